"""Group-relative advantage estimators, registered by name.

Conventions follow docs/algorithms.md: a batch is ``P`` prompts x ``G`` samples laid out
contiguously (rows ``p*G .. p*G+G-1`` belong to prompt ``p``), rewards are ``[P*G]`` and every
estimator returns ``[P*G]`` advantages (one scalar per trajectory, broadcast over its tokens).

Add an estimator without editing this file::

    from mtrl_jax.rl import advantages

    @advantages.register("median_baseline")
    def median_baseline(rewards, group_size, loss_mask):
        groups = rewards.reshape(-1, group_size)
        return (groups - jnp.median(groups, axis=1, keepdims=True)).reshape(-1)

and select it with ``--config.rl.advantage=median_baseline``.
"""

from __future__ import annotations

import math

import chex
import jax.numpy as jnp
import numpy as np

from mtrl_jax.rl.registry import Registry

EPS = 1e-6

# fn(rewards [P*G], group_size (static int), loss_mask [P*G, T], **options) -> advantages [P*G]
ESTIMATORS = Registry("advantage estimator", ("rewards", "group_size", "loss_mask"))
register = ESTIMATORS.register
names = ESTIMATORS.names
get = ESTIMATORS.get


def compute(name: str, rewards: jnp.ndarray, group_size: int, loss_mask=None, **options) -> jnp.ndarray:
    """Advantages ``[P*G]`` float32 of ``rewards [P*G]`` with the estimator registered as ``name``.

    ``group_size`` is static (a Python int); the function is jit-compatible. ``loss_mask [P*G, T]``
    is the batch's loss mask; without one every trajectory counts as a single sampled token.
    """
    chex.assert_rank(rewards, 1)
    if group_size < 1 or rewards.shape[0] % group_size:
        raise ValueError(f"rewards of length {rewards.shape[0]} do not split into groups of size {group_size}")
    rewards = jnp.asarray(rewards, jnp.float32)
    loss_mask = (
        jnp.ones((rewards.shape[0], 1), jnp.float32) if loss_mask is None else jnp.asarray(loss_mask, jnp.float32)
    )
    chex.assert_rank(loss_mask, 2)
    chex.assert_equal(loss_mask.shape[0], rewards.shape[0])
    adv = ESTIMATORS(name, rewards, group_size, loss_mask, **options)
    chex.assert_shape(adv, rewards.shape)
    return adv.astype(jnp.float32)


def _groups(rewards: jnp.ndarray, group_size: int) -> jnp.ndarray:
    """``[P, G]`` rewards shifted by their group's max. Every estimator here is shift-invariant, and
    after the shift an all-equal group is exactly zero, so its mean, std and advantages are exactly 0
    in float32 (the float32 mean of G copies of 0.7 is not 0.7, and ``/ (std + 1e-6)`` would amplify
    the one-ulp difference into advantages of +-0.1)."""
    groups = rewards.reshape(-1, group_size)
    return groups - groups.max(axis=1, keepdims=True)


@register("grpo")
def grpo(
    rewards: jnp.ndarray, group_size: int, loss_mask: jnp.ndarray, scale: str = "group", std_floor: float = 0.0
) -> jnp.ndarray:
    """GRPO (Shao et al. 2024): ``(r - mean_g) / (std_g + 1e-6)``, unbiased std (ddof=1).

    ``scale="batch"`` divides by the std of the whole batch (mean still per group);
    ``scale="none"`` is Dr.GRPO (Liu et al. 2025): ``r - mean_g``. Groups of size 1 give 0.
    ``std_floor`` (``"group"`` and ``"batch"``): divide by ``max(std, std_floor) + 1e-6``, so a group
    whose rewards differ by less than the floor is not scaled up to unit advantages (0: GRPO exactly).
    """
    if std_floor < 0:
        raise ValueError(f"grpo: std_floor must be >= 0, got {std_floor!r}")
    if group_size == 1:
        return jnp.zeros_like(rewards)
    groups = _groups(rewards, group_size)
    centred = groups - groups.mean(axis=1, keepdims=True)
    if scale == "group":
        std = jnp.std(groups, axis=1, keepdims=True, ddof=1)
    elif scale == "batch":
        std = jnp.std(rewards, ddof=1) if rewards.shape[0] > 1 else jnp.zeros(())
    elif scale == "none":
        return centred.reshape(-1)
    else:
        raise ValueError(f"grpo: scale must be 'group', 'batch' or 'none', got {scale!r}")
    return (centred / (jnp.maximum(std, std_floor) + EPS)).reshape(-1)


@register("dr_grpo")
def dr_grpo(rewards: jnp.ndarray, group_size: int, loss_mask: jnp.ndarray) -> jnp.ndarray:
    """Dr.GRPO: GRPO without the std division (alias of ``grpo`` with ``scale="none"``)."""
    return grpo(rewards, group_size, loss_mask, scale="none")


