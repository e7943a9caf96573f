"""Does a real model become a better search agent? The whole recipe of a real-model config (an evaluation
of the base model, the cold-start cold start, an evaluation, MTRL, an evaluation) over several seeds, per
collection, beside one-search baselines on the very same dev queries.

    python -m tools.fetch_models --model smollm2-135m-instruct --out models/smollm2-135m-instruct
    python -m benchmarks.bench_real_learning --config=configs/real_cpu.py --seeds 0,1,2

Each seed is one ``experiments.run`` of the config with ``eval.before_warmup`` on, in ``<out>/seed_<s>``
(a seed already finished is not rerun, so the script resumes). From the runs' evaluation trajectories it
prints, per collection and stage (base -> warmed up -> after RL): nDCG@10 (failures count 0), failure
rate by reason, mean turns, tool calls and repeated calls per episode; each seed, then the mean with its 95% interval
over seeds, and the change from the cold-started policy to RL. The baselines are one search with the
question as typed (BM25, dense, their fusion), its top 10 as the ranking; each seed's policy after RL is
also set against the best of them query by query (wins, losses, ties, and a paired bootstrap interval of
the mean difference; for several seeds also of their mean), since a mean over 25-30 queries can hide one
query's luck. Then each run's minutes and peak resident memory. Extra ``--config.*`` arguments go to every run.
``--test`` then reads each seed's test split once, its cold start and its RL policy (``experiments.evaluate
--split=test``, whose ledger counts the readings; a reading already made is loaded), and prints per collection
both with their intervals, RL's paired gain and the RL policy against each one search on the same test queries.
``--samples k`` also evaluates each seed's finished cold start and RL policy with k samples a dev query at
the rollout temperature (the policy RL trains, where the table above decodes greedily), with RL's change.

``--step_baseline REV`` instead times the RL step of the config here and in a git worktree of ``REV``:
each checkout's own ``configs/real_cpu.py`` on the same data (one collection, its dev queries cut to
``--step_eval_tasks``), no cold start, ``--steps`` RL steps, the two runs alternated ``--rounds`` times; it
prints the median step time of each (the first step, which compiles, left out) and the speed-up.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from benchmarks.common import REPO, machine_line, ratio, read_test, run_seeds, worktree
from mtrl_jax import stats
from mtrl_jax.metrics import read_episodes as episodes
from mtrl_jax.metrics import task_scores

STAGES = (("base", "base"), ("warmed up", "before"), ("after RL", "after"))


def stage_metrics(path: pathlib.Path) -> dict:
    """``{collection: summarize(...)}`` of an evaluation's trajectory file."""
    from mtrl_jax.metrics import summarize

    by_collection: dict = {}
    for t in episodes(path):
        by_collection.setdefault(t.task_type, []).append(t)
    return {name: summarize(ts, by_type=False) for name, ts in sorted(by_collection.items())}


def paired(agent, baseline: dict) -> str:
    """The agent against a baseline query by query (``{task_id: nDCG@10}`` each, the same tasks): wins, losses
    and ties of each query's mean over the seeds, and the mean difference with its paired 95% interval
    (``mtrl_jax.stats.paired``: a two-way bootstrap over the seeds and the queries, the queries alone with one
    seed) and its verdict. ``agent`` is one such dict or a list of them, one per seed."""
    agents = [agent] if isinstance(agent, dict) else list(agent)
    for one in agents:
        if set(one) != set(baseline):
            raise ValueError(f"the agent's and the baseline's queries differ: {sorted(set(one) ^ set(baseline))[:5]}")
    ids = sorted(baseline)
    mine = np.array([[one[t] for t in ids] for one in agents])
    base = np.broadcast_to(np.array([baseline[t] for t in ids]), mine.shape)
    d = (mine - base).mean(axis=0)
    diff = stats.paired(mine, base)
    return (
        f"{int((d > 1e-9).sum())} wins, {int((d < -1e-9).sum())} losses, {int((abs(d) <= 1e-9).sum())} ties, "
        f"difference {diff.text()}: {stats.verdict(diff)}"
    )


HEADER = "| stage | seed | nDCG@10 | failure rate (by reason) | mean turns | tool calls / episode; malformed calls |"
MALFORMED = ("bad_json", "bad_arguments", "unknown_tool", "empty_query")  # a call the model wrote wrong


