"""The report of an ablation (``experiments.ablate``), from its finished runs: per arm the dev nDCG@10 after RL
with its interval, per pair the paired difference; with ``focus`` the same on the dev queries of one task type;
with ``reach`` the RL steps each run took to first reach a dev nDCG@10 (of the focus type, if given).

Steps to reach are read from the run's dev curve (before RL at step 0, every ``eval.every_steps``, after RL), so
they are a multiple of the evaluation interval. A run that never reaches the threshold counts as its last step
and is *censored*: the arm's mean is then a lower bound, and the report says how many seeds reached it."""

from __future__ import annotations

import itertools
import json
import pathlib
import time
from typing import Optional

import numpy as np

from mtrl_jax import stats
from mtrl_jax.metrics import task_scores


def _figure(summary_part: dict, focus: Optional[str]) -> float:
    return summary_part["ndcg@10"] if focus is None else summary_part["by_type"][focus]["ndcg@10"]


def dev_curve(workdir: pathlib.Path, focus: Optional[str] = None) -> list[tuple[int, float]]:
    """(step, dev nDCG@10, of the ``focus`` type's queries if given): before RL at 0, periodic evaluations,
    after RL at the end."""
    summary = json.loads((workdir / "summary.json").read_text())
    key = "eval/ndcg@10" if focus is None else f"eval/by_type/{focus}/ndcg@10"
    points = [(0, _figure(summary["before"], focus))]
    metrics = workdir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if key in row:
                points.append((row["step"], row[key]))
    points.append((summary["rl_steps"], _figure(summary["after"], focus)))
    return points


def steps_to_reach(curve: list[tuple[int, float]], threshold: float) -> tuple[int, bool]:
    """``(the first step whose value is >= threshold, True)``, or ``(the last step, False)`` (censored)."""
    for step, value in curve:
        if value >= threshold:
            return step, True
    return curve[-1][0], False


def task_types(path: pathlib.Path) -> dict:
    """``{task_id: task type}`` of an evaluation's trajectory file."""
    return {r["task_id"]: r["type"] for r in map(json.loads, path.read_text().splitlines())}


def score_matrix(workdirs, stage: str = "after", focus: Optional[str] = None) -> tuple[np.ndarray, list[str]]:
    """``[seeds, queries]`` dev nDCG@10 of the runs ``workdirs`` (the same queries in each) after RL, or with
    ``stage="before"`` of the cold-started policy RL started from; with ``focus``, the queries of that type."""
    files = [w / "trajectories" / f"eval_{stage}.jsonl" for w in workdirs]
    scores = [task_scores(f) for f in files]
    ids = sorted(scores[0])
    for w, s in zip(workdirs, scores):
        if sorted(s) != ids:
            raise ValueError(f"{w}: its dev queries differ from {workdirs[0]}'s: the arms are not paired")
    if focus is not None:
        types = task_types(files[0])
        ids = [i for i in ids if types[i] == focus]
        if not ids:
            raise ValueError(f"--focus {focus!r}: no dev query of that type (types: {sorted(set(types.values()))})")
    return np.array([[s[i] for i in ids] for s in scores]), ids


def _arm(after: np.ndarray, before: np.ndarray) -> dict:
    ci, gain = stats.interval(after), stats.paired(after, before)  # RL over the arm's own cold start
    return {
        "mean": ci.mean,
        "ci95": [ci.low, ci.high],
        "n": {"seeds": ci.seeds, "queries": ci.queries},
        "before": float(before.mean()),
        "gain": {"diff": gain.mean, "ci95": [gain.low, gain.high], "separated": gain.excludes_zero},
    }


def _pairs(matrices: dict) -> list[dict]:
    pairs = []
    for a, b in itertools.combinations(matrices, 2):
        diff = stats.paired(matrices[a], matrices[b])
        ci95 = [diff.low, diff.high]
        pairs.append({"a": a, "b": b, "diff": diff.mean, "ci95": ci95, "separated": diff.excludes_zero})
    return pairs


def _reach(runs: dict, threshold: float, focus: Optional[str]) -> dict:
    """Per arm each seed's steps to ``threshold`` (censored at its last step), their mean and t-interval over the
    seeds, how many reached it; per pair the paired difference over the seeds."""
    arms, steps = {}, {}
    for name, workdirs in runs.items():
        found = [steps_to_reach(dev_curve(w, focus), threshold) for w in workdirs]
        steps[name] = np.array([s for s, _ in found], np.float64)
        ci = stats.interval(steps[name])
        arms[name] = {
            "steps": [int(s) for s, _ in found],
            "reached": int(sum(r for _, r in found)),
            "mean": ci.mean,
            "ci95": [ci.low, ci.high],
            "censored": not all(r for _, r in found),
        }
    return {"threshold": threshold, "on": focus or "all dev queries", "arms": arms, "pairs": _pairs(steps)}


