"""The policy update: one jitted function over the train state and a whole trajectory batch.

``update_step`` keeps purejaxrl's skeleton (``prepare`` -> ``lax.scan(optimizer_step)`` -> ``summarize``): it
computes the group advantages,
recomputes ``old_logp`` (and the KL reference's log-probs) with the parameters before the update,
draws the mini-batch order from a split of ``TrainState.rng``, and runs one ``lax.scan`` over
``update_epochs x mini_batches`` optimizer steps. Each optimizer step accumulates its gradient over
``micro_batches`` with an inner ``lax.scan``, normalised by the mini-batch's token / sequence / row
counts, so accumulation gives the same gradient as one large batch. A step whose loss, gradient norm or
updated parameters are not finite is skipped: parameters and optimizer state stay as they were, and it is
counted (``NonFiniteGuard`` stops a run after ``rl.max_nonfinite_steps`` such RL steps in a row).
Metrics come back as device scalars; the caller fetches them once.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import optax

from mtrl_jax.model import lora
from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.sharding import constrain_rows
from mtrl_jax.rl import advantages as advantages_lib
from mtrl_jax.rl.turn_credit import TurnCreditConfig, token_advantages
from mtrl_jax.rl.batch import TrajectoryBatch
from mtrl_jax.rl.guard import all_finite
from mtrl_jax.rl.lengths import by_length, length_buckets, switch_on_length
from mtrl_jax.rl.optimizer import TrainState
from mtrl_jax.rl.logprobs import score, sequence_logprobs
from mtrl_jax.rl.objective import ObjectiveConfig, objective

log = logging.getLogger("mtrl_jax")


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
    length_bucket: int = 128  # a micro-batch is computed at its longest row rounded up to this (see length_buckets)
    # every row of a batch holds at least this many tokens (its prompt; setup measures a lower bound): no
    # branch is compiled for the lengths below it, which no micro-batch then takes (a shorter row is still
    # right, computed at the shortest length compiled)
    min_length: int = 0
    # a micro-batch whose rows' sampled tokens all have advantage 0 (every row of an all-equal group, and with
    # per-search credit one whose search-turn rewards are all equal too) adds exactly 0 to the gradient when
    # the objective has no KL and no entropy term: skip its forward and backward (the optimizer step still
    # runs). Exact for every built-in loss (a zero advantage gives a zero loss and gradient); a registered
    # loss with a term that does not scale with the advantage must turn it off.
    skip_zero_advantage: bool = True
    # per-search credit (rl.turn_reward="retrieval_gain"): token-level advantages from the batch's turn
    # rewards (TrajectoryBatch.turns); None: one advantage per trajectory
    turn_credit: Optional[TurnCreditConfig] = None

    def __post_init__(self):
        if self.advantage not in advantages_lib.ESTIMATORS:
            raise ValueError(
                f"rl.advantage: unknown advantage estimator {self.advantage!r}; registered: {advantages_lib.names()}"
            )
        advantages_lib.ESTIMATORS.check_options(self.advantage, dict(self.advantage_options), "rl.advantage_options")
        if self.old_logp not in ("recompute", "behaviour"):
            raise ValueError(f"rl.old_logp must be 'recompute' or 'behaviour', got {self.old_logp!r}")
        for field in ("update_epochs", "mini_batches", "micro_batches", "logprob_chunk", "length_bucket"):
            if getattr(self, field) < 1:
                raise ValueError(f"rl.{field} must be >= 1, got {getattr(self, field)}")
        if self.min_length < 0:
            raise ValueError(f"UpdateConfig.min_length must be >= 0, got {self.min_length}")
        if not self.temperature > 0:
            raise ValueError(
                f"rollout.temperature: training log-probs are of logits / temperature, so it must be > 0, "
                f"got {self.temperature}"
            )

    @property
    def rows_per_micro_batch_divisor(self) -> int:
        """The batch's row count must be a multiple of this."""
        return self.mini_batches * self.micro_batches


