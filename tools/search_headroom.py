"""What the agent's own moves can reach, with no model: nDCG@10 of fixed tool-only strategies built from
the moves the cold start's teacher demonstrates, on the training and the dev queries of a config's
collections. Where no strategy beats one BM25 search, RL over a cold start that already searches BM25 has
nothing better to find (issue 48, docs/real_models.md).

    python -m tools.search_headroom --config=configs/real_cpu.py [--json OUT]

Each strategy is what an episode's final ranking would be (``env.answer_fallback="fusion"``: the
reciprocal-rank fusion of the searches' shown results; an answer of ids: the ids shown, in order):

- ``bm25``, ``dense``: one search with the question, 10 results (the one-search baselines);
- ``bm25+dense``: both searches with the question, the empty answer;
- ``bm25+keywords``: BM25 with the question, then with its content words, the empty answer;
- ``bm25+title<i>``: BM25 with the question, then with the title of its i-th result (the teacher's
  hop), the empty answer; ``bm25+title<i> ids``: the first search's 5 results then the hop's, as ids;
- ``best per query``: the best of the strategies above for each query, an upper bound that only a policy
  knowing each query's judgments could reach.

Training queries are the config's training split (each once), dev ones its dev split; the test split is never
read here (only `experiments.evaluate --split=test` reads it).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys
from typing import Callable

import numpy as np

from experiments.sweep import load_config
from mtrl_jax.search.build import make_retriever
from mtrl_jax.search.metrics import ndcg_at_k
from mtrl_jax.search.retrievers import reciprocal_rank_fusion
from mtrl_jax.setup import build_data, search_settings
from mtrl_jax.search.results import question_keywords

TOP_K = 10
BEST = "best per query"


def fused(*rankings) -> list[str]:
    return [d for d, _ in reciprocal_rank_fusion(rankings)][:TOP_K]


def strategies(query: str, bm25: Callable, dense: Callable, title: dict) -> dict[str, list[str]]:
    """``{strategy: final ranking}`` for one question; ``bm25(q)`` / ``dense(q)``: the top 10 ids."""
    first = bm25(query)
    out = {"bm25": first, "dense": dense(query)}
    out["bm25+dense"] = fused(first, out["dense"])
    keywords = question_keywords(query)
    out["bm25+keywords"] = fused(first, bm25(keywords[0])) if keywords else first
    for i in (1, 2):
        hop = bm25(title[first[i - 1]]) if len(first) >= i and title.get(first[i - 1]) else []
        out[f"bm25+title{i}"] = fused(first, hop) if hop else first
        out[f"bm25+title{i} ids"] = list(dict.fromkeys(first[:5] + hop))[:TOP_K] if hop else first
    return out


def headroom(config) -> dict:
    """``{split: {collection: {"queries": n, strategy: mean nDCG@10}}}`` over the judged queries."""
    collections, train, dev = build_data(config)
    settings = search_settings(config)
    out: dict = {"train": {}, "dev": {}}
    for name, collection in collections.items():
        searchers = [make_retriever(kind, collection, settings) for kind in ("bm25", "dense")]
        bm25, dense = ((lambda q, r=r: [d for d, _ in r.search(q, TOP_K)]) for r in searchers)
        title = {d.doc_id: d.title for d in collection.documents}
        for split, tasks in (("train", train), ("dev", dev)):
            unique = {t.task_id: t for t in tasks if t.corpus == name and t.qrels}
            scores: dict[str, list[float]] = {}
            for task in unique.values():
                rankings = strategies(task.query, bm25, dense, title)
                ranked = {s: ndcg_at_k(r, task.qrels, 10) for s, r in rankings.items()}
                ranked[BEST] = max(ranked.values())
                for s, v in ranked.items():
                    scores.setdefault(s, []).append(v)
            out[split][name] = {"queries": len(unique), **{s: float(np.mean(v)) for s, v in scores.items()}}
    return out


def table(results: dict) -> str:
    names = [k for k in next(iter(next(iter(results.values())).values())) if k != "queries"]
    lines = ["| split | collection (queries) | " + " | ".join(names) + " |", "|---" * (len(names) + 2) + "|"]
    for split, by_collection in results.items():
        for name, m in by_collection.items():
            cells = " | ".join(f"{m[s]:.3f}" for s in names)
            lines.append(f"| {split} | {name} ({m['queries']}) | {cells} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/real_cpu.py")
    parser.add_argument("--json", default=None, help="write the results here")
    args, overrides = parser.parse_known_args(argv)
    results = headroom(load_config(args.config, overrides))
    print(table(results))
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