def report(ablation, started: float, focus: Optional[str] = None, reach: Optional[float] = None) -> dict:
    """``results.json``'s content: per arm its interval, per pair the paired difference (``ablation``: an
    ``experiments.ablate.Ablation`` whose runs have finished)."""
    from experiments.ablate import cell_name

    runs = {cell_name(c): [ablation.out / cell_name(c) / f"seed_{s}" for s in ablation.seeds] for c in ablation.cells}
    arms, matrices = {}, {}
    for cell in ablation.cells:
        name = cell_name(cell)
        matrices[name], _ = score_matrix(runs[name])
        summaries = [json.loads((w / "summary.json").read_text()) for w in runs[name]]
        arms[name] = {
            **_arm(matrices[name], score_matrix(runs[name], "before")[0]),
            "failure_rate": float(np.mean([s["after"]["failure_rate"] for s in summaries])),
            "curves": [dev_curve(w) for w in runs[name]],
            "wall_seconds": ablation.arm_wall_seconds(cell),
        }
    results = {
        "split": "dev",
        "seeds": ablation.seeds,
        "arms": arms,
        "pairs": _pairs(matrices),
        "warmups": {**ablation.warmup_counts(), "wall_seconds": ablation.warmup_wall_seconds()},
    }
    if focus is not None:
        focused = {name: score_matrix(w, focus=focus)[0] for name, w in runs.items()}
        results["focus"] = {
            "type": focus,
            "arms": {n: _arm(m, score_matrix(runs[n], "before", focus)[0]) for n, m in focused.items()},
            "pairs": _pairs(focused),
        }
    if reach is not None:
        results["reach"] = _reach(runs, reach, focus)
    return {**results, "seconds": time.perf_counter() - started}


def _verdict(separated: bool) -> str:
    return "separated" if separated else "not resolved"


def _tables(arms: dict, pairs: list, what: str) -> list[str]:
    any_arm = next(iter(arms.values()))
    seeds = any_arm["n"]["seeds"]
    n = f"{seeds} seed{'s' if seeds != 1 else ''} x {any_arm['n']['queries']} dev queries"
    failures = "failure_rate" in any_arm
    lines = [
        f"{what} after RL (failures 0), mean and 95% interval over {n}; before RL: the shared warm-up.",
        "",
        "| arm | nDCG@10 [95% CI] | before RL | RL gain [95% CI, paired] |" + " failure rate |" * failures,
        "|---|---|---|---|" + "---|" * failures,
    ]
    for name, r in arms.items():
        g = r["gain"]
        failures = f" {r['failure_rate']:.3f} |" if "failure_rate" in r else ""
        lines.append(
            f"| {name} | {r['mean']:.4f} [{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] | {r['before']:.4f} | "
            f"{g['diff']:+.4f} [{g['ci95'][0]:+.4f}, {g['ci95'][1]:+.4f}] {_verdict(g['separated'])} |{failures}"
        )
    lines += ["", "| a | b | a - b [95% CI, paired] | verdict |", "|---|---|---|---|"]
    for p in pairs:
        low, high = p["ci95"]
        verdict = _verdict(p["separated"])
        lines.append(f"| {p['a']} | {p['b']} | {p['diff']:+.4f} [{low:+.4f}, {high:+.4f}] | {verdict} |")
    return lines


def markdown(results: dict) -> str:
    pairs = results["pairs"]
    lines = _tables(results["arms"], pairs, "Dev nDCG@10")
    widest = max((p["ci95"][1] - p["ci95"][0]) / 2 for p in pairs) if pairs else 0.0
    separated = sum(p["separated"] for p in pairs)
    lines += [
        "",
        f"{separated} of {len(pairs)} pairs separated; the widest paired interval is ±{widest:.4f} around its mean.",
        f"Warm-ups: {results['warmups']['trained']} trained, {results['warmups']['reused']} reused.",
    ]
    if "focus" in results:
        focus = results["focus"]
        lines += ["", *_tables(focus["arms"], focus["pairs"], f"Dev nDCG@10 of the {focus['type']} queries")]
    if "reach" in results:
        reach = results["reach"]
        lines += [
            "",
            f"RL steps to first reach dev nDCG@10 >= {reach['threshold']} ({reach['on']}); a seed that never does "
            "counts its last step (censored: the mean is then a lower bound); mean and t-interval over the seeds.",
            "",
            "| arm | steps per seed | reached | mean steps [95% CI] |",
            "|---|---|---|---|",
        ]
        for name, r in reach["arms"].items():
            bound = " (censored)" if r["censored"] else ""
            lines.append(
                f"| {name} | {', '.join(map(str, r['steps']))} | {r['reached']} of {len(r['steps'])} | "
                f"{r['mean']:.1f} [{r['ci95'][0]:.1f}, {r['ci95'][1]:.1f}]{bound} |"
            )
        lines += ["", "| a | b | a - b steps [95% CI, paired over seeds] | verdict |", "|---|---|---|---|"]
        for p in reach["pairs"]:
            low, high = p["ci95"]
            verdict = _verdict(p["separated"])
            lines.append(f"| {p['a']} | {p['b']} | {p['diff']:+.1f} [{low:+.1f}, {high:+.1f}] | {verdict} |")
    return "\n".join(lines) + "\n"


def plot(results: dict, path: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results["arms"])
    means = np.array([results["arms"][n]["mean"] for n in names])
    low = means - np.array([results["arms"][n]["ci95"][0] for n in names])
    high = np.array([results["arms"][n]["ci95"][1] for n in names]) - means
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(names) + 2), 4.5), dpi=120)
    ax.errorbar(range(len(names)), means, yerr=[low, high], fmt="o", capsize=4)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("dev nDCG@10 after RL (failures count 0)")
    any_arm = next(iter(results["arms"].values()))
    ax.set_title(f"mean and 95% interval, {any_arm['n']['seeds']} seeds x {any_arm['n']['queries']} queries")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