def minibatch_order(key: jax.Array, batch_size: int, update_epochs: int, mini_batches: int) -> jax.Array:
    """``[update_epochs * mini_batches, batch_size // mini_batches]`` int32 row indices: optimizer step
    ``s`` trains on rows ``order[s]``. Each epoch is a fresh permutation of all rows (one key per
    epoch, split from ``key``); with a single mini-batch the rows stay in order."""
    if batch_size % mini_batches:
        raise ValueError(f"batch of {batch_size} trajectories does not split into {mini_batches} mini-batches")
    if mini_batches == 1:
        order = jnp.tile(jnp.arange(batch_size, dtype=jnp.int32), (update_epochs, 1))
    else:
        order = jax.vmap(lambda k: jax.random.permutation(k, batch_size))(jax.random.split(key, update_epochs))
    return order.reshape(update_epochs * mini_batches, batch_size // mini_batches).astype(jnp.int32)


def _mean_or_max(name: str, values: jax.Array, weights: Optional[jax.Array] = None) -> jax.Array:
    """A ``*_max`` metric's max, any other's mean (weighted by ``weights``, e.g. 0 for a skipped micro-batch)."""
    if name.endswith(("_max", "_max_dev", "_max_abs_dev")):
        return values.max()
    return values.mean() if weights is None else (values * weights).sum() / jnp.maximum(weights.sum(), 1.0)


class StepPlan(NamedTuple):
    """What every optimizer step of one update reads, made once by ``prepare``: the static shapes and choices
    (hashable: closed over) and the batch's per-row arrays (traced)."""

    model_cfg: ModelConfig
    cfg: UpdateConfig
    tx: optax.GradientTransformation
    buckets: tuple[int, ...]  # the lengths a micro-batch is computed at (length_buckets)
    rows_per_micro: int
    skip: bool  # rows with advantage 0 add exactly 0: their micro-batches are skipped


class Prepared(NamedTuple):
    data: dict  # per-row arrays the micro-batches gather: tokens, masks, behaviour / old / reference log-probs, adv
    advantages: jax.Array  # [B] the estimator's, one per trajectory (data["adv"] is [B, T] with per-search credit)
    turn_advantages: Optional[jax.Array]  # [B, K] with per-search credit (turn_credit.token_advantages), else None
    signal: Optional[jax.Array]  # [B] rows whose gradient can be non-zero (with plan.skip), else None
    current: dict  # scored set name -> whether it is bitwise the parameters the first mini-batch starts from
    order: jax.Array  # [update_epochs * mini_batches, rows] the optimizer steps' rows
    rng: jax.Array  # the state's next key


def plan_update(model_cfg: ModelConfig, cfg: UpdateConfig, tx, batch: TrajectoryBatch) -> StepPlan:
    B, T = batch.tokens.shape
    if B % cfg.rows_per_micro_batch_divisor:
        raise ValueError(
            f"batch of {B} trajectories does not split into {cfg.mini_batches} mini-batches "
            f"x {cfg.micro_batches} micro-batches"
        )
    obj = cfg.objective
    return StepPlan(
        model_cfg,
        cfg,
        tx,
        length_buckets(T, cfg.length_bucket, shortest=cfg.min_length),
        B // cfg.rows_per_micro_batch_divisor,
        cfg.skip_zero_advantage and not obj.kl_coef and not obj.entropy_coef,
    )


def policy_logprobs(plan: StepPlan, frozen, trainable, tokens, attention_mask):
    """``(log-probs, entropy)`` of the policy ``frozen`` + ``trainable`` (``sequence_logprobs``)."""
    cfg = plan.cfg
    return sequence_logprobs(
        plan.model_cfg, lora.merge(frozen, trainable), tokens, attention_mask, cfg.temperature, cfg.logprob_chunk
    )


def _one_step(cfg: UpdateConfig) -> bool:
    return cfg.update_epochs * cfg.mini_batches == 1  # the old policy is the one the only step starts from


def prepare(plan: StepPlan, state: TrainState, batch: TrajectoryBatch, ref_params, frozen) -> Prepared:
    """Advantages, the mini-batch order, and the log-probs the update needs before its first step (the old
    policy's, the KL reference's), scored in the first epoch's micro-batches."""
    cfg, obj = plan.cfg, plan.cfg.objective
    loss_mask = batch.loss_mask.astype(jnp.float32)
    trajectory_adv = advantages_lib.compute(
        cfg.advantage, batch.reward, batch.group_size, loss_mask, **dict(cfg.advantage_options)
    )
    adv, turn_adv = trajectory_adv, None
    if cfg.turn_credit is not None:
        if batch.turns is None:
            raise ValueError("rl.turn_reward='retrieval_gain' needs the batch's turn rewards (make_batch)")
        adv, turn_adv = token_advantages(adv, batch.turns, batch.group_size, cfg.turn_credit)
    # rows whose gradient can be non-zero: with no KL and no entropy term, a row whose sampled tokens all have
    # advantage 0 adds 0
    if not plan.skip:
        signal = None
    elif adv.ndim == 1:
        signal = (adv != 0) & (loss_mask.sum(axis=1) > 0)
    else:
        signal = ((adv != 0) & (loss_mask > 0)).any(axis=1)
    scored = []  # parameter sets whose log-probs the update needs before its first step
    if cfg.old_logp == "recompute" and not _one_step(cfg):
        scored.append(("old_logp", state.params))
    if obj.kl_coef:
        if ref_params is None:
            raise ValueError("rl.kl_coef > 0 needs the reference parameters")
        scored.append(("ref_logp", ref_params))
    rng, order_key = jax.random.split(state.rng)
    order = minibatch_order(order_key, batch.tokens.shape[0], cfg.update_epochs, cfg.mini_batches)
    data = {
        "tokens": batch.tokens,
        "attention_mask": batch.attention_mask,
        "loss_mask": loss_mask,
        "behav_logp": batch.behav_logp,
        "old_logp": batch.behav_logp,
        "adv": adv,
    }
    if scored:  # in the first epoch's micro-batches (see score)
        first_epoch = jnp.concatenate(
            [by_length(batch.attention_mask, rows, plan.rows_per_micro, signal) for rows in order[: cfg.mini_batches]]
        )
        data.update(
            score(
                functools.partial(policy_logprobs, plan, frozen),
                [p for _, p in scored],
                [n for n, _ in scored],
                batch.tokens,
                batch.attention_mask,
                plan.buckets,
                first_epoch,
            )
        )
    # In the first mini-batch the parameters are still the ones scored: a scored set that is bitwise the
    # current parameters (the old policy always; the reference at the first RL step) takes the training
    # forward's own log-probs, so the first ratio is 1 to the last bit and an all-zero-advantage step has
    # a gradient of exactly 0 (two compiled programs agree only to ~1 ulp, which Adam would amplify).
    current = {"old_logp": jnp.bool_(True)} if cfg.old_logp == "recompute" else {}
    if obj.kl_coef:
        current["ref_logp"] = jnp.all(
            jnp.stack(
                [jnp.array_equal(a, b) for a, b in zip(jax.tree.leaves(ref_params), jax.tree.leaves(state.params))]
            )
        )
    return Prepared(data, trajectory_adv, turn_adv, signal, current, order, rng)


def micro_loss(plan: StepPlan, frozen, current: dict, params, micro: dict, norms: dict, first):
    """The objective of one micro-batch (``micro``: its rows of ``Prepared.data``), normalised by its
    mini-batch's counts (``norms``), and its metrics."""
    cfg = plan.cfg
    logp, entropy = policy_logprobs(plan, frozen, params, micro["tokens"], micro["attention_mask"])
    micro = {
        **micro,
        **{name: jnp.where(first & same, jax.lax.stop_gradient(logp), micro[name]) for name, same in current.items()},
    }
    loss, metrics = objective(
        cfg.objective,
        logp,
        micro["old_logp"],
        micro["adv"],
        micro["loss_mask"],
        entropy=entropy,
        behav_logp=micro["behav_logp"] if cfg.old_logp == "recompute" else None,
        ref_logp=micro.get("ref_logp"),
        norms=norms,
    )
    dev = jnp.abs(jax.lax.stop_gradient(micro["old_logp"]) - micro["behav_logp"]) * micro["loss_mask"]
    return loss, {**metrics, "behav_logp_max_abs_dev": jnp.max(dev)}


def micro_gradient(plan: StepPlan, frozen, prepared: Prepared, params, norms, first, micro_batch: dict):
    """The gradient and metrics of one micro-batch, computed at the shortest of ``plan.buckets`` that holds
    its rows (one branch per length: the micro-batch's columns ``[0, length)``)."""
    grad_fn = jax.value_and_grad(functools.partial(micro_loss, plan, frozen, prepared.current), has_aux=True)

    def at_length(length, micro_batch):
        cut = {k: v[:, :length] if v.ndim == 2 else v for k, v in micro_batch.items()}
        (_, metrics), g = grad_fn(params, cut, norms, first)
        return g, {
            **metrics,
            "computed": jnp.float32(1.0),
            "computed_tokens": jnp.float32(plan.rows_per_micro * length),
            "computed_real_tokens": cut["attention_mask"].sum().astype(jnp.float32),
            "computed_loss_tokens": cut["loss_mask"].sum(),
        }

    return switch_on_length(plan.buckets, micro_batch["attention_mask"], at_length, micro_batch)


def optimizer_step(plan: StepPlan, frozen, prepared: Prepared, attention_mask, carry, xs):
    """One optimizer step on the rows ``xs[0]`` (a mini-batch; ``xs[1]``: whether it is the update's first),
    its gradient accumulated over micro-batches of rows of similar length; a step whose loss, gradient norm
    or new parameters are not finite is skipped and counted. A ``lax.scan`` body over the mini-batches."""
    rows, first = xs
    params, opt_state, step, skipped = carry
    data, signal = prepared.data, prepared.signal
    mask = data["loss_mask"][rows]
    norms = dict(num_tokens=mask.sum(), num_seqs=(mask.sum(1) > 0).sum().astype(jnp.float32), num_rows=mask.shape[0])
    gradient = functools.partial(micro_gradient, plan, frozen, prepared, params, norms, first)

    def accumulate(grads, micro_rows):
        # the gathered rows come out of the gather unsharded: split them over the batch axes
        micro_batch = jax.tree.map(lambda x: constrain_rows(x[micro_rows]), data)
        if plan.skip:  # every row with advantage 0: the gradient is exactly 0, and nothing is computed
            shapes = jax.eval_shape(gradient, micro_batch)
            zeros = lambda _: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), shapes)  # noqa: E731
            g, metrics = jax.lax.cond(signal[micro_rows].any(), gradient, zeros, micro_batch)
        else:
            g, metrics = gradient(micro_batch)
        return jax.tree.map(jnp.add, grads, g), metrics

    # micro-batches of rows of similar length (longest first), each computed at its own length; the rows
    # that can have a gradient first, so the others make micro-batches that are skipped
    micro_rows = by_length(attention_mask, rows, plan.rows_per_micro, signal)
    grads, micro_metrics = jax.lax.scan(accumulate, jax.tree.map(jnp.zeros_like, params), micro_rows)
    metrics = step_metrics(plan, micro_metrics, micro_rows.shape[0], mask)
    metrics["grad_norm"] = optax.global_norm(grads)
    updates, new_opt_state = plan.tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    # a finite loss and gradient can still step to non-finite parameters (a learning rate of inf)
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]) & all_finite(new_params)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    carry = (
        keep(new_params, params),
        keep(new_opt_state, opt_state),
        step + finite.astype(jnp.int32),
        skipped + (~finite).astype(jnp.int32),
    )
    return carry, metrics


