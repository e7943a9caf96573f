"""Metrics over trajectories and where they are written.

``summarize``: nDCG@10 with failures counted as 0 (as published MTRL results do); failure rate
overall and by reason; mean turns; tool calls and tool errors per episode; the same per task type; pass@k at a threshold
``tau`` on nDCG with the unbiased estimator ``1 - C(n-c, k) / C(n, k)``; max@k, the expected best
nDCG of k samples, exactly from the sorted samples with the subset-max weights of docs/algorithms.md.

``type_metrics``: an RL step's per-type training diagnostics (reward, nDCG@10, failures, turns,
tool calls, the share of all-equal groups, the mean absolute advantage).
``MetricsLog`` writes the scalars of each RL step to TensorBoard and ``metrics.jsonl``;
``write_trajectories`` writes one JSON record per trajectory.
"""

from __future__ import annotations

import collections
import json
import math
import pathlib
import resource
import sys
import threading
import types
from typing import Optional, Sequence

import jax
import numpy as np

from mtrl_jax.rl.advantages import passk_weights
from mtrl_jax.rollout.selection import all_equal


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k (Chen et al. 2021) from ``n`` samples with ``c`` successes."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def max_at_k(values: Sequence[float], k: int) -> float:
    """Expected max of ``k`` samples drawn without replacement from ``values``."""
    w, _ = passk_weights(len(values), k)
    return float(np.sort(np.asarray(values, np.float64)) @ w)


def trajectory_score(traj) -> float:
    """nDCG@10 with failures counted as 0."""
    return float(traj.reward) if traj.status == "ok" else 0.0


def summarize(
    trajectories: Sequence, samples_per_task: int = 1, k: int | None = None, tau: float = 0.5, by_type: bool = True
) -> dict:
    """Metrics of ``trajectories`` laid out as consecutive groups of ``samples_per_task`` per task;
    with ``by_type``, the same metrics of each task type (``Trajectory.task_type``) under ``"by_type"``."""
    out = _summarize(trajectories, samples_per_task, k, tau)
    if by_type:
        out["by_type"] = {
            kind: _summarize(subset, samples_per_task, k, tau) for kind, subset in split_by_type(trajectories).items()
        }
    return out


def split_by_type(trajectories: Sequence) -> dict:
    """``{type: [trajectories]}`` (types sorted, order within a type kept)."""
    out: dict = {}
    for t in trajectories:
        out.setdefault(t.task_type, []).append(t)
    return dict(sorted(out.items()))


def _summarize(trajectories: Sequence, samples_per_task: int, k: int | None, tau: float) -> dict:
    n = len(trajectories)
    if n == 0:
        raise ValueError("no trajectories to summarize")
    scores = np.array([trajectory_score(t) for t in trajectories])
    failures = collections.Counter(t.status for t in trajectories if t.status != "ok")
    tools, errors, asked = collections.Counter(), collections.Counter(), collections.Counter()
    for t in trajectories:
        for key, value in t.counters.items():
            if key.startswith("tool_calls/"):
                tools[key.split("/", 1)[1]] += value
            elif key.startswith("tool_queries/"):
                asked[key.split("/", 1)[1]] += value
            elif key.startswith("tool_errors/"):
                errors[key.split("/", 1)[1]] += value
    out = {
        "queries": n // samples_per_task,
        "samples": n,
        "ndcg@10": float(scores.mean()),
        "failure_rate": float(sum(failures.values()) / n),
        "failure_rate_by_reason": {r: c / n for r, c in sorted(failures.items())},
        "mean_turns": float(np.mean([len(t.turns) for t in trajectories])),
        "tool_calls_per_episode": {name: c / n for name, c in sorted(tools.items())},
        # queries per successful call of each tool (above 1 only where a call gave a list, search.max_queries)
        "queries_per_call": {name: asked[name] / c for name, c in sorted(tools.items()) if c and name in asked},
        "tool_errors_per_episode": sum(errors.values()) / n,
        "tool_errors": dict(sorted(errors.items())),  # failed tool calls by kind (the model's, the service's), in all
        "repeated_calls_per_episode": sum(t.counters.get("repeated_calls", 0) for t in trajectories) / n,
    }
    if samples_per_task > 1:
        k = k or samples_per_task
        groups = scores.reshape(-1, samples_per_task)
        out[f"pass@{k}"] = float(np.mean([pass_at_k(samples_per_task, int((g >= tau).sum()), k) for g in groups]))
        out[f"max@{k}"] = float(np.mean([max_at_k(g, k) for g in groups]))
        out["pass_threshold"] = tau
    return out


