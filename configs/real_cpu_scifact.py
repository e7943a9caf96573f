"""A per-collection agent for SciFact: configs/real_cpu.py trained on SciFact's training queries alone,
with a cold start whose teacher always demonstrates the move SciFact's training queries favour.

    python -m benchmarks.bench_real_learning --config=configs/real_cpu_scifact.py --seeds 0,1

`tools.search_headroom` on SciFact's 140 training queries (no held-out judgment): one BM25 search 0.653,
one vector search 0.623, both searches with the question (10 results each), fused by the empty answer's
fallback, 0.680; the tool does not score 5 each. So this teacher searches with one tool (drawn at random), then with the
other on the question again, 5 results each (10 each overflow the 1,024-token context), and gives the
empty answer. The recipe's teacher draws all of these at random instead; this one leaves RL only what it
samples itself. The held-out queries are the mixture recipe's 30 SciFact ones (the same split).

Measured, seeds 0 / 1 at 6a1f02d / 98f5744 (docs/real_models.md): warmed up 0.772 / 0.772 (one call of each
tool on every held-out query), after 40 RL steps 0.772 / 0.675 (failures 0) against the best one search's
0.748 (fusion): +0.024 / -0.073. On seed 0 RL changed nothing (query by query 3 wins, 4 losses and 23 ties);
on seed 1 it replaced the vector search by a repeated BM25 call. 91.9 / 43.3 minutes, peak 6.37 / 7.15 GiB.
"""

from configs import real_cpu


def get_config():
    c = real_cpu.get_config()
    c.unlock()
    c.data.folders = "../shared/data/scifact"
    c.data.weights = "1"
    c.warmup.teacher_hop = 1.0  # always a second search
    c.warmup.teacher_hop_tools = "other"  # with the tool the first search did not use
    c.warmup.teacher_hop_queries = "question:1"  # for the question again
    c.warmup.teacher_top_k = "5:1"
    c.warmup.teacher_answers = "empty:1"  # the fallback fuses the two lists
    c.lock()
    return c
