"""tools/accelerator_check.sh end to end on CPU, with a tiny model shape instead of Qwen3-0.6B."""

import json
import pathlib
import subprocess

import pytest

from envs import subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 4096,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "tie_word_embeddings": True,
    "max_position_embeddings": 4096,
}


@pytest.mark.slow
@pytest.mark.parametrize("lora_rank", [0, 4])
def test_accelerator_check_runs_rl_steps_and_reports_throughput(tmp_path, lora_rank):
    model = tmp_path / "tiny.json"
    model.write_text(json.dumps(TINY))
    # one length branch (--max_len 512) and the sampler shapes compiled as met: 25 s instead of 76 s
    env = subprocess_env()
    result = subprocess.run(
        [
            "bash",
            "tools/accelerator_check.sh",
            "--model",
            str(model),
            "--steps",
            "2",
            "--prompts",
            "2",
            "--group_size",
            "2",
            "--slots",
            "4",
            "--max_tokens_per_turn",
            "16",
            "--mesh",
            "1,1,1",
            "--dtype",
            "float32",
            "--micro_batches",
            "1",
            "--peak_tflops",
            "1",
            "--max_len",
            "512",
            "--precompile",
            "0",
            "--workdir",
            str(tmp_path / "w"),
            "--lora_rank",
            str(lora_rank),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "sampled tokens/s" in out and "trained tokens/s" in out and "MFU" in out
    assert ("LoRA rank 4 adapters trained" if lora_rank else "every parameter trained") in out
    assert (tmp_path / "w" / "random-tiny" / "tokenizer.json").exists()  # the random checkpoint and its tokenizer
    steps = [json.loads(line) for line in (tmp_path / "w" / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2] and all(s["throughput/trained_tokens_per_s"] > 0 for s in steps)
