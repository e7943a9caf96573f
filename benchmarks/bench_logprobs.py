"""Peak memory and time of chunked vs dense token log-probs (value and gradient).

    python -m benchmarks.bench_logprobs                      # vocab 151,936, B*T = 8,192
    python -m benchmarks.bench_logprobs --tokens 2048 --hidden 256   # quicker

Peak memory is XLA's compiled plan for the jitted value-and-grad (arguments + outputs +
temporaries), the number that decides whether a step fits on an accelerator.
"""

import argparse
import time

import jax
import jax.numpy as jnp

from benchmarks.common import machine_line
from mtrl_jax.rl.logprobs import token_logprobs, token_logprobs_dense


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--tokens", type=int, default=8_192, help="B*T")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--chunk", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    print(machine_line(), flush=True)
    B, T = args.batch, args.tokens // args.batch
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    hidden = jax.random.normal(k[0], (B, T, args.hidden), jnp.float32)
    head = jax.random.normal(k[1], (args.hidden, args.vocab), jnp.float32) * 0.02
    targets = jax.random.randint(k[2], (B, T), 0, args.vocab)

    def build(fn):
        def loss(h, w):
            logp, entropy = fn(h, w, targets, 1.0)
            return logp.sum() + 0.01 * entropy.sum()

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))

    results = {}
    for name, fn in [
        ("dense", token_logprobs_dense),
        ("chunked", lambda *a: token_logprobs(*a, chunk_size=args.chunk)),
    ]:
        step = build(fn)
        mem = step.lower(hidden, head).compile().memory_analysis()
        peak = mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes
        jax.block_until_ready(step(hidden, head))  # compile + cold-start
        start = time.perf_counter()
        for _ in range(args.repeats):
            jax.block_until_ready(step(hidden, head))
        seconds = (time.perf_counter() - start) / args.repeats
        results[name] = (peak, seconds)
        print(f"{name:8s} peak {peak / 2**30:7.2f} GiB   value+grad {seconds:7.2f} s")
    (pd, td), (pc, tc) = results["dense"], results["chunked"]
    print(f"vocab={args.vocab} B*T={B * T} hidden={args.hidden} chunk={args.chunk} backend={jax.default_backend()}")
    print(f"chunked/dense: memory {pc / pd:.3f} (1/{pd / pc:.1f}), time {tc / td:.2f}x")


if __name__ == "__main__":
    main()
