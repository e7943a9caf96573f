"""Does RL beat the warmed-up teacher? The default config over several seeds, mean +- std.

    python scripts/bench_learning.py --seeds 0,1,2 --out workdirs/bench_learning

Each seed is a full `experiments.run` of configs/default.py (synthetic collection, tokenizer,
warm-up and RL all seeded) in `<out>/seed_<s>`; a seed whose summary.json exists is not rerun,
so the script resumes; each run's wall time is printed. The baseline, measured in the same runs, is the warmed-up policy before RL.
Extra `--config.*` overrides are passed through. It also prints, from the runs' evaluation
trajectories, nDCG@10, mean turns and the share of each tool's first call per task type (e.g.
`synthetic/multihop`), before and after RL: what RL changed, not only how much; and the checks of
issue 15 (overall gain >= 0.15, multihop nDCG@10 >= 0.60 with >= 2.8 turns, lookup <= 2.3 turns).
"""

import argparse
import json
import pathlib
import subprocess
import sys
import time

import numpy as np


KEYS = ("ndcg@10", "failure_rate", "mean_turns")


def by_query_type(path: pathlib.Path) -> dict:
    """{type: {"ndcg": nDCG@10 (failures 0), "turns": mean turns, "tools": {tool: share of first calls}}}
    of an evaluation trajectory file (types as the records give them, e.g. ``synthetic/multihop``)."""
    out: dict = {}
    for line in path.read_text().splitlines():
        t = json.loads(line)
        score, turns, tools = out.setdefault(t["type"], ([], [], {}))
        score.append(t["reward"] if t["status"] == "ok" else 0.0)
        turns.append(t["num_turns"])
        calls = [c["name"] for turn in t["turns"] for c in turn["calls"] if c["name"]]
        first = calls[0] if calls else "(none)"
        tools[first] = tools.get(first, 0) + 1
    return {k: {"ndcg": float(np.mean(s)), "turns": float(np.mean(n)), "tools": {name: c / len(s) for name, c in sorted(tools.items())}}
            for k, (s, n, tools) in sorted(out.items())}


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
    print("\nby query type (mean over seeds), before -> after: nDCG@10, mean turns, first tool call shares")
    types: dict = {}
    for seed in summaries:
        for label in ("before", "after"):
            path = out / f"seed_{seed}" / "trajectories" / f"eval_{label}.jsonl"
            if path.exists():
                for kind, row in by_query_type(path).items():
                    types.setdefault(kind, {"before": [], "after": []})[label].append(row)
    mean = lambda rows, key: float(np.mean([r[key] for r in rows])) if rows else float("nan")  # noqa: E731
    print(f"{'type':>20} | {'nDCG@10':>15} | {'mean turns':>12} | first tool (before -> after)")
    for kind, entry in types.items():
        shares = []
        for label in ("before", "after"):
            names = sorted({n for r in entry[label] for n in r["tools"]})
            shares.append(", ".join(f"{n} {np.mean([r['tools'].get(n, 0.0) for r in entry[label]]):.2f}" for n in names))
        print(f"{kind:>20} | {mean(entry['before'], 'ndcg'):.3f} -> {mean(entry['after'], 'ndcg'):.3f} | "
              f"{mean(entry['before'], 'turns'):.2f} -> {mean(entry['after'], 'turns'):.2f} | {shares[0]} -> {shares[1]}")
    gain = np.mean([s["after"]["ndcg@10"] - s["before"]["ndcg@10"] for s in summaries.values()])
    worse = np.mean([s["after"]["failure_rate"] - s["before"]["failure_rate"] for s in summaries.values()])
    print(f"RL beats the warmed-up policy by >= 0.15 nDCG@10 with the failure rate not higher: "
          f"{gain >= 0.15 and worse <= 0} (change {gain:+.4f}, failure rate {worse:+.4f})")
    hop = [k for k in types if k.endswith("/multihop")]
    look = [k for k in types if k.endswith("/lookup")]
    if hop and look:
        ndcg, turns = mean(types[hop[0]]["after"], "ndcg"), mean(types[hop[0]]["after"], "turns")
        lookup_turns = mean(types[look[0]]["after"], "turns")
        print(f"RL learns when to hop: multihop nDCG@10 {ndcg:.3f} (>= 0.60: {ndcg >= 0.60}), multihop mean turns {turns:.2f} "
              f"(>= 2.8: {turns >= 2.8}), lookup mean turns {lookup_turns:.2f} (<= 2.3: {lookup_turns <= 2.3})")

if __name__ == "__main__":
    main()