def step_metrics(plan: StepPlan, micro_metrics: dict, micro_batches: int, mask) -> dict:
    """An optimizer step's metrics from its micro-batches' (``[micro_batches]`` each)."""
    ran = micro_metrics.pop("computed")
    computed = {k: micro_metrics.pop(f"computed_{k}").sum() for k in ("tokens", "real_tokens", "loss_tokens")}
    # means over the micro-batches computed (a skipped one has no ratios or clipping to report)
    metrics = {k: _mean_or_max(k, v, ran) for k, v in micro_metrics.items()}
    metrics["real_token_fraction"] = computed["real_tokens"] / jnp.maximum(computed["tokens"], 1.0)
    metrics["computed_rows_frac"] = ran.sum() / micro_batches
    # additive terms were normalised by mini-batch counts, so the micro-batches' sum is the mini-batch value
    # (the loss and pg_loss of a skipped micro-batch are exactly 0; the entropy is of the tokens computed)
    for key in ("loss", "pg_loss", "kl", "entropy"):
        if key in metrics:
            metrics[key] = micro_metrics[key].sum()
    if plan.skip and "entropy" in metrics:
        metrics["entropy"] = metrics["entropy"] * mask.sum() / jnp.maximum(computed["loss_tokens"], 1.0)
    return metrics


