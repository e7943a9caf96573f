"""The search environment: tools over one collection, the answer, the reward. The protocol's
tags, rendering and parsing live in ``mtrl_jax.chat``.

Protocol (Qwen / Hermes style, what Qwen chat templates produce):

* the system prompt lists the tools' JSON schemas inside ``<tools></tools>``;
* a tool call is ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (several per turn
  are allowed); each result comes back as a ``tool`` message;
* a turn without a tool call ends the episode. Its final answer is
  ``<answer>["doc-id-1", "doc-id-2", ...]</answer>`` (best first; a JSON list carries any id, commas
  included; ids separated by commas or white space are accepted too). An answer without ids falls back to
  ``answer_fallback``: the last search's results
  (``"last_search"``), a reciprocal-rank fusion of every search (``"fusion"``), or nothing (``"none"``).

Reward: nDCG@10 of the final ranking, or -1 when the episode used ``max_turns`` turns without
answering or a turn hit the per-turn token limit (``StepResult.turn["stop_reason"]``).
"""

from __future__ import annotations

import dataclasses
import json
import time
from typing import Optional

from mtrl_jax.chat import TOOL_ERROR_PREFIX, TOOL_PROMPTS, parse_answer, parse_tool_calls, system_prompt
from mtrl_jax.rollout.interfaces import (
    FAILURE_REWARD,
    Environment,
    Episode,
    Reward,
    ServiceDown,
    StepResult,
    Tool,
    ToolError,
)
from mtrl_jax.search.metrics import best_ndcg_at_k, ndcg_at_k
from mtrl_jax.search.retrievers import reciprocal_rank_fusion


@dataclasses.dataclass
class SearchEpisode(Episode):
    search_results: list[list[str]] = dataclasses.field(default_factory=list)  # each search's ranked ids
    calls_made: set = dataclasses.field(default_factory=set)  # (tool, arguments as canonical JSON) of each call


REPEATED_CALLS = ("error", "run")  # env.repeated_calls


class NdcgReward:
    """nDCG@k of the final ranking against the task's graded qrels."""

    def __init__(self, k: int = 10):
        self.k = k

    def __call__(self, task, final_ranking: list[str]) -> float:
        return ndcg_at_k(final_ranking, task.qrels, self.k)


@dataclasses.dataclass(frozen=True)
class SearchEnvConfig:
    max_turns: int = 4
    answer_fallback: str = "last_search"  # "last_search" | "fusion" | "none"
    max_answer_docs: int = 10
    instructions: Optional[str] = None  # None: chat.DEFAULT_INSTRUCTIONS, or chat.COMPACT_INSTRUCTIONS for "compact"
    tool_prompt: str = "schemas"  # see chat.system_prompt
    # a call identical to one the episode already made (same tool, same arguments): "error" answers it with a
    # tool error saying so (counted as tool_errors/repeated_call), "run" runs it again; both count repeated_calls
    repeated_calls: str = "error"

    def __post_init__(self):
        if self.tool_prompt not in TOOL_PROMPTS[:3]:
            raise ValueError(
                f"env.tool_prompt must be one of {TOOL_PROMPTS[:3]} (or 'auto', resolved by setup), got "
                f"{self.tool_prompt!r}"
            )
        if self.answer_fallback not in ("last_search", "fusion", "none"):
            raise ValueError(
                f"env.answer_fallback must be 'last_search', 'fusion' or 'none', got {self.answer_fallback!r}"
            )
        if self.repeated_calls not in REPEATED_CALLS:
            raise ValueError(f"env.repeated_calls must be one of {REPEATED_CALLS}, got {self.repeated_calls!r}")
        if self.max_turns < 1:
            raise ValueError(f"env.max_turns must be >= 1, got {self.max_turns}")


def search_credit(seen: set, results: list[list[str]], qrels: dict, k: int = 10) -> dict:
    """What a search turn found (per-search credit, ``mtrl_jax.rl.turn_credit``): ``retrieval_gain``, the rise of
    the nDCG@k of the best ranking of every document seen (``seen`` before the turn, then its calls' ``results``),
    and ``repeated_docs``, the fraction of the results shown already (before the turn, or by an earlier call of
    it). Recorded in the turn whether or not RL uses it."""
    now, repeated, shown, qrels = set(seen), 0, 0, qrels or {}
    for docs in results:
        for d in dict.fromkeys(docs):  # a call's results once each, in order
            repeated, shown = repeated + (d in now), shown + 1
            now.add(d)
    gain = best_ndcg_at_k(now, qrels, k) - best_ndcg_at_k(seen, qrels, k)
    return {"retrieval_gain": gain, "repeated_docs": repeated / max(shown, 1)}


