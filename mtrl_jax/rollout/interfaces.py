"""The interfaces between the rollout loop and the world (``Tool``, ``Reward``, ``Environment``,
``Episode``, the router) and the one episode driver.

Environments speak in messages (``{"role": ..., "content": ...}``); the chat format turns them
into tokens. An environment:

* ``reset(task)`` -> ``(episode, messages)``: the system and user messages that open an episode;
* ``step(episode, assistant_text, hit_token_limit)`` -> ``StepResult``: the messages to append
  (tool responses, error messages) or ``done`` with the final ranking, reward and status.

Failures of the *model* (bad JSON, unknown tool, wrong arguments) are never exceptions: they come
back as tool error messages and are counted in ``episode.counters``.

``EpisodeDriver`` is the one place where an episode becomes a token-level ``Trajectory``: the
collector drives it with sampled turns, the cold start with a scripted teacher's (``run_scripted``).
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any, Callable, Optional, Protocol, Sequence

from mtrl_jax.chat import ChatFormat
from mtrl_jax.rollout.trajectory import Trajectory

STATUSES = ("ok", "max_turns", "turn_token_limit", "context_limit")
FAILURE_REWARD = -1.0


class ToolError(Exception):
    """A problem with one tool call, reported to the model as the tool's response."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


class ServiceDown(RuntimeError):
    """A tool service that keeps failing (``search.remote_max_failures`` calls in a row): not the model's
    fault and not something it can fix, so it stops the run instead of feeding the model error messages."""


@dataclasses.dataclass
class ToolOutput:
    content: str  # what the model reads
    doc_ids: list[str] = dataclasses.field(default_factory=list)  # ranked results, for fusion and logging
    queries: int = 1  # the queries the call ran (a search tool's list of queries, fused)


_JSON_TYPES = {"string": str, "integer": int, "number": (int, float), "boolean": bool, "object": dict, "array": list}


def _of_type(value, schema: dict) -> bool:
    """Whether ``value`` has the JSON ``schema``'s type (one, or a list of them; an array's ``items`` too)."""
    names = schema.get("type")
    if names is None:
        return True
    for name in [names] if isinstance(names, str) else names:
        kind = _JSON_TYPES.get(name)
        if kind is None or (isinstance(value, kind) and not (isinstance(value, bool) and kind is not bool)):
            if name == "array" and "items" in schema:
                return all(_of_type(v, schema["items"]) for v in value)
            return True
    return False


def _type_text(schema: dict) -> str:
    names = schema.get("type")
    text = names if isinstance(names, str) else " or ".join(names)
    items = schema.get("items", {}).get("type")
    return text.replace("array", f"array of {items}") if items else text


class Tool(abc.ABC):
    """A function the model can call. ``parameters`` is a JSON schema (type ``object``); arguments
    are validated against it (required, types, no unknown keys) before ``run`` sees them."""

    name: str
    description: str
    parameters: dict

    def schema(self) -> dict:
        return {
            "type": "function",
            "function": {"name": self.name, "description": self.description, "parameters": self.parameters},
        }

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
            if not _of_type(value, props[key]):
                kind = _type_text(props[key])
                raise ToolError("bad_arguments", f"{self.name}: argument {key!r} must be of type {kind}")
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
    """What every environment tracks; an environment keeps its own working state in a subclass."""

    task: Any
    turns: list[dict] = dataclasses.field(default_factory=list)
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


class EnvironmentRouter(Environment):
    """Dispatches each task to the environment of its corpus (dataset mixtures)."""

    def __init__(self, environments: dict[str, Environment]):
        self.environments = environments

    def _env(self, task) -> Environment:
        try:
            return self.environments[task.corpus]
        except KeyError:
            raise ValueError(
                f"task {task.task_id!r}: no environment for corpus {task.corpus!r}; have {sorted(self.environments)}"
            ) from None

    def reset(self, task):
        return self._env(task).reset(task)

    def step(self, episode, assistant_text, hit_token_limit=False):
        return self._env(episode.task).step(episode, assistant_text, hit_token_limit)


# ----------------------------------------------------------------------------- the episode driver


