"""Multi-process: two local CPU processes with 4 devices each train (warm-up, 2 RL steps) to the same
parameters as one process with 8 devices; the run's work directory is written once."""

import json
import pathlib
import socket
import subprocess
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from envs import background, background_result, popen, subprocess_env

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = [
    "--config=configs/default.py",
    "--config.global_batch_size=4",
    "--config.rollout.group_size=2",
    "--config.rollout_max_concurrency=8",
    "--config.warmup.steps=2",
    "--config.warmup.share_prefix=False",
    "--config.warmup.augment=0",
    "--config.data.max_train_per_collection=96",  # a smaller pool of demonstrations to render
    "--config.data.max_eval_tasks=3",
    "--config.checkpoint.every_steps=1",
    "--config.rollout.asynchronous=False",
    "--config.rollout.tool_workers=0",
    "--config.log.progress=False",
    "--config.model.tiny_layers=1",
    "--config.rl.mini_batches=1",
    "--config.rollout.max_tokens_per_turn=48",  # the default's demonstrations have turns of up to 47 tokens
    "--config.rollout.decode_chunk=48",
    "--config.max_steps=2",
    "--config.model.mesh_shape=(-1,1,1)",
    "--config.rl.micro_batches=1",
    "--config.rl.length_bucket=512",
    "--config.optim.warmup_steps=0",
    "--config.rollout.precompile=False",
]
# One mini-batch: the first RL step's advantages are all 0, and only a first mini-batch is computed exactly
# (train_step.update_step); a later one's ~1-ulp KL noise, which differs between device layouts, Adam turns
# into a full-size step, so two mini-batches made the 2x4 and 1x8 runs differ by 6e-4 after the synthetic
# collection changed (the trajectories of both were identical)


def _env(devices: int) -> dict:
    env = subprocess_env(devices)
    for name in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(name, None)
    return env


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _final_state(workdir: pathlib.Path, step: int, like=None):
    """The checkpoint's state and record, onto this process's first device (``like``: the target
    shapes; needed for a checkpoint written by processes whose devices this one does not have)."""
    manager = ocp.CheckpointManager(workdir.absolute() / "checkpoints")
    target = (
        None
        if like is None
        else jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
            ),
            like,
        )
    )
    restored = manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target), record=ocp.args.JsonRestore())
    )
    return restored["state"], restored["record"]


@background("multihost")
def _one_and_two_processes(root):
    """The run in one process of 8 devices and in two of 4, all three started together (the programs of 8
    devices and of 4 differ): ``root`` (work directories ``root / name``) and ``{"one" | "two": (return codes,
    outputs)}``."""
    port = _free_port()
    runs = {"one": [([], 8, root / "one.txt")]}
    runs["two"] = [
        ([f"--coordinator_address=localhost:{port}", "--num_processes=2", f"--process_id={i}"], 4, root / f"two{i}.txt")
        for i in range(2)
    ]
    procs = {
        name: [
            popen(
                [sys.executable, "-m", "experiments.run", *TINY, f"--workdir={root / name}", *extra],
                output,
                cwd=REPO,
                env=_env(devices),
            )
            for extra, devices, output in started
        ]
        for name, started in runs.items()
    }
    return root, {
        name: ([p.wait(timeout=900) for p in procs[name]], [output.read_text() for _, _, output in runs[name]])
        for name in runs
    }


@pytest.mark.slow
@pytest.mark.background("multihost")
def test_two_processes_of_four_devices_equal_one_process_of_eight():
    tmp_path, runs = background_result("multihost")
    for name, (codes, outputs) in runs.items():
        for i, (code, out) in enumerate(zip(codes, outputs)):
            assert code == 0, f"{name}, process {i}:\n" + out[-4000:]
    assert "process 1 of 2: 4 local devices, 8 in all" in runs["two"][1][1]
    one, record_one = _final_state(tmp_path / "one", 2)
    two, record_two = _final_state(tmp_path / "two", 2, like=one)
    assert record_one["rl_step"] == record_two["rl_step"] == 2
    assert record_one["cursor"] == record_two["cursor"]
    assert int(one["step"]) == int(two["step"]) == 2  # 2 RL steps x 1 mini-batch
    before = _final_state(tmp_path / "one", 1)[0]  # checkpoints keep the last 2 steps
    moved = max(
        jax.tree.leaves(
            jax.tree.map(
                lambda a, b: float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()),
                before["params"],
                one["params"],
            )
        )
    )
    assert moved > 1e-4  # the RL step changed the parameters, so the equality below says something
    differ = jax.tree.leaves(
        jax.tree.map(lambda a, b: float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max()), one, two)
    )
    # float32 sums in another order (4 + 4 devices against 8): Adam divides each gradient by its running scale, so
    # a near-zero gradient's rounding can move its parameter by a visible fraction of the learning rate (3e-4);
    # 1e-5 held on the earlier training split by a small margin, 1.1e-5 on today's: the bound is a tenth of lr
    assert max(differ) < 3e-5, max(differ)

    # every process generated its share, the primary wrote each step's groups once, in request order
    for workdir in ("one", "two"):
        lines = (tmp_path / workdir / "trajectories" / "step_000002.jsonl").read_text().splitlines()
        assert [(r["group_id"], r["sample_index"]) for r in map(json.loads, lines)] == [
            (g, s) for g in range(4) for s in range(2)
        ]
    metrics = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    summary_one = json.loads((tmp_path / "one" / "summary.json").read_text())
    summary_two = json.loads((tmp_path / "two" / "summary.json").read_text())
    assert summary_one["after"]["queries"] == summary_two["after"]["queries"] == 3
    assert summary_one["after"]["ndcg@10"] == pytest.approx(summary_two["after"]["ndcg@10"], abs=1e-6)


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_incomplete_multiprocess_flags_name_what_is_missing():
    result = subprocess.run(
        [sys.executable, "-m", "experiments.run", *TINY, "--workdir=/nonexistent/never", "--num_processes=2"],
        cwd=REPO,
        env=_env(1),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode != 0
    assert "missing: coordinator_address, process_id" in result.stderr
