"""Which groups of an RL step train, and which of their rows get a gradient: the one home of that choice.

``GroupSelector.select(groups, step)`` takes a step's collected groups (``P x G`` trajectories each of
``G``) and returns ``Selection``: the groups the update trains on, the rows of those that get no
gradient, and the counts of what was left out and why. In order:

1. **Staleness.** A group with a sampled token more than ``max_staleness`` parameter versions older
   than the trainer's is dropped (``rollout.max_staleness``; the asynchronous rollouts' bound).
2. **Dynamic sampling** (DAPO's ``filter_groups``, ``rl.filter_groups``). A group whose rewards are all
   equal (and, with per-search credit, whose search turns' rewards are all equal too) has advantages of
   exactly 0: it adds no policy gradient, only tokens to the normaliser (and KL / entropy terms), so it is
   dropped; at most ``global_batch_size`` informative
   groups train. The collection refills such steps (``refill``: up to ``rl.filter_max_extra_groups``
   more groups, for training tasks drawn at random).
3. **Even split.** The jitted update splits a batch's rows into equal mini- and micro-batches, and a
   group is only meaningful whole; the longest prefix of groups whose row count is a multiple of
   ``mini_batches x micro_batches`` trains, the rest is left out (only after filtering: a full step
   always splits, the configuration is checked for it).
4. **Truncation** (``rl.truncation``). A failed episode (turn limit, per-turn token limit, context
   limit) keeps its reward -1 in its group's baseline either way; ``"penalty"`` (the default) trains on
   its tokens, ``"mask"`` gives them no gradient.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Callable, NamedTuple, Optional, Sequence

from mtrl_jax.rl.turn_credit import rewards_vary
from mtrl_jax.rollout.trajectory import Trajectory

TRUNCATION_MODES = ("penalty", "mask")


def all_equal(group: Sequence) -> bool:
    """Whether every trajectory of ``group`` has the same reward (its group-relative advantages are all 0)."""
    return len({t.reward for t in group}) <= 1


def informative(group: Sequence, turn_redundancy: Optional[float] = None) -> bool:
    """Whether ``group``'s rewards differ (its group-relative advantages are not all 0), or, with per-search
    credit (``turn_redundancy`` not None: ``rl.turn_redundancy``), its search turns' rewards do."""
    return not all_equal(group) or (turn_redundancy is not None and rewards_vary(group, turn_redundancy))


def filter_stale(groups: Sequence[Sequence[Trajectory]], trainer_version: int, max_staleness: int) -> tuple[list, list]:
    """Split groups into (fresh, stale): a group is stale when any of its sampled tokens is more
    than ``max_staleness`` parameter versions older than the trainer's."""
    fresh, stale = [], []
    for group in groups:
        versions = [t.min_version() for t in group if t.min_version() is not None]
        oldest = min(versions) if versions else trainer_version
        (stale if trainer_version - oldest > max_staleness else fresh).append(group)
    return fresh, stale


def split_informative(groups: Sequence[Sequence], turn_redundancy: Optional[float] = None) -> tuple[list, list]:
    """``(informative groups, the others)``, each in the given order (``informative``)."""
    keep, drop = [], []
    for group in groups:
        (keep if informative(group, turn_redundancy) else drop).append(group)
    return keep, drop


def trainable_groups(groups: Sequence, rows_divisor: int) -> tuple[list, list]:
    """``(kept, left_out)``: the longest prefix of whole groups whose row count is a multiple of
    ``rows_divisor`` (mini-batches x micro-batches)."""
    if not groups:
        return [], []
    size = len(groups[0])
    unit = math.lcm(size, rows_divisor) // size  # groups per evenly splittable block
    keep = len(groups) // unit * unit
    return list(groups[:keep]), list(groups[keep:])


def no_gradient_rows(trajectories: Sequence, truncation: str) -> list[int]:
    """Indices of the rows whose tokens get no gradient under ``rl.truncation``: with ``"mask"``, the
    failed episodes (any status other than ``"ok"``); with ``"penalty"``, none."""
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"rl.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    if truncation == "penalty":
        return []
    return [i for i, t in enumerate(trajectories) if t.status != "ok"]


def refill(
    groups: list,
    target: int,
    generate: Callable[[int, int], list],
    max_extra_groups: int,
    is_informative: Callable[[Sequence], bool] = informative,
) -> tuple[list, int]:
    """Generate further groups until ``groups`` holds ``target`` informative ones or ``max_extra_groups``
    extra groups have been generated: round ``r`` calls ``generate(n, r)`` for the ``n`` groups still
    missing (at most what the cap leaves) and appends what it returns. Returns ``(groups, extra groups
    generated)``."""
    extra, round_ = 0, 0
    while True:
        missing = target - sum(is_informative(g) for g in groups)
        n = min(missing, max_extra_groups - extra)
        if n <= 0:
            return groups, extra
        more = generate(n, round_)
        if len(more) != n:
            raise RuntimeError(f"dynamic sampling: asked for {n} groups, got {len(more)}")
        groups = groups + list(more)
        extra, round_ = extra + n, round_ + 1


class Selection(NamedTuple):
    kept: list  # the groups the update trains on, in order
    no_gradient: list  # indices of the rows of ``kept`` (flattened) whose tokens get no gradient
    fresh: list  # every group not dropped as stale (the step's rollout metrics are of these)
    counts: dict  # what was dropped or left out, and why (the step's metrics)


@dataclasses.dataclass(frozen=True)
class GroupSelector:
    max_staleness: int
    global_batch_size: int
    rows_divisor: int  # mini_batches x micro_batches: the kept rows are a multiple of it
    filter_groups: bool = False
    truncation: str = "penalty"
    turn_redundancy: Optional[float] = None  # per-search credit's rl.turn_redundancy (None: off; see informative)

    def informative(self, group: Sequence) -> bool:
        """Whether ``group`` has a non-zero advantage somewhere (``informative``)."""
        return informative(group, self.turn_redundancy)

    def select(self, groups: Sequence[Sequence[Trajectory]], step: int) -> Selection:
        """The groups of RL step ``step`` (0-based: the trainer holds parameter version ``step``) that train."""
        fresh, stale = filter_stale(groups, step, self.max_staleness)
        lag = [step - t.min_version() for g in fresh for t in g if t.min_version() is not None]
        counts = {
            "staleness/dropped_groups": len(stale),
            "staleness/mean": sum(lag) / len(lag) if lag else 0.0,
            "staleness/max": max(lag, default=0),
        }
        trainable = fresh
        if self.filter_groups:
            trainable, all_equal_groups = split_informative(fresh, self.turn_redundancy)
            counts["filter/dropped_groups"] = len(all_equal_groups)
            counts["filter/extra_episodes"] = sum(len(g) for g in groups if g[0].group_id >= self.global_batch_size)
            counts["filter/informative_groups"] = len(trainable)
            trainable = trainable[: self.global_batch_size]
        kept, left_out = trainable_groups(trainable, self.rows_divisor)
        counts["batch/left_out_groups"] = len(left_out)
        no_gradient = no_gradient_rows([t for g in kept for t in g], self.truncation)
        if self.truncation != "penalty":
            counts["batch/no_gradient_episodes"] = len(no_gradient)
        return Selection(kept, no_gradient, fresh, counts)