@dataclasses.dataclass
class EpisodeRun:
    """One episode in progress: the environment's ``episode``, the token-level ``trajectory`` built so
    far, the conversation as messages, and the sampled tokens of the current turn."""

    episode: Episode
    trajectory: Trajectory
    messages: list[dict]
    turn_tokens: list[int] = dataclasses.field(default_factory=list)
    done: bool = False


class EpisodeDriver:
    """Turns an environment's episode into a token-in/token-out trajectory.

    The prompt is rendered once; each assistant turn is exactly its sampled tokens; each environment
    reply is rendered as a new block appended after them (nothing is re-tokenised). An episode whose
    next block would not fit in ``max_len`` context tokens ends with status ``context_limit``.
    """

    def __init__(self, env: Environment, chat: ChatFormat, max_len: int):
        self.env, self.chat, self.max_len = env, chat, max_len

    def begin(self, task, group_id: int = 0, sample_index: int = 0) -> tuple[EpisodeRun, list[int]]:
        """A new episode and its first block (the prompt); the block is empty when the episode
        already ended (the prompt does not fit)."""
        episode, messages = self.env.reset(task)
        prompt = self.chat.prompt(messages)
        run = EpisodeRun(
            episode, Trajectory(task.task_id, group_id, sample_index, task.type, prompt_len=len(prompt)), list(messages)
        )
        return run, self._append_block(run, prompt)

    def add_sampled(self, run: EpisodeRun, tokens: Sequence[int], logp: Sequence[float], version: int) -> None:
        """Tokens the policy sampled (part of the current turn, which may end with a stop token)."""
        run.trajectory.append(tokens, sampled=True, logp=logp, version=version)
        run.turn_tokens += [int(t) for t in tokens]

    def act(self, run: EpisodeRun, hit_token_limit: bool = False) -> StepResult:
        """The environment's reply to the current turn (thread-safe per episode: tools run here)."""
        text = self.chat.turn_text(run.turn_tokens)
        run.messages = run.messages + [{"role": "assistant", "content": text}]
        return self.env.step(run.episode, text, hit_token_limit)

    def receive(self, run: EpisodeRun, result: StepResult) -> list[int]:
        """Record ``result`` (from ``act``); returns the block to extend the context with, or ``[]``
        when the episode ended."""
        run.messages = run.messages + result.messages
        run.turn_tokens = []
        if result.done:
            return self._finish(run)
        return self._append_block(run, self.chat.continuation(result.messages))

    def fail(self, run: EpisodeRun, status: str) -> None:
        """End the episode with a failure ``status`` (e.g. ``context_limit`` when the cache is full)."""
        self.env.fail(run.episode, status)
        self._finish(run)

    def _append_block(self, run: EpisodeRun, block: list[int]) -> list[int]:
        if len(run.trajectory.tokens) + len(block) + 1 > self.max_len:  # +1: room for a sampled token
            self.fail(run, "context_limit")
            return []
        run.trajectory.append(block, sampled=False)
        return block

    def _finish(self, run: EpisodeRun) -> list[int]:
        ep, traj = run.episode, run.trajectory
        traj.turns, traj.reward, traj.status = ep.turns, ep.reward, ep.status
        traj.final_ranking, traj.counters = list(ep.final_ranking or []), dict(ep.counters)
        qrels = getattr(ep.task, "qrels", None) or {}
        shown = [
            d for turn in ep.turns for call in turn.get("calls", []) for d in call.get("doc_ids", [])
        ] + traj.final_ranking
        traj.query, traj.grades = getattr(ep.task, "query", ""), {d: int(qrels.get(d, 0)) for d in shown}
        run.done = True
        return []


def run_scripted(driver: EpisodeDriver, task, policy: Callable[[list[dict]], str], max_turns: int = 100) -> EpisodeRun:
    """Drive one episode with ``policy(messages) -> assistant text`` (a scripted teacher, tests). Its
    turns are tokenised as if sampled (behaviour log-prob 0, version 0)."""
    run, _ = driver.begin(task)
    for _ in range(max_turns):
        if run.done:
            return run
        turn = driver.chat.encode(policy(run.messages)) + [driver.chat.im_end_id]
        driver.add_sampled(run, turn, [0.0] * len(turn), version=0)
        driver.receive(run, driver.act(run))
    if not run.done:
        raise RuntimeError(f"scripted episode of {task.task_id!r} did not end within {max_turns} turns")
    return run
