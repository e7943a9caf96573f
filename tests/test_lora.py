"""LoRA adapters (mtrl_jax/model/lora.py): the base model at initialisation, the gradient of the adapters
the full gradient projected onto them, merged export exact against transformers, an optimizer state of
adapter size in the compiled update, and training that moves the adapters only."""

import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtrl_jax.model import ModelConfig, compute_logits, forward, init_params, load_hf_checkpoint, lora
from mtrl_jax.model.hf_io import read_safetensors, save_hf_checkpoint
from mtrl_jax.model.transformer import Transformer
from mtrl_jax.rl.batch import TrajectoryBatch
from mtrl_jax.rl.objective import ObjectiveConfig
from mtrl_jax.rl.train_step import UpdateConfig
from mtrl_jax.rl.updater import Updater

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
CFG = ModelConfig(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=48,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    lora_rank=4,
    lora_alpha=8.0,
    tie_word_embeddings=False,
)


def _params(cfg=CFG, b_scale=0.0):
    frozen, adapters = lora.split(init_params(cfg, jax.random.PRNGKey(0)))
    if b_scale:
        keys = iter(jax.random.split(jax.random.PRNGKey(1), 64))
        adapters = jax.tree.map(lambda x: x + b_scale * jax.random.normal(next(keys), x.shape), adapters)
    return frozen, adapters


def test_the_adapters_start_as_the_base_model_and_sit_beside_the_weights_they_adapt():
    frozen, adapters = _params()
    tokens = jnp.asarray([[1, 5, 9, 3, 7]])
    with_adapters = compute_logits(Transformer(CFG), lora.merge(frozen, adapters), tokens)
    base = compute_logits(Transformer(CFG.replace(lora_rank=0)), frozen, tokens)
    np.testing.assert_array_equal(with_adapters, base)  # B = 0: exactly the base model
    attn = adapters["layers"]["attn"]
    assert attn["q_proj_lora_a"].shape == (2, 32, 4) and attn["q_proj_lora_b"].shape == (2, 4, 4, 8)
    assert attn["o_proj_lora_a"].shape == (2, 4, 8, 4) and attn["o_proj_lora_b"].shape == (2, 4, 32)
    assert float(jnp.abs(attn["q_proj_lora_a"]).sum()) > 0 and not float(jnp.abs(attn["q_proj_lora_b"]).sum())
    assert not lora.split(frozen)[0] or not lora.has_adapters(frozen)
    only_q = CFG.replace(lora_targets=("q",))
    assert set(lora.split(init_params(only_q, jax.random.PRNGKey(0)))[1]["layers"]) == {"attn"}
    with pytest.raises(ValueError, match="lora_targets"):
        CFG.replace(lora_targets=("q", "lm_head"))


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_the_adapters_gradient_is_the_full_gradient_projected_onto_them():
    """d/dA and d/dB of a loss equal (alpha / r) * G B^T and (alpha / r) * A^T G, G the gradient of the same
    loss with respect to the merged weight W + (alpha / r) A B (one layer's q, o and down projections)."""
    frozen, adapters = _params(b_scale=0.1)
    tokens = jnp.asarray([[1, 5, 9, 3, 7, 2], [4, 4, 8, 1, 0, 6]])

    def loss_adapters(a):
        hidden, _ = forward(CFG, lora.merge(frozen, a), tokens)
        return jnp.sum(jnp.sin(hidden))

    base_cfg, merged = lora.merged_weights(CFG, lora.merge(frozen, adapters))

    def loss_merged(params):
        hidden, _ = forward(base_cfg, params, tokens)
        return jnp.sum(jnp.sin(hidden))

    g_adapters = jax.grad(loss_adapters)(adapters)
    g_merged = jax.grad(loss_merged)(merged)
    scale = CFG.lora_alpha / CFG.lora_rank
    for module, name, contract in (("attn", "q_proj", 1), ("attn", "o_proj", 2), ("mlp", "down_proj", 1)):
        a, b = adapters["layers"][module][f"{name}_lora_a"], adapters["layers"][module][f"{name}_lora_b"]
        G = g_merged["layers"][module][name]  # [L, *in, *out]
        L, r = a.shape[0], CFG.lora_rank
        a2, b2, G2 = a.reshape(L, -1, r), b.reshape(L, r, -1), G.reshape(L, a.reshape(L, -1, r).shape[1], -1)
        expect_a = scale * jnp.einsum("lio,lro->lir", G2, b2)
        expect_b = scale * jnp.einsum("lir,lio->lro", a2, G2)
        got_a = g_adapters["layers"][module][f"{name}_lora_a"].reshape(L, -1, r)
        got_b = g_adapters["layers"][module][f"{name}_lora_b"].reshape(L, r, -1)
        # float32 sums in another order: the absolute error scales with the gradient's largest entries (~30 here),
        # so a fixed atol of 2e-5 failed on an entry of 0.056 off by 4e-5 on one machine; a wrong projection is O(1)
        for got, expect in ((got_a, expect_a), (got_b, expect_b)):
            np.testing.assert_allclose(got, expect, rtol=2e-4, atol=5e-6 * float(jnp.abs(expect).max()))