def summarize(plan: StepPlan, prepared: Prepared, batch: TrajectoryBatch, history: dict, skipped) -> dict:
    """The update's metrics from its optimizer steps' (``history``: ``[steps]`` each): device scalars, and
    ``advantages [B]``."""
    cfg, data = plan.cfg, prepared.data
    adv = prepared.advantages
    metrics = {k: _mean_or_max(k, v) for k, v in history.items()}
    metrics["first_minibatch_ratio_max_dev"] = history["ratio_max_dev"][0]
    metrics["skipped_steps"] = skipped
    if not (cfg.old_logp == "recompute" and _one_step(cfg)):  # else the training forward measured it
        dev = jnp.abs(data["old_logp"] - batch.behav_logp) * data["loss_mask"]
        metrics["behav_logp_max_abs_dev"] = jnp.max(dev)
    else:
        metrics["behav_logp_max_abs_dev"] = history["behav_logp_max_abs_dev"][0]
    metrics["advantage_mean"] = adv.mean()
    metrics["advantage_abs_mean"] = jnp.abs(adv).mean()
    metrics["advantages"] = adv  # [B]: each trajectory's advantage (the trainer writes it to its record)
    if prepared.turn_advantages is not None:  # [B, K]: each turn's (the trainer writes them to the turns)
        metrics["turn_advantages"] = prepared.turn_advantages
        sampled = data["loss_mask"] > 0
        metrics["turn_advantage_abs_mean"] = (jnp.abs(data["adv"] - adv[:, None]) * sampled).sum() / jnp.maximum(
            sampled.sum(), 1.0
        )
    return metrics


