"""End to end: experiments.run, checkpoint/resume (SIGKILL, SIGTERM), overrides, the real-model path."""

import json
import os
import pathlib
import signal
import subprocess
import sys
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
SMALL = ["--config.global_batch_size=2", "--config.rollout.group_size=2", "--config.rollout_max_concurrency=4",
         "--config.warmup.steps=2", "--config.data.max_eval_tasks=2", "--config.checkpoint.every_steps=1",
         "--config.rollout.asynchronous=False", "--config.rollout.tool_workers=0", "--config.rollout.max_staleness=0",
         "--config.log.progress=False", "--config.model.tiny_layers=1", "--config.rl.mini_batches=1",
         "--config.rollout.max_tokens_per_turn=24", "--config.rollout.decode_chunk=24"]


def _env():
    env = dict(os.environ)
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user would run it
    env["JAX_PLATFORMS"] = "cpu"
    return env


def _run(workdir, *extra, config="configs/default.py", wait=True):
    cmd = [sys.executable, "-m", "experiments.run", f"--config={config}", f"--workdir={workdir}", *SMALL, *extra]
    if not wait:
        return subprocess.Popen(cmd, cwd=REPO, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    result = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result.stdout + result.stderr


def _final_state(workdir, step):
    manager = ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "checkpoints")
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(), meta=ocp.args.JsonRestore()))
    return restored["state"], restored["meta"]


