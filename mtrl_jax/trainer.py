"""The RL loop: collect, filter stale groups, update, publish, log, checkpoint, stop on SIGTERM.

``train_and_evaluate(config, workdir)`` is what ``python -m experiments.run`` calls. Components
come from ``mtrl_jax.setup``, checkpoints from ``mtrl_jax.checkpoint``, metrics and trajectory files
from ``mtrl_jax.metrics``. When ``workdir`` holds a checkpoint the run resumes from it (parameters,
optimizer state, RNG, data cursor, staleness counters); SIGTERM writes a checkpoint before exiting.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import pathlib
import signal
import sys
import threading
import time
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtrl_jax import distributed
from mtrl_jax import metrics as M
from mtrl_jax.checkpoint import Checkpoints, RunRecord, WorkdirLock
from mtrl_jax.data.schedule import DataCursor
from mtrl_jax.evaluate import eval_rows, run_episodes
from mtrl_jax.rl.batch import make_batch
from mtrl_jax.rollout.collector import Collector, EpisodeRequest, extend_fractions, fitted_slots
from mtrl_jax.rollout.dynamic_sampling import no_gradient_rows, refill, split_informative
from mtrl_jax.rollout.staleness import AsyncRollouts, PublishedParams, filter_stale
from mtrl_jax.setup import Components, build
from mtrl_jax.warmup import WarmupProgress, warm_up, warmup_optimizer

log = logging.getLogger("mtrl_jax")


def trainable_groups(groups: Sequence, rows_divisor: int) -> tuple[list, list]:
    """``(kept, left_out)``: the longest prefix of whole groups whose row count is a multiple of
    ``rows_divisor`` (mini-batches x micro-batches).

    Why drop any: the jitted update splits the batch's rows into equal mini- and micro-batches, and a
    group is only meaningful whole (its advantages compare its samples with each other). A full step
    always qualifies (the configuration is checked for it), but after stale groups are filtered out
    the rest may not split evenly; the few groups that do not fit are left out of this step, and
    counted in the step's metrics.
    """
    if not groups:
        return [], []
    size = len(groups[0])
    unit = math.lcm(size, rows_divisor) // size  # groups per evenly splittable block
    keep = len(groups) // unit * unit
    return list(groups[:keep]), list(groups[keep:])


class NonFiniteGuard:
    """Counts RL steps in a row whose update skipped an optimizer step (non-finite loss or gradient;
    the update leaves parameters and optimizer state as they were) and stops the run at ``limit``."""

    def __init__(self, limit: int):
        self.limit, self.in_a_row = limit, 0

    def observe(self, rl_step: int, skipped: int, last_checkpoint: pathlib.Path) -> None:
        if not skipped:
            self.in_a_row = 0
            return
        self.in_a_row += 1
        log.warning("RL step %d: %d optimizer step(s) skipped: non-finite loss or gradient (%d RL steps in a row)",
                    rl_step, skipped, self.in_a_row)
        if self.in_a_row >= self.limit:
            raise FloatingPointError(f"RL step {rl_step}: {self.in_a_row} RL steps in a row had non-finite losses or "
                                     f"gradients (rl.max_nonfinite_steps={self.limit}); stopping. The last checkpoint, "
                                     f"{last_checkpoint}, holds the last good parameters")


class Trainer:
    def __init__(self, components: Components, workdir: os.PathLike):
        c = self.c = components
        self.workdir = pathlib.Path(workdir)
        self.checkpoints = Checkpoints(self.workdir, c.run.checkpoint_keep)
        self.state = c.updater.init_state(c.params, jax.random.PRNGKey(c.run.seed))
        self.record = RunRecord(cursor=DataCursor(shuffle_seed=c.run.seed))
        self.ref_params = None
        self.published = PublishedParams(None, 0)
        self.publish(self.state.params, 0)
        # never more rows (each a max_len KV cache) than this process's episodes of a step / of an evaluation
        eval_episodes, rows = eval_rows(c)
        step_episodes = -(-c.run.global_batch_size * c.run.group_size // jax.process_count())
        self.collector = Collector(c.model_cfg, c.chat, c.env, fitted_slots(c.collector, step_episodes, rows), self.published,
                                   c.rollout_mesh)
        eval_cfg = dataclasses.replace(fitted_slots(c.collector, eval_episodes, rows), temperature=max(c.run.eval_temperature, 0.0))
        self.eval_collector = Collector(c.model_cfg, c.chat, c.env, eval_cfg, self.published, c.rollout_mesh)
        self.start = (0, self.record.cursor)  # (RL step, data cursor) the loop starts from
        self.stop_requested = False
        self.nonfinite = NonFiniteGuard(c.run.max_nonfinite_steps)

    # -------------------------------------------------------------- pieces of the loop

    def publish(self, params, version: int) -> None:
        """Hand ``params`` to the rollouts (a copy on this process's devices when there are several processes)."""
        self.published.publish(distributed.to_rollout_mesh(params, self.c.rollout_mesh), version)

    def requests(self, step: int) -> list[EpisodeRequest]:
        """The ``P x G`` episodes of RL step ``step``: the tasks at the data cursor, a key per episode."""
        first_step, first_cursor = self.start
        tasks = self.c.schedule.batch(self.c.schedule.advance(first_cursor, step - first_step))
        G = self.c.run.group_size
        base = jax.random.fold_in(jax.random.PRNGKey(self.c.run.seed + 1), step)
        return [EpisodeRequest(task, p, g, jax.random.fold_in(base, p * G + g)) for p, task in enumerate(tasks) for g in range(G)]

    def extra_requests(self, step: int, round_: int, groups: int) -> list[EpisodeRequest]:
        """Dynamic sampling's refill: ``groups`` more groups for RL step ``step`` (round ``round_``), of
        training tasks drawn at random, the same on every run of that step (and on each process its
        own); their group ids come after the step's ``global_batch_size``."""
        G, P = self.c.run.group_size, self.c.run.global_batch_size
        rng = np.random.default_rng([self.c.run.seed, step, round_, jax.process_index()])
        tasks = [self.c.train_tasks[i] for i in rng.choice(len(self.c.train_tasks), size=groups)]
        first = P * (1 + round_ * jax.process_count() + jax.process_index())  # unique, and >= P
        base = jax.random.fold_in(jax.random.fold_in(jax.random.PRNGKey(self.c.run.seed + 4), step), round_)
        base = jax.random.fold_in(base, jax.process_index())
        return [EpisodeRequest(task, first + p, g, jax.random.fold_in(base, p * G + g)) for p, task in enumerate(tasks) for g in range(G)]

    def collect(self, step: int) -> tuple[list, dict]:
        """This process's share of RL step ``step``'s groups (all of them with one process), refilled by
        dynamic sampling when it is on, and where the time went (``collect_s`` in all; the collector's
        extend, decode and tool waits); may run on the rollout thread, so it talks to no other process
        (``gather`` does, on the main thread)."""
        start = time.perf_counter()
        G, run = self.c.run.group_size, self.c.run
        trajectories = self.collector.run(distributed.share(self.requests(step), G))
        timings = dict(self.collector.timings)
        groups = [trajectories[i:i + G] for i in range(0, len(trajectories), G)]
        if run.filter_groups and run.filter_max_extra_groups:
            def generate(n, round_):
                more = self.collector.run(self.extra_requests(step, round_, n))
                for k, v in self.collector.timings.items():
                    timings[k] = timings.get(k, 0) + v
                if "extend_tokens" in timings:  # of the summed counts, not a sum of fractions
                    timings.update(extend_fractions(timings))
                return [more[i:i + G] for i in range(0, len(more), G)]

            cap = -(-run.filter_max_extra_groups // jax.process_count())  # each process refills its share
            groups, _ = refill(groups, len(groups), generate, cap)
        return groups, {**timings, "collect_s": time.perf_counter() - start}

    @staticmethod
    def gather(groups: list, timings: dict) -> tuple[list, dict]:
        """Every process's groups of the step, in request order, and the slowest process's timings."""
        everything = distributed.exchange([(groups, timings)])
        return [g for part, _ in everything for g in part], {k: max(t[k] for _, t in everything) for k in timings}

    def evaluate(self, label: str) -> dict:
        start = time.perf_counter()
        trajectories = run_episodes(self.eval_collector, self.c.val_tasks, jax.random.PRNGKey(self.c.run.seed + 2))
        if self.c.run.log_trajectories and distributed.is_primary():
            M.write_trajectories(self.workdir / "trajectories" / f"eval_{label}.jsonl", trajectories)
        return {**M.summarize(trajectories), "seconds": time.perf_counter() - start}

    def train_on(self, step: int, groups: list) -> dict:
        """One update on the fresh groups of RL step ``step``, informative ones only under dynamic
        sampling; returns the step's metrics. Every collected trajectory is written to the step's
        trajectory file, those the update used with their advantage."""
        run = self.c.run
        fresh, stale = filter_stale(groups, step, run.max_staleness)
        lag = [step - t.min_version() for g in fresh for t in g if t.min_version() is not None]
        self.record.dropped_groups += len(stale)
        self.record.max_staleness_seen = max([self.record.max_staleness_seen] + lag)
        trajectories = [t for g in fresh for t in g]
        metrics = {**M.rollout_metrics(trajectories), "staleness/dropped_groups": len(stale),
                   "staleness/mean": sum(lag) / len(lag) if lag else 0.0}
        trainable = fresh
        if run.filter_groups:
            trainable, all_equal = split_informative(fresh)
            metrics["filter/dropped_groups"] = len(all_equal)
            metrics["filter/extra_episodes"] = sum(len(g) for g in groups if g[0].group_id >= run.global_batch_size)
            metrics["filter/informative_groups"] = len(trainable)
            trainable = trainable[:run.global_batch_size]
        kept, left_out = trainable_groups(trainable, self.c.updater.config.rows_per_micro_batch_divisor)
        metrics["batch/left_out_groups"] = len(left_out)
        if not kept:
            log.warning("RL step %d: no trainable groups (%d stale, %d after filtering, %d left out)", step + 1, len(stale),
                        len(trainable), len(left_out))
        else:
            metrics.update(self._update(step, kept))
        metrics.update(M.type_metrics(fresh))
        start = time.perf_counter()
        if run.log_trajectories and distributed.is_primary():
            M.write_trajectories(self.workdir / "trajectories" / f"step_{step + 1:06d}.jsonl", [t for g in groups for t in g], step + 1)
        metrics["time/logging_s"] = time.perf_counter() - start
        return metrics

    def _update(self, step: int, groups: list) -> dict:
        """The update on ``groups`` (rows whose tokens get no gradient under ``rl.truncation="mask"``
        zeroed in the loss mask); each trajectory's advantage is set from the update's."""
        trajectories = [t for g in groups for t in g]
        batch = make_batch(trajectories, self.c.run.group_size, pad_id=self.c.chat.pad_id, length=self.c.run.batch_length)
        masked = no_gradient_rows(trajectories, self.c.run.truncation)
        batch.loss_mask[masked] = 0.0
        metrics = {"batch/no_gradient_episodes": len(masked)} if self.c.run.truncation != "penalty" else {}
        start = time.perf_counter()
        self.state, update_metrics = self.c.updater.update(self.state, batch, self.ref_params)
        advantages = distributed.fetch(update_metrics.pop("advantages"))  # [B], batch-sharded on the mesh
        update_metrics = jax.device_get(update_metrics)  # the one host transfer of the step's scalars
        metrics["time/update_s"] = time.perf_counter() - start  # old / reference log-probs, loss, backward, optimizer
        for t, advantage in zip(trajectories, advantages):
            t.advantage = float(advantage)
        metrics.update({f"train/{k}": float(v) for k, v in update_metrics.items()})
        metrics["batch/real_token_fraction"] = metrics["train/real_token_fraction"]  # of the tokens the update computed
        metrics["throughput/trained_tokens_per_s"] = float(batch.loss_mask.sum()) / metrics["time/update_s"]
        self.nonfinite.observe(step + 1, int(update_metrics["skipped_steps"]), self.workdir / "checkpoints" / str(self.record.rl_step))
        return metrics

    def save(self) -> None:
        self.checkpoints.save(self.state, self.record)

    def _on_sigterm(self, signum, frame):
        self.stop_requested = True

    # -------------------------------------------------------------- the run

    def _warm_up(self) -> None:
        """The supervised warm-up, continued from its saved progress; SIGTERM saves its progress."""
        w = self.c.warmup
        params = self.state.params
        like_opt = jax.eval_shape(warmup_optimizer(w.steps, w.learning_rate).init, params)
        saved = self.checkpoints.restore_warmup(params, like_opt)
        resume = None if saved is None else WarmupProgress(saved[0], saved[1], saved[2]["step"], saved[2]["rng_state"],
                                                           saved[2]["losses"])
        if resume is None or resume.step < w.steps:
            resume = warm_up(self.c, params, log=log.info, resume=resume,
                             should_stop=lambda: distributed.any_process(self.stop_requested))
            self.checkpoints.save_warmup(resume.params, resume.opt_state, resume.step, resume.rng_state, resume.losses)
            if resume.step < w.steps:
                log.warning("SIGTERM: warm-up progress written at step %d of %d, exiting", resume.step, w.steps)
                raise SystemExit(143)
        self.state = self.c.updater.init_state(resume.params, self.state.rng)
        self.publish(resume.params, 0)

    def _begin(self) -> None:
        """Resume from the newest intact checkpoint, or warm up, evaluate the starting policy and save step 0."""
        restored = self.checkpoints.restore(self.state)
        kl = self.c.updater.config.objective.kl_coef
        if restored is not None:
            self.state, self.record = restored
            log.info("resumed from %s at RL step %d", self.workdir / "checkpoints", self.record.rl_step)
            if distributed.is_primary():
                M.truncate_logs(self.workdir, self.record.rl_step)
            self.publish(self.state.params, self.record.rl_step)
            self.ref_params = self.checkpoints.restore_reference(self.state.params) if kl else None
        else:
            if self.c.warmup is not None:
                self._warm_up()
            self.record.before = self.evaluate("before")
            print(M.headline("before RL", self.record.before), flush=True)
            if kl:  # the policy RL starts from
                self.checkpoints.save_reference(self.state.params)
                self.ref_params = jax.tree.map(jnp.copy, self.state.params)
            self.save()
        self.start = (self.record.rl_step, self.record.cursor)

    def train(self) -> dict:
        run = self.c.run
        previous = signal.signal(signal.SIGTERM, self._on_sigterm)
        metrics_log, rollouts, precompile, stop = None, None, None, threading.Event()
        try:
            if jax.process_count() == 1 and run.total_steps > 0:  # compiled while warm-up and evaluation run
                self.c.updater.warm(self.state, run.global_batch_size * run.group_size, run.batch_length, run.group_size,
                                    bool(self.c.updater.config.objective.kl_coef))
                if self.collector.config.precompile:  # the evaluation's first (it runs first), then the step's
                    collectors, params = (self.eval_collector, self.collector), self.state.params
                    precompile = threading.Thread(target=lambda: [c.precompile(params, stop) for c in collectors],
                                                  daemon=True, name="sampler-compile")
                    precompile.start()
            self._begin()
            first, _ = self.start
            metrics_log = M.MetricsLog(self.workdir, first + 1) if distributed.is_primary() else None
            if run.asynchronous and first < run.total_steps:
                rollouts = AsyncRollouts(self.collect, first, run.max_staleness, first)
            progress = _progress(run.log_progress and distributed.is_primary(), first, run.total_steps)
            checkpoint_s = 0.0
            for step in range(first, run.total_steps):
                t0 = time.perf_counter()
                compiles = M.CompileCounter.mark()
                if rollouts is not None:
                    got_step, (groups, timings) = rollouts.get()
                    assert got_step == step, (got_step, step)
                else:
                    groups, timings = self.collect(step)
                groups, timings = self.gather(groups, timings)
                wait_s = time.perf_counter() - t0
                metrics = self.train_on(step, groups)
                metrics.update({f"time/{k}" if k.endswith("_s") else f"rollout/{k}": v for k, v in timings.items()})
                self.record.rl_step = step + 1
                self.record.cursor = self.c.schedule.advance(self.start[1], step + 1 - first)
                self.publish(self.state.params, step + 1)
                if rollouts is not None:
                    rollouts.publish(step + 1)
                metrics["time/collect_wait_s"] = wait_s
                metrics["throughput/sampled_tokens_per_s"] = metrics["throughput/sampled_tokens"] / max(timings["collect_s"], 1e-9)
                if (peak := M.peak_device_memory_gib()) is not None:
                    metrics["memory/peak_device_gib"] = peak
                if run.eval_every and (step + 1) % run.eval_every == 0 and step + 1 < run.total_steps:
                    metrics.update(M.flatten(self.evaluate(f"step_{step + 1:06d}"), "eval"))
                metrics.update(M.CompileCounter.since(compiles))  # this step's new programs (both threads)
                metrics["time/previous_checkpoint_s"] = checkpoint_s  # written after the metrics: see below
                metrics["time/step_s"] = time.perf_counter() - t0
                if metrics_log is not None:
                    metrics_log.write(step + 1, metrics)
                progress.update(1)
                progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", ndcg=f"{metrics['reward/ndcg@10']:.3f}")
                self.stop_requested = distributed.any_process(self.stop_requested)  # all processes stop at the same step
                checkpoint_s = 0.0
                # after the step's metrics line: a run killed in between redoes the step, and a resume cuts
                # the log back to the checkpoint, so no step is logged twice or lost
                if (step + 1) % run.checkpoint_every == 0 or step + 1 == run.total_steps or self.stop_requested:
                    t1 = time.perf_counter()
                    self.save()
                    checkpoint_s = time.perf_counter() - t1
                if self.stop_requested:
                    log.warning("SIGTERM: checkpoint written at RL step %d, exiting", step + 1)
                    raise SystemExit(143)
            progress.close()
        finally:
            if rollouts is not None:
                rollouts.stop()
            if precompile is not None:  # a short run: the shapes not compiled yet are not needed
                stop.set()
                precompile.join()
            signal.signal(signal.SIGTERM, previous)
            if metrics_log is not None:
                metrics_log.close()
        after = self.evaluate("after")
        print(M.headline("after RL", after), flush=True)
        summary = {"before": self.record.before, "after": after, "rl_steps": run.total_steps,
                   "staleness": self.record.to_json()["staleness"]}
        if distributed.is_primary():
            (self.workdir / "summary.json").write_text(json.dumps(summary, indent=2))
        return summary

    def close(self) -> None:
        self.collector.close()
        self.eval_collector.close()
        self.checkpoints.close()


def _progress(enabled: bool, start: int, total: int):
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="MTRL", unit="step", disable=not enabled, file=sys.stdout)


def train_and_evaluate(config, workdir: os.PathLike) -> dict:
    workdir = pathlib.Path(workdir)
    with WorkdirLock(workdir):  # before anything is written there
        trainer = Trainer(build(config, workdir), workdir)
        try:
            return trainer.train()
        finally:
            trainer.close()
