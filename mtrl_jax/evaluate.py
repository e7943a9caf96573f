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


# ----------------------------------------------------------------------------- the evaluation job


def markdown_table(results: dict, k: int | None = None) -> str:
    """One row per dataset: the headline metrics of ``results`` ({dataset: summarize(...)})."""
    cols = ["queries", "ndcg@10", "failure_rate", "mean_turns"] + ([f"pass@{k}", f"max@{k}"] if k and k > 1 else [])
    lines = ["| dataset | " + " | ".join(cols) + " | failures by reason | tool calls / query |",
             "|---|" + "---|" * (len(cols) + 2)]
    for name, m in results.items():
        cells = [f"{m[c]}" if c == "queries" else f"{m[c]:.4f}" for c in cols]
        reasons = ", ".join(f"{r} {v:.3f}" for r, v in m["failure_rate_by_reason"].items()) or "-"
        tools = ", ".join(f"{t} {v:.2f}" for t, v in m["tool_calls_per_query"].items()) or "-"
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {reasons} | {tools} |")
    return "\n".join(lines) + "\n"


def comparison_table(base: dict, tuned: dict, base_label: str = "base", tuned_label: str = "fine-tuned") -> str:
    """Side-by-side ``base -> fine-tuned`` table with the relative change, per dataset and metric."""
    lines = [f"| dataset | metric | {base_label} | {tuned_label} | change |", "|---|---|---|---|---|"]
    for name in tuned:
        if name not in base:
            continue
        for metric in [m for m in tuned[name] if isinstance(tuned[name][m], float) and m in base[name] and m != "pass_threshold"]:
            b, t = base[name][metric], tuned[name][metric]
            rel = f"{(t - b) / abs(b) * 100:+.1f}%" if b else ("n/a" if t == b else "new")
            lines.append(f"| {name} | {metric} | {b:.4f} | {t:.4f} | {t - b:+.4f} ({rel}) |")
    return "\n".join(lines) + "\n"


def run_evaluation(config, out_dir, checkpoint: str | None = None, samples: int = 1, tau: float = 0.5,
                   compare: str | None = None) -> dict:
    """Evaluate a trained work directory (``checkpoint``) or the base policy on the held-out tasks
    of every dataset of ``config``; writes ``eval.json``, ``eval.md``, one TREC run file per
    dataset (first sample) and, with ``compare``, ``compare.md``."""
    import dataclasses
    import json
    import pathlib

    import jax

    from mtrl_jax.rollout.collector import Collector, EpisodeRequest
    from mtrl_jax.search.metrics import write_trec_run
    from mtrl_jax.trainer import Run

    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run = Run(config, checkpoint if checkpoint else out)
    if checkpoint:
        if not run.try_restore():
            raise FileNotFoundError(f"{checkpoint}: no checkpoint under {pathlib.Path(checkpoint) / 'checkpoints'}")
    temperature = config.rollout.temperature if samples > 1 else config.eval.temperature
    collector_cfg = dataclasses.replace(run.collector_cfg, temperature=temperature, tool_workers=0)  # deterministic
    collector = Collector(run.model_cfg, run.chat, run.env, collector_cfg, run.holder)
    key = jax.random.PRNGKey(config.seed + 3)
    results = {}
    for name in run.collections:
        tasks = [t for t in run.val_tasks if t.corpus == name]
        if not tasks:
            continue
        requests = [EpisodeRequest(t, i, s, jax.random.fold_in(key, i * samples + s))
                    for i, t in enumerate(tasks) for s in range(samples)]
        trajectories = collector.run(requests)
        results[name] = summarize(trajectories, samples, k=samples if samples > 1 else None, tau=tau)
        with open(out / f"{name}.run", "w") as f:
            write_trec_run(f, {t.task_id.split("/", 1)[-1]: traj.final_ranking
                               for t, traj in zip(tasks, trajectories[::samples])}, tag="mtrl_jax")
        with open(out / f"{name}.trajectories.jsonl", "w") as f:
            for traj in trajectories:
                f.write(traj.to_json() + "\n")
    (out / "eval.json").write_text(json.dumps(results, indent=2))
    (out / "eval.md").write_text(markdown_table(results, samples))
    if compare:
        base = json.loads((pathlib.Path(compare) / "eval.json").read_text())
        (out / "compare.md").write_text(comparison_table(base, results, f"base ({compare})", f"fine-tuned ({out})"))
    for c in (collector, run.collector, run.eval_collector):  # their tool thread pools
        c.close()
    return results
