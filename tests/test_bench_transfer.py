"""benchmarks/bench_transfer.py: which folders train and which is held out, and the held-out collection's row."""

import numpy as np
import pytest

import benchmarks.bench_transfer as bench

FOLDERS = "../shared/data/scifact,../shared/data/cranfield,../shared/data/musique"


def test_the_held_out_collection_is_named_by_its_folder_and_the_others_train():
    assert bench.partition(FOLDERS, "cranfield") == (
        "../shared/data/scifact,../shared/data/musique",
        "../shared/data/cranfield",
    )
    with pytest.raises(
        SystemExit, match=r"--holdout 'nfcorpus': not a collection of data.folders \(scifact, cranfield"
    ):
        bench.partition(FOLDERS, "nfcorpus")
    with pytest.raises(SystemExit, match="no other collection to train on"):
        bench.partition("../shared/data/scifact", "scifact")


def _reading(policy, bm25, dense, fusion):
    ids = [f"cranfield/{i}" for i in range(len(policy))]
    columns = {"policy": policy, "bm25": bm25, "dense": dense, "fusion": fusion}
    return {"cranfield": {key: dict(zip(ids, values)) for key, values in columns.items()}}


def test_the_row_sets_the_policy_against_the_best_one_search_of_the_same_queries():
    tuned = _reading([0.5, 0.4, 0.9, 0.2], [0.2, 0.2, 0.2, 0.2], [0.6, 0.2, 0.8, 0.2], [0.4, 0.3, 0.8, 0.1])
    cold = _reading([0.5, 0.2, 0.7, 0.2], [0.2, 0.2, 0.2, 0.2], [0.6, 0.2, 0.8, 0.2], [0.4, 0.3, 0.8, 0.1])
    row = bench.transfer_row("cranfield", cold, tuned)
    assert row["queries"] == 4 and row["best"] == "dense"  # dense 0.45 over fusion 0.40 and BM25 0.20
    assert row["ratio"] == pytest.approx(0.5 / 0.45)
    assert row["rl"].mean == pytest.approx(0.5) and row["cold"].mean == pytest.approx(0.4)
    assert row["gain"].mean == pytest.approx(0.1) and row["gain"].low >= 0  # never below the cold start
    value, diff = row["against"]["bm25"]
    assert value == pytest.approx(0.2) and diff.mean == pytest.approx(0.3) and diff.low > 0
    assert np.isclose(row["against"]["dense"][1].mean, 0.05)
    with pytest.raises(ValueError, match="not the held-out 'scifact' alone"):
        bench.transfer_row("scifact", cold, tuned)
