"""A per-collection agent for SciFact: configs/real_cpu.py trained on SciFact's training queries alone,
with a cold start whose teacher always demonstrates the move SciFact's training queries favour, and copy
practice for the 135M model.

    python -m benchmarks.bench_real_learning --config=configs/real_cpu_scifact.py --seeds 0,1,2

`tools.search_headroom` on SciFact's 140 training queries (no held-out judgment): one BM25 search 0.653,
one vector search 0.623, both searches with the question (10 results each), fused by the empty answer's
fallback, 0.680; the tool does not score 5 each. So this teacher searches with one tool (drawn at random), then with the
other on the question again, 5 results each (10 each overflow the 1,024-token context), and gives the
empty answer. The recipe's teacher draws all of these at random instead; this one leaves RL only what it
samples itself. The held-out queries are the mixture recipe's 30 SciFact ones (the same split).

Every loss of this agent against its best cold start was a broken copy of a held-out question (a misspelt
rare word, a loop on a repeated phrase), different on each seed; ``warmup.augment = 1`` adds, for each
training question, a demonstration on a rewrite of it (words swapped for other questions' words) to copy.
Measured (docs/real_models.md): seeds 0 / 1 / 2 at b48f75f with these settings, warmed up 0.772 each,
after 20 RL steps of 8 queries 0.772 / 0.772 / 0.772 against the best one search's 0.748 (fusion); without
the rewrites (309f82d / 8f75759) 0.739 each, the cold starts 0.739 / 0.739 / 0.772. With 40 steps of 4
queries and no rewrites (6a1f02d / 98f5744, seeds 0 / 1): 0.772 / 0.675. 36.5-38.8 minutes a seed, peak
9.85-11.17 GiB (32 episodes generated at once).
"""

from configs import real_cpu


def get_config():
    c = real_cpu.get_config()
    c.unlock()
    c.data.folders = "../shared/data/scifact"
    c.data.weights = "1"
    c.max_steps = 20
    c.global_batch_size = 8  # queries per RL step: 32 episodes, against 16 in the recipe
    c.rollout_max_concurrency = 32  # one generation batch per step
    c.rl.micro_batches = 16
    c.warmup.augment = 1  # copy practice: one rewritten variant of each training question, drawn once
    c.warmup.teacher_hop = 1.0  # always a second search
    c.warmup.teacher_hop_tools = "other"  # with the tool the first search did not use
    c.warmup.teacher_hop_queries = "question:1"  # for the question again
    c.warmup.teacher_top_k = "5:1"
    c.warmup.teacher_answers = "empty:1"  # the fallback fuses the two lists
    c.lock()
    return c
