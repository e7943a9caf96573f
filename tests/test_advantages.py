"""Advantage estimators against plain-numpy references written from docs/algorithms.md."""

import itertools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax.rl import advantages


# ------------------------------------------------------------------ independent references


def ref_grpo(rewards, G, scale="group", std_floor=0.0):
    r = np.asarray(rewards, np.float64)
    out = np.zeros_like(r)
    batch_std = np.std(r, ddof=1) if len(r) > 1 else 0.0
    for p in range(len(r) // G):
        g = r[p * G : (p + 1) * G]
        if G == 1:
            continue
        mean = sum(g) / G
        std = math.sqrt(sum((x - mean) ** 2 for x in g) / (G - 1))
        for i in range(G):
            if scale == "group":
                out[p * G + i] = (g[i] - mean) / (max(std, std_floor) + 1e-6)
            elif scale == "batch":
                out[p * G + i] = (g[i] - mean) / (max(batch_std, std_floor) + 1e-6)
            else:
                out[p * G + i] = g[i] - mean
    return out


def ref_rloo(rewards, G):
    r = np.asarray(rewards, np.float64)
    out = np.zeros_like(r)
    if G == 1:
        return out
    for p in range(len(r) // G):
        for i in range(G):
            others = [r[p * G + j] for j in range(G) if j != i]
            out[p * G + i] = r[p * G + i] - sum(others) / len(others)
    return out


def brute_passk(group, k):
    """Enumerate every k-subset: mean of the subset max over subsets containing i, vs all."""
    G = len(group)
    subsets = list(itertools.combinations(range(G), k))
    maxes = np.array([max(group[j] for j in s) for s in subsets])
    mu = maxes.mean()
    sigma = maxes.std()  # population
    out = []
    for i in range(G):
        mine = [max(group[j] for j in s) for s in subsets if i in s]
        out.append((np.mean(mine) - mu) / (sigma + 1e-6))
    return np.array(out)


# ------------------------------------------------------------------ test vectors


def test_vectors_from_algorithms_md():
    np.testing.assert_allclose(
        advantages.compute("grpo", jnp.array([1.0, 0, 0, 1]), 4),
        [0.8660239, -0.8660239, -0.8660239, 0.8660239],
        atol=1e-6,
    )
    np.testing.assert_allclose(
        advantages.compute("rloo", jnp.array([0.2, 0.5, 0.9]), 3), [-0.5, -0.05, 0.55], atol=1e-6
    )
    np.testing.assert_allclose(
        advantages.compute("grpo_passk", jnp.array([1.0, 0, 0, 0]), 4, k=2),
        [0.999998, -0.3333327, -0.3333327, -0.3333327],
        atol=1e-6,
    )


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("G", [1, 2, 5, 8])
def test_grpo_random(scale, G):
    r = np.random.default_rng(G).normal(size=4 * G)
    got = jax.jit(lambda x: advantages.compute("grpo", x, G, scale=scale))(jnp.asarray(r, jnp.float32))
    np.testing.assert_allclose(got, ref_grpo(r, G, scale), atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("scale", ["group", "batch"])
def test_grpo_std_floor(scale):
    # groups of small and large reward spread: the floor damps only the groups (or batch) below it
    r = np.array([0.80, 0.82, 0.84, 0.86, 0.0, 0.5, 1.0, 0.2, 0.3, 0.3, 0.3, 0.3])
    for floor in (0.05, 0.3, 2.0):
        got = advantages.compute("grpo", jnp.asarray(r, jnp.float32), 4, scale=scale, std_floor=floor)
        np.testing.assert_allclose(got, ref_grpo(r, 4, scale, floor), atol=2e-5, rtol=1e-5)
    damped = np.asarray(advantages.compute("grpo", jnp.asarray(r, jnp.float32), 4, std_floor=0.3)).reshape(3, 4)
    plain = np.asarray(advantages.compute("grpo", jnp.asarray(r, jnp.float32), 4)).reshape(3, 4)
    assert np.abs(damped[0]).max() < 0.2 * np.abs(plain[0]).max()  # the 0.026-std group is damped
    np.testing.assert_allclose(damped[1], plain[1], rtol=1e-5)  # the 0.43-std group is not
    assert (damped[2] == 0).all() and (plain[2] == 0).all()  # an all-equal group: exact zeros either way
    with pytest.raises(ValueError, match="std_floor must be >= 0"):
        advantages.compute("grpo", jnp.asarray(r, jnp.float32), 4, std_floor=-1.0)


def test_dr_grpo_alias():
    r = jnp.array([0.1, 0.9, 0.3, -1.0, 0.5, 0.5])
    np.testing.assert_allclose(advantages.compute("dr_grpo", r, 3), ref_grpo(np.asarray(r), 3, "none"), atol=1e-6)


@pytest.mark.parametrize("G", [1, 2, 3, 7])
def test_rloo_random(G):
    r = np.random.default_rng(10 + G).uniform(-1, 1, size=3 * G)
    np.testing.assert_allclose(advantages.compute("rloo", jnp.asarray(r, jnp.float32), G), ref_rloo(r, G), atol=1e-5)


@pytest.mark.parametrize(
    "name,opts", [("grpo", {}), ("grpo", {"scale": "batch"}), ("rloo", {}), ("grpo_passk", {"k": 2})]
)
def test_all_equal_groups_give_zero(name, opts):
    r = jnp.array([0.3] * 4 + [-1.0] * 4)
    np.testing.assert_allclose(advantages.compute(name, r, 4, **opts), 0.0, atol=1e-6)


@pytest.mark.parametrize(
    "name,opts",
    [
        ("grpo", {"scale": "group"}),
        ("grpo", {"scale": "batch"}),
        ("grpo", {"scale": "none"}),
        ("dr_grpo", {}),
        ("rloo", {}),
        ("grpo_passk", {"k": 1}),
        ("grpo_passk", {"k": 3}),
    ],
)
def test_all_equal_groups_give_exactly_zero_in_float32(name, opts):
    """docs/algorithms.md: an all-equal group gives exactly 0 for any value and group size (float32's group
    mean of equal values is off by an ulp unless the estimator shifts first)."""
    values = [0.7, 0.1, 1 / 3, -1.0, 0.123456789, 0.9999, 1e-3, 0.0]
    for G in (4, 5, 7, 8, 16):
        rng = np.random.default_rng(G)
        other = rng.uniform(-1, 1, size=G)  # one informative group so that batch-scale std is not 0
        rewards = jnp.asarray(np.concatenate([np.full(G, v, np.float32) for v in values] + [other]), jnp.float32)
        adv = np.asarray(advantages.compute(name, rewards, G, **opts)).reshape(-1, G)
        assert (adv[:-1] == 0.0).all(), (G, adv[:-1][adv[:-1] != 0])


def test_registry_options_are_checked_by_name():
    with pytest.raises(ValueError, match=r"does not take \['k'\]; it takes scale='group', std_floor=0.0"):
        advantages.compute("grpo", jnp.zeros(4), 2, k=2)
    with pytest.raises(ValueError, match="it takes no options"):
        advantages.compute("rloo", jnp.zeros(4), 2, scale="batch")


def test_scoped_options_apply_only_to_their_entry():
    from mtrl_jax.rl.registry import parse_options

    text = "grpo:scale=batch, grpo_passk:k=4"
    assert parse_options(text, "f", advantages.ESTIMATORS, "grpo") == {"scale": "batch"}
    assert parse_options(text, "f", advantages.ESTIMATORS, "grpo_passk") == {"k": 4}
    assert parse_options(text, "f", advantages.ESTIMATORS, "rloo") == {}  # rloo takes none: no error
    assert parse_options("k=3,grpo_passk:scale=x", "f", advantages.ESTIMATORS, "rloo") == {"k": 3}
    with pytest.raises(
        ValueError, match=r"f: 'gpro:scale=batch' is scoped to 'gpro', which is not a registered advantage estimator"
    ):
        parse_options("gpro:scale=batch", "f", advantages.ESTIMATORS, "grpo")
    with pytest.raises(ValueError, match=r"f: option 'k' given twice"):
        parse_options("k=2,grpo_passk:k=4", "f", advantages.ESTIMATORS, "grpo_passk")
    with pytest.raises(ValueError, match=r"must be NAME=VALUE or ENTRY:NAME=VALUE"):
        parse_options(":k=2", "f", advantages.ESTIMATORS, "grpo_passk")
    with pytest.raises(ValueError, match=r"need a selected entry"):
        parse_options("grpo:scale=batch", "f")
    # the default config's scoped option: GRPO gets its std floor, another estimator nothing
    from configs import default
    from mtrl_jax.setup import update_config

    config = default.get_config()
    assert dict(update_config(config).advantage_options) == {"std_floor": 0.1}
    config.rl.advantage = "rloo"
    assert dict(update_config(config).advantage_options) == {}


def test_every_estimator_receives_the_loss_mask():
    seen = []
    with advantages.ESTIMATORS.restoring():

        @advantages.register("mask_spy")
        def mask_spy(rewards, group_size, loss_mask):
            seen.append(loss_mask.shape)
            return rewards * loss_mask.sum(1)

        mask = jnp.asarray([[1, 1, 0], [1, 0, 0]], jnp.float32)
        np.testing.assert_allclose(advantages.compute("mask_spy", jnp.array([1.0, 3.0]), 2, mask), [2.0, 3.0])
        assert seen == [(2, 3)]
    assert "mask_spy" not in advantages.names()


def test_group_of_one_gives_zero():
    r = jnp.array([0.3, -1.0, 0.7])
    for name in ["grpo", "rloo", "dr_grpo"]:
        np.testing.assert_array_equal(advantages.compute(name, r, 1), 0.0)


def _passk_groups():
    rng = np.random.default_rng(0)
    for G in range(2, 9):
        ndcg = rng.uniform(0, 1, size=G).round(2)
        ndcg[rng.uniform(size=G) < 0.3] = -1.0  # failures mixed in
        yield G, ndcg
        yield G, rng.integers(0, 3, size=G).astype(float) / 2  # many ties
        yield G, rng.integers(0, 2, size=G).astype(float)  # binary


@pytest.mark.parametrize("G,group", list(_passk_groups()))
def test_grpo_passk_matches_brute_force(G, group):
    for k in range(1, G):
        got = advantages.compute("grpo_passk", jnp.asarray(group, jnp.float32), G, k=k)
        np.testing.assert_allclose(
            got, brute_passk(list(group), k), atol=3e-4, rtol=1e-4, err_msg=f"G={G} k={k} group={group}"
        )


def test_grpo_passk_k1_is_grpo_with_population_std():
    r = np.random.default_rng(3).uniform(size=6)
    expected = (r - r.mean()) / (r.std() + 1e-6)
    np.testing.assert_allclose(
        advantages.compute("grpo_passk", jnp.asarray(r, jnp.float32), 6, k=1), expected, atol=1e-5
    )


def test_grpo_passk_binary_matches_chen_et_al_closed_form():
    # Pass@k Training (Chen et al. 2025): with c correct of G, the group pass@k is
    # 1 - C(G-c, k)/C(G, k); positives get (1 - pass)/std and negatives a smaller magnitude.
    G, k = 8, 3
    group = np.array([1, 0, 0, 1, 0, 0, 0, 0], float)
    c = int(group.sum())
    pass_k = 1 - math.comb(G - c, k) / math.comb(G, k)
    std = math.sqrt(pass_k * (1 - pass_k))
    pos = (1 - pass_k) / (std + 1e-6)
    neg = (1 - pass_k - math.comb(G - c - 1, k - 1) / math.comb(G - 1, k - 1)) / (std + 1e-6)
    got = np.asarray(advantages.compute("grpo_passk", jnp.asarray(group, jnp.float32), G, k=k))
    np.testing.assert_allclose(got[group == 1], pos, atol=1e-5)
    np.testing.assert_allclose(got[group == 0], neg, atol=1e-5)


def test_grpo_passk_rejects_bad_k():
    with pytest.raises(ValueError, match="k"):
        advantages.compute("grpo_passk", jnp.zeros(4), 4, k=4)


def test_reinforce_pp_baseline_whitens_over_tokens():
    rng = np.random.default_rng(1)
    r = rng.uniform(size=6)
    mask = (rng.uniform(size=(6, 5)) < 0.6).astype(np.float32)
    mask[2] = 0
    got = np.asarray(advantages.compute("reinforce_pp_baseline", jnp.asarray(r, jnp.float32), 3, jnp.asarray(mask)))
    centred = np.concatenate([g - g.mean() for g in r.reshape(2, 3)])
    tokens = [centred[b] for b in range(6) for t in range(5) if mask[b, t]]
    expected = (centred - np.mean(tokens)) / (np.std(tokens) + 1e-6)
    np.testing.assert_allclose(got, expected, atol=1e-5)


def test_bfloat16_rewards():
    r = jnp.array([1.0, 0, 0, 1], jnp.bfloat16)
    got = advantages.compute("grpo", r, 4)
    assert got.dtype == jnp.float32
    np.testing.assert_allclose(got, [0.8660239, -0.8660239, -0.8660239, 0.8660239], atol=1e-5)


def test_bad_group_size_and_unknown_name():
    with pytest.raises(ValueError, match="groups of size 3"):
        advantages.compute("grpo", jnp.zeros(4), 3)
    with pytest.raises(ValueError, match="unknown advantage estimator 'nope'"):
        advantages.compute("nope", jnp.zeros(4), 2)
