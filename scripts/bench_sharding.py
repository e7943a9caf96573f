"""Does the mesh split the update's work? Per-device FLOPs and temporaries of the compiled update,
by mesh shape, against the single-device program, with the logical-axis rules as ``activate``
applies them (``jax.set_mesh``) and as it used to (``with mesh:``, which on JAX >= 0.7 leaves every
``nn.with_logical_constraint`` a no-op), side by side in one run.

    python scripts/bench_sharding.py                 # Qwen3-0.6B shape, 16 x 1024 tokens, 8 fake CPU devices

FLOPs are XLA's cost analysis of the loop-free one-layer update (``plan_scale.compile_update`` with
``flop_count``); temporaries come from the real (scanned) program's memory analysis. Nothing runs:
the programs are only compiled.
"""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import plan_scale  # noqa: E402  (scripts/ is this script's directory)

MESHES = [(1, 1, 1), (8, 1, 1), (1, 8, 1), (2, 2, 2), (1, 1, 8)]


def main():
    argv = sys.argv[1:] or ["--model", "qwen3-0.6b", "--batch", "16", "--seq", "1024"]
    sys.path.insert(0, str(plan_scale.REPO))
    from mtrl_jax.model import sharding

    args = plan_scale.parse_args(argv + ["--devices", "1", "--mesh", "1,1,1"])
    cfg = plan_scale.model_config(args.model, args)
    one_layer = cfg.replace(num_layers=1, scan_unroll=1)
    current = sharding._set_mesh
    results = {}
    for legacy in (False, True):  # compiling is deterministic: the two sides need no alternation
        sharding._set_mesh = (lambda mesh: mesh) if legacy else current
        for shape in MESHES:
            mesh = sharding.make_mesh(shape)
            flops = plan_scale._flops(plan_scale.compile_update(one_layer, mesh, args, flop_count=True))
            temp = plan_scale._memory(plan_scale.compile_update(cfg, mesh, args))["temp_bytes"]
            results[legacy, shape] = flops, temp
    sharding._set_mesh = current
    print(f"{args.model}, update of {args.batch} x {args.seq} tokens; per device: TFLOP of the one-layer program, "
          "GiB of temporaries of the full one; ratio = per-device FLOPs / single-device FLOPs")
    print("mesh (data,fsdp,tensor) | jax.set_mesh: TFLOP  temp GiB  ratio | with mesh (before): TFLOP  temp GiB  ratio")
    for shape in MESHES:
        cells = []
        for legacy in (False, True):
            flops, temp = results[legacy, shape]
            cells.append(f"{flops / 1e12:6.2f} {temp / 2**30:8.2f} {flops / results[legacy, MESHES[0]][0]:6.3f}")
        print(f"{str(shape):23s} | {cells[0]:>28s} | {cells[1]:>34s}")


if __name__ == "__main__":
    main()
