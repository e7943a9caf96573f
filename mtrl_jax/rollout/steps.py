"""The episodes of each RL step: its tasks (the task schedule at the data cursor), one key per episode
(the run's ``rollout`` stream), this process's share of them, the extra groups dynamic sampling asks
for (``selection.refill``), and the exchange of every process's groups on the main thread."""

from __future__ import annotations

import time
from typing import Callable, Sequence

import jax
import numpy as np

from mtrl_jax import distributed, rng
from mtrl_jax.data.schedule import DataCursor, TaskSchedule
from mtrl_jax.rollout.collector import Collector, EpisodeRequest
from mtrl_jax.rollout.engine import ExtendCounts
from mtrl_jax.rollout.selection import informative, refill


def add_timings(total: dict, more: dict) -> dict:
    """Two collections' timings summed, extend's fractions recomputed from the summed counts."""
    out = {k: total.get(k, 0) + v for k, v in more.items() if not k.endswith("_fraction")}
    if "extend_tokens" in out:
        out.update(ExtendCounts(out["extend_tokens"], out["extend_computed"], out["extend_shared"]).fractions())
    return out


class StepRollouts:
    """``collect(step)``: this process's groups of RL step ``step`` and where the time went. It may run on
    the rollout thread, so it talks to no other process (``gather`` does, on the main thread)."""

    def __init__(
        self,
        collector: Collector,
        schedule: TaskSchedule,
        train_tasks: Sequence,
        seed: int,
        group_size: int,
        filter_max_extra_groups: int = 0,
        informative: Callable[[Sequence], bool] = informative,
    ):
        self.collector, self.schedule, self.train_tasks = collector, schedule, train_tasks
        self.seed, self.group_size, self.max_extra = seed, group_size, filter_max_extra_groups
        self.informative = informative  # which groups dynamic sampling counts (GroupSelector.informative)
        self.start: tuple[int, DataCursor] = (
            0,
            DataCursor(shuffle_seed=seed),
        )  # (RL step, data cursor) the run starts from

    def cursor(self, step: int) -> DataCursor:
        """The data cursor at the start of RL step ``step``."""
        first_step, first_cursor = self.start
        return self.schedule.advance(first_cursor, step - first_step)

    def requests(self, step: int) -> list[EpisodeRequest]:
        """The ``P x G`` episodes of RL step ``step``: the tasks at the data cursor, a key per episode."""
        G = self.group_size
        base = jax.random.fold_in(rng.key(self.seed, "rollout"), step)
        return [
            EpisodeRequest(task, p, g, jax.random.fold_in(base, p * G + g))
            for p, task in enumerate(self.schedule.batch(self.cursor(step)))
            for g in range(G)
        ]

    def extra_requests(self, step: int, round_: int, groups: int) -> list[EpisodeRequest]:
        """Dynamic sampling's refill: ``groups`` more groups for RL step ``step`` (round ``round_``), of
        training tasks drawn at random, the same on every run of that step (and on each process its
        own); their group ids come after the step's ``global_batch_size``."""
        G, P = self.group_size, self.schedule.batch_size
        draw = np.random.default_rng(rng.numpy_seed(self.seed, "refill_tasks", step, round_, jax.process_index()))
        tasks = [self.train_tasks[i] for i in draw.choice(len(self.train_tasks), size=groups)]
        first = P * (1 + round_ * jax.process_count() + jax.process_index())  # unique, and >= P
        base = rng.key(self.seed, "refill")
        for x in (step, round_, jax.process_index()):
            base = jax.random.fold_in(base, x)
        return [
            EpisodeRequest(task, first + p, g, jax.random.fold_in(base, p * G + g))
            for p, task in enumerate(tasks)
            for g in range(G)
        ]

    def _groups(self, requests: list[EpisodeRequest]) -> tuple[list, dict]:
        trajectories = self.collector.run(requests)
        return [trajectories[i : i + self.group_size] for i in range(0, len(trajectories), self.group_size)], dict(
            self.collector.timings
        )

    def collect(self, step: int) -> tuple[list, dict]:
        start = time.perf_counter()
        groups, timings = self._groups(distributed.share(self.requests(step), self.group_size))
        if self.max_extra:

            def generate(n, round_):
                nonlocal timings
                more, more_timings = self._groups(self.extra_requests(step, round_, n))
                timings = add_timings(timings, more_timings)
                return more

            cap = -(-self.max_extra // jax.process_count())  # each process refills its share
            groups, _ = refill(groups, len(groups), generate, cap, self.informative)
        return groups, {**timings, "collect_s": time.perf_counter() - start}

    @staticmethod
    def gather(groups: list, timings: dict) -> tuple[list, dict]:
        """Every process's groups of the step, in request order, and the slowest process's timings."""
        everything = distributed.exchange([(groups, timings)])
        return [g for part, _ in everything for g in part], {k: max(t[k] for _, t in everything) for k in timings}
