"""Losses, KL, aggregation and the objective against numpy references from docs/algorithms.md."""

import math
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax.rl import losses
from mtrl_jax.rl.objective import ObjectiveConfig, objective

# ------------------------------------------------------------------ independent references
# Each returns (per-token loss, d loss / d logp) written element by element from the spec.


def _ratio(lp, olp):
    return math.exp(min(max(lp - olp, -20.0), 20.0))


def ref_ppo(lp, olp, A, clip_low=0.2, clip_high=0.28, clip_dual=3.0):
    r = _ratio(lp, olp)
    l1, l2 = -A * r, -A * min(max(r, 1 - clip_low), 1 + clip_high)
    loss, grad = (l1, -A * r) if l1 >= l2 else (l2, 0.0)
    if A < 0 and loss > -A * clip_dual:
        loss, grad = -A * clip_dual, 0.0
    return loss, grad


def ref_cispo(lp, olp, A, clip_low=1.0, clip_high=4.0):
    w = min(max(_ratio(lp, olp), 1 - clip_low), 1 + clip_high)
    return -w * A * lp, -w * A


def ref_is(lp, olp, A, is_cap=None):
    r = _ratio(lp, olp)
    if is_cap is not None and r > is_cap:
        return -is_cap * A, -is_cap * A
    return -r * A, -r * A


def ref_token_loss(name, lp, olp, A, opts):
    return {"ppo": ref_ppo, "cispo": ref_cispo, "is": ref_is}[name](lp, olp, A, **opts)


def ref_gspo(logp, old_logp, A, mask, clip_low=3e-4, clip_high=4e-4):
    B, T = logp.shape
    loss, grad = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        n = mask[b].sum()
        s = math.exp(sum(min(max(logp[b, t] - old_logp[b, t], -20), 20) for t in range(T) if mask[b, t]) / max(n, 1))
        for t in range(T):
            l1, l2 = -A[b] * s, -A[b] * min(max(s, 1 - clip_low), 1 + clip_high)
            loss[b, t], grad[b, t] = (l1, -A[b] * s) if l1 >= l2 else (l2, 0.0)
    return loss, grad


def ref_aggregate_weights(mask, mode, norm_len=None):
    """d agg / d L[b, t] for each mode: aggregation is linear in L."""
    B, T = mask.shape
    w = np.zeros((B, T))
    valid_rows = [b for b in range(B) if mask[b].sum() > 0]
    for b in range(B):
        for t in range(T):
            if not mask[b, t]:
                continue
            if mode == "token-mean":
                w[b, t] = 1 / mask.sum()
            elif mode == "seq-mean-token-mean":
                w[b, t] = 1 / (mask[b].sum() * len(valid_rows))
            elif mode == "seq-mean-token-sum":
                w[b, t] = 1 / len(valid_rows)
            else:
                w[b, t] = 1 / (B * norm_len)
    return w


MODES = losses.AGGREGATIONS.names()


def random_batch(seed, B=4, T=7, spread=0.5):
    rng = np.random.default_rng(seed)
    old_logp = np.log(rng.uniform(0.05, 0.95, size=(B, T)))
    logp = old_logp + rng.normal(scale=spread, size=(B, T))
    A = rng.normal(size=B)
    mask = (rng.uniform(size=(B, T)) < 0.7).astype(np.float64)
    mask[1] = 0  # a fully masked row
    return logp, old_logp, A, mask


# ------------------------------------------------------------------ test vectors


def test_ppo_vector_from_algorithms_md():
    old_logp = np.log([[0.2, 0.4, 0.1, 0.5]])
    ratio = np.array([[1.5, 0.5, 4.0, 1.1]])
    logp = jnp.asarray(old_logp + np.log(ratio), jnp.float32)
    A = jnp.array([[1.0, 1.0, -1.0, -1.0]])
    mask = jnp.array([[1.0, 1.0, 1.0, 0.0]])
    per_token, _ = losses.compute("ppo", logp, jnp.asarray(old_logp, jnp.float32), A, jnp.ones_like(mask))
    np.testing.assert_allclose(per_token, [[-1.28, -0.5, 3.0, 1.1]], atol=1e-5)

    def f(lp):
        per, _ = losses.compute("ppo", lp, jnp.asarray(old_logp, jnp.float32), A, mask)
        return losses.aggregate(per, mask, "token-mean")

    np.testing.assert_allclose(f(logp), 0.4066667, atol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(logp), [[0, -0.1666667, 0, 0]], atol=1e-6)


# ------------------------------------------------------------------ random comparisons


