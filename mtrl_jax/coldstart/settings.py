"""The cold start's settings: ``ColdStartSettings``, read from the ``warmup.*`` config keys (and the few of
``rl.*`` and ``seed`` its step reads) by ``coldstart_settings``, with the parsers of its weighted choices. The
numeric fields' ranges are ``mtrl_jax.ranges``'s; what is checked here is what no range can say."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from mtrl_jax import rng as seeds
from mtrl_jax.data.build import csv
from mtrl_jax.coldstart.teacher import ANSWERS, HOP_QUERIES, Teacher
from mtrl_jax.search.build import SearchSettings


@dataclasses.dataclass(frozen=True)
class ColdStartSettings:
    """Everything the cold start reads: the teacher's draws, the demonstrations' selection and the supervised
    step's schedule. The defaults are the step's own; ``coldstart_settings`` fills every field from a config."""

    steps: int  # supervised steps (warmup.steps)
    batch_size: int  # demonstrations a step (warmup.batch_size)
    learning_rate: float  # peak of its cosine schedule after a ramp of steps / 20 (warmup.learning_rate)
    teacher: Optional[Teacher] = None  # the scripted teacher (None: demonstrations are given)
    augment: int = 0  # rewritten copies of each training question (warmup.augment)
    special_copies: int = 0  # copies with quotes, a backslash or an accent written in (warmup.special_copies)
    hop_drills: int = 0  # extra forced-hop demonstrations per question, the decision untrained (warmup.hop_drills)
    samples_per_task: int = 1  # demonstrations drawn per training task (warmup.samples_per_task)
    min_reward: Optional[float] = None  # rejection sampling: keep those at least this good (warmup.min_reward)
    keep_best: bool = False  # only the best of a judged task's draws, of equals the shortest answer (warmup.keep_best)
    keep_best_per_searches: bool = False  # with keep_best: the best draw of each number of searches (its field)
    share_prefix: bool = True  # the prompt every demonstration opens with computed once a step (warmup.share_prefix)
    full_every: int = 8  # one step in this many trains on whole demonstrations (warmup.full_every)
    two_turn_every: int = 2  # one other step in this many: cut after the second turn (warmup.two_turn_every)
    full_bucket: int = 64  # whole demonstrations grouped by length in multiples of this many tokens
    loss_columns_only: bool = False  # the output projection at the trained columns only (warmup.loss_columns_only)
    micro_batches: int = 1  # a step's rows in this many slices, gradients accumulated (warmup.micro_batches)
    train_base: bool = False  # the cold start trains the base weights, RL fresh adapters over them (warmup.train_base)
    batch_seed: Sequence[int] = (0,)  # numpy seed of the batch draws (the run's seed, stream "warmup_batches")
    logprob_chunk: int = 512  # as rl.logprob_chunk
    max_nonfinite_steps: int = 3  # skipped steps in a row that stop the cold start (rl.max_nonfinite_steps)
    log_every: int = 50  # a loss line every this many steps


def coldstart_settings(config) -> Optional[ColdStartSettings]:
    """The cold start of ``config`` (None with ``warmup.steps=0``); a combination of fields that cannot work is
    a ``ValueError`` naming them (their ranges are checked by ``ranges.check``, before)."""
    w = config.warmup
    if not w.steps:
        return None
    tools = tuple(csv(config.search.tools))
    if w.keep_best_per_searches and not w.keep_best:
        raise ValueError(
            "warmup.keep_best_per_searches=True chooses among warmup.keep_best's draws: set keep_best=True"
        )
    if w.batch_size % w.micro_batches:
        raise ValueError(f"warmup.micro_batches={w.micro_batches} must divide warmup.batch_size={w.batch_size}")
    if w.micro_batches > 1 and not w.loss_columns_only:
        raise ValueError("warmup.micro_batches > 1 needs warmup.loss_columns_only=True")
    if w.train_base and not config.model.lora_rank:
        raise ValueError(
            "warmup.train_base=True trains the base in the warm-up and LoRA adapters over it in RL; it needs "
            f"model.lora_rank > 0 (got {config.model.lora_rank}: without adapters every weight trains in both already)"
        )
    if w.train_base and config.model.param_dtype != "float32":
        raise ValueError(
            f"warmup.train_base=True with model.param_dtype={config.model.param_dtype!r}: the warm-up would update the "
            "base weights in that dtype, where a small step rounds away; use model.param_dtype='float32'"
        )
    return ColdStartSettings(
        steps=w.steps,
        batch_size=w.batch_size,
        learning_rate=w.learning_rate,
        teacher=teacher_settings(config, tools),
        augment=w.augment,
        special_copies=int(w.special_copies),
        hop_drills=int(w.hop_drills),
        samples_per_task=int(w.samples_per_task),
        min_reward=None if w.min_reward <= -1.0 else float(w.min_reward),
        keep_best=bool(w.keep_best),
        keep_best_per_searches=bool(w.keep_best_per_searches),
        share_prefix=bool(w.share_prefix),
        full_every=int(w.full_every),
        two_turn_every=int(w.two_turn_every),
        loss_columns_only=bool(w.loss_columns_only),
        micro_batches=int(w.micro_batches),
        train_base=bool(w.train_base),
        batch_seed=tuple(seeds.numpy_seed(config.seed, "warmup_batches")),
        logprob_chunk=int(config.rl.logprob_chunk),
        max_nonfinite_steps=int(config.rl.max_nonfinite_steps),
    )


def teacher_settings(config, tools: tuple[str, ...]) -> Teacher:
    """The teacher's draws from ``warmup.teacher_*`` (weights ``NAME:WEIGHT,...``; "" is uniform)."""
    w = config.warmup
    top_ks, top_k_probs = parse_top_k_weights(w.teacher_top_k, SearchSettings.max_top_k)
    hop_queries, hop_query_probs = parse_choices(w.teacher_hop_queries, HOP_QUERIES, "warmup.teacher_hop_queries")
    hop_other = w.teacher_hop_tools.strip() == "other"
    if hop_other and len(tools) < 2:
        raise ValueError(
            f"warmup.teacher_hop_tools='other' needs two tools or more in search.tools, got {config.search.tools!r}"
        )
    answers, answer_probs = parse_choices(w.teacher_answers, ANSWERS, "warmup.teacher_answers")
    if w.teacher_multi_query > 0 and config.search.max_queries < 2:
        raise ValueError(
            f"warmup.teacher_multi_query={w.teacher_multi_query} demonstrates lists of queries: it needs "
            f"search.max_queries >= 2, got {config.search.max_queries}"
        )
    hop_tools = parse_tool_weights("" if hop_other else w.teacher_hop_tools, tools, "warmup.teacher_hop_tools")
    return Teacher(
        tools=tools,
        tool_probs=tuple(parse_tool_weights(w.teacher_tools, tools).tolist()),
        top_ks=tuple(top_ks),
        top_k_probs=tuple(top_k_probs.tolist()),
        hop=w.teacher_hop,
        hop_tool_probs=tuple(hop_tools.tolist()),
        hop_other=hop_other,
        hop_queries=hop_queries,
        hop_query_probs=tuple(hop_query_probs.tolist()),
        answers=answers,
        answer_probs=tuple(answer_probs.tolist()),
        multi_query=float(w.teacher_multi_query),
        max_queries=int(config.search.max_queries),
    )


