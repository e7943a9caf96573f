"""The curriculum of hard queries (issue 72, point 3): the training queries a fixed one-search move does not solve."""

import numpy as np
import pytest

from mtrl_jax.data.synthetic import make_synthetic_collection
from mtrl_jax.search.build import SearchSettings
from mtrl_jax.search.curriculum import BASELINES, best_one_search, hard_tasks
from mtrl_jax.rl import advantages
from mtrl_jax.rl.batch import make_batch
from mtrl_jax.rollout.trajectory import Trajectory
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
def test_a_run_with_the_curriculum_trains_rl_on_hard_queries_and_evaluates_on_the_same_dev(tmp_path):
    from configs import default
    from mtrl_jax.setup import build

    config = default.get_config()
    plain = build(config, tmp_path / "plain")
    config.data.curriculum_max_baseline = 0.5
    hard = build(config, tmp_path / "hard")
    assert hard.dev_tasks == plain.dev_tasks  # dev is never filtered
    assert hard.train_tasks == plain.train_tasks == plain.rl_tasks  # the cold start demonstrates every query
    assert set(t.task_id for t in hard.rl_tasks) < set(t.task_id for t in plain.train_tasks)
    collection = plain.collections["synthetic"]
    best = best_one_search(collection, plain.train_tasks, SearchSettings(tfidf_dim=config.search.tfidf_dim))
    assert [t.task_id for t in hard.rl_tasks] == [t.task_id for t in plain.train_tasks if best[t.task_id] < 0.5]
    assert hard.schedule.steps_per_epoch < plain.schedule.steps_per_epoch  # an epoch is RL's tasks
    # the reward baseline of rl.reward_baseline="one_search": the same scores, for every training task
    assert plain.reward_baseline is None
    config.data.curriculum_max_baseline, config.rl.reward_baseline = 0.0, "one_search"
    offsets = build(config, tmp_path / "offsets").reward_baseline
    assert offsets == pytest.approx(best) and set(offsets) == {t.task_id for t in plain.train_tasks}
    config.rl.reward_baseline = "bm25"
    with pytest.raises(ValueError, match=r"rl.reward_baseline must be one of \('none', 'one_search'\), got 'bm25'"):
        build(config, tmp_path / "bad")


def _group(rewards, task_id):
    return [
        Trajectory(task_id, 0, i, tokens=[1, 2], loss_mask=[0, 1], behav_logp=[0.0, 0.0], reward=r)
        for i, r in enumerate(rewards)
    ]


def test_subtracting_each_querys_one_search_score_is_a_no_op_under_group_relative_estimators():
    """s3's reward minus a fixed retrieval's score: a per-query constant, which every group-relative estimator
    cancels; grpo with the batch's std (scale=batch) is the one registered exception."""
    trajectories = _group([0.9, 0.2, 0.5, -1.0], "a") + _group([0.3, 0.3, 0.7, 0.1], "b")
    offsets = {"a": 0.6, "b": 0.05}
    plain, shifted = make_batch(trajectories, 4), make_batch(trajectories, 4, reward_offset=offsets)
    np.testing.assert_allclose(shifted.reward, plain.reward - np.repeat([0.6, 0.05], 4), rtol=1e-6)
    for name, options in [(n, {}) for n in advantages.names()] + [
        ("grpo", {"scale": "none"}),
        ("grpo_passk", {"k": 3}),
    ]:
        a = advantages.compute(name, plain.reward, 4, plain.loss_mask, **options)
        b = advantages.compute(name, shifted.reward, 4, shifted.loss_mask, **options)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-6, err_msg=name)
    a = advantages.compute("grpo", plain.reward, 4, plain.loss_mask, scale="batch")
    b = advantages.compute("grpo", shifted.reward, 4, shifted.loss_mask, scale="batch")
    assert np.abs(np.asarray(a) - np.asarray(b)).max() > 0.01  # the batch std is of the rewards themselves
    with pytest.raises(KeyError, match="'a'"):
        make_batch(trajectories, 4, reward_offset={"b": 0.0})
