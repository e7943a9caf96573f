"""The jitted update: which trajectories each optimizer step sees, against a step-by-step reference."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from mtrl_jax.model import ModelConfig, init_params
from mtrl_jax.rl.batch import TrajectoryBatch
from mtrl_jax.rl.logprobs import sequence_logprobs
from mtrl_jax.rl.objective import ObjectiveConfig, objective
from mtrl_jax.rl.lengths import by_length, length_buckets, switch_on_length
from mtrl_jax.rl.logprobs import score
from mtrl_jax.rl.train_step import UpdateConfig, minibatch_order
from mtrl_jax.rl.updater import Updater

CFG = ModelConfig(
    vocab_size=48,
    hidden_size=16,
    intermediate_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    head_dim=8,
    tie_word_embeddings=True,
)


def test_minibatch_order_is_a_fresh_permutation_per_epoch():
    key = jax.random.PRNGKey(3)
    order = np.asarray(minibatch_order(key, 12, update_epochs=3, mini_batches=4))
    assert order.shape == (12, 3)
    epochs = order.reshape(3, 12)
    assert all(sorted(e) == list(range(12)) for e in epochs)  # every row once per epoch
    assert not (epochs[0] == epochs[1]).all() and not (epochs[1] == epochs[2]).all()
    np.testing.assert_array_equal(order, minibatch_order(key, 12, 3, 4))  # the key decides
    assert not np.array_equal(order, minibatch_order(jax.random.PRNGKey(4), 12, 3, 4))
    np.testing.assert_array_equal(minibatch_order(key, 6, 2, 1), [[0, 1, 2, 3, 4, 5]] * 2)  # one mini-batch: in order
    with pytest.raises(ValueError, match="does not split into 4 mini-batches"):
        minibatch_order(key, 10, 1, 4)


def test_length_buckets_cover_the_batch_length_with_few_programs():
    assert length_buckets(512, 32) == tuple(range(32, 513, 32))
    assert length_buckets(100, 32) == (32, 64, 96, 100)
    assert length_buckets(100, 128) == (100,)
    wide = length_buckets(8192, 32)  # 256 multiples: spread geometrically instead
    assert len(wide) <= 16 and wide[0] == 32 and wide[-1] == 8192 and all(b % 32 == 0 for b in wide)
    assert list(wide) == sorted(set(wide))


def test_length_buckets_start_at_the_shortest_row_a_batch_can_hold():
    assert length_buckets(528, 48, shortest=81) == tuple(range(96, 529, 48))  # the default: 10 branches, not 11
    assert length_buckets(528, 48, shortest=96) == tuple(range(96, 529, 48))  # a multiple holds it exactly
    assert length_buckets(100, 32, shortest=0) == length_buckets(100, 32)
    assert length_buckets(100, 32, shortest=99) == (100,)
    assert length_buckets(100, 32, shortest=5000) == (100,)  # never above the batch length
    wide = length_buckets(8192, 32, shortest=1000)  # the geometric spread starts at it too
    assert len(wide) <= 16 and wide[0] == 1024 and wide[-1] == 8192
    with pytest.raises(ValueError, match="min_length must be >= 0"):
        UpdateConfig(min_length=-1)


def test_switch_on_length_takes_the_smallest_bucket_that_holds_every_row():
    mask = np.zeros((3, 10), np.int32)
    for lengths, expected in (((2, 3, 1), 4), ((2, 7, 1), 8), ((9, 3, 1), 10), ((0, 0, 0), 4)):
        for row, n in enumerate(lengths):
            mask[row] = np.arange(10) < n
        assert (
            int(switch_on_length((4, 8, 10), jnp.asarray(mask), lambda length, x: x + length, jnp.int32(0))) == expected
        )


@pytest.mark.slow
def test_scoring_returns_every_row_in_place():
    params = init_params(CFG, jax.random.PRNGKey(1))
    other = init_params(CFG, jax.random.PRNGKey(2))
    batch = _batch([0.0] * 8, T=12, seed=3)
    logprobs = lambda p, t, a: sequence_logprobs(CFG, p, t, a, chunk_size=7)  # noqa: E731
    groups = by_length(jnp.asarray(batch.attention_mask), jnp.asarray([3, 1, 0, 2, 7, 5, 4, 6]), 2)
    got = jax.jit(
        lambda p, q: score(logprobs, [p, q], ["old", "ref"], batch.tokens, batch.attention_mask, (4, 8, 12), groups)
    )(params, other)
    for name, p in (("old", params), ("ref", other)):
        want = np.asarray(logprobs(p, batch.tokens, batch.attention_mask)[0]) * batch.attention_mask
        np.testing.assert_allclose(np.asarray(got[name]), want, atol=2e-5)


def _batch(rewards, T=10, seed=0):
    rng = np.random.default_rng(seed)
    B = len(rewards)
    tokens = rng.integers(1, CFG.vocab_size, size=(B, T)).astype(np.int32)
    lengths = rng.integers(6, T + 1, size=B)
    attention = (np.arange(T)[None] < lengths[:, None]).astype(np.int32)
    loss_mask = ((np.arange(T)[None] >= 3) & (attention == 1)).astype(np.float32)
    behav = np.where(loss_mask > 0, -rng.uniform(1, 4, size=(B, T)), 0.0).astype(np.float32)
    return TrajectoryBatch(tokens, attention, loss_mask, behav, np.asarray(rewards, np.float32), group_size=2)


def _grpo(rewards, G):  # docs/algorithms.md, written out
    r = np.asarray(rewards, np.float64).reshape(-1, G)
    return ((r - r.mean(1, keepdims=True)) / (r.std(1, ddof=1, keepdims=True) + 1e-6)).reshape(-1)


@pytest.mark.slow
@pytest.mark.parametrize("reference", ["none", "other", "same"])
def test_update_equals_one_optimizer_step_per_minibatch_in_the_drawn_order(reference):
    """``reference``: no KL term, a KL term to other parameters, or to the very parameters the
    update starts from (the first RL step), where the first mini-batch uses its own forward."""
    rewards = [1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7]
    batch = _batch(rewards)
    params = init_params(CFG, jax.random.PRNGKey(1))
    ref_params = {"none": None, "same": params, "other": init_params(CFG, jax.random.PRNGKey(2))}[reference]
    tx = optax.sgd(0.5)
    # length_bucket 4: micro-batches are cut to 8 or 10 columns (their rows are 6..10 tokens long)
    cfg = UpdateConfig(
        objective=ObjectiveConfig(loss="ppo", kl_coef=0.0 if ref_params is None else 0.2),
        update_epochs=2,
        mini_batches=2,
        micro_batches=2,
        logprob_chunk=7,
        length_bucket=4,
    )
    updater = Updater(CFG, cfg, tx)
    state = updater.init_state(params, jax.random.PRNGKey(9))
    new_state, metrics = updater.update(state, batch, ref_params)

    # the reference: old log-probs once, the permutation from a split of the state's key, then one
    # plain SGD step per mini-batch of whole rows (no micro-batching)
    rng, order_key = jax.random.split(state.rng)
    order = np.asarray(minibatch_order(order_key, 8, 2, 2))
    old_logp, _ = sequence_logprobs(CFG, params, batch.tokens, batch.attention_mask, chunk_size=7)
    ref_logp = (
        None
        if ref_params is None
        else sequence_logprobs(CFG, ref_params, batch.tokens, batch.attention_mask, chunk_size=7)[0]
    )
    adv = jnp.asarray(_grpo(rewards, 2), jnp.float32)
    tokens, attention, loss_mask, behav = map(
        jnp.asarray, (batch.tokens, batch.attention_mask, batch.loss_mask, batch.behav_logp)
    )

    @jax.jit  # one program for the four steps (same shapes), compiled once instead of dispatched op by op
    def sgd_step(p, rows):
        def loss(p):
            logp, entropy = sequence_logprobs(CFG, p, tokens[rows], attention[rows], chunk_size=7)
            return objective(
                cfg.objective,
                logp,
                old_logp[rows],
                adv[rows],
                loss_mask[rows],
                entropy=entropy,
                behav_logp=behav[rows],
                ref_logp=None if ref_logp is None else ref_logp[rows],
            )[0]

        return jax.tree.map(lambda w, g: w - 0.5 * g, p, jax.grad(loss)(p))

    ref = params
    for rows in order:
        ref = sgd_step(ref, jnp.asarray(rows))
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6), new_state.params, ref
    )
    assert int(new_state.step) == 4 and int(metrics["skipped_steps"]) == 0
    np.testing.assert_array_equal(new_state.rng, rng)  # the state's key advances: the next update draws a new order
    assert float(metrics["first_minibatch_ratio_max_dev"]) == 0.0  # the first mini-batch's own forward
    assert float(metrics["ratio_max_dev"]) > 1e-3  # the later ones: against the scored old log-probs
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), new_state.params, params)
    assert max(jax.tree.leaves(moved)) > 1e-4


@pytest.mark.slow
def test_leaving_out_the_lengths_no_row_has_changes_nothing():
    """``min_length`` 6 (every row holds 6..10 tokens) leaves out the 4-column branch: the same
    micro-batches take the same branches, so the update is the same to the last bit."""
    batch = _batch([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7])
    params = init_params(CFG, jax.random.PRNGKey(1))
    results = []
    for shortest in (0, 6):
        cfg = UpdateConfig(
            objective=ObjectiveConfig(loss="ppo", kl_coef=0.2),
            mini_batches=2,
            micro_batches=2,
            logprob_chunk=7,
            length_bucket=4,
            min_length=shortest,
        )
        updater = Updater(CFG, cfg, optax.adam(0.1))
        results.append(updater.update(updater.init_state(params, jax.random.PRNGKey(9)), batch, params))
    (a, metrics_a), (b, metrics_b) = results
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a.params, b.params)
    for name in ("loss", "real_token_fraction", "grad_norm"):
        assert float(metrics_a[name]) == float(metrics_b[name]), name


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_a_non_finite_step_is_skipped_and_counted():
    batch = _batch([1.0, 0.0, np.nan, 0.5])  # a NaN reward makes its group's advantages, so the loss, NaN
    params = init_params(CFG, jax.random.PRNGKey(1))
    updater = Updater(CFG, UpdateConfig(objective=ObjectiveConfig(loss="ppo"), mini_batches=1), optax.adam(1e-2))
    state = updater.init_state(params, jax.random.PRNGKey(0))
    opt_state = jax.tree.map(np.array, state.opt_state)  # a host copy: the update donates the optimizer state
    new_state, metrics = updater.update(state, batch)
    assert int(metrics["skipped_steps"]) == 1 and int(new_state.step) == 0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), new_state.params, params)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), new_state.opt_state, opt_state
    )


@pytest.mark.slow
def test_warm_compiles_the_update_in_the_background():
    from mtrl_jax.metrics import CompileCounter

    params = init_params(CFG, jax.random.PRNGKey(1))
    # length_bucket 16: one length branch per program (this test is about when it is compiled, not its branches)
    updater = Updater(
        CFG,
        UpdateConfig(objective=ObjectiveConfig(loss="ppo", kl_coef=0.1), micro_batches=2, length_bucket=16),
        optax.sgd(0.1),
    )
    state = updater.init_state(params, jax.random.PRNGKey(0))
    batch = _batch([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7])
    updater.compile_ahead(state, 8, 10, 2, with_reference=True).join()
    mark = CompileCounter.mark()
    new_state, metrics = updater.update(state, batch, params)
    jax.block_until_ready(metrics)
    assert CompileCounter.since(mark)["compile/programs"] == 0  # the program was ready
    assert int(metrics["skipped_steps"]) == 0 and int(new_state.step) == 1
    # compile_ahead() compiled ahead of time and ran nothing; the program gives what the plain jitted update gives
    plain = Updater(updater.model_cfg, updater.config, updater.tx)
    want, _ = plain.update(plain.init_state(params, jax.random.PRNGKey(0)), batch, params)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), new_state.params, want.params
    )
    # a batch of another shape than the warmed one is compiled on first use (jit)
    longer = _batch([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7], T=14)
    mark = CompileCounter.mark()
    jax.block_until_ready(updater.update(new_state, longer, params))
    assert CompileCounter.since(mark)["compile/programs"] >= 1


def test_the_update_with_per_search_credit_is_compiled_ahead_too():
    """With ``rl.turn_reward`` the batch carries its turns' rewards: the program compiled ahead takes them."""
    from mtrl_jax.metrics import CompileCounter
    from mtrl_jax.rl.turn_credit import TurnCreditConfig, empty_turn_rewards

    params = init_params(CFG, jax.random.PRNGKey(1))
    config = UpdateConfig(micro_batches=2, length_bucket=16, turn_credit=TurnCreditConfig(max_turns=3, coef=0.5))
    updater = Updater(CFG, config, optax.sgd(0.1))
    state = updater.init_state(params, jax.random.PRNGKey(0))
    turns = empty_turn_rewards(8, 10, 3)
    turns.reward[:, 0], turns.valid[:, 0], turns.token_turn[:, 3:6] = np.linspace(0, 1, 8), 1.0, 0
    batch = dataclasses.replace(_batch([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7]), turns=turns)
    updater.compile_ahead(state, 8, 10, 2, with_reference=False).join()
    mark = CompileCounter.mark()
    new_state, metrics = updater.update(state, batch)
    jax.block_until_ready(metrics)
    assert CompileCounter.since(mark)["compile/programs"] == 0  # the program was ready, and took the turns
    plain = Updater(updater.model_cfg, updater.config, updater.tx)
    want, _ = plain.update(plain.init_state(params, jax.random.PRNGKey(0)), batch)
    jax.tree.map(
        lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), new_state.params, want.params
    )


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_the_update_writes_the_new_optimizer_state_over_the_old():
    """The optimizer state is donated (its buffers alias the new state's: no second copy of Adam's
    moments at the update's peak); the parameters are not, for the collector still samples with them."""
    params = init_params(CFG, jax.random.PRNGKey(1))
    updater = Updater(CFG, UpdateConfig(objective=ObjectiveConfig(loss="ppo")), optax.adam(1e-2))
    state = updater.init_state(params, jax.random.PRNGKey(0))
    batch = _batch([1.0, 0.0, 0.2, 0.9, 0.5, 0.1, 0.0, 0.7])
    moments = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
    assert updater.lower(state, batch).compile().memory_analysis().alias_size_in_bytes >= moments
    new_state, metrics = updater.update(state, batch)
    jax.block_until_ready(new_state)
    assert all(x.is_deleted() for x in jax.tree.leaves(state.opt_state))
    assert not any(x.is_deleted() for x in jax.tree.leaves(state.params))
    assert int(new_state.step) == 1 and int(metrics["skipped_steps"]) == 0
    new_state, _ = updater.update(new_state, batch)  # the returned state is the one to go on with
    assert int(new_state.step) == 2


