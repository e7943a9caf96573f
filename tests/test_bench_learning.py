"""benchmarks/bench_learning.py: the hop diagnostics read from the RL steps' trajectories."""

import math
import pathlib

import benchmarks.bench_learning as bench
from mtrl_jax.rollout.trajectory import Trajectory

REPO = pathlib.Path(__file__).resolve().parents[1]


def _episode(kind, searches, reward, grades):
    t = Trajectory(f"synthetic/{kind}-0", 0, 0, f"synthetic/{kind}", query="q")
    t.turns = [
        {
            "index": i,
            "text": "",
            "stop_reason": "end_of_turn",
            "calls": [{"name": "bm25_search", "arguments": {"query": "x"}, "doc_ids": ids, "error": None}],
        }
        for i, ids in enumerate(searches)
    ]
    t.turns.append(
        {
            "index": len(searches),
            "text": "<answer></answer>",
            "stop_reason": "end_of_turn",
            "calls": [{"name": "", "arguments": {}, "doc_ids": [], "error": "parse_error: no JSON"}],
        }
    )
    t.reward, t.status, t.grades = reward, "ok", grades
    return t.to_json(1)


def test_training_hops_split_the_steps_into_quarters_and_tell_hops_that_found_something(tmp_path):
    folder = tmp_path / "trajectories"
    folder.mkdir()
    (folder / "eval_before.jsonl").write_text(
        _episode("multihop", [["d1"], ["d2"]], 0.9, {"d2": 2}) + "\n"
    )  # not a step
    for step in range(1, 9):
        lines = [_episode("lookup", [["d5"]], 1.0, {"d5": 2})]
        if step <= 2:  # the first quarter: two hops that find nothing new, one episode without a hop
            lines += [
                _episode("multihop", [["d1"], ["d1", "d9"]], 0.2, {"d1": 1, "d9": 0}),
                _episode("multihop", [["d1"], []], 0.4, {"d1": 1}),
                _episode("multihop", [["d1"]], 0.3, {"d1": 1}),
            ]
        elif step >= 7:  # the last quarter: one hop of two finds the part (grade 2)
            lines += [
                _episode("multihop", [["d1"], ["d2", "d1"]], 0.9, {"d1": 1, "d2": 2}),
                _episode("multihop", [["d1"], ["d7"]], 0.1, {"d1": 1, "d7": 0}),
            ]
        (folder / f"step_{step:06d}.jsonl").write_text("\n".join(lines) + "\n")
    hops = bench.training_hops(tmp_path)
    early, late = hops["synthetic/multihop"]["early"], hops["synthetic/multihop"]["late"]
    assert early["episodes"] == 6 and abs(early["hop_share"] - 4 / 6) < 1e-9
    assert (
        abs(early["reward_hop"] - 0.3) < 1e-9 and abs(early["reward_single"] - 0.3) < 1e-9 and early["hop_found"] == 0.0
    )
    assert late["episodes"] == 4 and late["hop_share"] == 1.0 and late["hop_found"] == 0.5
    assert abs(late["reward_hop"] - 0.5) < 1e-9 and math.isnan(late["reward_single"])
    lookup = hops["synthetic/lookup"]["late"]  # a failed parse is not a search
    assert lookup["episodes"] == 2 and lookup["hop_share"] == 0.0 and math.isnan(lookup["hop_found"])
