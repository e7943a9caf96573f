"""The cold start's demonstrations: the scripted teacher's episodes, rendered through the same episode driver
the collector uses (so a demonstration is exactly a trajectory the policy could have sampled), selected by
rejection sampling and best-of-n on the training tasks' judgments, with hop drills and rewritten questions."""

from __future__ import annotations

import dataclasses

import numpy as np

from mtrl_jax import rng as seeds
from mtrl_jax.coldstart.teacher import (
    TeacherPolicy,
    augmented_tasks,
    question_vocabulary,
    special_tasks,
    teacher_turns,
)
from mtrl_jax.coldstart.masks import assistant_turns, decision_untrained, last_turn, longest_turn
from mtrl_jax.rollout.interfaces import EpisodeDriver, run_scripted


def demonstration_run(driver: EpisodeDriver, task, policy):
    """Run the scripted ``policy`` through the episode driver: the finished ``EpisodeRun``, whose trajectory
    is exactly what the collector would have produced had the policy sampled these turns, and whose
    episode holds the reward. A teacher's hop whose results overflow the context is left out (the episode
    is demonstrated without it)."""
    run = run_scripted(driver, task, policy)
    if run.episode.status == "context_limit" and isinstance(policy, TeacherPolicy) and policy.hops:
        run = run_scripted(driver, task, policy.without_hop())
    return run


def demonstration_tokens(driver: EpisodeDriver, task, policy) -> tuple[list[int], list[int]]:
    """``demonstration_run``'s ``(tokens, loss mask)``; an episode that does not end well is an error."""
    run = demonstration_run(driver, task, policy)
    if run.episode.status != "ok":
        raise RuntimeError(f"scripted demonstration failed on {task.task_id}: {run.episode.status}")
    return run.trajectory.tokens, run.trajectory.loss_mask


def searches(run) -> int:
    """The turns of ``run``'s episode that made a tool call."""
    return sum(1 for turn in run.episode.turns if turn.get("calls"))


def best_draws(runs: list, per_searches: bool = False) -> list:
    """Best of n (``warmup.keep_best``): the run with the highest reward, of equals the shortest answer, then the
    first drawn; with ``per_searches`` that run of each number of searches (fewest searches first)."""
    key = lambda run: (run.episode.reward, -last_turn(run.trajectory.loss_mask))  # noqa: E731
    if not per_searches:
        return [max(runs, key=key)]
    by_searches: dict[int, list] = {}
    for run in runs:
        by_searches.setdefault(searches(run), []).append(run)
    return [max(group, key=key) for _, group in sorted(by_searches.items())]


@dataclasses.dataclass
class DemoCounts:
    """What became of the drawn demonstrations, and the failed tool calls by kind (a flaky server shows here,
    not only in a worse cold start)."""

    budget: int  # rollout.max_tokens_per_turn
    min_reward: object = None
    samples_per_task: int = 1
    drawn: int = 0
    rejected: int = 0
    not_best: int = 0
    failed: int = 0
    too_long: int = 0
    tool_errors: dict = dataclasses.field(default_factory=dict)

    def usable(self, run, judged: bool) -> bool:
        """Whether ``run`` may be a demonstration: it ended well, no turn is over the per-turn limit (a call the
        sampler would cut short) and, if ``judged``, its reward reaches ``min_reward``; counted either way."""
        for key, value in run.episode.counters.items():
            if key.startswith("tool_errors/"):
                kind = key.split("/", 1)[1]
                self.tool_errors[kind] = self.tool_errors.get(kind, 0) + value
        if run.episode.status != "ok":
            self.failed += 1
        elif longest_turn(run.trajectory.loss_mask) > self.budget:
            self.too_long += 1
        elif judged and self.min_reward is not None and run.episode.reward < self.min_reward:
            self.rejected += 1
        else:
            return True
        return False

    def dropped(self) -> bool:
        return bool(self.rejected or self.not_best or self.failed or self.too_long or self.tool_errors)

    def __str__(self) -> str:
        return (
            f"{self.drawn} drawn, {self.rejected} below warmup.min_reward={self.min_reward}, {self.not_best} not the "
            f"best of their task's warmup.samples_per_task={self.samples_per_task}, {self.failed} past the context, "
            f"{self.too_long} with a turn over rollout.max_tokens_per_turn={self.budget}"
            + (f"; failed tool calls {dict(sorted(self.tool_errors.items()))}" if self.tool_errors else "")
        )


