"""Sharding applied, not only declared: one RL step (collect, then update) on 8 fake CPU devices
equals the single-device step for several mesh shapes, and the compiled programs keep the table's
shardings for parameters, batches and the KV cache."""

import concurrent.futures

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtrl_jax.chat import ChatFormat, train_tokenizer
from mtrl_jax.data.collection import Task
from mtrl_jax.model import ModelConfig, compute_logits, init_params, lora
from mtrl_jax.model.sharding import make_mesh, param_shardings
from mtrl_jax.model.transformer import Transformer, abstract_params, pad_vocab
from mtrl_jax.rl.batch import make_batch
from mtrl_jax.rl.objective import ObjectiveConfig
from mtrl_jax.rl.train_step import UpdateConfig
from mtrl_jax.rl.turn_credit import TurnCreditConfig
from mtrl_jax.rl.updater import Updater
from mtrl_jax.rollout.collector import Collector, CollectorConfig, EpisodeRequest
from mtrl_jax.rollout.interfaces import Environment, Episode, StepResult

MESHES = [(8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 2, 4)]
CREDIT = TurnCreditConfig(max_turns=2)  # per-search credit (rl.turn_reward="retrieval_gain")


class CountingEnv(Environment):
    """Two turns: a tool reply, then the episode ends with a reward from the sampled text."""

    def reset(self, task):
        return Episode(task), [{"role": "system", "content": "sys"}, {"role": "user", "content": task.query}]

    def step(self, episode, text, hit_token_limit=False):
        # a search turn's record for per-search credit (search.env.search_credit), from the sampled text
        episode.turns.append({"text": text, "retrieval_gain": len(text) % 3 / 3, "repeated_docs": 0.0})
        if hit_token_limit or len(episode.turns) >= 2:
            episode.status, episode.final_ranking = "ok", []
            episode.reward = float(len(text) % 5) / 5
            return StepResult([], True, {})
        return StepResult([{"role": "tool", "content": f"result for {episode.task.query}"}], False, {})


@pytest.fixture(scope="module")
def setup():
    chat = ChatFormat(train_tokenizer(["sys user tool result for query alpha beta gamma delta"] * 20, 320))
    # every sharded dimension divides by 8 (heads and KV heads by the tensor axis of up to 4)
    cfg = ModelConfig(
        vocab_size=320,
        hidden_size=64,
        intermediate_size=128,
        num_layers=2,
        num_heads=4,
        num_kv_heads=4,
        head_dim=16,
        qk_norm=True,
        tie_word_embeddings=False,
    )
    return chat, cfg, init_params(cfg, jax.random.PRNGKey(0))


