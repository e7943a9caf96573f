"""Where the default RL step's time goes: a short run of configs/default.py, step by step.

    python -m benchmarks.bench_rl_step                       # 8 RL steps after a 300-step cold start
    python -m benchmarks.bench_rl_step --baseline 1114276    # the same run at another commit, side by side

Each RL step's metrics (``metrics.jsonl``) hold its timings: the collection (``collect_s``) split
into device calls (``decode_s``, ``extend_s``) and waits on tools (``tool_wait_s``); the wait for
the rollout thread (``collect_wait_s``, ~0 when generation overlaps the previous update); the
update (``update_s``: old and reference log-probs, loss, backward, optimizer); the trajectory
log (``logging_s``); the checkpoint written after the previous step; and the XLA programs compiled
during the step (``compile/programs``, ``compile/seconds``, both threads); the real tokens of the
update's micro-batches, extend's useful tokens and the share of appended tokens copied from a cached
prefix (``rollout.share_prefixes``). The script prints them
per step and the medians of the steady state (from ``--steady_from``). With ``--baseline REV`` it
also runs the same command in a git worktree of ``REV`` and prints the ratio of the steady-state
step times (the baseline only needs ``time/step_s``).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.common import REPO, machine_line, ratio, worktree

COLUMNS = [
    ("step_s", "time/step_s"),
    ("collect_wait", "time/collect_wait_s"),
    ("collect", "time/collect_s"),
    ("decode", "time/decode_s"),
    ("extend", "time/extend_s"),
    ("tool_wait", "time/tool_wait_s"),
    ("update", "time/update_s"),
    ("logging", "time/logging_s"),
    ("prev_ckpt", "time/previous_checkpoint_s"),
    ("compiles", "compile/programs"),
    ("compile_s", "compile/seconds"),
    ("real_tok", "batch/real_token_fraction"),
    ("ext_useful", "rollout/extend_useful_fraction"),
    ("ext_shared", "rollout/extend_shared_fraction"),
]


def run(repo: pathlib.Path, workdir: pathlib.Path, args) -> tuple[list[dict], float]:
    cmd = [
        sys.executable,
        "-m",
        "experiments.run",
        "--config=configs/default.py",
        f"--workdir={workdir}",
        f"--config.max_steps={args.steps}",
        f"--config.warmup.steps={args.warmup_steps}",
        "--config.log.progress=False",
        f"--config.seed={args.seed}",
        *args.overrides,
    ]
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {
        "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")
    }
    start = time.perf_counter()
    result = subprocess.run(cmd, cwd=repo, env=env, capture_output=True, text=True)
    if result.returncode:
        raise SystemExit(f"{' '.join(cmd)} (in {repo}) failed:\n{result.stderr[-3000:]}")
    steps = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    return steps, time.perf_counter() - start


def table(steps: list[dict], steady_from: int) -> float:
    names = [name for name, key in COLUMNS if any(key in s for s in steps)]
    keys = dict(COLUMNS)
    print("step | " + " | ".join(names))
    for s in steps:
        print(f"{s['step']:4d} | " + " | ".join(f"{s.get(keys[n], float('nan')):.3f}" for n in names))
    steady = [s for s in steps if s["step"] >= steady_from] or steps
    medians = {n: statistics.median(s.get(keys[n], float("nan")) for s in steady) for n in names}
    print(
        f"median of steps {steady[0]['step']}..{steady[-1]['step']} | " + " | ".join(f"{medians[n]:.3f}" for n in names)
    )
    return medians["step_s"]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup_steps", type=int, default=300)
    p.add_argument("--steady_from", type=int, default=3, help="first RL step counted in the medians")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--baseline", default="", help="a git revision to run side by side (in a temporary worktree)")
    p.add_argument("overrides", nargs="*", help="extra --config.* flags for both runs")
    args = p.parse_args(argv)
    print(machine_line(), flush=True)
    out = pathlib.Path(tempfile.mkdtemp(prefix="bench_rl_step_"))
    steps, seconds = run(REPO, out / "current", args)
    print(f"this checkout: {seconds:.0f} s end to end (warm-up {args.warmup_steps} steps, {args.steps} RL steps)")
    current = table(steps, args.steady_from)
    if not args.baseline:
        return
    with worktree(args.baseline) as tree:
        steps, seconds = run(tree, out / "baseline", args)
    print(f"\nbaseline {args.baseline}: {seconds:.0f} s end to end")
    baseline = table(steps, args.steady_from)
    print(
        f"\nsteady-state step: {current:.3f} s vs {baseline:.3f} s at {args.baseline}: "
        f"{ratio(current, baseline)} faster"
    )


if __name__ == "__main__":
    main()
