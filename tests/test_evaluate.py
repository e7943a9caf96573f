"""Evaluation metrics against hand-computed trajectories; the evaluation job and the ablation runner."""

import itertools
import json
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from envs import subprocess_env

from mtrl_jax.evaluate import comparison_table
from mtrl_jax.metrics import max_at_k, pass_at_k, summarize
from mtrl_jax.rollout.trajectory import Trajectory

REPO = pathlib.Path(__file__).resolve().parents[1]


def _traj(reward, status="ok", turns=2, calls=None, kind=""):
    t = Trajectory("t", 0, 0, kind)
    t.reward, t.status, t.turns = reward, status, [{}] * turns
    t.counters = {f"tool_calls/{k}": v for k, v in (calls or {}).items()}
    return t


def test_summarize_hand_computed():
    # two queries x 3 samples; failures count 0 in nDCG
    trajs = [
        _traj(0.9, calls={"bm25_search": 1}),
        _traj(-1.0, "max_turns", 4, {"bm25_search": 4}),
        _traj(0.3, calls={"vector_search": 1}),
        _traj(0.0),
        _traj(-1.0, "turn_token_limit", 1),
        _traj(0.6, turns=3, calls={"bm25_search": 1, "vector_search": 1}),
    ]
    m = summarize(trajs, samples_per_task=3, k=2, tau=0.5)
    assert m["queries"] == 2 and m["samples"] == 6
    assert m["ndcg@10"] == pytest.approx((0.9 + 0 + 0.3 + 0 + 0 + 0.6) / 6)
    assert m["failure_rate"] == pytest.approx(2 / 6)
    assert m["failure_rate_by_reason"] == {"max_turns": pytest.approx(1 / 6), "turn_token_limit": pytest.approx(1 / 6)}
    assert m["mean_turns"] == pytest.approx((2 + 4 + 2 + 2 + 1 + 3) / 6)
    assert m["tool_calls_per_episode"] == {"bm25_search": pytest.approx(6 / 6), "vector_search": pytest.approx(2 / 6)}
    # pass@2 at tau 0.5: query 1 has 1 success of 3 -> 1 - C(2,2)/C(3,2) = 2/3; query 2 has 1 of 3 -> 2/3
    assert m["pass@2"] == pytest.approx(2 / 3)
    # max@2: query 1 scores {0.9, 0, 0.3}: pairs' maxima 0.9, 0.9, 0.3 -> 0.7; query 2 {0, 0, 0.6}: 0, 0.6, 0.6 -> 0.4
    assert m["max@2"] == pytest.approx((0.7 + 0.4) / 2)


def test_summarize_breaks_the_metrics_down_by_task_type():
    trajs = [
        _traj(0.9, kind="c/a"),
        _traj(0.3, kind="c/a"),
        _traj(-1.0, "max_turns", 4, kind="c/b"),
        _traj(0.6, turns=3, kind="c/b"),
        _traj(0.2, kind="c/a"),
        _traj(0.4, kind="c/a"),
    ]
    m = summarize(trajs, samples_per_task=2, k=2)
    assert set(m["by_type"]) == {"c/a", "c/b"}
    a, b = m["by_type"]["c/a"], m["by_type"]["c/b"]
    assert (
        a["queries"] == 2
        and a["ndcg@10"] == pytest.approx(0.45)
        and a["failure_rate"] == 0
        and a["pass@2"] == pytest.approx(0.5)
    )
    assert (
        b["queries"] == 1 and b["ndcg@10"] == pytest.approx(0.3) and b["failure_rate_by_reason"] == {"max_turns": 0.5}
    )
    assert b["mean_turns"] == pytest.approx(3.5) and "by_type" not in a


def test_pass_and_max_at_k_match_enumeration():
    rng = np.random.default_rng(0)
    for n in range(2, 7):
        values = np.round(rng.uniform(-1, 1, size=n), 2)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(values, k))
            assert max_at_k(values, k) == pytest.approx(np.mean([max(s) for s in subsets]))
            c = int((values >= 0.2).sum())
            assert pass_at_k(n, c, k) == pytest.approx(np.mean([any(v >= 0.2 for v in s) for s in subsets]))


def test_comparison_table():
    table = comparison_table(
        {"syn": {"ndcg@10": 0.4, "failure_rate": 0.1}}, {"syn": {"ndcg@10": 0.5, "failure_rate": 0.0}}
    )
    assert "| syn | ndcg@10 | 0.4000 | 0.5000 | +0.1000 (+25.0%) |" in table
    assert "| syn | failure_rate | 0.1000 | 0.0000 | -0.1000 (-100.0%) |" in table


TINY = [
    "--config.warmup.steps=0",
    "--config.data.max_eval_tasks=4",
    "--config.rollout.max_tokens_per_turn=8",
    "--config.rollout.decode_chunk=8",
    "--config.model.tiny_layers=1",
    "--config.rollout_max_concurrency=8",
    "--config.rl.micro_batches=1",
    "--config.rl.length_bucket=512",
    # the shapes a few steps meet, compiled as met (tests/test_trainer.py's greedy run precompiles them all)
    "--config.rollout.precompile=False",
]


