"""The policy update against HF transformers + torch on the same CPU, same weights, same batch.

    python -m benchmarks.bench_train_step                 # both configs, 5 alternated repeats
    python -m benchmarks.bench_train_step --configs tiny --repeats 3

For each config (``tiny``: the embedded default's policy, B32 x T384; ``30m``: a 30M Qwen3, 4
layers, hidden 512, vocabulary 32k, B8 x T512) one optimizer step on a batch of full rows:

* **mtrl-jax**: the jitted update of ``mtrl_jax.rl.train_step`` (advantages, token log-probs and
  entropy, the PPO loss, backward, gradient clipping, Adam), in the configuration docs/benchmarks.md
  recommends for CPU (float32, no remat, layers unrolled, chunked causal attention, the
  log-probs in one chunk so the logits are held rather than recomputed);
* **HF**: the same weights exported with ``save_hf_checkpoint`` and loaded by transformers'
  ``Qwen3ForCausalLM`` (torch, float32, its default SDPA attention): forward, log-softmax gather,
  the same PPO loss (asymmetric and dual clip, token mean), backward, gradient clipping, AdamW.

The two alternate, ``--repeats`` times, after a cold start call each; the script prints the median
tokens/s of each, the ratio, and each side's share of the float32 matmul peak measured in the same
run (the faster of a 2048^3 ``jnp.dot`` and ``torch.mm``), with the model's FLOPs counted as
``6 x (matmul parameters) x tokens + 6 x layers x heads x head_dim x T^2 x B`` (causal attention, forward and backward).
Without torch/transformers the HF side is skipped with a message and only mtrl-jax is measured.

``--components`` then times where the two differ, forward and backward of each part on its own at
the config's shapes (``[B x T]`` rows), alternated the same way: the attention core (the project's
chunked ``causal_attention`` vs torch's ``scaled_dot_product_attention``, causal, grouped KV heads),
one MLP (the project's ``MLP`` module vs the same products in torch, HF's ``down(silu(gate(x)) * up(x))``) and
the LM head with the
log-softmax gather (the project's ``token_logprobs``, entropy included, vs ``lm_head`` +
``log_softmax`` + ``gather``). Each backward is taken with respect to the inputs and the weights.

``--equal_groups F`` instead times the project's update with and without ``rl.skip_zero_advantage``
(alternated, same batch), where a share ``F`` of the groups have all-equal rewards (advantage 0, as
GRPO gives a group whose samples all score the same): the skipped micro-batches' forward and backward
against computing them.

``--baseline REV`` instead times the project's update against itself at another commit: the same
harness, run in child processes with ``mtrl_jax`` imported from a git worktree of ``REV`` or from
this tree, alternated ``--rounds`` times (each child a cold start call and ``--repeats`` timed ones);
it prints the median of the children's medians and the speed-up.
"""

from __future__ import annotations

if (
    __name__ == "__main__"
):  # first: the host allocator (glibc reads its tunables when the process starts; mtrl_jax/host.py)
    from mtrl_jax.host import prepare_process

    prepare_process()

import argparse
import pathlib
import statistics
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from benchmarks.common import alternate, alternate_checkouts, import_torch, machine_line, model_config, ratio
from mtrl_jax.model import ModelConfig, init_params
from mtrl_jax.model.hf_io import save_hf_checkpoint
from mtrl_jax.model.transformer import MLP, Transformer, causal_attention
from mtrl_jax.rl.logprobs import token_logprobs
from mtrl_jax.rl.batch import TrajectoryBatch
from mtrl_jax.rl.objective import ObjectiveConfig
from mtrl_jax.rl.optimizer import make_optimizer
from mtrl_jax.rl.train_step import UpdateConfig
from mtrl_jax.rl.updater import Updater

BATCH = {"tiny": (32, 384), "30m": (8, 512)}
CLIP_LOW, CLIP_HIGH, CLIP_DUAL, LR = 0.2, 0.28, 3.0, 1e-5


