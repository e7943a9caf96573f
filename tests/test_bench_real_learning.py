"""benchmarks/bench_real_learning.py: the agent against the best one search, query by query."""

import json

import pytest

import benchmarks.bench_real_learning as bench


def test_task_scores_count_a_failure_as_zero(tmp_path):
    path = tmp_path / "eval_after.jsonl"
    rows = [
        {"task_id": "scifact/1", "status": "ok", "reward": 0.5, "turns": [], "counters": {}},
        {"task_id": "scifact/2", "status": "max_turns", "reward": -1.0, "turns": [], "counters": {}},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.task_scores(path) == {"scifact/1": 0.5, "scifact/2": 0.0}
    path.write_text(path.read_text() + json.dumps(rows[0]) + "\n")
    with pytest.raises(ValueError, match="eval_after.jsonl:3: a second episode of scifact/1"):
        bench.task_scores(path)


def _interval(line):
    mean, bracket = line.split("difference ", 1)[1].split(" (n = ")[0].split(" [")
    lo, hi = (float(x) for x in bracket.rstrip("]").split(", "))
    return float(mean), lo, hi


def test_paired_counts_wins_losses_and_ties_and_brackets_the_mean_difference():
    agent = {"a": 1.0, "b": 0.2, "c": 0.5, "d": 0.5}
    baseline = {"a": 0.4, "b": 0.3, "c": 0.5, "d": 0.5}
    line = bench.paired(agent, baseline)
    assert line.startswith("1 wins, 1 losses, 2 ties, difference ") and line.endswith(": not resolved")
    mean, lo, hi = _interval(line)
    assert mean == pytest.approx(0.125, abs=1e-3) and -0.1 <= lo < mean < hi <= 0.6
    same = bench.paired({"a": 0.3, "b": 0.7}, {"a": 0.1, "b": 0.5})  # every difference +0.2
    assert _interval(same) == pytest.approx((0.2, 0.2, 0.2)) and same.endswith(": separated")
    with pytest.raises(ValueError, match="queries differ: \\['c'\\]"):
        bench.paired({"a": 1.0, "c": 0.0}, {"a": 1.0})


def test_paired_over_seeds_resamples_the_seeds_and_the_queries():
    seeds = [{"a": 1.0, "b": 0.0, "c": 0.5}, {"a": 0.0, "b": 0.0, "c": 0.5}, {"a": 1.0, "b": 0.6, "c": 0.5}]
    baseline = {"a": 0.5, "b": 0.2, "c": 0.5}
    # per-query means 2/3, 0.2, 0.5: a win, a tie and a tie, whatever each seed did alone
    line = bench.paired(seeds, baseline)
    assert line.startswith("1 wins, 0 losses, 2 ties, difference ") and "(n = 3 seeds x 3 queries)" in line
    mean, lo, hi = _interval(line)
    # two-way: a resample can draw seed 1 (a loss on query a) three times
    assert mean == pytest.approx(1 / 18, abs=1e-3) and lo < 0 < hi
    assert bench.paired([seeds[0]], baseline) == bench.paired(seeds[0], baseline)
    with pytest.raises(ValueError, match="queries differ: \\['c'\\]"):
        bench.paired([seeds[0], {"a": 1.0, "b": 0.0}], baseline)


def test_the_sampled_evaluations_are_read_back_and_reported_with_rls_change(tmp_path, capsys):
    def summary(ndcg, failures):
        return {
            "ndcg@10": ndcg,
            "failure_rate": failures,
            "failure_rate_by_reason": {"turn_token_limit": failures} if failures else {},
            "mean_turns": 3.0,
            "tool_calls_per_episode": {"bm25_search": 1.0},
            "repeated_calls_per_episode": 0.0,
            "tool_errors": {"bad_json": 1, "service_error": 3},  # the model's own: the malformed JSON only
            "samples": 2,
        }

    scores = {(0, "warmup"): 0.75, (0, "rl"): 0.70, (1, "warmup"): 0.74, (1, "rl"): 0.73}
    for (seed, stage), ndcg in scores.items():  # written already: read back, no evaluation runs
        where = tmp_path / f"seed_{seed}" / f"sampled_{stage}_k4"
        where.mkdir(parents=True)
        (where / "eval.json").write_text(json.dumps({"scifact": summary(ndcg, 0.25 if seed else 0.0)}))
    found = bench.sampled_evaluations("configs/real_cpu.py", [0, 1], tmp_path, [], 4)
    assert found[1]["rl"]["scifact"]["ndcg@10"] == 0.73
    bench.report_sampled(found, 4)
    out = capsys.readouterr().out
    assert "### scifact, sampled: 4 samples a dev query at the rollout temperature" in out
    row = "| after RL | 1 | 0.730 | 0.25 (turn_token_limit 0.25) | 3.00 | bm25 1.00; repeated 0.00; "
    assert row + "malformed calls 0.50 |" in out
    # two seeds: Student's t with one degree of freedom, 0.745 +- 12.706 x 0.005
    assert "| warmed up | mean [95% CI] | 0.745 [0.681, 0.809] (n = 2 seeds) |" in out
    assert "RL over the warmed-up policy, sampled: -0.030 [-0.284, 0.224] (n = 2 seeds) nDCG@10" in out


def test_the_test_readings_are_read_back_and_reported_with_rls_gain_and_the_baselines(tmp_path, capsys):
    """Readings already written are loaded, not made again (each is one line of the run's ledger)."""
    for seed in (0, 1):
        for stage, policy in (("warmup", [0.2, 0.4, 0.6]), ("rl", [0.5, 0.5, 0.9])):
            where = tmp_path / f"seed_{seed}" / f"test_{stage}"
            where.mkdir(parents=True)
            scores = {"policy": policy, "bm25": [0.3, 0.3, 0.3], "dense": [0.9, 0.9, 0.9], "fusion": [0.5, 0.6, 0.7]}
            ids = ["scifact/1", "scifact/2", "scifact/3"]
            body = {"scifact": {k: dict(zip(ids, [v + 0.01 * seed for v in vs])) for k, vs in scores.items()}}
            (where / "test_scores.json").write_text(json.dumps(body))
    bench.test_report("configs/real_cpu.py", [0, 1], tmp_path, [])
    out = capsys.readouterr().out
    assert "| scifact | 3 | 0.405 [" in out and "(n = 2 seeds x 3 queries) | +0.233 [" in out
    assert "| scifact | bm25 | 0.300 | +0.333 [" in out and "| separated |" in out
    assert "| scifact | dense | 0.900 | -0.267 [" in out
