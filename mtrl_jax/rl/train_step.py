"""The jitted policy update over a ``TrajectoryBatch``.

One call to ``Updater.update`` does ``update_epochs`` passes over the batch, each split into
``mini_batches`` optimizer steps; each mini-batch is accumulated over ``micro_batches`` with a
``lax.scan``, normalised by the mini-batch's token / sequence / row counts so accumulation gives
the same gradient as one large batch. ``old_logp`` is recomputed once per batch with the
parameters before the update (or taken from the sampler, ``old_logp="behaviour"``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.transformer import forward, head_kernel
from mtrl_jax.rl import advantages as advantages_lib
from mtrl_jax.rl.batch import TrajectoryBatch
from mtrl_jax.rl.logprobs import token_logprobs
from mtrl_jax.rl.objective import ObjectiveConfig, objective


class TrainState(NamedTuple):
    params: Any
    opt_state: Any
    step: jax.Array  # int32: optimizer steps taken
    rng: jax.Array


@dataclasses.dataclass(frozen=True)
class UpdateConfig:
    objective: ObjectiveConfig = ObjectiveConfig()
    advantage: str = "grpo"
    advantage_options: tuple[tuple[str, Any], ...] = ()
    temperature: float = 1.0  # the sampler's: log-probs are of logits / temperature
    old_logp: str = "recompute"  # or "behaviour"
    update_epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    logprob_chunk: int = 512

    def __post_init__(self):
        advantages_lib.get(self.advantage)
        if self.old_logp not in ("recompute", "behaviour"):
            raise ValueError(f"rl.old_logp must be 'recompute' or 'behaviour', got {self.old_logp!r}")


def make_optimizer(learning_rate: float, total_steps: int, schedule: str = "constant", warmup_steps: int = 0,
                   grad_clip: float = 1.0, weight_decay: float = 0.0, b1: float = 0.9, b2: float = 0.999):
    if schedule == "constant":
        lr = optax.join_schedules([optax.linear_schedule(0.0, learning_rate, max(warmup_steps, 1)),
                                   optax.constant_schedule(learning_rate)], [max(warmup_steps, 1)]) if warmup_steps else learning_rate
    elif schedule == "cosine":
        lr = optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(warmup_steps, 1), max(total_steps, warmup_steps + 1))
    else:
        raise ValueError(f"optim.schedule must be 'constant' or 'cosine', got {schedule!r}")
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip else []
    return optax.chain(*parts, optax.adamw(lr, b1=b1, b2=b2, weight_decay=weight_decay))


def sequence_logp(model_cfg: ModelConfig, params, tokens, attention_mask, temperature, chunk):
    """``(logp, entropy)`` ``[B, T]`` of each token given its prefix (column 0 is 0)."""
    hidden, _ = forward(model_cfg, params, tokens, attention_mask)
    logp, entropy = token_logprobs(hidden[:, :-1], head_kernel(model_cfg, params), tokens[:, 1:], temperature, chunk)
    pad = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([pad, logp], 1), jnp.concatenate([pad, entropy], 1)


class Updater:
    def __init__(self, model_cfg: ModelConfig, config: UpdateConfig, tx: optax.GradientTransformation):
        self.model_cfg, self.config, self.tx = model_cfg, config, tx
        chunk = config.logprob_chunk
        self._logp = jax.jit(lambda params, tokens, mask: sequence_logp(model_cfg, params, tokens, mask, config.temperature, chunk))
        self._advantages = jax.jit(self._compute_advantages, static_argnums=(2,))
        self._step = jax.jit(self._minibatch_step)

    def init_state(self, params, rng) -> TrainState:
        return TrainState(params, self.tx.init(params), jnp.zeros((), jnp.int32), rng)

    def _compute_advantages(self, reward, loss_mask, group_size):
        options = dict(self.config.advantage_options)
        if self.config.advantage == "reinforce_pp_baseline":
            options["mask"] = loss_mask
        return advantages_lib.compute(self.config.advantage, reward, group_size, **options)

    def token_logp(self, params, batch: TrajectoryBatch):
        return self._logp(params, batch.tokens, batch.attention_mask)

    def _micro_loss(self, params, mb, norms):
        cfg = self.config
        logp, entropy = sequence_logp(self.model_cfg, params, mb["tokens"], mb["attention_mask"], cfg.temperature, cfg.logprob_chunk)
        return objective(cfg.objective, logp, mb["old_logp"], mb["adv"], mb["loss_mask"], entropy=entropy,
                         behav_logp=mb["behav_logp"] if cfg.old_logp == "recompute" else None,
                         ref_logp=mb.get("ref_logp"), **norms)

    def _minibatch_step(self, state: TrainState, mb: dict):
        """One optimizer step on a mini-batch ``mb`` of ``[R, T]`` arrays, accumulated over micro-batches."""
        n_micro = self.config.micro_batches
        mask = mb["loss_mask"]
        norms = dict(num_tokens=mask.sum(), num_seqs=(mask.sum(1) > 0).sum().astype(jnp.float32), num_rows=mask.shape[0])
        micro = jax.tree.map(lambda x: x.reshape(n_micro, x.shape[0] // n_micro, *x.shape[1:]), mb)
        grad_fn = jax.value_and_grad(self._micro_loss, has_aux=True)

        def body(grads, micro_batch):
            (_, metrics), g = grad_fn(state.params, micro_batch, norms)
            return jax.tree.map(jnp.add, grads, g), metrics

        zeros = jax.tree.map(jnp.zeros_like, state.params)
        grads, metrics = jax.lax.scan(body, zeros, micro)
        metrics = {k: (v.max() if k.endswith(("_max", "_max_dev")) else v.mean()) for k, v in metrics.items()}
        # additive terms were normalised by mini-batch counts, so the scan's sum is the mini-batch value
        for key in ("loss", "pg_loss", "kl", "entropy"):
            if key in metrics:
                metrics[key] = metrics[key] * n_micro
        metrics["grad_norm"] = optax.global_norm(grads)
        updates, opt_state = self.tx.update(grads, state.opt_state, state.params)
        params = optax.apply_updates(state.params, updates)
        return TrainState(params, opt_state, state.step + 1, state.rng), metrics

    def update(self, state: TrainState, batch: TrajectoryBatch, ref_params=None, seed: int = 0):
        """All optimizer steps for one batch; returns the new state and host metrics."""
        cfg = self.config
        B = batch.tokens.shape[0]
        if B % (cfg.mini_batches * cfg.micro_batches):
            raise ValueError(f"batch of {B} trajectories does not split into {cfg.mini_batches} mini-batches "
                             f"x {cfg.micro_batches} micro-batches")
        adv = self._advantages(jnp.asarray(batch.reward), jnp.asarray(batch.loss_mask), batch.group_size)
        if cfg.old_logp == "recompute":
            old_logp, _ = self.token_logp(state.params, batch)
        else:
            old_logp = jnp.asarray(batch.behav_logp)
        arrays = {"tokens": batch.tokens, "attention_mask": batch.attention_mask, "loss_mask": batch.loss_mask,
                  "behav_logp": batch.behav_logp, "old_logp": old_logp, "adv": adv}
        if cfg.objective.kl_coef:
            arrays["ref_logp"] = self.token_logp(ref_params, batch)[0]
        arrays = {k: np.asarray(v) for k, v in arrays.items()}  # one device-to-host copy, not one per mini-batch
        mask = batch.loss_mask
        behav_dev = float(np.max(np.abs(arrays["old_logp"] - batch.behav_logp) * mask)) if mask.any() else 0.0
        history = []
        rng = np.random.default_rng(seed)
        for _ in range(cfg.update_epochs):
            order = rng.permutation(B) if cfg.mini_batches > 1 else np.arange(B)
            for part in np.split(order, cfg.mini_batches):
                mb = {k: jnp.asarray(v[part]) for k, v in arrays.items()}
                state, metrics = self._step(state, mb)
                history.append(metrics)
        metrics = {k: float(np.mean([np.asarray(m[k]) for m in history])) for k in history[0]}
        metrics["first_minibatch_ratio_max_dev"] = float(history[0]["ratio_max_dev"])
        metrics["behav_logp_max_abs_dev"] = behav_dev
        metrics["advantage_mean"] = float(np.mean(arrays["adv"]))
        metrics["advantage_abs_mean"] = float(np.mean(np.abs(arrays["adv"])))
        return state, metrics
