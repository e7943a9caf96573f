"""Does RL beat the cold-started teacher? The default config over several seeds, means with 95% intervals.

    python -m benchmarks.bench_learning --seeds 0,1,2 --out workdirs/bench_learning

Each seed is a full `experiments.run` of configs/default.py (synthetic collection, tokenizer,
cold start and RL all seeded) in `<out>/seed_<s>`; a seed whose summary.json exists is not rerun,
so the script resumes; each run's wall time is printed. The baseline, measured in the same runs, is the
cold-started policy before RL.
Extra `--config.*` overrides are passed through. It also prints, from the runs' evaluation
trajectories, nDCG@10, mean turns and the share of each tool's first call per task type (e.g.
`synthetic/multihop`), before and after RL: what RL changed, not only how much; and the checks of
issue 15 (overall gain >= 0.15, multihop nDCG@10 >= 0.60 with >= 2.8 turns, lookup <= 2.3 turns).
From the RL steps' trajectories it prints how the sampled episodes hop per task type, in the first and
the last quarter of the steps: the share with a second search, the mean reward with and without one,
and the share of second searches that returned a relevant document the first search had not.
"""

import argparse
import json
import pathlib

import numpy as np

from benchmarks.common import machine_line, run_seeds
from mtrl_jax import stats


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
    return {
        k: {
            "ndcg": float(np.mean(s)),
            "turns": float(np.mean(n)),
            "tools": {name: c / len(s) for name, c in sorted(tools.items())},
        }
        for k, (s, n, tools) in sorted(out.items())
    }


def training_hops(workdir: pathlib.Path) -> dict:
    """{type: {"early" | "late": {"episodes", "hop_share", "reward_hop", "reward_single", "hop_found"}}} over
    the first and the last quarter of the RL steps' trajectories (``trajectories/step_*.jsonl``). A hop is
    an episode with a second search; it found something when that search returned a document with a
    grade > 0 that the first had not (grades as the records give them, of the final ranking's documents)."""
    files = sorted((workdir / "trajectories").glob("step_*.jsonl"))
    quarter = max(1, len(files) // 4)
    out: dict = {}
    for label, part in (("early", files[:quarter]), ("late", files[-quarter:])):
        rows: dict = {}
        for path in part:
            for line in path.read_text().splitlines():
                t = json.loads(line)
                searches = [c for turn in t["turns"] for c in turn["calls"] if c["name"] and not c.get("error")]
                hop, single, found = rows.setdefault(t["type"], ([], [], []))
                (hop if len(searches) > 1 else single).append(t["reward"])
                if len(searches) > 1:
                    first = set(searches[0]["doc_ids"])
                    found.append(any(t["grades"].get(d, 0) > 0 and d not in first for d in searches[1]["doc_ids"]))
        nan = float("nan")
        for kind, (hop, single, found) in rows.items():
            out.setdefault(kind, {})[label] = {
                "episodes": len(hop) + len(single),
                "hop_share": len(hop) / (len(hop) + len(single)),
                "reward_hop": float(np.mean(hop)) if hop else nan,
                "reward_single": float(np.mean(single)) if single else nan,
                "hop_found": float(np.mean(found)) if found else nan,
            }
    return out


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", default="0,1,2,3,4")
    parser.add_argument("--out", default="workdirs/bench_learning")
    parser.add_argument("--config", default="configs/default.py")
    args, overrides = parser.parse_known_args(argv)
    out = pathlib.Path(args.out)
    print(machine_line(peak=False), flush=True)
    seeds = [int(s) for s in args.seeds.split(",")]
    summaries = run_seeds(
        args.config, seeds, out, overrides, per_seed=("--config.seed={seed}", "--config.data.synthetic_seed={seed}")
    )
    for seed, s in summaries.items():
        if "wall_seconds" in s:
            print(f"seed {seed}: {s['wall_seconds'] / 60:.1f} minutes end to end", flush=True)
    print(f"{'seed':>6} " + " ".join(f"{p}:{k:>14}" for p in ("before", "after") for k in KEYS))
    for seed, s in summaries.items():
        print(f"{seed:>6} " + " ".join(f"{s[p][k]:>21.4f}" for p in ("before", "after") for k in KEYS))
    # each seed its own synthetic collection (data.synthetic_seed): seed-level figures, Student's t over the seeds
    # (each seed's figure carries its own queries' noise); the change is paired seed by seed
    for key in KEYS:
        before = stats.interval([s["before"][key] for s in summaries.values()])
        after = stats.interval([s["after"][key] for s in summaries.values()])
        change = stats.paired(
            [s["after"][key] for s in summaries.values()], [s["before"][key] for s in summaries.values()]
        )
        print(f"{key:>13}: before {before.text(4)}   after {after.text(4)}")
        print(f"{'':>13}  change {change.text(4)}: {stats.verdict(change)}")
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
            shares.append(
                ", ".join(f"{n} {np.mean([r['tools'].get(n, 0.0) for r in entry[label]]):.2f}" for n in names)
            )
        print(
            f"{kind:>20} | {mean(entry['before'], 'ndcg'):.3f} -> {mean(entry['after'], 'ndcg'):.3f} | "
            f"{mean(entry['before'], 'turns'):.2f} -> {mean(entry['after'], 'turns'):.2f} | {shares[0]} -> {shares[1]}"
        )
    print(
        "\nhops in the RL steps' sampled episodes (mean over seeds), first quarter -> last quarter of the "
        "steps: share of "
        "episodes with a second search, mean reward with / without one, share of second searches that found a relevant "
        "document the first had not"
    )
    hops: dict = {}
    for seed in summaries:
        for kind, parts in training_hops(out / f"seed_{seed}").items():
            for label, row in parts.items():
                hops.setdefault(kind, {}).setdefault(label, []).append(row)
    for kind, parts in sorted(hops.items()):
        cells = []
        for label in ("early", "late"):
            rows = parts.get(label, [])
            m = {
                k: float(np.nanmean([r[k] for r in rows])) if rows else float("nan")
                for k in ("hop_share", "reward_hop", "reward_single", "hop_found")
            }
            cells.append(
                f"{m['hop_share']:.2f}, {m['reward_hop']:+.3f} / {m['reward_single']:+.3f}, found {m['hop_found']:.2f}"
            )
        print(f"{kind:>20} | {cells[0]} -> {cells[1]}")
    gain = np.mean([s["after"]["ndcg@10"] - s["before"]["ndcg@10"] for s in summaries.values()])
    worse = np.mean([s["after"]["failure_rate"] - s["before"]["failure_rate"] for s in summaries.values()])
    print(
        f"RL beats the warmed-up policy by >= 0.15 nDCG@10 with the failure rate not higher: "
        f"{gain >= 0.15 and worse <= 0} (change {gain:+.4f}, failure rate {worse:+.4f})"
    )
    hop = [k for k in types if k.endswith("/multihop")]
    look = [k for k in types if k.endswith("/lookup")]
    if hop and look:
        ndcg, turns = mean(types[hop[0]]["after"], "ndcg"), mean(types[hop[0]]["after"], "turns")
        lookup_turns = mean(types[look[0]]["after"], "turns")
        print(
            f"RL learns when to hop: multihop nDCG@10 {ndcg:.3f} (>= 0.60: {ndcg >= 0.60}), multihop mean turns "
            f"{turns:.2f} "
            f"(>= 2.8: {turns >= 2.8}), lookup mean turns {lookup_turns:.2f} (<= 2.3: {lookup_turns <= 2.3})"
        )


if __name__ == "__main__":
    main()
