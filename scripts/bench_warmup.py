"""The embedded default's supervised warm-up step with the shared system prompt computed once per
step against computing it in every row.

    python scripts/bench_warmup.py                 # 20 steps per side per round, 3 rounds

Builds `configs/default.py` (synthetic collection, tokenizer, tiny policy), renders the scripted
teacher's demonstrations as the warm-up does, and times `warmup_step` on the two batch shapes the
warm-up trains on: the first-turn cut (7 of every 8 steps) and whole demonstrations (the most common
length group). The two sides alternate, `--steps` steps each, `--repeats` rounds, on the same
batches from the same parameters; the script prints the median step time of each, the ratio, the
tokens each computes per step, and the largest loss difference (the same loss, to float rounding).
"""

from __future__ import annotations

import argparse
import pathlib
import statistics
import tempfile
import time

import jax
import numpy as np

from configs.default import get_config
from mtrl_jax.model.sharding import activate, place_batch
from mtrl_jax.rl.batch import bucket
from mtrl_jax.setup import build
from mtrl_jax.warmup import _pack, _turn_end, common_prefix, demonstrations, warmup_optimizer, warmup_step


def warmup_views(demos):
    """What the default's warm-up trains on (``warmup.supervised_warmup``): the shared prefix, the
    demonstrations cut after their first turn, the length groups of whole demonstrations (multiples of
    64 tokens), and the most common group's demonstrations, packed."""
    shared = np.asarray(common_prefix(demos), np.int32)
    first_turns = _pack([(t[:_turn_end(m, 1)], m[:_turn_end(m, 1)]) for t, m in demos])
    lengths = [bucket(len(t), 64) for t, _ in demos]
    groups = sorted(set(lengths))
    common = max(groups, key=lengths.count)
    whole = _pack([d for d, length in zip(demos, lengths) if length == common], 64)
    return shared, first_turns, groups, whole


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    config = get_config()
    config.unlock()
    config.compilation_cache_dir = ""  # compile both sides here (their compile times are printed too)
    c = build(config, pathlib.Path(tempfile.mkdtemp(prefix="bench_warmup_")))
    demos = demonstrations(c)
    shared, first_turns, _, whole = warmup_views(demos)
    P, B = len(shared), c.warmup.batch_size
    rng = np.random.default_rng(0)
    print(f"{len(demos)} demonstrations, shared prefix {P} tokens, batch {B}")

    tx = warmup_optimizer(c.warmup.steps, c.warmup.learning_rate)
    opt_state = tx.init(c.params)
    for name, packed in (("first turns", first_turns), ("whole demonstrations", whole)):
        idx = rng.choice(len(packed[0]), size=B, replace=False)
        rows = tuple(x[idx] for x in packed)
        T = rows[0].shape[1]
        sides = {"shared prefix": (warmup_step(c.model_cfg, tx, shared, c.updater.config.logprob_chunk),
                                   tuple(x[:, P:] for x in rows), P + B * (T - P)),
                 "every row": (warmup_step(c.model_cfg, tx, np.zeros((0,), np.int32), c.updater.config.logprob_chunk),
                               rows, B * T)}
        times = {side: [] for side in sides}
        losses = {}
        with activate(c.mesh):
            for side, (step, batch, _) in sides.items():
                start = time.perf_counter()
                step.lower(c.params, opt_state, *batch).compile()
                print(f"  {name}, {side}: compiled in {time.perf_counter() - start:.1f} s")
            for _ in range(args.repeats):
                for side, (step, batch, _) in sides.items():
                    placed = place_batch(batch, c.mesh)
                    params, state = c.params, jax.tree.map(np.copy, opt_state)
                    for i in range(args.steps + 1):
                        start = time.perf_counter()
                        params, state, loss = step(params, state, *placed)
                        loss = float(loss)
                        if i:  # the first call of a round fetches the arguments
                            times[side].append(time.perf_counter() - start)
                        else:
                            losses.setdefault(side, loss)
        medians = {side: statistics.median(t) for side, t in times.items()}
        print(f"{name} [{B} x {T}]:")
        for side, (_, _, tokens) in sides.items():
            print(f"  {side:>14}: {1000 * medians[side]:7.1f} ms/step, {tokens} tokens computed")
        print(f"  ratio {medians['every row'] / medians['shared prefix']:.2f}x; first-step loss "
              f"{losses['shared prefix']:.6f} vs {losses['every row']:.6f} (difference {abs(losses['shared prefix'] - losses['every row']):.1e})")


if __name__ == "__main__":
    main()