@register("rloo")
def rloo(rewards: jnp.ndarray, group_size: int, loss_mask: jnp.ndarray) -> jnp.ndarray:
    """REINFORCE leave-one-out (Ahmadian et al. 2024): ``r_i - mean_{j != i} r_j``."""
    if group_size == 1:
        return jnp.zeros_like(rewards)
    groups = _groups(rewards, group_size)
    total = groups.sum(axis=1, keepdims=True)
    return ((group_size * groups - total) / (group_size - 1)).reshape(-1)


def passk_weights(group_size: int, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Constants of the best-of-k statistics over a group sorted ascending (1-based j).

    Returns ``(w [G], S [G, G])`` with ``w_j = C(j-1, k-1) / C(G, k)`` (probability that the
    j-th smallest is the max of a random k-subset) and ``S`` such that ``S @ g_sorted`` is
    ``s_(i) = [C(i-1,k-1) g_(i) + sum_{j>i} C(j-2,k-2) g_(j)] / C(G, k)``.
    Computed exactly with Python integers, then rounded once to float64.
    """
    if not 1 <= k <= group_size:
        raise ValueError(f"k must be in [1, group_size={group_size}], got {k}")
    total = math.comb(group_size, k)
    w = np.array([math.comb(j - 1, k - 1) / total for j in range(1, group_size + 1)])
    s = np.zeros((group_size, group_size))
    for i in range(1, group_size + 1):
        s[i - 1, i - 1] = math.comb(i - 1, k - 1) / total
        if k >= 2:
            for j in range(i + 1, group_size + 1):
                s[i - 1, j - 1] = math.comb(j - 2, k - 2) / total
    return w, s


@register("grpo_passk")
def grpo_passk(rewards: jnp.ndarray, group_size: int, loss_mask: jnp.ndarray, k: int = 2) -> jnp.ndarray:
    """GRPO advantage of the best-of-k reward, averaged over the k-subsets containing each sample.

    Chen et al. 2025 ("Pass@k Training"), extended to continuous rewards as in docs/algorithms.md:
    ``adv_(i) = ((G/k) s_(i) - mu) / (sigma + 1e-6)`` with ``mu``/``sigma`` the mean and population
    std of the max of a uniformly random k-subset. k = 1 reduces to GRPO with population std.
    """
    if not 1 <= k < group_size:
        raise ValueError(f"grpo_passk needs 1 <= k < group_size, got k={k}, group_size={group_size}")
    w_np, s_np = passk_weights(group_size, k)
    w = jnp.asarray(w_np, jnp.float32)
    s = jnp.asarray(s_np, jnp.float32)
    # Shifted by the group max (``_groups``), the degenerate case (every k-subset has the same max,
    # sigma = 0) is exactly 0 in float32: the samples below the max then only ever meet zero
    # weights. The two-pass variance avoids cancellation.
    groups = _groups(rewards, group_size)
    order = jnp.argsort(groups, axis=1)
    sorted_g = jnp.take_along_axis(groups, order, axis=1)
    mu = sorted_g @ w
    sigma = jnp.sqrt(((sorted_g - mu[:, None]) ** 2) @ w)
    subset_mean = sorted_g @ s.T  # [P, G] in sorted order
    adv_sorted = ((group_size / k) * subset_mean - mu[:, None]) / (sigma[:, None] + EPS)
    inverse = jnp.argsort(order, axis=1)
    return jnp.take_along_axis(adv_sorted, inverse, axis=1).reshape(-1)


@register("reinforce_pp_baseline")
def reinforce_pp_baseline(rewards: jnp.ndarray, group_size: int, loss_mask: jnp.ndarray) -> jnp.ndarray:
    """REINFORCE++ with a group baseline (Hu 2025): ``r - mean_g``, whitened over valid tokens.

    Each trajectory's advantage is weighted by its number of valid
    tokens in the batch mean and (population) std, exactly as whitening the ``[B, T]`` token
    advantages would. Returns ``[B]``; rows without valid tokens get the whitened value too but
    carry no loss. An all-zero mask returns the centred rewards unscaled.
    """
    groups = _groups(rewards, group_size)
    centred = (groups - groups.mean(axis=1, keepdims=True)).reshape(-1)
    counts = loss_mask.sum(axis=1)
    n = counts.sum()
    safe_n = jnp.maximum(n, 1.0)
    mean = (centred * counts).sum() / safe_n
    var = ((centred - mean) ** 2 * counts).sum() / safe_n
    whitened = (centred - mean) / (jnp.sqrt(var) + EPS)
    return jnp.where(n > 0, whitened, centred)
