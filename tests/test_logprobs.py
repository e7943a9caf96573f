"""Chunked token log-probs/entropy equal the dense path, and never hold [B, T, V] float32."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax.rl.logprobs import token_logprobs, token_logprobs_dense


def _inputs(B, T, D=16, V=97, seed=0):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    hidden = jax.random.normal(k[0], (B, T, D))
    head = jax.random.normal(k[1], (D, V)) * 0.5
    targets = jax.random.randint(k[2], (B, T), 0, V)
    mask = (jax.random.uniform(k[3], (B, T)) < 0.8).astype(jnp.float32)
    return hidden, head, targets, mask


def numpy_reference(hidden, head, targets, temperature):
    logits = np.einsum("btd,dv->btv", np.asarray(hidden, np.float64), np.asarray(head, np.float64))
    logits = logits / np.broadcast_to(np.asarray(temperature, np.float64).reshape(-1, 1, 1), (logits.shape[0], 1, 1))
    logits -= logits.max(-1, keepdims=True)
    logp_all = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    logp = np.take_along_axis(logp_all, np.asarray(targets)[..., None], -1)[..., 0]
    entropy = -(np.exp(logp_all) * logp_all).sum(-1)
    return logp, entropy


@pytest.mark.parametrize(
    "B,T,chunk", [(3, 7, 4), (3, 7, 5), (2, 5, 1000), (4, 8, 8), (1, 1, 3), (2, 10, 14), (4, 9, 28)]
)
def test_chunked_equals_dense_values_and_grads(B, T, chunk):
    hidden, head, targets, mask = _inputs(B, T, seed=B * T + chunk)
    mask = mask.at[0].set(0.0)  # a fully padded row
    temperature = jnp.linspace(0.6, 1.2, B)

    def objective(fn, hidden, head):
        logp, entropy = fn(hidden, head, targets, temperature)
        return ((logp + 0.1 * entropy) * mask).sum(), (logp, entropy)

    dense = jax.value_and_grad(lambda h, w: objective(token_logprobs_dense, h, w), argnums=(0, 1), has_aux=True)
    chunked = jax.value_and_grad(
        lambda h, w: objective(lambda *a: token_logprobs(*a, chunk_size=chunk), h, w), argnums=(0, 1), has_aux=True
    )
    (v_d, (lp_d, ent_d)), g_d = jax.jit(dense)(hidden, head)
    (v_c, (lp_c, ent_c)), g_c = jax.jit(chunked)(hidden, head)
    np.testing.assert_allclose(lp_c, lp_d, atol=1e-5)
    np.testing.assert_allclose(ent_c, ent_d, atol=1e-5)
    np.testing.assert_allclose(v_c, v_d, atol=1e-5, rtol=1e-6)
    for a, b in zip(g_c, g_d):
        np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)
    ref_logp, ref_entropy = numpy_reference(hidden, head, targets, temperature)
    np.testing.assert_allclose(lp_c, ref_logp, atol=1e-4)
    np.testing.assert_allclose(ent_c, ref_entropy, atol=1e-4)


def test_chunked_never_materialises_full_logits():
    B, T, D, V = 8, 512, 32, 4096  # [B, T, V] float32 = 64 MiB
    hidden, head, targets, mask = _inputs(B, T, D, V)

    def loss(fn):
        return lambda h, w: (fn(h, w, targets, 1.0)[0] * mask).sum()

    def temp_bytes(fn):
        compiled = jax.jit(jax.grad(loss(fn), argnums=(0, 1))).lower(hidden, head).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    full = B * T * V * 4
    dense = temp_bytes(token_logprobs_dense)
    chunked = temp_bytes(lambda *a: token_logprobs(*a, chunk_size=64))
    assert dense >= full
    assert chunked < full / 8, (chunked, full)


@pytest.mark.slow
def test_a_shared_prefix_computed_once_gives_the_log_probs_and_gradients_of_whole_rows():
    """``shared_prefix_logprobs`` (the prefix as a one-row cache every row attends to) equals
    ``sequence_logprobs`` of the whole right-padded rows at the columns after the prefix (log-probs
    in chunks of 8 tokens; the warm-up's equivalence test covers the one-chunk path)."""
    from mtrl_jax.model import ModelConfig, init_params
    from mtrl_jax.rl.logprobs import sequence_logprobs, shared_prefix_logprobs

    cfg = ModelConfig(
        vocab_size=61,
        hidden_size=32,
        intermediate_size=48,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
        tie_word_embeddings=True,
        attention_chunk=8,
    )
    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    P, S, B = 9, 13, 4
    prefix = rng.integers(0, 61, P).astype(np.int32)
    rest = rng.integers(0, 61, (B, S)).astype(np.int32)
    att = (np.arange(S)[None] < np.array([S, 5, 1, 11])[:, None]).astype(np.int32)  # right-padded, one row of 1 token
    weights = jnp.asarray(rng.uniform(0.5, 1.5, (B, S)).astype(np.float32) * att)
    whole = np.concatenate([np.broadcast_to(prefix, (B, P)), rest], axis=1)
    whole_att = np.concatenate([np.ones((B, P), np.int32), att], axis=1)

    def by_rows(p):
        logp, entropy = sequence_logprobs(cfg, p, whole, whole_att, chunk_size=8)
        return ((logp[:, P:] + 0.1 * entropy[:, P:]) * weights).sum(), logp[:, P:]

    def shared(p):
        logp, entropy = shared_prefix_logprobs(cfg, p, jnp.asarray(prefix), rest, att, chunk_size=8)
        return ((logp + 0.1 * entropy) * weights).sum(), logp

    (v1, logp1), g1 = jax.jit(jax.value_and_grad(by_rows, has_aux=True))(params)
    (v2, logp2), g2 = jax.jit(jax.value_and_grad(shared, has_aux=True))(params)
    np.testing.assert_allclose(np.asarray(logp2) * att, np.asarray(logp1) * att, atol=2e-5)
    np.testing.assert_allclose(float(v2), float(v1), rtol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=2e-5, rtol=1e-4), g1, g2)


@pytest.mark.slow
def test_logprobs_at_columns_equal_the_whole_sequence_read_there():
    """``logprobs_at`` runs the head at given columns only: the same log-probs, entropies and gradients
    as ``sequence_logprobs`` (or ``shared_prefix_logprobs`` after a shared prefix) read at those columns."""
    from mtrl_jax.model import ModelConfig, init_params
    from mtrl_jax.rl.logprobs import logprobs_at, sequence_logprobs, shared_prefix_logprobs

    cfg = ModelConfig(
        vocab_size=50,
        hidden_size=16,
        intermediate_size=32,
        num_layers=2,
        num_heads=2,
        num_kv_heads=1,
        head_dim=8,
        attention_chunk=4,
    )
    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, 50, size=(3, 11)), jnp.int32)
    attention = jnp.asarray((np.arange(11)[None] < np.array([[11], [8], [5]])).astype(np.int32))
    columns = jnp.asarray([[1, 4, 10, 0], [2, 3, 7, 0], [1, 2, 3, 4]], jnp.int32)
    weights = jnp.asarray([[1, 1, 1, 0], [1, 1, 1, 0], [1, 1, 1, 1]], jnp.float32)
    prefix = jnp.asarray([7, 8, 9], jnp.int32)
    for prefix_ in (None, prefix):

        def at(p):
            logp, ent = logprobs_at(
                cfg,
                p,
                tokens,
                attention,
                columns if prefix_ is not None else columns.at[2, 0].set(1),
                0.9,
                4,
                prefix=prefix_,
            )
            return (logp * weights).sum() + 0.1 * (ent * weights).sum(), (logp, ent)

        def whole(p):
            if prefix_ is None:
                logp, ent = sequence_logprobs(cfg, p, tokens, attention, 0.9, 4)
                cols = columns.at[2, 0].set(1)
            else:
                logp, ent = shared_prefix_logprobs(cfg, p, prefix_, tokens, attention, 0.9, 4)
                cols = columns
            logp, ent = jnp.take_along_axis(logp, cols, 1), jnp.take_along_axis(ent, cols, 1)
            return (logp * weights).sum() + 0.1 * (ent * weights).sum(), (logp, ent)

        (v1, (l1, e1)), g1 = jax.jit(jax.value_and_grad(at, has_aux=True))(params)
        (v2, (l2, e2)), g2 = jax.jit(jax.value_and_grad(whole, has_aux=True))(params)
        np.testing.assert_allclose(l1 * weights, l2 * weights, atol=1e-5)
        np.testing.assert_allclose(e1 * weights, e2 * weights, atol=1e-5)
        np.testing.assert_allclose(v1, v2, rtol=1e-5)
        for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g2)):
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)
