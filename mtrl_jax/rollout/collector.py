"""The rollout collector: ``slots`` episodes at once as the rows of one generation batch.

Each slot cycles through: *extend* (append the prompt or the environment's reply to its KV-cache
row) -> *decode* (sample the assistant turn, in chunks, with every other generating slot) ->
*tool* (the environment parses the turn and runs the tools in a thread pool while the other slots
keep generating) -> extend ... until the episode ends; the slot is then refilled at once with the
next episode. Tokens are never re-tokenised: a trajectory is the prompt tokens, the sampled tokens
and the rendered environment replies, concatenated.

Every sampled token records the parameter version that produced it; ``params_source()`` is asked
for the latest ``(params, version)`` before each device call, so new parameters published by the
trainer are picked up mid-episode.

``AsyncRollouts`` runs the collector in a background thread, ahead of the trainer by at most
``max_staleness`` parameter versions.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import queue
import threading
from typing import Callable, Optional, Sequence

import jax
import numpy as np

from mtrl_jax.chat import ChatFormat
from mtrl_jax.model.config import ModelConfig
from mtrl_jax.rollout import sampler as S
from mtrl_jax.rollout.env import Environment
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
    episode: object
    traj: Trajectory
    phase: str  # "extend" | "decode" | "tool"
    block: list = dataclasses.field(default_factory=list)
    turn_tokens: list = dataclasses.field(default_factory=list)
    future: object = None
    fresh: bool = True


class Collector:
    def __init__(self, model_cfg: ModelConfig, chat: ChatFormat, env: Environment, config: CollectorConfig,
                 params_source: Callable[[], tuple[object, int]]):
        self.chat, self.env, self.config, self.params_source = chat, env, config, params_source
        self.sampler = S.Sampler(model_cfg, config.slots, config.max_len, min(config.decode_chunk, config.max_tokens_per_turn))
        stop = list(chat.stop_ids)
        self.stop_tokens = np.array([stop] * config.slots, np.int32)
        self.pool = concurrent.futures.ThreadPoolExecutor(config.tool_workers) if config.tool_workers > 0 else None
        self.stats = collections.Counter()

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True)

    def _submit(self, fn, *args):
        return self.pool.submit(fn, *args) if self.pool is not None else _Inline(fn, *args)

    def run(self, requests: Sequence[EpisodeRequest]) -> list[Trajectory]:
        """Run every episode to the end; returns trajectories in request order."""
        cfg = self.config
        pending = collections.deque(enumerate(requests))
        slots: list[Optional[_Slot]] = [None] * cfg.slots
        results: dict[int, Trajectory] = {}
        order: dict[int, int] = {}
        state = self.sampler.init()

        def finish(i: int):
            slot = slots[i]
            ep, traj = slot.episode, slot.traj
            traj.turns, traj.reward, traj.status = ep.turns, ep.reward, ep.status
            traj.final_ranking, traj.counters = list(ep.final_ranking or []), dict(ep.counters)
            results[order[i]] = traj
            slots[i] = None
            self.stats["episodes"] += 1
            self.stats[f"status/{traj.status}"] += 1

        def receive(i: int, step_result):
            slot = slots[i]
            if step_result.done:
                return finish(i)
            block = self.chat.continuation(step_result.messages)
            if len(slot.traj.tokens) + len(block) + 1 > cfg.max_len:
                self.env.fail(slot.episode, "context_limit")
                return finish(i)
            slot.traj.append(block, sampled=False)
            slot.block, slot.phase = block, "extend"

        while pending or any(slots):
            for i in range(cfg.slots):  # refill free slots
                while slots[i] is None and pending:
                    index, req = pending.popleft()
                    episode, messages = self.env.reset(req.task)
                    prompt = self.chat.prompt(messages)
                    traj = Trajectory(req.task.task_id, req.group_id, req.sample_index, prompt_len=len(prompt))
                    traj.append(prompt, sampled=False)
                    slots[i], order[i] = _Slot(req, episode, traj, "extend", block=prompt), index
                    if len(prompt) + 1 > cfg.max_len:
                        self.env.fail(episode, "context_limit")
                        finish(i)

            for i, slot in enumerate(slots):  # collect finished tool calls
                if slot is not None and slot.phase == "tool" and slot.future.done():
                    receive(i, slot.future.result())

            if any(s is not None and s.phase == "extend" for s in slots):
                params, _ = self.params_source()
                fresh = [s is not None and s.phase == "extend" and s.fresh for s in slots]
                if any(fresh):
                    state = self.sampler.reset_rows(state, fresh)
                blocks = [s.block if s is not None and s.phase == "extend" else [] for s in slots]
                state = self.sampler.extend(params, state, blocks)
                self.stats["extend_calls"] += 1
                for s in slots:
                    if s is not None and s.phase == "extend":
                        s.phase, s.block, s.fresh, s.turn_tokens = "decode", [], False, []

            decoding = [s is not None and s.phase == "decode" for s in slots]
            if any(decoding):
                params, version = self.params_source()
                keys = [s.request.key if s is not None else jax.random.PRNGKey(0) for s in slots]
                budget = [cfg.max_tokens_per_turn - len(s.turn_tokens) if d else 0 for s, d in zip(slots, decoding)]
                state, out = self.sampler.decode(params, state, jax.numpy.stack(keys), [cfg.temperature] * cfg.slots,
                                                 [cfg.top_p] * cfg.slots, self.stop_tokens, decoding, budget)
                self.stats["decode_calls"] += 1
                tokens, logp = np.asarray(out.tokens), np.asarray(out.logp)
                num, reason = np.asarray(out.num_tokens), np.asarray(out.stop_reason)
                for i, slot in enumerate(slots):
                    if not decoding[i]:
                        continue
                    n = int(num[i])
                    slot.traj.append(tokens[i, :n], sampled=True, logp=logp[i, :n], version=version)
                    slot.turn_tokens += tokens[i, :n].tolist()
                    self.stats["sampled_tokens"] += n
                    if reason[i] == S.STOP_TOKEN:
                        slot.phase = "tool"
                        slot.future = self._submit(self.env.step, slot.episode, self.chat.turn_text(slot.turn_tokens))
                    elif reason[i] == S.CACHE_FULL:
                        self.env.fail(slot.episode, "context_limit")
                        finish(i)
                    elif len(slot.turn_tokens) >= cfg.max_tokens_per_turn:
                        receive(i, self.env.step(slot.episode, self.chat.turn_text(slot.turn_tokens), True))
            elif any(s is not None and s.phase == "tool" for s in slots):
                futures = [s.future for s in slots if s is not None and s.phase == "tool"]
                if not any(f.done() for f in futures):
                    concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
        return [results[i] for i in range(len(requests))]


def filter_stale(groups: Sequence[Sequence[Trajectory]], trainer_version: int, max_staleness: int):
    """Split groups into (fresh, stale): a group is stale when any of its sampled tokens is more
    than ``max_staleness`` parameter versions older than the trainer's."""
    fresh, stale = [], []
    for group in groups:
        versions = [t.min_version() for t in group if t.min_version() is not None]
        oldest = min(versions) if versions else trainer_version
        (stale if trainer_version - oldest > max_staleness else fresh).append(group)
    return fresh, stale