@pytest.mark.slow
def test_all_equal_rewards_leave_the_parameters_exactly_as_they_were():
    """In the first mini-batch the old and (here equal) reference log-probs are the training forward's
    own, so with every advantage 0 the gradient is exactly 0, and Adam (which would blow float noise
    of ~1 ulp between two compiled programs up to a full-size step) leaves every parameter untouched."""
    params = init_params(CFG, jax.random.PRNGKey(1))
    updater = Updater(
        CFG,
        UpdateConfig(
            objective=ObjectiveConfig(loss="ppo", kl_coef=0.1), mini_batches=2, micro_batches=2, length_bucket=4
        ),
        optax.adam(1e-2),
    )
    state = updater.init_state(params, jax.random.PRNGKey(0))
    new_state, metrics = updater.update(state, _batch([0.5] * 8), params)
    assert float(metrics["first_minibatch_ratio_max_dev"]) == 0.0 and float(metrics["grad_norm"]) == 0.0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), new_state.params, params)


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_a_row_without_gradient_stays_in_the_baseline_but_its_tokens_do_not_count():
    """rl.truncation="mask": a failed row's loss mask is zeroed. Its tokens then change nothing in the
    update, while its reward still moves the other rows' group-relative advantages."""
    params = init_params(CFG, jax.random.PRNGKey(1))
    updater = Updater(CFG, UpdateConfig(objective=ObjectiveConfig(loss="ppo"), mini_batches=1), optax.sgd(0.5))
    state = updater.init_state(params, jax.random.PRNGKey(0))

    def update(rewards, failed_tokens_seed):
        batch = _batch(rewards)
        other = _batch(rewards, seed=failed_tokens_seed)
        tokens = np.array(batch.tokens)
        tokens[3] = np.asarray(other.tokens)[3]  # the failed row's tokens
        loss_mask = np.array(batch.loss_mask)
        loss_mask[3] = 0.0
        masked = batch.replace(tokens=tokens, loss_mask=loss_mask, group_size=4)  # one group
        new_state, metrics = updater.update(state, masked)
        return new_state.params, np.asarray(metrics["advantages"])

    a, adv_a = update([1.0, 0.0, 0.5, -1.0], 5)
    b, _ = update([1.0, 0.0, 0.5, -1.0], 6)
    c, adv_c = update([1.0, 0.0, 0.5, 0.2], 5)
    jax.tree.map(
        lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b
    )  # its tokens: no effect
    assert not np.allclose(adv_a[:3], adv_c[:3])  # its reward: in the baseline
    assert max(float(jnp.abs(x - y).max()) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(c))) > 1e-6