def model_flops(cfg: ModelConfig, B: int, T: int) -> float:
    D, N, K, H, F = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size
    per_layer = D * (N + 2 * K) * H + N * H * D + 3 * D * F
    matmul_params = cfg.num_layers * per_layer + D * cfg.vocab_size
    return 6.0 * matmul_params * B * T + 6.0 * cfg.num_layers * N * H * T * T * B


def make_batch(cfg: ModelConfig, B: int, T: int, seed: int = 0, equal_groups: float = 0.0) -> TrajectoryBatch:
    """Random tokens and rewards in groups of 4; the first ``equal_groups`` share of the groups all-equal."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab_size, size=(B, T)).astype(np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    loss_mask[:, T // 4 :] = 1.0  # the last three quarters are "sampled"
    behav = np.where(loss_mask > 0, -rng.uniform(2, 6, size=(B, T)), 0.0).astype(np.float32)
    rewards = rng.uniform(size=B).astype(np.float32)
    rewards[: 4 * round(equal_groups * B / 4)] = 0.5
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
    flops = 2.0 * n**3
    return flops / statistics.median(jax_times), (flops / statistics.median(torch_times) if torch_times else 0.0)


# The project's update settings measured against torch: "default" is configs/default.py's (micro-batches of 4
# rows, each at its own length; log-probs in chunks of 4,096 tokens; attention in query chunks of 256),
# "one_batch" the whole batch as one micro-batch with the logits held (one chunk) and attention chunks of 128.
SETTINGS = {
    "default": dict(attention_chunk=256, rows_per_micro_batch=4, logprob_chunk=4096),
    "one_batch": dict(attention_chunk=128, rows_per_micro_batch=0, logprob_chunk=0),
}


def setting_config(name: str, setting: str) -> ModelConfig:
    """Model shape ``name`` with the CPU runtime settings of ``setting``: float32, no remat, layers unrolled."""
    return model_config(name, scan_unroll=0, attention_chunk=SETTINGS[setting]["attention_chunk"])


def project_side(cfg: ModelConfig, batch: TrajectoryBatch, setting: str = "default", skip: bool = True):
    B, T = batch.tokens.shape
    rows = SETTINGS[setting]["rows_per_micro_batch"] or B
    update_cfg = UpdateConfig(
        objective=ObjectiveConfig(
            loss="ppo", loss_options=(("clip_dual", CLIP_DUAL), ("clip_high", CLIP_HIGH), ("clip_low", CLIP_LOW))
        ),
        advantage="grpo",
        old_logp="behaviour",
        mini_batches=1,
        micro_batches=B // rows,
        logprob_chunk=SETTINGS[setting]["logprob_chunk"] or B * T,
        length_bucket=T,
        skip_zero_advantage=skip,
    )
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


def component_pairs(cfg: ModelConfig, B: int, T: int, torch) -> list:
    """``[(name, ours, theirs)]``: forward + backward of each part on its own (see the module
    docstring); ``theirs`` is None without torch. Both sides get the same inputs and weights."""
    rng = np.random.default_rng(1)
    D, F, N, K, H, V = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_heads,
        cfg.num_kv_heads,
        cfg.head_dim,
        cfg.vocab_size,
    )

    def normal(*shape, scale=1.0):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    def run_jax(fn, *args):
        grad = jax.jit(jax.grad(fn, argnums=tuple(range(len(args)))))
        args = [jnp.asarray(a) for a in args]
        return lambda: jax.block_until_ready(grad(*args))

    def leaf(a):
        return torch.from_numpy(a).requires_grad_()

    pairs = []
    # attention core: q [B, T, N, H], k, v [B, T, K, H]
    q, k, v, ct_attention = normal(B, T, N, H), normal(B, T, K, H), normal(B, T, K, H), normal(B, T, N, H)
    valid = jnp.ones((B, T), bool)
    ours = run_jax(
        lambda q, k, v: jnp.sum(causal_attention(q, k, v, valid, cfg.attention_chunk) * ct_attention), q, k, v
    )
    theirs = None
    if torch is not None:
        tq, tk, tv = (leaf(np.ascontiguousarray(a.transpose(0, 2, 1, 3))) for a in (q, k, v))
        tct_attention = torch.from_numpy(np.ascontiguousarray(ct_attention.transpose(0, 2, 1, 3)))

        def theirs():
            out = torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, is_causal=True, enable_gqa=True)
            (out * tct_attention).sum().backward()

    pairs.append((f"attention core (chunk {cfg.attention_chunk} vs SDPA)", ours, theirs))

    # one MLP: x [B, T, D]
    x, ct_mlp = normal(B, T, D), normal(B, T, D)
    gate, up, down = normal(D, F, scale=0.05), normal(D, F, scale=0.05), normal(F, D, scale=0.05)
    mlp = MLP(cfg)
    ours = run_jax(
        lambda x, g, u, d: jnp.sum(mlp.apply({"params": {"gate_proj": g, "up_proj": u, "down_proj": d}}, x) * ct_mlp),
        x,
        gate,
        up,
        down,
    )
    theirs = None
    if torch is not None:
        tx, tg, tu, td = (leaf(np.ascontiguousarray(a)) for a in (x, gate, up, down))
        tct_mlp = torch.from_numpy(ct_mlp)

        def theirs():  # HF's Qwen3MLP: down(silu(gate(x)) * up(x))
            out = torch.nn.functional.silu(tx @ tg) * (tx @ tu) @ td
            (out * tct_mlp).sum().backward()

    pairs.append(("MLP (one layer)", ours, theirs))

    # LM head + log-softmax gather: hidden [B, T, D], head [D, V]
    hidden, head = normal(B, T, D), normal(D, V, scale=0.05)
    targets = rng.integers(0, V, size=(B, T)).astype(np.int32)
    ours = run_jax(lambda h, w: jnp.sum(token_logprobs(h, w, targets, 1.0, B * T)[0]), hidden, head)
    theirs = None
    if torch is not None:
        th, tw = leaf(hidden), leaf(np.ascontiguousarray(head.T))
        tt = torch.from_numpy(targets.astype(np.int64))

        def theirs():
            logits = torch.nn.functional.linear(th, tw)
            torch.log_softmax(logits, dim=-1).gather(-1, tt[..., None]).sum().backward()

    pairs.append(("LM head + log-softmax gather", ours, theirs))
    return pairs


def child(name: str, repeats: int) -> None:
    """``--child``: the project's update alone (whichever ``mtrl_jax`` is on the path), its median seconds."""
    B, T = BATCH[name]
    cfg = setting_config(name, "default")
    _, ours = project_side(cfg, make_batch(cfg, B, T))
    seconds, _ = alternate({"ours": ours}, repeats)
    print(f"median_seconds {seconds['ours']}")


