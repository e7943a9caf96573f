"""Episodes per second of the rollout collector with tool workers against tools run inline.

    python -m benchmarks.bench_collector                  # 64 episodes, one 50 ms tool call each, 3 repeats

The policy is the embedded default's tiny Qwen3 shape (random weights), the collector has the
default's 32 slots, 512-token contexts and 48-token turns. Each episode is a prompt, a turn, one
tool call that takes ``--tool_ms`` (a sleep, standing in for a search service), the tool's reply
and a second turn. A random policy seldom says the end-of-turn token, so ``--stop_share`` of the
vocabulary ends a turn (turns of ~17 tokens; a turn that reaches 48 tokens ends the episode, as
the search environment does). The two settings (``--workers`` tool threads, and 0: tools inline) alternate,
``--repeats`` times; the script prints the median episodes/s of each and the ratio, and where the
collector's time went (device calls, their count, tool waits, extend's useful-token fraction).
"""

from __future__ import annotations

import argparse
import statistics
import time

import jax
import numpy as np

from benchmarks.common import machine_line
from mtrl_jax.chat import ChatFormat, train_tokenizer
from mtrl_jax.data.collection import Task
from mtrl_jax.model import ModelConfig, init_params
from mtrl_jax.rollout.collector import Collector, CollectorConfig, EpisodeRequest
from mtrl_jax.rollout.interfaces import Environment, Episode, StepResult

WORDS = "search query document result alpha beta gamma delta project component part identifier".split()


class OneToolCall(Environment):
    """Turn 1, whatever it says, calls a tool that sleeps ``delay`` seconds; turn 2 ends the episode."""

    def __init__(self, delay: float, reply_words: int, rng: np.random.Generator):
        self.delay, self.reply = delay, " ".join(rng.choice(WORDS, reply_words))

    def reset(self, task):
        return Episode(task), [{"role": "system", "content": "You search."}, {"role": "user", "content": task.query}]

    def step(self, episode, text, hit_token_limit=False):
        turn = {"text": text, "stop_reason": "token_limit" if hit_token_limit else "end_of_turn"}
        episode.turns.append(turn)
        if hit_token_limit:
            episode.status, episode.reward, episode.final_ranking = "turn_token_limit", -1.0, []
            return StepResult([], True, turn)
        if len(episode.turns) >= 2:
            episode.status, episode.reward, episode.final_ranking = "ok", 0.0, []
            return StepResult([], True, turn)
        time.sleep(self.delay)
        return StepResult([{"role": "tool", "content": self.reply}], False, turn)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--episodes", type=int, default=64)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--tool_ms", type=float, default=50.0)
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--prompt_words", type=int, default=80)
    p.add_argument("--reply_words", type=int, default=30)
    p.add_argument("--stop_share", type=float, default=0.06, help="share of the vocabulary that ends a turn")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(machine_line(), flush=True)
    rng = np.random.default_rng(0)
    chat = ChatFormat(train_tokenizer([" ".join(rng.choice(WORDS, 50)) for _ in range(50)], 1024))
    chat.stop_ids = chat.stop_ids + [
        int(i) for i in rng.choice(chat.vocab_size, int(args.stop_share * chat.vocab_size), replace=False)
    ]
    cfg = ModelConfig(
        vocab_size=chat.vocab_size,
        hidden_size=128,
        intermediate_size=384,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=32,
        qk_norm=True,
        tie_word_embeddings=True,
        rope_theta=10000.0,
    )
    params = init_params(cfg, jax.random.PRNGKey(0))
    env = OneToolCall(args.tool_ms / 1e3, args.reply_words, rng)
    tasks = [Task(f"t{i}", " ".join(rng.choice(WORDS, args.prompt_words)), {}, "bench") for i in range(args.episodes)]
    requests = [EpisodeRequest(t, i // 8, i % 8, jax.random.PRNGKey(i)) for i, t in enumerate(tasks)]
    collectors = {}
    for workers in (args.workers, 0):
        config = CollectorConfig(
            slots=args.slots, max_len=512, max_tokens_per_turn=48, decode_chunk=48, tool_workers=workers
        )
        collectors[workers] = Collector(cfg, chat, env, config, lambda: (params, 0))
        collectors[workers].run(requests)  # compile
    seconds = {w: [] for w in collectors}
    timings = {w: [] for w in collectors}
    for _ in range(args.repeats):
        for workers, collector in collectors.items():  # alternated
            start = time.perf_counter()
            trajectories = collector.run(requests)
            seconds[workers].append(time.perf_counter() - start)
            timings[workers].append({**collector.timings, "tool_calls": sum(len(t.turns) == 2 for t in trajectories)})
            assert len(trajectories) == args.episodes
    rate = {w: args.episodes / statistics.median(s) for w, s in seconds.items()}
    print(
        f"{args.episodes} episodes, {args.slots} slots, one {args.tool_ms:.0f} ms tool call each, medians of "
        f"{args.repeats}:"
    )
    for workers in collectors:
        med = {k: statistics.median(t[k] for t in timings[workers]) for k in timings[workers][0]}
        label = f"{workers} tool workers" if workers else "tools inline"
        print(
            f"  {label:15s} {rate[workers]:6.1f} episodes/s | extend {med['extend_s']:.2f} s in "
            f"{med['extend_calls']:.0f} calls "
            f"({med['extend_useful_fraction']:.0%} useful tokens), decode {med['decode_s']:.2f} s in "
            f"{med['decode_calls']:.0f} calls, "
            f"tool waits {med['tool_wait_s']:.2f} s, {med['tool_calls']:.0f} tool calls"
        )
    print(f"tool workers / inline: {rate[args.workers] / rate[0]:.2f}x")
    for collector in collectors.values():
        collector.close()


if __name__ == "__main__":
    main()
