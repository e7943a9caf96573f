"""Collections in the BEIR layout and the JSONL task format, loaded with line-level validation.

BEIR folder: ``corpus.jsonl`` (``{"_id", "title", "text"}``), ``queries.jsonl`` (``{"_id", "text"}``),
``qrels.tsv`` (header, then ``query-id<TAB>corpus-id<TAB>score``).

Task JSONL (one task per line)::

    {"task_id": "scifact/1", "query": "...", "qrels": {"doc-id": 2, ...}, "corpus": "scifact", "type": "hard"}

Every task carries a *type*, the key of the per-type metrics: its dataset's name, plus
``/<query type>`` where one is known: the optional ``type`` field of a task JSONL line or of a BEIR
``queries.jsonl`` line, MuSiQue's hop count in its query ids (``2hop__...`` -> ``musique/2hop``), or
the synthetic collection's query kind (``synthetic/lookup``).

Every bad line is reported as ``file:line: reason``; nothing is dropped silently.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import re
from typing import Iterable, Iterator, Optional


class DataError(ValueError):
    """A malformed input file; the message starts with ``file:line:``."""


@dataclasses.dataclass(frozen=True)
class Document:
    doc_id: str
    title: str
    text: str


@dataclasses.dataclass(frozen=True)
class Task:
    task_id: str
    query: str
    qrels: dict  # doc id -> int grade
    corpus: str
    type: str = ""  # "<dataset>" or "<dataset>/<query type>"; "" -> the dataset's name

    def __post_init__(self):
        if not self.type:
            object.__setattr__(self, "type", self.corpus)

    def to_json(self) -> str:
        record = {"task_id": self.task_id, "query": self.query, "qrels": self.qrels, "corpus": self.corpus}
        if self.type != self.corpus:
            record["type"] = self.type.removeprefix(f"{self.corpus}/")
        return json.dumps(record)


def task_type(dataset: str, query_type: Optional[str]) -> str:
    """``"musique", "2hop"`` -> ``"musique/2hop"``; no query type -> the dataset's name."""
    return f"{dataset}/{query_type}" if query_type else dataset


_HOPS_ID = re.compile(r"^(\d+hop)\d*__")  # MuSiQue query ids: "2hop__...", "3hop1__...", "4hop2__..."


def query_type_of(obj: dict, qid: str, where: str) -> Optional[str]:
    """A BEIR query's type: its ``type`` field, else the hop count of a MuSiQue-style id, else none."""
    if "type" in obj:
        value = _field(obj, "type", str, where)
        if not value.strip() or "/" in value:
            raise DataError(f"{where}: 'type' must be a non-empty name without '/', got {value!r}")
        return value
    match = _HOPS_ID.match(qid)
    return match.group(1) if match else None


@dataclasses.dataclass
class Collection:
    name: str
    documents: list[Document]
    tasks: list[Task]

    def __post_init__(self):
        self.index = {d.doc_id: i for i, d in enumerate(self.documents)}

    def fingerprint(self) -> str:
        """Content hash of the documents (keys the on-disk embedding cache)."""
        h = hashlib.sha256()
        for d in self.documents:
            h.update(json.dumps([d.doc_id, d.title, d.text]).encode())
        return h.hexdigest()[:16]


