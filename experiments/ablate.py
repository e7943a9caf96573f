"""Ablations: ``python -m experiments.ablate --config=configs/default.py --grid rl.loss=ppo,cispo,is
--grid rl.advantage=grpo,rloo,grpo_passk --seeds 3 --out workdirs/ablate [--config.max_steps=...]``.

Every cell of the grid runs once per seed, one after another, as ``experiments.run`` in
``<out>/<cell>/seed_<s>``; a run whose summary.json exists is skipped, so the command resumes.
Then ``results.md`` / ``results.json`` (mean +- std over seeds of the final validation nDCG@10 and
failure rate) and ``validation.png`` (validation nDCG@10 against RL step, one line per cell) are
written. Other ``--config.*`` flags are passed to every run.
"""

import argparse
import itertools
import json
import pathlib

import numpy as np

from experiments.sweep import run_seeds


def parse_grid(items):
    grid = []
    for item in items:
        if "=" not in item:
            raise SystemExit(f"--grid {item!r}: expected field=value1,value2")
        field, values = item.split("=", 1)
        grid.append((field, [v for v in values.split(",") if v]))
    return grid


def cell_name(cell) -> str:
    return ",".join(f"{field.split('.')[-1]}={value}" for field, value in cell)


def validation_curve(workdir: pathlib.Path) -> list[tuple[int, float]]:
    """(step, validation nDCG@10): before RL at 0, periodic evaluations, after RL at the end."""
    summary = json.loads((workdir / "summary.json").read_text())
    points = [(0, summary["before"]["ndcg@10"])]
    metrics = workdir / "metrics.jsonl"
    if metrics.exists():
        for line in metrics.read_text().splitlines():
            row = json.loads(line)
            if "eval/ndcg@10" in row:
                points.append((row["step"], row["eval/ndcg@10"]))
    points.append((summary["rl_steps"], summary["after"]["ndcg@10"]))
    return points


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/default.py")
    parser.add_argument("--grid", action="append", default=[], help="field=value1,value2 (repeatable)")
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--out", default="workdirs/ablate")
    parser.add_argument("--eval-every", type=int, default=8, help="validation every N RL steps (the plot's points)")
    args, overrides = parser.parse_known_args(argv)
    for o in overrides:
        if not o.startswith("--config."):
            raise SystemExit(f"unknown argument {o!r}")
    grid = parse_grid(args.grid)
    if not grid:
        raise SystemExit("give at least one --grid field=values")
    out = pathlib.Path(args.out)
    cells = [tuple(zip([f for f, _ in grid], values)) for values in itertools.product(*[v for _, v in grid])]
    results = {}
    for cell in cells:
        name = cell_name(cell)
        flags = [f"--config.eval.every_steps={args.eval_every}", *[f"--config.{f}={v}" for f, v in cell], *overrides]
        summaries = list(run_seeds(args.config, range(args.seeds), out / name, flags, label=f"[{name}] ").values())
        runs = [out / name / f"seed_{seed}" for seed in range(args.seeds)]
        ndcg = np.array([s["after"]["ndcg@10"] for s in summaries])
        fail = np.array([s["after"]["failure_rate"] for s in summaries])
        results[name] = {
            "ndcg@10_mean": float(ndcg.mean()),
            "ndcg@10_std": float(ndcg.std()),
            "failure_rate_mean": float(fail.mean()),
            "failure_rate_std": float(fail.std()),
            "seeds": len(runs),
            "curves": [validation_curve(w) for w in runs],
        }
    lines = ["| cell | validation nDCG@10 | failure rate | seeds |", "|---|---|---|---|"]
    for name, r in results.items():
        lines.append(
            f"| {name} | {r['ndcg@10_mean']:.4f} ± {r['ndcg@10_std']:.4f} | "
            f"{r['failure_rate_mean']:.4f} ± {r['failure_rate_std']:.4f} | {r['seeds']} |"
        )
    table = "\n".join(lines) + "\n"
    (out / "results.md").write_text(table)
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(results, out / "validation.png")
    print(table)
    print(f"wrote {out / 'results.md'}, {out / 'results.json'} and {out / 'validation.png'}")


def plot(results: dict, path: pathlib.Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    for name, r in results.items():
        steps = sorted({s for curve in r["curves"] for s, _ in curve})
        mean = [np.mean([dict(c)[s] for c in r["curves"] if s in dict(c)]) for s in steps]
        ax.plot(steps, mean, marker="o", label=name)
    ax.set_xlabel("RL step")
    ax.set_ylabel("validation nDCG@10 (failures count 0)")
    ax.set_title("validation reward per ablation cell (mean over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


if __name__ == "__main__":
    main()
