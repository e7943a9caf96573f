"""The synthetic collection behind the embedded default, generated deterministically from a seed.

Documents describe engineering *parts* (each with an identifier such as ``KX-4821``) and the
*projects* that use them. Parts mostly use the canonical word of each synonym set and sometimes
(``synonym_rate``) another one in the same context, so a co-occurrence model (the TF-IDF + SVD
encoder, 32 dimensions) learns which words mean the same thing. Three query types, graded qrels:

* ``lookup``: an identifier (``"KX-4821 datasheet"``). Exact-term search (BM25) wins: an SVD
  embedding blurs rare identifiers.
* ``describe``: a paraphrase of a part's properties in synonyms the target documents mostly do not
  use (``"stainless tap for naval use"``). Vector search wins; BM25 only finds the few documents
  that happen to use the same synonyms.
  Grade 2 for parts matching all three attributes, 1 for two of them (same domain and component).
* ``multihop``: ``"component of project Falcon-12"``. The project document (grade 1) names the
  part's identifier at the start of its text (so a result snippet shows it); a second, identifier
  search finds the part (grade 2).

Identifiers are quoted wherever a document shows them (``Part "KX-4821" is ...``, ``Key component:
part "KX-4821".``), so that they are tokenised as in a tool call's JSON query string: a copy out of
search results is then token for token (``chat.train_tokenizer`` also splits capital letters).
"""

from __future__ import annotations

import numpy as np

from mtrl_jax.data.collection import Collection, Document, Task

DOMAINS = [
    (["marine", "naval", "seafaring"], ["hull", "ballast", "harbor", "deck", "tide"]),
    (["aerospace", "aviation", "airborne"], ["wing", "cockpit", "altitude", "runway", "thrust"]),
    (["medical", "clinical", "surgical"], ["patient", "ward", "sterile", "dose", "scan"]),
    (["automotive", "vehicular", "motorcar"], ["chassis", "axle", "gearbox", "brake", "fuel"]),
    (["agricultural", "farming", "crop"], ["soil", "harvest", "tractor", "irrigation", "seed"]),
    (["railway", "train", "locomotive"], ["track", "carriage", "signal", "platform", "rail"]),
    (["mining", "quarry", "excavation"], ["ore", "shaft", "drill", "tunnel", "rock"]),
    (["nuclear", "reactor", "atomic"], ["core", "coolant", "rod", "shielding", "isotope"]),
]
COMPONENTS = [
    ["valve", "tap", "stopcock"],
    ["pump", "impeller", "compressor"],
    ["sensor", "detector", "probe"],
    ["bearing", "bushing", "journal"],
    ["gasket", "seal", "washer"],
    ["actuator", "servo", "motor"],
    ["filter", "strainer", "sieve"],
    ["cable", "wire", "harness"],
    ["nozzle", "jet", "spout"],
    ["bracket", "mount", "clamp"],
]
PROPERTIES = [
    ["rustproof", "stainless", "anticorrosive"],
    ["lightweight", "featherweight", "ultralight"],
    ["heatproof", "fireproof", "thermoresistant"],
    ["waterproof", "watertight", "submersible"],
    ["lowcost", "budget", "inexpensive"],
    ["silent", "quiet", "noiseless"],
    ["miniature", "compact", "tiny"],
    ["heavyduty", "rugged", "industrial"],
]
SYNTHETIC_TFIDF_DIM = 32  # the vector tool's dimensions on this collection

LABS = ["Ames", "Brno", "Cork", "Delft", "Essen", "Faro", "Genoa", "Hilo", "Izmir", "Jena"]
PROJECTS = ["Falcon", "Heron", "Orca", "Lynx", "Bison", "Cobra", "Ibis", "Puma", "Raven", "Tapir", "Viper", "Wren"]


def _ident(rng, used: set) -> str:
    while True:
        letters = "".join(rng.choice(list("BCDFGHJKLMNPQRSTVWXZ"), size=2))
        ident = f"{letters}-{rng.integers(1000, 10000)}"
        if ident not in used:
            used.add(ident)
            return ident