def _lines(path: pathlib.Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of a UTF-8 file; a byte that is not UTF-8 is an error naming its line."""
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            try:
                yield line_no, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}:{line_no}: not UTF-8 (byte {raw[e.start]:#04x} at column {e.start + 1})"
                ) from None


def _jsonl(path: pathlib.Path) -> Iterator[tuple[int, dict]]:
    for line_no, line in _lines(path):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: invalid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:
            raise DataError(f"{path}:{line_no}: invalid JSON ({type(e).__name__})") from None
        if not isinstance(obj, dict):
            raise DataError(f"{path}:{line_no}: expected a JSON object")
        if "\\u" in line:  # an escape can spell a lone surrogate (valid JSON, but no text): no tokenizer can take it
            try:
                json.dumps(obj, ensure_ascii=False).encode("utf-8")
            except UnicodeEncodeError as e:
                raise DataError(
                    f"{path}:{line_no}: a lone surrogate ({e.object[e.start : e.end]!r}) is not text"
                ) from None
        yield line_no, obj


def _field(obj: dict, key: str, kind, where: str):
    if key not in obj:
        raise DataError(f"{where}: missing field {key!r}")
    value = obj[key]
    if not isinstance(value, kind):
        raise DataError(f"{where}: field {key!r} must be {getattr(kind, '__name__', kind)}, got {type(value).__name__}")
    return value


def load_corpus(path: os.PathLike) -> list[Document]:
    path = pathlib.Path(path)
    docs, seen = [], {}
    for line_no, obj in _jsonl(path):
        where = f"{path}:{line_no}"
        doc_id = str(_field(obj, "_id", (str, int), where))
        if doc_id in seen:
            raise DataError(f"{where}: duplicate document id {doc_id!r} (first at line {seen[doc_id]})")
        seen[doc_id] = line_no
        docs.append(Document(doc_id, str(obj.get("title") or ""), _field(obj, "text", str, where)))
    if not docs:
        raise DataError(f"{path}: no documents")
    return docs


def load_qrels(path: os.PathLike, doc_ids: Optional[set] = None) -> dict[str, dict[str, int]]:
    path = pathlib.Path(path)
    qrels: dict[str, dict[str, int]] = {}
    for line_no, line in _lines(path):
        parts = line.rstrip("\r\n").split("\t")
        if line_no == 1 and parts[0] == "query-id":
            continue
        if not line.strip():
            continue
        where = f"{path}:{line_no}"
        if len(parts) != 3:
            raise DataError(f"{where}: expected 3 tab-separated fields, got {len(parts)}")
        qid, did, grade = parts
        try:
            grade = int(grade)
        except ValueError:
            raise DataError(f"{where}: score {grade!r} is not an integer") from None
        if grade < 0:
            raise DataError(f"{where}: negative score {grade}")
        if doc_ids is not None and did not in doc_ids:
            raise DataError(f"{where}: document {did!r} is not in the corpus")
        if did in qrels.setdefault(qid, {}):
            raise DataError(f"{where}: duplicate judgment for ({qid!r}, {did!r})")
        qrels[qid][did] = grade
    return qrels


def load_beir(folder: os.PathLike, name: Optional[str] = None) -> Collection:
    """A BEIR folder as a ``Collection``. Queries with no positive judgment (IDCG = 0) are
    excluded from the tasks, as docs/algorithms.md requires; queries without judgments too."""
    folder = pathlib.Path(folder)
    name = name or folder.name
    for required in ("corpus.jsonl", "queries.jsonl", "qrels.tsv"):
        if not (folder / required).exists():
            raise FileNotFoundError(f"{folder / required}: not found (expected a BEIR-layout folder)")
    docs = load_corpus(folder / "corpus.jsonl")
    qrels = load_qrels(folder / "qrels.tsv", {d.doc_id for d in docs})
    tasks, seen = [], {}
    for line_no, obj in _jsonl(folder / "queries.jsonl"):
        where = f"{folder / 'queries.jsonl'}:{line_no}"
        qid = str(_field(obj, "_id", (str, int), where))
        if qid in seen:
            raise DataError(f"{where}: duplicate query id {qid!r} (first at line {seen[qid]})")
        seen[qid] = line_no
        text = _field(obj, "text", str, where)
        judged = qrels.get(qid, {})
        if any(g > 0 for g in judged.values()):
            if not text.strip():
                raise DataError(f"{where}: empty query text")
            tasks.append(
                Task(f"{name}/{qid}", text, dict(judged), name, task_type(name, query_type_of(obj, qid, where)))
            )
    if not seen:
        raise DataError(f"{folder / 'queries.jsonl'}: no queries")
    if not tasks:
        raise DataError(
            f"{folder / 'queries.jsonl'}: none of its {len(seen)} queries has a judgment with grade > 0 "
            f"in {folder / 'qrels.tsv'}"
        )
    return Collection(name, docs, tasks)


def load_tasks(path: os.PathLike) -> list[Task]:
    """Tasks from the task JSONL format, validated line by line."""
    path = pathlib.Path(path)
    tasks, seen = [], {}
    for line_no, obj in _jsonl(path):
        where = f"{path}:{line_no}"
        task_id = _field(obj, "task_id", str, where)
        if task_id in seen:
            raise DataError(f"{where}: duplicate task_id {task_id!r} (first at line {seen[task_id]})")
        seen[task_id] = line_no
        query = _field(obj, "query", str, where)
        if not query.strip():
            raise DataError(f"{where}: empty query")
        qrels = _field(obj, "qrels", dict, where)
        for doc, grade in qrels.items():
            if not isinstance(grade, int) or isinstance(grade, bool) or grade < 0:
                raise DataError(f"{where}: qrels[{doc!r}] must be a non-negative integer, got {grade!r}")
        if not any(g > 0 for g in qrels.values()):
            raise DataError(f"{where}: no judgment with grade > 0 (nDCG undefined)")
        corpus = _field(obj, "corpus", str, where)
        tasks.append(Task(task_id, query, qrels, corpus, task_type(corpus, query_type_of(obj, "", where))))
    if not tasks:
        raise DataError(f"{path}: no tasks")
    return tasks


def write_tasks(tasks: Iterable[Task], path: os.PathLike) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for t in tasks:
            f.write(t.to_json() + "\n")


SPLITS = ("train", "dev", "test")


@dataclasses.dataclass(frozen=True)
class SplitSizes:
    """How many of a collection's tasks go to dev and to test (``data.dev_*`` / ``data.test_*``).

    The tasks are ranked by a hash of their id (``split_rank``): dev takes the first
    ``max(round(dev_fraction * n), dev_min)`` (all but one, at most; at least one with two or more tasks),
    test the next ``max(round(test_fraction * n), test_min)``, at most half of what dev leaves (so that
    training keeps the other half), and train the rest. Dev is exactly the "held-out" split of earlier
    versions (the same hash, the same first tasks), so no figure published before the test split existed
    was measured on test."""

    dev_fraction: float = 0.05
    dev_min: int = 0
    test_fraction: float = 0.05
    test_min: int = 0

    def counts(self, n: int) -> tuple[int, int]:
        n_dev = max(1 if n > 1 else 0, round(self.dev_fraction * n), min(self.dev_min, n - 1))
        n_dev = min(n_dev, max(n - 1, 0))
        n_test = min(max(round(self.test_fraction * n), self.test_min), (n - n_dev) // 2)
        return n_dev, n_test


def split_rank(tasks: list[Task], salt: str = "mtrl-jax") -> list[Task]:
    """``tasks`` ordered by a hash of ``task_id``: the order the splits are cut from, independent of the
    file's line order (and of the other tasks: adding one moves none of the others)."""

    def bucket(t):
        return int(hashlib.sha256(f"{salt}:{t.task_id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF

    return sorted(tasks, key=lambda t: (bucket(t), t.task_id))


def _split_ids(tasks: list[Task], sizes: SplitSizes) -> tuple[set, set]:
    ranked = split_rank(tasks)
    n_dev, n_test = sizes.counts(len(tasks))
    return {t.task_id for t in ranked[:n_dev]}, {t.task_id for t in ranked[n_dev : n_dev + n_test]}


def split(tasks: list[Task], sizes: SplitSizes = SplitSizes()) -> tuple[list[Task], list[Task]]:
    """``(train, dev)`` of a collection's tasks, each in the tasks' own order (``SplitSizes`` says how they
    are cut). The test split is not returned: only ``test_split`` gives it, and only the test evaluation
    (``mtrl_jax.evaluate``, ``experiments.evaluate --split=test``) calls that."""
    dev_ids, test_ids = _split_ids(tasks, sizes)
    train = [t for t in tasks if t.task_id not in dev_ids and t.task_id not in test_ids]
    return train, [t for t in tasks if t.task_id in dev_ids]


def test_split(tasks: list[Task], sizes: SplitSizes) -> list[Task]:
    """The test tasks of a collection, in their own order. Read once per final config, through the test
    ledger (``mtrl_jax.evaluate.evaluate_test``); ``tests/test_splits.py`` holds that nothing else calls it."""
    _, test_ids = _split_ids(tasks, sizes)
    return [t for t in tasks if t.task_id in test_ids]


test_split.__test__ = False  # not a pytest test, whatever its name


def mixture(datasets: dict[str, list[Task]], weights: dict[str, float], num_tasks: int, seed=0) -> list[Task]:
    """A weighted mixture: ``num_tasks`` tasks drawn so each dataset's share follows ``weights``
    (largest-remainder rounding; within a dataset, tasks cycle in a seeded shuffle)."""
    import numpy as np

    unknown = set(weights) - set(datasets)
    if unknown:
        raise ValueError(f"mixture weights name unknown datasets: {sorted(unknown)}")
    total = sum(weights.values())
    if total <= 0 or any(w < 0 for w in weights.values()):
        raise ValueError(f"mixture weights must be non-negative with a positive sum, got {weights}")
    names = sorted(weights)
    exact = np.array([weights[n] / total * num_tasks for n in names])
    counts = np.floor(exact).astype(int)
    for i in np.argsort(-(exact - counts))[: num_tasks - counts.sum()]:
        counts[i] += 1
    rng = np.random.default_rng(seed)
    out = []
    for name, count in zip(names, counts):
        pool = datasets[name]
        if count and not pool:
            raise ValueError(f"mixture: dataset {name!r} has no tasks")
        order = rng.permutation(len(pool)) if pool else []
        out += [pool[order[i % len(pool)]] for i in range(count)]
    return [out[i] for i in rng.permutation(len(out))]


def write_beir(collection: Collection, folder: os.PathLike) -> None:
    """Write ``collection`` in the BEIR layout (its tasks become queries and qrels)."""
    folder = pathlib.Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "corpus.jsonl", "w", encoding="utf-8") as f:
        for d in collection.documents:
            f.write(json.dumps({"_id": d.doc_id, "title": d.title, "text": d.text}) + "\n")
    with open(folder / "queries.jsonl", "w", encoding="utf-8") as f:
        for t in collection.tasks:
            f.write(json.dumps({"_id": t.task_id.split("/", 1)[-1], "text": t.query}) + "\n")
    with open(folder / "qrels.tsv", "w", encoding="utf-8") as f:
        f.write("query-id\tcorpus-id\tscore\n")
        for t in collection.tasks:
            for doc, grade in t.qrels.items():
                f.write(f"{t.task_id.split('/', 1)[-1]}\t{doc}\t{grade}\n")
