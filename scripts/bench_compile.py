"""The compile work of the embedded default's RL programs, with and without the lengths no call can
take left out (``setup.shortest_prompt``).

    python scripts/bench_compile.py                # 2 alternated rounds

Builds `configs/default.py` and compiles, as a first run does (persistent compilation cache off):

* **the update** for the default's batch shape (`Updater.warm`: global_batch_size x group_size rows
  of `batch_length` tokens, with the KL reference), one `lax.switch` branch per length bucket;
* **the sampler's programs** for the RL step's collector (`Collector.precompile`: every extend
  shape, every decode window, prefix sharing).

Side "all lengths" sets `UpdateConfig.min_length` and `CollectorConfig.min_prompt` to 0 (the
behaviour before them); side "from the shortest prompt" keeps what `build` measured. The sides
alternate, `--repeats` rounds; the script prints each side's programs (branches), its median compile
wall time and CPU time (all threads of this process: XLA compiles on several), and the ratios.
"""

from __future__ import annotations

import argparse
import dataclasses
import pathlib
import statistics
import tempfile
import time

import jax

from configs.default import get_config
from mtrl_jax.rl.train_step import Updater, length_buckets
from mtrl_jax.rollout.collector import Collector, fitted_slots
from mtrl_jax.setup import build


def timed(fn) -> tuple[float, float]:
    """``fn()``'s wall and CPU seconds (every thread of the process), JAX's in-memory caches cleared
    first (a program compiled before would be served from them)."""
    jax.clear_caches()
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()

    config = get_config()
    config.unlock()
    config.compilation_cache_dir = ""
    jax.config.update("jax_enable_compilation_cache", False)  # every program compiled here, none loaded
    c = build(config, pathlib.Path(tempfile.mkdtemp(prefix="bench_compile_")))
    run = c.run
    rows = run.global_batch_size * run.group_size
    shortest = c.updater.config.min_length
    print(f"default: shortest prompt {shortest} tokens (setup.shortest_prompt); update batch {rows} x {run.batch_length}, "
          f"length_bucket {c.updater.config.length_bucket}; sampler {fitted_slots(c.collector, rows).slots} slots x "
          f"{c.collector.max_len}")

    def update_side(min_length):
        updater = Updater(c.model_cfg, dataclasses.replace(c.updater.config, min_length=min_length), c.tx, c.mesh)
        state = updater.init_state(c.params, jax.random.PRNGKey(0))
        branches = len(length_buckets(run.batch_length, updater.config.length_bucket, shortest=min_length))
        return branches, lambda: updater.warm(state, rows, run.batch_length, run.group_size, True).join()

    def sampler_side(min_prompt):
        collector = Collector(c.model_cfg, c.chat, c.env, fitted_slots(dataclasses.replace(c.collector, min_prompt=min_prompt), rows),
                              lambda: (c.params, 0), c.mesh)
        extend_shapes, decode_windows = collector.sampler.call_shapes()

        def compile_all():
            collector.sampler._programs.clear()  # shared by the samplers of one model: compile them all again
            collector.precompile(c.params)
        return (len(extend_shapes), len(decode_windows)), compile_all

    sides = {"all lengths": 0, "from the shortest prompt": shortest}
    times = {(part, side): [] for part in ("update", "sampler") for side in sides}
    shapes = {}
    for _ in range(args.repeats):
        for side, floor in sides.items():
            branches, compile_update = update_side(floor)
            shapes["update", side] = f"{branches} branches"
            times["update", side].append(timed(compile_update))
            (extends, decodes), compile_sampler = sampler_side(floor)
            shapes["sampler", side] = f"{extends} extend + {decodes} decode shapes"
            times["sampler", side].append(timed(compile_sampler))
    for part in ("update", "sampler"):
        medians = {}
        for side in sides:
            wall = statistics.median(t[0] for t in times[part, side])
            cpu = statistics.median(t[1] for t in times[part, side])
            medians[side] = wall, cpu
            print(f"{part}, {side}: {shapes[part, side]}; compile {wall:.1f} s wall, {cpu:.1f} s CPU")
        (w0, c0), (w1, c1) = medians.values()
        print(f"{part}: {w0 / w1:.2f}x less wall time, {c0 / c1:.2f}x less CPU time from the shortest prompt")


if __name__ == "__main__":
    main()
