"""Evaluate single-tool retrieval on a BEIR-layout folder (or the synthetic collection).

    python -m tools.eval_retrieval --data ../shared/data/scifact --tools bm25,dense,fusion --encoder minilm
    python -m tools.eval_retrieval --synthetic --json /tmp/synthetic.json

Scores the collection's dev split (``--split=dev``, the default) or its training split, cut as the configs cut
them (``--dev-fraction``, ``--dev-min``; the defaults are those of configs/real_cpu.py for ``--data`` and of
configs/default.py for ``--synthetic``); the test split is never read here (only ``experiments.evaluate
--split=test`` reads it). Prints nDCG@10 and recall@100 per tool; ``--json`` writes ``{tool: {"ndcg@10", "recall@100",
"queries"[, "by_type"]}}``; ``--run-dir`` writes one TREC run file per tool.
"""

import argparse
import dataclasses
import json
import pathlib
import sys

from mtrl_jax.data.collection import SplitSizes, load_beir, split
from mtrl_jax.data.synthetic import SYNTHETIC_TFIDF_DIM, make_synthetic_collection
from mtrl_jax.search.build import SearchSettings
from mtrl_jax.search.baselines import evaluate_retrieval
from mtrl_jax.search.metrics import write_trec_run


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--data", help="a BEIR-layout folder (corpus.jsonl, queries.jsonl, qrels.tsv)")
    source.add_argument("--synthetic", action="store_true", help="the embedded default's synthetic collection")
    parser.add_argument("--seed", type=int, default=0, help="synthetic collection seed")
    parser.add_argument("--tools", default="bm25,dense,fusion")
    parser.add_argument("--encoder", default="tfidf", help="tfidf | minilm | a sentence-transformers directory")
    parser.add_argument(
        "--tfidf-dim", type=int, default=None, help="TF-IDF+SVD dimensions (default 128; 32 for --synthetic)"
    )
    parser.add_argument("--index", default="flat", help="faiss index: flat | ivf | hnsw")
    parser.add_argument("--cache-dir", default=None, help="where corpus embeddings are cached")
    parser.add_argument("--split", choices=("dev", "train"), default="dev", help="which queries are scored")
    parser.add_argument("--dev-fraction", type=float, default=None, help="data.dev_fraction (0.1; 0.05 synthetic)")
    parser.add_argument("--dev-min", type=int, default=None, help="data.dev_min (25; 200 synthetic)")
    parser.add_argument("--json", default=None, help="write the metrics here")
    parser.add_argument("--run-dir", default=None, help="write TREC run files here")
    args = parser.parse_args(argv)

    collection = make_synthetic_collection(args.seed) if args.synthetic else load_beir(args.data)
    d_fraction, d_min = (0.05, 200) if args.synthetic else (0.1, 25)
    sizes = SplitSizes(
        d_fraction if args.dev_fraction is None else args.dev_fraction,
        d_min if args.dev_min is None else args.dev_min,
        d_fraction,
        d_min,
    )
    train, dev = split(collection.tasks, sizes)
    collection = dataclasses.replace(collection, tasks=dev if args.split == "dev" else train)
    # per task type (the synthetic query kinds, MuSiQue's hop counts) where the collection has several
    group_of = (lambda task: task.type) if len({t.type for t in collection.tasks}) > 1 else None
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    dim = args.tfidf_dim or (SYNTHETIC_TFIDF_DIM if args.synthetic else SearchSettings.tfidf_dim)
    settings = SearchSettings(encoder=args.encoder, tfidf_dim=dim, index_type=args.index, cache_dir=args.cache_dir)
    results = evaluate_retrieval(collection, tools, settings, group_of=group_of)
    print(
        f"{collection.name}: {len(collection.documents)} documents, {len(collection.tasks)} judged {args.split} queries"
    )
    for tool, m in results.items():
        line = f"  {tool:7s} nDCG@10 {m['ndcg@10']:.4f}  recall@100 {m['recall@100']:.4f}"
        if "by_type" in m:
            line += "  | " + "  ".join(f"{g} {v['ndcg@10']:.3f}" for g, v in m["by_type"].items())
        print(line)
    if args.run_dir:
        out = pathlib.Path(args.run_dir)
        out.mkdir(parents=True, exist_ok=True)
        for tool, m in results.items():
            with open(out / f"{collection.name}.{tool}.run", "w") as f:
                write_trec_run(f, {q.split("/", 1)[-1]: r for q, r in m["rankings"].items()}, tag=tool)
    if args.json:
        payload = {tool: {k: v for k, v in m.items() if k != "rankings"} for tool, m in results.items()}
        pathlib.Path(args.json).write_text(json.dumps(payload, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
