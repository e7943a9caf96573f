"""The host allocator policy (``mtrl_jax/host.py``) against its thresholds alone and glibc's defaults, side by side.

    python scripts/bench_host.py               # 5 rounds
    python scripts/bench_host.py --rounds 3

The policy is set per process (``mallopt`` at import, ``GLIBC_TUNABLES`` at the start), so each side
runs in its own child process, the three alternated ``--rounds`` times: **tuned** (the thresholds and
``glibc.malloc.hugetlb=1``, what the entry points run with), **thresholds** (the thresholds alone:
``glibc.malloc.hugetlb=0``) and **default** (``MTRL_JAX_MALLOC=default``: glibc's own policy). Each
child times, after a warm-up call each (medians of ``--repeats`` calls):

* **decode 48 tokens**: one sampler decode call as the collector makes it (32 rows, a 512-slot
  cache, 48 tokens, the default tiny policy);
* **decode 1 token, 2,048 slots**: the fixed cost of a call (the per-layer working copies of the
  window and their write-back into the cache), where a large cache shows it most;
* **update**: the tiny policy's jitted update on B32 x T384 (``bench_train_step.py``'s mtrl-jax side);
* **copy 64 MiB**: ``jnp.copy`` of a 64 MiB array (a fresh output buffer, nothing else).

The script prints the median of each measure on each side over the rounds, the ratios thresholds /
tuned and default / tuned (above 1: the tuned policy is faster), and the page faults of one update
call. Only the CPU backend is measured.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

MEASURES = ("decode 48 tokens", "decode 1 token, 2,048 slots", "update", "copy 64 MiB")
SIDES = {"tuned": {"MTRL_JAX_MALLOC": "tuned", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=1"},
         "thresholds": {"MTRL_JAX_MALLOC": "tuned", "GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"},
         "default": {"MTRL_JAX_MALLOC": "default"}}


def child(repeats: int) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from bench_common import model_config
    from bench_train_step import BATCH, make_batch, project_side
    from mtrl_jax import host
    from mtrl_jax.model import init_params
    from mtrl_jax.rollout import sampler as S

    def median_ms(fn, prepare=lambda: None) -> float:
        times = []
        for i in range(repeats + 1):
            args = prepare()
            start = time.perf_counter()
            fn(args)
            if i:
                times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    cfg = model_config("tiny")
    params = init_params(cfg, jax.random.PRNGKey(0))
    B, rng = 32, np.random.default_rng(1)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=int(n))) for n in rng.integers(100, 180, size=B)]
    keys = jax.random.split(jax.random.PRNGKey(0), B)
    out = {"policy": host.applied}

    def decode_ms(max_len: int, new: int, held) -> float:
        smp = S.Sampler(cfg, slots=B, max_len=max_len, max_new_tokens=new)
        base = smp.extend(params, smp.init(), held)
        rows = (np.ones(B, np.float32), np.ones(B, np.float32), np.full((B, 1), -1, np.int32), np.ones(B, bool),
                np.full(B, new, np.int32))

        def prepare():
            return jax.block_until_ready(jax.tree.map(jnp.copy, base))  # decode donates its state

        return median_ms(lambda state: jax.block_until_ready(smp.decode(params, state, keys, *rows)), prepare)

    out["decode 48 tokens"] = decode_ms(512, 48, prompts)
    out["decode 1 token, 2,048 slots"] = decode_ms(2048, 1, [p[:64] for p in prompts])
    _, step = project_side(cfg, make_batch(cfg, *BATCH["tiny"]))
    out["update"] = median_ms(lambda _: step())
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    step()
    out["update page faults"] = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    big = jnp.ones((16 << 20,), jnp.float32)
    out["copy 64 MiB"] = median_ms(lambda _: jax.block_until_ready(jnp.copy(big)))
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--repeats", type=int, default=5, help="timed calls per measure in each child")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args.repeats)))
        return
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([here, os.path.dirname(here), os.environ.get("PYTHONPATH", "")]))
    env.pop("GLIBC_TUNABLES", None)
    results = {side: [] for side in SIDES}
    for r in range(args.rounds):
        for side in results:
            run = subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--repeats", str(args.repeats)],
                                 env=dict(env, **SIDES[side]), capture_output=True, text=True, check=False)
            if run.returncode != 0:
                raise SystemExit(f"the {side} child failed (exit {run.returncode}):\n{run.stderr[-3000:]}")
            results[side].append(json.loads(run.stdout.strip().splitlines()[-1]))
            row = ", ".join(f"{m} {results[side][-1][m]:.2f}" for m in MEASURES)
            print(f"round {r + 1} {side:10s} (ms): {row}; update page faults {results[side][-1]['update page faults']}",
                  flush=True)
    print(f"\nmedians of {args.rounds} alternated rounds (ms); tuned = {results['tuned'][0]['policy']}, "
          f"thresholds = {results['thresholds'][0]['policy']}, default = glibc's own policy")
    print(f"{'measure':30s} | {'tuned':>9s} | {'thresholds':>10s} | {'default':>9s} | thresholds / tuned | "
          f"default / tuned")
    for m in MEASURES + ("update page faults",):
        tuned, thresholds, default = (statistics.median(x[m] for x in results[side]) for side in SIDES)
        ratios = f"{thresholds / tuned:17.2f}x | {default / tuned:.2f}x" if m in MEASURES else ""
        print(f"{m:30s} | {tuned:9.2f} | {thresholds:10.2f} | {default:9.2f} | {ratios}")


if __name__ == "__main__":
    main()