CASES = [
    ("ppo", {}),
    ("ppo", {"clip_low": 0.1, "clip_high": 0.1, "clip_dual": 2.0}),
    ("cispo", {}),
    ("cispo", {"clip_low": 0.2, "clip_high": 0.2}),
    ("is", {}),
    ("is", {"is_cap": 1.5}),
]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name,opts", CASES)
def test_loss_values_and_grads_match_reference(name, opts, mode):
    logp, old_logp, A, mask = random_batch(zlib.crc32(f"{name}{mode}{sorted(opts.items())}".encode()) % 1000)
    B, T = logp.shape
    ref_loss, ref_grad = np.zeros((B, T)), np.zeros((B, T))
    for b in range(B):
        for t in range(T):
            ref_loss[b, t], ref_grad[b, t] = ref_token_loss(name, logp[b, t], old_logp[b, t], A[b], opts)
    weights = ref_aggregate_weights(mask, mode, norm_len=T)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def f(lp):
        per, _ = losses.compute(name, lp, f32(old_logp), f32(A), f32(mask), **opts)
        return losses.aggregate(per, f32(mask), mode, norm_len=T), per

    (value, per), grad = jax.jit(jax.value_and_grad(f, has_aux=True))(f32(logp))
    np.testing.assert_allclose(per, ref_loss * mask, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(value, (weights * ref_loss).sum(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(grad, weights * ref_grad, rtol=1e-4, atol=1e-6)


def test_gspo_matches_reference():
    logp, old_logp, A, mask = random_batch(7, spread=3e-4)
    mask[0, :2] = 1
    ref_loss, ref_grad = ref_gspo(logp, old_logp, A, mask)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731

    def f(lp):
        per, _ = losses.compute("gspo", lp, f32(old_logp), f32(A), f32(mask))
        return losses.aggregate(per, f32(mask), "token-mean")

    weights = ref_aggregate_weights(mask, "token-mean")
    np.testing.assert_allclose(f(f32(logp)), (weights * ref_loss).sum(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(jax.grad(f)(f32(logp)), weights * ref_grad, rtol=1e-3, atol=1e-6)


def test_ppo_metrics():
    old = jnp.zeros((1, 5))
    ratio = jnp.array([[1.5, 0.5, 4.0, 1.1, 0.7]])
    A = jnp.array([[1.0, -1.0, -1.0, 1.0, 1.0]])
    mask = jnp.ones((1, 5))
    _, m = losses.compute("ppo", jnp.log(ratio), old, A, mask)
    # token 0: clipped high (A>0, r>1.28); token 1: clipped low (A<0, r<0.8); token 2: dual clip.
    np.testing.assert_allclose(m["clipfrac_high"], 1 / 5)
    np.testing.assert_allclose(m["clipfrac_low"], 1 / 5)
    np.testing.assert_allclose(m["clipfrac"], 2 / 5)
    np.testing.assert_allclose(m["clipfrac_dual"], 1 / 5)
    np.testing.assert_allclose(m["nonzero_grad_frac"], 2 / 5)
    np.testing.assert_allclose(m["is_weight_max"], 4.0, rtol=1e-6)
    np.testing.assert_allclose(m["is_weight_mean"], float(ratio.mean()), rtol=1e-6)
    np.testing.assert_allclose(m["approx_kl"], -float(jnp.log(ratio).mean()), rtol=1e-5)


def test_truncated_is_weight_multiplies_pg_term():
    logp, old_logp, A, mask = random_batch(3)
    behav = old_logp + np.random.default_rng(0).normal(scale=1.0, size=old_logp.shape)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    plain, _ = losses.compute("ppo", f32(logp), f32(old_logp), f32(A), f32(mask))
    corrected, m = losses.compute(
        "ppo", f32(logp), f32(old_logp), f32(A), f32(mask), behav_logp=f32(behav), tis_cap=2.0
    )
    tis = np.minimum(np.exp(old_logp - behav), 2.0)
    np.testing.assert_allclose(corrected, np.asarray(plain) * tis, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m["tis_max"], (tis * mask).max(), rtol=1e-5)
    np.testing.assert_allclose(m["tis_mean"], (tis * mask).sum() / mask.sum(), rtol=1e-5)


# ------------------------------------------------------------------ KL and entropy


def test_kl_estimators():
    d = np.array([[-50.0, -1.0, 0.0, 0.5, 50.0]])
    ref = np.zeros_like(d)
    lp, rlp = jnp.asarray(d, jnp.float32), jnp.zeros((1, 5))
    np.testing.assert_allclose(losses.kl("k1", lp, rlp), d)
    np.testing.assert_allclose(losses.kl("k2", lp, rlp), d**2 / 2, rtol=1e-6)
    for i, x in enumerate(d[0]):
        ref[0, i] = min(max(math.exp(min(max(-x, -20), 20)) + x - 1, -10), 10)
    np.testing.assert_allclose(losses.kl("k3", lp, rlp), ref, rtol=1e-5)
    with pytest.raises(ValueError, match="unknown KL estimator"):
        losses.kl("k4", lp, rlp)


def test_objective_combines_kl_and_entropy():
    logp, old_logp, A, mask = random_batch(5)
    rng = np.random.default_rng(1)
    ref_logp = logp + rng.normal(scale=0.1, size=logp.shape)
    entropy = rng.uniform(0, 3, size=logp.shape)
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    cfg = ObjectiveConfig(
        loss="cispo", aggregation="seq-mean-token-mean", kl_coef=0.1, kl_estimator="k2", entropy_coef=0.01
    )
    total, m = objective(cfg, f32(logp), f32(old_logp), f32(A), f32(mask), entropy=f32(entropy), ref_logp=f32(ref_logp))
    w = ref_aggregate_weights(mask, "seq-mean-token-mean")
    pg = sum(w[b, t] * ref_cispo(logp[b, t], old_logp[b, t], A[b])[0] for b in range(4) for t in range(7))
    kl = (w * (logp - ref_logp) ** 2 / 2).sum()
    ent = (w * entropy).sum()
    np.testing.assert_allclose(total, pg + 0.1 * kl - 0.01 * ent, rtol=1e-5)
    np.testing.assert_allclose(m["entropy"], ent, rtol=1e-5)
    with pytest.raises(ValueError, match="ref_logp"):
        objective(cfg, f32(logp), f32(old_logp), f32(A), f32(mask), entropy=f32(entropy))


# ------------------------------------------------------------------ edge cases


@pytest.mark.parametrize("name", ["ppo", "cispo", "is", "gspo"])
@pytest.mark.parametrize("mode", MODES)
def test_all_zero_mask_gives_zero_not_nan(name, mode):
    logp = jnp.full((3, 4), -1.0)
    mask = jnp.zeros((3, 4))

    def f(lp):
        per, metrics = losses.compute(name, lp, lp - 0.3, jnp.ones(3), mask)
        return losses.aggregate(per, mask, mode, norm_len=4), metrics

    (value, metrics), grad = jax.value_and_grad(f, has_aux=True)(logp)
    assert float(value) == 0.0
    assert np.all(np.asarray(grad) == 0)
    assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("name", ["ppo", "cispo", "is", "gspo"])
def test_extreme_log_ratios_are_finite(name):
    logp = jnp.array([[-60.0, -0.1, -55.0, -1.0]])
    old = jnp.array([[-10.0, -50.1, -5.0, -51.0]])  # log-ratios of -50, +50, -50, +50
    A = jnp.array([[1.0, -1.0, -1.0, 1.0]])
    mask = jnp.ones((1, 4))

    def f(lp):
        per, metrics = losses.compute(name, lp, old, A, mask, behav_logp=old + 50.0)
        return losses.aggregate(per, mask), metrics

    (value, metrics), grad = jax.value_and_grad(f, has_aux=True)(logp)
    assert np.isfinite(float(value)) and np.all(np.isfinite(np.asarray(grad)))
    assert all(np.isfinite(float(v)) for v in metrics.values())


@pytest.mark.parametrize("name,opts", CASES)
def test_bfloat16_inputs(name, opts):
    logp, old_logp, A, mask = random_batch(11, spread=0.1)
    bf = lambda x: jnp.asarray(x, jnp.bfloat16)  # noqa: E731
    per_bf, _ = losses.compute(name, bf(logp), bf(old_logp), bf(A), bf(mask), **opts)
    assert per_bf.dtype == jnp.float32
    f32 = lambda x: jnp.asarray(jnp.asarray(x, jnp.bfloat16), jnp.float32)  # noqa: E731
    per_32, _ = losses.compute(name, f32(logp), f32(old_logp), f32(A), f32(mask), **opts)
    np.testing.assert_allclose(per_bf, per_32, rtol=1e-6)


# ------------------------------------------------------------------ gradient accumulation


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", ["ppo", "cispo"])
def test_micro_batch_accumulation_equals_full_batch(name, mode):
    logp, old_logp, A, mask = random_batch(21, B=8, T=6)
    mask[5] = 0
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    logp, old_logp, A, mask = map(f32, (logp, old_logp, A, mask))
    norms = dict(num_tokens=mask.sum(), num_seqs=(mask.sum(1) > 0).sum(), num_rows=8)

    def loss(lp, olp, a, m, **kw):
        per, _ = losses.compute(name, lp, olp, a, m)
        return losses.aggregate(per, m, mode, norm_len=6, **kw)

    full = jax.grad(loss)(logp, old_logp, A, mask)
    micro = [
        jax.grad(loss)(logp[i : i + 2], old_logp[i : i + 2], A[i : i + 2], mask[i : i + 2], **norms)
        for i in range(0, 8, 2)
    ]
    np.testing.assert_allclose(jnp.concatenate(micro), full, rtol=1e-6, atol=1e-8)


def test_shape_and_name_errors():
    with pytest.raises(ValueError, match="unknown loss 'nope'"):
        losses.compute("nope", jnp.zeros((2, 3)), jnp.zeros((2, 3)), jnp.zeros(2), jnp.ones((2, 3)))
    with pytest.raises(AssertionError):
        losses.compute("ppo", jnp.zeros((2, 3)), jnp.zeros((2, 4)), jnp.zeros(2), jnp.ones((2, 3)))
    with pytest.raises(ValueError, match="norm_len"):
        losses.aggregate(jnp.zeros((2, 3)), jnp.ones((2, 3)), "seq-mean-token-sum-norm")
    with pytest.raises(ValueError, match="rl.aggregation"):
        ObjectiveConfig(aggregation="mean")