def cell(m: dict) -> str:
    reasons = ", ".join(f"{k} {v:.2f}" for k, v in m["failure_rate_by_reason"].items())
    tools = ", ".join(f"{k.split('_')[0]} {v:.2f}" for k, v in m["tool_calls_per_episode"].items()) or "none"
    # tool_errors counts every failed call of the evaluation: per episode, those the model wrote wrong
    malformed = sum(m.get("tool_errors", {}).get(kind, 0) for kind in MALFORMED) / max(m.get("samples", 1), 1)
    return (
        f"{m['ndcg@10']:.3f} | {m['failure_rate']:.2f}{f' ({reasons})' if reasons else ''} | {m['mean_turns']:.2f} | "
        f"{tools}; repeated {m['repeated_calls_per_episode']:.2f}; malformed calls {malformed:.2f}"
    )


def mean_ci(values) -> str:
    """The seeds' mean and its 95% interval (Student's t over the seeds), with n."""
    return stats.interval(values).text()


def print_rows(label: str, rows: list) -> None:
    """A stage's table rows, ``rows`` ``[(seed, summarize(...))]``: one a seed, then their mean [95% CI]."""
    for seed, m in rows:
        print(f"| {label} | {seed} | {cell(m)} |")
    if len(rows) > 1:
        print(
            f"| {label} | mean [95% CI] | {mean_ci([m['ndcg@10'] for _, m in rows])} | "
            f"{mean_ci([m['failure_rate'] for _, m in rows])} | "
            f"{mean_ci([m['mean_turns'] for _, m in rows])} | |"
        )


def sampled_evaluations(config: str, seeds: list[int], out: pathlib.Path, overrides: list[str], k: int) -> dict:
    """``{seed: {stage: {collection: summarize(...)}}}``: each seed's finished cold start and RL policy evaluated
    with ``k`` samples a dev query at the rollout temperature (``experiments.evaluate --stage``), in
    ``<out>/seed_<s>/sampled_<stage>_k<k>`` (an evaluation already written is read, not rerun)."""
    from mtrl_jax.evaluate import STAGES

    found: dict = {}
    for seed in seeds:
        for stage in STAGES:
            where = out / f"seed_{seed}" / f"sampled_{stage}_k{k}"
            if not (where / "eval.json").exists():
                cmd = [sys.executable, "-m", "experiments.evaluate", f"--config={config}"]
                cmd += [f"--checkpoint={out / f'seed_{seed}'}", f"--stage={stage}", f"--samples={k}", f"--out={where}"]
                print(f"[seed {seed}] {' '.join(cmd[1:])}", flush=True)
                done = subprocess.run([*cmd, f"--config.seed={seed}", *overrides], cwd=REPO)
                if done.returncode:
                    raise SystemExit(f"[seed {seed}] the sampled evaluation of {stage} failed ({done.returncode})")
            found.setdefault(seed, {})[stage] = json.loads((where / "eval.json").read_text())
    return found


def report_sampled(found: dict, k: int) -> None:
    """The cold-started and RL policies as RL samples them, per collection: the rows, and RL's change."""
    names = sorted({name for stages in found.values() for results in stages.values() for name in results})
    for name in names:
        print(f"\n### {name}, sampled: {k} samples a dev query at the rollout temperature\n")
        print(HEADER)
        print("|---|---|---|---|---|---|")
        for label, stage in (("warmed up", "warmup"), ("after RL", "rl")):
            print_rows(label, [(seed, stages[stage][name]) for seed, stages in found.items()])
        gains = [stages["rl"][name]["ndcg@10"] - stages["warmup"][name]["ndcg@10"] for stages in found.values()]
        print(f"\nRL over the warmed-up policy, sampled: {mean_ci(gains)} nDCG@10")


