"""The compile work a first run of the embedded default does, before and after the changes that cut it.

    python scripts/bench_compile.py                # 1 round (about 8 minutes on 2 cores)

Builds `configs/default.py` and compiles what a first run compiles (persistent compilation cache off,
JAX's in-memory caches cleared before each compile), side by side:

* **update**: the RL update for the default's batch shape (`Updater.warm`: global_batch_size x
  group_size rows of `batch_length` tokens, with the KL reference), one `lax.switch` branch per
  length bucket;
* **sampler**: the RL collector's programs (`Collector.precompile`: every extend shape, every decode
  window, prefix sharing);
* **warm-up**: the warm-up step (`warmup.warmup_step`) at every shape the default's warm-up trains on:
  the demonstrations cut after their first turn, and each length group of whole demonstrations.

Sides: **before**: no lengths left out (`UpdateConfig.min_length` = `CollectorConfig.min_prompt` = 0)
and `model.attention_chunk` 128, the default until 5341253; **shortest prompt**: the lengths below
`setup.shortest_prompt` left out, chunk 128; **now**: the default (both). The sides alternate,
`--repeats` rounds; the script prints each side's programs, median compile wall and CPU time (all
threads of this process: XLA compiles on several), and the run time of the compiled update and
whole-demonstration warm-up step (the median of `--runs` calls), then the ratios to "before".
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import tempfile
import time

import jax
import numpy as np

from bench_warmup import warmup_views
from configs.default import get_config
from mtrl_jax.model.sharding import activate, place_batch
from mtrl_jax.rl.batch import TrajectoryBatch
from mtrl_jax.rl.train_step import Updater, length_buckets
from mtrl_jax.rollout.collector import Collector, fitted_slots
from mtrl_jax.setup import build
from mtrl_jax.warmup import demonstrations, warmup_optimizer, warmup_step


def timed(fn) -> tuple[float, float]:
    """``fn()``'s wall and CPU seconds (every thread of the process), JAX's in-memory caches cleared
    first (a program compiled before would be served from them)."""
    jax.clear_caches()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def median_run(fn, runs: int) -> float:
    jax.block_until_ready(fn())  # the first call fetches the arguments
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--runs", type=int, default=3, help="calls of each compiled update / warm-up step timed")
    args = parser.parse_args()

    config = get_config()
    config.unlock()
    config.compilation_cache_dir = ""
    jax.config.update("jax_enable_compilation_cache", False)  # every program compiled here, none loaded
    c = build(config, pathlib.Path(tempfile.mkdtemp(prefix="bench_compile_")))
    run, mesh = c.run, c.mesh
    rows = run.global_batch_size * run.group_size
    shortest, chunk = c.updater.config.min_length, c.model_cfg.attention_chunk
    sides = {"before": (0, 128), "shortest prompt": (shortest, 128), "now": (shortest, chunk)}
    parts = {"update": list(sides), "sampler": ["before", "now"], "warm-up": ["before", "now"]}

    demos = demonstrations(c)
    shared, first, groups, whole = warmup_views(demos)
    P = len(shared)
    shapes = [first[0].shape[1] - P] + [g - P for g in groups]
    print(f"default: shortest prompt {shortest} tokens (setup.shortest_prompt), attention_chunk {chunk}; update "
          f"{rows} x {run.batch_length}, length_bucket {c.updater.config.length_bucket}; sampler "
          f"{fitted_slots(c.collector, rows).slots} slots x {c.collector.max_len}; warm-up {c.warmup.batch_size} rows x "
          f"{shapes} tokens after the {P}-token shared prefix")

    rng = np.random.default_rng(0)
    lens = rng.integers(120, 420, rows)  # the default's RL episodes hold 123-413 tokens
    attention = (np.arange(run.batch_length)[None] < lens[:, None]).astype(np.int32)
    loss_mask = (attention * (np.arange(run.batch_length)[None] > 90)).astype(np.float32)
    batch = TrajectoryBatch(rng.integers(1, 1000, attention.shape).astype(np.int32) * attention, attention, loss_mask,
                            -2.0 * loss_mask, rng.normal(size=rows).astype(np.float32), group_size=run.group_size)
    warm_rows = tuple(x[rng.choice(len(whole[0]), c.warmup.batch_size, replace=False), P:] for x in whole)
    tx = warmup_optimizer(c.warmup.steps, c.warmup.learning_rate)

    def update(side):
        floor, attention_chunk = sides[side]
        model_cfg = dataclasses.replace(c.model_cfg, attention_chunk=attention_chunk)
        updater = Updater(model_cfg, dataclasses.replace(c.updater.config, min_length=floor), c.tx, mesh)
        state = updater.init_state(c.params, jax.random.PRNGKey(0))
        programs = f"{len(length_buckets(run.batch_length, updater.config.length_bucket, shortest=floor))} branches"
        compile_ = lambda: updater.warm(state, rows, run.batch_length, run.group_size, True).join()  # noqa: E731
        # a fresh state per call: the update donates its optimizer state
        run_ = lambda: updater.update(updater.init_state(c.params, jax.random.PRNGKey(0)), batch, c.params)[1]["loss"]  # noqa: E731
        return programs, compile_, run_

    def sampler(side):
        collector = Collector(c.model_cfg, c.chat, c.env, fitted_slots(dataclasses.replace(c.collector, min_prompt=sides[side][0]), rows),
                              lambda: (c.params, 0), mesh)
        extends, decodes = map(len, collector.sampler.call_shapes())

        def compile_():
            collector.sampler._programs.clear()  # shared by the samplers of one model: compile them all again
            collector.precompile(c.params)
        return f"{extends} extend + {decodes} decode shapes", compile_, None

    def warm_up(side):
        model_cfg = dataclasses.replace(c.model_cfg, attention_chunk=sides[side][1])
        step = warmup_step(model_cfg, tx, shared, c.updater.config.logprob_chunk)
        opt_state = tx.init(c.params)
        blank = [tuple(np.zeros((c.warmup.batch_size, width), dtype) for dtype in (np.int32, np.int32, np.float32)) for width in shapes]

        def compile_():
            with activate(mesh):
                for arrays in blank:
                    step.lower(c.params, opt_state, *place_batch(arrays, mesh)).compile()

        def run_():
            with activate(mesh):
                return step(c.params, tx.init(c.params), *place_batch(warm_rows, mesh))[2]
        return f"{len(shapes)} programs", compile_, run_

    build_side = {"update": update, "sampler": sampler, "warm-up": warm_up}
    results = {(part, side): [] for part, names in parts.items() for side in names}
    programs = {}
    for _ in range(args.repeats):
        for part, names in parts.items():
            for side in names:
                programs[part, side], compile_, run_ = build_side[part](side)
                wall, cpu = timed(compile_)
                results[part, side].append((wall, cpu, median_run(run_, args.runs) if run_ else float("nan")))
    for part, names in parts.items():
        med = {side: [statistics.median(r[i] for r in results[part, side]) for i in range(3)] for side in names}
        base = med["before"]
        for side in names:
            wall, cpu, step = med[side]
            ran = "" if np.isnan(step) else f"; runs in {step:.2f} s ({base[2] / step:.2f}x)"
            print(f"{part:>8}, {side:>15}: {programs[part, side]}; compile {wall:6.1f} s wall, {cpu:6.1f} s CPU "
                  f"({base[1] / cpu:.2f}x less CPU than before){ran}")


if __name__ == "__main__":
    main()
