"""The RL loop: collect, select, update, publish, log, checkpoint, stop on SIGTERM or Ctrl-C (after a checkpoint); a
work directory that holds a checkpoint is resumed. ``python -m experiments.run`` calls ``train_and_evaluate``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import pathlib
import time

import jax
import jax.numpy as jnp

from mtrl_jax import distributed, rng
from mtrl_jax import metrics as M
from mtrl_jax.checkpoint import Checkpoints, RunRecord, WorkdirLock, check_run_config
from mtrl_jax.data.schedule import DataCursor
from mtrl_jax.evaluate import eval_rows, evaluate_policy
from mtrl_jax.host import stop_signals
from mtrl_jax.rl.batch import make_batch
from mtrl_jax.rl.guard import NonFiniteGuard
from mtrl_jax.compile_ahead import Background
from mtrl_jax.rollout.collector import Collector, fitted_slots
from mtrl_jax.rollout.staleness import AsyncRollouts, PublishedParams
from mtrl_jax.rollout.steps import StepRollouts
from mtrl_jax.setup import Components, build
from mtrl_jax.model import lora
from mtrl_jax.coldstart.stage import restore_policy, resume_or_warm_up, rl_policy

log = logging.getLogger("mtrl_jax")


class Trainer:
    def __init__(self, components: Components, workdir: os.PathLike):
        c = self.c = components
        run = c.run
        self.workdir = pathlib.Path(workdir)
        self.checkpoints = Checkpoints(self.workdir, run.checkpoint_keep)
        self.base = c.policy.base  # what the update and the sampler see beside the trainable parameters
        self.state = c.updater.init_state(c.policy.trainable, rng.key(run.seed, "train"))
        self.record = RunRecord(cursor=DataCursor(shuffle_seed=run.seed))
        self.ref_params = None
        self.published = PublishedParams(None, 0, c.collector.param_dtype)
        self.publish(self.state.params, 0)
        # never more rows (each a max_len KV cache) than this process's episodes of a step / of an evaluation
        eval_episodes, rows = eval_rows(c)
        step_episodes = -(-run.global_batch_size * run.group_size // jax.process_count())
        eval_cfg = dataclasses.replace(
            fitted_slots(c.collector, eval_episodes, rows), temperature=max(run.eval_temperature, 0)
        )
        self.collector, self.eval_collector = (
            Collector(c.model_cfg, c.chat, c.env, config, self.published, c.rollout_mesh)
            for config in (fitted_slots(c.collector, step_episodes, rows), eval_cfg)
        )
        self.rollouts = StepRollouts(
            self.collector,
            c.schedule,
            c.rl_tasks,
            run.seed,
            run.group_size,
            run.filter_max_extra_groups,
            c.selector.informative,
        )
        self.stop_requested, self.stop_code = False, 0  # a stop signal: save, then exit with 128 + its number
        self.nonfinite = NonFiniteGuard(run.max_nonfinite_steps)

    def request_stop(self, signum: int) -> None:
        self.stop_requested, self.stop_code = True, 128 + signum

    def publish(self, trainable, version: int) -> None:
        """The policy of these trainable parameters to the rollouts (a copy on this process's devices with several)."""
        self.published.publish(
            distributed.to_rollout_mesh(lora.merge(self.base, trainable), self.c.rollout_mesh), version
        )

    def trajectory_file(self, name: str):
        """Where a step's or an evaluation's trajectories go; None: not written (by this process)."""
        logged = self.c.run.log_trajectories and distributed.is_primary()
        return self.workdir / "trajectories" / f"{name}.jsonl" if logged else None

    def evaluate(self, label: str) -> dict:
        key, path = rng.key(self.c.run.seed, "eval"), self.trajectory_file(f"eval_{label}")
        return evaluate_policy(self.eval_collector, self.c.dev_tasks, key, path)

    def train_on(self, step: int, groups: list) -> dict:
        """One update on the groups of step ``step`` that ``c.selector`` keeps; every trajectory logged."""
        selection = self.c.selector.select(groups, step)
        self.record.dropped_groups += selection.counts["staleness/dropped_groups"]
        self.record.max_staleness_seen = max(self.record.max_staleness_seen, selection.counts.pop("staleness/max"))
        metrics = {**M.rollout_metrics([t for g in selection.fresh for t in g]), **selection.counts}
        if failed := metrics.get("episodes/tool_errors/service_error"):  # a flaky server, said where it is seen
            log.warning("RL step %d: %d tool calls failed on the tool service", step + 1, int(failed))
        if not selection.kept:
            log.warning("RL step %d: no trainable groups (%s)", step + 1, selection.counts)
        else:
            metrics.update(self._update(step, selection.kept, selection.no_gradient))
        metrics.update(M.type_metrics(selection.fresh))
        start = time.perf_counter()
        if (path := self.trajectory_file(f"step_{step + 1:06d}")) is not None:
            M.write_trajectories(path, [t for g in groups for t in g], step + 1)
        metrics["time/logging_s"] = time.perf_counter() - start
        return metrics

    def _update(self, step: int, groups: list, no_gradient: list) -> dict:
        """The update on ``groups``; each trajectory's advantage is set from the update's."""
        trajectories, run = [t for g in groups for t in g], self.c.run
        turn_credit = self.c.updater.config.turn_credit
        batch = make_batch(
            trajectories,
            run.group_size,
            pad_id=self.c.chat.pad_id,
            length=run.batch_length,
            no_gradient=no_gradient,
            turn_credit=turn_credit,
            reward_offset=self.c.reward_baseline,
        )
        start = time.perf_counter()
        self.state, update_metrics = self.c.updater.update(self.state, batch, self.ref_params, self.base)
        advantages = distributed.fetch(update_metrics.pop("advantages"))  # [B], batch-sharded on the mesh
        if turn_credit is not None:  # each turn's tokens' advantage into its record
            turn_advantages = distributed.fetch(update_metrics.pop("turn_advantages"))
            for t, advantage, turn_adv in zip(trajectories, advantages, turn_advantages):
                for turn, a in zip(t.turns, turn_adv):
                    turn["advantage"] = float(advantage + turn_credit.coef * a)
        update_metrics = jax.device_get(update_metrics)  # the one host transfer of the step's scalars
        metrics = {"time/update_s": time.perf_counter() - start}  # old / reference log-probs, loss, backward, optimizer
        for t, advantage in zip(trajectories, advantages):
            t.advantage = float(advantage)
        metrics.update({f"train/{k}": float(v) for k, v in update_metrics.items()})
        metrics["batch/real_token_fraction"] = metrics["train/real_token_fraction"]  # of the tokens the update computed
        metrics["throughput/trained_tokens_per_s"] = float(batch.loss_mask.sum()) / metrics["time/update_s"]
        last_checkpoint = self.workdir / "checkpoints" / str(self.record.rl_step)
        self.nonfinite.observe(step + 1, int(update_metrics["skipped_steps"]), last_checkpoint)
        return metrics

    def _begin(self) -> None:
        """Resume from the newest intact checkpoint, or cold-start, evaluate the starting policy and save step 0."""
        restored = self.checkpoints.restore(self.state)
        kl = self.c.updater.config.objective.kl_coef
        if restored is not None:
            self.state, self.record = restored
            log.info("resumed from %s at RL step %d", self.workdir / "checkpoints", self.record.rl_step)
            if self.c.warmup is not None and self.c.warmup.train_base:  # the base the adapters train over
                self.base = restore_policy(self.c, self.checkpoints, "warmup").base
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
            self.checkpoints.save(self.state, self.record)
        self.rollouts.start = (self.record.rl_step, self.record.cursor)

    def _warm_up(self) -> None:
        """The base policy evaluated first (``eval.before_warmup``; ``base_eval.json``, kept across a restart),
        then the supervised cold start, continued from its saved progress; a stop signal during it saves and exits."""
        base = self.workdir / "base_eval.json"
        if self.c.run.eval_before_warmup and not base.exists():
            metrics = self.evaluate("base")
            print(M.headline("base policy", metrics), flush=True)
            if distributed.is_primary():
                base.write_text(json.dumps(metrics, indent=2))
        stop = lambda: distributed.any_process(self.stop_requested)
        progress = resume_or_warm_up(self.c, self.checkpoints, self.state.params, log=log.info, should_stop=stop)
        if progress.step < self.c.warmup.steps:
            log.warning("stopped: warm-up progress written at step %d of %d", progress.step, self.c.warmup.steps)
            raise SystemExit(self.stop_code or 143)
        # with warmup.train_base the cold-started base is frozen and the fresh adapters (B = 0) train in RL
        self.base, trainable = rl_policy(self.c, progress.params)
        self.state = self.c.updater.init_state(trainable, self.state.rng)
        self.publish(trainable, 0)

    def _start_compiles(self):
        """The update and every sampler shape compiled ahead, in the background, during the cold start."""
        run, kl = self.c.run, bool(self.c.updater.config.objective.kl_coef)
        if jax.process_count() != 1 or run.total_steps == 0:
            return None
        rows = run.global_batch_size * run.group_size
        self.c.updater.compile_ahead(self.state, rows, run.batch_length, run.group_size, kl, self.base)
        if not self.collector.config.precompile:
            return None
        # the evaluation's shapes first: it runs first
        params = lora.merge(self.base, self.state.params)
        return Background([functools.partial(c.precompile, params) for c in (self.eval_collector, self.collector)])

    def _step(self, step: int, async_rollouts) -> dict:
        """RL step ``step``: its groups (rollout thread, or collected now), the update, new parameters published."""
        t0 = time.perf_counter()
        compiles = M.CompileCounter.mark()
        groups, timings = self.rollouts.collect(step) if async_rollouts is None else async_rollouts.get(step)
        groups, timings = StepRollouts.gather(groups, timings)
        metrics = {"time/collect_wait_s": time.perf_counter() - t0, **self.train_on(step, groups)}
        metrics.update({f"time/{k}" if k.endswith("_s") else f"rollout/{k}": v for k, v in timings.items()})
        self.record.rl_step, self.record.cursor = step + 1, self.rollouts.cursor(step + 1)
        self.publish(self.state.params, step + 1)
        if async_rollouts is not None:
            async_rollouts.publish(step + 1)
        collect_s = max(timings["collect_s"], 1e-9)
        metrics["throughput/sampled_tokens_per_s"] = metrics["throughput/sampled_tokens"] / collect_s
        if (peak := M.peak_device_memory_gib()) is not None:
            metrics["memory/peak_device_gib"] = peak
        run = self.c.run
        if run.eval_every and (step + 1) % run.eval_every == 0 and step + 1 < run.total_steps:
            metrics.update(M.flatten(self.evaluate(f"step_{step + 1:06d}"), "eval"))
        metrics.update(M.CompileCounter.since(compiles))  # this step's new programs (both threads)
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics

    def train(self) -> dict:
        run = self.c.run
        metrics_log, async_rollouts, precompile = None, None, self._start_compiles()
        try:
            self._begin()
            first, _ = self.rollouts.start
            metrics_log = M.MetricsLog(self.workdir, first + 1) if distributed.is_primary() else None
            if run.asynchronous and first < run.total_steps:
                async_rollouts = AsyncRollouts(self.rollouts.collect, first, run.max_staleness, first)
            progress = M.progress_bar(run.log_progress and distributed.is_primary(), first, run.total_steps)
            checkpoint_s = 0.0
            for step in range(first, run.total_steps):
                metrics = self._step(step, async_rollouts)
                metrics["time/previous_checkpoint_s"] = checkpoint_s  # written after the metrics: see below
                if metrics_log is not None:
                    metrics_log.write(step + 1, metrics)
                progress.update(1)
                progress.set_postfix(reward=f"{metrics['reward/mean']:.3f}", ndcg=f"{metrics['reward/ndcg@10']:.3f}")
                # all processes stop at the same step
                self.stop_requested = distributed.any_process(self.stop_requested)
                checkpoint_s = 0.0
                # after the step's metrics line: a run killed in between redoes the step, and a resume cuts
                # the log back to the checkpoint, so no step is logged twice or lost
                if (step + 1) % run.checkpoint_every == 0 or step + 1 == run.total_steps or self.stop_requested:
                    t1 = time.perf_counter()
                    self.checkpoints.save(self.state, self.record)
                    checkpoint_s = time.perf_counter() - t1
                if self.stop_requested:
                    log.warning("stopped: checkpoint written at RL step %d", step + 1)
                    raise SystemExit(self.stop_code or 143)
            progress.close()
        finally:
            if async_rollouts is not None:
                async_rollouts.stop()
            if precompile is not None:  # a short run: the shapes not compiled yet are not needed
                precompile.stop()
            self.c.updater.settle()  # never exit while the update compiles in its thread
            if metrics_log is not None:
                metrics_log.close()
        after = self.evaluate("after")
        print(M.headline("after RL", after), flush=True)
        staleness = self.record.to_json()["staleness"]
        summary = {
            "split": "dev",  # what "before" and "after" were measured on; test: experiments.evaluate --split=test
            "before": self.record.before,
            "after": after,
            "rl_steps": run.total_steps,
            "staleness": staleness,
        }
        return M.write_summary(self.workdir, summary, distributed.is_primary())

    def close(self) -> None:
        self.collector.close()
        self.eval_collector.close()
        self.checkpoints.close()


def train_and_evaluate(config, workdir: os.PathLike, stage: str = "all", data=None) -> dict:
    """The run of ``config`` in ``workdir``: the cold start, RL and the evaluations (``stage="all"``), or the
    cold start alone (``stage="warmup"``: what ``experiments.ablate`` shares between the arms of a seed; a run
    of the same config in a work directory holding a copy of its ``warmup/`` and ``tokenizer.json`` then
    starts RL from it, with the parameters a run that warmed up itself would have). ``data``: what
    ``setup.build_data(config)`` returned, when the caller loaded it (before creating the work directory)."""
    workdir = pathlib.Path(workdir)
    with WorkdirLock(workdir):  # before anything is written there
        check_run_config(workdir, config)
        trainer = Trainer(build(config, workdir, data=data), workdir)
        try:
            with stop_signals(trainer.request_stop):
                if stage == "warmup":
                    if trainer.c.warmup is None:
                        raise ValueError("--stage=warmup: the config has no warm-up (warmup.steps=0)")
                    trainer._warm_up()
                    return {"warmup_steps": trainer.c.warmup.steps}
                return trainer.train()
        finally:
            trainer.close()