def _wait_for_checkpoint(workdir, step, proc, timeout=600):
    target = pathlib.Path(workdir) / "checkpoints" / str(step)
    deadline = time.time() + timeout
    while not target.exists():
        if proc.poll() is not None:
            raise AssertionError(f"run ended before checkpoint {step}: {proc.stdout.read()[-3000:]}")
        if time.time() > deadline:
            raise AssertionError(f"no checkpoint {step} after {timeout} s")
        time.sleep(0.2)


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(tmp_path):
    steps = ["--config.max_steps=3"]
    out = _run(tmp_path / "straight", *steps)
    assert "[before RL] validation: nDCG@10" in out and "[after RL] validation: nDCG@10" in out
    summary = json.loads((tmp_path / "straight" / "summary.json").read_text())
    for phase in ("before", "after"):
        assert {"ndcg@10", "failure_rate", "mean_turns"} <= set(summary[phase])

    proc = _run(tmp_path / "killed", *steps, wait=False)
    _wait_for_checkpoint(tmp_path / "killed", 1, proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    out = _run(tmp_path / "killed", *steps)
    assert "resumed from" in out

    a, meta_a = _final_state(tmp_path / "straight", 3)
    b, meta_b = _final_state(tmp_path / "killed", 3)
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), a, b)
    assert meta_a["cursor"] == meta_b["cursor"] == {"epoch": 0, "index": 6, "shuffle_seed": 0}
    assert meta_a["staleness"] == meta_b["staleness"]
    # the default's KL reference is written once and restored on resume (else the runs would differ)
    assert (tmp_path / "killed" / "reference").is_dir()
    # observability: scalars, trajectory records, the viewer
    records = [json.loads(line) for line in (tmp_path / "straight/trajectories/step_000002.jsonl").read_text().splitlines()]
    assert len(records) == 4 and all(r["param_versions"] == [1] for r in records if r["num_sampled_tokens"])
    assert {"text", "calls", "stop_reason", "latency_s"} <= set(records[0]["turns"][0])
    metrics = [json.loads(line) for line in (tmp_path / "straight/metrics.jsonl").read_text().splitlines()]
    for key in ("reward/mean", "reward/ndcg@10", "episodes/failure_rate", "episodes/mean_turns", "train/loss",
                "train/clipfrac", "train/approx_kl", "train/kl", "train/entropy", "train/grad_norm", "staleness/mean",
                "throughput/trained_tokens_per_s", "throughput/sampled_tokens_per_s"):
        assert key in metrics[-1], key
    assert list((tmp_path / "straight/tensorboard").glob("events.out.tfevents.*"))
    view = subprocess.run([sys.executable, "scripts/show_trajectories.py", "--workdir", str(tmp_path / "straight"), "--limit", "2"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert view.returncode == 0 and "assistant:" in view.stdout and "reward" in view.stdout


@pytest.mark.slow
def test_sigterm_writes_a_checkpoint(tmp_path):
    proc = _run(tmp_path, "--config.max_steps=40", "--config.checkpoint.every_steps=100", wait=False)
    _wait_for_checkpoint(tmp_path, 0, proc)  # the pre-RL checkpoint
    deadline = time.time() + 600
    metrics = tmp_path / "metrics.jsonl"
    while not metrics.exists() and time.time() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=600)[0]
    assert proc.returncode != 0 and "SIGTERM: checkpoint written" in out, out[-2000:]
    steps = sorted(int(p.name) for p in (tmp_path / "checkpoints").iterdir() if p.name.isdigit())
    assert steps[-1] >= 1
    _, meta = _final_state(tmp_path, steps[-1])
    assert meta["rl_step"] == steps[-1]


def test_overrides_and_typos():
    cmd = [sys.executable, "-m", "experiments.run", "--config=configs/default.py", "--config.rl.lossy=ppo"]
    result = subprocess.run(cmd, cwd=REPO, env=_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode != 0 and "lossy" in result.stderr
    from configs import default, qwen3_search
    from mtrl_jax.trainer import update_config

    config = default.get_config()
    config.rl.loss, config.rl.advantage, config.rl.clip_high = "cispo", "rloo", 3.0
    ucfg = update_config(config)
    assert ucfg.objective.loss == "cispo" and ucfg.advantage == "rloo" and dict(ucfg.objective.loss_options) == {"clip_high": 3.0}
    with pytest.raises(AttributeError):
        config.rl.lossy = "ppo"
    assert qwen3_search.get_config().model.dtype == "bfloat16"


@pytest.mark.slow
def test_real_checkpoint_path_on_a_shared_collection(tmp_path, shared_data):
    from mtrl_jax.chat import train_tokenizer
    from mtrl_jax.model import ModelConfig, init_params, save_hf_checkpoint
    from mtrl_jax.model.transformer import Transformer

    texts = [line for line in (shared_data / "cranfield/corpus.jsonl").read_text().splitlines()[:300]]
    tokenizer = train_tokenizer(texts + ['<tool_call>{"name": "bm25_search"}</tool_call>'] * 10, 512)
    ckpt = tmp_path / "qwen3_tiny"
    cfg = ModelConfig(vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=128, num_layers=2,
                      num_heads=4, num_kv_heads=2, head_dim=16, model_type="qwen3", qk_norm=True, tie_word_embeddings=True)
    save_hf_checkpoint(Transformer(cfg), init_params(cfg, jax.random.PRNGKey(0)), ckpt)
    tokenizer.save(str(ckpt / "tokenizer.json"))
    out = _run(tmp_path / "run", f"--config.model.checkpoint={ckpt}", "--config.model.dtype=float32",
               "--config.model.compute_dtype=float32", "--config.model.mesh_shape=(1,1,1)",
               f"--config.data.folders={shared_data / 'cranfield'}", "--config.search.cache_dir=",
               "--config.max_steps=2", "--config.rollout.max_len=4096", "--config.rl.micro_batches=1",
               "--config.rl.length_bucket=256", "--config.eval.every_steps=0", "--config.model.remat=False",
               config="configs/qwen3_search.py")
    summary = json.loads((tmp_path / "run/summary.json").read_text())
    assert summary["rl_steps"] == 2 and "ndcg@10" in summary["after"]
    assert "[after RL] validation" in out


def test_resuming_with_kl_but_no_reference_is_an_error(tmp_path):
    from configs import default
    from mtrl_jax.trainer import Run

    config = default.get_config()
    config.data.max_eval_tasks, config.rollout_max_concurrency = 2, 4
    run = Run(config, tmp_path)
    with pytest.raises(FileNotFoundError, match=r"reference: rl.kl_coef is set but this run has no KL reference"):
        run.restore_reference()
    run.save_reference()
    restored = run.restore_reference()
    jax.tree.map(lambda x, y: np.testing.assert_array_equal(np.asarray(x), np.asarray(y)), restored, run.state.params)
    run.collector.close()
    run.eval_collector.close()