def _parts(rng, n: int, synonym_rate: float, num_domains: int, num_components: int, num_properties: int):
    """``n`` part datasheets: ``(documents, parts)``, each part ``(doc_id, ident, domain, component, property)``."""
    used: set = set()
    docs, parts = [], []
    for _ in range(n):
        d, c, p = rng.integers(num_domains), rng.integers(num_components), rng.integers(num_properties)
        ident = _ident(rng, used)
        names, context = DOMAINS[d]
        # parts mostly use the canonical (first) word of each synonym set; the occasional other word,
        # in the same contexts, is what a co-occurrence encoder learns synonymy from
        syn = lambda words: words[0] if rng.random() >= synonym_rate else words[1 + rng.integers(len(words) - 1)]  # noqa: E731
        comp, prop, domain = syn(COMPONENTS[c]), syn(PROPERTIES[p]), syn(names)
        ctx = rng.choice(context, size=3, replace=False)
        text = (
            f"Part \"{ident}\" is a {prop} {comp} for {domain} equipment. It is fitted near the {ctx[0]} and "
            f"the {ctx[1]}, "
            f"and is tested for {ctx[2]} conditions at the {LABS[rng.integers(len(LABS))]} lab."
        )
        doc_id = f"d{len(docs):04d}"
        docs.append(Document(doc_id, f"\"{ident}\" {comp}", text))
        parts.append((doc_id, ident, int(d), int(c), int(p)))
    return docs, parts


def _projects(rng, n: int, parts, first_doc: int):
    """``n`` project pages, each naming one part: ``(documents, projects)``, each ``(doc_id, name, part index)``."""
    docs, projects, project_names = [], [], set()
    for _ in range(n):
        while True:
            pname = f"{PROJECTS[rng.integers(len(PROJECTS))]}-{rng.integers(10, 100)}"
            if pname not in project_names:
                project_names.add(pname)
                break
        part = int(rng.integers(len(parts)))
        _, ident, d, _, _ = parts[part]
        # the part's identifier comes first, so that a search result's snippet shows it (the hop's lead)
        text = (
            f"Key component: part \"{ident}\". Project {pname} is a {DOMAINS[d][0][0]} programme, "
            f"delivered by the {LABS[rng.integers(len(LABS))]} team."
        )
        doc_id = f"d{first_doc + len(docs):04d}"
        docs.append(Document(doc_id, f"Project {pname}", text))
        projects.append((doc_id, pname, part))
    return docs, projects


def _tasks(rng, name: str, parts, projects, queries_per_type: int) -> list[Task]:
    """The three query types: a part by its identifier, parts by description, a project's component (two hops)."""
    mentions: dict[str, list[str]] = {}
    for doc_id, _, part in projects:
        mentions.setdefault(parts[part][1], []).append(doc_id)
    tasks: list[Task] = []
    for i, part in enumerate(rng.choice(len(parts), size=queries_per_type, replace=False)):
        doc_id, ident, *_ = parts[part]
        qrels = {doc_id: 2, **{m: 1 for m in mentions.get(ident, [])}}
        query = f"{ident} {['datasheet', 'details', 'specification'][i % 3]}"
        tasks.append(Task(f"{name}/lookup-{i}", query, qrels, name, f"{name}/lookup"))
    for i, part in enumerate(rng.choice(len(parts), size=queries_per_type, replace=False)):
        _, _, d, c, p = parts[part]
        qrels = {}
        for doc_id, _, d2, c2, p2 in parts:
            if d2 == d and c2 == c:
                qrels[doc_id] = 2 if p2 == p else 1
        query = (
            f"{PROPERTIES[p][1 + i % 2]} {COMPONENTS[c][1 + (i // 2) % 2]} for {DOMAINS[d][0][1 + (i // 4) % 2]} use"
        )
        tasks.append(Task(f"{name}/describe-{i}", query, qrels, name, f"{name}/describe"))
    for i, proj in enumerate(rng.choice(len(projects), size=min(queries_per_type, len(projects)), replace=False)):
        doc_id, pname, part = projects[proj]
        qrels = {doc_id: 1, parts[part][0]: 2}
        tasks.append(Task(f"{name}/multihop-{i}", f"component of project {pname}", qrels, name, f"{name}/multihop"))
    return tasks


def make_synthetic_collection(
    seed: int = 0,
    num_parts: int = 1200,
    num_projects: int = 400,
    queries_per_type: int = 300,
    synonym_rate: float = 0.3,
    num_domains: int = 6,
    num_components: int = 6,
    num_properties: int = 5,
    name: str = "synthetic",
) -> Collection:
    rng = np.random.default_rng(seed)
    part_docs, parts = _parts(rng, num_parts, synonym_rate, num_domains, num_components, num_properties)
    project_docs, projects = _projects(rng, num_projects, parts, len(part_docs))
    docs = part_docs + project_docs
    order = rng.permutation(len(docs))  # interleave the kinds of document; ids stay stable
    docs = [docs[i] for i in order]
    return Collection(name, docs, _tasks(rng, name, parts, projects, queries_per_type))
