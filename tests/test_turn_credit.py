"""Per-search credit (``rl.turn_reward="retrieval_gain"``): the environment's search-turn records, the host's
turn arrays, the token-level advantages against a plain-numpy reference written from docs/algorithms.md, and
the update with every registered loss and estimator (the skip rule restated for token-level advantages)."""

import math

import jax
import numpy as np
import optax
import pytest

from mtrl_jax.data.collection import Task
from mtrl_jax.model import init_params
from mtrl_jax.rl import advantages, losses
from mtrl_jax.rl.batch import TrajectoryBatch, make_batch
from mtrl_jax.rl.objective import ObjectiveConfig
from mtrl_jax.rl.train_step import UpdateConfig, plan_update, prepare
from mtrl_jax.rl.turn_credit import TurnCreditConfig, TurnRewards, token_advantages, token_turns, turn_arrays
from mtrl_jax.rl.updater import Updater
from mtrl_jax.rollout.interfaces import Tool, ToolOutput
from mtrl_jax.rollout.selection import GroupSelector, informative
from mtrl_jax.rollout.trajectory import Trajectory
from mtrl_jax.search.env import SearchEnvConfig, SearchEnvironment, search_credit
from test_train_step import CFG  # the tiny policy of the update's tests

# ----------------------------------------------------------------------------- the reference (numpy, loops)


