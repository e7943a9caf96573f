"""The fetched base models on the held-out queries of the shared collections, next to the single-tool
baselines (BM25, dense, fusion) on the very same queries: the "before" column of RL on real models.

    python -m tools.fetch_models --model smollm2-135m-instruct --out models/smollm2-135m-instruct
    python -m tools.eval_base_models --models smollm2-135m-instruct --out workdirs/base_eval

For each model and collection this runs ``python -m experiments.evaluate --config=configs/real_cpu.py``
(the model's own chat template, 50 held-out queries per collection: ``data.dev_min``), and
writes ``<out>/table.md`` (nDCG@10, failure rate by reason, mean turns, tool calls per episode) and
``<out>/results.json``. Extra ``--set key=value`` pairs are passed on as ``--config.key=value``.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import subprocess
import sys
import time

REPO = pathlib.Path(__file__).resolve().parents[1]

COLLECTIONS = ("scifact", "cranfield", "musique", "dbpedia_entity_5k")


def baselines(folder: pathlib.Path, minimum: int, tfidf_dim: int) -> dict:
    """BM25 / dense / fusion nDCG@10 on the dev queries of ``folder`` (the split the runs use)."""
    import dataclasses

    from mtrl_jax.data.collection import SplitSizes, load_beir, split
    from mtrl_jax.search.baselines import evaluate_retrieval
    from mtrl_jax.search.build import SearchSettings

    collection = load_beir(folder)
    _, held_out = split(collection.tasks, SplitSizes(0.05, minimum))  # data.dev_fraction's default, as in the runs
    results = evaluate_retrieval(
        dataclasses.replace(collection, tasks=held_out),
        ("bm25", "dense", "fusion"),
        SearchSettings(tfidf_dim=tfidf_dim),
    )
    return {"queries": len(held_out), **{tool: r["ndcg@10"] for tool, r in results.items()}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="smollm2-135m-instruct,qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--models-dir", type=pathlib.Path, default=REPO / "models")
    parser.add_argument("--data", type=pathlib.Path, default=REPO.parent / "shared" / "data")
    parser.add_argument("--collections", default=",".join(COLLECTIONS))
    parser.add_argument("--out", type=pathlib.Path, default=REPO / "workdirs" / "base_eval")
    parser.add_argument("--queries", type=int, default=50, help="held-out queries per collection (data.dev_min)")
    parser.add_argument("--set", action="append", default=[], help="key=value: passed on as --config.key=value")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    results_file = args.out / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    collections = [c for c in args.collections.split(",") if c]
    for c in collections:
        if not (args.data / c).is_dir():
            sys.exit(f"eval_base_models.py: {args.data / c} not found")
    results.setdefault("baselines", {})
    for c in collections:
        if c not in results["baselines"]:
            results["baselines"][c] = baselines(args.data / c, args.queries, 128)
            results_file.write_text(json.dumps(results, indent=2))
    for model in [m for m in args.models.split(",") if m]:
        directory = args.models_dir / model
        if not (directory / "fetch.json").exists():
            sys.exit(
                f"eval_base_models.py: {directory} not fetched (tools/fetch_models.py --model {model} --out "
                f"{directory})"
            )
        for c in collections:
            if c in results.get(model, {}):
                continue  # done in an earlier run: resumable
            out = args.out / model / c
            start = time.perf_counter()
            cmd = [
                sys.executable,
                "-m",
                "experiments.evaluate",
                "--config=configs/real_cpu.py",
                f"--out={out}",
                f"--config.model.checkpoint={directory}",
                f"--config.data.folders={args.data / c}",
                f"--config.data.dev_min={args.queries}",
                "--config.global_batch_size=1",  # no training here
                *[f"--config.{kv}" for kv in args.set],
            ]
            subprocess.run(cmd, cwd=REPO, check=True)
            metrics = json.loads((out / "eval.json").read_text())[c]
            metrics["wall_s"] = time.perf_counter() - start
            results.setdefault(model, {})[c] = metrics
            results_file.write_text(json.dumps(results, indent=2))
            print(
                f"{model} {c}: nDCG@10 {metrics['ndcg@10']:.4f}, failure rate {metrics['failure_rate']:.3f} "
                f"({metrics['wall_s']:.0f} s)",
                flush=True,
            )
    lines = [
        "| collection | model / baseline | queries | nDCG@10 | failure rate (by reason) | mean turns | tool "
        "calls / episode |",
        "|---|---|---|---|---|---|---|",
    ]
    for c in collections:
        scores = dict(results["baselines"][c])
        queries = scores.pop("queries", args.queries)
        for tool, value in scores.items():
            lines.append(f"| {c} | {tool} (single search) | {queries} | {value:.4f} | - | - | - |")
        for model in [m for m in results if m != "baselines" and c in results[m]]:
            m = results[model][c]
            reasons = ", ".join(f"{r} {v:.2f}" for r, v in m["failure_rate_by_reason"].items())
            tools = ", ".join(f"{t} {v:.2f}" for t, v in m["tool_calls_per_episode"].items()) or "0"
            lines.append(
                f"| {c} | {model} | {m['queries']} | {m['ndcg@10']:.4f} | {m['failure_rate']:.2f}"
                f"{' (' + reasons + ')' if reasons else ''} | {m['mean_turns']:.2f} | {tools} |"
            )
    (args.out / "table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