def update_step(
    model_cfg: ModelConfig,
    cfg: UpdateConfig,
    tx: optax.GradientTransformation,
    state: TrainState,
    batch: TrajectoryBatch,
    ref_params=None,
    frozen=None,
) -> tuple[TrainState, dict]:
    """All optimizer steps for one batch of ``P x G`` trajectories (``batch``'s arrays ``[B, T]`` /
    ``[B]``); returns the new state and device metrics: scalars, and ``advantages [B]``. Jit it with
    ``model_cfg``, ``cfg``, ``tx`` and ``batch.group_size`` static (``Updater`` does).

    ``state.params`` are the trainable parameters (the adapters, with LoRA) and ``frozen`` the rest of
    the model (``lora.split``; empty without adapters): the gradient, the optimizer and the reference
    (``ref_params``, trainable-shaped) cover the trainable ones only, the forward pass sees both.

    purejaxrl's skeleton: ``prepare`` (advantages, the order, the old and reference log-probs), one
    ``lax.scan`` of ``optimizer_step`` over ``update_epochs x mini_batches``, ``summarize``. With one
    optimizer step per batch and ``old_logp="recompute"``, the old policy is the current one: its log-probs
    are the training forward's own (no separate pass)."""
    frozen = {} if frozen is None else frozen
    plan = plan_update(model_cfg, cfg, tx, batch)
    prepared = prepare(plan, state, batch, ref_params, frozen)
    step = functools.partial(optimizer_step, plan, frozen, prepared, batch.attention_mask)
    init = (state.params, state.opt_state, state.step, jnp.zeros((), jnp.int32))
    firsts = jnp.arange(prepared.order.shape[0]) == 0
    (params, opt_state, step_count, skipped), history = jax.lax.scan(step, init, (prepared.order, firsts))
    return TrainState(params, opt_state, step_count, prepared.rng), summarize(plan, prepared, batch, history, skipped)
