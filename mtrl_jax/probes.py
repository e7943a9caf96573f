"""Probes of what a policy has learnt, beyond its reward: does it copy an identifier out of search
results, the step a second search (the hop) needs?

A hop case is the scripted teacher's episode (``warmup.teacher_turns`` forced to hop) on a
held-out task, cut after its second search's call: the first search's results are in the context,
and the call's query is one identifier drawn among those shown. Two measures, per task type:

* teacher-forced: how often the policy's most likely next token is the identifier's next token,
  over the identifier's tokens after its first (which names the choice among the shown ones, not
  the copy), and how often all of them are; and that accuracy by position (the identifier's second
  token, its third, ...), which shows where a copy goes wrong;
* greedy: the policy's own turn after the first search's results (up to
  ``rollout.max_tokens_per_turn`` tokens): a tool call, a call whose query is one of the identifiers
  shown, or an answer.

``probe_hop_copy`` takes the policy as an object with ``logits(tokens [N, L], valid [N, L],
positions [N, P]) -> [N, P, V]`` (the next-token logits at those positions) and ``greedy(prompts,
stop_id, max_new_tokens)`` (each prompt's greedy continuation, the stop token included), so that
the measures are tested with scripted policies (``tests/test_probes.py``); ``ModelPolicy`` is that
object for policy parameters (the sampler's ``prefill`` and ``decode`` for the greedy turns). ``scripts/probe_hop_copy.py`` runs it on a
training work directory's warmed-up and trained policies.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from mtrl_jax.chat import ChatFormat, parse_answer, parse_tool_calls
from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.transformer import forward, logits_from_hidden
from mtrl_jax.rollout import sampler
from mtrl_jax.rollout.interfaces import EpisodeDriver, run_scripted
from mtrl_jax.warmup import _assistant_turns, _turn_end, result_identifiers, settings_teacher


@dataclasses.dataclass(frozen=True)
class HopCase:
    task_id: str
    task_type: str
    tokens: tuple  # the episode up to the end of the teacher's hop call (its closing im_end included)
    start: int  # index of the hop call's first token
    span: tuple  # (a, b): the identifier's tokens after its first, tokens[a:b]
    identifier: str  # the teacher's query
    shown: tuple  # the identifiers the first search's results show (``result_identifiers``)


def identifier_span(chat: ChatFormat, turn: Sequence[int], identifier: str) -> tuple[int, int]:
    """``(a, b)`` such that ``turn[a:b]`` are the tokens of ``"query": "<identifier>"`` after the
    one that begins the identifier, before the one that closes the string: the first ``a`` whose
    decoded prefix shows the identifier's first character in the query, the first ``b`` whose
    prefix shows it whole. A turn without that query is an error."""
    def first(condition, lo):
        for k in range(lo, len(turn) + 1):
            if condition(chat.decode(list(turn[:k]))):
                return k
        raise ValueError(f"{chat.decode(list(turn))!r} has no query {identifier!r}")

    a = first(lambda text: f'"query": "{identifier[:1]}' in text, 1)
    b = first(lambda text: f'"query": "{identifier}"' in text, a)
    return a, b - 1


def hop_cases(driver: EpisodeDriver, tasks: Sequence, teacher: Callable[[], Callable], per_task: int = 2) -> list[HopCase]:
    """Up to ``per_task`` hop cases of each task, each the episode of a new ``teacher()`` (a
    ``warmup.teacher_turns`` policy with ``hop=1``: ``forced_hop_teacher``). A draw whose first
    results show no identifier, or whose hop overflows the context, gives no case."""
    chat = driver.chat
    cases = []
    for task in tasks:
        for _ in range(per_task):
            policy = teacher()
            run = run_scripted(driver, task, policy)
            tokens, mask = run.trajectory.tokens, run.trajectory.loss_mask
            if run.episode.status != "ok" or _assistant_turns(mask) < 3:
                continue
            start = mask.index(1, _turn_end(mask, 1))
            end = _turn_end(mask, 2)
            calls = parse_tool_calls(chat.decode(tokens[start:end]))
            identifier = calls[0].arguments["query"]
            a, b = identifier_span(chat, tokens[start:end], identifier)
            first_results = next(m["content"] for m in run.messages if m["role"] == "tool")
            shown = result_identifiers(first_results, task.query)
            cases.append(HopCase(task.task_id, task.type, tuple(tokens[:end]), start, (start + a, start + b), identifier,
                                 tuple(shown)))
    return cases


def forced_hop_teacher(settings, rng: np.random.Generator) -> Callable[[], Callable]:
    """``teacher()`` for ``hop_cases``: the scripted teacher of ``settings`` (``setup.WarmupSettings``:
    its tool and ``top_k`` draws) with its hop forced."""
    if settings is None:
        raise ValueError("the hop probe needs the scripted teacher's settings (warmup.steps > 0)")
    return lambda: settings_teacher(settings, rng, hop=1.0)


def probe_hop_copy(cases: Sequence[HopCase], policy, chat: ChatFormat, max_len: int, max_new_tokens: int) -> dict:
    """``{task type: measures}`` (see the module docstring) of ``policy`` on ``cases``,
    and ``"all"`` over every case: ``cases``, ``id_token_accuracy``, ``id_token_accuracy_by_position``
    (a list: the k-th token after the identifier's first, over the cases whose identifier has it), ``id_exact``,
    ``greedy_call``, ``greedy_shown`` and ``greedy_answer`` (shares of the cases)."""
    if not cases:
        raise ValueError("no hop cases: the held-out tasks' first searches showed no identifier")
    for c in cases:
        if len(c.tokens) > max_len:
            raise ValueError(f"hop case of {c.task_id}: {len(c.tokens)} tokens, longer than max_len={max_len}")
    N = len(cases)
    grid = np.zeros((N, max_len), np.int32)
    for i, c in enumerate(cases):
        grid[i, :len(c.tokens)] = c.tokens
    lengths = np.array([len(c.tokens) for c in cases])
    width = max(c.span[1] - c.span[0] for c in cases)
    positions = np.zeros((N, max(width, 1)), np.int32)  # each identifier token's preceding position
    for i, c in enumerate(cases):
        positions[i, :c.span[1] - c.span[0]] = np.arange(c.span[0] - 1, c.span[1] - 1)
    predicted = np.asarray(policy.logits(grid, np.arange(max_len)[None] < lengths[:, None], positions)).argmax(-1)
    copied = [predicted[i, :c.span[1] - c.span[0]] == grid[i, c.span[0]:c.span[1]] for i, c in enumerate(cases)]

    # greedy: every case's own turn after the first search's results
    new = policy.greedy([c.tokens[:c.start] for c in cases], chat.im_end_id, max_new_tokens)
    turns = [chat.decode([t for t in tokens if t != chat.im_end_id]) for tokens in new]

    def queries(text):
        return [call.arguments.get("query") for call in parse_tool_calls(text) if call.arguments]

    rows = [dict(type=c.task_type, id_token=copied[i], call=bool(queries(turns[i])),
                 shown=any(q in c.shown for q in queries(turns[i])), answer=parse_answer(turns[i]) is not None)
            for i, c in enumerate(cases)]

    def measures(selected):
        tokens = np.concatenate([r["id_token"] for r in selected])
        width = max(len(r["id_token"]) for r in selected)
        by_position = [float(np.mean([r["id_token"][k] for r in selected if len(r["id_token"]) > k])) for k in range(width)]
        return {"cases": len(selected), "id_token_accuracy": float(tokens.mean()) if tokens.size else 0.0,
                "id_token_accuracy_by_position": by_position,
                "id_exact": float(np.mean([r["id_token"].all() for r in selected])),
                "greedy_call": float(np.mean([r["call"] for r in selected])),
                "greedy_shown": float(np.mean([r["shown"] for r in selected])),
                "greedy_answer": float(np.mean([r["answer"] for r in selected]))}

    out = {t: measures([r for r in rows if r["type"] == t]) for t in sorted({r["type"] for r in rows})}
    out["all"] = measures(rows)
    return out


class ModelPolicy:
    """The probe's policy for parameters ``params``: ``logits`` from one jitted forward pass (float32,
    at the asked positions only: a real vocabulary's logits at every position would not fit), and
    ``greedy`` turns from the sampler's ``prefill`` and ``decode`` at temperature 0."""

    def __init__(self, model_cfg: ModelConfig, params, max_len: int):
        self.params, self.max_len = params, max_len

        @jax.jit
        def logits(params, tokens, valid, positions):
            hidden, _ = forward(model_cfg, params, tokens, valid)
            return logits_from_hidden(model_cfg, params, jnp.take_along_axis(hidden, positions[..., None], axis=1))

        @functools.partial(jax.jit, static_argnums=(4,))
        def greedy(params, tokens, lengths, stop, max_new_tokens):
            B = tokens.shape[0]
            state = sampler.prefill(model_cfg, params, tokens, lengths, max_len)
            _, out = sampler.decode(model_cfg, params, state, jax.random.split(jax.random.PRNGKey(0), B), jnp.zeros(B),
                                    jnp.ones(B), jnp.full((B, 1), stop, jnp.int32), jnp.ones(B, bool),
                                    jnp.full(B, max_new_tokens, jnp.int32), max_new_tokens)
            return out.tokens, out.num_tokens

        self._logits, self._greedy = logits, greedy

    def logits(self, tokens, valid, positions):
        return self._logits(self.params, jnp.asarray(tokens), jnp.asarray(valid), jnp.asarray(positions))

    def greedy(self, prompts: Sequence[Sequence[int]], stop_id: int, max_new_tokens: int) -> list[list[int]]:
        grid = np.zeros((len(prompts), self.max_len), np.int32)
        for i, prompt in enumerate(prompts):
            grid[i, :len(prompt)] = prompt
        tokens, counts = jax.device_get(self._greedy(self.params, grid, np.array([len(p) for p in prompts], np.int32),
                                                     stop_id, max_new_tokens))
        return [list(map(int, row[:n])) for row, n in zip(tokens, counts)]
