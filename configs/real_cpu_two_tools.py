"""configs/real_cpu.py with a teacher that demonstrates both tools: on 8 of 10 demonstrations the first
search is followed by a second with the other tool on the question again, and the empty answer lets the
environment fuse the two result lists. After RL two of three seeds make that move on (almost) every held-out query.

    python -m benchmarks.bench_real_learning --config=configs/real_cpu_two_tools.py --seeds 0,1,2

Measured, seeds 0, 1 and 2 (docs/real_models.md): held-out SciFact 0.772 / 0.739 / 0.717 after RL against the
best one search's 0.748 (fusion): above it on one seed of three, -0.006 as the mean. Seed 2 ended at one vector
search; seeds 0 and 1 at both tools for 5 results each (10 each overflow SciFact's 1,024-token context).
With ``--config.rollout.max_len=1536``, where 10 of each fit, seed 0 ended at one vector search (SciFact 0.717).
Cranfield, MuSiQue and DBpedia-entity stay at or below their best one search on every seed, since one fixed
move for every collection is not the best one for each. Three turns an episode make an RL step about 2.5x the
recipe's: 110-124 minutes a seed, over the 90 aimed for, so this is not the default recipe.
"""

from configs import real_cpu


def get_config():
    c = real_cpu.get_config()
    c.unlock()
    c.warmup.teacher_hop = 0.8  # a second search on 8 of 10 demonstrations (the recipe: 0.3)
    c.warmup.teacher_hop_tools = "other"  # with the tool the first search did not use
    c.warmup.teacher_hop_queries = "question:1"  # for the question again
    c.lock()
    return c
