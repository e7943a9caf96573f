"""Train / dev / test splits, the test split's single reader, and the interval functions against scipy."""

import ast
import json
import pathlib
import random

import numpy as np
import pytest
from scipy import stats as scipy_stats

from configs import default, real_cpu
from mtrl_jax import stats
from mtrl_jax.data import collection as col
from mtrl_jax.data.synthetic import make_synthetic_collection
from mtrl_jax.setup import build_data, load_collections, split_sizes

REPO = pathlib.Path(__file__).resolve().parents[1]


def _ids(tasks):
    return {t.task_id for t in tasks}


def test_the_three_splits_are_disjoint_and_cover_every_task():
    tasks = make_synthetic_collection(0).tasks
    sizes = split_sizes(default.get_config())
    train, dev = col.split(tasks, sizes)
    test = col.test_split(tasks, sizes)
    assert (len(train), len(dev), len(test)) == (500, 200, 200)  # the default's dev and test: 200 each
    assert not _ids(train) & _ids(dev) and not _ids(train) & _ids(test) and not _ids(dev) & _ids(test)
    assert _ids(train) | _ids(dev) | _ids(test) == _ids(tasks)
    # the held-out split of earlier versions (5%, the same hash) is inside dev: no published figure was on test
    _, held_out = col.split(tasks, col.SplitSizes(0.05, 0, 0.0, 0))
    assert len(held_out) == 45 and _ids(held_out) <= _ids(dev)


def test_the_splits_are_stable_when_a_files_lines_are_reordered(tmp_path):
    rows = [{"_id": f"q{i}", "text": f"question {i}"} for i in range(60)]
    for name, order in (("a", rows), ("b", random.Random(0).sample(rows, len(rows)))):
        folder = tmp_path / name / "c"
        folder.mkdir(parents=True)
        (folder / "corpus.jsonl").write_text(json.dumps({"_id": "d1", "title": "t", "text": "x"}) + "\n")
        (folder / "queries.jsonl").write_text("".join(json.dumps(r) + "\n" for r in order))
        lines = [f"{r['_id']}\td1\t1" for r in order]
        (folder / "qrels.tsv").write_text("query-id\tcorpus-id\tscore\n" + "\n".join(lines) + "\n")
    sizes = col.SplitSizes(0.1, 5, 0.1, 5)
    a, b = (col.load_beir(tmp_path / name / "c").tasks for name in "ab")
    for pick in (
        lambda t: col.split(t, sizes)[0],
        lambda t: col.split(t, sizes)[1],
        lambda t: col.test_split(t, sizes),
    ):
        assert _ids(pick(a)) == _ids(pick(b))
    assert len(col.split(a, sizes)[1]) == 6 and len(col.test_split(a, sizes)) == 6
    # a task added moves no other task between splits
    more = a + [col.Task("c/new", "q", {"d1": 1}, "c")]
    assert _ids(col.split(more, sizes)[1]) - {"c/new"} <= _ids(col.split(a, sizes)[1]) | _ids(col.test_split(a, sizes))


def test_a_small_collection_keeps_training_tasks():
    tasks = [col.Task(f"c/{i}", "q", {"d": 1}, "c") for i in range(41)]  # DBpedia-entity's judged queries
    sizes = col.SplitSizes(0.1, 25, 0.1, 25)
    train, dev = col.split(tasks, sizes)
    assert (len(train), len(dev), len(col.test_split(tasks, sizes))) == (8, 25, 8)


def test_the_run_never_holds_a_test_task(shared_data):
    for config in (default.get_config(), real_cpu.get_config()):
        if not config.data.synthetic:
            config.data.folders = ",".join(
                str(shared_data / p.rsplit("/", 1)[-1]) for p in config.data.folders.split(",")
            )
        test = {
            t.task_id for c in load_collections(config).values() for t in col.test_split(c.tasks, split_sizes(config))
        }
        collections, train, dev = build_data(config)
        held = _ids(train) | _ids(dev) | {t.task_id for c in collections.values() for t in c.tasks}
        assert test and not test & held


def _calls(tree: ast.AST, name: str) -> int:
    return sum(
        isinstance(n, ast.Call) and getattr(n.func, "id", getattr(n.func, "attr", None)) == name for n in ast.walk(tree)
    )


def test_only_the_test_evaluation_reads_the_test_split():
    """Every call of ``test_split`` in the repository's code: the test evaluation alone (and this file)."""
    callers = {}
    for path in REPO.rglob("*.py"):
        relative = path.relative_to(REPO).as_posix()
        if relative.startswith((".", "tests/test_splits.py")) or "/." in relative:
            continue
        text = path.read_text()
        if "test_split" in text:
            calls = _calls(ast.parse(text, relative), "test_split")
            if calls:
                callers[relative] = calls
    assert callers == {"mtrl_jax/evaluate.py": 1}, callers
    tree = ast.parse((REPO / "mtrl_jax/evaluate.py").read_text())
    (function,) = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and _calls(n, "test_split")]
    assert function.name == "evaluate_test"  # which appends to the ledger (tests/test_ablate.py)


def test_the_seed_interval_is_students_t():
    x = np.array([0.61, 0.55, 0.64, 0.58, 0.60])
    ci = stats.interval(x)
    low, high = scipy_stats.t.interval(0.95, len(x) - 1, loc=x.mean(), scale=scipy_stats.sem(x))
    assert (ci.low, ci.high) == pytest.approx((low, high)) and ci.method == "t" and ci.seeds == 5


def test_one_seeds_query_interval_is_scipys_bootstrap():
    x = np.random.default_rng(1).random(50)
    ci = stats.interval(x[None, :], seed=3)
    ref = scipy_stats.bootstrap(
        (x,), np.mean, n_resamples=stats.RESAMPLES, method="percentile", random_state=np.random.default_rng(3)
    ).confidence_interval
    assert (ci.low, ci.high) == pytest.approx((ref.low, ref.high)) and ci.queries == 50


def test_the_two_way_bootstrap_matches_a_plain_resampling_loop():
    rng = np.random.default_rng(0)
    x = rng.random((5, 40)) * 0.5 + rng.normal(0, 0.1, (5, 1))  # a seed effect and query noise
    ci = stats.interval(x)
    draws = np.random.default_rng(7)
    means = [x[np.ix_(draws.integers(0, 5, 5), draws.integers(0, 40, 40))].mean() for _ in range(20000)]
    low, high = np.percentile(means, [2.5, 97.5])
    assert ci.low == pytest.approx(low, abs=0.006) and ci.high == pytest.approx(high, abs=0.006)
    # wider than either source of noise alone
    assert ci.high - ci.low > stats.interval(x.mean(axis=0)[None, :]).high - stats.interval(x.mean(axis=0)[None, :]).low


def test_a_paired_comparison_separates_only_outside_zero():
    rng = np.random.default_rng(0)
    a = rng.random((5, 100))
    assert stats.verdict(stats.paired(a + 0.05, a + rng.normal(0, 0.01, a.shape))) == "separated"
    assert stats.verdict(stats.paired(a, a + rng.normal(0, 0.2, a.shape))) == "not resolved"
    with pytest.raises(ValueError, match="same seeds and queries"):
        stats.paired(a, a[:4])