def _fixture_params():
    fixture = np.load(FIXTURES / "lora" / "reference.npz")
    model, base = load_hf_checkpoint(FIXTURES / "qwen3_untied")
    cfg = model.config.replace(lora_rank=4, lora_alpha=8.0)
    adapters: dict = {}
    for key in fixture.files:
        if lora.is_adapter(key.rsplit("/", 1)[-1]):
            node = adapters
            *path, leaf = key.split("/")
            for part in path:
                node = node.setdefault(part, {})
            node[leaf] = jnp.asarray(fixture[key])
    return fixture, cfg, base, adapters


def test_the_merged_export_reloads_with_the_adapters_logits(tmp_path):
    """The adapters folded into the base weights (``merged_weights``), exported as HF safetensors: transformers
    (its logits stored by tools/make_hf_fixtures.py, and live when torch is installed) and our own loader
    give the logits of the model with its adapters, within 1e-4."""
    fixture, cfg, base, adapters = _fixture_params()
    tokens, mask = fixture["tokens"], fixture["attention_mask"]
    ours = np.asarray(compute_logits(Transformer(cfg), lora.merge(base, adapters), tokens, mask))
    valid = mask.astype(bool)
    np.testing.assert_allclose(ours[valid], fixture["logits"][valid], atol=1e-4)
    merged_cfg, merged = lora.merged_weights(cfg, lora.merge(base, adapters))
    save_hf_checkpoint(Transformer(merged_cfg), merged, tmp_path / "merged")
    model, reloaded = load_hf_checkpoint(tmp_path / "merged")
    assert model.config.lora_rank == 0
    again = np.asarray(compute_logits(model, reloaded, tokens, mask))
    np.testing.assert_allclose(again[valid], ours[valid], atol=1e-4)
    assert np.abs(ours - np.asarray(compute_logits(Transformer(merged_cfg), base, tokens, mask)))[valid].max() > 1e-2
    try:
        import torch
        import transformers
    except ImportError:
        return
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    with torch.no_grad():
        live = hf(input_ids=torch.tensor(tokens, dtype=torch.long), attention_mask=torch.tensor(mask)).logits.numpy()
    np.testing.assert_allclose(live[valid], ours[valid], atol=1e-4)


def test_the_peft_export_is_the_same_update_in_peft_layout(tmp_path):
    """``save_peft_adapters``: PEFT's names and [r, in] / [out, r] layout, whose W + (alpha / r) B A is the
    merged HF weight."""
    fixture, cfg, base, adapters = _fixture_params()
    lora.save_peft_adapters(cfg, lora.merge(base, adapters), tmp_path / "peft", base_model="qwen3_untied")
    tensors = read_safetensors(tmp_path / "peft" / "adapter_model.safetensors")
    config = json.loads((tmp_path / "peft" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0 and config["peft_type"] == "LORA"
    assert set(config["target_modules"]) == {
        "q_proj",
        "k_proj",
        "v_proj",
        "o_proj",
        "gate_proj",
        "up_proj",
        "down_proj",
    }
    merged_cfg, merged = lora.merged_weights(cfg, lora.merge(base, adapters))
    save_hf_checkpoint(Transformer(merged_cfg), merged, tmp_path / "merged")
    save_hf_checkpoint(Transformer(merged_cfg), base, tmp_path / "base")
    merged_hf = read_safetensors(tmp_path / "merged" / "model.safetensors")
    base_hf = read_safetensors(tmp_path / "base" / "model.safetensors")
    for module in ("self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"):
        for i in range(cfg.num_layers):
            prefix = f"base_model.model.model.layers.{i}.{module}"
            a, b = tensors[f"{prefix}.lora_A.weight"], tensors[f"{prefix}.lora_B.weight"]
            name = f"model.layers.{i}.{module}.weight"
            np.testing.assert_allclose(base_hf[name] + 2.0 * b @ a, merged_hf[name], atol=1e-5)


def _batch(B=8, T=16, V=64, seed=0):
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, V, size=(B, T)).astype(np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    loss_mask[:, 6:] = 1.0
    behav = np.where(loss_mask > 0, -2.0, 0.0).astype(np.float32)
    return TrajectoryBatch(
        tokens, np.ones((B, T), np.int32), loss_mask, behav, rng.normal(size=B).astype(np.float32), group_size=4
    )


@pytest.mark.slow
def test_the_compiled_update_holds_an_optimizer_state_of_adapter_size():
    """From the compiled program's memory analysis: with LoRA the update's arguments are the frozen base, the
    adapters with Adam's two moments, and the batch, not three copies of the model."""
    cfg = CFG.replace(vocab_size=512, hidden_size=64, intermediate_size=256)
    frozen, adapters = _params(cfg)
    batch = _batch(V=512)
    nbytes = lambda tree: sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))  # noqa: E731
    config = UpdateConfig(objective=ObjectiveConfig(loss="ppo"), old_logp="behaviour")
    analyses = {}
    for name, (trainable, rest) in {"lora": (adapters, frozen), "full": (lora.merge(frozen, adapters), {})}.items():
        updater = Updater(cfg, config, optax.adam(1e-3))
        state = updater.init_state(trainable, jax.random.PRNGKey(0))
        assert nbytes(state.opt_state) < 2 * nbytes(trainable) + 1024  # the moments follow the trainable tree
        analyses[name] = updater.lower(state, batch, base=rest).compile().memory_analysis().argument_size_in_bytes
    batch_bytes = nbytes(batch)
    assert analyses["lora"] <= nbytes(frozen) + 3 * nbytes(adapters) + batch_bytes + 4096
    assert analyses["full"] >= 3 * nbytes(frozen)
    assert nbytes(adapters) < 0.2 * nbytes(frozen)


