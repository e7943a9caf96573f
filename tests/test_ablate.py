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
        ("data.curriculum_max_baseline", 0.5),  # RL's tasks only
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


def _fake_run(workdir: pathlib.Path, after: dict, curve: list, rl_steps: int = 12):
    """A finished run's files as the report reads them: ``after`` {task id: (type, nDCG@10)} after RL (before RL
    every query scored 0.1), ``curve`` [(step, multihop dev nDCG@10)] of its periodic evaluations."""
    (workdir / "trajectories").mkdir(parents=True)
    for stage, scores in (("before", {t: (k, 0.1) for t, (k, _) in after.items()}), ("after", after)):
        lines = [
            json.dumps({"task_id": t, "type": k, "status": "ok", "reward": v, "turns": [], "counters": {}})
            for t, (k, v) in scores.items()
        ]
        (workdir / "trajectories" / f"eval_{stage}.jsonl").write_text("\n".join(lines) + "\n")
    multihop = [v for k, v in after.values() if k == "multihop"]
    summary = {
        "before": {"ndcg@10": 0.1, "by_type": {"multihop": {"ndcg@10": 0.1}}},
        "after": {"ndcg@10": 0.5, "failure_rate": 0.0, "by_type": {"multihop": {"ndcg@10": float(np.mean(multihop))}}},
        "rl_steps": rl_steps,
    }
    (workdir / "summary.json").write_text(json.dumps(summary))
    rows = [{"step": s, "eval/by_type/multihop/ndcg@10": v, "eval/ndcg@10": v} for s, v in curve]
    (workdir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_the_report_of_one_task_type_and_the_steps_to_reach_a_score(tmp_path):
    from experiments.ablate_report import markdown, report

    curves = {"turn_reward=none": [[(4, 0.5), (8, 0.95)], [(4, 0.2), (8, 0.3)], [(4, 0.9), (8, 0.92)]]}
    curves["turn_reward=retrieval_gain"] = [[(4, 0.91), (8, 0.95)], [(4, 0.6), (8, 0.93)], [(4, 0.95), (8, 0.9)]]
    for arm, runs in curves.items():
        for seed, curve in enumerate(runs):
            lift = 0.3 if "gain" in arm else 0.0
            after = {"a": ("lookup", 0.9), "b": ("multihop", 0.2 + lift + 0.1 * seed), "c": ("multihop", 0.5 + lift)}
            _fake_run(tmp_path / arm / f"seed_{seed}", after, curve)
    ablation = ablate.Ablation(
        "configs/default.py", ablate.parse_grid(["rl.turn_reward=none,retrieval_gain"]), [0, 1, 2], tmp_path, [], 4
    )
    results = report(ablation, 0.0, focus="multihop", reach=0.9)
    assert results["arms"]["turn_reward=none"]["n"] == {"seeds": 3, "queries": 3}
    focus = results["focus"]
    assert focus["arms"]["turn_reward=none"]["n"] == {"seeds": 3, "queries": 2}  # the lookup query left out
    (pair,) = focus["pairs"]
    assert pair["diff"] == pytest.approx(-0.3) and pair["separated"]
    reach = results["reach"]["arms"]
    # seed 1 of "none" never reaches 0.9: counted at its last step, 12, and the mean marked censored
    assert reach["turn_reward=none"]["steps"] == [8, 12, 4] and reach["turn_reward=none"]["reached"] == 2
    assert reach["turn_reward=none"]["censored"] and not reach["turn_reward=retrieval_gain"]["censored"]
    assert reach["turn_reward=retrieval_gain"]["steps"] == [4, 8, 4]
    (steps,) = results["reach"]["pairs"]
    assert steps["diff"] == pytest.approx((8 + 12 + 4 - 4 - 8 - 4) / 3)
    text = markdown(results)
    assert "Dev nDCG@10 of the multihop queries" in text and "| turn_reward=none | 8, 12, 4 | 2 of 3 |" in text
    with pytest.raises(ValueError, match="no dev query of that type"):
        report(ablation, 0.0, focus="describe")
