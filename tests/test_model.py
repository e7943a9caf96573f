"""Policy model: HF parity, strict loading, export round trip, sharding, scan, dtypes."""

import json
import pathlib
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax.model import (
    ModelConfig,
    abstract_params,
    compute_logits,
    forward,
    hf_io,
    init_params,
    load_hf_checkpoint,
    save_hf_checkpoint,
)
from mtrl_jax.model import sharding
from mtrl_jax.model.transformer import causal_attention, init_cache, unstack_layers

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
DECODERS = ["qwen2", "qwen3_tied", "qwen3_untied", "llama"]


def reference(name):
    ref = np.load(FIXTURES / name / "reference.npz")
    return ref["tokens"], ref["attention_mask"], ref["logits"]


@pytest.mark.parametrize("name", DECODERS)
def test_logits_match_transformers(name):
    model, params = load_hf_checkpoint(FIXTURES / name)
    tokens, mask, ref_logits = reference(name)
    logits = np.asarray(compute_logits(model, params, jnp.asarray(tokens), jnp.asarray(mask)))
    assert logits.dtype == np.float32
    valid = mask.astype(bool)
    assert np.abs(logits - ref_logits)[valid].max() <= 1e-4


def test_fixture_variants_are_what_they_claim():
    cfgs = {n: load_hf_checkpoint(FIXTURES / n)[0].config for n in DECODERS}
    assert cfgs["qwen2"].qkv_bias and not cfgs["qwen2"].qk_norm
    assert cfgs["qwen3_tied"].qk_norm and cfgs["qwen3_tied"].tie_word_embeddings
    assert (
        not cfgs["qwen3_untied"].tie_word_embeddings
        and (FIXTURES / "qwen3_untied/model.safetensors.index.json").exists()
    )
    assert cfgs["llama"].rope_llama3_scaling is not None
    assert "rope_theta" in json.loads((FIXTURES / "qwen2/config.json").read_text())
    assert "rope_parameters" in json.loads((FIXTURES / "qwen3_tied/config.json").read_text())
    for name, cfg in cfgs.items():
        assert cfg.num_kv_heads < cfg.num_heads, name  # grouped-query attention
        assert sum(f.stat().st_size for f in (FIXTURES / name).iterdir()) < 1 << 20
    params = load_hf_checkpoint(FIXTURES / "qwen3_tied")[1]
    assert "lm_head" not in params