def _parse_weights(text: str, field: str, what: str, parse_key) -> dict:
    """``"KEY:WEIGHT,..."`` -> ``{key: weight}`` (keys through ``parse_key``, which raises ValueError)."""
    weights = {}
    for item in text.split(","):
        key, sep, value = item.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            key = parse_key(key)
        except ValueError:
            raise ValueError(f"{field}: {item.strip()!r} must be {what}:WEIGHT") from None
        try:
            weights[key] = float(value)
        except ValueError:
            raise ValueError(f"{field}: {item.strip()!r}: weight {value!r} is not a number") from None
        if weights[key] < 0:
            raise ValueError(f"{field}: {item.strip()!r}: weights must be >= 0")
    if sum(weights.values()) <= 0:
        raise ValueError(f"{field}: {text!r} gives every choice weight 0")
    return weights


def parse_tool_weights(text: str, tool_names: Sequence[str], field: str = "warmup.teacher_tools") -> np.ndarray:
    """``"vector_search:3,bm25_search:1"`` -> probabilities in ``tool_names`` order; "" -> uniform.

    Tools not named get weight 0; naming an unknown tool or a negative weight is an error naming ``field``."""
    if not text.strip():
        return np.full(len(tool_names), 1.0 / len(tool_names))

    def tool(name):
        if name not in tool_names:
            raise ValueError
        return name

    weights = _parse_weights(text, field, f"TOOL (one of {list(tool_names)})", tool)
    w = np.array([weights.get(n, 0.0) for n in tool_names])
    return w / w.sum()


def parse_choices(text: str, allowed: Sequence[str], field: str) -> tuple[tuple[str, ...], np.ndarray]:
    """``"title:1,keywords:2"`` -> ``(("title", "keywords"), probabilities)``: the named choices of weight
    > 0 (in ``allowed``'s order) and their probabilities; a name not in ``allowed`` is an error naming ``field``."""

    def choice(name):
        if name not in allowed:
            raise ValueError
        return name

    weights = _parse_weights(text, field, f"NAME (one of {list(allowed)})", choice)
    names = tuple(n for n in allowed if weights.get(n, 0.0) > 0)
    w = np.array([weights[n] for n in names])
    return names, w / w.sum()


def parse_top_k_weights(text: str, max_top_k: int) -> tuple[list, np.ndarray]:
    """``"1:4,2:2,10:1"`` -> ``([1, 2, 10], probabilities)``; "" -> ``([None], [1.0])`` (no ``top_k``
    argument: the tool's default)."""
    if not text.strip():
        return [None], np.ones(1)

    def k(value):
        value = int(value)
        if not 1 <= value <= max_top_k:
            raise ValueError
        return value

    weights = _parse_weights(text, "warmup.teacher_top_k", f"K (an integer in 1..{max_top_k})", k)
    values = sorted(weights)
    w = np.array([weights[v] for v in values])
    return values, w / w.sum()
