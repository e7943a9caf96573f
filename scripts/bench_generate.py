"""Decode throughput of the KV-cache sampler at batch 32 on a small Qwen3 config.

    python scripts/bench_generate.py

Baseline, measured side by side: the same greedy tokens produced without a cache (one full
forward over the whole padded sequence per new token), the way a naive loop would.
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


if __name__ == "__main__":
    main()
