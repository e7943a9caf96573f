"""The embedded default with a teacher that hops: the multi-turn demonstration (issue 15).

    python -m experiments.run --config=configs/hop.py --workdir=workdirs/hop
    python scripts/bench_learning.py --config=configs/hop.py --seeds 0,1,2 --out workdirs/bench_hop

The scripted teacher makes a second search half the time, whatever the question, on an identifier
copied from the first search's results (one drawn at random among those shown); two more
demonstrations per question always hop (``warmup.hop_drills``, no loss on the decision to hop); its
first tool is BM25 or vector search at random. RL has to learn which questions the hop pays on
(``component of project X``: the project document names the part, a search on its identifier finds
it). The warm-up runs 2,400 steps: the tiny policy has to learn to copy an identifier out of search
results whole, which it does on some seeds and not others (README, "Multi-turn: RL learns the hop").
About 8-9 minutes on 2 cores, against the default's 5-6.
"""

from configs import default


def get_config():
    c = default.get_config()
    c.unlock()
    c.warmup.steps = 2400
    c.warmup.teacher_tools = ""  # uniform
    c.warmup.teacher_hop = 0.5
    c.warmup.hop_drills = 2
    c.lock()
    return c
