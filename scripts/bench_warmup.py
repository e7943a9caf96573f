"""The embedded default's supervised warm-up step with the shared system prompt computed once per
step against computing it in every row.

    python scripts/bench_warmup.py                 # 20 steps per side per round, 3 rounds

Builds `configs/default.py` (synthetic collection, tokenizer, tiny policy), renders the scripted
teacher's demonstrations as the warm-up does, and times `warmup_step` on the two batch shapes the
warm-up trains on: the first-turn cut (7 of every 8 steps) and whole demonstrations (the most common
length group). The two sides alternate, `--steps` steps each, `--repeats` rounds, on the same
batches from the same parameters; the script prints the median step time of each, the ratio, the
tokens each computes per step, and the largest loss difference (the same loss, to float rounding).

    python scripts/bench_warmup.py --baseline 35ea290   # this tree against another commit
    python scripts/bench_warmup.py --xla_flags=--xla_cpu_experimental_ynn_fusion_type=   # XLA flags against none

``--baseline REV`` instead times the warm-up's whole schedule here against ``REV``: child processes,
alternated ``--rounds`` times, import ``mtrl_jax`` from this tree or from a git worktree of ``REV``;
each times the step on every batch shape the default's warm-up trains on (the first-turn cut, each
length group of the two-turn cuts and of whole demonstrations: ``--steps`` steps after a compiled
first one) and weighs them as ``supervised_warmup``'s schedule draws them (``full_every``,
``two_turn_every``, a group as often as its demonstrations). The script prints each shape's median
milliseconds on both sides and the expected seconds of the ``warmup.steps`` steps, with the ratios.
``--xla_flags FLAGS`` runs this tree's children with ``FLAGS`` added to ``XLA_FLAGS`` against
children without them (or, with ``--baseline``, against ``REV`` without them), the same way.
"""

from __future__ import annotations

if __name__ == "__main__":  # first: glibc reads its tunables when the process starts (mtrl_jax/host.py), as in a run
    from mtrl_jax.host import reexec_with_tunables

    reexec_with_tunables()

import argparse
import collections
import contextlib
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

import jax
import numpy as np

from bench_common import REPO, worktree
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


def schedule_shapes(demos):
    """``{shape name: (rows, view, share)}``: every batch shape the default's warm-up trains on (the
    shared prefix's columns removed), the view of the demonstrations it is one of (``step_view``) and
    the share of that view's steps that draw it (a length group as often as its demonstrations)."""
    P = len(common_prefix(demos))
    shapes = {"first turns": (tuple(x[:, P:] for x in _pack([(t[:_turn_end(m, 1)], m[:_turn_end(m, 1)]) for t, m in demos])),
                              "first", 1.0)}
    for view, cut in (("two", lambda m: _turn_end(m, 2)), ("full", len)):
        cuts = [(t[:cut(m)], m[:cut(m)]) for t, m in demos]
        lengths = [bucket(len(t), 64) for t, _ in cuts]
        for length, count in sorted(collections.Counter(lengths).items()):
            packed = _pack([d for d, g in zip(cuts, lengths) if g == length], 64)
            shapes[f"{'two turns' if view == 'two' else 'whole'} {length}"] = (tuple(x[:, P:] for x in packed), view,
                                                                               count / len(demos))
    return shapes


def schedule_child(steps: int, cache_dir: str) -> None:
    """``--child``: the schedule's shapes timed with whichever ``mtrl_jax`` is on the path; one JSON line."""
    config = get_config()
    config.unlock()
    config.compilation_cache_dir = cache_dir  # the rounds after the first load their side's programs
    c = build(config, pathlib.Path(tempfile.mkdtemp(prefix="bench_warmup_")))
    demos = demonstrations(c)
    shared = np.asarray(common_prefix(demos), np.int32)
    tx = warmup_optimizer(c.warmup.steps, c.warmup.learning_rate)
    step = warmup_step(c.model_cfg, tx, shared, c.updater.config.logprob_chunk)
    rng = np.random.default_rng(0)
    out = {}
    with activate(c.mesh):
        for name, (packed, view, share) in schedule_shapes(demos).items():
            idx = rng.choice(len(packed[0]), size=c.warmup.batch_size, replace=len(packed[0]) < c.warmup.batch_size)
            placed = place_batch(tuple(x[idx] for x in packed), c.mesh)
            params, state = c.params, tx.init(c.params)
            times = []
            for i in range(steps + 1):
                start = time.perf_counter()
                params, state, loss = step(params, state, *placed)
                float(loss)
                if i:
                    times.append(time.perf_counter() - start)
            out[name] = (statistics.median(times), view, share, list(placed[0].shape))
    print("schedule " + json.dumps(out))