def one_rl_step(chat, cfg, params, mesh, lora_rank=0, turn_credit=None):
    """Collect 16 episodes and update on them, on ``mesh`` (None: one device); with ``lora_rank`` the base is
    frozen and LoRA adapters (B non-zero, so that they act) train; with ``turn_credit``, per-search credit."""
    frozen = {}
    if lora_rank:
        cfg = cfg.replace(lora_rank=lora_rank)
        adapters = lora.init_adapters(cfg, jax.random.PRNGKey(3))
        adapters = jax.tree.map(lambda x: x + 0.02 * jax.random.normal(jax.random.PRNGKey(4), x.shape), adapters)
        frozen, params = params, adapters
    if mesh is not None:
        shardings = lora.split(param_shardings(abstract_params(cfg), mesh))
        frozen = jax.device_put(frozen, shardings[0]) if lora_rank else {}
        params = jax.device_put(params, shardings[1])
    requests = [
        EpisodeRequest(Task(f"t{i}", f"query {i % 4} alpha", {}, "c"), i // 4, i % 4, jax.random.PRNGKey(i))
        for i in range(16)
    ]
    collector = Collector(
        cfg,
        chat,
        CountingEnv(),
        CollectorConfig(slots=8, max_len=128, max_tokens_per_turn=6, decode_chunk=6, tool_workers=0),
        lambda: (lora.merge(frozen, params), 0),
        mesh,
    )
    trajectories = collector.run(requests)
    batch = make_batch(trajectories, 4, 32, chat.pad_id, turn_credit=turn_credit)
    # plain SGD: Adam's m / sqrt(v) turns float-reordering noise in near-zero gradients into full-size steps
    updater = Updater(
        cfg,
        UpdateConfig(objective=ObjectiveConfig(loss="ppo"), mini_batches=2, micro_batches=1, turn_credit=turn_credit),
        optax.sgd(0.5),
        mesh,
    )
    state, metrics = updater.update(updater.init_state(params, jax.random.PRNGKey(1)), batch, base=frozen)
    return trajectories, state, metrics


@pytest.fixture(scope="module")
def rl_steps(setup):
    """``one_rl_step`` on one device (the reference each mesh shape is compared with) and on every mesh shape,
    with and without LoRA, computed once, two at a time: most of each is XLA compiling programs of its own,
    which holds one core and lets another thread run. ``{(shape or None, lora_rank): future}``."""
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        yield {
            (shape, rank): pool.submit(one_rl_step, *setup, shape and make_mesh(shape), lora_rank=rank)
            for rank in (0, 4)
            for shape in (None, *MESHES)
        } | {
            (shape, "credit"): pool.submit(one_rl_step, *setup, shape and make_mesh(shape), turn_credit=CREDIT)
            for shape in (None, *MESHES)
        }


@pytest.mark.slow
@pytest.mark.parametrize("shape", MESHES)
def test_one_lora_rl_step_on_a_mesh_equals_the_single_device_step(setup, rl_steps, shape):
    """LoRA adapters, sharded by the logical axes of the weights they adapt, and a frozen base."""
    chat, cfg, params = setup
    ref_trajectories, ref_state, _ = rl_steps[None, 4].result()
    trajectories, state, _ = rl_steps[shape, 4].result()
    assert [t.tokens for t in trajectories] == [t.tokens for t in ref_trajectories]
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5), state.params, ref_state.params
    )
    a, b = state.params["layers"]["attn"]["q_proj_lora_a"], state.params["layers"]["attn"]["q_proj_lora_b"]
    mesh = make_mesh(shape)
    expected = lora.split(param_shardings(abstract_params(cfg.replace(lora_rank=4)), mesh))[1]["layers"]["attn"]
    assert a.sharding.is_equivalent_to(expected["q_proj_lora_a"], a.ndim)  # A [L, D, r]: D over fsdp, like q_proj's
    assert b.sharding.is_equivalent_to(expected["q_proj_lora_b"], b.ndim)  # B [L, r, N, H]: heads over tensor
    assert b.sharding.is_fully_replicated == (shape[2] == 1)  # heads split over tensor, like q_proj's


@pytest.mark.slow
@pytest.mark.parametrize("shape", MESHES)
def test_one_rl_step_on_a_mesh_equals_the_single_device_step(setup, rl_steps, shape):
    assert jax.device_count() >= 8, "conftest sets 8 fake CPU devices"
    chat, cfg, params = setup
    ref_trajectories, ref_state, _ = rl_steps[None, 0].result()
    trajectories, state, metrics = rl_steps[shape, 0].result()
    assert [t.tokens for t in trajectories] == [t.tokens for t in ref_trajectories]  # the same samples
    np.testing.assert_allclose([t.behav_logp for t in trajectories][0], ref_trajectories[0].behav_logp, atol=1e-5)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5), state.params, ref_state.params
    )
    q_proj = state.params["layers"]["attn"]["q_proj"]
    expected = param_shardings(abstract_params(cfg), make_mesh(shape))["layers"]["attn"]["q_proj"]
    assert q_proj.sharding.is_equivalent_to(expected, q_proj.ndim)  # the update keeps the table's layout
    assert q_proj.sharding.is_fully_replicated == (shape[1] * shape[2] == 1)


@pytest.mark.slow
@pytest.mark.parametrize("shape", MESHES)
def test_one_rl_step_with_per_search_credit_on_a_mesh_equals_the_single_device_step(rl_steps, shape):
    ref_trajectories, ref_state, ref_metrics = rl_steps[None, "credit"].result()
    trajectories, state, metrics = rl_steps[shape, "credit"].result()
    assert [t.tokens for t in trajectories] == [t.tokens for t in ref_trajectories]
    assert float(ref_metrics["turn_advantage_abs_mean"]) > 0  # the searches' rewards differ: the term acts
    np.testing.assert_allclose(np.asarray(metrics["turn_advantages"]), np.asarray(ref_metrics["turn_advantages"]))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5), state.params, ref_state.params
    )
    _, plain, _ = rl_steps[None, 0].result()  # the same samples without the credit train differently
    assert not np.allclose(np.asarray(plain.params["lm_head"]), np.asarray(ref_state.params["lm_head"]))


