"""Per-token policy losses, KL estimators and loss aggregation, registered by name.

Exactly the conventions of docs/algorithms.md. Every array is ``[B, T]`` (``B`` padded
sequences of ``T`` tokens) except ``advantages``, which is ``[B]`` (broadcast over tokens) or
``[B, T]``. ``mask`` is 1 on tokens the policy sampled. All computation happens in float32,
whatever the input dtype.

A loss is ``fn(logp, old_logp, advantages [B, T], mask, **options) -> (per_token_loss, metrics)``
where ``metrics`` is a dict of scalars. Register your own::

    from mtrl_jax.rl import losses

    @losses.register("reinforce")
    def reinforce(logp, old_logp, advantages, mask):
        return -advantages * logp, {}

and select it with ``--config.rl.loss=reinforce``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import chex
import jax
import jax.numpy as jnp

from mtrl_jax.rl.registry import Registry

LOG_RATIO_CLIP = 20.0


LOSSES = Registry("loss", ("logp", "old_logp", "advantages", "mask"))
KL_ESTIMATORS = Registry("KL estimator", ("logp", "ref_logp"))
AGGREGATIONS = Registry("aggregation mode", ("per_token_loss", "mask", "norms"))

register = LOSSES.register
names = LOSSES.names
get = LOSSES.get


# ----------------------------------------------------------------------------- helpers


def masked_mean(x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """``sum(x * mask) / sum(mask)``; 0 (not NaN) for an all-zero mask."""
    mask = mask.astype(jnp.float32)
    return (x * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def masked_max(x: jnp.ndarray, mask: jnp.ndarray) -> jnp.ndarray:
    """Max of ``x`` over valid tokens; 0 for an all-zero mask."""
    valid = mask > 0
    return jnp.where(valid.any(), jnp.max(jnp.where(valid, x, -jnp.inf)), 0.0)


def log_ratio(logp: jnp.ndarray, old_logp: jnp.ndarray) -> jnp.ndarray:
    return jnp.clip(logp - old_logp, -LOG_RATIO_CLIP, LOG_RATIO_CLIP)


def _ratio_metrics(ratio, logp, old_logp, mask) -> dict:
    return {
        "approx_kl": masked_mean(old_logp - logp, mask),
        "is_weight_mean": masked_mean(ratio, mask),
        "is_weight_max": masked_max(ratio, mask),
        "ratio_max_dev": masked_max(jnp.abs(ratio - 1.0), mask),
    }


def _clipped_surrogate(ratio, advantages, mask, clip_low, clip_high, clip_dual):
    """PPO surrogate ``max(-A r, -A clip(r))`` with optional dual clip for ``A < 0``."""
    l1 = -advantages * ratio
    l2 = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = jnp.maximum(l1, l2)
    clipped = l2 > l1
    dual = jnp.zeros_like(clipped)
    if clip_dual is not None:
        dual = (advantages < 0) & (loss > -advantages * clip_dual)
        loss = jnp.where(advantages < 0, jnp.minimum(loss, -advantages * clip_dual), loss)
    metrics = {
        "clipfrac": masked_mean(clipped, mask),
        "clipfrac_low": masked_mean(clipped & (ratio < 1.0 - clip_low), mask),
        "clipfrac_high": masked_mean(clipped & (ratio > 1.0 + clip_high), mask),
        "clipfrac_dual": masked_mean(dual, mask),
        "nonzero_grad_frac": masked_mean((advantages != 0) & ~clipped & ~dual, mask),
    }
    return loss, metrics


# ----------------------------------------------------------------------------- losses


@register("ppo")
def ppo(logp, old_logp, advantages, mask, clip_low=0.2, clip_high=0.28, clip_dual=3.0):
    """PPO clipped surrogate (Schulman et al. 2017) with asymmetric clip-higher (DAPO,
    Yu et al. 2025) and dual clip for negative advantages (Ye et al. 2020)."""
    ratio = jnp.exp(log_ratio(logp, old_logp))
    loss, metrics = _clipped_surrogate(ratio, advantages, mask, clip_low, clip_high, clip_dual)
    return loss, {**metrics, **_ratio_metrics(ratio, logp, old_logp, mask)}


@register("cispo")
def cispo(logp, old_logp, advantages, mask, clip_low=1.0, clip_high=4.0):
    """CISPO (MiniMax-M1, 2025): ``-sg(clip(r, 1-lo, 1+hi)) * A * logp``; every token keeps its
    gradient, only the IS weight is clipped."""
    ratio = jnp.exp(log_ratio(logp, old_logp))
    weight = jax.lax.stop_gradient(jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high))
    loss = -weight * advantages * logp
    metrics = {
        "clipfrac": masked_mean((ratio < 1.0 - clip_low) | (ratio > 1.0 + clip_high), mask),
        "clipfrac_low": masked_mean(ratio < 1.0 - clip_low, mask),
        "clipfrac_high": masked_mean(ratio > 1.0 + clip_high, mask),
        "nonzero_grad_frac": masked_mean((advantages != 0) & (weight > 0), mask),
        **_ratio_metrics(ratio, logp, old_logp, mask),
    }
    return loss, metrics


@register("is")
def importance_sampling(logp, old_logp, advantages, mask, is_cap: Optional[float] = None):
    """Importance-sampled policy gradient ``-r * A``; with ``is_cap`` the truncated form
    ``sg(min(r, cap) / r) * r`` (value capped, gradient scaled to match)."""
    ratio = jnp.exp(log_ratio(logp, old_logp))
    truncated = jnp.zeros_like(ratio, dtype=bool)
    if is_cap is not None:
        truncated = ratio > is_cap
        ratio = jax.lax.stop_gradient(jnp.minimum(ratio, is_cap) / ratio) * ratio
    loss = -ratio * advantages
    metrics = {
        "clipfrac": masked_mean(truncated, mask),
        "clipfrac_high": masked_mean(truncated, mask),
        "nonzero_grad_frac": masked_mean(advantages != 0, mask),
        **_ratio_metrics(ratio, logp, old_logp, mask),
    }
    return loss, metrics


@register("gspo")
def gspo(logp, old_logp, advantages, mask, clip_low=3e-4, clip_high=4e-4, clip_dual=None):
    """GSPO-token (Zheng et al. 2025): sequence ratio ``exp(masked_mean_t(logp - old_logp))``
    carried by every token as ``sg(s) * exp(logp - sg(logp))``, clipped like PPO."""
    maskf = mask.astype(jnp.float32)
    seq_log_ratio = (log_ratio(logp, old_logp) * maskf).sum(1) / jnp.maximum(maskf.sum(1), 1.0)
    seq_ratio = jnp.exp(jax.lax.stop_gradient(seq_log_ratio))[:, None]
    ratio = seq_ratio * jnp.exp(logp - jax.lax.stop_gradient(logp))
    loss, metrics = _clipped_surrogate(ratio, advantages, mask, clip_low, clip_high, clip_dual)
    return loss, {**metrics, **_ratio_metrics(ratio, logp, old_logp, mask)}


# ----------------------------------------------------------------------------- public API


def _check(logp, old_logp, advantages, mask):
    chex.assert_rank(logp, 2)
    chex.assert_equal_shape([logp, old_logp, mask])
    if advantages.ndim == 1:
        chex.assert_shape(advantages, (logp.shape[0],))
        advantages = advantages[:, None]
    else:
        chex.assert_equal_shape([advantages, logp])
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    return f32(logp), f32(old_logp), f32(advantages), f32(mask)


def truncated_is_weight(old_logp, behav_logp, tis_cap: float = 2.0) -> jnp.ndarray:
    """Off-policy correction ``sg(min(exp(old_logp - behav_logp), tis_cap))`` ``[B, T]``."""
    return jax.lax.stop_gradient(jnp.minimum(jnp.exp(log_ratio(old_logp, behav_logp)), tis_cap))


def compute(
    name: str,
    logp: jnp.ndarray,
    old_logp: jnp.ndarray,
    advantages: jnp.ndarray,
    mask: jnp.ndarray,
    *,
    behav_logp: Optional[jnp.ndarray] = None,
    tis_cap: float = 2.0,
    **options,
) -> tuple[jnp.ndarray, dict]:
    """Per-token loss ``[B, T]`` (float32, zero off the mask) and scalar metrics.

    ``advantages`` is ``[B]`` or ``[B, T]``. When ``behav_logp`` is given (``old_logp`` was
    recomputed by the trainer), the loss is multiplied by the truncated IS weight
    ``min(exp(old_logp - behav_logp), tis_cap)`` and its mean/max are reported.
    """
    logp, old_logp, advantages, mask = _check(logp, old_logp, advantages, mask)
    advantages = jnp.broadcast_to(advantages, logp.shape)
    loss, metrics = LOSSES(name, logp, old_logp, advantages, mask, **options)
    chex.assert_equal_shape([loss, logp])
    if behav_logp is not None:
        chex.assert_equal_shape([behav_logp, logp])
        tis = truncated_is_weight(old_logp, jnp.asarray(behav_logp, jnp.float32), tis_cap)
        loss = loss * tis
        metrics = {**metrics, "tis_mean": masked_mean(tis, mask), "tis_max": masked_max(tis, mask)}
    return loss * mask, metrics


class Normalisers(NamedTuple):
    """Counts an aggregation divides by. ``None`` means "of this (micro-)batch"; pass the *mini-batch*
    counts under gradient accumulation so the sum over micro-batches equals the mini-batch value."""

    num_tokens: Optional[jnp.ndarray] = None  # valid tokens (token-mean)
    num_seqs: Optional[jnp.ndarray] = None  # rows with a valid token (seq-mean-*)
    num_rows: Optional[int] = None  # all rows B (seq-mean-token-sum-norm)
    norm_len: Optional[int] = None  # rollout.max_len: the trajectory's token budget (seq-mean-token-sum-norm)


def _row_counts(mask, norms: Normalisers):
    row_tokens = mask.sum(axis=1)
    valid_rows = (row_tokens > 0).astype(jnp.float32)
    seqs = valid_rows.sum() if norms.num_seqs is None else norms.num_seqs
    return row_tokens, valid_rows, seqs


@AGGREGATIONS.register("token-mean")
def token_mean(loss, mask, norms: Normalisers):
    denom = mask.sum() if norms.num_tokens is None else norms.num_tokens
    return loss.sum() / jnp.maximum(denom, 1.0)


@AGGREGATIONS.register("seq-mean-token-mean")
def seq_mean_token_mean(loss, mask, norms: Normalisers):
    row_tokens, valid_rows, seqs = _row_counts(mask, norms)
    row_loss = loss.sum(axis=1) / jnp.maximum(row_tokens, 1.0)
    return (row_loss * valid_rows).sum() / jnp.maximum(seqs, 1.0)


@AGGREGATIONS.register("seq-mean-token-sum")
def seq_mean_token_sum(loss, mask, norms: Normalisers):
    _, _, seqs = _row_counts(mask, norms)
    return loss.sum() / jnp.maximum(seqs, 1.0)


@AGGREGATIONS.register("seq-mean-token-sum-norm")
def seq_mean_token_sum_norm(loss, mask, norms: Normalisers):
    """Dr.GRPO's constant normaliser: ``sum(L * mask) / (B * norm_len)``."""
    if norms.norm_len is None:
        raise ValueError("aggregation 'seq-mean-token-sum-norm' needs norm_len (rollout.max_len)")
    rows = loss.shape[0] if norms.num_rows is None else norms.num_rows
    return loss.sum() / (rows * norms.norm_len)


