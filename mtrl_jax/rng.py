"""The random streams of a run: one root per seed, one named stream per use.

Every random draw of a run comes from ``key(seed, name)`` (JAX) or ``numpy_seed(seed, name)`` (numpy),
the root ``PRNGKey(seed)`` folded with the name's fixed code, so that no two uses share a stream (the
parameters' initialisation and the update's mini-batch order used to be the same key) and adding a
stream moves none of the others. The names are the ones below; any other is an error.
"""

from __future__ import annotations

import zlib

import jax

STREAMS = {
    # JAX keys
    "params": "the initial parameters of a policy built from its config (the tiny default)",
    "train": "TrainState.rng: the update's mini-batch order",
    "rollout": "each RL step's episodes (folded with the step, then the episode)",
    "refill": "dynamic sampling's extra episodes (folded with the step, the round, the process)",
    "eval": "the trainer's evaluations of the held-out tasks",
    "evaluate": "the evaluation job's episodes (experiments.evaluate)",
    "adapters": "LoRA adapters' initial A matrices",
    # numpy generators
    "schedule": "the shuffle of the training tasks, per epoch",
    "mixture": "the weighted mixture of the datasets' training tasks",
    "refill_tasks": "the training tasks dynamic sampling draws its extra groups for",
    "demonstrations": "the scripted teacher's choices, question rewrites and hop drills of the warm-up",
    "warmup_batches": "the warm-up's batches of demonstrations",
}


def _code(name: str) -> int:
    if name not in STREAMS:
        raise ValueError(f"unknown random stream {name!r}; the streams are {sorted(STREAMS)}")
    return zlib.crc32(name.encode()) & 0x7FFFFFFF


def key(seed: int, name: str) -> jax.Array:
    """The JAX key of stream ``name`` of the run seeded ``seed``."""
    return jax.random.fold_in(jax.random.PRNGKey(seed), _code(name))


def numpy_seed(seed: int, name: str, *more: int) -> list[int]:
    """The entropy of stream ``name`` (and of ``more`` integers below it, e.g. an epoch) for
    ``numpy.random.default_rng``."""
    return [int(seed), _code(name), *(int(x) for x in more)]