def _spec(sharding):
    """The partition spec without trailing ``None`` (compiled programs drop them)."""
    spec = list(sharding.spec)
    while spec and spec[-1] is None:
        spec.pop()
    return tuple(spec)


@pytest.mark.slow
def test_compiled_update_and_decode_keep_the_table_shardings(setup):
    chat, cfg, params = setup
    mesh = make_mesh((2, 2, 2))
    params = jax.device_put(params, param_shardings(abstract_params(cfg), mesh))
    updater = Updater(cfg, UpdateConfig(objective=ObjectiveConfig(loss="ppo")), optax.adam(1e-2), mesh)
    state = updater.init_state(params, jax.random.PRNGKey(1))
    rng = np.random.default_rng(0)
    from mtrl_jax.model.sharding import place_batch
    from mtrl_jax.rl.batch import TrajectoryBatch

    tokens = rng.integers(1, 300, size=(8, 32)).astype(np.int32)
    batch = TrajectoryBatch(
        tokens,
        np.ones_like(tokens),
        np.ones((8, 32), np.float32),
        -np.ones((8, 32), np.float32),
        rng.uniform(size=8).astype(np.float32),
        group_size=4,
    )
    compiled = updater.lower(state, place_batch(batch, mesh), None).compile()
    # the state's fields, the batch, no reference, the frozen parameters (none: every parameter trains)
    (params_in, opt_in, _, _, batch_in, _, _), _ = compiled.input_shardings
    (state_out, _) = compiled.output_shardings
    for where in (params_in, state_out.params, opt_in[0].mu, state_out.opt_state[0].mu):  # Adam's moments follow
        assert _spec(where["layers"]["attn"]["q_proj"]) == (None, "fsdp", "tensor")
        assert not where["embed"].is_fully_replicated and not where["lm_head"].is_fully_replicated
    assert _spec(batch_in.tokens)[0] == ("data", "fsdp") and _spec(batch_in.reward)[0] == ("data", "fsdp")

    from mtrl_jax.rollout.engine import Sampler

    smp = Sampler(cfg, slots=8, max_len=64, max_new_tokens=4, mesh=mesh)
    sampler_state, _ = smp.extend(params, smp.init(), [[1, 2, 3]] * 8)
    assert _spec(sampler_state.cache.k.sharding) == (None, ("data", "fsdp"), "tensor")
    rows = (
        jax.random.split(jax.random.PRNGKey(0), 8),
        np.ones(8, np.float32),
        np.ones(8, np.float32),
        np.full((8, 1), -1, np.int32),
        np.ones(8, bool),
        np.full(8, 4, np.int32),
    )
    compiled = smp.lower_decode(params, sampler_state, *place_batch(rows, mesh)).compile()
    (params_in, state_in, *_), _ = compiled.input_shardings
    state_out, _ = compiled.output_shardings
    assert _spec(params_in["layers"]["attn"]["q_proj"]) == (None, "fsdp", "tensor")
    for where in (state_in, state_out):
        assert _spec(where.cache.k) == (None, ("data", "fsdp"), "tensor")
        assert _spec(where.lengths)[0] == ("data", "fsdp")
    # the cache is donated: the state passed in is consumed, not copied
    new_state, _ = smp.decode(
        params, sampler_state, jax.random.PRNGKey(0), [1.0] * 8, [1.0] * 8, [[-1]] * 8, [True] * 8
    )
    assert sampler_state.cache.k.is_deleted() and not new_state.cache.k.is_deleted()