def test_rope_theta_both_places():
    base = dict(
        model_type="qwen3",
        vocab_size=8,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
    )
    assert ModelConfig.from_hf({**base, "rope_theta": 123.0}).rope_theta == 123.0
    assert (
        ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 77.0}}).rope_theta
        == 77.0
    )
    with pytest.raises(ValueError, match="rope theta"):
        ModelConfig.from_hf(base)
    with pytest.raises(ValueError, match="rope_type 'yarn'"):
        ModelConfig.from_hf({**base, "rope_theta": 1.0, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(ValueError, match="model_type 'gpt2'"):
        ModelConfig.from_hf({**base, "model_type": "gpt2"})


# ------------------------------------------------------------------ strictness


def _copy(tmp_path, name):
    dst = tmp_path / name
    shutil.copytree(FIXTURES / name, dst)
    return dst


def _rewrite(file, fn):
    tensors = {k: np.array(v) for k, v in hf_io.read_safetensors(file).items()}
    fn(tensors)
    hf_io.write_safetensors(tensors, file)


def test_missing_tensor_is_named(tmp_path):
    path = _copy(tmp_path, "qwen2")
    _rewrite(path / "model.safetensors", lambda t: t.pop("model.layers.1.self_attn.k_proj.bias"))
    with pytest.raises(ValueError, match=r"missing tensor 'model.layers.1.self_attn.k_proj.bias'"):
        load_hf_checkpoint(path)


def test_unmapped_tensor_is_named(tmp_path):
    path = _copy(tmp_path, "qwen3_tied")
    _rewrite(
        path / "model.safetensors", lambda t: t.__setitem__("model.layers.0.mlp.extra.weight", np.zeros(3, np.float32))
    )
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.extra.weight' .* not mapped"):
        load_hf_checkpoint(path)


def test_lm_head_in_tied_checkpoint_is_an_error(tmp_path):
    path = _copy(tmp_path, "qwen3_tied")
    _rewrite(path / "model.safetensors", lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"]))
    with pytest.raises(ValueError, match="lm_head.weight.*tie_word_embeddings"):
        load_hf_checkpoint(path)


def test_misshaped_tensor_is_named(tmp_path):
    path = _copy(tmp_path, "qwen2")
    _rewrite(path / "model.safetensors", lambda t: t.__setitem__("model.norm.weight", np.ones(31, np.float32)))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(31,\), expected \(32,\)"):
        load_hf_checkpoint(path)


def test_duplicated_tensor_across_shards_is_named(tmp_path):
    path = _copy(tmp_path, "qwen3_untied")
    first = sorted(path.glob("model-*.safetensors"))[0]
    second = sorted(path.glob("model-*.safetensors"))[1]
    name = next(iter(hf_io.read_safetensors(first)))
    value = np.array(hf_io.read_safetensors(first)[name])
    _rewrite(second, lambda t: t.__setitem__(name, value))
    with pytest.raises(ValueError, match=f"'{name}'"):
        load_hf_checkpoint(path)


def test_missing_shard_file_is_named(tmp_path):
    path = _copy(tmp_path, "llama")
    victim = sorted(path.glob("model-*.safetensors"))[-1]
    victim.unlink()
    with pytest.raises(FileNotFoundError, match=victim.name):
        load_hf_checkpoint(path)


# ------------------------------------------------------------------ dtypes, export


def test_bfloat16_params_and_compute():
    tokens, mask, ref_logits = reference("qwen3_untied")
    model, params = load_hf_checkpoint(FIXTURES / "qwen3_untied", param_dtype="bfloat16")
    assert all(p.dtype == jnp.bfloat16 for p in jax.tree.leaves(params))
    logits = np.asarray(compute_logits(model, params, jnp.asarray(tokens), jnp.asarray(mask)))
    assert np.abs(logits - ref_logits)[mask.astype(bool)].max() < 0.05


def test_float32_params_bfloat16_compute():
    tokens, mask, ref_logits = reference("qwen2")
    model, params = load_hf_checkpoint(FIXTURES / "qwen2", "float32", dtype="bfloat16")
    assert model.config.param_dtype == "float32" and model.config.dtype == "bfloat16"
    assert all(p.dtype == jnp.float32 for p in jax.tree.leaves(params))
    hidden, _ = forward(model.config, params, jnp.asarray(tokens), jnp.asarray(mask))
    assert hidden.dtype == jnp.bfloat16
    logits = np.asarray(compute_logits(model, params, jnp.asarray(tokens), jnp.asarray(mask)))
    assert np.abs(logits - ref_logits)[mask.astype(bool)].max() < 0.05


@pytest.mark.parametrize("name", DECODERS)
@pytest.mark.parametrize("shard_bytes", [None, 40_000])
def test_load_save_load_is_exact(tmp_path, name, shard_bytes):
    model, params = load_hf_checkpoint(FIXTURES / name)
    save_hf_checkpoint(model, params, tmp_path / "out", max_shard_bytes=shard_bytes)
    assert (tmp_path / "out/model.safetensors.index.json").exists() == (shard_bytes is not None)
    model2, params2 = load_hf_checkpoint(tmp_path / "out")
    assert model2.config == model.config
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), params, params2)
    assert jax.tree.structure(params) == jax.tree.structure(params2)


def test_safetensors_writer_is_readable_by_the_safetensors_library(tmp_path):
    from safetensors.numpy import load_file

    tensors = {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([1, 2], np.int64)}
    hf_io.write_safetensors(tensors, tmp_path / "x.safetensors")
    loaded = load_file(str(tmp_path / "x.safetensors"))
    for k in tensors:
        np.testing.assert_array_equal(loaded[k], tensors[k])


# ------------------------------------------------------------------ sharding


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_sharded_forward_and_grad_match_single_device():
    assert jax.device_count() >= 8, "conftest sets 8 fake CPU devices"
    tokens, mask, _ = reference("qwen3_untied")
    tokens = np.concatenate([tokens, tokens[::-1]])[:4]
    mask = np.concatenate([mask, mask[::-1]])[:4]
    model, params = load_hf_checkpoint(FIXTURES / "qwen3_untied")
    cfg = model.config

    def loss(params, tokens, mask):
        logits = compute_logits(model, params, tokens, mask)
        logp = jax.nn.log_softmax(logits[:, :-1])
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
        return -(picked * mask[:, 1:]).sum() / mask[:, 1:].sum(), logits

    (ref_loss, ref_logits), ref_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(params, tokens, mask)

    mesh = sharding.make_mesh((2, 2, 2))
    _, sharded = load_hf_checkpoint(FIXTURES / "qwen3_untied", mesh=mesh)
    q_proj = sharded["layers"]["attn"]["q_proj"]
    assert q_proj.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp", "tensor", None)
    assert q_proj.addressable_shards[0].data.shape == (
        cfg.num_layers,
        cfg.hidden_size // 2,
        cfg.num_heads // 2,
        cfg.head_dim,
    )
    assert sharded["embed"].addressable_shards[0].data.size == sharded["embed"].size // 4
    assert not sharded["lm_head"].sharding.is_fully_replicated

    batch = sharding.batch_sharding(mesh)
    with mesh, sharding.axis_rules():
        (sh_loss, sh_logits), sh_grad = jax.jit(jax.value_and_grad(loss, has_aux=True))(
            sharded, jax.device_put(tokens, batch), jax.device_put(mask, batch)
        )
    np.testing.assert_allclose(sh_logits, ref_logits, atol=1e-5)
    np.testing.assert_allclose(sh_loss, ref_loss, atol=1e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5), sh_grad, ref_grad)