def demonstrations(components, log=None) -> list[tuple[list[int], list[int]]]:
    """The scripted teacher's ``(tokens, loss mask)`` demonstrations of every training task and its
    augmented variants (``components.warmup``, a ``ColdStartSettings``), rendered through the episode driver;
    the same, seeded, on every call.

    ``samples_per_task`` demonstrations are drawn per task (each with its own draws of the teacher). With
    ``min_reward`` set, those of a task with relevance judgments whose reward falls below it are dropped
    (rejection sampling on the training tasks' judgments; no held-out task is ever a demonstration); with
    ``keep_best``, only the highest-reward one of a judged task's draws is kept (best of n; ties: the one
    whose answer has fewest tokens, then the first drawn; with ``keep_best_per_searches`` that one of each
    number of searches; a variant without judgments, such as an augmented one, is then drawn once), so that
    the teacher's choices lean toward those that pay on each collection, and, for the same reward, toward the
    empty answer ranked by ``env.answer_fallback`` over ids listed (a small model's greedy id lists run on past
    the turn's limit). Only the answer is compared: counting every
    token would prefer fewer results asked for. A demonstration that does not end well (its results overflow
    the context), or has a turn longer than ``rollout.max_tokens_per_turn`` (which the sampler would cut), is
    dropped and counted (``DemoCounts``); an answer of ids is cut to the ids that fit that limit (DBpedia's
    long ids: ten of them do not fit 96 tokens)."""
    from tqdm import tqdm

    cfg = components.warmup
    rng = np.random.default_rng(seeds.numpy_seed(components.run.seed, "demonstrations"))
    driver = EpisodeDriver(components.env, components.chat, components.collector.max_len)
    vocabulary = question_vocabulary(components.train_tasks)
    budget, encode = components.collector.max_tokens_per_turn, components.chat.encode
    counts = DemoCounts(budget, cfg.min_reward, cfg.samples_per_task)

    def teacher(hop=None):
        policy = teacher_turns(rng, cfg.teacher, hop)
        policy.fits = lambda text: len(encode(text)) + 1 <= budget  # the turn's tokens and its end token
        return policy

    demos = []
    progress = getattr(components.run, "log_progress", False) and log is not None
    for task in tqdm(components.train_tasks, desc="demonstrations", unit="task", disable=not progress):
        variants = augmented_tasks(task, cfg.augment, rng, vocabulary) + special_tasks(task, cfg.special_copies, rng)
        for variant in [task] + variants:
            # with keep_best, a variant without judgments (an augmented one) has nothing to choose its draws by:
            # it is drawn once, so that each question and each rewrite weighs one demonstration
            judged = bool(variant.qrels)
            draws = cfg.samples_per_task if judged or not cfg.keep_best else 1
            runs = [demonstration_run(driver, variant, teacher()) for _ in range(draws)]
            counts.drawn += len(runs)
            kept = [run for run in runs if counts.usable(run, judged)]
            if cfg.keep_best and judged and kept:  # best of n: the highest reward, then the shortest answer
                best = best_draws(kept, cfg.keep_best_per_searches)
                counts.not_best += len(kept) - len(best)
                kept = best
            demos.extend((run.trajectory.tokens, run.trajectory.loss_mask) for run in kept)
            # hop drills: the hop forced, its decision untrained (none when no hop fits or none is shown)
            for _ in range(cfg.hop_drills):
                run = demonstration_run(driver, variant, teacher(hop=1.0))
                counts.drawn += 1
                mask = run.trajectory.loss_mask
                if counts.usable(run, False) and assistant_turns(mask) > 2:
                    demos.append((run.trajectory.tokens, decision_untrained(mask)))
    if log and counts.dropped():
        log(f"demonstrations: {counts}")
    if not demos:
        raise ValueError(f"no demonstration left for the warm-up ({counts})")
    return demos
