"""The evaluation job: a trained work directory (or the base policy) on the dev tasks of every dataset, or
once per final config on the test tasks (``evaluate_test``, the only reader of the test split, with its
ledger), built from ``setup`` and ``checkpoint`` (no training run, no optimizer state in memory).

Writes per dataset, and per task type within it: nDCG@10 (failures 0), failure rate and by reason,
mean turns, tool calls per episode, pass@k / max@k with several samples (``mtrl_jax.metrics``), a TREC run of the first
sample
and the trajectories; ``--compare`` adds a base -> fine-tuned table.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import pathlib
import subprocess
import time
from typing import Optional, Sequence

import jax
import numpy as np

from mtrl_jax import distributed, rng, stats
from mtrl_jax.checkpoint import Checkpoints, check_saved_config
from mtrl_jax.metrics import summarize, trajectory_score, write_trajectories
from mtrl_jax.rollout.collector import Collector, EpisodeRequest, fitted_slots
from mtrl_jax.rollout.staleness import PublishedParams
from mtrl_jax.search.metrics import write_trec_run
from mtrl_jax.search.baselines import evaluate_retrieval
from mtrl_jax.data.collection import test_split
from mtrl_jax.setup import build, build_data, load_collections, search_settings, split_sizes
from mtrl_jax.coldstart.stage import STAGES, restore_policy

EVAL_SPLITS = ("dev", "test")  # what an evaluation reads; test only through evaluate_test and its ledger
LEDGER = "test_evaluations.jsonl"  # in the evaluated work directory: one line per reading of its test split


def markdown_table(results: dict, k: int | None = None) -> str:
    """One row per dataset, the headline metrics of ``results`` ({dataset: summarize(...)}), then one
    per task type of a dataset whose tasks have types of their own."""
    cols = ["queries", "ndcg@10", "failure_rate", "mean_turns"] + ([f"pass@{k}", f"max@{k}"] if k and k > 1 else [])
    lines = [
        "| dataset | " + " | ".join(cols) + " | failures by reason | tool calls / episode |",
        "|---|" + "---|" * (len(cols) + 2),
    ]
    for name, m in results.items():
        kinds = m.get("by_type", {})
        rows = [(name, m)] + (
            [(f"{name} · {kind}", v) for kind, v in kinds.items()] if len(kinds) > 1 or name not in kinds else []
        )
        for label, row in rows:
            cells = [f"{row[c]}" if c == "queries" else f"{row[c]:.4f}" for c in cols]
            reasons = ", ".join(f"{r} {v:.3f}" for r, v in row["failure_rate_by_reason"].items()) or "-"
            tools = ", ".join(f"{t} {v:.2f}" for t, v in row["tool_calls_per_episode"].items()) or "-"
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {reasons} | {tools} |")
    return "\n".join(lines) + "\n"


def comparison_table(base: dict, tuned: dict, base_label: str = "base", tuned_label: str = "fine-tuned") -> str:
    """Side-by-side ``base -> fine-tuned`` table with the relative change, per dataset and metric."""
    lines = [f"| dataset | metric | {base_label} | {tuned_label} | change |", "|---|---|---|---|---|"]
    for name in tuned:
        if name not in base:
            continue
        for metric in [
            m for m in tuned[name] if isinstance(tuned[name][m], float) and m in base[name] and m != "pass_threshold"
        ]:
            b, t = base[name][metric], tuned[name][metric]
            rel = f"{(t - b) / abs(b) * 100:+.1f}%" if b else ("n/a" if t == b else "new")
            lines.append(f"| {name} | {metric} | {b:.4f} | {t:.4f} | {t - b:+.4f} ({rel}) |")
    return "\n".join(lines) + "\n"


def eval_rows(components, samples: int = 1, tasks: Optional[Sequence] = None) -> tuple[int, int]:
    """(episodes this process runs at once in an evaluation: its share of the largest dataset's
    evaluated tasks (``tasks``, by default the dev tasks) x ``samples``; the devices the generation rows
    are split over), for ``fitted_slots``."""
    tasks = components.dev_tasks if tasks is None else tasks
    largest = max([sum(t.corpus == name for t in tasks) for name in components.collections] or [1])
    mesh = components.rollout_mesh
    return -(-largest * samples // jax.process_count()), mesh.shape["data"] * mesh.shape["fsdp"]


def run_episodes(collector: Collector, tasks: Sequence, key: jax.Array, samples: int = 1) -> list:
    """``samples`` episodes of each task (consecutive), episode ``i * samples + s`` with the key
    ``fold_in(key, i * samples + s)``; trajectories in that order. With several processes each runs
    its share of the tasks and every process gets all trajectories back (a collective)."""
    requests = [
        EpisodeRequest(t, i, s, jax.random.fold_in(key, i * samples + s))
        for i, t in enumerate(tasks)
        for s in range(samples)
    ]
    return distributed.exchange(collector.run(distributed.share(requests, samples)))


def evaluate_policy(
    collector: Collector, tasks: Sequence, key: jax.Array, trajectories_path: Optional[pathlib.Path] = None
) -> dict:
    """One greedy (or sampled, at the collector's temperature) episode per task: ``summarize``'s metrics and
    the seconds it took; the trajectories written to ``trajectories_path`` when given."""
    start = time.perf_counter()
    trajectories = run_episodes(collector, tasks, key)
    if trajectories_path is not None:
        write_trajectories(trajectories_path, trajectories)
    return {**summarize(trajectories), "seconds": time.perf_counter() - start}


def run_evaluation(
    config,
    out_dir,
    checkpoint: Optional[str] = None,
    samples: int = 1,
    tau: float = 0.5,
    compare: Optional[str] = None,
    stage: str = "rl",
    split: str = "dev",
) -> dict:
    """Evaluate a trained work directory (``checkpoint``: its latest checkpoint, or with ``stage="warmup"``
    its finished cold start) or the base policy on the ``split`` tasks ("dev", or "test": see ``evaluate_test``)
    of every dataset of ``config``; writes ``eval.json``, ``eval.md``, one TREC run file per dataset (first
    sample) and, with ``compare``, ``compare.md``."""
    if split not in EVAL_SPLITS:
        raise ValueError(f"split={split!r}: one of {EVAL_SPLITS}")
    if split == "test":
        return evaluate_test(config, out_dir, checkpoint, samples, tau, stage)
    results, _ = _evaluate(config, out_dir, checkpoint, samples, tau, stage, tasks=None)
    if compare:
        base = json.loads((pathlib.Path(compare) / "eval.json").read_text())
        out = pathlib.Path(out_dir)
        (out / "compare.md").write_text(comparison_table(base, results, f"base ({compare})", f"fine-tuned ({out})"))
    return results


def _evaluate(config, out_dir, checkpoint, samples, tau, stage, tasks) -> tuple[dict, dict]:
    """``({dataset: summarize(...)}, {dataset: each task's nDCG@10, averaged over its samples})`` of the policy
    on ``tasks`` (a list; None: the dev tasks), its files written to ``out_dir``."""
    out = pathlib.Path(out_dir)
    if checkpoint is not None:
        components, params = trained_policy(config, checkpoint, stage)
    else:
        components = build(config, out)  # the base policy: the checkpoint's, or the untrained tiny model
        params = components.policy.full()
    tasks = list(components.dev_tasks if tasks is None else tasks)
    temperature = config.rollout.temperature if samples > 1 else config.eval.temperature
    collector_cfg = dataclasses.replace(
        fitted_slots(components.collector, *eval_rows(components, samples, tasks)),
        temperature=temperature,
        tool_workers=0,
    )  # deterministic; no more rows than episodes
    collector = Collector(
        components.model_cfg,
        components.chat,
        components.env,
        collector_cfg,
        PublishedParams(distributed.to_rollout_mesh(params, components.rollout_mesh), 0, collector_cfg.param_dtype),
        components.rollout_mesh,
    )
    key = rng.key(config.seed, "evaluate")
    out.mkdir(parents=True, exist_ok=True)
    results, scores = {}, {}
    for name in components.collections:
        chosen = [t for t in tasks if t.corpus == name]
        if not chosen:
            continue
        trajectories = run_episodes(collector, chosen, key, samples)
        results[name] = summarize(trajectories, samples, k=samples if samples > 1 else None, tau=tau)
        per_sample = [trajectory_score(t) for t in trajectories]
        scores[name] = {
            t.task_id: float(sum(per_sample[i * samples : (i + 1) * samples]) / samples) for i, t in enumerate(chosen)
        }
        with open(out / f"{name}.run", "w") as f:
            write_trec_run(
                f,
                {t.task_id.split("/", 1)[-1]: traj.final_ranking for t, traj in zip(chosen, trajectories[::samples])},
                tag="mtrl_jax",
            )
        write_trajectories(out / f"{name}.trajectories.jsonl", trajectories)
    (out / "eval.json").write_text(json.dumps(results, indent=2))
    (out / "eval.md").write_text(markdown_table(results, samples))
    collector.close()
    return results, scores


def single_search_baselines(config, tools: Sequence[str] = ("bm25", "dense", "fusion")) -> dict:
    """``{collection: {"queries": n, tool: nDCG@10, "by_task": {tool: {task_id: nDCG@10}}}}``: one search with
    the question as typed, its top 10 as the ranking, on the dev queries of ``config``'s collections (the
    very queries its evaluations use), with its search settings (``evaluate_retrieval``; ``fusion``:
    reciprocal-rank fusion of the other two)."""
    collections, _, dev_tasks = build_data(config)
    return _baselines(collections, dev_tasks, search_settings(config), tools)


def _baselines(collections, tasks, settings, tools=("bm25", "dense", "fusion")) -> dict:
    out = {}
    for name, collection in collections.items():
        chosen = [t for t in tasks if t.corpus == name]
        if not chosen:
            continue
        results = evaluate_retrieval(dataclasses.replace(collection, tasks=chosen), tools, settings)
        out[name] = {
            "queries": len(chosen),
            **{tool: r["ndcg@10"] for tool, r in results.items()},
            "by_task": {tool: r["ndcg@10_by_task"] for tool, r in results.items()},
        }
    return out


def evaluate_test(config, out_dir, workdir, samples: int = 1, tau: float = 0.5, stage: str = "rl") -> dict:
    """The one reader of the test split (``python -m experiments.evaluate --split=test --checkpoint=WORKDIR``):
    the trained policy of ``workdir`` and the one-search baselines on the same test queries, each figure with
    its 95% interval over the queries and the policy's paired difference to each baseline; one line appended
    to ``WORKDIR/test_evaluations.jsonl`` (time, commit, config hash, figures). Returns ``eval.json``'s dict
    with ``"readings"``: how many times ``workdir``'s test split has now been evaluated."""
    if workdir is None:
        raise ValueError("--split=test evaluates a trained work directory: give --checkpoint=WORKDIR")
    workdir = pathlib.Path(workdir)
    collections = load_collections(config)
    tasks = [t for c in collections.values() for t in test_split(c.tasks, split_sizes(config))]
    if not tasks:
        raise ValueError(f"the config's collections {list(collections)} have no test tasks (data.test_*)")
    results, scores = _evaluate(config, out_dir, workdir, samples, tau, stage, tasks)
    baselines = _baselines(collections, tasks, search_settings(config))
    for name, m in results.items():
        ids = list(scores[name])
        policy = np.array([[scores[name][i] for i in ids]])  # one run: [1 seed, queries]
        m["ndcg@10_ci95"] = stats.interval(policy).to_json()["ci95"]
        m["baselines"] = {}
        for tool in ("bm25", "dense", "fusion"):
            if tool not in baselines[name]:
                continue
            base = np.array([[baselines[name]["by_task"][tool][i] for i in ids]])
            diff = stats.paired(policy, base)
            m["baselines"][tool] = {
                "ndcg@10": baselines[name][tool],
                "diff": diff.mean,
                "diff_ci95": [diff.low, diff.high],
                "verdict": stats.verdict(diff),
            }
    out = pathlib.Path(out_dir)
    (out / "eval.json").write_text(json.dumps(results, indent=2))
    (out / "eval.md").write_text(markdown_table(results, samples) + "\n" + baseline_table(results))
    # each query's scores, the policy's and the baselines', for intervals over several runs (bench_ablation)
    by_task = {name: {"policy": scores[name], **baselines[name]["by_task"]} for name in results}
    (out / "test_scores.json").write_text(json.dumps(by_task, indent=2))
    record = {
        "time": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "config_hash": config_hash(config),
        "stage": stage,
        "samples": samples,
        "out": str(out),
        "figures": {
            name: {
                "queries": m["queries"],
                "ndcg@10": m["ndcg@10"],
                "ndcg@10_ci95": m["ndcg@10_ci95"],
                "failure_rate": m["failure_rate"],
                "mean_turns": m["mean_turns"],
                "baselines": m["baselines"],
            }
            for name, m in results.items()
        },
    }
    ledger = workdir / LEDGER
    if distributed.is_primary():
        with open(ledger, "a") as f:
            f.write(json.dumps(record) + "\n")
    readings = len(ledger.read_text().splitlines()) if ledger.exists() else 1
    print(f"{workdir}: its test split has now been evaluated {readings} time{'s' if readings != 1 else ''} ({ledger})")
    return {**results, "readings": readings}


def baseline_table(results: dict) -> str:
    """The test evaluation's policy against each one-search baseline on the same queries: the paired
    difference, its 95% interval over the queries, and the verdict."""
    lines = ["| dataset | policy nDCG@10 [95% CI] | baseline | baseline nDCG@10 | difference [95% CI] | verdict |"]
    lines.append("|---|---|---|---|---|---|")
    for name, m in results.items():
        low, high = m["ndcg@10_ci95"]
        for tool, b in m.get("baselines", {}).items():
            lines.append(
                f"| {name} ({m['queries']}) | {m['ndcg@10']:.4f} [{low:.4f}, {high:.4f}] | {tool} | "
                f"{b['ndcg@10']:.4f} | {b['diff']:+.4f} [{b['diff_ci95'][0]:+.4f}, {b['diff_ci95'][1]:+.4f}] | "
                f"{b['verdict']} |"
            )
    return "\n".join(lines) + "\n"


def config_hash(config) -> str:
    """The first 16 hex digits of the SHA-256 of the config as sorted JSON: the same settings, the same hash."""
    text = config.to_json_best_effort(sort_keys=True) if hasattr(config, "to_json_best_effort") else json.dumps(config)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def git_commit() -> str:
    """The repository's HEAD commit, with ``-dirty`` when tracked files differ from it; "unknown" outside git."""
    root = pathlib.Path(__file__).resolve().parents[1]
    git = ["git", "-C", str(root)]
    try:
        head = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True, check=True)
        dirty = subprocess.run([*git, "status", "--porcelain", "-uno"], capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def trained_policy(config, workdir, stage: str = "rl"):
    """``(components, every parameter of the policy)``: with ``stage="rl"`` workdir's latest checkpoint (the
    trained policy, adapters included), with ``stage="warmup"`` its finished cold start (the policy RL started
    from, whatever checkpoints RL has kept since); ``coldstart.stage.restore_policy``, read-only."""
    workdir = pathlib.Path(workdir)
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: one of {STAGES}")
    if stage == "rl" and not (workdir / "checkpoints").is_dir():
        raise FileNotFoundError(f"{workdir}: not a training work directory (no {workdir / 'checkpoints'})")
    if stage == "warmup" and not (workdir / "warmup").is_dir():
        raise FileNotFoundError(f"{workdir}: no warm-up was saved here (no {workdir / 'warmup'})")
    check_saved_config(workdir, config, "the evaluation or export")  # the run's model, before anything is built
    components = build(config, workdir, train_tokenizer_if_missing=False)
    checkpoints = Checkpoints(workdir)
    try:
        return components, restore_policy(components, checkpoints, stage).full()
    finally:
        checkpoints.close()
