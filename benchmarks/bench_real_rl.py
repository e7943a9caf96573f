"""MTRL on a real model within a time budget: held-out nDCG@10 and failure rate before and after.

    python -m tools.fetch_models --model smollm2-135m-instruct --out models/smollm2-135m-instruct
    python -m benchmarks.bench_real_rl --minutes 60 --out workdirs/bench_real_rl

Runs ``python -m experiments.run --config=configs/real_cpu.py`` (SmolLM2-135M-Instruct on Cranfield,
its 50 held-out queries evaluated before RL) for as many RL steps as ``--minutes`` allow: at the
budget the run gets SIGTERM, writes a checkpoint at the end of its current step and exits. The same
work directory is then resumed with ``max_steps`` = the steps done, which only evaluates the policy
after RL and writes ``summary.json``. Prints the before / after table, the steps and seconds per
step. Extra ``--config.key=value`` arguments go to both runs.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import resource
import signal
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--minutes", type=float, default=60.0, help="wall-clock budget of the training run")
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "workdirs" / "bench_real_rl")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        sys.exit(f"bench_real_rl.py: unexpected arguments {bad} (only --config.key=value are passed on)")
    base = [
        sys.executable,
        "-m",
        "experiments.run",
        "--config=configs/real_cpu.py",
        f"--workdir={args.out}",
        "--config.log.progress=False",
        *overrides,
    ]
    start = time.perf_counter()
    train = subprocess.Popen(base + ["--config.max_steps=100000"], cwd=REPO)
    try:
        train.wait(timeout=args.minutes * 60)
    except subprocess.TimeoutExpired:
        print(
            f"bench_real_rl.py: {args.minutes:g} min budget reached: SIGTERM (checkpoint at the end of this step)",
            flush=True,
        )
        train.send_signal(signal.SIGTERM)
        train.wait()
    train_s = time.perf_counter() - start
    metrics_file = args.out / "metrics.jsonl"
    steps = [json.loads(line) for line in metrics_file.read_text().splitlines()] if metrics_file.exists() else []
    if train.returncode not in (0, 143) or not steps:
        sys.exit(f"bench_real_rl.py: the training run exited with {train.returncode} after {len(steps)} logged steps")
    done = steps[-1]["step"]
    if not (args.out / "summary.json").exists():  # stopped by the budget: evaluate the checkpoint of step `done`
        subprocess.run(base + [f"--config.max_steps={done}"], cwd=REPO, check=True)
    summary = json.loads((args.out / "summary.json").read_text())
    step_s = sorted(s["time/step_s"] for s in steps)
    print(
        f"\nRL steps: {done} in {train_s / 60:.1f} min (training run incl. the evaluation before RL); "
        f"median step {step_s[len(step_s) // 2]:.1f} s"
    )
    before, after = summary["before"], summary["after"]
    print(f"held-out queries: {before['queries']}\n| metric | before RL | after RL | change |\n|---|---|---|---|")
    for metric in ("ndcg@10", "failure_rate", "mean_turns"):
        print(f"| {metric} | {before[metric]:.4f} | {after[metric]:.4f} | {after[metric] - before[metric]:+.4f} |")
    print(f"| failures by reason | {before['failure_rate_by_reason']} | {after['failure_rate_by_reason']} | |")
    print(f"| tool calls / episode | {before['tool_calls_per_episode']} | {after['tool_calls_per_episode']} | |")
    peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20  # KiB -> GiB, the largest child
    print(f"peak resident memory of a run: {peak:.2f} GiB")
    rewards = [s["reward/mean"] for s in steps]
    print(f"training reward by step: {' '.join(f'{r:.3f}' for r in rewards)}")


if __name__ == "__main__":
    main()
