"""Decode throughput of the KV-cache sampler at batch 32 on a small Qwen3 config.

    python scripts/bench_generate.py

Baseline, measured side by side: the same greedy tokens produced without a cache (one full
forward over the whole padded sequence per new token), the way a naive loop would.

Then the per-token decode time with ``--held`` tokens in every row, at cache capacities of 128,
512 and 2,048 slots: the sampler (attention over a window just above the tokens held) against the
same decode attending to every slot of the cache, alternated, medians of ``--repeats``.
"""

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from mtrl_jax.model import ModelConfig, compute_logits, init_params
from mtrl_jax.model.transformer import Transformer
from mtrl_jax.rollout import sampler as S


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=64)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--held", type=int, default=64, help="tokens held per row in the capacity comparison")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    cfg = ModelConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=3 * args.hidden,
                      num_layers=args.layers, num_heads=8, num_kv_heads=2, head_dim=args.hidden // 8,
                      model_type="qwen3", qk_norm=True, tie_word_embeddings=True)
    params = init_params(cfg, jax.random.PRNGKey(0))
    rng = np.random.default_rng(0)
    prompts = [list(rng.integers(0, args.vocab, size=args.prompt)) for _ in range(args.batch)]
    max_len = args.prompt + args.new
    smp = S.Sampler(cfg, slots=args.batch, max_len=max_len, max_new_tokens=args.new)
    greedy = np.zeros(args.batch, np.float32)

    def cached():
        state = smp.extend(params, smp.init(), prompts)
        return smp.decode(params, state, jax.random.PRNGKey(0), greedy, np.ones(args.batch), [[-1]] * args.batch,
                          [True] * args.batch)[1].tokens

    full = jax.jit(lambda t: compute_logits(Transformer(cfg), params, t))

    def uncached():
        tokens = np.zeros((args.batch, max_len), np.int32)
        tokens[:, :args.prompt] = np.array(prompts)
        for i in range(args.new):
            logits = full(tokens)  # causal: positions past the current one do not matter
            tokens[:, args.prompt + i] = np.asarray(jnp.argmax(logits[:, args.prompt + i - 1], -1))
        return tokens[:, args.prompt:]

    rates = {}
    for name, fn in [("kv-cache decode", cached), ("no-cache baseline", uncached)]:
        out = jax.block_until_ready(fn())  # compile
        start = time.perf_counter()
        out = np.asarray(jax.block_until_ready(fn()))
        seconds = time.perf_counter() - start
        rates[name] = args.batch * args.new / seconds
        print(f"{name:18s} {rates[name]:9.1f} tokens/s")
        rates[name + "/tokens"] = out
    same = np.array_equal(rates["kv-cache decode/tokens"], rates["no-cache baseline/tokens"])
    print(f"batch={args.batch} prompt={args.prompt} new={args.new} layers={args.layers} hidden={args.hidden} "
          f"vocab={args.vocab} backend={jax.default_backend()} identical greedy tokens: {same}")
    print(f"kv-cache / no-cache throughput: {rates['kv-cache decode'] / rates['no-cache baseline']:.1f}x")
    capacity(args, cfg, params)


def capacity(args, cfg, params, capacities=(128, 512, 2048), new=32):
    """Per-token decode ms with ``args.held`` tokens per row, by cache capacity, windowed vs all slots."""
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, args.vocab, size=args.held)) for _ in range(args.batch)]
    B = args.batch
    rows = (np.zeros(B, np.float32), np.ones(B, np.float32), np.full((B, 1), -1, np.int32), np.ones(B, bool),
            np.full(B, new, np.int32))
    samplers = {c: S.Sampler(cfg, slots=B, max_len=c, max_new_tokens=new) for c in capacities}
    states = {c: samplers[c].extend(params, samplers[c].init(), prompts) for c in capacities}
    keys = jax.random.split(jax.random.PRNGKey(0), B)

    def one(c, windowed):
        smp = samplers[c]
        state = jax.tree.map(jnp.copy, states[c])  # decode donates its state
        window = smp.window(state, rows[3], new) if windowed else c
        start = time.perf_counter()
        jax.block_until_ready(smp._decode(params, state, keys, *rows, max_new_tokens=new, window=window))
        return (time.perf_counter() - start) / new * 1e3

    times = {(c, w): [] for c in capacities for w in (True, False)}
    for key in times:
        one(*key)  # compile
    for _ in range(args.repeats):
        for key in times:  # alternated
            times[key].append(one(*key))
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"\nper-token decode ms, batch {B}, {args.held} tokens held, medians of {args.repeats}:")
    print("capacity | sampler (window) | all slots")
    for c in capacities:
        print(f"{c:8d} | {med[(c, True)]:16.2f} | {med[(c, False)]:9.2f}")
    lo, hi = capacities[0], capacities[-1]
    print(f"{hi} / {lo} slots: sampler {med[(hi, True)] / med[(lo, True)]:.2f}x, all slots {med[(hi, False)] / med[(lo, False)]:.2f}x")


if __name__ == "__main__":
    main()
