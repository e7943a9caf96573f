"""The train state and the RL optimizer: AdamW with a global-norm clip and a learning-rate schedule (a linear
ramp of ``optim.warmup_steps`` steps (the learning-rate ramp), then constant, linear or cosine)."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array  # int32: optimizer steps taken
    rng: jax.Array  # split once per update for the mini-batch order


def make_optimizer(
    learning_rate: float,
    total_steps: int,
    schedule: str = "constant",
    ramp_steps: int = 0,
    grad_clip: float = 1.0,
    weight_decay: float = 0.0,
    b1: float = 0.9,
    b2: float = 0.999,
):
    if schedule == "constant":
        lr = (
            optax.join_schedules(
                [
                    optax.linear_schedule(0.0, learning_rate, max(ramp_steps, 1)),
                    optax.constant_schedule(learning_rate),
                ],
                [max(ramp_steps, 1)],
            )
            if ramp_steps
            else learning_rate
        )
    elif schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(
            0.0, learning_rate, max(ramp_steps, 1), max(total_steps, ramp_steps + 1)
        )
    else:
        raise ValueError(f"optim.schedule must be 'constant' or 'cosine', got {schedule!r}")
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
    return optax.chain(*parts, optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))


def init_state(tx: optax.GradientTransformation, params, rng) -> TrainState:
    return TrainState(params, tx.init(params), jnp.zeros((), jnp.int32), rng)