def aggregate(
    per_token_loss: jnp.ndarray,
    mask: jnp.ndarray,
    mode: str = "token-mean",
    *,
    norm_len: Optional[int] = None,
    num_tokens: Optional[jnp.ndarray] = None,
    num_seqs: Optional[jnp.ndarray] = None,
    num_rows: Optional[int] = None,
) -> jnp.ndarray:
    """Reduce ``per_token_loss [B, T]`` to a scalar with the aggregation mode ``mode``
    (docs/algorithms.md "Aggregation"). An all-zero mask gives 0, never NaN."""
    chex.assert_equal_shape([per_token_loss, mask])
    maskf = mask.astype(jnp.float32)
    loss = per_token_loss.astype(jnp.float32) * maskf
    return AGGREGATIONS(mode, loss, maskf, Normalisers(num_tokens, num_seqs, num_rows, norm_len))


def _log_difference(logp, ref_logp):
    chex.assert_equal_shape([logp, ref_logp])
    return jnp.asarray(logp, jnp.float32) - jnp.asarray(ref_logp, jnp.float32)


@KL_ESTIMATORS.register("k1")
def kl_k1(logp, ref_logp):
    return _log_difference(logp, ref_logp)


@KL_ESTIMATORS.register("k2")
def kl_k2(logp, ref_logp):
    return 0.5 * _log_difference(logp, ref_logp) ** 2


@KL_ESTIMATORS.register("k3")
def kl_k3(logp, ref_logp):
    d = _log_difference(logp, ref_logp)
    return jnp.clip(jnp.exp(jnp.clip(-d, -20.0, 20.0)) + d - 1.0, -10.0, 10.0)


def kl(name: str, logp: jnp.ndarray, ref_logp: jnp.ndarray) -> jnp.ndarray:
    """Per-token KL estimate ``[B, T]`` of the policy from the reference (Schulman 2020 k1/k2/k3)."""
    return KL_ESTIMATORS(name, logp, ref_logp)
