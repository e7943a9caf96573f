"""The rollout collector: ``slots`` episodes at once as the rows of one generation batch.

Each slot cycles through: *extend* (append the prompt or the environment's reply to its KV-cache
row) -> *decode* (sample the assistant turn, in chunks, with every other generating slot) ->
*tool* (the environment parses the turn and runs the tools in a thread pool while the other slots
keep generating) -> extend ... until the episode ends; the slot is then refilled at once with the
next episode. Tokens are never re-tokenised: a trajectory is the prompt tokens, the sampled tokens
and the rendered environment replies, concatenated.

Every sampled token records the parameter version that produced it; ``params_source()`` is asked
for the latest ``(params, version)`` before each device call, so new parameters published by the
trainer are picked up mid-episode (``rollout.staleness.PublishedParams``). The episode itself
(rendering, the environment's replies, the context limit) is the one ``EpisodeDriver``'s.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
import time
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from mtrl_jax.chat import ChatFormat
from mtrl_jax.model.config import ModelConfig
from mtrl_jax.rollout import sampler as S
from mtrl_jax.rollout.engine import ExtendCounts, Sampler
from mtrl_jax.rollout.interfaces import Environment, EpisodeDriver, EpisodeRun
from mtrl_jax.rollout.trajectory import Trajectory


@dataclasses.dataclass(frozen=True)
class CollectorConfig:
    slots: int = 8  # rollout_max_concurrency
    max_len: int = 2048  # context (KV-cache) length per episode
    max_tokens_per_turn: int = 256
    decode_chunk: int = 64  # tokens per decode call; slots whose tools returned join at the next call
    temperature: float = 1.0
    top_p: float = 1.0
    tool_workers: int = 4  # 0: run tools inline (fully deterministic schedule)
    precompile: bool = True  # the trainer compiles every extend / decode shape ahead of time (Sampler.precompile)
    share_prefixes: bool = (
        True  # a new episode's prompt takes the cached prefix it shares with another (Sampler.extend)
    )
    min_prompt: int = 0  # no episode's prompt is shorter (setup measures a lower bound): the sampler's min_length
    param_dtype: str = ""  # the rollouts' copy of the parameters in this dtype ("": the parameters as they are)


def fitted_slots(config: CollectorConfig, episodes: int, rows: int = 1) -> CollectorConfig:
    """``config`` with no more generation rows than ``episodes`` to run at once (rounded up to a
    multiple of ``rows``, the devices the rows are split over): every row holds a ``max_len`` KV cache,
    so 128 slots of 8,192 tokens for 50 episodes would be gigabytes allocated for nothing."""
    needed = max(rows, -(-max(episodes, 1) // rows) * rows)
    return dataclasses.replace(config, slots=min(config.slots, needed))


@dataclasses.dataclass
class EpisodeRequest:
    task: object
    group_id: int
    sample_index: int
    key: jax.Array  # PRNG key of this episode


class _Inline:
    """A finished future, for ``tool_workers=0``."""

    def __init__(self, fn, *args):
        self._result = fn(*args)

    def done(self):
        return True

    def result(self):
        return self._result


@dataclasses.dataclass
class _Slot:
    request: EpisodeRequest
    run: EpisodeRun
    phase: str  # "extend" | "decode" | "tool"
    block: list = dataclasses.field(default_factory=list)
    future: object = None
    fresh: bool = True


class Collector:
    def __init__(
        self,
        model_cfg: ModelConfig,
        chat: ChatFormat,
        env: Environment,
        config: CollectorConfig,
        params_source: Callable[[], tuple[object, int]],
        mesh=None,
    ):
        self.chat, self.env, self.config, self.params_source = chat, env, config, params_source
        self.driver = EpisodeDriver(env, chat, config.max_len)
        self.sampler = Sampler(
            model_cfg,
            config.slots,
            config.max_len,
            min(config.decode_chunk, config.max_tokens_per_turn),
            mesh=mesh,
            min_shared=16 if config.share_prefixes else 0,
            min_length=config.min_prompt,
        )
        stop = list(chat.stop_ids)
        self.stop_tokens = np.array([stop] * config.slots, np.int32)
        self.pool = concurrent.futures.ThreadPoolExecutor(config.tool_workers) if config.tool_workers > 0 else None
        # the last run(): seconds in extend and decode (device calls) and tool waits (``*_s``), the
        # number of device calls, extend's token counts and their fractions (``extend_fractions``)
        self.timings: dict[str, float] = {}

    def precompile(self, params, stop: Optional[threading.Event] = None) -> None:
        """Compile the sampler's every ``extend`` / ``decode`` shape for these calls (``Sampler.precompile``);
        ``stop`` set: return after the program being compiled."""
        self.sampler.precompile(params, self.stop_tokens.shape[1], stop)

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def _submit(self, fn, *args):
        if self.pool is not None:
            return self.pool.submit(fn, *args)
        start = time.perf_counter()  # inline tools: generation waits for them
        done = _Inline(fn, *args)
        self.timings["tool_wait_s"] += time.perf_counter() - start
        return done

    def run(self, requests: Sequence[EpisodeRequest]) -> list[Trajectory]:
        """Run every episode to the end; returns trajectories in request order. Each round refills the free slots,
        takes the finished tool calls, extends the slots with new tokens (prompts, tool results), decodes the
        slots whose turn it is, or else waits for a tool call to finish."""
        timings = self.timings = {
            "extend_s": 0.0,
            "decode_s": 0.0,
            "tool_wait_s": 0.0,
            "extend_calls": 0,
            "decode_calls": 0,
        }
        run = _Slots(self, requests)
        while run.pending or any(run.slots):
            run.refill()
            run.take_tool_results()
            if run.any_in("extend"):
                run.extend()
            if run.any_in("decode"):
                run.decode()
            elif run.any_in("tool"):
                run.wait_for_a_tool()
        counts = run.counts
        timings.update(extend_tokens=counts.extended, extend_computed=counts.computed, extend_shared=counts.shared)
        timings.update(counts.fractions())
        return [run.results[i] for i in range(len(requests))]


class _Slots:
    """One ``Collector.run`` call: the sampler's slots (each an episode between its phases "extend", "decode" and
    "tool"), the requests waiting for one, the finished trajectories and the sampler state."""

    def __init__(self, collector: Collector, requests: Sequence[EpisodeRequest]):
        self.c, self.cfg = collector, collector.config
        self.pending = collections.deque(enumerate(requests))
        self.slots: list[Optional[_Slot]] = [None] * self.cfg.slots
        self.results: dict[int, Trajectory] = {}
        self.order: dict[int, int] = {}
        self.counts = ExtendCounts()
        self.state = collector.sampler.init()

    def any_in(self, phase: str) -> bool:
        return any(s is not None and s.phase == phase for s in self.slots)

    def release_if_done(self, i: int) -> None:
        if self.slots[i].run.done:
            self.results[self.order[i]] = self.slots[i].run.trajectory
            self.slots[i] = None

    def receive(self, i: int, step_result) -> None:
        slot = self.slots[i]
        slot.block = self.c.driver.receive(slot.run, step_result)
        slot.phase = "extend"
        self.release_if_done(i)

    def refill(self) -> None:
        for i in range(self.cfg.slots):
            while self.slots[i] is None and self.pending:
                index, req = self.pending.popleft()
                run, prompt = self.c.driver.begin(req.task, req.group_id, req.sample_index)
                self.slots[i], self.order[i] = _Slot(req, run, "extend", block=prompt), index
                self.release_if_done(i)

    def take_tool_results(self) -> None:
        for i, slot in enumerate(self.slots):
            if slot is not None and slot.phase == "tool" and slot.future.done():
                self.receive(i, slot.future.result())

    def extend(self) -> None:
        """The slots in phase "extend" take their new tokens in one call, then decode."""
        slots, timings = self.slots, self.c.timings
        params, _ = self.c.params_source()
        fresh = [s is not None and s.phase == "extend" and s.fresh for s in slots]
        if any(fresh):
            self.state = self.c.sampler.reset_rows(self.state, fresh)
        blocks = [s.block if s is not None and s.phase == "extend" else [] for s in slots]
        start = time.perf_counter()
        state, appended = self.c.sampler.extend(params, self.state, blocks)
        self.state = jax.block_until_ready(state)
        self.counts = self.counts + appended
        timings["extend_s"] += time.perf_counter() - start
        timings["extend_calls"] += 1
        for s in slots:
            if s is not None and s.phase == "extend":
                s.phase, s.block, s.fresh = "decode", [], False

    def decode(self) -> None:
        """One decode call for the slots in phase "decode"; a turn that ended goes to its tool, or fails."""
        slots, cfg, timings, driver = self.slots, self.cfg, self.c.timings, self.c.driver
        decoding = [s is not None and s.phase == "decode" for s in slots]
        params, version = self.c.params_source()
        keys = [s.request.key if s is not None else jax.random.PRNGKey(0) for s in slots]
        budget = [cfg.max_tokens_per_turn - len(s.run.turn_tokens) if d else 0 for s, d in zip(slots, decoding)]
        start = time.perf_counter()
        self.state, out = self.c.sampler.decode(
            params,
            self.state,
            jax.numpy.stack(keys),
            [cfg.temperature] * cfg.slots,
            [cfg.top_p] * cfg.slots,
            self.c.stop_tokens,
            decoding,
            budget,
        )
        tokens, logp, num, reason = jax.device_get((out.tokens, out.logp, out.num_tokens, out.stop_reason))
        timings["decode_s"] += time.perf_counter() - start
        timings["decode_calls"] += 1
        for i, slot in enumerate(slots):
            if not decoding[i]:
                continue
            n = int(num[i])
            driver.add_sampled(slot.run, tokens[i, :n], logp[i, :n], version)
            if reason[i] == S.STOP_TOKEN:
                slot.phase = "tool"
                slot.future = self.c._submit(driver.act, slot.run)
            elif reason[i] == S.CACHE_FULL:
                driver.fail(slot.run, "context_limit")
                self.release_if_done(i)
            elif len(slot.run.turn_tokens) >= cfg.max_tokens_per_turn:
                self.receive(i, driver.act(slot.run, hit_token_limit=True))

    def wait_for_a_tool(self) -> None:
        futures = [s.future for s in self.slots if s is not None and s.phase == "tool"]
        if not any(f.done() for f in futures):
            start = time.perf_counter()
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
            self.c.timings["tool_wait_s"] += time.perf_counter() - start
