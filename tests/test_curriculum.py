"""The curriculum of hard queries (issue 72, point 3): the training queries a fixed one-search move does not solve."""

import pytest

from mtrl_jax.data.synthetic import make_synthetic_collection
from mtrl_jax.search.build import SearchSettings
from mtrl_jax.search.curriculum import BASELINES, best_one_search, hard_tasks
from mtrl_jax.search.baselines import evaluate_retrieval


def test_the_curriculum_keeps_the_queries_one_search_does_not_solve_in_order():
    collection = make_synthetic_collection(0)
    tasks = collection.tasks[::7]  # a spread of the three query types
    settings = SearchSettings(tfidf_dim=16)
    best = best_one_search(collection, tasks, settings)
    scored = evaluate_retrieval(collection, BASELINES, settings)  # the whole collection: the same per-query scores
    for t in tasks:
        assert best[t.task_id] == pytest.approx(max(scored[b]["ndcg@10_by_task"][t.task_id] for b in BASELINES))
    kept, counts = hard_tasks({collection.name: collection}, tasks, settings, 0.5)
    assert kept == [t for t in tasks if best[t.task_id] < 0.5] and 0 < len(kept) < len(tasks)
    assert counts == {collection.name: {"kept": len(kept), "of": len(tasks)}}
    types = {t.type for t in kept}
    assert "synthetic/multihop" in types  # the bridge a single search cannot follow
    easy = [t for t in tasks if best[t.task_id] >= 0.99]
    with pytest.raises(ValueError, match=r"data.curriculum_max_baseline=0.5: one search reaches it on every"):
        hard_tasks({collection.name: collection}, easy, settings, 0.5)


@pytest.mark.slow
def test_a_run_with_the_curriculum_trains_on_hard_queries_and_evaluates_on_the_same_dev(tmp_path):
    from configs import default
    from mtrl_jax.setup import build

    config = default.get_config()
    plain = build(config, tmp_path / "plain")
    config.data.curriculum_max_baseline = 0.5
    hard = build(config, tmp_path / "hard")
    assert hard.dev_tasks == plain.dev_tasks  # dev is never filtered
    assert set(t.task_id for t in hard.train_tasks) < set(t.task_id for t in plain.train_tasks)
    collection = plain.collections["synthetic"]
    best = best_one_search(collection, plain.train_tasks, SearchSettings(tfidf_dim=config.search.tfidf_dim))
    assert [t.task_id for t in hard.train_tasks] == [t.task_id for t in plain.train_tasks if best[t.task_id] < 0.5]
