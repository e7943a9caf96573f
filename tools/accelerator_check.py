"""One command for an accelerator: a few RL steps of a Qwen3-0.6B-shaped policy on the synthetic
collection, on whatever devices JAX sees; prints sampled and trained tokens/s, MFU against the
device's bf16 peak, and peak device memory.

    bash tools/accelerator_check.sh                       # random weights, Qwen3-0.6B shape
    bash tools/accelerator_check.sh --checkpoint DIR      # a real HF checkpoint (with tokenizer.json)
    bash tools/accelerator_check.sh --lora_rank 16        # LoRA adapters train, the base is frozen

With random weights the tokenizer is trained on the synthetic collection (the model keeps Qwen3's
151,936-row vocabulary) and the checkpoint is written once to ``<workdir>/random-<model>``; the
policy babbles until the per-turn token limit, which is what a throughput check needs. Every step
goes through the real code path: ``experiments.run``'s trainer, the sampler, the jitted update.

MFU counts model FLOPs: 6 N per trained token and 2 N per sampled token (N = parameters), over the
devices' bf16 peak; the update also recomputes the old log-probs, so its hardware FLOPs are higher.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import tempfile

REPO = pathlib.Path(__file__).resolve().parents[1]

# dense bf16 peak TFLOP/s by (a substring of) jax's device_kind, case-insensitive; first match wins
PEAK_TFLOPS = [
    ("h200", 989.0),
    ("h100", 989.0),
    ("gh200", 989.0),
    ("a100", 312.0),
    ("l40s", 362.0),
    ("a10g", 125.0),
    ("l4", 121.0),
    ("tpu v5p", 459.0),
    ("tpu v5 lite", 197.0),
    ("tpu v5e", 197.0),
    ("tpu v6", 918.0),
    ("tpu v4", 275.0),
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--checkpoint", default="", help="an HF checkpoint directory (config.json, safetensors, tokenizer.json)"
    )
    p.add_argument(
        "--model", default="qwen3-0.6b", help="shape of the random policy: configs/models/<name>.json or a path"
    )
    p.add_argument(
        "--steps", type=int, default=4, help="RL steps (the first one compiles and is left out of the medians)"
    )
    p.add_argument("--prompts", type=int, default=16, help="global_batch_size")
    p.add_argument("--group_size", type=int, default=8)
    p.add_argument("--slots", type=int, default=128, help="rollout_max_concurrency")
    p.add_argument("--max_tokens_per_turn", type=int, default=256)
    p.add_argument(
        "--max_len",
        type=int,
        default=2048,
        help="context tokens per episode (rollout.max_len); the update compiles one length branch per 512 of them",
    )
    p.add_argument(
        "--precompile",
        type=int,
        default=1,
        choices=(0, 1),
        help="1: compile every sampler shape in the background (rollout.precompile); 0: as met",
    )
    p.add_argument("--micro_batches", type=int, default=4, help="rl.micro_batches (gradient accumulation)")
    p.add_argument("--mesh", default="1,-1,1", help="data,fsdp,tensor; -1 takes the remaining devices")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype (parameters stay float32)")
    p.add_argument("--lora_rank", type=int, default=0, help="model.lora_rank: 0 trains every parameter")
    p.add_argument(
        "--warmup_steps", type=int, default=0, help="warmup.steps (0: none; the random policy babbles, as timing needs)"
    )
    p.add_argument(
        "--peak_tflops", type=float, default=0.0, help="bf16 peak per device (default: from the device kind)"
    )
    p.add_argument("--workdir", default="", help="default: a fresh temporary directory")
    return p.parse_args(argv)


def device_peak(kind: str, given: float):
    if given:
        return given
    for key, peak in PEAK_TFLOPS:
        if key in kind.lower():
            return peak
    return None


def random_checkpoint(config, model_json: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    """``out``: ``model_json``'s shape with random weights and a tokenizer trained on the config's data."""
    import jax

    from mtrl_jax.model import ModelConfig, Transformer, init_params, save_hf_checkpoint
    from mtrl_jax.setup import build_chat, build_data, build_environment

    if (out / "config.json").exists() and (out / "tokenizer.json").exists():
        return out
    collections, _, _ = build_data(config)
    chat = build_chat(config, out, collections, build_environment(config, collections))  # writes out/tokenizer.json
    cfg = ModelConfig.from_hf(json.loads(model_json.read_text()), str(model_json))
    if chat.vocab_size > cfg.vocab_size:
        raise SystemExit(f"{model_json}: vocabulary {cfg.vocab_size} < the tokenizer's {chat.vocab_size}")
    save_hf_checkpoint(Transformer(cfg), init_params(cfg, jax.random.PRNGKey(0)), out)
    return out


def main(argv=None):
    args = parse_args(argv)
    import jax

    from configs import default
    from mtrl_jax import trainer

    workdir = pathlib.Path(args.workdir or tempfile.mkdtemp(prefix="accelerator_check_"))
    config = default.get_config()
    config.unlock()
    config.max_steps, config.global_batch_size, config.rollout_max_concurrency = args.steps, args.prompts, args.slots
    config.rollout.group_size = args.group_size
    config.rollout.max_tokens_per_turn = config.rollout.decode_chunk = args.max_tokens_per_turn
    config.rollout.max_len = args.max_len
    config.rollout.precompile = bool(args.precompile)
    config.rollout.asynchronous = False  # sampling and training timed apart
    config.rl.length_bucket = 512  # a length branch per 512 tokens: 4 at the default max_len 2048
    config.rl.kl_coef = 0.0
    config.rl.micro_batches = args.micro_batches
    config.model.mesh_shape = tuple(int(x) for x in args.mesh.split(","))
    config.model.dtype, config.model.remat = args.dtype, True
    config.model.lora_rank = args.lora_rank
    config.warmup.steps = args.warmup_steps  # the default's 3,000 supervised steps are not what is timed
    config.model.scan_unroll = 1  # a loop over the layers (the CPU default unrolls them)
    config.rl.logprob_chunk = 512  # chunked, recomputed log-probs: the accelerator's memory goes to the batch
    config.data.max_eval_tasks = 8
    config.checkpoint.every_steps = args.steps
    config.log.trajectories = False
    if args.checkpoint:
        config.model.checkpoint = args.checkpoint
    else:
        path = (
            pathlib.Path(args.model)
            if args.model.endswith(".json")
            else REPO / "configs" / "models" / f"{args.model}.json"
        )
        config.model.checkpoint = str(random_checkpoint(config, path, workdir / f"random-{path.stem}"))
    config.lock()

    devices = jax.devices()
    kind = devices[0].device_kind
    print(f"{len(devices)} x {kind} ({jax.default_backend()}), policy {config.model.checkpoint}", flush=True)
    summary = trainer.train_and_evaluate(config, workdir / "run")

    import flax.linen as nn

    from mtrl_jax.model import ModelConfig, abstract_params

    cfg = ModelConfig.from_hf(json.loads((pathlib.Path(config.model.checkpoint) / "config.json").read_text()))
    n_params = sum(x.size for x in jax.tree.leaves(nn.unbox(abstract_params(cfg))))
    steps = [json.loads(line) for line in (workdir / "run" / "metrics.jsonl").read_text().splitlines()]
    timed = steps[1:] or steps  # the first step compiles
    sampled = statistics.median(s["throughput/sampled_tokens_per_s"] for s in timed)
    trained = statistics.median(s["throughput/trained_tokens_per_s"] for s in timed)
    peak = device_peak(kind, args.peak_tflops)
    memory = max((s.get("memory/peak_device_gib", 0.0) for s in steps), default=0.0)
    trains = f"LoRA rank {args.lora_rank} adapters" if args.lora_rank else "every parameter"
    print(f"\n{n_params / 1e6:,.1f} M parameters ({trains} trained), {len(devices)} x {kind}", end="")
    print(f", median of RL steps 2..{len(steps)}:")
    print(f"  sampled tokens/s {sampled:12,.0f}", end="")
    print(f"   MFU {2 * n_params * sampled / (len(devices) * peak * 1e12):.1%}" if peak else "")
    print(f"  trained tokens/s {trained:12,.0f}", end="")
    print(f"   MFU {6 * n_params * trained / (len(devices) * peak * 1e12):.1%}" if peak else "")
    if not peak:
        print(f"  MFU: no bf16 peak known for {kind!r}; pass --peak_tflops")
    print(f"  peak device memory {memory:.2f} GiB" if memory else "  peak device memory: not reported by this backend")
    print(f"  validation nDCG@10 before/after: {summary['before']['ndcg@10']:.4f} / {summary['after']['ndcg@10']:.4f}")
    return {
        "sampled_tokens_per_s": sampled,
        "trained_tokens_per_s": trained,
        "peak_memory_gib": memory,
        "params": n_params,
        "lora_rank": args.lora_rank,
    }


if __name__ == "__main__":
    main()
