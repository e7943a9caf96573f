"""Does RL beat the warmed-up teacher? The default config over several seeds, mean +- std.

    python scripts/bench_learning.py --seeds 0,1,2 --out workdirs/bench_learning

Each seed is a full `experiments.run` of configs/default.py (synthetic collection, tokenizer,
warm-up and RL all seeded) in `<out>/seed_<s>`; a seed whose summary.json exists is not rerun,
so the script resumes; each run's wall time is printed. The baseline, measured in the same runs, is the warmed-up policy before RL.
Extra `--config.*` overrides are passed through. It also prints, from the runs' evaluation
trajectories, nDCG@10 and the share of each tool's first call per query type (the part of the task
id before its last "-", e.g. `lookup`), before and after RL: what RL changed, not only how much.
"""

import argparse
import json
import pathlib
import subprocess
import sys
import time

import numpy as np

from mtrl_jax.data.synthetic import query_type_of_id

KEYS = ("ndcg@10", "failure_rate", "mean_turns")


def by_query_type(path: pathlib.Path) -> dict:
    """{type: [nDCG@10 (failures 0), {tool: share of first calls}]} of an evaluation trajectory file."""
    out: dict = {}
    for line in path.read_text().splitlines():
        t = json.loads(line)
        kind = query_type_of_id(t["task_id"])
        score, tools = out.setdefault(kind, [[], {}])
        score.append(t["reward"] if t["status"] == "ok" else 0.0)
        calls = [c["name"] for turn in t["turns"] for c in turn["calls"] if c["name"]]
        first = calls[0] if calls else "(none)"
        tools[first] = tools.get(first, 0) + 1
    return {k: [float(np.mean(s)), {n: c / len(s) for n, c in sorted(tools.items())}] for k, (s, tools) in sorted(out.items())}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--out", default="workdirs/bench_learning")
    parser.add_argument("--config", default="configs/default.py")
    args, overrides = parser.parse_known_args()
    out = pathlib.Path(args.out)
    summaries = {}
    for seed in [int(s) for s in args.seeds.split(",")]:
        workdir = out / f"seed_{seed}"
        summary = workdir / "summary.json"
        if not summary.exists():
            cmd = [sys.executable, "-m", "experiments.run", f"--config={args.config}", f"--workdir={workdir}",
                   f"--config.seed={seed}", f"--config.data.synthetic_seed={seed}", "--config.log.progress=False", *overrides]
            print("running", " ".join(cmd), flush=True)
            start = time.perf_counter()
            subprocess.run(cmd, check=True)
            (workdir / "wall_seconds.txt").write_text(f"{time.perf_counter() - start:.1f}\n")
        summaries[seed] = json.loads(summary.read_text())
        wall = workdir / "wall_seconds.txt"
        if wall.exists():
            print(f"seed {seed}: {float(wall.read_text()) / 60:.1f} minutes end to end", flush=True)
    print(f"{'seed':>6} " + " ".join(f"{p}:{k:>14}" for p in ("before", "after") for k in KEYS))
    for seed, s in summaries.items():
        print(f"{seed:>6} " + " ".join(f"{s[p][k]:>21.4f}" for p in ("before", "after") for k in KEYS))
    for key in KEYS:
        before = np.array([s["before"][key] for s in summaries.values()])
        after = np.array([s["after"][key] for s in summaries.values()])
        delta = after - before
        print(f"{key:>13}: before {before.mean():.4f} +- {before.std():.4f}   after {after.mean():.4f} +- {after.std():.4f}   "
              f"change {delta.mean():+.4f} +- {delta.std():.4f}")
    print("\nby query type (mean over seeds): nDCG@10 and first tool call shares, before -> after")
    types: dict = {}
    for seed in summaries:
        for label in ("before", "after"):
            path = out / f"seed_{seed}" / "trajectories" / f"eval_{label}.jsonl"
            if path.exists():
                for kind, (score, tools) in by_query_type(path).items():
                    entry = types.setdefault(kind, {"before": ([], []), "after": ([], [])})[label]
                    entry[0].append(score)
                    entry[1].append(tools)
    for kind, entry in types.items():
        cells = []
        for label in ("before", "after"):
            scores, per_seed = entry[label]
            names = sorted({n for tools in per_seed for n in tools})
            shares = ", ".join(f"{n} {np.mean([tools.get(n, 0.0) for tools in per_seed]):.2f}" for n in names)
            cells.append(f"{np.mean(scores):.3f} ({shares})" if scores else "n/a")
        print(f"{kind:>13}: {cells[0]} -> {cells[1]}")
    gain = np.mean([s["after"]["ndcg@10"] - s["before"]["ndcg@10"] for s in summaries.values()])
    worse = np.mean([s["after"]["failure_rate"] - s["before"]["failure_rate"] for s in summaries.values()])
    print(f"RL beats the teacher by >= 0.10 nDCG@10 with failure rate not higher: {gain >= 0.10 and worse <= 0}")


if __name__ == "__main__":
    main()
