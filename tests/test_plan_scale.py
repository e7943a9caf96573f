"""tools/plan_scale.py: compiler-measured memory and FLOPs of the update and decode steps."""

import json
import pathlib
import subprocess
import sys

import pytest

from envs import background, background_result, popen, subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[1]
SHAPE = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 512,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "tie_word_embeddings": False,
    "max_position_embeddings": 4096,
}


def _plan(model, *extra, output):
    """Start ``tools/plan_scale.py`` on the shape file ``model``, writing to ``output``."""
    env = subprocess_env()  # plan_scale.py sets its own --devices
    cmd = [sys.executable, "-m", "tools.plan_scale", "--model", str(model), "--json", *extra]
    return popen(cmd, output, cwd=REPO, env=env)


@background("plans")
def _plans(root):
    """The four plans below, started together (each compile is one thread): ``{name: its JSON line}``."""
    model = root / "shape.json"
    model.write_text(json.dumps(SHAPE))
    common = ["--batch", "8", "--seq", "128"]
    args = {
        "one": ["--devices", "1", "--mesh", "1,1,1", *common],
        "eight": ["--devices", "8", "--mesh", "1,8,1", *common, "--only", "update"],
        "full": ["--devices", "1", "--mesh", "1,1,1", *common, "--only", "update"],
        "adapters": ["--devices", "1", "--mesh", "1,1,1", *common, "--only", "update", "--lora", "4"],
    }
    procs = {name: _plan(model, *extra, output=root / f"{name}.txt") for name, extra in args.items()}
    plans = {}
    for name, proc in procs.items():
        output = root / f"{name}.txt"
        assert proc.wait(timeout=600) == 0, output.read_text()[-3000:]
        plans[name] = json.loads(output.read_text().strip().splitlines()[-1])
    return plans


@pytest.mark.slow
@pytest.mark.background("plans")
def test_plan_reports_per_device_memory_and_flops():
    one, eight = (background_result("plans")[name] for name in ("one", "eight"))
    n = one["params"]
    assert n == 512 * 256 * 2 + 4 * (256 * 4 * 64 * 2 + 256 * 2 * 64 * 2 + 3 * 256 * 768 + 2 * 256 + 2 * 64) + 256
    assert "decode" not in eight  # --only update compiles one program
    for f in (one["update"], one["decode"], eight["update"]):
        assert f["peak_bytes"] == f["argument_bytes"] + f["output_bytes"] - f["alias_bytes"] + f["temp_bytes"]
    # FLOPs per step, counted through the layer loop: at least 8 per token and matmul weight (forward 2,
    # backward 4, the rematerialized forward 2); the input embedding is a gather, it multiplies nothing
    tokens = 8 * 128
    assert one["update"]["flops"] >= 8 * (n - 512 * 256) * tokens
    # sharded 8 ways: each device holds 1/8 of the parameters and optimizer state, and does about 1/8 of the FLOPs
    assert eight["update"]["argument_bytes"] < one["update"]["argument_bytes"] / 6
    assert 0.1 < eight["update"]["flops"] / one["update"]["flops"] < 0.16


def test_plan_rejects_a_mesh_that_does_not_match_the_devices(tmp_path):
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.plan_scale",
            "--model",
            "qwen3-0.6b",
            "--devices",
            "8",
            "--mesh",
            "2,2,1",
            "--batch",
            "8",
            "--seq",
            "64",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "--mesh 2,2,1 has 4 devices, --devices is 8" in result.stderr


@pytest.mark.slow
@pytest.mark.background("plans")
def test_plan_with_lora_keeps_adapter_state_and_a_frozen_base():
    """``--lora``: the update's arguments are the frozen bfloat16 base, the float32 adapters and their Adam
    state; full fine-tuning holds float32 master parameters and two float32 moments of every parameter."""
    full, adapters = (background_result("plans")[name] for name in ("full", "adapters"))
    n = full["params"]
    assert adapters["params"] == n and adapters["lora"] == 4 and full["param_dtype"] == "float32"
    assert full["update"]["argument_bytes"] >= 3 * 4 * n  # parameters + Adam's two moments, float32
    assert adapters["update"]["argument_bytes"] < 2 * n + 0.5 * 4 * n  # the bf16 base, adapters with their moments


def test_plan_refuses_bfloat16_master_parameters():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "tools.plan_scale",
            "--model",
            "qwen3-0.6b",
            "--devices",
            "1",
            "--mesh",
            "1,1,1",
            "--batch",
            "8",
            "--seq",
            "64",
            "--param_dtype",
            "bfloat16",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode != 0 and "--param_dtype bfloat16" in result.stderr and "master" in result.stderr
