"""Collector: slots, token-in/token-out, loss mask, tool thread pool, staleness, on-policy update."""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from mtrl_jax.chat import ChatFormat, train_tokenizer
from mtrl_jax.data.collection import Task
from mtrl_jax.model import ModelConfig, init_params
from mtrl_jax.rl.batch import make_batch
from mtrl_jax.rl.objective import ObjectiveConfig
from mtrl_jax.rl.optimizer import make_optimizer
from mtrl_jax.rl.train_step import UpdateConfig
from mtrl_jax.rl.updater import Updater
from mtrl_jax.rollout.collector import Collector, CollectorConfig, EpisodeRequest
from mtrl_jax.rollout.interfaces import Environment, Episode, StepResult
from mtrl_jax.rollout.selection import filter_stale
from mtrl_jax.rollout.staleness import AsyncRollouts
from mtrl_jax.rollout.trajectory import Trajectory


class EchoEnv(Environment):
    """Every turn gets a tool reply until ``turns`` turns were taken; the tool sleeps ``delay``."""

    def __init__(self, turns=2, delay=0.0, system="sys"):
        self.turns, self.delay, self.system = turns, delay, system
        self.active_tools = 0
        self.lock = threading.Lock()

    def reset(self, task):
        return Episode(task), [{"role": "system", "content": self.system}, {"role": "user", "content": task.query}]

    def step(self, episode, text, hit_token_limit=False):
        turn = {"text": text, "stop_reason": "token_limit" if hit_token_limit else "end_of_turn"}
        episode.turns.append(turn)
        if hit_token_limit:
            episode.status, episode.reward = "turn_token_limit", -1.0
            return StepResult([], True, turn)
        with self.lock:
            self.active_tools += 1
        time.sleep(self.delay)
        with self.lock:
            self.active_tools -= 1
        if len(episode.turns) >= self.turns:
            episode.status, episode.reward, episode.final_ranking = "ok", float(len(text) % 7) / 7, []
            return StepResult([], True, turn)
        return StepResult(
            [{"role": "tool", "content": f"result {len(episode.turns)} for {episode.task.query}"}], False, turn
        )


@pytest.fixture(scope="module")
def chat():
    return ChatFormat(train_tokenizer(["sys user tool result for query alpha beta gamma <tool_response>"] * 20, 300))


@pytest.fixture(scope="module")
def model(chat):
    cfg = ModelConfig(
        vocab_size=chat.vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        qk_norm=True,
        tie_word_embeddings=True,
    )
    return cfg, init_params(cfg, jax.random.PRNGKey(0))