class AsyncRollouts:
    """Runs ``collect(step)`` for steps ``start, start+1, ...`` in a background thread.

    Batch ``step`` starts only once the trainer has published version ``>= step - max_staleness``,
    so generation overlaps training by at most ``max_staleness`` versions, and with
    ``max_staleness = 0`` every batch is generated entirely by the parameters it is trained from.
    """

    def __init__(self, collect: Callable[[int], list], start_step: int, max_staleness: int, initial_version: int):
        self.collect, self.max_staleness = collect, max_staleness
        self.version = initial_version
        self.cond = threading.Condition()
        self.out: queue.Queue = queue.Queue(maxsize=max_staleness + 1)
        self.error: Optional[BaseException] = None
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, args=(start_step,), daemon=True, name="rollouts")
        self.thread.start()

    def _loop(self, step: int):
        try:
            while True:
                with self.cond:
                    self.cond.wait_for(lambda: self.stopped or self.version >= step - self.max_staleness)
                    if self.stopped:
                        return
                batch = self.collect(step)
                while not self.stopped:
                    try:
                        self.out.put((step, batch), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                step += 1
        except BaseException as e:  # surfaced to the trainer by get()
            self.error = e
            self.out.put((None, None))

    def publish(self, version: int):
        with self.cond:
            self.version = version
            self.cond.notify_all()

    def get(self):
        step, batch = self.out.get()
        if self.error is not None:
            raise RuntimeError("rollout thread failed") from self.error
        return step, batch

    def stop(self):
        with self.cond:
            self.stopped = True
            self.cond.notify_all()
        self.thread.join(timeout=60)
