"""``experiments.ablate``: one warm-up per seed (and per value of a field the warm-up reads), arms that
start from it with common random numbers and equal their standalone runs, the paired report; and the test
split's one reader, ``experiments.evaluate --split=test``, with its ledger."""

import json
import pathlib
import sys

import jax
import numpy as np
import orbax.checkpoint as ocp
import pytest

from envs import background, background_result, popen, subprocess_env
from test_trainer import SMALL

from configs import default
from experiments import ablate
from tools import compare_runs

REPO = pathlib.Path(__file__).resolve().parents[1]
# zero advantages skip no update and an entropy bonus moves the parameters: the arms differ after 2 steps
# even though a 2-step warm-up scores nothing yet
ARM = [*SMALL, "--config.max_steps=2", "--config.rl.skip_zero_advantage=False"]
GRID = ["--grid", "rl.entropy_coef=0.01,0.03"]


def _ablate(out, *extra):
    cmd = [sys.executable, "-m", "experiments.ablate", "--config=configs/default.py", "--out", str(out), *extra]
    return cmd


@background("ablation")
def _ablation_runs(root: pathlib.Path):
    """An ablation (2 arms x 2 seeds), its rerun, a standalone run of one arm, an ablation over a warm-up
    field, and the test split read twice from the standalone run."""
    env = subprocess_env()
    outputs = {}

    def run(name, cmd):
        proc = popen(cmd, root / f"{name}.log", cwd=REPO, env=env)
        assert proc.wait(timeout=1500) == 0, (root / f"{name}.log").read_text()[-3000:]
        outputs[name] = (root / f"{name}.log").read_text()

    run("ablate", _ablate(root / "abl", *GRID, "--seeds", "0,1", *ARM))
    run("again", _ablate(root / "abl", *GRID, "--seeds", "0,1", *ARM))
    standalone = [sys.executable, "-m", "experiments.run", "--config=configs/default.py", *ARM]
    run("standalone", [*standalone, f"--workdir={root / 'alone'}", "--config.rl.entropy_coef=0.01"])
    run("warmup_grid", _ablate(root / "wgrid", "--grid", "warmup.learning_rate=0.003,0.001", "--seeds", "0", *ARM))
    evaluate = [
        sys.executable,
        "-m",
        "experiments.evaluate",
        "--config=configs/default.py",
        "--split=test",
        f"--checkpoint={root / 'alone'}",
        *ARM,
        "--config.rl.entropy_coef=0.01",
        # the run's test split cut shorter (the same first 4 of its 200): a quick reading
        "--config.data.test_fraction=0",
        "--config.data.test_min=4",
    ]
    run("test1", [*evaluate, f"--out={root / 'test1'}"])
    run("test2", [*evaluate, f"--out={root / 'test2'}"])
    return root, outputs


def _params(workdir, step=2):
    manager = ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "checkpoints")
    restored = manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore()))
    return restored["state"]


def _equal(a, b) -> bool:
    return all(jax.tree.leaves(jax.tree.map(lambda x, y: np.array_equal(np.asarray(x), np.asarray(y)), a, b)))


