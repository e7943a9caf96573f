"""Programs by length: an update batch padded to one length is computed, micro-batch by micro-batch, at the
smallest of a few lengths that holds its rows (``length_buckets``, ``switch_on_length``), with the rows grouped
by length (``by_length``), so the padding costs nothing."""

from __future__ import annotations

import functools
import math
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np


MAX_LENGTH_BRANCHES = 16


def length_buckets(
    T: int, granularity: int, max_branches: int = MAX_LENGTH_BRANCHES, shortest: int = 0
) -> tuple[int, ...]:
    """The static lengths a micro-batch of a ``[., T]`` batch can be cut to: multiples of
    ``granularity`` up to ``T`` (the last is ``T``), or, when there would be more than
    ``max_branches``, ``max_branches`` of them spread geometrically up to ``T``. With ``shortest``
    (no row holds fewer tokens: the shortest prompt) they start at the first multiple that holds it:
    a micro-batch's longest row never picks a shorter one, whose branch would be compiled for nothing
    (on the default, 1 of 11 branches)."""
    n = -(-T // granularity)
    first = min(max(1, -(-shortest // granularity)), n)  # the first multiple (1-based) that holds `shortest`
    if n - first + 1 <= max_branches:
        return tuple(min(T, granularity * i) for i in range(first, n + 1))
    steps = np.geomspace(first, n, max_branches)
    return tuple(sorted({min(T, granularity * int(math.ceil(x - 1e-9))) for x in steps} | {T}))


def switch_on_length(buckets: tuple[int, ...], attention_mask: jax.Array, fn, *args):
    """``fn(length, *args)`` for the smallest of ``buckets`` that holds every row of ``attention_mask
    [rows, T]``: one program with a branch per length (``lax.switch``), of which only the one taken
    runs, so a micro-batch of short rows costs what its rows hold, not the batch's longest row."""
    longest = attention_mask.astype(jnp.int32).sum(axis=1).max()
    index = jnp.minimum(jnp.searchsorted(jnp.asarray(buckets, jnp.int32), longest), len(buckets) - 1)
    return jax.lax.switch(index, [functools.partial(fn, length) for length in buckets], *args)


def by_length(attention_mask: jax.Array, rows: jax.Array, group: int, first: Optional[jax.Array] = None) -> jax.Array:
    """``rows`` sorted by length, longest first, as ``[len(rows) // group, group]`` groups: the
    micro-batches of a mini-batch (the order within a mini-batch does not change its gradient). With
    ``first [B]`` (booleans over the batch's rows), its rows come before the others (each part longest
    first), so the other rows fill micro-batches of their own."""
    lengths = attention_mask[rows].astype(jnp.int32).sum(axis=1)
    if first is not None:
        lengths = lengths + first[rows].astype(jnp.int32) * (attention_mask.shape[1] + 1)
    return rows[jnp.argsort(-lengths, stable=True)].reshape(-1, group)
