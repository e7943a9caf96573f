"""Dynamic sampling (DAPO's ``filter_groups``) and the handling of truncated / failed episodes.

A group whose rewards are all equal has group-relative advantages of exactly 0: it adds no policy
gradient, only tokens to the normaliser (and KL / entropy terms). ``rl.filter_groups`` drops such
groups from the update; with ``rl.filter_max_extra_groups > 0`` the rollouts first keep generating
groups for further training tasks (drawn at random, reproducibly per step) until the step has as
many informative groups as it asked for, or the cap of extra groups is reached.

``rl.truncation``: an episode that failed (turn limit, per-turn token limit, context limit) gets the
reward -1 either way, so it stays in its group's baseline; ``"penalty"`` (the default) trains on its
tokens with that reward, ``"mask"`` gives its tokens no gradient (``no_gradient_rows``).
"""

from __future__ import annotations

from typing import Callable, Sequence

from mtrl_jax.metrics import all_equal

TRUNCATION_MODES = ("penalty", "mask")


def informative(group: Sequence) -> bool:
    """Whether ``group``'s rewards differ (its group-relative advantages are not all 0)."""
    return not all_equal(group)


def split_informative(groups: Sequence[Sequence]) -> tuple[list, list]:
    """``(informative groups, all-equal groups)``, each in the given order."""
    keep, drop = [], []
    for group in groups:
        (keep if informative(group) else drop).append(group)
    return keep, drop


def refill(groups: list, target: int, generate: Callable[[int, int], list], max_extra_groups: int) -> tuple[list, int]:
    """Generate further groups until ``groups`` holds ``target`` informative ones or ``max_extra_groups``
    extra groups have been generated: round ``r`` calls ``generate(n, r)`` for the ``n`` groups still
    missing (at most what the cap leaves) and appends what it returns. Returns ``(groups, extra groups
    generated)``."""
    extra, round_ = 0, 0
    while True:
        missing = target - sum(informative(g) for g in groups)
        n = min(missing, max_extra_groups - extra)
        if n <= 0:
            return groups, extra
        more = generate(n, round_)
        if len(more) != n:
            raise RuntimeError(f"dynamic sampling: asked for {n} groups, got {len(more)}")
        groups = groups + list(more)
        extra, round_ = extra + n, round_ + 1


def no_gradient_rows(trajectories: Sequence, truncation: str) -> list[int]:
    """Indices of the rows whose tokens get no gradient under ``rl.truncation``: with ``"mask"``, the
    failed episodes (any status other than ``"ok"``); with ``"penalty"``, none."""
    if truncation not in TRUNCATION_MODES:
        raise ValueError(f"rl.truncation must be one of {TRUNCATION_MODES}, got {truncation!r}")
    if truncation == "penalty":
        return []
    return [i for i, t in enumerate(trajectories) if t.status != "ok"]
