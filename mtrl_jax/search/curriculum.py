"""A curriculum of hard queries (``data.curriculum_max_baseline``): the training tasks on which the best one search
(BM25, dense, or their fusion) falls below a threshold, where a policy has something to find that a fixed move
does not. The dev and test splits are never filtered: figures stay comparable with and without it. The same
scores are the reward baseline of ``rl.reward_baseline="one_search"`` (``one_search_scores``)."""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from mtrl_jax.data.collection import Collection
from mtrl_jax.search.baselines import evaluate_retrieval
from mtrl_jax.search.build import SearchSettings

BASELINES = ("bm25", "dense", "fusion")


def best_one_search(collection: Collection, tasks: Sequence, settings: SearchSettings) -> dict[str, float]:
    """``{task_id: the best nDCG@10 of one search}`` over ``BASELINES``, for ``tasks`` of ``collection``."""
    scored = evaluate_retrieval(dataclasses.replace(collection, tasks=list(tasks)), BASELINES, settings)
    return {t.task_id: max(scored[tool]["ndcg@10_by_task"][t.task_id] for tool in BASELINES) for t in tasks}


def one_search_scores(collections: Mapping[str, Collection], tasks: Sequence, settings: SearchSettings) -> dict:
    """``{task_id: the best nDCG@10 of one search}`` for ``tasks`` of any of ``collections``."""
    best: dict[str, float] = {}
    for name, collection in collections.items():
        own = [t for t in tasks if t.corpus == name]
        if own:
            best.update(best_one_search(collection, own, settings))
    return best


def hard_tasks(
    collections: Mapping[str, Collection], tasks: Sequence, settings: SearchSettings, threshold: float
) -> tuple[list, dict]:
    """The ``tasks`` (training tasks of ``collections``, in their order) whose best one search scores below
    ``threshold``, and per collection ``{"kept", "of"}``; an empty result is an error naming the field."""
    best = one_search_scores(collections, tasks, settings)
    kept = [t for t in tasks if best[t.task_id] < threshold]
    counts = {
        name: {"kept": sum(t.corpus == name for t in kept), "of": sum(t.corpus == name for t in tasks)}
        for name in collections
    }
    if not kept:
        raise ValueError(
            f"data.curriculum_max_baseline={threshold}: one search reaches it on every training query ({counts})"
        )
    return kept, counts