class SearchEnvironment(Environment):
    def __init__(
        self,
        tools: list[Tool],
        config: SearchEnvConfig = SearchEnvConfig(),
        reward: Optional[Reward] = None,
        known_doc_ids: Optional[set] = None,
    ):
        names = [t.name for t in tools]
        if len(set(names)) != len(names):
            raise ValueError(f"tool names must be unique, got {names}")
        self.tools = {t.name: t for t in tools}
        self.config = config
        self.reward_fn = reward or NdcgReward(10)
        self.known_doc_ids = known_doc_ids

    def system_prompt(self) -> str:
        return system_prompt(
            [t.schema() for t in self.tools.values()], self.config.tool_prompt, self.config.instructions
        )

    def reset(self, task) -> tuple[SearchEpisode, list[dict]]:
        system = {"role": "system", "content": self.system_prompt()}
        if self.config.tool_prompt == "template":  # the chat template renders them (chat_template.TemplateChat)
            system["tools"] = [t.schema() for t in self.tools.values()]
        return SearchEpisode(task), [system, {"role": "user", "content": task.query}]

    def step(self, episode: SearchEpisode, assistant_text: str, hit_token_limit: bool = False) -> StepResult:
        if episode.status is not None:
            raise RuntimeError("step() on a finished episode")
        turn = {
            "index": len(episode.turns),
            "text": assistant_text,
            "calls": [],
            "errors": [],
            "doc_ids": [],
            "latency_s": 0.0,
            "stop_reason": "token_limit" if hit_token_limit else "end_of_turn",
        }
        episode.turns.append(turn)
        if hit_token_limit:
            return self._finish(episode, turn, "turn_token_limit")

        calls = parse_tool_calls(assistant_text)
        if not calls:
            return self._answer(episode, turn, parse_answer(assistant_text))

        messages, seen = [], {d for results in episode.search_results for d in results}
        for name, arguments, error_kind, error in calls:
            record = {"name": name, "arguments": arguments, "doc_ids": [], "latency_s": 0.0, "error": None}
            start = time.perf_counter()
            try:
                if error_kind is not None:
                    raise ToolError(error_kind, error)
                if name not in self.tools:
                    raise ToolError("unknown_tool", f"unknown tool {name!r}; available: {sorted(self.tools)}")
                call = (name, json.dumps(arguments, sort_keys=True))
                if call in episode.calls_made:
                    episode.count("repeated_calls")
                    if self.config.repeated_calls == "error":
                        raise ToolError(
                            "repeated_call", f"{name} was already called with these arguments; its results are above"
                        )
                episode.calls_made.add(call)
                output = self.tools[name](arguments)
                record["doc_ids"] = output.doc_ids
                episode.search_results.append(output.doc_ids)
                episode.count(f"tool_calls/{name}")
                episode.count(f"tool_queries/{name}", output.queries)
                content = output.content
            except ServiceDown:  # the tool service itself is down: the run stops
                raise
            except Exception as e:  # noqa: BLE001 - whatever the model's call does to a tool, the run goes on
                if not isinstance(e, ToolError):
                    e = ToolError(
                        "tool_failure", f"{name}: the tool failed on this call ({type(e).__name__}: {str(e)[:200]})"
                    )
                record["error"] = f"{e.kind}: {e}"
                turn["errors"].append(record["error"])
                episode.count(f"tool_errors/{e.kind}")
                content = f"{TOOL_ERROR_PREFIX}{e}"
            record["latency_s"] = time.perf_counter() - start
            turn["latency_s"] += record["latency_s"]
            turn["doc_ids"] += record["doc_ids"]
            turn["calls"].append(record)
            messages.append({"role": "tool", "content": content})
        if turn["doc_ids"]:
            turn.update(search_credit(seen, [c["doc_ids"] for c in turn["calls"]], getattr(episode.task, "qrels", {})))
        if len(episode.turns) >= self.config.max_turns:
            return self._finish(episode, turn, "max_turns")
        return StepResult(messages, False, turn)

    def _answer(self, episode: SearchEpisode, turn: dict, answer: Optional[list[str]]) -> StepResult:
        if answer:
            ranking, source = answer, "answer"
        elif self.config.answer_fallback == "last_search" and episode.search_results:
            ranking, source = episode.search_results[-1], "fallback_last_search"
        elif self.config.answer_fallback == "fusion" and episode.search_results:
            ranking, source = [d for d, _ in reciprocal_rank_fusion(episode.search_results)], "fallback_fusion"
        else:
            ranking, source = [], "empty"
        ranking = ranking[: self.config.max_answer_docs]
        if self.known_doc_ids is not None:
            unknown = sum(d not in self.known_doc_ids for d in ranking)
            if unknown:
                episode.count("answer_unknown_ids", unknown)
        episode.count(f"answer_source/{source}")
        turn["answer_source"] = source
        episode.final_ranking = ranking
        return self._finish(episode, turn, "ok")

    def _finish(self, episode: Episode, turn: dict, status: str) -> StepResult:
        episode.status = status
        if status == "ok":
            episode.reward = float(self.reward_fn(episode.task, episode.final_ranking))
        else:
            episode.final_ranking = episode.final_ranking or []
            episode.reward = FAILURE_REWARD
        turn["status"] = status
        return StepResult([], True, turn)