def side_by_side(args) -> None:
    """``--baseline`` / ``--xla_flags``: the warm-up's schedule timed in alternated child processes, here
    (with the flags) against the other side (``REV``'s worktree, or this tree without the flags)."""
    from mtrl_jax.warmup import step_view  # this tree's (a child may import an older mtrl_jax, without it)

    w = get_config().warmup  # the schedule's views, counted with this tree's step_view (both trees draw them alike)
    views = collections.Counter(step_view(i, w.full_every, w.two_turn_every) for i in range(w.steps))

    def expected(child):  # {name: seconds a step} -> the warm-up's expected seconds
        return {name: views[view] * share for name, (_, view, share, _) in child.items()}

    def total(child):
        return sum(child[name][0] * n for name, n in expected(child).items())

    cache = tempfile.mkdtemp(prefix="bench_warmup_cache_")
    here_label = "this tree" + (f" with XLA_FLAGS {args.xla_flags}" if args.xla_flags else "")
    other = args.baseline or "without them"
    with (worktree(args.baseline) if args.baseline else contextlib.nullcontext(REPO)) as tree:
        runs = {here_label: [], other: []}
        for _ in range(args.rounds):
            for k, (side, root, flags) in enumerate(((here_label, REPO, args.xla_flags), (other, tree, ""))):
                env = {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{REPO / 'scripts'}"}
                if flags:  # after the caller's own XLA_FLAGS: XLA takes the last value of a flag
                    env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
                done = subprocess.run([sys.executable, __file__, "--child", "--steps", str(args.steps), "--cache", f"{cache}/{k}"],
                                      cwd=root, env=env, capture_output=True, text=True)
                lines = [line for line in done.stdout.splitlines() if line.startswith("schedule ")]
                if done.returncode or not lines:
                    raise RuntimeError(f"the {side} child failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
                runs[side].append(json.loads(lines[-1][len("schedule "):]))
                print(f"  {side}, round {len(runs[side])}: expected warm-up {total(runs[side][-1]):.1f} s", flush=True)
    ours, theirs = runs[here_label], runs[other]
    print(f"warm-up step by batch shape, medians of {args.rounds} alternated children ({args.steps} steps each):")
    for name, n in expected(ours[0]).items():
        a = statistics.median(child[name][0] for child in ours)
        b = statistics.median(child[name][0] for child in theirs)
        print(f"  {name:>16} {str(ours[0][name][3]):>10}, {n:7.1f} steps: {a * 1e3:6.1f} ms vs "
              f"{b * 1e3:6.1f} ms ({other}): {b / a:.2f}x")
    here, there = [total(child) for child in ours], [total(child) for child in theirs]
    a, b = statistics.median(here), statistics.median(there)
    print(f"expected warm-up ({w.steps} steps): {a:.0f} s here vs {b:.0f} s ({other}): {b / a:.2f}x faster "
          f"(per child: {', '.join(f'{t:.0f}' for t in here)} vs {', '.join(f'{t:.0f}' for t in there)} s)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--baseline", default="", help="a git revision: time the warm-up's schedule here and there")
    parser.add_argument("--xla_flags", default="", help="time the warm-up's schedule with these flags added to XLA_FLAGS "
                        "against without them (this tree, or --baseline)")
    parser.add_argument("--rounds", type=int, default=3, help="alternated child processes per side (--baseline, --xla_flags)")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return schedule_child(args.steps, args.cache)
    if args.baseline or args.xla_flags:
        return side_by_side(args)

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