@pytest.mark.parametrize("loss", sorted(__import__("mtrl_jax.rl.losses", fromlist=["x"]).names()))
def test_every_built_in_loss_has_no_gradient_at_advantage_zero(loss):
    """What ``skip_zero_advantage`` rests on: a row with advantage 0 adds exactly 0 to the gradient."""
    rng = np.random.default_rng(0)
    logp = jnp.asarray(-rng.uniform(0.5, 3, size=(3, 7)), jnp.float32)
    old = jnp.asarray(-rng.uniform(0.5, 3, size=(3, 7)), jnp.float32)
    mask = jnp.asarray(rng.integers(0, 2, size=(3, 7)), jnp.float32).at[:, 0].set(1.0)
    g = jax.grad(lambda lp: objective(ObjectiveConfig(loss=loss), lp, old, jnp.zeros(3), mask, behav_logp=old)[0])(logp)
    np.testing.assert_array_equal(np.asarray(g), 0.0)


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_micro_batches_of_all_equal_groups_are_skipped_and_change_nothing():
    """Two all-equal groups of four (advantage 0): with no KL and no entropy term their micro-batches add 0
    to the gradient, so skipping them (``skip_zero_advantage``) gives the update that computes them, while
    only the rows with a signal are computed; with a KL term nothing is skipped."""
    rewards = [1.0, 0.0, 0.4, 0.4, 0.3, 0.3, 0.3, 0.3, 0.9, 0.1, 0.6, 0.2, 0.5, 0.5, 0.5, 0.5]
    batch = _batch(rewards).replace(group_size=4)
    params = init_params(CFG, jax.random.PRNGKey(1))

    def update(skip, kl=0.0):
        cfg = UpdateConfig(
            objective=ObjectiveConfig(loss="ppo", kl_coef=kl),
            update_epochs=2,
            micro_batches=4,
            logprob_chunk=7,
            length_bucket=4,
            skip_zero_advantage=skip,
        )
        updater = Updater(CFG, cfg, optax.adam(1e-2))
        new, metrics = updater.update(updater.init_state(params, jax.random.PRNGKey(9)), batch, params if kl else None)
        return new.params, {k: float(v) for k, v in metrics.items() if k != "advantages"}

    skipped, m_skip = update(True)
    full, m_full = update(False)
    assert m_skip["computed_rows_frac"] == 0.5 and m_full["computed_rows_frac"] == 1.0  # 8 of 16 rows have a signal
    jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6), skipped, full)
    moved = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), skipped, params)
    assert max(jax.tree.leaves(moved)) > 1e-3
    for name in ("loss", "pg_loss", "grad_norm"):
        np.testing.assert_allclose(m_skip[name], m_full[name], rtol=1e-5, atol=1e-7, err_msg=name)
    assert m_skip["real_token_fraction"] <= 1.0
    _, m_kl = update(True, kl=0.1)  # a KL term has a gradient on every row
    assert m_kl["computed_rows_frac"] == 1.0


def test_a_program_compiled_ahead_that_rejects_its_arguments_is_logged_and_jit_runs(caplog):
    from mtrl_jax.compile_ahead import Programs

    programs = Programs("update")
    programs.compile("f32", lambda: jax.jit(lambda x: x * 2).lower(np.ones(3, np.float32)))
    assert "f32" in programs
    jitted = jax.jit(lambda x: x * 2)
    np.testing.assert_array_equal(programs.run("f32", jitted, (np.ones(3, np.float32),)), [2, 2, 2])
    assert not caplog.text  # the compiled program served the call
    with caplog.at_level("WARNING", logger="mtrl_jax"):
        out = programs.run("f32", jitted, (np.ones(4, np.float32),))  # another shape: rejected before it runs
    np.testing.assert_array_equal(out, [2, 2, 2, 2])
    assert "update: the program compiled ahead for f32 was not used" in caplog.text and "f32" not in programs
    thread = programs.compile_in_background("i32", lambda: jax.jit(lambda x: x + 1).lower(np.ones(2, np.int32)), "t")
    np.testing.assert_array_equal(programs.run("i32", jitted, (np.ones(2, np.int32),)), [2, 2])  # waits for it
    assert not thread.is_alive()