def against_baseline(args) -> None:
    for name in args.configs.split(","):
        times = alternate_checkouts(
            pathlib.Path(__file__),
            ["--child", name, "--repeats", str(args.repeats)],
            "median_seconds",
            args.baseline,
            args.rounds,
        )
        ours, theirs = statistics.median(times["this tree"]), statistics.median(times[args.baseline])
        B, T = BATCH[name]
        print(
            f"{name} (B{B} x T{T}), medians of {args.rounds} alternated children: this tree {ours * 1e3:.0f} ms "
            f"({B * T / ours:,.0f} tokens/s) vs {theirs * 1e3:.0f} ms at {args.baseline}: {ratio(ours, theirs)} faster "
            f"(per child: {', '.join(f'{t * 1e3:.0f}' for t in times['this tree'])} vs "
            f"{', '.join(f'{t * 1e3:.0f}' for t in times[args.baseline])} ms)",
            flush=True,
        )


def skipping(args) -> None:
    """``--equal_groups``: the update with and without ``skip_zero_advantage``, alternated."""
    for name in args.configs.split(","):
        B, T = BATCH[name]
        cfg = setting_config(name, "default")
        batch = make_batch(cfg, B, T, equal_groups=args.equal_groups)
        equal = int(np.sum(batch.reward == 0.5)) // 4
        sides = {f"skip {'on' if skip else 'off'}": project_side(cfg, batch, skip=skip)[1] for skip in (True, False)}
        seconds, _ = alternate(sides, args.repeats)
        print(
            f"{name} (B{B} x T{T}, {equal} of {B // 4} groups all-equal), medians of {args.repeats} alternated "
            f"updates: skip_zero_advantage on {seconds['skip on'] * 1e3:.0f} ms, off {seconds['skip off'] * 1e3:.0f} "
            f"ms: {ratio(seconds['skip on'], seconds['skip off'])} faster",
            flush=True,
        )


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,30m")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument(
        "--components",
        action="store_true",
        help="then time the attention core, one MLP and the LM head on their own, forward and backward, against torch",
    )
    p.add_argument("--baseline", default="", help="a git revision: time the project's update here and there instead")
    p.add_argument("--rounds", type=int, default=4, help="alternated child processes per side (--baseline)")
    p.add_argument(
        "--equal_groups",
        type=float,
        default=None,
        help="instead: the update with and without rl.skip_zero_advantage, this share of the groups all-equal",
    )
    p.add_argument("--child", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        return child(args.child, args.repeats)
    print(machine_line(peak=False), flush=True)
    if args.baseline:
        return against_baseline(args)
    if args.equal_groups is not None:
        if not 0.0 <= args.equal_groups <= 1.0:
            p.error(f"--equal_groups {args.equal_groups}: a share of the groups, from 0 to 1")
        return skipping(args)
    torch, transformers = import_torch("the HF side")
    jax_peak, torch_peak = matmul_peak(args.repeats, torch)
    peak = max(jax_peak, torch_peak)
    print(
        f"float32 matmul peak (2048^3): jnp.dot {jax_peak / 1e9:.1f} GFLOP/s"
        + (f", torch.mm {torch_peak / 1e9:.1f} GFLOP/s" if torch else "")
        + f"; peak used: {peak / 1e9:.1f} GFLOP/s"
    )
    for name in args.configs.split(","):
        B, T = BATCH[name]
        sides, tokens = {}, B * T
        for setting in SETTINGS:
            cfg = setting_config(name, setting)
            batch = make_batch(cfg, B, T)
            params, sides[f"mtrl-jax {setting}"] = project_side(cfg, batch, setting)
        if torch is not None:
            sides["HF torch"] = hf_side(cfg, params, batch, torch, transformers)
        seconds, _ = alternate(sides, args.repeats)
        flops = model_flops(cfg, B, T)
        print(f"{name} (B{B} x T{T}), medians of {args.repeats} alternated calls:", flush=True)
        for side, t in seconds.items():
            line = f"  {side:20s} {tokens / t:9,.0f} tokens/s ({t * 1e3:7.0f} ms, {flops / t / peak:.0%} of peak)"
            if "HF torch" in seconds and side != "HF torch":
                line += f"; {ratio(t, seconds['HF torch'])} HF torch"
            print(line, flush=True)
        fastest = min(SETTINGS, key=lambda setting: seconds[f"mtrl-jax {setting}"])
        slowest = max(seconds[f"mtrl-jax {setting}"] for setting in SETTINGS)
        print(f"  fastest setting: {fastest} ({ratio(seconds[f'mtrl-jax {fastest}'], slowest)} the other)", flush=True)
        if args.components:
            for part, ours, theirs in component_pairs(setting_config(name, "default"), B, T, torch):
                parts, _ = alternate({"ours": ours, **({"theirs": theirs} if theirs else {})}, args.repeats)
                print(
                    f"  {part}, forward + backward: mtrl-jax {parts['ours'] * 1e3:.1f} ms"
                    + (
                        f", torch {parts['theirs'] * 1e3:.1f} ms, ratio {ratio(parts['ours'], parts['theirs'])}"
                        if theirs
                        else ""
                    ),
                    flush=True,
                )


if __name__ == "__main__":
    main()
