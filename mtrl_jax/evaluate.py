"""Aggregating evaluation metrics over trajectories.

nDCG@10 counts failures as 0 (as published MTRL results do); failure rate overall and by reason;
mean turns; mean tool calls per tool; pass@k at a threshold ``tau`` on nDCG with the unbiased
estimator ``1 - C(n-c, k) / C(n, k)``; max@k, the expected best nDCG of k samples, exactly from the
sorted samples with the subset-max weights of ALGORITHMS.md.
"""

from __future__ import annotations

import collections
import math
from typing import Sequence

import numpy as np

from mtrl_jax.rl.advantages import passk_weights


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


def summarize(trajectories: Sequence, samples_per_task: int = 1, k: int | None = None, tau: float = 0.5) -> dict:
    """Metrics of ``trajectories`` laid out as consecutive groups of ``samples_per_task`` per task."""
    n = len(trajectories)
    if n == 0:
        raise ValueError("no trajectories to summarize")
    scores = np.array([trajectory_score(t) for t in trajectories])
    failures = collections.Counter(t.status for t in trajectories if t.status != "ok")
    tools = collections.Counter()
    errors = 0
    for t in trajectories:
        for key, value in t.counters.items():
            if key.startswith("tool_calls/"):
                tools[key.split("/", 1)[1]] += value
            elif key.startswith("tool_errors/"):
                errors += value
    out = {
        "queries": n // samples_per_task,
        "samples": n,
        "ndcg@10": float(scores.mean()),
        "failure_rate": float(sum(failures.values()) / n),
        "failure_rate_by_reason": {r: c / n for r, c in sorted(failures.items())},
        "mean_turns": float(np.mean([len(t.turns) for t in trajectories])),
        "tool_calls_per_query": {name: c / n for name, c in sorted(tools.items())},
        "tool_errors_per_query": errors / n,
    }
    if samples_per_task > 1:
        k = k or samples_per_task
        groups = scores.reshape(-1, samples_per_task)
        out[f"pass@{k}"] = float(np.mean([pass_at_k(samples_per_task, int((g >= tau).sum()), k) for g in groups]))
        out[f"max@{k}"] = float(np.mean([max_at_k(g, k) for g in groups]))
        out["pass_threshold"] = tau
    return out