@pytest.mark.slow
def test_init_params_on_mesh_is_partitioned():
    cfg = ModelConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8
    )
    params = init_params(cfg, jax.random.PRNGKey(0), mesh=sharding.make_mesh((2, 2, 2)))
    gate = params["layers"]["mlp"]["gate_proj"]
    assert gate.addressable_shards[0].data.shape == (2, 16, 32)


# ------------------------------------------------------------------ scan, remat


def _tiny(layers, **kw):
    return ModelConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_layers=layers,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
        **kw,
    )


def test_program_size_does_not_grow_with_depth():
    tokens = jnp.zeros((2, 8), jnp.int32)

    def size(layers):
        cfg = _tiny(layers)
        params = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), nn.unbox(abstract_params(cfg)))
        return len(jax.make_jaxpr(lambda p: forward(cfg, p, tokens)[0])(params).jaxpr.eqns)

    assert size(2) == size(12)


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_unstacked_layers_compute_what_stacked_layers_compute():
    """``unstack_layers`` (the decode loop's parameters) gives the same hidden states and cache, with
    and without a cache, and the same gradient with remat; stacked parameters are left as they are."""
    cfg = _tiny(3)
    params = init_params(cfg, jax.random.PRNGKey(0))
    flat = unstack_layers(params)
    assert "layers" not in flat and sorted(k for k in flat if k.startswith("layers_")) == [
        "layers_0",
        "layers_1",
        "layers_2",
    ]
    np.testing.assert_array_equal(flat["layers_2"]["mlp"]["up_proj"], params["layers"]["mlp"]["up_proj"][2])
    np.testing.assert_array_equal(flat["layers_1"]["mlp"]["down_proj_t"], params["layers"]["mlp"]["down_proj"][1].T)
    assert "down_proj" not in flat["layers_0"]["mlp"]
    assert unstack_layers(flat) is flat
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, 64)
    mask = jnp.array([[1] * 8, [1] * 5 + [0] * 3], bool)
    np.testing.assert_allclose(
        forward(cfg, flat, tokens, mask)[0], forward(cfg, params, tokens, mask)[0], rtol=1e-6, atol=1e-6
    )
    offsets = jnp.array([0, 3], jnp.int32)  # a cached call: rows at their own offsets, a window below capacity
    stacked = forward(cfg, params, tokens, mask, init_cache(cfg, 2, 32), offsets, 16)
    unstacked = forward(cfg, flat, tokens, mask, init_cache(cfg, 2, 32), offsets, 16)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), unstacked, stacked)
    assert float(jnp.abs(stacked[1].k).sum()) > 0  # the cache was written
    # decode's working copy: each layer's first 16 slots as its own array, then written back
    cache = init_cache(cfg, 2, 32)
    work = cache.per_layer(16)
    assert len(work.k) == 3 and work.k[0].shape == (2, cfg.num_kv_heads, 16, cfg.head_dim) and work.max_len == 16
    hidden, work = forward(cfg, flat, tokens, mask, work, offsets, 16)
    np.testing.assert_allclose(hidden, stacked[0], rtol=1e-6, atol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6), cache.write_back(work), stacked[1]
    )
    with pytest.raises(ValueError, match="per-layer cache of 16 slots"):  # a per-layer cache is read whole
        forward(cfg, flat, tokens[:, :2], mask[:, :2], cache.per_layer(16), jnp.zeros(2, jnp.int32), 8)

    def grad(cfg, p):
        return jax.grad(lambda p: forward(cfg, p, tokens)[0].astype(jnp.float32).sum())(p)

    remat = _tiny(3, remat=True)
    got, want = grad(remat, flat), grad(remat, params)
    for i in range(3):
        layer = got[f"layers_{i}"]
        layer["mlp"]["down_proj"] = layer["mlp"].pop("down_proj_t").T
        jax.tree.map(lambda a, b, i=i: np.testing.assert_allclose(a, b[i], rtol=1e-4, atol=1e-5), layer, want["layers"])


@pytest.mark.slow
@pytest.mark.parametrize("impl", [None, "xla"])
def test_a_prefix_computed_once_continues_every_row(impl):
    """``forward(..., prefix=cache)`` (the rows continue ``P`` shared tokens held as a one-row cache)
    gives what the whole rows give at the columns after the prefix, stacked or unstacked, in query
    chunks shorter than the rows or not, with the gradient through the prefix's keys and values."""
    P, T = 5, 11
    tokens = jax.random.randint(jax.random.PRNGKey(1), (3, P + T), 0, 64)
    tokens = tokens.at[:, :P].set(tokens[0, :P])
    mask = jnp.asarray(np.arange(P + T)[None] < np.array([P + T, P + 7, P + 1])[:, None])  # right-padded rows
    for cfg in (_tiny(2, attention_impl=impl, attention_chunk=4), _tiny(2, attention_impl=impl, attention_chunk=64)):
        params = init_params(cfg, jax.random.PRNGKey(0))

        @jax.jit  # op by op, these calls and their gradients took most of the test's time
        def whole(p):
            return forward(cfg, p, tokens, mask)[0][:, P:]

        @jax.jit
        def continued(p):
            _, cache = forward(cfg, p, tokens[:1, :P], None, init_cache(cfg, 1, P), jnp.zeros((1,), jnp.int32))
            return forward(cfg, p, tokens[:, P:], mask[:, P:], prefix=cache)[0]

        real = np.asarray(mask[:, P:])[..., None]
        for p in (params, unstack_layers(params)):
            np.testing.assert_allclose(
                np.asarray(continued(p)) * real, np.asarray(whole(p)) * real, rtol=1e-5, atol=1e-5
            )
        weights = jax.random.normal(jax.random.PRNGKey(2), (3, T, cfg.hidden_size)) * real
        got, want = (jax.jit(jax.grad(lambda p, f=f: (f(p) * weights).sum()))(params) for f in (continued, whole))
        jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), got, want)
    with pytest.raises(ValueError, match="prefix is for the cache-free"):
        forward(
            cfg, params, tokens, mask, init_cache(cfg, 3, 32), jnp.zeros((3,), jnp.int32), prefix=init_cache(cfg, 1, P)
        )


def test_chunked_attention_masks_padded_keys_anywhere():
    """``causal_attention`` (queries in chunks, each scoring only the keys up to its end) gives what a
    dense masked softmax gives, and the same gradients, for left padding and holes as well as right
    padding, in chunks that divide the rows or not; a query that sees no key gets a finite output."""
    B, T, N, K, H = 4, 11, 4, 2, 8
    q, k, v, ct = (
        jax.random.normal(jax.random.PRNGKey(i), s)
        for i, s in enumerate([(B, T, N, H), (B, T, K, H), (B, T, K, H), (B, T, N, H)])
    )
    valid = jnp.asarray(
        np.array([[1] * T, [1] * 7 + [0] * 4, [0] * 3 + [1] * 8, [1, 0, 1, 1, 0, 0, 1, 1, 1, 0, 1]], bool)
    )
    visible = jnp.tril(jnp.ones((T, T), bool))[None] & valid[:, None, :]  # [B, T(query), T(key)]
    sees = np.asarray(visible.any(-1))[:, :, None, None]  # left padding: the first queries see nothing

    def dense(q, k, v):
        kk, vv = (jnp.repeat(x, N // K, axis=2) for x in (k, v))
        scores = jnp.einsum("btnh,bsnh->bnts", q, kk) * H**-0.5
        weights = jax.nn.softmax(jnp.where(visible[:, None], scores, -jnp.inf), axis=-1)
        return jnp.einsum("bnts,bsnh->btnh", jnp.nan_to_num(weights), vv)

    want = dense(q, k, v)
    want_grads = jax.grad(lambda *a: (dense(*a) * ct * sees).sum(), argnums=(0, 1, 2))(q, k, v)
    for chunk in (3, 4, 11, 64):  # one jitted program per chunk size (op by op, the gradients took most of this test)

        @jax.jit
        def attention_and_grads(q, k, v, chunk=chunk):  # the gradient of (out * ct * sees).sum(): one forward pass
            got, pull = jax.vjp(lambda *a: causal_attention(*a, valid, chunk), q, k, v)
            return got, pull(ct * sees)

        got, grads = attention_and_grads(q, k, v)
        assert np.isfinite(np.asarray(got)).all()
        np.testing.assert_allclose(np.asarray(got) * sees, np.asarray(want) * sees, rtol=1e-5, atol=1e-6)
        for g, w in zip(grads, want_grads):
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_remat_gives_the_same_gradient():
    tokens = jax.random.randint(jax.random.PRNGKey(1), (2, 8), 0, 64)
    params = init_params(_tiny(3), jax.random.PRNGKey(0))

    def grad(cfg):
        return jax.grad(lambda p: forward(cfg, p, tokens)[0].astype(jnp.float32).sum())(params)

    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), grad(_tiny(3)), grad(_tiny(3, remat=True))
    )  # recompute reorders float sums