def _requests(n, G=2):
    return [
        EpisodeRequest(Task(f"t{i}", f"query {i} alpha", {"d": 1}, "c"), i // G, i % G, jax.random.PRNGKey(i))
        for i in range(n)
    ]


def test_trajectories_are_token_in_token_out(chat, model):
    cfg, params = model
    env = EchoEnv(turns=3)
    collector = Collector(
        cfg,
        chat,
        env,
        CollectorConfig(slots=3, max_len=512, max_tokens_per_turn=12, decode_chunk=5, tool_workers=2),
        lambda: (params, 7),
    )
    trajectories = collector.run(_requests(7))
    assert [t.task_id for t in trajectories] == [f"t{i}" for i in range(7)]
    for traj in trajectories:
        # rebuild the token sequence from its pieces: the prompt, sampled turns and rendered replies
        _, messages = env.reset(Task(traj.task_id, "", {}, "c"))
        query = traj.task_id.replace("t", "query ") + " alpha"
        messages[1]["content"] = query
        expected = chat.prompt(messages)
        assert traj.tokens[: len(expected)] == expected and traj.prompt_len == len(expected)
        sampled_runs, pos = [], len(expected)
        tokens, mask = np.array(traj.tokens), np.array(traj.loss_mask)
        for i, turn in enumerate(traj.turns):
            start = pos
            while pos < len(tokens) and mask[pos] == 1:
                pos += 1
            sampled = tokens[start:pos].tolist()
            sampled_runs.append(sampled)
            assert chat.turn_text(sampled) == turn["text"]  # the env saw exactly the sampled tokens
            if i < len(traj.turns) - 1:
                reply = chat.continuation([{"role": "tool", "content": f"result {i + 1} for {query}"}])
                assert tokens[pos : pos + len(reply)].tolist() == reply and not mask[pos : pos + len(reply)].any()
                pos += len(reply)
        assert pos == len(tokens)
        # the loss mask covers exactly the sampled tokens, each with its behaviour logp and version
        assert sum(map(len, sampled_runs)) == traj.num_sampled
        assert all(v == 7 for v, m in zip(traj.version, traj.loss_mask) if m)
        assert all(lp == 0.0 for lp, m in zip(traj.behav_logp, traj.loss_mask) if not m)
        assert all(lp < 0.0 for lp, m in zip(traj.behav_logp, traj.loss_mask) if m)
        assert traj.status in ("ok", "turn_token_limit")


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_slots_refill_and_tools_overlap_generation(chat, model):
    cfg, params = model
    env = EchoEnv(turns=2, delay=0.3)
    decode_during_tools = []

    def source():
        decode_during_tools.append(env.active_tools)
        return params, 0

    collector = Collector(
        cfg,
        chat,
        env,
        CollectorConfig(slots=4, max_len=512, max_tokens_per_turn=8, decode_chunk=8, tool_workers=4),
        source,
    )
    trajectories = collector.run(_requests(10))
    assert len(trajectories) == 10 and all(t.status is not None for t in trajectories)
    assert max(decode_during_tools) > 0  # device calls happened while tool calls were running


@pytest.mark.slow
def test_inline_tools_are_deterministic(chat, model):
    cfg, params = model
    run = lambda: Collector(
        cfg,
        chat,
        EchoEnv(turns=2),
        CollectorConfig(
            slots=3,
            max_len=512,
            max_tokens_per_turn=10,  # noqa: E731
            decode_chunk=4,
            tool_workers=0,
        ),
        lambda: (params, 0),
    ).run(_requests(5))
    a, b = run(), run()
    assert [t.tokens for t in a] == [t.tokens for t in b]
    # the same episodes in a different slot count give the same samples (per-episode PRNG keys)
    c = Collector(
        cfg,
        chat,
        EchoEnv(turns=2),
        CollectorConfig(slots=5, max_len=512, max_tokens_per_turn=10, decode_chunk=10, tool_workers=0),
        lambda: (params, 0),
    ).run(_requests(5))
    assert [t.tokens for t in a] == [t.tokens for t in c]


def test_episodes_share_cached_prompt_prefixes_without_changing_a_token(chat, model):
    """The system prompt, and the whole prompt of a group's samples, are computed once per run (then
    copied into the rows that start with them): the same trajectories, with fewer tokens computed."""
    cfg, params = model
    system = " ".join(["sys alpha beta gamma"] * 8)

    def run(share):
        collector = Collector(
            cfg,
            chat,
            EchoEnv(turns=2, system=system),
            CollectorConfig(
                slots=3, max_len=512, max_tokens_per_turn=6, decode_chunk=6, tool_workers=0, share_prefixes=share
            ),
            lambda: (params, 0),
        )
        requests = [
            EpisodeRequest(
                Task(f"t{i // 2}", f"query {i // 2} alpha", {"d": 1}, "c"), i // 2, i % 2, jax.random.PRNGKey(i)
            )
            for i in range(8)
        ]  # 4 groups of 2 samples of one prompt
        return collector.run(requests), collector.timings, collector.sampler.piece

    (shared, timings, piece), (plain, plain_timings, _) = run(True), run(False)
    assert [t.tokens for t in shared] == [t.tokens for t in plain]
    np.testing.assert_allclose([t.behav_logp for t in shared], [t.behav_logp for t in plain], atol=1e-5)
    prompts = [
        chat.prompt([{"role": "system", "content": system}, {"role": "user", "content": f"query {i} alpha"}])
        for i in (0, 1)
    ]
    common = next(i for i, (a, b) in enumerate(zip(*prompts)) if a != b)  # what all prompts start with
    # every episode but the first shares at least that, and the first group's second sample (started in the
    # same call as the first) its whole prompt but the last token; each copies what it shares but for the
    # last whole piece of its prompt, which it computes
    copied = lambda count: len(prompts[0]) - -(-(len(prompts[0]) - count) // piece) * piece  # noqa: E731
    assert plain_timings["extend_shared"] == 0 and timings["extend_shared"] >= 6 * copied(common) + copied(
        len(prompts[0]) - 1
    )
    assert timings["extend_tokens"] + timings["extend_shared"] == plain_timings["extend_tokens"]
    assert timings["extend_shared_fraction"] > 0.4


def test_context_limit_ends_episode_with_failure(chat, model):
    cfg, params = model
    collector = Collector(
        cfg,
        chat,
        EchoEnv(turns=50),
        CollectorConfig(slots=2, max_len=64, max_tokens_per_turn=64, decode_chunk=16, tool_workers=0),
        lambda: (params, 0),
    )
    trajectories = collector.run(_requests(2))
    assert all(t.status == "context_limit" and t.reward == -1.0 for t in trajectories)
    assert all(len(t.tokens) <= 64 for t in trajectories)


# ------------------------------------------------------------------ staleness


def _traj(versions):
    t = Trajectory("t", 0, 0)
    for v in versions:
        t.append([1], sampled=True, logp=[-1.0], version=v)
    t.append([2], sampled=False)
    return t


def test_filter_stale_with_a_controlled_schedule():
    groups = [[_traj([5, 5]), _traj([5, 6])], [_traj([3, 6]), _traj([6])], [_traj([4]), _traj([6, 6])]]
    fresh, stale = filter_stale(groups, trainer_version=6, max_staleness=2)
    assert fresh == [groups[0], groups[2]] and stale == [groups[1]]  # one token 3 versions old spoils its group
    fresh, stale = filter_stale(groups, trainer_version=6, max_staleness=0)
    assert fresh == [] and len(stale) == 3
    fresh, _ = filter_stale(groups, trainer_version=6, max_staleness=3)
    assert len(fresh) == 3


@pytest.mark.parametrize("max_staleness", [0, 1, 2])
def test_async_rollouts_never_run_ahead_of_the_staleness_bound(max_staleness):
    started = {}
    holder = {"version": 0}

    def collect(step):
        started[step] = holder["version"]
        time.sleep(0.01)
        return step

    rollouts = AsyncRollouts(collect, start_step=0, max_staleness=max_staleness, initial_version=0)
    try:
        for step in range(6):
            assert rollouts.get(step) == step
            time.sleep(0.03)  # "training"
            holder["version"] = step + 1
            rollouts.publish(step + 1)
    finally:
        rollouts.stop()
    for step, version in started.items():
        assert step - version <= max_staleness, (step, version)
    if max_staleness > 0:
        assert any(step - version > 0 for step, version in started.items())  # it did overlap


@pytest.mark.slow
def test_on_policy_first_minibatch_ratio_is_one(chat, model):
    cfg, params = model
    collector = Collector(
        cfg,
        chat,
        EchoEnv(turns=2),
        CollectorConfig(slots=4, max_len=256, max_tokens_per_turn=10, decode_chunk=10, tool_workers=0),
        lambda: (params, 0),
    )
    trajectories = collector.run(_requests(8, G=4))
    for i, t in enumerate(trajectories):  # distinct rewards within each group: non-zero advantages
        t.reward = float(i % 3)
    batch = make_batch(trajectories, 4, 64, chat.pad_id)
    updater = Updater(
        cfg, UpdateConfig(objective=ObjectiveConfig(loss="ppo"), mini_batches=2), make_optimizer(1e-3, 10)
    )
    state = updater.init_state(params, jax.random.PRNGKey(0))
    new_state, metrics = updater.update(state, batch)
    assert metrics["first_minibatch_ratio_max_dev"] <= 1e-5
    assert metrics["behav_logp_max_abs_dev"] <= 1e-4  # sampler and trainer agree
    assert int(new_state.step) == 2
    changed = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), state.params, new_state.params)
    assert any(jax.tree.leaves(changed))