@pytest.mark.slow
@pytest.mark.background("ablation")
def test_an_ablation_trains_one_warm_up_per_seed_and_its_arms_equal_their_standalone_runs():
    root, out = background_result("ablation")
    results = json.loads((root / "abl" / "results.json").read_text())
    assert results["warmups"]["trained"] == 2 and results["warmups"]["reused"] == 2  # 2 seeds, 2 arms each
    assert len(list((root / "abl" / "warmups").iterdir())) == 2
    assert out["ablate"].count("--stage=warmup") == 2
    assert out["again"].count("done already") == 4 and "--stage=warmup" not in out["again"]
    # the arm with the standalone run's config gives its parameters and optimizer state, bit for bit
    arm, other = root / "abl" / "entropy_coef=0.01" / "seed_0", root / "abl" / "entropy_coef=0.03" / "seed_0"
    alone = _params(root / "alone")
    assert _equal(_params(arm), alone)
    assert not _equal(_params(other)["params"], alone["params"])  # the grid's change does show
    # tools.compare_runs says the same, step metrics included
    assert compare_runs.differences(arm, root / "alone", 2) == []
    assert any(d.startswith("state") for d in compare_runs.differences(other, root / "alone", 2))
    # common random numbers: both arms sampled step 1 from the same warm-up with the same keys
    step1 = [(w / "trajectories" / "step_000001.jsonl").read_text() for w in (arm, other)]
    assert step1[0] == step1[1]
    # the report: per arm mean, interval and n; per pair the paired difference and its verdict
    for r in results["arms"].values():
        assert set(r) >= {"mean", "ci95", "n", "gain"} and r["ci95"][0] <= r["mean"] <= r["ci95"][1]
        assert r["n"] == {"seeds": 2, "queries": 4}
    (pair,) = results["pairs"]
    assert set(pair) == {"a", "b", "diff", "ci95", "separated"}
    assert pair["separated"] == (pair["ci95"][0] > 0 or pair["ci95"][1] < 0)
    assert "| entropy_coef=0.01 | entropy_coef=0.03 |" in (root / "abl" / "results.md").read_text()
    assert (root / "abl" / "results.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
@pytest.mark.background("ablation")
def test_a_grid_field_the_warm_up_reads_gives_each_value_its_own_warm_up():
    root, out = background_result("ablation")
    results = json.loads((root / "wgrid" / "results.json").read_text())
    assert results["warmups"]["trained"] == 2 and out["warmup_grid"].count("--stage=warmup") == 2


@pytest.mark.slow
@pytest.mark.background("ablation")
def test_the_test_split_is_read_through_its_ledger_and_counted():
    root, out = background_result("ablation")
    assert "its test split has now been evaluated 1 time " in out["test1"]
    assert "its test split has now been evaluated 2 times" in out["test2"]
    lines = [json.loads(line) for line in (root / "alone" / "test_evaluations.jsonl").read_text().splitlines()]
    assert len(lines) == 2
    for line in lines:
        assert {"time", "commit", "config_hash", "figures"} <= set(line)
        figures = line["figures"]["synthetic"]
        assert figures["queries"] == 4 and set(figures["baselines"]) == {"bm25", "dense", "fusion"}
    assert lines[0]["config_hash"] == lines[1]["config_hash"] and lines[0]["figures"] == lines[1]["figures"]
    per_query = json.loads((root / "test1" / "test_scores.json").read_text())["synthetic"]
    assert set(per_query) == {"policy", "bm25", "dense", "fusion"} and all(len(v) == 4 for v in per_query.values())
    # the queries it read are test queries: none of them trained or was evaluated in the run
    tested_file = root / "test1" / "synthetic.trajectories.jsonl"
    tested = {json.loads(t)["task_id"] for t in tested_file.read_text().splitlines()}
    seen = {
        json.loads(t)["task_id"]
        for p in (root / "alone" / "trajectories").glob("*.jsonl")
        for t in p.read_text().splitlines()
    }
    assert len(tested) == 4 and not tested & seen


def test_the_warm_up_key_changes_with_what_the_warm_up_reads_only():
    base = default.get_config()
    key = ablate.warmup_key(base)
    for field, value in (
        ("rl.loss", "cispo"),
        ("optim.learning_rate", 1e-5),
        ("max_steps", 3),
        ("eval.every_steps", 2),
    ):
        config = default.get_config()
        section, _, name = field.rpartition(".")
        setattr(config[section] if section else config, name, value)
        assert ablate.warmup_key(config) == key, field
    for field, value in (("seed", 1), ("warmup.learning_rate", 1e-3), ("rl.logprob_chunk", 64), ("model.lora_rank", 8)):
        config = default.get_config()
        section, _, name = field.rpartition(".")
        setattr(config[section] if section else config, name, value)
        assert ablate.warmup_key(config) != key, field


def test_the_ablation_refuses_a_seed_override_and_bad_seeds():
    with pytest.raises(SystemExit, match="--seeds"):
        ablate.main(["--grid", "rl.loss=ppo", "--config.seed=3"])
    with pytest.raises(SystemExit, match="distinct"):
        ablate.parse_seeds("0,0")
    assert ablate.parse_seeds("0,1,2,3,4") == [0, 1, 2, 3, 4]


def test_grid_fields_joined_by_plus_vary_together():
    grid = ablate.parse_grid(["model.lora_rank+warmup.train_base=0+False,8+True", "optim.learning_rate=3e-4,1e-3"])
    cells = ablate.grid_cells(grid)
    assert len(cells) == 4
    assert cells[0] == (("model.lora_rank", "0"), ("warmup.train_base", "False"), ("optim.learning_rate", "3e-4"))
    assert cells[3] == (("model.lora_rank", "8"), ("warmup.train_base", "True"), ("optim.learning_rate", "1e-3"))
    assert ablate.cell_name(cells[3]) == "lora_rank=8,train_base=True,learning_rate=1e-3"
    with pytest.raises(SystemExit, match="gives 1 values for 2 fields"):
        ablate.parse_grid(["model.lora_rank+warmup.train_base=0+False,8"])
    assert ablate.grid_cells(ablate.parse_grid(["rl.loss=ppo,is"])) == [(("rl.loss", "ppo"),), (("rl.loss", "is"),)]