def report(out: pathlib.Path, seeds: list[int], summaries: dict, baselines: dict) -> None:
    stages = {
        seed: {
            label: stage_metrics(out / f"seed_{seed}" / "trajectories" / f"eval_{key}.jsonl")
            for label, key in STAGES
            if (out / f"seed_{seed}" / "trajectories" / f"eval_{key}.jsonl").exists()
        }
        for seed in seeds
    }
    after_paths = {seed: out / f"seed_{seed}" / "trajectories" / "eval_after.jsonl" for seed in seeds}
    after_scores = {seed: task_scores(path) for seed, path in after_paths.items() if path.exists()}
    header = HEADER
    for name, base in baselines.items():
        print(f"\n### {name} ({base['queries']} dev queries)\n")
        print(f"one search: BM25 {base['bm25']:.3f}, dense {base['dense']:.3f}, fusion {base['fusion']:.3f}\n")
        print(header + "\n|---|---|---|---|---|---|")
        for label, _ in STAGES:
            rows = [
                (seed, stages[seed][label][name])
                for seed in seeds
                if label in stages[seed] and name in stages[seed][label]
            ]
            print_rows(label, rows)
        gains = [
            stages[s]["after RL"][name]["ndcg@10"] - stages[s]["warmed up"][name]["ndcg@10"]
            for s in seeds
            if {"after RL", "warmed up"} <= set(stages[s])
        ]
        warm = [stages[s]["warmed up"][name]["ndcg@10"] for s in seeds if "warmed up" in stages[s]]
        fails = [
            stages[s]["after RL"][name]["failure_rate"] - stages[s]["warmed up"][name]["failure_rate"]
            for s in seeds
            if {"after RL", "warmed up"} <= set(stages[s])
        ]
        best_tool = max(("bm25", "dense", "fusion"), key=lambda tool: base[tool])
        best = base[best_tool]
        if gains:
            after = [stages[s]["after RL"][name]["ndcg@10"] for s in seeds if "after RL" in stages[s]]
            print(
                f"\nRL over the warmed-up policy: {mean_ci(gains)} nDCG@10 (>= +0.03: {np.mean(gains) >= 0.03}), "
                f"failure rate {np.mean(fails):+.3f} (not higher: {np.mean(fails) <= 0}); warmed up / BM25: "
                f"{np.mean(warm) / max(base['bm25'], 1e-9):.2f} (>= 0.8: {np.mean(warm) >= 0.8 * base['bm25']}); "
                f"after RL vs the best one search ({best_tool} {best:.3f}): {np.mean(after) - best:+.3f}"
            )
            mine = {
                seed: {t: v for t, v in scores.items() if t.split("/", 1)[0] == name}
                for seed, scores in after_scores.items()
            }
            for seed, scores in mine.items():
                against = paired(scores, base["by_task"][best_tool])
                print(f"after RL vs {best_tool}, query by query, seed {seed}: {against}")
            if len(mine) > 1:
                against = paired(list(mine.values()), base["by_task"][best_tool])
                print(f"after RL vs {best_tool}, query by query, the mean of seeds {sorted(mine)}: {against}")
    print("\n| seed | minutes | peak resident GiB | RL steps |\n|---|---|---|---|")
    for seed, s in summaries.items():
        print(
            f"| {seed} | {s.get('wall_seconds', float('nan')) / 60:.1f} | {s.get('peak_rss_gib', float('nan')):.2f} | "
            f"{s['rl_steps']} |"
        )


def test_report(config: str, seeds: list[int], out: pathlib.Path, overrides: list[str]) -> None:
    """Each seed's cold start and RL policy read once on the test split (``read_test``: ``experiments.evaluate
    --split=test``, its ledger), per collection: both with their intervals over the seeds and queries, RL's gain
    paired, and the RL policy against each one-search baseline on the same test queries, paired."""

    def reading(seed: int, stage: str) -> dict:
        workdir = out / f"seed_{seed}"
        return read_test(config, workdir, workdir / f"test_{stage}", [f"--config.seed={seed}", *overrides], stage)

    readings = {stage: [reading(s, stage) for s in seeds] for stage in ("warmup", "rl")}
    print(f"\ntest split, read once per seed and stage (seeds {seeds}; intervals over the seeds and the queries)")
    print("| collection | queries | warmed up | after RL | RL gain [95% CI, paired] |\n|---|---|---|---|---|")
    against = []
    for name in readings["rl"][0]:
        ids = sorted(readings["rl"][0][name]["policy"])
        scores = lambda stage, key: np.array([[r[name][key][i] for i in ids] for r in readings[stage]])  # noqa: E731
        cold, tuned = scores("warmup", "policy"), scores("rl", "policy")
        gain = stats.paired(tuned, cold)
        print(
            f"| {name} | {len(ids)} | {stats.interval(cold).text()} | {stats.interval(tuned).text()} | "
            f"{gain.mean:+.3f} [{gain.low:+.3f}, {gain.high:+.3f}] {stats.verdict(gain)} |"
        )
        for tool in ("bm25", "dense", "fusion"):
            base = scores("rl", tool)
            against.append((name, tool, float(base[0].mean()), stats.paired(tuned, base)))
    print("\n| collection | one search | its nDCG@10 | after RL - it [95% CI, paired] | verdict |")
    print("|---|---|---|---|---|")
    for name, tool, value, d in against:
        print(f"| {name} | {tool} | {value:.3f} | {d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}] | {stats.verdict(d)} |")


def step_times(workdir: pathlib.Path) -> list[float]:
    return [json.loads(line)["time/step_s"] for line in (workdir / "metrics.jsonl").read_text().splitlines()]


def against_baseline(args, overrides: list[str]) -> None:
    """The RL step of ``configs/real_cpu.py`` here and at ``args.step_baseline``, alternated."""
    data = REPO.parent / "shared" / "data" / args.step_collection
    common = [
        f"--config.data.folders={data}",
        "--config.data.weights=",
        "--config.data.dev_min=0",
        f"--config.data.max_eval_tasks={args.step_eval_tasks}",
        f"--config.max_steps={args.steps}",
        "--config.warmup.steps=0",
        "--config.log.progress=False",
        "--config.checkpoint.every_steps=1000",
        f"--config.model.checkpoint={REPO / 'models' / 'smollm2-135m-instruct'}",
        *overrides,
    ]
    times: dict = {"this tree": [], args.step_baseline: []}
    with worktree(args.step_baseline) as tree, tempfile.TemporaryDirectory() as scratch:
        for round_ in range(args.rounds):
            for side, root in (("this tree", REPO), (args.step_baseline, tree)):
                workdir = pathlib.Path(scratch) / f"{side.replace(' ', '_')}_{round_}"
                cmd = [
                    sys.executable,
                    "-m",
                    "experiments.run",
                    "--config=configs/real_cpu.py",
                    f"--workdir={workdir}",
                    *common,
                ]
                start = time.perf_counter()
                done = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
                if done.returncode:
                    raise SystemExit(f"{side}: {' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
                steps = step_times(workdir)[1:]  # the first RL step compiles what the background did not
                times[side] += steps
                print(
                    f"{side}, round {round_}: {len(steps) + 1} RL steps, "
                    f"{time.perf_counter() - start:.0f} s end to end, "
                    f"steps {', '.join(f'{t:.1f}' for t in steps)} s",
                    flush=True,
                )
    ours, theirs = statistics.median(times["this tree"]), statistics.median(times[args.step_baseline])
    print(
        f"RL step of configs/real_cpu.py (median of steps 2..{args.steps}, {args.rounds} alternated rounds): this tree "
        f"{ours:.1f} s vs {theirs:.1f} s at {args.step_baseline}: {ratio(ours, theirs)} faster"
    )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/real_cpu.py")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "workdirs" / "bench_real_learning")
    parser.add_argument(
        "--samples", type=int, default=0, help="also evaluate each seed's warm-up and RL policy with k samples a query"
    )
    parser.add_argument(
        "--test", action="store_true", help="then read each seed's test split once (cold start and RL policy)"
    )
    parser.add_argument("--step_baseline", default="", help="a git revision: time the RL step here and there instead")
    parser.add_argument("--step_collection", default="cranfield", help="with --step_baseline: the collection")
    parser.add_argument("--step_eval_tasks", type=int, default=4, help="with --step_baseline: dev queries")
    parser.add_argument("--steps", type=int, default=4, help="with --step_baseline: RL steps per run")
    parser.add_argument("--rounds", type=int, default=1, help="with --step_baseline: alternated rounds")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        raise SystemExit(f"bench_real_learning: unexpected arguments {bad} (only --config.key=value are passed on)")
    print(machine_line(), flush=True)
    if args.step_baseline:
        return against_baseline(args, overrides)
    from experiments.sweep import load_config
    from mtrl_jax.evaluate import single_search_baselines

    seeds = [int(s) for s in args.seeds.split(",")]
    summaries = run_seeds(args.config, seeds, args.out, ["--config.eval.before_warmup=True", *overrides])
    baselines = single_search_baselines(load_config(args.config, overrides))
    print(f"\n{args.config} {' '.join(overrides)}: seeds {seeds}")
    report(args.out, seeds, summaries, baselines)
    if args.samples:
        report_sampled(sampled_evaluations(args.config, seeds, args.out, overrides, args.samples), args.samples)
    if args.test:
        test_report(args.config, seeds, args.out, overrides)


if __name__ == "__main__":
    main()
