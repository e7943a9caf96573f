"""The interfaces between the rollout loop and the world: ``Tool``, ``Reward``, ``Environment``.

The collector speaks in messages (``{"role": ..., "content": ...}``); the chat format turns them
into tokens. An environment:

* ``reset(task)`` -> ``(episode, messages)``: the system and user messages that open an episode;
* ``step(episode, assistant_text, hit_token_limit)`` -> ``StepResult``: the messages to append
  (tool responses, error messages) or ``done`` with the final ranking, reward and status.

Failures of the *model* (bad JSON, unknown tool, wrong arguments) are never exceptions: they come
back as tool error messages and are counted in ``episode.counters``.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional, Protocol

STATUSES = ("ok", "max_turns", "turn_token_limit", "context_limit")
FAILURE_REWARD = -1.0


class ToolError(Exception):
    """A problem with one tool call, reported to the model as the tool's response."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


@dataclasses.dataclass
class ToolOutput:
    content: str  # what the model reads
    doc_ids: list[str] = dataclasses.field(default_factory=list)  # ranked results, for fusion and logging


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


class Tool(abc.ABC):
    """A function the model can call. ``parameters`` is a JSON schema (type ``object``); arguments
    are validated against it (required, types, no unknown keys) before ``run`` sees them."""

    name: str
    description: str
    parameters: dict

    def schema(self) -> dict:
        return {"type": "function", "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}

    def validate(self, arguments: Any) -> dict:
        if not isinstance(arguments, dict):
            raise ToolError("bad_arguments", f"arguments of {self.name} must be a JSON object")
        props = self.parameters.get("properties", {})
        for key in self.parameters.get("required", []):
            if key not in arguments:
                raise ToolError("bad_arguments", f"{self.name}: missing required argument {key!r}")
        for key, value in arguments.items():
            if key not in props:
                raise ToolError("bad_arguments", f"{self.name}: unknown argument {key!r}; expected {sorted(props)}")
            kind = _JSON_TYPES.get(props[key].get("type"))
            if kind and (not isinstance(value, kind) or (isinstance(value, bool) and kind is not bool)):
                raise ToolError("bad_arguments", f"{self.name}: argument {key!r} must be of type {props[key]['type']}")
        return arguments

    def __call__(self, arguments: Any) -> ToolOutput:
        return self.run(**self.validate(arguments))

    @abc.abstractmethod
    def run(self, **arguments) -> ToolOutput: ...


class Reward(Protocol):
    def __call__(self, task, final_ranking: list[str]) -> float: ...


@dataclasses.dataclass
class StepResult:
    messages: list[dict]  # to append to the conversation (empty when done)
    done: bool
    turn: dict  # the per-turn record: text, calls, doc ids, latency, errors, stop reason


@dataclasses.dataclass
class Episode:
    task: Any
    turns: list[dict] = dataclasses.field(default_factory=list)
    search_results: list[list[str]] = dataclasses.field(default_factory=list)
    counters: dict = dataclasses.field(default_factory=dict)
    final_ranking: Optional[list[str]] = None
    reward: Optional[float] = None
    status: Optional[str] = None

    def count(self, key: str, n: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + n


class Environment(abc.ABC):
    @abc.abstractmethod
    def reset(self, task) -> tuple[Episode, list[dict]]: ...

    @abc.abstractmethod
    def step(self, episode: Episode, assistant_text: str, hit_token_limit: bool = False) -> StepResult: ...

    def fail(self, episode: Episode, status: str) -> None:
        """End ``episode`` with a failure status (e.g. ``context_limit`` from the collector)."""
        if status not in STATUSES or status == "ok":
            raise ValueError(f"unknown failure status {status!r}")
        episode.status, episode.reward, episode.final_ranking = status, FAILURE_REWARD, episode.final_ranking or []


def run_text_episode(env: Environment, task, policy: Callable[[list[dict]], str], max_steps: int = 100) -> Episode:
    """Drive one episode at the message level with ``policy(messages) -> assistant text``
    (scripted agents, tests, demonstrations). The token-level collector does the same with
    the sampler."""
    episode, messages = env.reset(task)
    for _ in range(max_steps):
        text = policy(messages)
        messages = messages + [{"role": "assistant", "content": text}]
        result = env.step(episode, text)
        if result.done:
            return episode
        messages = messages + result.messages
    raise RuntimeError(f"episode did not end within {max_steps} steps")
