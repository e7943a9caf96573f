"""Single-tool retrieval evaluation (the baselines an agent has to beat)."""

from __future__ import annotations

import collections
from typing import Callable, Optional, Sequence

import numpy as np

from mtrl_jax.data.collection import Collection
from mtrl_jax.search.build import SearchSettings, make_retriever
from mtrl_jax.search.metrics import ndcg_at_k, recall_at_k


def evaluate_retrieval(
    collection: Collection,
    tools: Sequence[str] = ("bm25", "dense", "fusion"),
    settings: SearchSettings = SearchSettings(),
    depth: int = 100,
    group_of: Optional[Callable] = None,
) -> dict:
    """``{tool: {"ndcg@10", "recall@100", "queries", "rankings", "ndcg@10_by_task", "by_type"?: {...}}}``
    (``rankings`` and ``ndcg@10_by_task`` keyed by task id); with ``group_of(task)``
    the metrics are also broken down by group (e.g. the synthetic query type)."""
    results = {}
    retrievers = {}
    for tool in tools:
        if tool == "fusion" and {"bm25", "dense"} <= set(retrievers):
            from mtrl_jax.search.retrievers import FusionRetriever

            retrievers[tool] = FusionRetriever([retrievers["bm25"], retrievers["dense"]], depth=depth)
        else:
            retrievers[tool] = make_retriever(tool, collection, settings)
    for tool, retriever in retrievers.items():
        queries = [t.query for t in collection.tasks]
        if hasattr(retriever, "search_batch"):
            rankings = retriever.search_batch(queries, depth)
        else:
            rankings = [retriever.search(q, depth) for q in queries]
        per_group = collections.defaultdict(lambda: ([], []))
        ndcgs, recalls = [], []
        for task, ranking in zip(collection.tasks, rankings):
            ids = [d for d, _ in ranking]
            n, r = ndcg_at_k(ids, task.qrels, 10), recall_at_k(ids, task.qrels, 100)
            ndcgs.append(n)
            recalls.append(r)
            if group_of:
                per_group[group_of(task)][0].append(n)
                per_group[group_of(task)][1].append(r)
        results[tool] = {"ndcg@10": float(np.mean(ndcgs)), "recall@100": float(np.mean(recalls)), "queries": len(ndcgs)}
        if group_of:
            results[tool]["by_type"] = {
                g: {"ndcg@10": float(np.mean(n)), "recall@100": float(np.mean(r)), "queries": len(n)}
                for g, (n, r) in sorted(per_group.items())
            }
        results[tool]["rankings"] = {t.task_id: ranking for t, ranking in zip(collection.tasks, rankings)}
        results[tool]["ndcg@10_by_task"] = {t.task_id: n for t, n in zip(collection.tasks, ndcgs)}
    return results