def peak_device_memory_gib() -> Optional[float]:
    """The largest ``peak_bytes_in_use`` of this process's devices, in GiB; ``None`` where the
    backend reports no memory statistics (CPU)."""
    peaks = [
        stats["peak_bytes_in_use"]
        for stats in (d.memory_stats() for d in jax.local_devices())
        if stats and "peak_bytes_in_use" in stats
    ]
    return max(peaks) / 2**30 if peaks else None


class CompileCounter:
    """XLA compilations in this process (every jitted program, eager ops' too), counted from JAX's
    ``/jax/core/compile/backend_compile_duration`` events; ``since(mark)`` gives the programs and
    seconds after a ``mark()``. One listener per process, registered on first use."""

    _lock = threading.Lock()
    _programs, _seconds, _registered = 0, 0.0, False

    @classmethod
    def _on_event(cls, name: str, seconds: float, **_):
        if name == "/jax/core/compile/backend_compile_duration":
            with cls._lock:
                cls._programs += 1
                cls._seconds += seconds

    @classmethod
    def mark(cls) -> tuple[int, float]:
        with cls._lock:
            if not cls._registered:
                jax.monitoring.register_event_duration_secs_listener(cls._on_event)
                cls._registered = True
            return cls._programs, cls._seconds

    @classmethod
    def since(cls, mark: tuple[int, float]) -> dict:
        programs, seconds = cls.mark()
        return {"compile/programs": programs - mark[0], "compile/seconds": seconds - mark[1]}


def rollout_metrics(trajectories: Sequence) -> dict:
    """The scalars logged for the trajectories of one RL step."""
    s = summarize(trajectories, by_type=False)
    out = {
        "reward/mean": float(np.mean([t.reward for t in trajectories])),
        "reward/ndcg@10": s["ndcg@10"],
        "episodes/failure_rate": s["failure_rate"],
        "episodes/mean_turns": s["mean_turns"],
        "episodes/tool_errors_per_episode": s["tool_errors_per_episode"],
        "episodes/repeated_calls_per_episode": s["repeated_calls_per_episode"],
        "throughput/sampled_tokens": float(sum(t.num_sampled for t in trajectories)),
    }
    out.update({f"episodes/failure_rate/{k}": v for k, v in s["failure_rate_by_reason"].items()})
    out.update({f"episodes/tool_errors/{k}": float(v) for k, v in s["tool_errors"].items()})  # the step's, by kind
    out.update({f"tools/calls_per_episode/{k}": v for k, v in s["tool_calls_per_episode"].items()})
    out.update({f"tools/queries_per_call/{k}": v for k, v in s["queries_per_call"].items()})
    return out


def type_metrics(groups: Sequence[Sequence]) -> dict:
    """Per task type, the training diagnostics of one RL step's groups (each group one task):
    ``by_type/<type>/{reward_mean, ndcg@10, failure_rate, mean_turns, tool_calls/<tool>,
    all_equal_groups, adv_abs_mean}``. ``all_equal_groups``: the share of the type's groups whose
    rewards are all equal (no GRPO signal); ``adv_abs_mean``: the mean absolute advantage of the
    type's trajectories that an update used (``Trajectory.advantage``; absent before any has)."""
    by_kind: dict = {}
    for group in groups:
        by_kind.setdefault(group[0].task_type, []).append(group)
    out = {}
    for kind, kind_groups in sorted(by_kind.items()):
        trajectories = [t for g in kind_groups for t in g]
        s = summarize(trajectories, by_type=False)
        prefix = f"by_type/{kind}/"
        out[prefix + "reward_mean"] = float(np.mean([t.reward for t in trajectories]))
        out[prefix + "ndcg@10"] = s["ndcg@10"]
        out[prefix + "failure_rate"] = s["failure_rate"]
        out[prefix + "mean_turns"] = s["mean_turns"]
        out.update({f"{prefix}tool_calls/{name}": v for name, v in s["tool_calls_per_episode"].items()})
        out[prefix + "all_equal_groups"] = float(np.mean([all_equal(g) for g in kind_groups]))
        advantages = [abs(t.advantage) for t in trajectories if t.advantage is not None]
        if advantages:
            out[prefix + "adv_abs_mean"] = float(np.mean(advantages))
    return out


def flatten(d: dict, prefix: str = "", sep: str = "/") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"prefix/a/b": 1}`` (``{"a/b": 1}`` without a prefix)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(flatten(v, key, sep))
        else:
            out[key] = v
    return out