def test_an_update_moves_the_adapters_only():
    frozen, adapters = _params(b_scale=0.0)
    updater = Updater(CFG, UpdateConfig(objective=ObjectiveConfig(loss="ppo"), old_logp="behaviour"), optax.adam(1e-2))
    state, metrics = updater.update(updater.init_state(adapters, jax.random.PRNGKey(0)), _batch(), base=frozen)
    assert int(metrics["skipped_steps"]) == 0
    assert jax.tree.structure(state.params) == jax.tree.structure(adapters)

    def moved(new):
        flat = jax.tree_util.tree_leaves_with_path(new)
        return {
            jax.tree_util.keystr(p): float(jnp.abs(a - b).max()) for (p, a), b in zip(flat, jax.tree.leaves(adapters))
        }

    first = moved(state.params)
    # B starts at zero, so the first step moves every B and no A (dL/dA = (alpha / r) G B^T); the second, both
    assert all(v > 0 for k, v in first.items() if "lora_b" in k) and all(
        v == 0 for k, v in first.items() if "lora_a" in k
    )
    state, _ = updater.update(state, _batch(seed=1), base=frozen)
    assert min(moved(state.params).values()) > 0
    full = lora.Policy(frozen, state.params).full()
    assert full["embed"] is frozen["embed"]  # the base is the very same arrays


def test_merging_into_a_bfloat16_base_keeps_an_update_below_its_rounding():
    """Issue 71, item 11: a bfloat16 merge rounded small trained updates away, so the export was not the trained
    policy. The merge is float32: the adapted policy's logits, to float32 rounding."""
    cfg = CFG.replace(param_dtype="bfloat16")
    frozen, adapters = _params(cfg, b_scale=1e-4)  # deltas far below a bfloat16 weight's rounding step
    assert jax.tree.leaves(frozen)[0].dtype == jnp.bfloat16
    merged_cfg, merged = lora.merged_weights(cfg, lora.merge(frozen, adapters))
    assert merged_cfg.param_dtype == "float32" and merged_cfg.lora_rank == 0
    q = merged["layers"]["attn"]["q_proj"]
    base = frozen["layers"]["attn"]["q_proj"].astype(jnp.float32)
    assert q.dtype == jnp.float32 and float(jnp.abs(q - base).max()) > 0  # the update is there
    tokens = jnp.asarray([[1, 5, 9, 3, 7, 2]])
    f32 = lambda tree: jax.tree.map(lambda x: x.astype(jnp.float32), tree)  # noqa: E731
    adapted = compute_logits(Transformer(cfg.replace(param_dtype="float32")), f32(lora.merge(frozen, adapters)), tokens)
    exported = compute_logits(Transformer(merged_cfg), merged, tokens)
    np.testing.assert_allclose(np.asarray(exported), np.asarray(adapted), atol=1e-5)
