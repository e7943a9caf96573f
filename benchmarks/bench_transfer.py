"""Transfer: is the recipe's agent still a search agent on a collection it never saw?

    python -m benchmarks.bench_transfer --config=configs/real_cpu.py --holdout cranfield,musique --seed 0

For each held-out collection (a folder of ``data.folders``, named by its last path component): one
``experiments.run`` of the config on the other collections (``data.folders`` without it, equal
``data.weights``) in ``<out>/<holdout>/seed_<s>``, its cold start and RL drawn from them alone. Then its cold
start and its RL policy are read once on the held-out collection's test split alone (``experiments.evaluate
--split=test --config.data.folders=<it>``, whose ledger counts the readings; a reading already made is loaded),
beside one search with the question (BM25, dense, their fusion) on the same test queries. It prints, per held-out
collection: each policy's nDCG@10 with its interval over the queries, RL's paired gain, the RL policy's paired
difference to each one search, and its ratio to the best of them (the bar: 0.9). Each run's minutes and peak
resident memory follow. A run or a reading already done is not repeated, so held-out collections can run as
separate invocations side by side and a last one with all of them prints the table. Extra ``--config.*``
arguments go to every run and reading.
"""

from __future__ import annotations

import argparse
import pathlib

import numpy as np

from benchmarks.common import REPO, machine_line, read_test, run_seeds
from mtrl_jax import stats
from mtrl_jax.data.build import csv

TOOLS = ("bm25", "dense", "fusion")
BAR = 0.9  # the RL policy's nDCG@10 over the best one search's, on the collection it never saw


def partition(folders: str, holdout: str) -> tuple[str, str]:
    """``(the other folders, the held-out folder)`` of the comma-separated ``folders``; ``holdout`` names a folder
    by its last path component."""
    names = {pathlib.PurePath(f).name: f for f in csv(folders)}
    if holdout not in names:
        raise SystemExit(f"--holdout {holdout!r}: not a collection of data.folders ({', '.join(names)})")
    if len(names) < 2:
        raise SystemExit(f"--holdout {holdout!r}: data.folders has no other collection to train on")
    return ",".join(f for name, f in names.items() if name != holdout), names[holdout]


def transfer_row(name: str, cold: dict, tuned: dict) -> dict:
    """One held-out collection's figures from its two ``test_scores.json`` readings (``read_test``)."""
    if set(tuned) != {name} or set(cold) != {name}:
        raise ValueError(f"the readings hold {sorted(tuned)} and {sorted(cold)}, not the held-out {name!r} alone")
    ids = sorted(tuned[name]["policy"])
    scores = lambda reading, key: np.array([[reading[name][key][i] for i in ids]])  # noqa: E731 - one run
    policy, warm = scores(tuned, "policy"), scores(cold, "policy")
    base = {tool: scores(tuned, tool) for tool in TOOLS}
    best = max(TOOLS, key=lambda tool: base[tool].mean())
    against = {tool: (float(base[tool].mean()), stats.paired(policy, base[tool])) for tool in TOOLS}
    return {
        "queries": len(ids),
        "cold": stats.interval(warm),
        "rl": stats.interval(policy),
        "gain": stats.paired(policy, warm),
        "against": against,
        "best": best,
        "ratio": float(policy.mean() / max(base[best].mean(), 1e-9)),
    }


def print_table(rows: dict) -> None:
    print(
        "\n| held out | test queries | cold start | after RL | RL gain [95% CI, paired] | after RL / best one search |"
    )
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        g = r["gain"]
        print(
            f"| {name} | {r['queries']} | {r['cold'].text()} | {r['rl'].text()} | {g.mean:+.3f} [{g.low:+.3f}, "
            f"{g.high:+.3f}] {stats.verdict(g)} | {r['ratio']:.2f} ({r['best']}; >= {BAR}: {r['ratio'] >= BAR}) |"
        )
    print("\n| held out | one search | its nDCG@10 | after RL - it [95% CI, paired] | verdict |\n|---|---|---|---|---|")
    for name, r in rows.items():
        for tool, (value, d) in r["against"].items():
            print(
                f"| {name} | {tool} | {value:.3f} | {d.mean:+.3f} [{d.low:+.3f}, {d.high:+.3f}] | {stats.verdict(d)} |"
            )


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/real_cpu.py")
    parser.add_argument("--holdout", required=True, help="comma-separated collections, each held out in its own run")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "workdirs" / "bench_transfer")
    args, overrides = parser.parse_known_args(argv)
    bad = [o for o in overrides if not o.startswith("--config.")]
    if bad:
        raise SystemExit(f"bench_transfer: unexpected arguments {bad} (only --config.key=value are passed on)")
    from experiments.sweep import load_config

    folders = load_config(args.config, overrides).data.folders
    plan = {name: partition(folders, name) for name in csv(args.holdout)}
    print(machine_line(), flush=True)
    rows, summaries = {}, {}
    for name, (others, held) in plan.items():
        train = [f"--config.data.folders={others}", f"--config.data.weights={','.join('1' * len(csv(others)))}"]
        out = args.out / name
        summaries[name] = run_seeds(args.config, [args.seed], out, [*train, *overrides], label=f"[{name} held out] ")
        workdir = out / f"seed_{args.seed}"
        test = [f"--config.seed={args.seed}", f"--config.data.folders={held}", "--config.data.weights=1", *overrides]
        cold, tuned = (read_test(args.config, workdir, workdir / f"test_{s}", test, s) for s in ("warmup", "rl"))
        rows[name] = transfer_row(name, cold, tuned)
    print(
        f"\n{args.config} {' '.join(overrides)}: seed {args.seed}, each collection's test split, trained on the others"
    )
    print_table(rows)
    print("\n| held out | minutes | peak resident GiB | RL steps |\n|---|---|---|---|")
    for name, by_seed in summaries.items():
        s = by_seed[args.seed]
        minutes, peak = s.get("wall_seconds", float("nan")) / 60, s.get("peak_rss_gib", float("nan"))
        print(f"| {name} | {minutes:.1f} | {peak:.2f} | {s['rl_steps']} |")


if __name__ == "__main__":
    main()
