"""What tests/test_real_models.py and scripts/make_real_fixtures.py share: where the fetched models
and their transformers fixtures live, the prompts, and the scripted three-turn episode."""

from __future__ import annotations

import os
import pathlib

from mtrl_jax.chat import TemplateChat, render_answer, render_tool_call
from mtrl_jax.data.synthetic import make_synthetic_collection
from mtrl_jax.rollout.interfaces import EpisodeDriver, run_scripted
from mtrl_jax.search.build import SearchSettings, make_environment
from mtrl_jax.search.env import SearchEnvConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
# scripts/fetch_models.py --out models/<name> writes them here (or set MTRL_MODELS_DIR)
MODELS_DIR = pathlib.Path(os.environ.get("MTRL_MODELS_DIR", REPO / "models"))
FIXTURES = REPO / "tests" / "fixtures" / "real"
MODELS = ("smollm2-135m-instruct", "qwen2.5-coder-0.5b-instruct")
GREEDY_TOKENS = 32

PROMPTS = (
    "Hello",
    "The quick brown fox jumps over the lazy dog, 1234 times in 2024 -- or so they say.",
    "Multi-turn reinforcement learning trains a language model that acts over several steps: it searches, "
    "reads what the search engine returns, searches again with what it learnt, and finally answers. The reward "
    "arrives only at the end of the episode, so every token of every turn shares it. Group-relative estimators "
    "such as GRPO compare several episodes of the same question and push up the tokens of those that scored "
    "above their group's mean, while a clipped importance ratio keeps each update close to the policy that "
    "generated the data.\n\n```python\ndef ndcg(gains):\n    return sum(g / log2(i + 2) for i, g in enumerate(gains))\n```",
)


def environment(directory: os.PathLike):
    """The search environment on a small synthetic collection, with the tools rendered the way this
    checkpoint's chat template wants them (``env.tool_prompt="auto"``), and the template chat."""
    chat = TemplateChat.from_checkpoint(directory)
    collection = make_synthetic_collection(seed=0, num_parts=60, num_projects=20, queries_per_type=4)
    tool_prompt = "template" if chat.renders_tools else "schemas"
    env = make_environment(collection, SearchSettings(tfidf_dim=32, top_k=3), SearchEnvConfig(max_turns=4, tool_prompt=tool_prompt))
    env.collection = collection
    return env, chat


def tool_schemas(env) -> list[dict]:
    return [t.schema() for t in env.tools.values()]


def greedy_tasks(env) -> list:
    return list(env.collection.tasks[:3])


def scripted_episode(env, chat):
    """Three assistant turns: a BM25 call, two calls in one turn, the answer."""
    task = env.collection.tasks[0]
    turns = iter([
        render_tool_call("bm25_search", {"query": task.query}),
        "Searching both ways.\n" + render_tool_call("vector_search", {"query": task.query}) + "\n"
        + render_tool_call("bm25_search", {"query": "part 7"}),
        "Done.\n" + render_answer([d.doc_id for d in env.collection.documents[:2]]),
    ])
    return run_scripted(EpisodeDriver(env, chat, 1 << 20), task, lambda messages: next(turns))
