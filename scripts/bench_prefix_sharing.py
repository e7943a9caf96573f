"""Prefix sharing in the sampler against computing every prompt token: the collector on a run's own
episodes, the two settings alternated.

    python scripts/bench_prefix_sharing.py                                  # the default (tiny policy, random weights)
    python scripts/bench_prefix_sharing.py --checkpoint=workdirs/default    # the default's trained policy
    python scripts/bench_prefix_sharing.py --config=configs/real_cpu.py \\
        --config.model.checkpoint=models/smollm2-135m-instruct --config.data.max_eval_tasks=16 --repeats=1

Two workloads of ``--config`` (any ``--config.key=value`` override applies), each run with
``rollout.share_prefixes`` on and off by two collectors on the same parameters, ``--repeats`` times,
alternated, after each compiled every shape a call can take (as the trainer does at its start:
``rollout.precompile``; with tool workers the calls' shapes vary from run to run) and ran once:

* **RL step**: the episodes of the first RL step (``global_batch_size`` training tasks x
  ``rollout.group_size`` samples at the rollout temperature), with the trainer's slots and tool workers;
* **evaluation**: the held-out tasks, greedy, with the evaluation job's slots and inline tools.

Prints per workload the median seconds, the tokens extend computed (real, padding excluded) and
the share copied from a cached prefix instead, the ratio of the medians, and whether the two
settings gave the same episodes token for token (the shared keys and values are those computing
gives, up to float rounding; a sampled token could in principle differ).
"""

from __future__ import annotations

import dataclasses
import pathlib
import statistics
import tempfile
import time

import jax
from absl import app, flags
from ml_collections import config_flags

from mtrl_jax.evaluate import eval_rows, restore_params
from mtrl_jax.rollout.collector import Collector, EpisodeRequest, fitted_slots
from mtrl_jax.rollout.staleness import PublishedParams
from mtrl_jax.setup import build

_CONFIG = config_flags.DEFINE_config_file("config", "configs/default.py", "ml_collections config file", lock_config=True)
_CHECKPOINT = flags.DEFINE_string("checkpoint", None, "a training work directory: its latest checkpoint's policy")
_REPEATS = flags.DEFINE_integer("repeats", 3, "timed runs per setting, alternated")


def measure(name: str, collectors: dict, requests: list, repeats: int, params) -> None:
    seconds, timings, outcomes = {k: [] for k in collectors}, {k: [] for k in collectors}, {}
    for collector in collectors.values():  # every shape a call can take, as the trainer does (rollout.precompile)
        collector.precompile(params)
        collector.run(requests)
    for _ in range(repeats):
        for setting, collector in collectors.items():  # alternated
            start = time.perf_counter()
            outcomes[setting] = collector.run(requests)
            seconds[setting].append(time.perf_counter() - start)
            timings[setting].append(dict(collector.timings))
    med = {k: {key: statistics.median(t[key] for t in runs) for key in runs[0]} for k, runs in timings.items()}
    same = sum(a.tokens == b.tokens for a, b in zip(outcomes[True], outcomes[False]))
    print(f"{name}: {len(requests)} episodes, {collectors[True].config.slots} slots, medians of {repeats}")
    for setting, label in ((True, "shared prefixes"), (False, "every token computed")):
        t = med[setting]
        print(f"  {label:20s} {statistics.median(seconds[setting]):7.2f} s | extend {t['extend_s']:.2f} s in {t['extend_calls']:.0f} calls, "
              f"{t['extend_tokens']:,.0f} tokens computed, {t['extend_shared']:,.0f} shared ({t['extend_shared_fraction']:.0%} of the "
              f"tokens appended); decode {t['decode_s']:.2f} s in {t['decode_calls']:.0f} calls; tool waits {t['tool_wait_s']:.2f} s")
    ratio = statistics.median(seconds[False]) / statistics.median(seconds[True])
    print(f"  every token computed / shared prefixes: {ratio:.2f}x the time, {med[False]['extend_s'] / med[True]['extend_s']:.2f}x "
          f"extend's time, {med[False]['extend_tokens'] / max(med[True]['extend_tokens'], 1):.2f}x the tokens it computes; "
          f"{same} of {len(requests)} episodes token for token the same")


def main(argv):
    if len(argv) > 1:
        raise app.UsageError(f"unexpected arguments: {argv[1:]}")
    config = _CONFIG.value
    if _CHECKPOINT.value:
        components = build(config, pathlib.Path(_CHECKPOINT.value), train_tokenizer_if_missing=False)
        params = restore_params(pathlib.Path(_CHECKPOINT.value), components)
    else:
        components = build(config, pathlib.Path(tempfile.mkdtemp(prefix="bench_prefix_sharing_")))
        params = components.params
    source = PublishedParams(params, 0)
    run = components.run
    G = run.group_size
    tasks = components.train_tasks[:run.global_batch_size]
    key = jax.random.PRNGKey(config.seed)
    step = [EpisodeRequest(t, p, g, jax.random.fold_in(key, p * G + g)) for p, t in enumerate(tasks) for g in range(G)]
    held_out = [EpisodeRequest(t, i, 0, jax.random.fold_in(key, 10_000 + i)) for i, t in enumerate(components.val_tasks)]

    def collectors(cfg):
        return {share: Collector(components.model_cfg, components.chat, components.env, dataclasses.replace(cfg, share_prefixes=share),
                                 source, components.rollout_mesh) for share in (True, False)}

    step_cfg = fitted_slots(components.collector, len(step))
    eval_cfg = dataclasses.replace(fitted_slots(components.collector, *eval_rows(components)),
                                   temperature=max(config.eval.temperature, 0.0), tool_workers=0)
    for name, cfg, requests in (("RL step", step_cfg, step), ("evaluation", eval_cfg, held_out)):
        pair = collectors(cfg)
        measure(name, pair, requests, _REPEATS.value, params)
        for collector in pair.values():
            collector.close()


if __name__ == "__main__":
    app.run(main)
