"""Group selection (rollout/selection.py): staleness, dynamic sampling (rl.filter_groups), the even split,
rl.truncation, and the trainer's use of them on a controlled schedule of rewards (a scripted collector and a
recording updater: no model)."""

import types

import jax
import numpy as np
import pytest

from mtrl_jax.checkpoint import RunRecord
from mtrl_jax.data.collection import Task
from mtrl_jax.data.schedule import DataCursor, TaskSchedule
from mtrl_jax.rl.guard import NonFiniteGuard
from mtrl_jax.rollout.selection import GroupSelector, informative, no_gradient_rows, refill, split_informative
from mtrl_jax.rollout.steps import StepRollouts
from mtrl_jax.rollout.trajectory import Trajectory
from mtrl_jax.setup import RunSettings
from mtrl_jax.trainer import Trainer


def _group(rewards, status=None, group_id=0, kind="synthetic/lookup"):
    out = []
    for i, r in enumerate(rewards):
        t = Trajectory(
            f"t{group_id}",
            group_id,
            i,
            kind,
            tokens=[1, 2, 3, 4],
            loss_mask=[0, 1, 1, 1],
            behav_logp=[0.0, -1.0, -1.0, -1.0],
            version=[-1, 0, 0, 0],
        )
        t.reward, t.status = float(r), (status[i] if status else "ok")
        out.append(t)
    return out


def test_informative_and_split_keep_order():
    groups = [_group([0.5, 0.5]), _group([0.1, 0.2]), _group([-1, -1]), _group([0.0, 1.0])]
    keep, drop = split_informative(groups)
    assert [informative(g) for g in groups] == [False, True, False, True]
    assert keep == [groups[1], groups[3]] and drop == [groups[0], groups[2]]


def test_refill_on_a_controlled_schedule():
    # each generated group's rewards come from the schedule: all-equal (None) or informative (1)
    schedule = iter([None, 1, None, None, 1, 1, 1])
    calls = []

    def generate(n, round_):
        calls.append((n, round_))
        return [_group([0.3, 0.3]) if next(schedule) is None else _group([0.0, 1.0]) for _ in range(n)]

    start = [_group([0.0, 1.0]), _group([0.2, 0.2]), _group([0.4, 0.4]), _group([0.5, 0.5])]  # 1 informative of 4
    groups, extra = refill(start, 4, generate, max_extra_groups=10)
    # round 0 asks for the 3 missing: 1 informative; round 1 for 2: 1; round 2 for 1: 1
    assert calls == [(3, 0), (2, 1), (1, 2)] and extra == 6
    assert sum(informative(g) for g in groups) == 4 and groups[:4] == start
    # the cap bounds the extra generation, whatever the schedule
    calls.clear()
    groups, extra = refill(start, 4, lambda n, r: calls.append((n, r)) or [_group([0.3, 0.3])] * n, max_extra_groups=5)
    assert calls == [(3, 0), (2, 1)] and extra == 5 and sum(informative(g) for g in groups) == 1
    # nothing missing, or no cap: no generation
    assert refill(start, 1, generate, 10) == (start, 0)
    assert refill(start, 4, generate, 0) == (start, 0)


def test_no_gradient_rows():
    trajectories = _group([0.5, -1.0, -1.0, 0.2], status=["ok", "turn_token_limit", "max_turns", "ok"])
    assert no_gradient_rows(trajectories, "penalty") == []
    assert no_gradient_rows(trajectories, "mask") == [1, 2]
    with pytest.raises(ValueError, match="rl.truncation"):
        no_gradient_rows(trajectories, "drop")


class _Collector:
    """Returns scripted groups: the requests' rewards come from ``rewards_of(request)``."""

    def __init__(self, rewards_of):
        self.rewards_of, self.requests, self.timings = rewards_of, [], {"decode_s": 1.0}

    def run(self, requests):
        self.requests.append(requests)
        out = []
        for r in requests:
            t = _group([self.rewards_of(r)], group_id=r.group_id)[0]
            t.sample_index, t.task_id, t.task_type = r.sample_index, r.task.task_id, r.task.type
            out.append(t)
        return out


class _Updater:
    """Records the batch it is given; advantages = reward (enough to check they reach the records)."""

    def __init__(self, divisor):
        self.config = types.SimpleNamespace(rows_per_micro_batch_divisor=divisor, turn_credit=None)
        self.batches = []

    def update(self, state, batch, ref_params, base=None):
        self.batches.append(batch)
        return state, {
            "advantages": np.asarray(batch.reward),
            "skipped_steps": np.int32(0),
            "real_token_fraction": np.float32(1.0),
        }


def _trainer(tmp_path, rewards_of, filter_groups, max_extra, truncation="penalty", divisor=4):
    tasks = tuple(Task(f"s/{i}", f"q{i}", {"d": 1}, "s", "s/" + ("a" if i % 2 else "b")) for i in range(40))
    run = RunSettings(
        seed=0,
        global_batch_size=4,
        group_size=2,
        total_steps=2,
        asynchronous=False,
        max_staleness=0,
        batch_length=8,
        checkpoint_every=1,
        checkpoint_keep=1,
        eval_every=0,
        eval_temperature=0.0,
        log_trajectories=True,
        log_progress=False,
        max_nonfinite_steps=3,
        filter_groups=filter_groups,
        filter_max_extra_groups=max_extra,
        truncation=truncation,
    )
    trainer = object.__new__(Trainer)
    trainer.c = types.SimpleNamespace(
        run=run,
        train_tasks=tasks,
        schedule=TaskSchedule(list(tasks), 4),
        updater=_Updater(divisor),
        chat=types.SimpleNamespace(pad_id=0),
        reward_baseline=None,
    )
    trainer.workdir, trainer.record, trainer.ref_params, trainer.state = (
        tmp_path,
        RunRecord(cursor=DataCursor()),
        None,
        None,
    )
    trainer.base = {}  # no adapters: nothing beside the trainable parameters
    trainer.nonfinite = NonFiniteGuard(3)
    trainer.collector = _Collector(rewards_of)
    trainer.rollouts = StepRollouts(trainer.collector, trainer.c.schedule, tasks, run.seed, run.group_size, max_extra)
    trainer.c.selector = GroupSelector(run.max_staleness, run.global_batch_size, divisor, filter_groups, truncation)
    return trainer


