"""Reference outputs of transformers on the fetched real models, for tests/test_real_models.py.

    pip install -r tools/requirements-fixtures.txt
    python -m tools.fetch_models --model smollm2-135m-instruct --out models/smollm2-135m-instruct
    python -m tools.fetch_models --model qwen2.5-coder-0.5b-instruct --out models/qwen2.5-coder-0.5b-instruct
    python -m tools.make_real_fixtures --models models

For every model found under ``--models`` this writes ``tests/fixtures/real/<model>.npz``:
- the float32 logits of transformers on three prompts of different lengths, at every position, for
  a fixed random set of vocabulary ids plus each position's top 8 (the whole vocabulary would be
  megabytes; the tests compare the full rows live when torch is installed);
- the 32 greedy tokens of ``generate`` on three chat prompts;
- a three-turn episode (system with the tools, user, two tool-calling turns, one with two calls, the
  tool responses, the answer) as messages, and the token ids ``apply_chat_template(messages, tools=...)``
  gives. The test replays those very messages through the episode driver (``replay_episode``), so it
  depends on no collection's text;
- a cold start demonstration (``teacher_demonstration``: the scripted teacher of ``mtrl_jax/coldstart/teacher.py``, a
  second search on a result's title, an answer of the ids shown, on a synthetic collection) as messages,
  and the ids ``apply_chat_template`` gives them: the test builds the demonstration again and compares.
Torch and transformers are needed here only; the tests run without them. The definitions the tests
share (models, prompts, the episodes) are in this module.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib

import numpy as np

from mtrl_jax.chat import render_answer, render_tool_call
from mtrl_jax.chat_template import TemplateChat
from mtrl_jax.data.collection import Task
from mtrl_jax.data.synthetic import make_synthetic_collection
from mtrl_jax.rollout.interfaces import Environment, Episode, EpisodeDriver, EpisodeRun, StepResult, run_scripted
from mtrl_jax.search.build import SearchSettings, make_environment
from mtrl_jax.search.env import SearchEnvConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
# python -m tools.fetch_models --out models/<name> writes them here (or set MTRL_MODELS_DIR)
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
    "generated the data.\n\n```python\ndef ndcg(gains):\n    return sum(g / log2(i + 2) for i, g in "
    "enumerate(gains))\n```",
)


def environment(directory: os.PathLike):
    """The search environment on a small synthetic collection, with the tools rendered the way this
    checkpoint's chat template wants them (``env.tool_prompt="auto"``), and the template chat."""
    chat = TemplateChat.from_checkpoint(directory)
    collection = make_synthetic_collection(seed=0, num_parts=60, num_projects=20, queries_per_type=4)
    tool_prompt = "template" if chat.renders_tools else "schemas"
    env = make_environment(
        collection, SearchSettings(tfidf_dim=32, top_k=3), SearchEnvConfig(max_turns=4, tool_prompt=tool_prompt)
    )
    env.collection = collection
    return env, chat


def tool_schemas(env) -> list[dict]:
    return [t.schema() for t in env.tools.values()]


def greedy_tasks(env) -> list:
    return list(env.collection.tasks[:3])


def scripted_episode(env, chat) -> EpisodeRun:
    """Three assistant turns: a BM25 call, two calls in one turn, the answer."""
    task = env.collection.tasks[0]
    turns = iter(
        [
            render_tool_call("bm25_search", {"query": task.query}),
            "Searching both ways.\n"
            + render_tool_call("vector_search", {"query": task.query})
            + "\n"
            + render_tool_call("bm25_search", {"query": "part 7"}),
            "Done.\n" + render_answer([d.doc_id for d in env.collection.documents[:2]]),
        ]
    )
    return run_scripted(EpisodeDriver(env, chat, 1 << 20), task, lambda messages: next(turns))


def teacher_demonstration(env, chat) -> EpisodeRun:
    """A cold-start demonstration as ``coldstart.demonstrations`` makes one: the scripted teacher (BM25 with 3
    results, a forced second search on a result's title, an answer of the ids shown) run through the
    episode driver with the checkpoint's chat template. Seeded, and BM25 only: the same on every machine."""
    from mtrl_jax.coldstart.demonstrations import demonstration_run
    from mtrl_jax.coldstart.teacher import Teacher, teacher_turns

    teacher = Teacher(("bm25_search",), top_ks=(3,), hop=1.0, hop_queries=("title",), answers=("ids",))
    policy = teacher_turns(np.random.default_rng(7), teacher)
    return demonstration_run(EpisodeDriver(env, chat, 1 << 20), env.collection.tasks[1], policy)


