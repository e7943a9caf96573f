"""Greedy decode throughput of the sampler against HF ``generate`` and a minimal ``lax.scan`` decoder.

    python -m benchmarks.bench_generate                        # tiny (batch 32) and 30m (batch 8), 3 repeats
    python -m benchmarks.bench_generate --configs tiny --repeats 5

Per config (``tiny``: the embedded default's policy; ``30m``: a 30M Qwen3, 4 layers, hidden 512,
vocabulary 32k), prompts of ``--prompt`` random tokens, ``--new`` greedy tokens, one run each per
repeat, alternated, medians:

* **sampler**: ``mtrl_jax.rollout.sampler`` (prefill by ``extend``, then one ``decode`` call: the
  on-device loop with stop tokens, budgets, behaviour log-probs and a cache window);
* **minimal**: a bare greedy decoder written below, ``lax.scan`` over the project's ``forward``
  (its layers' parameters sliced once before the loop, ``unstack_layers``, as the sampler does)
  with a KV cache of exactly prompt + new slots, nothing else: the stand-in for what the hardware
  allows with this model code;
* **HF**: transformers' ``generate`` (torch, float32, greedy, KV cache) on the same weights
  exported with ``save_hf_checkpoint``; skipped with a message when torch/transformers are absent.

The three must produce the same tokens (printed). Then, on ``tiny``:

* **collector-shaped**: the same sampler as the collector drives it (a 512-slot cache, 48-token
  decode calls, outputs fetched after each call) against the raw sampler above;
* **no cache**: the same greedy tokens with a full forward over the padded sequence per token;
* **capacity**: per-token decode time with ``--held`` tokens per row at 128, 512 and 2,048 cache
  slots, the sampler (a window just above the tokens held) against attending to every slot.
"""

from __future__ import annotations

if (
    __name__ == "__main__"
):  # first: the host allocator (glibc reads its tunables when the process starts; mtrl_jax/host.py)
    from mtrl_jax.host import prepare_process

    prepare_process()

import argparse
import functools
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import alternate, import_torch, machine_line, model_config
from mtrl_jax.model import ModelConfig, compute_logits, init_params
from mtrl_jax.model.hf_io import save_hf_checkpoint
from mtrl_jax.model.transformer import Transformer, forward, init_cache, logits_from_hidden, unstack_layers
from mtrl_jax.rollout import sampler as S
from mtrl_jax.rollout.engine import Sampler

BATCH = {"tiny": 32, "30m": 8}


@functools.partial(jax.jit, static_argnums=(0, 3))
def minimal_decoder(cfg: ModelConfig, params, prompts, new: int):
    """Greedy: prefill the prompts, then ``new`` steps of one token each, in a ``lax.scan``."""
    B, P = prompts.shape
    params = unstack_layers(params)  # each layer's arrays, sliced once, as the sampler's decode does
    cache = init_cache(cfg, B, P + new)
    hidden, cache = forward(cfg, params, prompts, None, cache, jnp.zeros(B, jnp.int32))
    first = jnp.argmax(logits_from_hidden(cfg, params, hidden[:, -1]), axis=-1).astype(jnp.int32)

    def step(carry, i):
        token, cache = carry
        hidden, cache = forward(cfg, params, token[:, None], None, cache, jnp.full(B, P, jnp.int32) + i)
        return (jnp.argmax(logits_from_hidden(cfg, params, hidden[:, 0]), axis=-1).astype(jnp.int32), cache), token

    _, tokens = jax.lax.scan(step, (first, cache), jnp.arange(new))
    return tokens.T


def greedy_rows(B: int, new: int):
    """Sampler row arguments for greedy decoding of ``new`` tokens with no stop token."""
    return (
        np.zeros(B, np.float32),
        np.ones(B, np.float32),
        np.full((B, 1), -1, np.int32),
        np.ones(B, bool),
        np.full(B, new, np.int32),
    )


def sides(cfg: ModelConfig, params, prompts: np.ndarray, new: int, torch, transformers) -> dict:
    B, P = prompts.shape
    smp = Sampler(cfg, slots=B, max_len=P + new, max_new_tokens=new)
    keys = jax.random.split(jax.random.PRNGKey(0), B)
    rows = greedy_rows(B, new)

    def sampler():
        state, _ = smp.extend(params, smp.init(), [list(p) for p in prompts])
        return np.asarray(smp.decode(params, state, keys, *rows)[1].tokens)

    def minimal():
        return np.asarray(minimal_decoder(cfg, params, jnp.asarray(prompts), new))

    out = {"sampler": sampler, "minimal": minimal}
    if torch is not None:
        directory = tempfile.mkdtemp(prefix="bench_generate_hf_")
        save_hf_checkpoint(Transformer(cfg), params, directory)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None
        model.generation_config.pad_token_id = 0
        ids = torch.from_numpy(prompts.astype(np.int64))

        def hf():
            with torch.no_grad():
                result = model.generate(
                    input_ids=ids,
                    attention_mask=torch.ones_like(ids),
                    max_new_tokens=new,
                    min_new_tokens=new,
                    do_sample=False,
                )
            return result[:, P:].numpy()

        out["HF generate"] = hf
    return out