@pytest.mark.slow
def test_bfloat16_compute_with_float32_parameters(setup):
    chat, cfg, params = setup
    bf16 = cfg.replace(dtype="bfloat16")  # parameters stay float32; log-probs and the loss are float32
    requests = [
        EpisodeRequest(Task(f"t{i}", f"query {i % 4} alpha", {}, "c"), i // 4, i % 4, jax.random.PRNGKey(i))
        for i in range(8)
    ]
    collector = Collector(
        bf16,
        chat,
        CountingEnv(),
        CollectorConfig(slots=8, max_len=128, max_tokens_per_turn=6, decode_chunk=6, tool_workers=0),
        lambda: (params, 0),
    )
    trajectories = collector.run(requests)
    for i, t in enumerate(trajectories):  # distinct rewards within each group
        t.reward = float(i % 3)
    batch = make_batch(trajectories, 4, 32, chat.pad_id)
    updater = Updater(bf16, UpdateConfig(objective=ObjectiveConfig(loss="ppo"), mini_batches=2), optax.adam(1e-3))
    state = updater.init_state(params, jax.random.PRNGKey(1))
    for step in range(2):
        state, metrics = updater.update(state, batch)
        metrics = jax.device_get(metrics)
        if step == 0:
            assert metrics["first_minibatch_ratio_max_dev"] <= 1e-2
            assert metrics["behav_logp_max_abs_dev"] <= 5e-2
        assert np.isfinite(metrics["loss"]) and np.isfinite(metrics["grad_norm"]) and metrics["skipped_steps"] == 0
    assert all(x.dtype == jnp.float32 and np.isfinite(np.asarray(x)).all() for x in jax.tree.leaves(state.params))


def _update_flops_per_device(cfg, params, mesh) -> float:
    from mtrl_jax.model.sharding import place_batch
    from mtrl_jax.rl.batch import TrajectoryBatch

    if mesh is not None:
        params = jax.device_put(params, param_shardings(abstract_params(cfg), mesh))
    updater = Updater(
        cfg,
        UpdateConfig(objective=ObjectiveConfig(loss="ppo"), mini_batches=2, micro_batches=2),
        optax.adam(1e-2),
        mesh,
    )
    tokens = np.random.default_rng(0).integers(1, 300, size=(16, 32)).astype(np.int32)
    batch = TrajectoryBatch(
        tokens,
        np.ones_like(tokens),
        np.ones((16, 32), np.float32),
        -np.ones((16, 32), np.float32),
        np.linspace(0, 1, 16, dtype=np.float32),
        group_size=4,
    )
    compiled = updater.lower(updater.init_state(params, jax.random.PRNGKey(1)), place_batch(batch, mesh)).compile()
    cost = compiled.cost_analysis()
    return (cost[0] if isinstance(cost, (list, tuple)) else cost)["flops"]


@pytest.mark.slow
def test_the_update_splits_its_work_over_the_devices(setup, shape=(8, 1, 1)):
    """The logical-axis constraints reach the compiler: each of 8 data-parallel devices does about
    1/8 of the single-device FLOPs (with them silently inactive, the activations were replicated and every
    device computed the whole batch)."""
    _, cfg, params = setup
    ratio = _update_flops_per_device(cfg, params, make_mesh(shape)) / _update_flops_per_device(cfg, params, None)
    assert ratio < 0.3, ratio


@pytest.mark.slow
def test_a_vocabulary_that_divides_no_mesh_axis_is_padded_and_masked(setup):
    """317 entries split over no axis of a (2, 2, 2) mesh: padded to 320 (``pad_vocab``), the padding's logits
    masked, the RL step on the mesh is the unpadded model's on one device."""
    chat, cfg, _ = setup
    small = cfg.replace(vocab_size=317)
    params = init_params(small, jax.random.PRNGKey(5))
    padded_cfg, padded = pad_vocab(small, params, 8)
    assert padded_cfg.vocab_size == 320 and padded_cfg.valid_vocab == 317
    logits = compute_logits(Transformer(padded_cfg), padded, jnp.asarray([[1, 2, 3]]))
    assert bool((logits[..., 317:] == jnp.finfo(jnp.float32).min).all())  # never sampled, probability 0
    ref_trajectories, ref_state, _ = one_rl_step(chat, small, params, None)
    trajectories, state, _ = one_rl_step(chat, padded_cfg, padded, make_mesh((2, 2, 2)))
    assert [t.tokens for t in trajectories] == [t.tokens for t in ref_trajectories]
    for name in ("embed", "lm_head"):
        got = np.asarray(state.params[name])
        real = got[:317] if name == "embed" else got[:, :317]
        np.testing.assert_allclose(real, np.asarray(ref_state.params[name]), atol=1e-5)
    np.testing.assert_allclose(
        np.asarray(state.params["layers"]["attn"]["q_proj"]),
        np.asarray(ref_state.params["layers"]["attn"]["q_proj"]),
        atol=1e-5,
    )
    # unpadded, the vocabulary would not split over the tensor axis: it is replicated there instead
    unpadded = param_shardings(abstract_params(small), make_mesh((2, 2, 2)))["embed"].spec
    padded_spec = param_shardings(abstract_params(padded_cfg), make_mesh((2, 2, 2)))["embed"].spec
    assert unpadded[0] is None and padded_spec[0] == "tensor"