def _schedule(request):
    # the step's groups 0 and 2 are all-equal; group 1 informative; group 3 all failed (-1);
    # every extra group (group id >= 4) is informative
    if request.group_id >= 4:
        return float(request.sample_index)
    return {0: 0.5, 1: float(request.sample_index), 2: 0.0, 3: -1.0}[request.group_id]


def test_trainer_drops_all_equal_groups_and_refills_within_the_cap(tmp_path):
    trainer = _trainer(tmp_path, _schedule, filter_groups=True, max_extra=2)
    groups, timings = trainer.rollouts.collect(0)
    assert (
        len(groups) == 6 and timings["decode_s"] == 2.0
    )  # 4 requested + 2 extra (capped), the collector's time summed
    extra = trainer.collector.requests[1]
    assert [r.group_id for r in extra] == [4, 4, 5, 5] and all(r.task in trainer.c.train_tasks for r in extra)
    # the same step draws the same extra tasks and keys (a resumed run regenerates them identically)
    again = _trainer(tmp_path, _schedule, filter_groups=True, max_extra=2).rollouts.extra_requests(0, 0, 2)
    assert [r.task.task_id for r in again] == [r.task.task_id for r in extra]
    assert all(np.array_equal(jax.random.key_data(a.key), jax.random.key_data(b.key)) for a, b in zip(again, extra))
    metrics = trainer.train_on(0, groups)
    assert metrics["filter/dropped_groups"] == 3 and metrics["filter/extra_episodes"] == 4
    assert (
        metrics["filter/informative_groups"] == 3 and metrics["batch/left_out_groups"] == 1
    )  # 3 groups: 2 split evenly
    batch = trainer.c.updater.batches[-1]
    assert batch.tokens.shape[0] == 4 and sorted(batch.reward.tolist()) == [0.0, 0.0, 1.0, 1.0]
    # per-type diagnostics over every fresh group: the share of all-equal groups, the mean |advantage|
    kinds = {g[0].task_type for g in groups}
    assert {f"by_type/{k}/all_equal_groups" for k in kinds} <= set(metrics)
    assert np.isclose(
        sum(metrics[f"by_type/{k}/all_equal_groups"] * sum(g[0].task_type == k for g in groups) for k in kinds), 3
    )
    trained = [t for g in groups for t in g if t.advantage is not None]
    assert len(trained) == 4 and all(t.advantage == t.reward for t in trained)
    lines = (tmp_path / "trajectories" / "step_000001.jsonl").read_text().splitlines()
    assert len(lines) == 12  # every collected trajectory is written, the untrained ones with no advantage


def test_trainer_without_filter_trains_on_every_group(tmp_path):
    trainer = _trainer(tmp_path, _schedule, filter_groups=False, max_extra=0)
    groups, _ = trainer.rollouts.collect(0)
    assert len(groups) == 4 and len(trainer.collector.requests) == 1
    metrics = trainer.train_on(0, groups)
    assert "filter/dropped_groups" not in metrics and trainer.c.updater.batches[-1].tokens.shape[0] == 8


def test_truncation_mask_zeroes_the_failed_rows_loss_mask(tmp_path):
    status_of = {3: "turn_token_limit"}

    trainer = _trainer(tmp_path, _schedule, filter_groups=False, max_extra=0, truncation="mask")
    groups, _ = trainer.rollouts.collect(0)
    for g in groups:
        for t in g:
            t.status = status_of.get(t.group_id, "ok")
    metrics = trainer.train_on(0, groups)
    batch = trainer.c.updater.batches[-1]
    assert metrics["batch/no_gradient_episodes"] == 2
    np.testing.assert_array_equal(batch.loss_mask.sum(1), [3, 3, 3, 3, 3, 3, 0, 0])
    assert batch.reward.tolist()[6:] == [-1.0, -1.0]  # still in the group's rewards (its baseline)
    penalty = _trainer(tmp_path, _schedule, filter_groups=False, max_extra=0, truncation="penalty")
    groups, _ = penalty.rollouts.collect(0)
    penalty.train_on(0, groups)
    assert penalty.c.updater.batches[-1].loss_mask.sum() == 24


def test_run_settings_check_the_dynamic_sampling_fields():
    from configs.default import get_config
    from mtrl_jax.setup import run_settings

    config = get_config()
    with config.unlocked():
        config.rl.filter_max_extra_groups = 4
    with pytest.raises(ValueError, match="rl.filter_groups=True"):
        run_settings(config, 16)
    with config.unlocked():
        config.rl.filter_groups, config.rl.truncation = True, "clip"
    with pytest.raises(ValueError, match="rl.truncation"):
        run_settings(config, 16)
    with config.unlocked():
        config.rl.truncation = "mask"
    settings = run_settings(config, 16)
    assert (settings.filter_groups, settings.filter_max_extra_groups, settings.truncation) == (True, 4, "mask")