@pytest.mark.slow
def test_evaluation_job_is_deterministic_and_compares(tmp_path):
    def evaluate(out, *extra):
        cmd = [
            sys.executable,
            "-m",
            "experiments.evaluate",
            "--config=configs/default.py",
            f"--out={out}",
            "--samples=2",
            *TINY,
            *extra,
        ]
        result = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=900)
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stdout

    evaluate(tmp_path / "a")
    out = evaluate(tmp_path / "b", f"--compare={tmp_path / 'a'}")
    a, b = (json.loads((tmp_path / x / "eval.json").read_text()) for x in "ab")
    assert a == b  # same seed, same numbers
    assert (tmp_path / "a/synthetic.run").read_text() == (tmp_path / "b/synthetic.run").read_text()
    m = a["synthetic"]
    for key in (
        "queries",
        "ndcg@10",
        "failure_rate",
        "failure_rate_by_reason",
        "mean_turns",
        "tool_calls_per_episode",
        "pass@2",
        "max@2",
    ):
        assert key in m
    assert m["queries"] == 4 and "| synthetic |" in (tmp_path / "a/eval.md").read_text()
    assert sum(v["queries"] for v in m["by_type"].values()) == 4 and all(
        k.startswith("synthetic/") for k in m["by_type"]
    )
    if len(m["by_type"]) > 1:
        assert "| synthetic · synthetic/" in (tmp_path / "a/eval.md").read_text()
    compare = (tmp_path / "b/compare.md").read_text()
    assert "fine-tuned" in out
    # identical runs: every metric row shows no change ("+0.0%", or "n/a" where the base value is 0)
    rows = [line for line in compare.splitlines() if line.startswith("| synthetic |")]
    assert rows and all(line.endswith(("+0.0000 (+0.0%) |", "+0.0000 (n/a) |")) for line in rows), compare


@pytest.mark.slow  # kept out of the quick subset (under 3 minutes); CI runs it
def test_evaluating_a_missing_work_directory_creates_nothing(tmp_path):
    cmd = [
        sys.executable,
        "-m",
        "experiments.evaluate",
        "--config=configs/default.py",
        f"--out={tmp_path / 'out'}",
        f"--checkpoint={tmp_path / 'typo'}",
        *TINY,
    ]
    result = subprocess.run(cmd, cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode != 0 and f"{tmp_path / 'typo'}: not a training work directory" in result.stderr
    assert not (tmp_path / "typo").exists()


def test_a_per_collection_evaluation_cap_keeps_the_split(shared_data):
    """``data.max_eval_per_collection`` evaluates the first N held-out queries of each collection; the
    training tasks, and which queries are held out, do not change."""
    from configs import default
    from mtrl_jax.setup import build_data

    config = default.get_config()
    config.data.synthetic = False
    config.data.folders = f"{shared_data / 'cranfield'},{shared_data / 'scifact'}"
    config.data.weights = "1,1"
    config.data.dev_min = 25
    _, train, val = build_data(config)
    config.data.max_eval_per_collection = 10
    _, train_capped, val_capped = build_data(config)
    assert [t.task_id for t in train_capped] == [t.task_id for t in train]
    by_collection = {name: [t.task_id for t in val if t.corpus == name] for name in ("cranfield", "scifact")}
    assert all(len(ids) >= 25 for ids in by_collection.values())
    assert [t.task_id for t in val_capped] == by_collection["cranfield"][:10] + by_collection["scifact"][:10]


def test_search_headroom_scores_the_agents_moves_as_the_baselines_do(shared_data):
    """``tools.search_headroom``: its one-search BM25 and dense rows are the bench's baselines on the same
    held-out queries; every strategy is a ranking of the collection's documents; the best per query
    bounds every strategy it picks from; training and held-out queries are kept apart."""
    from configs import default
    from mtrl_jax.evaluate import single_search_baselines
    from mtrl_jax.setup import build_data
    from tools.search_headroom import BEST, headroom, table

    config = default.get_config()
    config.data.synthetic = False
    config.data.folders = f"{shared_data / 'cranfield'}"
    config.data.dev_min = 25
    results = headroom(config)
    held_out, train = results["dev"]["cranfield"], results["train"]["cranfield"]
    baselines = single_search_baselines(config)["cranfield"]
    assert held_out["queries"] == baselines["queries"] == 25
    assert abs(held_out["bm25"] - baselines["bm25"]) < 1e-9 and abs(held_out["dense"] - baselines["dense"]) < 1e-9
    for tool in ("bm25", "dense", "fusion"):  # the per-query scores the bench sets the agent against
        by_task = baselines["by_task"][tool]
        assert len(by_task) == 25 and abs(np.mean(list(by_task.values())) - baselines[tool]) < 1e-9
    _, train_tasks, _ = build_data(config)
    assert train["queries"] == len({t.task_id for t in train_tasks if t.qrels})
    for m in (held_out, train):
        picked = [v for s, v in m.items() if s not in ("queries", BEST)]
        assert max(picked) <= m[BEST] <= 1.0
        assert len(set(round(v, 6) for v in picked)) > 1  # the moves do rank differently
    assert "| dev | cranfield (25) |" in table(results)
