"""Non-finite steps: ``all_finite`` (inside a jitted step, which then keeps parameters and optimizer state as they
were) and ``NonFiniteGuard`` (on the host: counts the skipped steps in a row and stops the run). The RL update
and the cold start's supervised step share both."""

from __future__ import annotations

import logging
import pathlib
from typing import Optional

import jax
import jax.numpy as jnp

log = logging.getLogger("mtrl_jax")


def all_finite(tree) -> jax.Array:
    """Whether every element of every floating leaf of ``tree`` is finite (a boolean scalar)."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves])) if leaves else jnp.bool_(True)


class NonFiniteGuard:
    """Counts the steps in a row whose update skipped an optimizer step (non-finite loss, gradient or updated
    parameters) and stops the run at ``limit`` (``rl.max_nonfinite_steps``) with a ``FloatingPointError``.

    ``stage`` opens its messages ("RL", "cold start"), ``unit`` counts the steps ("RL steps": an RL step holds
    several optimizer steps) and ``remedy`` ends the error (what holds the last good parameters, or what to check).
    """

    def __init__(self, limit: int, stage: str = "RL", unit: str = "RL steps", remedy: str = ""):
        self.limit, self.stage, self.unit, self.remedy = limit, stage, unit, remedy
        self.in_a_row = self.skipped = self.observed = 0

    def observe(self, step: int, skipped: int, last_checkpoint: Optional[pathlib.Path] = None) -> None:
        """Step ``step`` (1-based) skipped ``skipped`` optimizer steps (0: it trained); ``last_checkpoint``, when
        given, is named in the error as what holds the last good parameters."""
        self.observed += 1
        self.in_a_row = self.in_a_row + 1 if skipped else 0
        if not skipped:
            return
        self.skipped += 1
        log.warning(
            "%s step %d: %d optimizer step(s) skipped: non-finite loss or parameters (%d %s in a row)",
            self.stage,
            step,
            skipped,
            self.in_a_row,
            self.unit,
        )
        if self.in_a_row >= self.limit:
            remedy = self.remedy
            if last_checkpoint is not None:
                remedy = f"The last checkpoint, {last_checkpoint}, holds the last good parameters"
            raise FloatingPointError(
                f"{self.stage} step {step}: {self.in_a_row} {self.unit} in a row had a non-finite loss, gradient or "
                f"updated parameters (rl.max_nonfinite_steps={self.limit}); stopping. {remedy}"
            )

    def check_some_trained(self) -> None:
        """Refuse a stage of which every step observed was skipped (fewer than ``limit``: no stop yet)."""
        if self.observed and self.skipped == self.observed:
            raise FloatingPointError(
                f"{self.stage}: all {self.skipped} steps had a non-finite loss or updated parameters; stopping. "
                f"{self.remedy}"
            )
