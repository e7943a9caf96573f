"""IR metrics with trec_eval conventions, and a TREC run-file writer.

* gains are linear (the grade itself); ideal DCG uses all judged grades > 0;
* a document repeated in a ranking counts once, at its first rank;
* unjudged documents have grade 0.
"""

from __future__ import annotations

import math
from typing import Iterable, Mapping, Sequence, TextIO


def dedupe(ranking: Sequence[str]) -> list[str]:
    seen: set[str] = set()
    return [d for d in ranking if not (d in seen or seen.add(d))]


def dcg(grades: Iterable[float]) -> float:
    return sum(g / math.log2(i + 2) for i, g in enumerate(grades))


def ideal_dcg(qrels: Mapping[str, int], k: int = 10) -> float:
    return dcg(sorted((g for g in qrels.values() if g > 0), reverse=True)[:k])


def ndcg_at_k(ranking: Sequence[str], qrels: Mapping[str, int], k: int = 10) -> float:
    """nDCG@k of ``ranking`` (doc ids, best first) against graded ``qrels``; 0 if IDCG is 0."""
    idcg = ideal_dcg(qrels, k)
    if idcg == 0:
        return 0.0
    return dcg(max(qrels.get(d, 0), 0) for d in dedupe(ranking)[:k]) / idcg


def best_ndcg_at_k(docs: Iterable[str], qrels: Mapping[str, int], k: int = 10) -> float:
    """nDCG@k of the best ranking of ``docs`` (each once, by grade): how good an answer built from them can be."""
    idcg = ideal_dcg(qrels, k)
    if idcg == 0:
        return 0.0
    return dcg(sorted((max(qrels.get(d, 0), 0) for d in set(docs)), reverse=True)[:k]) / idcg


def recall_at_k(ranking: Sequence[str], qrels: Mapping[str, int], k: int = 100) -> float:
    relevant = {d for d, g in qrels.items() if g > 0}
    if not relevant:
        return 0.0
    return len(relevant.intersection(dedupe(ranking)[:k])) / len(relevant)


def mrr(ranking: Sequence[str], qrels: Mapping[str, int], k: int | None = None) -> float:
    for i, d in enumerate(dedupe(ranking)[:k]):
        if qrels.get(d, 0) > 0:
            return 1.0 / (i + 1)
    return 0.0


def write_trec_run(
    out: TextIO, runs: Mapping[str, Sequence[tuple[str, float]] | Sequence[str]], tag: str = "mtrl_jax"
) -> None:
    """Write ``query_id Q0 doc_id rank score tag`` lines. A ranking without scores gets ``-rank``."""
    for qid, ranking in runs.items():
        for rank, item in enumerate(dedupe_scored(ranking), start=1):
            doc, score = item
            out.write(f"{qid} Q0 {doc} {rank} {score:.6f} {tag}\n")


def dedupe_scored(ranking):
    pairs = [(r, -float(i + 1)) if isinstance(r, str) else (r[0], float(r[1])) for i, r in enumerate(ranking)]
    seen: set[str] = set()
    return [p for p in pairs if not (p[0] in seen or seen.add(p[0]))]