class ReplayEnvironment(Environment):
    """An environment that answers with recorded messages: ``reset`` gives the recorded opening messages
    (system, user), each step the tool messages recorded after that assistant turn; the last assistant
    turn ends the episode."""

    def __init__(self, messages: list[dict]):
        self.messages = [dict(m) for m in messages]
        self.assistant_at = [i for i, m in enumerate(self.messages) if m["role"] == "assistant"]
        if not self.assistant_at:
            raise ValueError("a recorded episode needs at least one assistant turn")

    def reset(self, task):
        return Episode(task), [dict(m) for m in self.messages[: self.assistant_at[0]]]

    def step(self, episode, assistant_text, hit_token_limit=False):
        at = self.assistant_at[len(episode.turns)]
        turn = {"index": len(episode.turns), "text": assistant_text, "calls": [], "errors": [], "doc_ids": []}
        episode.turns.append(turn)
        if at == self.assistant_at[-1]:
            episode.status, episode.reward, episode.final_ranking = "ok", 0.0, []
            return StepResult([], True, turn)
        following = self.messages[at + 1 : self.assistant_at[len(episode.turns)]]
        return StepResult([dict(m) for m in following], False, turn)


def replay_episode(chat, messages: list[dict]) -> EpisodeRun:
    """``messages`` (a recorded episode) run through the episode driver: the prompt rendered once, each
    assistant turn tokenised as if sampled, each environment reply appended as its own block."""
    turns = iter([m["content"] for m in messages if m["role"] == "assistant"])
    task = Task("replay/0", next(m["content"] for m in messages if m["role"] == "user"), {}, "replay")
    return run_scripted(EpisodeDriver(ReplayEnvironment(messages), chat, 1 << 20), task, lambda _: next(turns))


def hf_apply(tokenizer, messages: list[dict], tools, add_generation_prompt: bool) -> list[int]:
    plain = [{k: v for k, v in m.items() if k != "tools"} for m in messages]
    out = tokenizer.apply_chat_template(plain, tools=tools, add_generation_prompt=add_generation_prompt, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", type=pathlib.Path, default=MODELS_DIR)
    args = parser.parse_args(argv)
    import torch
    import transformers

    FIXTURES.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        directory = args.models / name
        if not (directory / "fetch.json").exists():
            print(f"{name}: not fetched under {args.models}, skipped")
            continue
        tokenizer = transformers.AutoTokenizer.from_pretrained(directory)
        model = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
        model.generation_config.eos_token_id = None  # exactly 32 tokens on both sides
        model.generation_config.pad_token_id = 0
        out = {}
        for i, text in enumerate(PROMPTS):
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0].numpy()
            rng = np.random.default_rng(i)
            subset = np.union1d(
                rng.choice(logits.shape[1], 256, replace=False), np.argsort(-logits, axis=1)[:, :8].ravel()
            )
            out[f"prompt{i}_ids"] = np.asarray(ids, np.int32)
            out[f"prompt{i}_vocab"] = subset.astype(np.int32)
            out[f"prompt{i}_logits"] = logits[:, subset].astype(np.float32)
        env, chat = environment(directory)
        tools = tool_schemas(env)
        for i, task in enumerate(greedy_tasks(env)):
            _, messages = env.reset(task)
            prompt = hf_apply(tokenizer, messages, tools, add_generation_prompt=True)
            with torch.no_grad():
                generated = model.generate(
                    torch.tensor([prompt]),
                    attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                    max_new_tokens=GREEDY_TOKENS,
                    do_sample=False,
                )
            out[f"greedy{i}_prompt"] = np.asarray(prompt, np.int32)
            out[f"greedy{i}_tokens"] = generated[0, len(prompt) :].numpy().astype(np.int32)
            print(f"{name} greedy {i}: {tokenizer.decode(out[f'greedy{i}_tokens'])!r}")
        run = scripted_episode(env, chat)
        out["episode_ids"] = np.asarray(hf_apply(tokenizer, run.messages, tools, add_generation_prompt=False), np.int32)
        demo = teacher_demonstration(env, chat)
        out["demo_ids"] = np.asarray(hf_apply(tokenizer, demo.messages, tools, add_generation_prompt=False), np.int32)
        record = {
            "gguf_sha256": json.loads((directory / "fetch.json").read_text())["gguf_sha256"],
            "transformers": transformers.__version__,
            "torch": torch.__version__,
            "messages": run.messages,
            "demo_messages": demo.messages,
        }
        out["record"] = np.frombuffer(json.dumps(record).encode(), np.uint8)
        np.savez_compressed(FIXTURES / f"{name}.npz", **out)
        print(f"{name}: wrote {FIXTURES / (name + '.npz')}")


if __name__ == "__main__":
    main()