def reference(reward, valid, token_turn, trajectory_adv, G, gamma, std_floor, coef):
    """docs/algorithms.md, "Per-search credit", written out with loops in float64."""
    B, K = reward.shape
    norm = np.zeros((B, K))
    for p in range(B // G):
        cells = [(b, k) for b in range(p * G, p * G + G) for k in range(K) if valid[b, k]]
        values = [float(reward[b, k]) for b, k in cells]
        n = len(values)
        mean = sum(values) / n if n else 0.0
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
        for b, k in cells:
            norm[b, k] = (reward[b, k] - mean) / (max(std, std_floor) + 1e-6)
    turn_adv = np.zeros((B, K))
    for b in range(B):
        for k in range(K):
            turn_adv[b, k] = sum(gamma ** (j - k) * norm[b, j] for j in range(k, K))
    adv = np.zeros(token_turn.shape)
    for b in range(B):
        for t in range(token_turn.shape[1]):
            k = token_turn[b, t]
            adv[b, t] = trajectory_adv[b] + coef * (turn_adv[b, k] if k >= 0 else 0.0)
    return adv, turn_adv


def _hand_made(seed=0, B=6, K=3, T=12):
    rng = np.random.default_rng(seed)
    reward = rng.uniform(-0.3, 0.6, size=(B, K)).astype(np.float32)
    valid = (rng.uniform(size=(B, K)) < 0.7).astype(np.float32)
    valid[3:6] = 0  # the second group: one search turn only
    valid[4, 1] = 1
    reward *= valid
    token_turn = np.full((B, T), -1, np.int32)
    for b in range(B):  # a prompt, then turns of 2-3 tokens separated by tool blocks
        t, k = 2, 0
        while t < T - 1 and k < K:
            n = 2 + (b + k) % 2
            token_turn[b, t : t + n] = k
            t, k = t + n + 1, k + 1
    return reward, valid, token_turn, rng.normal(size=B).astype(np.float32)


@pytest.mark.parametrize("gamma,std_floor,coef", [(1.0, 0.1, 1.0), (0.8, 0.0, 0.5), (0.5, 2.0, 3.0)])
def test_token_advantages_match_the_numpy_reference(gamma, std_floor, coef):
    reward, valid, token_turn, trajectory_adv = _hand_made()
    cfg = TurnCreditConfig(max_turns=3, coef=coef, gamma=gamma, std_floor=std_floor)
    got, got_turn = jax.jit(token_advantages, static_argnums=(2, 3))(
        trajectory_adv, TurnRewards(reward, valid, token_turn), 3, cfg
    )
    want, want_turn = reference(reward, valid, token_turn, trajectory_adv, 3, gamma, std_floor, coef)
    np.testing.assert_allclose(np.asarray(got_turn), want_turn, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert np.abs(want_turn[:3]).max() > 0.1  # the first group's turns differ: they are credited
    np.testing.assert_array_equal(np.asarray(got_turn)[3:], 0.0)  # one search reward in a group: nothing to compare


def test_a_group_whose_search_rewards_are_all_equal_gets_exactly_zero():
    """Shifted by the group's largest first, as the estimators are: 0.7 in float32, averaged, is not 0.7."""
    reward = np.full((4, 2), 0.7, np.float32)
    valid = np.array([[1, 1], [1, 0], [0, 0], [1, 1]], np.float32)
    token_turn = np.array([[0, 0, 1, 1], [0, 0, -1, -1], [0, -1, -1, -1], [0, 1, 1, -1]], np.int32)
    trajectory_adv = np.zeros(4, np.float32)
    adv, turn_adv = token_advantages(
        trajectory_adv, TurnRewards(reward * valid, valid, token_turn), 4, TurnCreditConfig(2, std_floor=0.0)
    )
    assert not np.asarray(adv).any() and not np.asarray(turn_adv).any()


def test_token_turns_number_the_runs_of_sampled_tokens():
    assert token_turns([0, 0, 1, 1, 0, 0, 1, 0, 1, 1]) == [-1, -1, 0, 0, -1, -1, 1, -1, 2, 2]
    assert token_turns([]) == [] and token_turns([0, 0]) == [-1, -1]


def _trajectory(loss_mask, turns, reward=0.0, sample_index=0):
    t = Trajectory("q1", 0, sample_index, tokens=list(range(1, len(loss_mask) + 1)), loss_mask=list(loss_mask))
    t.behav_logp, t.turns, t.reward, t.status = [0.0] * len(loss_mask), turns, reward, "ok"
    return t


def test_turn_arrays_from_trajectories():
    search = lambda gain, repeated: {"retrieval_gain": gain, "repeated_docs": repeated}  # noqa: E731
    a = _trajectory([0, 1, 1, 0, 1, 0, 1], [search(0.5, 0.0), {"calls": []}, {"answer_source": "answer"}])
    # cut off by the context limit in its second turn: that turn's tokens have a turn, it has no record
    b = _trajectory([0, 1, 0, 1, 1], [search(0.25, 0.5)], sample_index=1)
    got = turn_arrays([a, b], 8, TurnCreditConfig(max_turns=3, redundancy=0.4))
    np.testing.assert_allclose(got.reward, [[0.5, 0, 0], [0.25 - 0.4 * 0.5, 0, 0]])
    np.testing.assert_array_equal(got.valid, [[1, 0, 0], [1, 0, 0]])
    np.testing.assert_array_equal(got.token_turn, [[-1, 0, 0, -1, 1, -1, 2, -1], [-1, 0, -1, 1, 1, -1, -1, -1]])
    with pytest.raises(ValueError, match=r"trajectory 'q1' \(sample 0\) has 3 turns, more than env.max_turns = 2"):
        turn_arrays([a, b], 8, TurnCreditConfig(max_turns=2))
    batch = make_batch([a, b], 2, length=8, turn_credit=TurnCreditConfig(max_turns=3))
    assert batch.turns.reward.shape == (2, 3) and make_batch([a, b], 2, length=8).turns is None


# ----------------------------------------------------------------------------- what the environment records


def test_search_credit_counts_the_gain_of_the_best_ranking_and_the_repeats():
    qrels = {"a": 2, "b": 1, "c": 0}
    idcg = 2 + 1 / math.log2(3)
    got = search_credit({"a"}, [["a", "b"], ["b", "c", "c"]], qrels)
    assert got["retrieval_gain"] == pytest.approx(1 - 2 / idcg)  # {a, b, c} holds the ideal ranking; {a}: 2 / idcg
    assert got["repeated_docs"] == pytest.approx(2 / 4)  # a (seen before), b (shown by the first call)
    assert search_credit(set(), [["c"]], qrels) == {"retrieval_gain": 0.0, "repeated_docs": 0.0}
    assert search_credit({"x"}, [["a"]], {})["retrieval_gain"] == 0.0  # no judged documents: nothing to gain


class _Fixed(Tool):
    name, description = "bm25_search", "fixed results"
    parameters = {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}

    def run(self, query):
        return ToolOutput(query, {"one": ["a", "x"], "two": ["x", "b"]}.get(query, []))


def test_the_environment_records_each_search_turns_credit():
    env = SearchEnvironment([_Fixed()], SearchEnvConfig(max_turns=4))
    episode, _ = env.reset(Task("q", "question", {"a": 1, "b": 1}, "c"))
    call = '<tool_call>{{"name": "bm25_search", "arguments": {{"query": "{}"}}}}</tool_call>'
    env.step(episode, call.format("one"))
    env.step(episode, call.format("none"))  # a search that found nothing: no search-turn record
    env.step(episode, '<tool_call>{"name": "nope", "arguments": {}}</tool_call>')  # an error: none either
    env.step(episode, call.format("two"))
    first, empty, error, second = episode.turns
    idcg = 1 + 1 / math.log2(3)
    assert first["retrieval_gain"] == pytest.approx(1 / idcg) and first["repeated_docs"] == 0.0
    assert "retrieval_gain" not in empty and "retrieval_gain" not in error
    assert second["retrieval_gain"] == pytest.approx(1 - 1 / idcg) and second["repeated_docs"] == 0.5


# ----------------------------------------------------------------------------- which groups train


def test_a_group_of_equal_rewards_trains_when_its_searches_earned_differently():
    search = lambda gain: [{"retrieval_gain": gain, "repeated_docs": 0.0}]  # noqa: E731
    differ = [_trajectory([0, 1], search(0.1), 0.5), _trajectory([0, 1], search(0.4), 0.5)]
    same = [_trajectory([0, 1], search(0.3), 0.5), _trajectory([0, 1], search(0.3), 0.5)]
    assert not informative(differ) and informative(differ, 0.5) and not informative(same, 0.5)
    selector = GroupSelector(1, 2, 1, filter_groups=True, turn_redundancy=0.5)
    assert selector.select([differ, same], 0).kept == [differ]


# ----------------------------------------------------------------------------- the update


def _batch(rewards, turn_reward, T=12, seed=0):
    """Rows of a prompt (3 tokens), a search turn, a tool block, an answer turn; ``turn_reward [B]`` the search's."""
    rng = np.random.default_rng(seed)
    B = len(rewards)
    tokens = rng.integers(1, CFG.vocab_size, size=(B, T)).astype(np.int32)
    attention = np.ones((B, T), np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    loss_mask[:, 3:6], loss_mask[:, 8:12] = 1, 1
    token_turn = np.where(loss_mask > 0, (np.arange(T) >= 8).astype(np.int32)[None].repeat(B, 0), -1).astype(np.int32)
    turns = TurnRewards(
        np.stack([np.asarray(turn_reward, np.float32), np.zeros(B, np.float32)], 1),
        np.tile(np.array([[1, 0]], np.float32), (B, 1)),
        token_turn,
    )
    behav = np.where(loss_mask > 0, -rng.uniform(1, 4, size=(B, T)), 0.0).astype(np.float32)
    return TrajectoryBatch(tokens, attention, loss_mask, behav, np.asarray(rewards, np.float32), 2, turns)


def _update(batch, loss, estimator, credit, skip=True):
    cfg = UpdateConfig(
        objective=ObjectiveConfig(loss=loss),
        advantage=estimator,
        micro_batches=2,
        length_bucket=4,
        skip_zero_advantage=skip,
        turn_credit=TurnCreditConfig(max_turns=2) if credit else None,
    )
    updater = Updater(CFG, cfg, optax.sgd(0.5))
    state = updater.init_state(init_params(CFG, jax.random.PRNGKey(1)), jax.random.PRNGKey(2))
    state, metrics = updater.update(state, batch)
    return jax.device_get(state.params), jax.device_get(metrics)


@pytest.mark.parametrize("estimator", advantages.names())
def test_every_estimator_gives_the_trajectory_part(estimator):
    """The update's preparation (eager): the estimator's advantage plus the turn term, token by token, and the
    rows that count as signal are those with a non-zero advantage on a sampled token."""
    batch = _batch([0.9, 0.1, 0.4, 0.4, 0.2, 0.2], [0.3, 0.3, 0.6, 0.0, 0.1, 0.1])
    options = (("k", 1),) if estimator == "grpo_passk" else ()
    cfg = UpdateConfig(advantage=estimator, advantage_options=options, turn_credit=TurnCreditConfig(max_turns=2))
    updater = Updater(CFG, cfg, optax.sgd(0.5))
    state = updater.init_state(init_params(CFG, jax.random.PRNGKey(1)), jax.random.PRNGKey(2))
    prepared = prepare(plan_update(CFG, cfg, updater.tx, batch), state, batch, None, {})
    trajectory_adv = np.asarray(advantages.compute(estimator, batch.reward, 2, batch.loss_mask, **dict(options)))
    want, want_turn = reference(
        batch.turns.reward, batch.turns.valid, batch.turns.token_turn, trajectory_adv, 2, 1.0, 0.1, 1.0
    )
    np.testing.assert_allclose(np.asarray(prepared.data["adv"]), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(prepared.turn_advantages), want_turn, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(prepared.advantages), trajectory_adv)
    signal = np.asarray(prepared.signal)
    assert signal[:4].all() and not signal[4:].any()  # the third group ties on both


@pytest.mark.parametrize("loss", losses.LOSSES.names())
def test_every_loss_takes_token_advantages(loss):
    """A row's advantage given per token equals it given per row, and a token of advantage 0 has loss and
    log-prob gradient exactly 0 (what skipping the rows whose sampled tokens all have advantage 0 rests on)."""
    rng = np.random.default_rng(0)
    logp = -rng.uniform(0.5, 3, size=(4, 6)).astype(np.float32)
    old = logp + rng.normal(scale=0.1, size=(4, 6)).astype(np.float32)
    mask = np.ones((4, 6), np.float32)
    per_row = np.array([0.7, -1.2, 0.0, 0.4], np.float32)
    per_token = np.repeat(per_row[:, None], 6, axis=1)
    per_token[3, 3:] = 0.0  # a turn whose advantage is 0

    def total(lp, adv):
        value, _ = losses.compute(loss, lp, old, adv, mask)
        return (value * mask).sum(), value

    (_, by_row), _ = jax.value_and_grad(total, has_aux=True)(logp, per_row)
    (_, by_token), grad = jax.value_and_grad(total, has_aux=True)(logp, per_token)
    if loss != "gspo":  # gspo's ratio is the sequence's: a token's loss depends on the whole row
        np.testing.assert_array_equal(np.asarray(by_token)[:3], np.asarray(by_row)[:3])
        assert not np.asarray(by_token)[3, 3:].any() and not np.asarray(grad)[3, 3:].any()
    assert not np.asarray(by_token)[2].any() and not np.asarray(grad)[2].any()


@pytest.mark.slow
@pytest.mark.parametrize("loss,estimator", [("ppo", "grpo"), ("cispo", "rloo")])
def test_the_update_with_per_search_credit(loss, estimator):
    """With equal search rewards the term is exactly 0 and the update is the trajectory-level one; with equal
    trajectory rewards and different search rewards the rows train (they are not skipped as all-zero), and
    skipping the rows whose tokens all have advantage 0 changes nothing."""
    rewards = [0.9, 0.1, 0.4, 0.4]  # the second group's trajectories tie
    equal = _batch(rewards, [0.3, 0.3, 0.3, 0.3])
    flat, _ = _update(equal, loss, estimator, credit=False)
    credited, metrics = _update(equal, loss, estimator, credit=True)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=0, atol=1e-7), credited, flat)
    assert metrics["turn_advantage_abs_mean"] == 0.0

    differ = _batch(rewards, [0.3, 0.3, 0.6, 0.0])
    credited, metrics = _update(differ, loss, estimator, credit=True)
    assert metrics["computed_rows_frac"] == 1.0 and metrics["turn_advantage_abs_mean"] > 0
    assert np.asarray(metrics["turn_advantages"])[2, 0] > 0 > np.asarray(metrics["turn_advantages"])[3, 0]
    unskipped, _ = _update(differ, loss, estimator, credit=True, skip=False)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), credited, unskipped)
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(credited), jax.tree.leaves(flat)))


@pytest.mark.slow
def test_a_tied_group_with_different_searches_is_the_only_signal():
    """Every trajectory reward equal: without the credit nothing is computed; with it the update moves."""
    rewards = [0.5, 0.5, 0.5, 0.5]
    batch = _batch(rewards, [0.0, 0.4, 0.2, 0.2])
    params = jax.device_get(init_params(CFG, jax.random.PRNGKey(1)))
    flat, metrics = _update(batch, "ppo", "grpo", credit=False)
    assert metrics["computed_rows_frac"] == 0.0
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(a, b), flat, params)
    credited, metrics = _update(batch, "ppo", "grpo", credit=True)
    assert metrics["computed_rows_frac"] == 0.5  # the first group's micro-batch; the second's search rewards tie
    assert any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(credited), jax.tree.leaves(params)))
