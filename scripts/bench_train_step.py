"""The policy update against HF transformers + torch on the same CPU, same weights, same batch.

    python scripts/bench_train_step.py                 # both configs, 5 alternated repeats
    python scripts/bench_train_step.py --configs tiny --repeats 3

For each config (``tiny``: the embedded default's policy, B32 x T384; ``30m``: a 30M Qwen3, 4
layers, hidden 512, vocabulary 32k, B8 x T512) one optimizer step on a batch of full rows:

* **mtrl-jax**: the jitted update of ``mtrl_jax.rl.train_step`` (advantages, token log-probs and
  entropy, the PPO loss, backward, gradient clipping, Adam), in the configuration the README
  recommends for CPU (float32, no remat, layers unrolled, chunked causal attention, the
  log-probs in one chunk so the logits are held rather than recomputed);
* **HF**: the same weights exported with ``save_hf_checkpoint`` and loaded by transformers'
  ``Qwen3ForCausalLM`` (torch, float32, its default SDPA attention): forward, log-softmax gather,
  the same PPO loss (asymmetric and dual clip, token mean), backward, gradient clipping, AdamW.

The two alternate, ``--repeats`` times, after a warm-up call each; the script prints the median
tokens/s of each, the ratio, and each side's share of the float32 matmul peak measured in the same
run (the faster of a 2048^3 ``jnp.dot`` and ``torch.mm``), with the model's FLOPs counted as
``6 x (matmul parameters) x tokens + 6 x layers x heads x head_dim x T^2 x B`` (causal attention, forward and backward).
Without torch/transformers the HF side is skipped with a message and only mtrl-jax is measured.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench_common import import_torch, model_config
from mtrl_jax.model import ModelConfig, init_params
from mtrl_jax.model.hf_io import save_hf_checkpoint
from mtrl_jax.model.transformer import Transformer
from mtrl_jax.rl.batch import TrajectoryBatch
from mtrl_jax.rl.objective import ObjectiveConfig
from mtrl_jax.rl.train_step import UpdateConfig, Updater, make_optimizer

BATCH = {"tiny": (32, 384), "30m": (8, 512)}
CLIP_LOW, CLIP_HIGH, CLIP_DUAL, LR = 0.2, 0.28, 3.0, 1e-5


def model_flops(cfg: ModelConfig, B: int, T: int) -> float:
    D, N, K, H, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    per_layer = D * (N + 2 * K) * H + N * H * D + 3 * D * F
    matmul_params = cfg.num_layers * per_layer + D * cfg.vocab_size
    return 6.0 * matmul_params * B * T + 6.0 * cfg.num_layers * N * H * T * T * B


def make_batch(cfg: ModelConfig, B: int, T: int, seed: int = 0) -> TrajectoryBatch:
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, size=(B, T)).astype(np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    loss_mask[:, T // 4:] = 1.0  # the last three quarters are "sampled"
    behav = np.where(loss_mask > 0, -rng.uniform(2, 6, size=(B, T)), 0.0).astype(np.float32)
    rewards = rng.uniform(size=B).astype(np.float32)
    return TrajectoryBatch(tokens, np.ones((B, T), np.int32), loss_mask, behav, rewards, group_size=4)


def timed(fn, repeats_log: list) -> None:
    start = time.perf_counter()
    fn()
    repeats_log.append(time.perf_counter() - start)


def matmul_peak(repeats: int, torch=None) -> tuple[float, float]:
    n = 2048
    a = jnp.asarray(np.random.default_rng(0).standard_normal((n, n)), jnp.float32)
    dot = jax.jit(jnp.dot)
    jax.block_until_ready(dot(a, a))
    jax_times, torch_times = [], []
    ta = None if torch is None else torch.randn(n, n)
    for _ in range(repeats):
        timed(lambda: jax.block_until_ready(dot(a, a)), jax_times)
        if ta is not None:
            timed(lambda: torch.mm(ta, ta), torch_times)
    flops = 2.0 * n ** 3
    return flops / statistics.median(jax_times), (flops / statistics.median(torch_times) if torch_times else 0.0)


def project_side(cfg: ModelConfig, batch: TrajectoryBatch):
    update_cfg = UpdateConfig(objective=ObjectiveConfig(loss="ppo", loss_options=(("clip_dual", CLIP_DUAL), ("clip_high", CLIP_HIGH),
                                                                                    ("clip_low", CLIP_LOW))),
                              advantage="grpo", old_logp="behaviour", mini_batches=1, micro_batches=1,
                              logprob_chunk=batch.tokens.size,  # one chunk: the logits are held, not recomputed
                              length_bucket=batch.tokens.shape[1])
    tx = make_optimizer(LR, 100, grad_clip=1.0)
    updater = Updater(cfg, update_cfg, tx)
    params = init_params(cfg, jax.random.PRNGKey(0))
    holder = {"state": updater.init_state(params, jax.random.PRNGKey(1))}
    device_batch = jax.device_put(batch)

    def step():
        holder["state"], metrics = updater.update(holder["state"], device_batch)
        jax.block_until_ready(metrics)

    return params, step


def hf_side(cfg: ModelConfig, params, batch: TrajectoryBatch, torch, transformers):
    directory = tempfile.mkdtemp(prefix="bench_train_step_hf_")
    save_hf_checkpoint(Transformer(cfg), params, directory)
    model = transformers.AutoModelForCausalLM.from_pretrained(directory, torch_dtype=torch.float32)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    tokens = torch.from_numpy(batch.tokens.astype(np.int64))
    mask = torch.from_numpy(batch.loss_mask[:, 1:])
    old = torch.from_numpy(batch.behav_logp[:, 1:])
    rewards = torch.from_numpy(batch.reward).view(-1, batch.group_size)
    adv = ((rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)).view(-1, 1)

    def step():
        logits = model(input_ids=tokens).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(-1, tokens[:, 1:, None]).squeeze(-1)
        ratio = torch.exp(logp - old)
        surrogate = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP_LOW, 1 + CLIP_HIGH))
        surrogate = torch.where(adv < 0, torch.minimum(surrogate, -adv * CLIP_DUAL), surrogate)
        loss = (surrogate * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,30m")
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    torch, transformers = import_torch("the HF side")
    jax_peak, torch_peak = matmul_peak(args.repeats, torch)
    peak = max(jax_peak, torch_peak)
    print(f"float32 matmul peak (2048^3): jnp.dot {jax_peak / 1e9:.1f} GFLOP/s"
          + (f", torch.mm {torch_peak / 1e9:.1f} GFLOP/s" if torch else "") + f"; peak used: {peak / 1e9:.1f} GFLOP/s")
    for name in args.configs.split(","):
        B, T = BATCH[name]
        # the README's CPU settings: float32, no remat, layers unrolled, chunked causal attention
        cfg = model_config(name, scan_unroll=0, attention_chunk=128)
        batch = make_batch(cfg, B, T)
        params, ours = project_side(cfg, batch)
        theirs = None if torch is None else hf_side(cfg, params, batch, torch, transformers)
        ours()
        if theirs is not None:
            theirs()
        ours_t, theirs_t = [], []
        for _ in range(args.repeats):
            timed(ours, ours_t)
            if theirs is not None:
                timed(theirs, theirs_t)
        tokens, flops = B * T, model_flops(cfg, B, T)
        ours_s = statistics.median(ours_t)
        line = (f"{name} (B{B} x T{T}): mtrl-jax {tokens / ours_s:,.0f} tokens/s ({ours_s * 1e3:.0f} ms, "
                f"{flops / ours_s / peak:.0%} of peak)")
        if theirs_t:
            theirs_s = statistics.median(theirs_t)
            line += (f"; HF torch {tokens / theirs_s:,.0f} tokens/s ({theirs_s * 1e3:.0f} ms, {flops / theirs_s / peak:.0%} of peak)"
                     f"; ratio {theirs_s / ours_s:.2f}x")
        print(line, flush=True)


if __name__ == "__main__":
    main()
