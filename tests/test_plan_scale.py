"""tools/plan_scale.py: compiler-measured memory and FLOPs of the update and decode steps."""

import json
import pathlib
import subprocess
import sys

import pytest

from envs import subprocess_env

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


def _plan(model, *extra):
    """Start ``tools/plan_scale.py`` on the shape file ``model``; ``_result`` waits for it and reads its JSON line."""
    env = subprocess_env()  # plan_scale.py sets its own --devices
    return subprocess.Popen(
        [sys.executable, "-m", "tools.plan_scale", "--model", str(model), "--json", *extra],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc):
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.slow
def test_plan_reports_per_device_memory_and_flops(tmp_path):
    model = tmp_path / "shape.json"
    model.write_text(json.dumps(SHAPE))
    # the two plans compile their programs side by side (each compile is one thread)
    plans = [
        _plan(model, "--devices", "1", "--mesh", "1,1,1", "--batch", "8", "--seq", "128"),
        _plan(model, "--devices", "8", "--mesh", "1,8,1", "--batch", "8", "--seq", "128", "--only", "update"),
    ]
    one, eight = [_result(p) for p in plans]
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
def test_plan_with_lora_keeps_adapter_state_and_a_frozen_base(tmp_path):
    """``--lora``: the update's arguments are the frozen bfloat16 base, the float32 adapters and their Adam
    state; full fine-tuning holds float32 master parameters and two float32 moments of every parameter."""
    model = tmp_path / "shape.json"
    model.write_text(json.dumps(SHAPE))
    common = ["--devices", "1", "--mesh", "1,1,1", "--batch", "8", "--seq", "128", "--only", "update"]
    full, adapters = [_result(p) for p in [_plan(model, *common), _plan(model, *common, "--lora", "4")]]
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