def headline(label: str, m: dict) -> str:
    """Validation metrics as the run prints them: one line, and one per task type when there are several."""
    line = (
        f"[{label}] dev: nDCG@10 {m['ndcg@10']:.4f} (failures count 0), failure rate {m['failure_rate']:.3f}, "
        f"mean turns {m['mean_turns']:.2f}, tool calls {m['tool_calls_per_episode']}, queries {m['queries']}"
    )
    if m.get("tool_errors"):  # every phase says how many tool calls failed, and why (a flaky server shows here)
        line += f", failed tool calls {m['tool_errors']}"
    kinds = m.get("by_type", {})
    if len(kinds) > 1:
        line += "".join(
            f"\n    {kind}: nDCG@10 {v['ndcg@10']:.4f}, failure rate {v['failure_rate']:.3f}, mean turns "
            f"{v['mean_turns']:.2f}, queries {v['queries']}"
            for kind, v in kinds.items()
        )
    return line


def read_episodes(path: pathlib.Path) -> list:
    """An evaluation's trajectory file as episodes: ``task_id``, ``task_type`` (the collection, the task id's
    prefix), ``status``, ``reward``, ``turns``, ``counters``."""
    out = []
    for line in path.read_text().splitlines():
        r = json.loads(line)
        out.append(
            types.SimpleNamespace(
                task_id=r["task_id"],
                task_type=r["task_id"].split("/", 1)[0],
                status=r["status"],
                reward=r["reward"],
                turns=r["turns"],
                counters=r["counters"],
            )
        )
    return out


def task_scores(path: pathlib.Path) -> dict:
    """``{task_id: nDCG@10 (failures 0)}`` of an evaluation's trajectory file (one greedy episode a task)."""
    scores: dict = {}
    for number, t in enumerate(read_episodes(path), start=1):
        if t.task_id in scores:
            raise ValueError(f"{path}:{number}: a second episode of {t.task_id} (one episode a task expected)")
        scores[t.task_id] = trajectory_score(t)
    return scores


def write_trajectories(path: pathlib.Path, trajectories: Sequence, step: Optional[int] = None) -> None:
    """One JSON record per trajectory (``Trajectory.to_record``) in ``path``."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for t in trajectories:
            f.write(t.to_json(step) + "\n")


def truncate_logs(workdir: pathlib.Path, step: int) -> None:
    """Cut ``metrics.jsonl`` and the step trajectory files back to RL step ``step`` (a resumed run
    redoes the steps after it, and none may appear twice)."""
    jsonl = workdir / "metrics.jsonl"
    if jsonl.exists():
        kept = []
        for line in jsonl.read_text().splitlines():
            try:
                if json.loads(line)["step"] <= step:
                    kept.append(line + "\n")
            except (ValueError, KeyError, TypeError):  # a line cut short by the kill
                continue
        tmp = jsonl.with_suffix(".tmp")
        tmp.write_text("".join(kept))
        tmp.replace(jsonl)
    for path in (workdir / "trajectories").glob("*step_*.jsonl"):
        if int(path.stem.rsplit("_", 1)[1]) > step:
            path.unlink()


class MetricsLog:
    """Scalars per RL step to TensorBoard (``<workdir>/tensorboard``) and ``<workdir>/metrics.jsonl``.
    ``first_step``: TensorBoard events at or after it, left by an interrupted run, are purged."""

    def __init__(self, workdir: pathlib.Path, first_step: int = 0):
        from tensorboardX import SummaryWriter

        self.jsonl = workdir / "metrics.jsonl"
        self.writer = SummaryWriter(str(workdir / "tensorboard"), purge_step=first_step or None)

    def write(self, step: int, metrics: dict) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.number))}
        for k, v in scalars.items():
            if np.isfinite(v):
                self.writer.add_scalar(k, v, step)
        self.writer.flush()
        with open(self.jsonl, "a") as f:
            f.write(json.dumps({"step": step, **scalars}) + "\n")

    def close(self) -> None:
        self.writer.close()


def progress_bar(enabled: bool, start: int, total: int):
    """The RL steps' progress bar on stdout (tqdm), from ``start`` of ``total``; a no-op when not ``enabled``."""
    from tqdm import tqdm

    return tqdm(total=total, initial=start, desc="MTRL", unit="step", disable=not enabled, file=sys.stdout)


def write_summary(workdir: pathlib.Path, summary: dict, write: bool = True) -> dict:
    """``summary`` with the base policy's evaluation (``base_eval.json``, when the run made one) and the
    process's peak resident memory in GiB, written to ``<workdir>/summary.json`` when ``write``."""
    base = workdir / "base_eval.json"
    summary = {**summary, **({"base": json.loads(base.read_text())} if base.exists() else {})}
    summary["peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if write:
        (workdir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary
