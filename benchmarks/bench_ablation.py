"""An ablation that resolves: losses x advantage estimators on the embedded default, the arms of a seed
sharing its cold start (``experiments.ablate``), against the same runs without sharing.

    python -m benchmarks.bench_ablation --out /work/runs/bench_ablation [--seeds 0,1,2,3,4] [--unshared 1]

Runs ``python -m experiments.ablate --config=configs/default.py --grid rl.loss=ppo,cispo,is
--grid rl.advantage=grpo,rloo,grpo_passk --seeds ...`` (resumable: a finished arm or cold start is not rerun),
timing it. Without sharing, each of the arm-seeds would be a standalone ``experiments.run``: its cold start and
its RL. Its time is the arm's own wall time plus that of the cold start it started from (both recorded by the
runs); ``--unshared k`` also runs k of them standalone (the first arms of the last seed), so that this sum is
checked against real standalone runs, side by side. Prints the minutes of both, their ratio, and the
ablation's verdicts: the pairs it separates, or the widest paired interval (an equivalence result when every
pair's interval is narrower than +-0.03).

``--test-arm ARM`` then reads the test split once for each seed of that arm (the final config; the default's
own settings are the arm ``loss=ppo,advantage=grpo``), through ``experiments.evaluate --split=test`` and its
ledger (a seed already read is not read again), and prints the arm's test nDCG@10 and its paired difference to
each one-search baseline on the same test queries, with two-way intervals over the seeds and queries.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

from benchmarks.common import REPO, machine_line, ratio, read_test
from experiments.ablate import cell_name, grid_cells, parse_grid, parse_seeds, wall_seconds
from experiments.sweep import timed_run

GRID = ("rl.loss=ppo,cispo,is", "rl.advantage=grpo,rloo,grpo_passk")
EQUIVALENCE = 0.03  # half-width under which every pair's interval is an equivalence result


def wall(workdir: pathlib.Path) -> float:
    return wall_seconds(workdir, missing=float("nan"))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="workdirs/bench_ablation")
    parser.add_argument("--config", default="configs/default.py")
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--grid", action="append", default=None, help=f"default: {' '.join(GRID)}")
    parser.add_argument("--unshared", type=int, default=1, help="arm-seeds also run standalone (timed)")
    parser.add_argument("--test-arm", default=None, help="read the test split once for each seed of this arm")
    args, overrides = parser.parse_known_args(argv)
    out = pathlib.Path(args.out)
    grid_args = args.grid or list(GRID)
    seeds = parse_seeds(args.seeds)
    print(machine_line(peak=False), flush=True)
    cmd = [sys.executable, "-m", "experiments.ablate", f"--config={args.config}", f"--seeds={args.seeds}"]
    cmd += [f"--out={out / 'shared'}", *[f"--grid={g}" for g in grid_args], *overrides]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=REPO, check=True)
    invocation = time.perf_counter() - start
    results = json.loads((out / "shared" / "results.json").read_text())

    arms_s = sum(r["wall_seconds"] for r in results["arms"].values())
    warmups_s = results["warmups"]["wall_seconds"]
    shared_s = arms_s + warmups_s
    # each arm-seed without sharing: its own cold start (the one it started from) and its RL
    warmup_of = {p.name: wall(p) for p in (out / "shared" / "warmups").glob("seed_*")}
    per_seed_warmup = {}
    for name, s in warmup_of.items():
        per_seed_warmup.setdefault(int(name.split("-")[0].removeprefix("seed_")), []).append(s)
    cells = grid_cells(parse_grid(grid_args))
    # one cold start per seed here (the grid reads no cold start field): every arm-seed would train it again
    unshared_s = arms_s + len(cells) * sum(sum(per_seed_warmup.get(seed, [float("nan")])) for seed in seeds)
    print(
        f"\nshared: {shared_s / 60:.1f} min for {len(cells) * len(seeds)} arm-seeds "
        f"({warmups_s / 60:.1f} min of {len(warmup_of)} warm-ups, {arms_s / 60:.1f} min of arms; this invocation "
        f"{invocation / 60:.1f} min)"
    )
    print(f"unshared (each arm-seed its own warm-up): {unshared_s / 60:.1f} min")
    print(f"shared / unshared: {shared_s / unshared_s:.3f} (target <= 0.4); shared within 150 min: {shared_s <= 9000}")

    for cell in cells[: args.unshared]:  # standalone runs, timed, against the sum they are estimated by
        seed = seeds[-1]
        workdir = out / "unshared" / cell_name(cell) / f"seed_{seed}"
        if not (workdir / "summary.json").exists():
            run = [sys.executable, "-m", "experiments.run", f"--config={args.config}", f"--workdir={workdir}"]
            run += [f"--config.seed={seed}", "--config.log.progress=False", *[f"--config.{f}={v}" for f, v in cell]]
            timed_run([*run, *overrides], workdir / "wall_seconds.txt", REPO)
        arm = out / "shared" / cell_name(cell) / f"seed_{seed}"
        estimate = wall(arm) + sum(per_seed_warmup[seed])
        print(
            f"standalone {cell_name(cell)} seed {seed}: {wall(workdir) / 60:.1f} min measured, "
            f"{estimate / 60:.1f} min estimated (warm-up + arm): {ratio(wall(workdir), estimate)}"
        )

    if args.test_arm:
        cell = next((c for c in cells if cell_name(c) == args.test_arm), None)
        if cell is None:
            raise SystemExit(f"--test-arm {args.test_arm!r}: not an arm of the grid ({[cell_name(c) for c in cells]})")
        test_report(args, out, cell, seeds, overrides)

    pairs = results["pairs"]
    separated = [p for p in pairs if p["separated"]]
    widest = max((p["ci95"][1] - p["ci95"][0]) / 2 for p in pairs)
    print(f"\n{(out / 'shared' / 'results.md').read_text()}")
    if separated:
        print(f"verdict: {len(separated)} of {len(pairs)} pairs separated")
    elif widest < EQUIVALENCE:
        print(f"verdict: no pair separated, every paired interval narrower than +-{EQUIVALENCE}: equivalent arms")
    else:
        print(f"verdict: not resolved (no pair separated; the widest paired half-width is {widest:.4f})")


def test_report(args, out: pathlib.Path, cell, seeds, overrides) -> None:
    """The arm's test split, read once per seed (``experiments.evaluate --split=test``, its ledger), against the
    one-search baselines on the same queries: means and paired differences with two-way intervals."""
    import numpy as np

    from mtrl_jax import stats

    flags = ["--config.eval.every_steps=0", *[f"--config.{f}={v}" for f, v in cell], *overrides]
    per_seed = [
        read_test(
            args.config,
            out / "shared" / cell_name(cell) / f"seed_{seed}",
            out / "test" / cell_name(cell) / f"seed_{seed}",
            [f"--config.seed={seed}", *flags],
        )
        for seed in seeds
    ]
    for name in per_seed[0]:
        ids = sorted(per_seed[0][name]["policy"])
        policy = np.array([[s[name]["policy"][i] for i in ids] for s in per_seed])
        print(f"\ntest, {name}, {cell_name(cell)}: nDCG@10 {stats.interval(policy).text()}")
        for tool in ("bm25", "dense", "fusion"):
            base = np.array([[s[name][tool][i] for i in ids] for s in per_seed])
            diff = stats.paired(policy, base)
            print(f"  against one {tool} search ({base.mean():.4f}): {diff.text()}: {stats.verdict(diff)}")


if __name__ == "__main__":
    main()
