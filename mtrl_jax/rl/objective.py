"""The scalar training objective: policy-gradient loss + KL penalty - entropy bonus.

``objective = agg(pg_loss * tis) + kl_coef * agg(kl) - entropy_coef * agg(entropy)``
(docs/algorithms.md). The truncated IS weight multiplies the policy-gradient term only.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp

from mtrl_jax.rl import losses


@dataclasses.dataclass(frozen=True)
class ObjectiveConfig:
    """Static description of the objective (hashable, so it can be a jit static argument)."""

    loss: str = "ppo"
    loss_options: tuple[tuple[str, Any], ...] = ()
    aggregation: str = "token-mean"
    norm_len: Optional[int] = None  # for seq-mean-token-sum-norm
    tis_cap: float = 2.0
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self):  # fail on a typo before anything is compiled, naming the config field
        for field, registry, name in (
            ("rl.loss", losses.LOSSES, self.loss),
            ("rl.aggregation", losses.AGGREGATIONS, self.aggregation),
            ("rl.kl_estimator", losses.KL_ESTIMATORS, self.kl_estimator),
        ):
            if name not in registry:
                raise ValueError(f"{field}: unknown {registry.kind} {name!r}; registered: {registry.names()}")
        losses.LOSSES.check_options(self.loss, dict(self.loss_options), "rl.loss_options")
        if self.aggregation == "seq-mean-token-sum-norm" and not self.norm_len:
            raise ValueError("rl.aggregation: 'seq-mean-token-sum-norm' needs norm_len (rollout.max_len)")


def objective(
    cfg: ObjectiveConfig,
    logp: jnp.ndarray,
    old_logp: jnp.ndarray,
    advantages: jnp.ndarray,
    mask: jnp.ndarray,
    *,
    entropy: Optional[jnp.ndarray] = None,
    behav_logp: Optional[jnp.ndarray] = None,
    ref_logp: Optional[jnp.ndarray] = None,
    norms: Optional[dict] = None,
) -> tuple[jnp.ndarray, dict]:
    """Scalar loss and metrics for one (micro-)batch of ``[B, T]`` arrays.

    ``behav_logp`` enables the truncated-IS correction (old_logp recomputed by the trainer);
    ``ref_logp`` is required when ``kl_coef > 0``. ``norms``: the mini-batch normalisers for gradient
    accumulation, ``num_tokens``, ``num_seqs`` and ``num_rows`` (see ``losses.aggregate``; None: this batch's own).
    """
    norms = dict(norm_len=cfg.norm_len, num_tokens=None, num_seqs=None, num_rows=None) | (norms or {})
    per_token, metrics = losses.compute(
        cfg.loss,
        logp,
        old_logp,
        advantages,
        mask,
        behav_logp=behav_logp,
        tis_cap=cfg.tis_cap,
        **dict(cfg.loss_options),
    )
    pg_loss = losses.aggregate(per_token, mask, cfg.aggregation, **norms)
    total = pg_loss
    metrics = {**metrics, "pg_loss": pg_loss}
    if cfg.kl_coef:
        if ref_logp is None:
            raise ValueError("kl_coef > 0 needs ref_logp (a frozen reference policy)")
        kl_value = losses.aggregate(losses.kl(cfg.kl_estimator, logp, ref_logp), mask, cfg.aggregation, **norms)
        total = total + cfg.kl_coef * kl_value
        metrics["kl"] = kl_value
    if entropy is not None:
        entropy_value = losses.aggregate(entropy, mask, cfg.aggregation, **norms)
        metrics["entropy"] = entropy_value
        if cfg.entropy_coef:
            total = total - cfg.entropy_coef * entropy_value
    elif cfg.entropy_coef:
        raise ValueError("entropy_coef > 0 needs the per-token entropy")
    metrics["loss"] = total
    return total, metrics