def collector_shaped(cfg: ModelConfig, params, prompts: np.ndarray, new: int, chunk: int = 48, max_len: int = 512):
    """The sampler driven as the collector drives it: 512 slots, ``chunk``-token calls, outputs fetched."""
    B = prompts.shape[0]
    smp = Sampler(cfg, slots=B, max_len=max_len, max_new_tokens=chunk)
    keys = jax.random.split(jax.random.PRNGKey(0), B)

    def run():
        state, _ = smp.extend(params, smp.init(), [list(p) for p in prompts])
        done, pieces = 0, []
        while done < new:
            budget = min(chunk, new - done)
            state, out = smp.decode(params, state, keys, *greedy_rows(B, budget)[:4], np.full(B, budget, np.int32))
            tokens, num = jax.device_get((out.tokens, out.num_tokens))
            pieces.append(tokens[:, :budget])
            done += int(num.min())
        return np.concatenate(pieces, axis=1)

    return run


def no_cache(cfg: ModelConfig, params, prompts: np.ndarray, new: int):
    full = jax.jit(lambda t: compute_logits(Transformer(cfg), params, t))
    B, P = prompts.shape

    def run():
        tokens = np.zeros((B, P + new), np.int32)
        tokens[:, :P] = prompts
        for i in range(new):
            logits = full(tokens)  # causal: positions past the current one do not matter
            tokens[:, P + i] = np.asarray(jnp.argmax(logits[:, P + i - 1], -1))
        return tokens[:, P:]

    return run


def capacity(cfg: ModelConfig, params, B: int, held: int, repeats: int, capacities=(128, 512, 2048), new=32):
    """Per-token decode ms with ``held`` tokens per row, by cache capacity, windowed vs all slots."""
    rng = np.random.default_rng(1)
    prompts = [list(rng.integers(0, cfg.vocab_size, size=held)) for _ in range(B)]
    rows = greedy_rows(B, new)
    samplers = {c: Sampler(cfg, slots=B, max_len=c, max_new_tokens=new) for c in capacities}
    states = {c: samplers[c].extend(params, samplers[c].init(), prompts)[0] for c in capacities}
    keys = jax.random.split(jax.random.PRNGKey(0), B)
    decode = jax.jit(
        functools.partial(S.decode, cfg), static_argnames=("max_new_tokens", "window"), donate_argnums=(1,)
    )

    def one(c, windowed):
        smp = samplers[c]
        state = jax.block_until_ready(
            jax.tree.map(jnp.copy, states[c])
        )  # decode donates its state; copied before the clock starts
        window = smp.window(state, rows[3], new) if windowed else c
        start = time.perf_counter()
        jax.block_until_ready(decode(params, state, S.DecodeRows(keys, *rows), max_new_tokens=new, window=window))
        return (time.perf_counter() - start) / new * 1e3

    times = {(c, w): [] for c in capacities for w in (True, False)}
    for key in times:
        one(*key)  # compile
    for _ in range(repeats):
        for key in times:  # alternated
            times[key].append(one(*key))
    med = {k: float(np.median(v)) for k, v in times.items()}
    print(f"per-token decode ms, batch {B}, {held} tokens held, medians of {repeats}:")
    print("capacity | sampler (window) | all slots")
    for c in capacities:
        print(f"{c:8d} | {med[(c, True)]:16.2f} | {med[(c, False)]:9.2f}")
    lo, hi = capacities[0], capacities[-1]
    print(
        f"{hi} / {lo} slots: sampler {med[(hi, True)] / med[(lo, True)]:.2f}x, "
        f"all slots {med[(hi, False)] / med[(lo, False)]:.2f}x"
    )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,30m")
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--held", type=int, default=64, help="tokens held per row in the capacity comparison")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    print(machine_line(), flush=True)
    torch, transformers = import_torch("the HF generate side")
    for name in args.configs.split(","):
        B, cfg = BATCH[name], model_config(name)
        params = init_params(cfg, jax.random.PRNGKey(0))
        prompts = np.random.default_rng(0).integers(0, cfg.vocab_size, size=(B, args.prompt)).astype(np.int32)
        fns = sides(cfg, params, prompts, args.new, torch, transformers)
        seconds, outputs = alternate(fns, args.repeats)
        rate = {k: B * args.new / s for k, s in seconds.items()}
        same = {k: bool(np.array_equal(outputs["sampler"], v)) for k, v in outputs.items() if k != "sampler"}
        print(
            f"\n{name}: batch {B}, prompt {args.prompt} + {args.new} greedy tokens, medians of {args.repeats} "
            f"(identical tokens to the sampler: {same})"
        )
        for k, r in rate.items():
            print(f"  {k:12s} {r:9,.0f} tokens/s")
        print(
            "  sampler / "
            + ", sampler / ".join(f"{k} {rate['sampler'] / r:.2f}x" for k, r in rate.items() if k != "sampler")
        )
        if name != "tiny":
            continue
        shaped = {
            "raw sampler": fns["sampler"],
            "collector-shaped": collector_shaped(cfg, params, prompts, args.new),
            "no cache": no_cache(cfg, params, prompts, args.new),
        }
        seconds, outputs = alternate(shaped, args.repeats)
        rate = {k: B * args.new / s for k, s in seconds.items()}
        print(
            f"  collector-shaped (512 slots, 48-token calls) {rate['collector-shaped']:,.0f} tokens/s vs raw sampler "
            f"{rate['raw sampler']:,.0f}: {rate['collector-shaped'] / rate['raw sampler']:.2f}x "
            f"(same tokens: {bool(np.array_equal(outputs['collector-shaped'], outputs['raw sampler']))})"
        )
        print(
            f"  no cache {rate['no cache']:,.0f} tokens/s: "
            f"the sampler is {rate['raw sampler'] / rate['no cache']:.1f}x "
            f"(same tokens: {bool(np.array_equal(outputs['no cache'], outputs['raw sampler']))})\n"
        )
        # short calls: more of them, against this machine's noise
        capacity(cfg, params, B, args.held, max(3 * args.repeats, 15))


if __name__ == "__main__":
    main()
