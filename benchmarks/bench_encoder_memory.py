"""Peak resident memory of a config's vector search on its collections: one pre-trained encoder shared by every
collection (``search.build.pretrained_encoder``, the code's way) against one encoder per collection (the way
before it), each side in a fresh process, alternated.

    python -m benchmarks.bench_encoder_memory --config=configs/real_cpu.py [--rounds 2]

Each process builds the vector search of every collection of the config (corpus embeddings from
``search.cache_dir`` when cached there) and runs every query of the collection once, one query a call, as
the agent's tool calls do (so each query shape is compiled), then reports its peak resident memory
(``ru_maxrss``). Needs a pre-trained encoder (``search.encoder="minilm"`` or a model directory): the TF-IDF
encoder is fitted per corpus and is never shared.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys

from benchmarks.common import machine_line


def measure(config_path: str, overrides: list[str], shared: bool) -> dict:
    """In this process: build every collection's vector search, run its queries; peak RSS in GiB."""
    import time

    from experiments.sweep import load_config
    from mtrl_jax.search.build import make_encoder, minilm_path
    from mtrl_jax.search.encoders import BertEncoder
    from mtrl_jax.search.retrievers import DenseRetriever
    from mtrl_jax.setup import build_data, search_settings

    config = load_config(config_path, overrides)
    settings = search_settings(config)
    collections, train, val = build_data(config)
    start = time.perf_counter()
    queries = 0
    for name, collection in collections.items():
        if shared:
            encoder = make_encoder(settings.encoder, settings.tfidf_dim)
        else:  # a new encoder for each collection
            encoder = BertEncoder(minilm_path() if settings.encoder == "minilm" else settings.encoder)
        dense = DenseRetriever(collection, encoder, settings.cache_dir, settings.index_type)
        for task in {t.task_id: t for t in [*train, *val] if t.corpus == name}.values():
            dense.search(task.query, 10)
            queries += 1
    return {
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "queries": queries,
        "seconds": time.perf_counter() - start,
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/real_cpu.py")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--side", choices=("shared", "per_collection"), help=argparse.SUPPRESS)
    args, overrides = parser.parse_known_args(argv)
    if args.side:
        print(json.dumps(measure(args.config, overrides, args.side == "shared")))
        return 0
    from experiments.sweep import load_config

    encoder = load_config(args.config, overrides).search.encoder
    if encoder == "tfidf":
        print(f"{args.config}: search.encoder='tfidf' is fitted per corpus and never shared; nothing to compare")
        return 0
    print(machine_line(peak=False), flush=True)
    results: dict[str, list[dict]] = {"shared": [], "per_collection": []}
    for _ in range(args.rounds):
        for side in results:
            cmd = [sys.executable, "-m", "benchmarks.bench_encoder_memory", f"--config={args.config}", f"--side={side}"]
            done = subprocess.run([*cmd, *overrides], capture_output=True, text=True, check=True)
            results[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(f"{side}: {results[side][-1]}", flush=True)
    peak = {side: statistics.median(r["peak_rss_gib"] for r in runs) for side, runs in results.items()}
    print(
        f"\n{args.config} (search.encoder={encoder!r}, {results['shared'][0]['queries']} queries, median of "
        f"{args.rounds} alternated rounds): peak resident {peak['shared']:.2f} GiB with one shared encoder, "
        f"{peak['per_collection']:.2f} GiB with one per collection: {peak['per_collection'] - peak['shared']:+.2f} "
        f"GiB, {peak['per_collection'] / peak['shared']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
