"""A run's data from its config: the collections (``data.synthetic``, ``data.folders``), cut train / dev / test
(the test split is never loaded here: ``mtrl_jax.evaluate.evaluate_test`` alone reads it), and the training
mixture."""

from __future__ import annotations

import dataclasses

from mtrl_jax import rng
from mtrl_jax.data.collection import Collection, SplitSizes, load_beir, mixture, split
from mtrl_jax.data.synthetic import make_synthetic_collection


def csv(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_data(config) -> tuple[dict[str, Collection], list, list]:
    """Collections by name, train tasks (mixture) and dev tasks (``split_sizes``; the test split is never
    loaded here: ``mtrl_jax.evaluate.evaluate_test`` alone reads it). With ``data.max_train_per_collection`` /
    ``max_eval_per_collection``, the first that many of each collection's training / dev tasks (the split
    itself unchanged)."""
    collections = load_collections(config)
    train, dev = {}, []
    for name, c in collections.items():
        t, d = split(c.tasks, split_sizes(config))
        kept = {task.task_id for task in (*t, *d)}  # the collection as the run sees it: no test task
        collections[name] = dataclasses.replace(c, tasks=[task for task in c.tasks if task.task_id in kept])
        train[name] = t[: config.data.max_train_per_collection or None]
        dev += d[: config.data.max_eval_per_collection or None]
    weights = csv(config.data.weights)
    if weights:
        if len(weights) != len(collections):
            raise ValueError(
                f"data.weights has {len(weights)} entries for {len(collections)} collections {list(collections)}"
            )
        try:
            weight_map = dict(zip(collections, map(float, weights)))
        except ValueError:
            raise ValueError(f"data.weights: {config.data.weights!r} must be comma-separated numbers") from None
        total = sum(len(t) for t in train.values())
        train_tasks = mixture(train, weight_map, total, seed=rng.numpy_seed(config.seed, "mixture"))
    else:
        train_tasks = [t for name in collections for t in train[name]]
    if not train_tasks:
        raise ValueError(f"no training tasks in {list(collections)}")
    if config.data.max_eval_tasks:
        dev = dev[: config.data.max_eval_tasks]
    return collections, train_tasks, dev


def split_sizes(config) -> SplitSizes:
    d = config.data
    return SplitSizes(d.dev_fraction, d.dev_min, d.test_fraction, d.test_min)


def load_collections(config) -> dict[str, Collection]:
    """The config's collections by name (``data.synthetic``, ``data.folders``), every task of each."""
    collections = {}
    if config.data.synthetic:
        c = make_synthetic_collection(config.data.synthetic_seed)
        collections[c.name] = c
    for folder in csv(config.data.folders):
        c = load_beir(folder)
        if c.name in collections:
            raise ValueError(f"data.folders: two collections are named {c.name!r}")
        collections[c.name] = c
    if not collections:
        raise ValueError("no data: set data.synthetic=True or data.folders")
    return collections
