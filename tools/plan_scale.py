"""What fits where, measured by the compiler: the update step and the decode step of a published
model, lowered and compiled for ``N`` devices (fake CPU devices here), nothing allocated.

    python -m tools.plan_scale --model qwen3-8b --devices 8 --mesh 1,8,1 --batch 64 --seq 2048
    python -m tools.plan_scale --model qwen3-32b --devices 64 --mesh 1,16,4 --batch 256 --seq 2048 --target tpu-v5p
    python -m tools.plan_scale --table    # docs/scale.md's table: every model on 8 GPUs, on a 64-chip v5p slice

Parameters are abstract (``jax.ShapeDtypeStruct`` with the sharding table's shardings) built from
the model's HF ``config.json`` kept in ``configs/models/``. The update is the trainer's own jitted
``update_step`` (Adam, PPO loss, one mini-batch of ``--batch`` rows split into ``--micro_batches``, each
at the full ``--seq``);
the decode step is the sampler's own ``decode`` for ``--slots`` rows with a ``--max_len`` KV cache,
one token per row. Printed per device, from the compiled programs' ``memory_analysis()`` and
``cost_analysis()``: bytes of arguments, outputs, temporaries and their peak (arguments + outputs -
aliased + temporaries), FLOPs, and the step time implied at the target's bf16 peak and ``--mfu``.

Precision as the trainer runs it: float32 master parameters and Adam state, ``--dtype`` compute
(bfloat16 parameters are refused for full fine-tuning, as ``setup`` refuses them). ``--gen_dtype
bfloat16``: the decode step reads a bfloat16 copy of the parameters (the sampler's, refreshed after each
update). ``--lora RANK``: LoRA adapters of that rank on every projection train (float32, with their Adam
state), the base is frozen in ``--base_dtype``; the update's gradient and optimizer hold the adapters only.

These are CPU-compiled estimates: XLA:CPU fuses and schedules differently from XLA:GPU / XLA:TPU,
so temporaries are indicative, and parameter / optimizer / cache bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]
MODELS = REPO / "configs" / "models"

# bf16 dense peak (TFLOP/s), memory per device (GiB as the runtime reports it), HBM bandwidth (TB/s)
TARGETS = {
    "a100-80gb": (312.0, 79.2, 2.04),
    "h100-80gb": (989.0, 79.6, 3.35),
    "h200": (989.0, 139.8, 4.8),
    "tpu-v5p": (459.0, 95.0, 2.76),
    "tpu-v5e": (197.0, 16.0, 0.82),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument(
        "--table", action="store_true", help="compile TABLE_ROWS for every model and print docs/scale.md's table"
    )
    p.add_argument(
        "--model", help=f"one of {sorted(f.stem for f in MODELS.glob('*.json'))}, or a path to an HF config.json"
    )
    p.add_argument("--devices", type=int, help="number of devices (fake CPU devices here)")
    p.add_argument("--mesh", help="data,fsdp,tensor (their product is --devices)")
    p.add_argument("--batch", type=int, help="trajectories per optimizer step (rows of the update)")
    p.add_argument("--seq", type=int, help="tokens per trajectory (padded length)")
    p.add_argument("--micro_batches", type=int, default=1, help="gradient accumulation steps per mini-batch")
    p.add_argument("--slots", type=int, default=0, help="rollout rows decoded at once (default: --batch)")
    p.add_argument("--max_len", type=int, default=0, help="KV-cache length per rollout row (default: --seq)")
    p.add_argument("--param_dtype", default="float32", help="the trained parameters' (and Adam state's) dtype")
    p.add_argument("--dtype", default="bfloat16", help="compute dtype")
    p.add_argument("--gen_dtype", default="", help="the decode step's parameter copy (default: --param_dtype)")
    p.add_argument("--lora", type=int, default=0, help="LoRA rank: adapters train, the base is frozen (0: full)")
    p.add_argument("--base_dtype", default="bfloat16", help="with --lora: the frozen base's dtype")
    p.add_argument("--no_remat", action="store_true", help="keep every layer's activations for the backward pass")
    p.add_argument("--kl", action="store_true", help="with a KL term (a reference copy of the parameters)")
    p.add_argument("--target", default="h100-80gb", choices=sorted(TARGETS), help="device for the fit and timing")
    p.add_argument("--mfu", type=float, default=0.4, help="model FLOPs utilisation assumed for the step time")
    p.add_argument("--only", choices=("update", "decode"), help="compile only one of the two programs")
    p.add_argument("--json", action="store_true", help="print one JSON line instead of the table")
    args = p.parse_args(argv)
    if args.table:
        return args
    missing = [f"--{name}" for name in ("model", "devices", "mesh", "batch", "seq") if getattr(args, name) is None]
    if missing:
        p.error(f"missing {', '.join(missing)} (or --table)")
    try:
        args.mesh_shape = tuple(int(x) for x in args.mesh.split(","))
    except ValueError:
        p.error(f"--mesh {args.mesh!r}: expected three integers data,fsdp,tensor")
    if len(args.mesh_shape) != 3 or any(x < 1 for x in args.mesh_shape):
        p.error(f"--mesh {args.mesh!r}: expected three positive integers data,fsdp,tensor")
    if args.mesh_shape[0] * args.mesh_shape[1] * args.mesh_shape[2] != args.devices:
        p.error(
            f"--mesh {args.mesh} has {args.mesh_shape[0] * args.mesh_shape[1] * args.mesh_shape[2]} devices, "
            f"--devices is {args.devices}"
        )
    args.slots = args.slots or args.batch
    args.max_len = args.max_len or args.seq
    if args.param_dtype != "float32" and not args.lora:
        p.error(
            f"--param_dtype {args.param_dtype}: full fine-tuning keeps float32 master parameters (the trainer "
            "refuses bfloat16 ones: an Adam step at a small learning rate rounds away); use --dtype for compute"
        )
    args.gen_dtype = args.gen_dtype or (args.base_dtype if args.lora else args.param_dtype)
    return args


def model_config(name: str, args):
    from mtrl_jax.model.config import ModelConfig

    path = pathlib.Path(name) if name.endswith(".json") else MODELS / f"{name}.json"
    if not path.exists():
        raise SystemExit(f"--model {name}: {path} not found; known: {sorted(f.stem for f in MODELS.glob('*.json'))}")
    cfg = ModelConfig.from_hf(
        json.loads(path.read_text()), str(path), dtype=args.dtype, param_dtype=args.param_dtype, remat=not args.no_remat
    )
    return (
        cfg.replace(lora_rank=args.lora, lora_alpha=2.0 * args.lora, param_dtype=args.base_dtype) if args.lora else cfg
    )


def split_abstract(cfg, mesh):
    """``(frozen, trainable)`` abstract parameters (shapes, dtypes, the table's shardings): the frozen base
    and the adapters with ``--lora``, else ``({}, every parameter)``."""
    import flax.linen as nn

    from mtrl_jax.model import lora
    from mtrl_jax.model.sharding import param_shardings
    from mtrl_jax.model.transformer import abstract_params

    boxed = abstract_params(cfg)
    return lora.split(_abstract(nn.unbox(boxed), param_shardings(boxed, mesh)))


def _abstract(tree, shardings):
    import jax

    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree, shardings)


def _memory(compiled) -> dict:
    m = compiled.memory_analysis()
    out = {
        "argument_bytes": m.argument_size_in_bytes,
        "output_bytes": m.output_size_in_bytes,
        "alias_bytes": m.alias_size_in_bytes,
        "temp_bytes": m.temp_size_in_bytes,
    }
    out["peak_bytes"] = out["argument_bytes"] + out["output_bytes"] - out["alias_bytes"] + out["temp_bytes"]
    return out


def _flops(compiled) -> float:
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, (list, tuple)) else cost
    return float(cost.get("flops", 0.0))


def flops_per_step(compile_for, cfg) -> float:
    """XLA's cost analysis counts a loop's body once, whatever its trip count. So the FLOPs come from
    programs without loops (``compile_for(cfg, flop_count=True)``: one mini-/micro-batch, one log-prob
    chunk, the layer scan unrolled) of 1 and 2 layers, extrapolated linearly to ``cfg.num_layers``."""
    one, two = (_flops(compile_for(cfg.replace(num_layers=n, scan_unroll=n), flop_count=True)) for n in (1, 2))
    return one + (cfg.num_layers - 1) * (two - one)


def compile_update(cfg, mesh, args, flop_count: bool = False):
    import jax
    import jax.numpy as jnp
    import optax

    from mtrl_jax.model.sharding import batch_sharding
    from mtrl_jax.rl.batch import TrajectoryBatch
    from mtrl_jax.rl.objective import ObjectiveConfig
    from mtrl_jax.rl.optimizer import TrainState
    from mtrl_jax.rl.train_step import UpdateConfig
    from mtrl_jax.rl.updater import Updater

    frozen, params = split_abstract(cfg, mesh)
    tx = optax.adam(1e-6)
    replicated = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    # Adam's moments keep their parameter's sharding (as the trainer's eager tx.init does); its counter is replicated
    abstract_opt = jax.eval_shape(tx.init, params)
    opt_shardings = optax.tree_map_params(
        tx,
        lambda _, s: s,
        abstract_opt,
        jax.tree.map(lambda p: p.sharding, params),
        transform_non_params=lambda _: replicated,
    )
    opt_state = _abstract(abstract_opt, opt_shardings)
    state = TrainState(
        params,
        opt_state,
        jax.ShapeDtypeStruct((), jnp.int32, sharding=replicated),
        jax.ShapeDtypeStruct((2,), jnp.uint32, sharding=replicated),
    )
    B, T = args.batch, args.seq
    rows = lambda dtype: jax.ShapeDtypeStruct((B, T), dtype, sharding=batch_sharding(mesh, 2))  # noqa: E731
    batch = TrajectoryBatch(
        tokens=rows(jnp.int32),
        attention_mask=rows(jnp.int32),
        loss_mask=rows(jnp.float32),
        behav_logp=rows(jnp.float32),
        reward=jax.ShapeDtypeStruct((B,), jnp.float32, sharding=batch_sharding(mesh, 1)),
        group_size=8,
    )
    config = UpdateConfig(
        objective=ObjectiveConfig(loss="ppo", kl_coef=0.001 if args.kl else 0.0),
        micro_batches=1 if flop_count else args.micro_batches,
        logprob_chunk=B * T if flop_count else 512,
        # one length branch, the full --seq: the plan is for micro-batches of the longest rows (the shorter
        # branches of the trainer's lax.switch need less, and each would be compiled again for nothing)
        length_bucket=T,
    )
    return Updater(cfg, config, tx, mesh).lower(state, batch, params if args.kl else None, frozen).compile()


def compile_decode(cfg, mesh, args, flop_count: bool = False):
    import jax
    import jax.numpy as jnp

    from mtrl_jax.model.sharding import batch_sharding
    from mtrl_jax.rollout.engine import Sampler, state_sharding
    from mtrl_jax.rollout.sampler import init_state

    from mtrl_jax.model import lora

    frozen, trainable = split_abstract(cfg.replace(param_dtype=args.gen_dtype), mesh)
    params = lora.merge(
        frozen, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, args.gen_dtype, sharding=x.sharding), trainable)
    )  # the sampler's copy, every array in --gen_dtype
    sampler = Sampler(cfg, args.slots, args.max_len, 1, mesh=mesh)
    shapes = jax.eval_shape(lambda: init_state(cfg, args.slots, args.max_len))
    state = _abstract(shapes, state_sharding(mesh, cfg.num_kv_heads))
    S = args.slots
    row = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=batch_sharding(mesh, len(shape)))  # noqa: E731
    return sampler.lower_decode(
        params,
        state,
        row((S, 2), jnp.uint32),
        row((S,), jnp.float32),
        row((S,), jnp.float32),
        row((S, 2), jnp.int32),
        row((S,), jnp.bool_),
        row((S,), jnp.int32),
    ).compile()


def plan(compile_for, cfg, mesh, args) -> dict:
    """Memory of the program as it runs; FLOPs per step (``flops_per_step``); the time at the target."""
    figures = _memory(compile_for(cfg, mesh, args))
    figures["flops"] = flops_per_step(lambda c, flop_count: compile_for(c, mesh, args, flop_count), cfg)
    figures["seconds"] = figures["flops"] / (TARGETS[args.target][0] * 1e12 * args.mfu)
    return figures


# the table's rows: (devices, mesh, rows per update, micro-batches, decode slots, target) with one micro-batch
# row per device and 8 samples per prompt, the rollouts decoding on the same mesh (a single host); each model in
# full fine-tuning (float32 master parameters) and with LoRA adapters of rank 16 (the base frozen in bfloat16),
# bfloat16 compute and a bfloat16 copy of the parameters for decoding
TABLE_ROWS = [(8, "1,8,1", 64, 8, 64, "h200")]
TABLE_SEQ, TABLE_CACHE, TABLE_LORA = 2048, 4096, 16


def table() -> str:
    """Compile every model of ``configs/models`` at each ``TABLE_ROWS`` size, full and LoRA, each in a
    subprocess of its own, and tabulate."""
    import subprocess

    lines = [
        "| model | training | devices, mesh (data,fsdp,tensor) | update: rows x tokens (micro) | GiB/device | "
        "decode: slots x cache | GiB/device | target | fits | update s @40% MFU | decode ms/token (HBM-bound) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    models = sorted((f.stem for f in MODELS.glob("*.json")), key=lambda m: float(m.split("-")[1].rstrip("b")))
    for devices, mesh, rows, micro, slots, target in TABLE_ROWS:
        for model in models:
            for lora in (0, TABLE_LORA):
                cmd = [sys.executable, "-m", "tools.plan_scale", "--model", model, "--devices", str(devices)]
                cmd += ["--mesh", mesh, "--batch", str(rows), "--seq", str(TABLE_SEQ), "--micro_batches", str(micro)]
                cmd += ["--slots", str(slots), "--max_len", str(TABLE_CACHE), "--gen_dtype", "bfloat16"]
                cmd += ["--lora", str(lora), "--target", target, "--json"]
                run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env={**os.environ, "XLA_FLAGS": ""})
                if run.returncode:
                    raise SystemExit(f"{' '.join(cmd)} failed:\n{run.stderr[-3000:]}")
                out = json.loads(run.stdout.strip().splitlines()[-1])
                u, d = out["update"], out["decode"]
                peak, memory_gib, bandwidth = TARGETS[target]
                fits = "yes" if max(u["peak_bytes"], d["peak_bytes"]) <= memory_gib * 2**30 * 0.9 else "**no**"
                decode_ms = max(d["argument_bytes"] / (bandwidth * 1e12), d["flops"] / (peak * 1e12 * 0.4)) * 1e3
                lines.append(
                    f"| {model} ({out['params'] / 1e9:.1f} B) | {f'LoRA r{lora}' if lora else 'full'} | {devices}, "
                    f"({mesh}) | {rows} x {TABLE_SEQ} ({micro}) | {u['peak_bytes'] / 2**30:.1f} | "
                    f"{slots} x {TABLE_CACHE} | {d['peak_bytes'] / 2**30:.1f} | {target} ({memory_gib:.0f} GiB) | "
                    f"{fits} | "
                    f"{u['flops'] / (peak * 1e12 * 0.4):.2f} | {decode_ms:.2f} |"
                )
                print(lines[-1], file=sys.stderr, flush=True)
    return "\n".join(lines)


def main(argv=None):
    args = parse_args(argv)
    if args.table:
        print(table())
        return None
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={args.devices}"
    )
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import flax.linen as nn
    import jax

    from mtrl_jax.model.sharding import make_mesh
    from mtrl_jax.model.transformer import abstract_params

    if jax.device_count() < args.devices:
        raise SystemExit(
            f"JAX sees {jax.device_count()} devices, --devices is {args.devices} (was jax imported before?)"
        )
    cfg = model_config(args.model, args)
    mesh = make_mesh(args.mesh_shape)
    n_params = sum(x.size for x in jax.tree.leaves(nn.unbox(abstract_params(cfg.replace(lora_rank=0)))))
    peak_tflops, memory_gib, bandwidth = TARGETS[args.target]
    out = {
        "model": args.model,
        "params": n_params,
        "devices": args.devices,
        "mesh": args.mesh,
        "batch": args.batch,
        "seq": args.seq,
        "micro_batches": args.micro_batches,
        "slots": args.slots,
        "max_len": args.max_len,
        "param_dtype": args.param_dtype,
        "dtype": args.dtype,
        "gen_dtype": args.gen_dtype,
        "lora": args.lora,
        "remat": not args.no_remat,
        "kl": args.kl,
        "target": args.target,
        "mfu": args.mfu,
    }
    if args.only != "decode":
        out["update"] = plan(compile_update, cfg, mesh, args)
        out["update"]["tokens_per_s"] = (
            args.batch * args.seq / out["update"]["seconds"] if out["update"]["seconds"] else 0.0
        )
    if args.only != "update":
        decode = plan(compile_decode, cfg, mesh, args)
        decode["bandwidth_seconds"] = decode["argument_bytes"] / (
            bandwidth * 1e12
        )  # every weight and cache byte read once
        out["decode"] = decode
    for name in ("update", "decode"):
        if name in out:
            out[name]["fits"] = out[name]["peak_bytes"] <= memory_gib * 2**30 * 0.9  # 10% for the runtime
    if args.json:
        print(json.dumps(out))
        return out
    gib = lambda b: f"{b / 2**30:8.2f} GiB"  # noqa: E731
    print(
        f"{args.model} ({n_params / 1e9:.2f} B parameters; "
        + (
            f"LoRA rank {args.lora} adapters on a frozen {args.base_dtype} base"
            if args.lora
            else f"{args.param_dtype} master parameters"
        )
        + f", {args.dtype} compute, {args.gen_dtype} parameters for decoding, remat {not args.no_remat}) on "
        f"{args.devices} devices, mesh (data, fsdp, tensor) = ({args.mesh})"
    )
    print(
        f"target {args.target}: {peak_tflops:.0f} TFLOP/s bf16 peak, {memory_gib:.1f} GiB, {bandwidth} TB/s; "
        f"times at {args.mfu:.0%} MFU. CPU-compiled estimates, per device."
    )
    for name, what in (
        ("update", f"update step: {args.batch} x {args.seq} tokens, {args.micro_batches} micro-batch(es), Adam"),
        ("decode", f"decode step: {args.slots} rows x 1 token, KV cache of {args.max_len}"),
    ):
        if name not in out:
            continue
        f = out[name]
        print(f"\n{what}")
        print(
            f"  arguments {gib(f['argument_bytes'])}   outputs {gib(f['output_bytes'])}   aliased "
            f"{gib(f['alias_bytes'])}   "
            f"temporaries {gib(f['temp_bytes'])}"
        )
        print(
            f"  peak      {gib(f['peak_bytes'])}   {'fits' if f['fits'] else 'does NOT fit'} in 90% of "
            f"{memory_gib:.1f} GiB"
        )
        print(f"  {f['flops'] / 1e12:.2f} TFLOP per device -> {f['seconds'] * 1e3:.1f} ms at {args.mfu:.0%} MFU")
        if name == "update":
            print(f"  {f['tokens_per_s']:,.0f} trained tokens/s on the {args.devices} devices")
        else:
            print(
                f"  {f['bandwidth_seconds'] * 1e3:.2f} ms to read the weights and cache once at {bandwidth} TB/s "
                f"(decode is bound by this, not by FLOPs)"
            )
    return out


if __name__ == "__main__":
    main()
