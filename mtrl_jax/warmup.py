"""The cold start (the ``warmup.*`` config keys): supervised training on scripted, deliberately imperfect
demonstrations of the tool protocol, before RL.

The tiny default and the fetched instruction-tuned checkpoints alike need it: none of them uses the protocol on
its own (every fetched one scores 0, docs/real_models.md).

The scripted teacher calls a *random* search tool with the question verbatim,
asking for a *random* number of results; with probability ``hop`` it then makes a second search on
an identifier copied from the first search's results, chosen at random among those shown; then it
answers without ids (so the environment's answer fallback ranks the results). It never learns which
tool suits which question, how many results pay, which questions need the second search or which
identifier to follow: RL has to. ``hop_drills`` adds demonstrations whose hop is forced and whose
decision to hop carries no loss: the copy out of the results gets more examples, and the hop
probability the policy learns is still ``hop``.

A tiny model trained on a few hundred questions memorises their words rather than learning to copy
them; ``augment_question`` adds copies of each question whose identifier-like words (those with a
digit) are rewritten with random characters and whose other words are often swapped for other
question words, so copying is what generalises.
"""

from __future__ import annotations

import dataclasses
import itertools
import functools
import logging
import re
from typing import Any, Callable, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax

from mtrl_jax import rng as seeds
from mtrl_jax.chat import render_answer, render_tool_call
from mtrl_jax.checkpoint import CheckpointError, abstract_state
from mtrl_jax.model import lora
from mtrl_jax.model.lora import Policy
from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.sharding import activate, on_mesh, place_batch
from mtrl_jax.rl.batch import bucket, pad_rows
from mtrl_jax.rl.logprobs import logprobs_at, sequence_logprobs, shared_prefix_logprobs
from mtrl_jax.rl.train_step import all_finite
from mtrl_jax.rollout.interfaces import EpisodeDriver, run_scripted
from mtrl_jax.search.text import STOPWORDS


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


def _has_digit(text: str) -> bool:
    return any(ch.isdigit() for ch in text)


def augment_question(
    text: str, rng: np.random.Generator, vocabulary: Sequence[str] = (), word_rate: float = 0.5
) -> str:
    """A variant of ``text`` to copy: every character of each word that contains a digit is rewritten
    with a random one of its class (upper-case letter, lower-case letter, digit); each other word is,
    with probability ``word_rate``, replaced by a random word of ``vocabulary`` (none if empty)."""

    def scramble(word: str) -> str:
        if not _has_digit(word):
            if len(vocabulary) and rng.random() < word_rate:
                return vocabulary[rng.integers(len(vocabulary))]
            return word
        out = []
        for ch in word:
            if ch.isdigit():
                out.append(str(rng.integers(10)))
            elif "A" <= ch <= "Z":
                out.append(chr(ord("A") + rng.integers(26)))
            elif "a" <= ch <= "z":
                out.append(chr(ord("a") + rng.integers(26)))
            else:
                out.append(ch)
        return "".join(out)

    return " ".join(scramble(w) for w in text.split(" "))


def question_vocabulary(tasks) -> list[str]:
    """The distinct words without digits of the tasks' questions, sorted (deterministic)."""
    return sorted({w for t in tasks for w in t.query.split(" ") if w and not _has_digit(w)})


def augmented_tasks(task, copies: int, rng: np.random.Generator, vocabulary: Sequence[str] = ()) -> list:
    """``copies`` variants of ``task`` rewritten by ``augment_question`` (ids ``<task_id>#aug<i>``, no
    qrels: only the demonstration matters); none when there is nothing to rewrite."""
    if not len(vocabulary) and not _has_digit(task.query):
        return []
    return [
        dataclasses.replace(
            task, task_id=f"{task.task_id}#aug{i}", query=augment_question(task.query, rng, vocabulary), qrels={}
        )
        for i in range(copies)
    ]


_RESULT_LINE = re.compile(r"^\[\d+\] (\S+) \| (.*)$")  # tools.render_results: "[rank] doc_id | title | text"
_PUNCTUATION = ".,;:!?'\"()[]|"
ANSWERS = ("empty", "ids")  # warmup.teacher_answers


def result_identifiers(tool_output: str, question: str) -> list[str]:
    """The identifiers a search result shows: the distinct words with a digit in the results' titles
    and texts (not their document ids), punctuation stripped, that are not words of ``question``;
    in order of appearance."""
    asked = {w.strip(_PUNCTUATION) for w in question.split()}
    found = []
    for line in tool_output.splitlines():
        match = _RESULT_LINE.match(line)
        if match is None:
            continue
        for word in match.group(2).split():
            word = word.strip(_PUNCTUATION)
            if _has_digit(word) and word not in asked and word not in found:
                found.append(word)
    return found


def result_titles(tool_output: str, question: str) -> list[str]:
    """The distinct titles of the results a search showed (``[rank] id | title | text``), in order, but
    the question itself: the entities a second search can follow (a multi-hop question's bridge)."""
    found = []
    for line in tool_output.splitlines():
        match = _RESULT_LINE.match(line)
        if match is None or " | " not in match.group(2):
            continue
        title = match.group(2).split(" | ", 1)[0].strip()
        if title and title.lower() != question.strip().lower() and title not in found:
            found.append(title)
    return found


def result_ids(tool_output: str) -> list[str]:
    """The document ids the searches showed, in order of appearance, each once."""
    found = []
    for line in tool_output.splitlines():
        match = _RESULT_LINE.match(line)
        if match is not None and match.group(1) not in found:
            found.append(match.group(1))
    return found


def question_keywords(question: str) -> list[str]:
    """The question rewritten as its content words (stop words and punctuation dropped), or nothing when
    that changes nothing."""
    words = [w.strip(_PUNCTUATION) for w in question.split()]
    kept = " ".join(w for w in words if w and w.lower() not in STOPWORDS)
    return [kept] if kept and kept != question.strip() else []


# warmup.teacher_hop_queries: what a second search may look for, as (results shown, question) -> the queries to
# draw from: an identifier or a title the results showed, the question's content words, the question itself
HOP_QUERY_SOURCES = {
    "identifier": result_identifiers,
    "title": result_titles,
    "keywords": lambda shown, question: question_keywords(question),
    "question": lambda shown, question: [question],
}
HOP_QUERIES = tuple(HOP_QUERY_SOURCES)


class TeacherPolicy:
    """The scripted teacher of one episode (see ``teacher_turns``): called with the messages so far,
    returns the assistant's next turn."""

    def __init__(
        self, render, first, second, pick: float, hop_query: str = "identifier", answer: str = "empty", fits=None
    ):
        self.render, self.first, self.second, self.pick = render, first, second, pick
        self.hop_query, self.answer = hop_query, answer
        # fits(text): whether a turn of this text fits the per-turn token limit (None: no limit); an answer of ids
        # is cut to fit, so that no demonstration shows a turn the sampler would cut short
        self.fits = fits

    @property
    def hops(self) -> bool:
        return self.second is not None

    def without_hop(self) -> "TeacherPolicy":
        """The same episode with no second search (when the hop's results overflow the context)."""
        return TeacherPolicy(self.render, self.first, None, 0.0, self.hop_query, self.answer, self.fits)

    def __call__(self, messages) -> str:
        if messages[-1]["role"] == "user":
            return self.render(self.first, messages[-1]["content"])
        shown = "\n".join(m["content"] for m in messages if m["role"] == "tool")
        if self.second is not None and sum(m["role"] == "assistant" for m in messages) == 1:
            question = next(m["content"] for m in messages if m["role"] == "user")
            queries = HOP_QUERY_SOURCES[self.hop_query](shown, question)
            if queries:
                return self.render(self.second, queries[int(self.pick * len(queries))])
        ids = result_ids(shown)[:10] if self.answer == "ids" else []
        while ids and self.fits is not None and not self.fits(render_answer(ids)):
            ids.pop()
        return render_answer(ids)


def teacher_turns(
    rng: np.random.Generator,
    tool_names: Sequence[str],
    probs: Optional[np.ndarray] = None,
    top_ks: Sequence[Optional[int]] = (None,),
    top_k_probs: Optional[np.ndarray] = None,
    hop: float = 0.0,
    hop_probs: Optional[np.ndarray] = None,
    hop_queries: Sequence[str] = ("identifier",),
    hop_query_probs: Optional[np.ndarray] = None,
    answers: Sequence[str] = ("empty",),
    answer_probs: Optional[np.ndarray] = None,
    hop_other: bool = False,
) -> TeacherPolicy:
    """A scripted policy: a search with the question verbatim; with probability ``hop`` a second
    search on a query drawn uniformly from the first search's results, of a kind drawn from
    ``hop_queries`` (an identifier, ``result_identifiers``; a result's title, ``result_titles``; the
    question's content words, ``question_keywords``; or the question itself; none to follow: no second
    search); then an answer
    of a kind drawn from ``answers`` ("empty": the environment's fallback ranks the results; "ids": the
    ids the searches showed, in order). The first search's tool is drawn from ``probs``, the second's
    from ``hop_probs`` (both uniform by default; with ``hop_other``, uniformly among the tools the first
    search did not use), each search's number of results from ``top_ks`` with
    ``top_k_probs`` (``None``: no ``top_k`` argument), whatever the question. Every draw is made here,
    in a fixed order; a choice with a single option draws nothing."""

    def pick_one(options, p):
        return options[0] if len(options) == 1 else options[rng.choice(len(options), p=p)]

    def draw(p=probs):
        return tool_names[rng.choice(len(tool_names), p=p)], top_ks[rng.choice(len(top_ks), p=top_k_probs)]

    def render(tool_and_top_k, query):
        tool, top_k = tool_and_top_k
        return render_tool_call(tool, {"query": query} | ({} if top_k is None else {"top_k": int(top_k)}))

    first = draw()
    if hop_other and len(tool_names) > 1:
        hop_probs = np.array([0.0 if name == first[0] else 1.0 for name in tool_names]) / (len(tool_names) - 1)
    second = draw(hop_probs) if hop > 0 and rng.random() < hop else None
    pick = rng.random() if second is not None else 0.0
    hop_query = pick_one(hop_queries, hop_query_probs) if second is not None else hop_queries[0]
    return TeacherPolicy(render, first, second, pick, hop_query, pick_one(answers, answer_probs))


def settings_teacher(settings, rng: np.random.Generator, hop: Optional[float] = None) -> TeacherPolicy:
    """``teacher_turns`` with the draws of ``settings`` (``setup.WarmupSettings``); ``hop`` overrides its
    probability of a second search (1.0: forced, as in hop drills and the hop probe)."""
    return teacher_turns(
        rng,
        settings.tools,
        np.array(settings.tool_probs),
        settings.top_ks,
        np.array(settings.top_k_probs),
        settings.hop if hop is None else hop,
        np.array(settings.hop_tool_probs),
        settings.hop_queries,
        np.array(settings.hop_query_probs),
        settings.answers,
        np.array(settings.answer_probs),
        settings.hop_other,
    )


def demonstration_run(driver: EpisodeDriver, task, policy):
    """Run the scripted ``policy`` through the episode driver: the finished ``EpisodeRun``, whose trajectory
    is exactly what the collector would have produced had the policy sampled these turns, and whose
    episode holds the reward. A teacher's hop whose results overflow the context is left out (the episode
    is demonstrated without it)."""
    run = run_scripted(driver, task, policy)
    if run.episode.status == "context_limit" and isinstance(policy, TeacherPolicy) and policy.hops:
        run = run_scripted(driver, task, policy.without_hop())
    return run


def demonstration_tokens(driver: EpisodeDriver, task, policy) -> tuple[list[int], list[int]]:
    """``demonstration_run``'s ``(tokens, loss mask)``; an episode that does not end well is an error."""
    run = demonstration_run(driver, task, policy)
    if run.episode.status != "ok":
        raise RuntimeError(f"scripted demonstration failed on {task.task_id}: {run.episode.status}")
    return run.trajectory.tokens, run.trajectory.loss_mask


def decision_untrained(mask: Sequence[int]) -> list[int]:
    """``mask`` with no loss on the second assistant turn's first token: the choice between a second
    search and an answer (a hop drill's hop is forced, so that choice is not the teacher's)."""
    mask = list(mask)
    start = mask.index(1, turn_end(mask, 1))
    mask[start] = 0
    return mask


def turn_end(mask: Sequence[int], turns: int) -> int:
    """Index just past the ``turns``-th run of assistant tokens (the whole length when there are fewer)."""
    end, seen = 0, 0
    mask = list(mask)
    while seen < turns:
        try:
            end = mask.index(1, end)
        except ValueError:
            return len(mask)
        while end < len(mask) and mask[end] == 1:
            end += 1
        seen += 1
    return end


def turn_lengths(mask: Sequence[int]) -> list[int]:
    """The tokens of each assistant turn, in order (the runs of loss-mask ones, each end token included)."""
    return [sum(1 for _ in run) for trained, run in itertools.groupby(mask) if trained]


def longest_turn(mask: Sequence[int]) -> int:
    """The tokens of the longest assistant turn (0 without one)."""
    return max(turn_lengths(mask), default=0)


def last_turn(mask: Sequence[int]) -> int:
    """The tokens of the last assistant turn (the answer of a finished demonstration; 0 without one)."""
    return (turn_lengths(mask) or [0])[-1]


def assistant_turns(mask: Sequence[int]) -> int:
    return sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))


def common_prefix(demos: Sequence[tuple[Sequence[int], Sequence[int]]]) -> list[int]:
    """The tokens every demonstration ``(tokens, loss mask)`` begins with, up to the first trained
    token of any and leaving each at least one token (the system prompt on the default)."""
    first = demos[0][0]
    n = min(len(t) for t, _ in demos) - 1
    for tokens, mask in demos:
        k = 0
        while k < n and tokens[k] == first[k] and not mask[k]:
            k += 1
        n = k
    return [int(t) for t in first[:n]]


def _pack(demos, length_multiple: int = 8):
    T = bucket(max(len(t) for t, _ in demos), length_multiple)
    return (
        pad_rows([t for t, _ in demos], T, np.int32),
        pad_rows([[1] * len(t) for t, _ in demos], T, np.int32),
        pad_rows([m for _, m in demos], T, np.float32),
    )


@dataclasses.dataclass
class WarmupProgress:
    """Where a supervised warm-up stands: enough to continue it exactly (``step`` of ``steps`` done)."""

    params: Any
    opt_state: Any
    step: int
    rng_state: dict  # the batch sampler's numpy bit-generator state
    losses: list


def step_view(i: int, full_every: int, two_turn_every: int) -> str:
    """Which view of the demonstrations warm-up step ``i`` (0-based) trains on: ``"full"`` (whole
    ones, one step in ``full_every``), ``"two"`` (cut after their second turn, one of the other steps
    in ``two_turn_every``; 0: never) or ``"first"`` (cut after their first turn)."""
    if (i + 1) % full_every == 0:
        return "full"
    return "two" if two_turn_every and i % two_turn_every == 1 % two_turn_every else "first"


def warmup_optimizer(steps: int, learning_rate: float) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(1.0),
        optax.adamw(
            optax.warmup_cosine_decay_schedule(0.0, learning_rate, max(1, steps // 20), max(steps, 2)), weight_decay=0.0
        ),
    )


def loss_columns(loss_mask: np.ndarray, multiple: int = 16) -> tuple[np.ndarray, np.ndarray]:
    """``(columns [B, K], weights [B, K])``: each row's loss-mask positions, padded (column 0, weight 0) to
    ``K``, the longest row's count rounded up to ``multiple`` (a few shapes, few compiles)."""
    counts = loss_mask.sum(axis=1).astype(int)
    K = bucket(max(int(counts.max()), 1), multiple)
    columns, weights = np.zeros((len(loss_mask), K), np.int32), np.zeros((len(loss_mask), K), np.float32)
    for row, mask in enumerate(loss_mask):
        where = np.flatnonzero(mask)
        columns[row, : len(where)], weights[row, : len(where)] = where, mask[where]
    return columns, weights


def warmup_step(
    model_cfg: ModelConfig,
    tx: optax.GradientTransformation,
    shared: np.ndarray,
    logprob_chunk: int = 512,
    columns_only: bool = False,
    micro_batches: int = 1,
):
    """The jitted warm-up step ``(params, opt_state, frozen, tokens, attention, loss_mask) -> (params,
    opt_state, loss, finite)``: mean cross-entropy on the loss-mask tokens, trained on ``params`` (the trainable
    parameters; ``frozen`` the rest of the model, ``lora.split``). With a non-empty ``shared`` prefix the
    rows are what follows it, and it is computed once (``shared_prefix_logprobs``). The optimizer state is
    donated; the parameters are not (the caller's may be published).

    ``columns_only``: the step takes ``(columns, weights)`` (``loss_columns``) instead of the loss mask and
    runs the output projection at those columns alone (``logprobs_at``): the same loss and gradients, to
    float rounding, for a fraction of the head's work when most tokens carry no loss (tool results).
    ``micro_batches``: the rows in that many slices, their gradients accumulated (``lax.scan``), so that only
    one slice's activations are held at a time; the same loss and gradient, to float rounding.
    A step whose loss or updated parameters are not finite leaves parameters and optimizer state as they
    were (``finite`` false)."""
    P = len(shared)

    def loss_fn(trainable, frozen, tok, att, mask, normaliser=None):
        params = lora.merge(frozen, trainable)
        if columns_only:
            columns, weights = mask
            prefix = jnp.asarray(shared) if P else None
            logp, _ = logprobs_at(model_cfg, params, tok, att, columns, 1.0, logprob_chunk, prefix=prefix)
            total = weights.sum() if normaliser is None else normaliser
            return -(logp * weights).sum() / jnp.maximum(total, 1.0)
        if P:
            logp, _ = shared_prefix_logprobs(model_cfg, params, jnp.asarray(shared), tok, att, chunk_size=logprob_chunk)
        else:
            logp, _ = sequence_logprobs(model_cfg, params, tok, att, temperature=1.0, chunk_size=logprob_chunk)
        return -(logp * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def step(params, opt_state, frozen, tok, att, mask):
        if micro_batches == 1:
            loss, grads = jax.value_and_grad(loss_fn)(params, frozen, tok, att, mask)
        else:  # every slice normalised by the whole batch's count: their sum is the batch's loss and gradient
            if not columns_only:
                raise ValueError("warm-up micro-batches take the loss columns (columns_only)")
            total = mask[1].sum()
            slices = jax.tree.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), (tok, att, mask))

            def accumulate(carry, xs):
                loss, grads = jax.value_and_grad(loss_fn)(params, frozen, *xs, normaliser=total)
                return jax.tree.map(jnp.add, carry, (loss, grads)), None

            zero = (jnp.zeros((), jnp.float32), jax.tree.map(jnp.zeros_like, params))
            (loss, grads), _ = jax.lax.scan(accumulate, zero, slices)
        updates, new_opt_state = tx.update(grads, opt_state, params)
        new_params = optax.apply_updates(params, updates)
        finite = jnp.isfinite(loss) & all_finite(new_params)  # else the step is skipped: nothing changes
        keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
        return keep(new_params, params), keep(new_opt_state, opt_state), loss, finite

    return step


def supervised_warmup(
    model_cfg: ModelConfig,
    params,
    demos: Sequence[tuple[list[int], list[int]]],
    steps: int,
    batch_size: int,
    learning_rate: float,
    seed=0,
    log_every: int = 50,
    log=print,
    full_every: int = 8,
    full_bucket: int = 64,
    resume: Optional[WarmupProgress] = None,
    two_turn_every: int = 2,
    should_stop: Optional[Callable[[], bool]] = None,
    mesh=None,
    logprob_chunk: int = 512,
    share_prefix: bool = True,
    frozen=None,
    columns_only: bool = False,
    micro_batches: int = 1,
    max_nonfinite_steps: int = 3,
) -> WarmupProgress:
    """Cross-entropy on the demonstrations' assistant tokens. Returns the progress: ``step == steps``
    when done, fewer when ``should_stop()`` turned true (then ``resume=`` the progress continues
    exactly where it stopped). ``params`` are the trainable parameters (the LoRA adapters; ``frozen``
    the rest of the model, or None when every parameter trains).

    The first assistant turn (the tool call, which has to copy the question) carries most of what
    there is to learn, and it comes early in the sequence: so every step but one in ``full_every``
    trains on the demonstrations cut after their first turn, which is several times cheaper. When
    some demonstrations have more than two turns (a second search, whose query is copied from the
    first search's results), one of those steps in ``two_turn_every`` (0: none) trains on all of them
    cut after their second turn instead, so the hop's copy and the choice between hopping and
    answering are learnt too.
    Whole demonstrations are grouped by length (multiples of ``full_bucket`` tokens): a full step
    draws a demonstration and fills its batch from the same group, so a few long tool responses
    (a large ``top_k``) do not pad every batch to their length. ``logprob_chunk``: as ``rl.logprob_chunk``.
    With ``share_prefix``, the tokens every demonstration opens with (``common_prefix``: the system
    prompt) are computed once per step instead of once per row (``shared_prefix_logprobs``: the same
    loss and gradients); on the default they are more than half of a first-turn cut.
    A step with a non-finite loss or updated parameters is skipped (a warning); ``max_nonfinite_steps`` of
    them in a row, or all of the steps run, stop the warm-up with a ``FloatingPointError``.
    """
    tx = warmup_optimizer(steps, learning_rate)
    shared = np.asarray(common_prefix(demos) if share_prefix else [], np.int32)
    P = len(shared)
    if log and P:
        log(f"warm-up: the {P} tokens every demonstration opens with are computed once per step")

    def after_prefix(packed):  # the rows without the shared prefix's columns (computed once per step)
        return tuple(x[:, P:] for x in packed)

    def grouped(cut):  # demonstrations cut by cut(tokens, mask), grouped by length (multiples of full_bucket)
        cuts = [(t[: cut(m)], m[: cut(m)]) for t, m in demos]
        group_of = [bucket(len(t), full_bucket) for t, _ in cuts]
        groups = {}
        for length in sorted(set(group_of)):
            members = [i for i, g in enumerate(group_of) if g == length]
            groups[length] = np.array(members), after_prefix(_pack([cuts[i] for i in members], full_bucket))
        return group_of, groups

    full = grouped(len)
    prefixes = after_prefix(_pack([(t[: turn_end(m, 1)], m[: turn_end(m, 1)]) for t, m in demos]))
    # with demonstrations of more than two turns (the teacher's hops), one step in two_turn_every trains on
    # them cut after their second turn: the hop's call (copied from the first results) or the answer there
    two_turns = (
        grouped(lambda m: turn_end(m, 2)) if two_turn_every and any(assistant_turns(m) > 2 for _, m in demos) else None
    )

    frozen = {} if frozen is None else frozen
    step = warmup_step(model_cfg, tx, shared, logprob_chunk, columns_only, micro_batches)
    rng = np.random.default_rng(seed)
    if resume is None:
        opt_state, start, losses = on_mesh(tx.init(params), mesh), 0, []
    else:
        params, opt_state, start, losses = resume.params, resume.opt_state, resume.step, list(resume.losses)
        rng.bit_generator.state = resume.rng_state
    in_a_row = skipped = 0  # skipped (non-finite) steps in a row, and in all
    for i in range(start, steps):
        if should_stop is not None and should_stop():
            return WarmupProgress(params, opt_state, i, rng.bit_generator.state, losses)
        view = {"full": full, "two": two_turns, "first": None}[step_view(i, full_every, two_turn_every)]
        if view is not None:
            group_of, groups = view
            members, (tokens, attention, loss_mask) = groups[group_of[int(rng.integers(len(demos)))]]
            idx = rng.choice(len(members), size=batch_size, replace=len(members) < batch_size)
        else:
            tokens, attention, loss_mask = prefixes
            idx = rng.choice(len(demos), size=min(batch_size, len(demos)), replace=False)
        with activate(mesh):
            mask = loss_columns(loss_mask[idx]) if columns_only else loss_mask[idx]
            params, opt_state, loss, finite = step(
                params, opt_state, frozen, *place_batch((tokens[idx], attention[idx], mask), mesh)
            )
        if not bool(finite):
            in_a_row += 1
            logging.getLogger("mtrl_jax").warning(
                "warm-up step %d skipped: non-finite loss or parameters (%d in a row)", i + 1, in_a_row
            )
            if in_a_row >= max_nonfinite_steps:
                raise FloatingPointError(
                    f"warm-up step {i + 1}: {in_a_row} steps in a row had a non-finite loss or updated parameters "
                    f"(rl.max_nonfinite_steps={max_nonfinite_steps}); stopping, nothing of them was saved. "
                    f"Check warmup.learning_rate={learning_rate}"
                )
            skipped += 1
            continue
        in_a_row = 0
        losses.append(float(loss))
        if log and (i + 1) % log_every == 0:
            log(f"warm-up step {i + 1}/{steps}: loss {np.mean(losses[-log_every:]):.4f}")
    if steps > start and skipped == steps - start:
        raise FloatingPointError(
            f"warm-up: all {skipped} steps had a non-finite loss or updated parameters; stopping, nothing of them "
            f"was saved. Check warmup.learning_rate={learning_rate}"
        )
    return WarmupProgress(params, opt_state, steps, rng.bit_generator.state, losses)


def demonstrations(components, log=None) -> list[tuple[list[int], list[int]]]:
    """The scripted teacher's ``(tokens, loss mask)`` demonstrations of every training task and its
    augmented variants (``components.warmup`` settings), rendered through the episode driver; the
    same, seeded, on every call.

    ``samples_per_task`` demonstrations are drawn per task (each with its own draws of the teacher). With
    ``min_reward`` set, those of a task with relevance judgments whose reward falls below it are dropped
    (rejection sampling on the training tasks' judgments; no held-out task is ever a demonstration); with
    ``keep_best``, only the highest-reward one of a judged task's draws is kept (best of n; ties: the one
    whose answer has fewest tokens, then the first drawn; a variant without judgments, such as an augmented
    one, is then drawn once), so that the teacher's choices lean toward those
    that pay on each collection, and, for the same reward, toward the empty answer ranked by
    ``env.answer_fallback`` over ids listed (a small model's greedy id lists run on past the turn's
    limit). Only the answer is compared: counting every token would prefer fewer results asked for. A
    demonstration that does not end well (its results overflow the context), or has a turn longer than
    ``rollout.max_tokens_per_turn`` (which the sampler would cut), is dropped and counted; an answer of ids
    is cut to the ids that fit that limit (DBpedia's long ids: ten of them do not fit 96 tokens)."""
    cfg = components.warmup
    rng = np.random.default_rng(seeds.numpy_seed(components.run.seed, "demonstrations"))
    driver = EpisodeDriver(components.env, components.chat, components.collector.max_len)
    vocabulary = question_vocabulary(components.train_tasks)
    budget, encode = components.collector.max_tokens_per_turn, components.chat.encode
    fits = lambda text: len(encode(text)) + 1 <= budget  # noqa: E731 - the turn's tokens and its end token

    def teacher(hop=None):
        policy = settings_teacher(cfg, rng, hop)
        policy.fits = fits
        return policy

    demos, drawn, rejected, not_best, failed, too_long = [], 0, 0, 0, 0, 0
    tool_errors: dict = {}  # failed tool calls by kind: a flaky server shows here, not only in a worse cold start

    def usable(run, judged: bool) -> bool:
        nonlocal failed, too_long, rejected
        for key, value in run.episode.counters.items():
            if key.startswith("tool_errors/"):
                tool_errors[key.split("/", 1)[1]] = tool_errors.get(key.split("/", 1)[1], 0) + value
        if run.episode.status != "ok":
            failed += 1
        elif longest_turn(run.trajectory.loss_mask) > budget:  # a call the sampler would cut short
            too_long += 1
        elif judged and cfg.min_reward is not None and run.episode.reward < cfg.min_reward:
            rejected += 1
        else:
            return True
        return False

    from tqdm import tqdm

    progress = getattr(components.run, "log_progress", False) and log is not None
    for task in tqdm(components.train_tasks, desc="demonstrations", unit="task", disable=not progress):
        for variant in [task] + augmented_tasks(task, cfg.augment, rng, vocabulary):
            # with keep_best, a variant without judgments (an augmented one) has nothing to choose its draws by:
            # it is drawn once, so that each question and each rewrite weighs one demonstration
            judged = bool(variant.qrels)
            draws = cfg.samples_per_task if judged or not cfg.keep_best else 1
            runs = [demonstration_run(driver, variant, teacher()) for _ in range(draws)]
            drawn += len(runs)
            kept = [run for run in runs if usable(run, judged)]
            if cfg.keep_best and judged and kept:  # best of n: the highest reward, then the shortest answer
                not_best += len(kept) - 1
                kept = [max(kept, key=lambda run: (run.episode.reward, -last_turn(run.trajectory.loss_mask)))]
            demos.extend((run.trajectory.tokens, run.trajectory.loss_mask) for run in kept)
            # hop drills: the hop forced, its decision untrained (none when no hop fits or none is shown)
            for _ in range(cfg.hop_drills):
                run = demonstration_run(driver, variant, teacher(hop=1.0))
                drawn += 1
                mask = run.trajectory.loss_mask
                if usable(run, False) and assistant_turns(mask) > 2:
                    demos.append((run.trajectory.tokens, decision_untrained(mask)))
    counts = (
        f"{drawn} drawn, {rejected} below warmup.min_reward={cfg.min_reward}, {not_best} not the best of their "
        f"task's warmup.samples_per_task={cfg.samples_per_task}, {failed} past the context, {too_long} with a turn "
        f"over rollout.max_tokens_per_turn={budget}"
        + (f"; failed tool calls {dict(sorted(tool_errors.items()))}" if tool_errors else "")
    )
    if log and (rejected or not_best or failed or too_long or tool_errors):
        log(f"demonstrations: {counts}")
    if not demos:
        raise ValueError(f"no demonstration left for the warm-up ({counts})")
    return demos


def warm_up(
    components,
    params,
    log=print,
    resume: Optional[WarmupProgress] = None,
    should_stop: Optional[Callable[[], bool]] = None,
) -> WarmupProgress:
    """The embedded default's warm-up of ``params`` (``warmed_parameters``): ``supervised_warmup`` on
    ``demonstrations``."""
    cfg = components.warmup
    model_cfg, frozen = warmup_model(components)
    demos = demonstrations(components, log)
    log(
        f"warm-up on {len(demos)} scripted demonstrations for {cfg.steps} steps"
        + (f", continuing at step {resume.step}" if resume is not None else "")
    )
    return supervised_warmup(
        model_cfg,
        params,
        demos,
        cfg.steps,
        cfg.batch_size,
        cfg.learning_rate,
        seed=seeds.numpy_seed(components.run.seed, "warmup_batches"),
        log=log,
        resume=resume,
        should_stop=should_stop,
        mesh=components.mesh,
        logprob_chunk=components.updater.config.logprob_chunk,
        share_prefix=cfg.share_prefix,
        full_every=cfg.full_every,
        two_turn_every=cfg.two_turn_every,
        frozen=frozen,
        columns_only=cfg.loss_columns_only,
        micro_batches=cfg.micro_batches,
        max_nonfinite_steps=components.run.max_nonfinite_steps,
    )


def warmup_model(components) -> tuple[ModelConfig, dict]:
    """``(model config, frozen parameters)`` of the warm-up: those of RL (the LoRA adapters train over the
    frozen base, or every parameter), or with ``warmup.train_base`` the base model alone, all of it trained."""
    if components.warmup.train_base:
        return components.model_cfg.replace(lora_rank=0), {}
    return components.model_cfg, components.policy.base


def warmed_parameters(components, trainable):
    """What the warm-up trains: RL's ``trainable`` parameters, or with ``warmup.train_base`` the base."""
    return components.policy.base if components.warmup.train_base else trainable


def rl_policy(components, warmed) -> Policy:
    """The policy RL starts from, given what the finished warm-up trained (``warmed``): RL's trainable
    parameters over the initial base, or with ``warmup.train_base`` the initial (fresh) adapters over the
    warmed-up base."""
    if components.warmup is not None and components.warmup.train_base:
        return Policy(warmed, components.policy.trainable)
    return Policy(components.policy.base, warmed)


def resume_or_warm_up(
    components, checkpoints, params, log=print, should_stop: Optional[Callable[[], bool]] = None
) -> WarmupProgress:
    """The warm-up of ``params`` (RL's trainable parameters; the base with ``warmup.train_base``), continued
    from the progress saved in the work directory (``checkpoints.restore_warmup``), its progress saved again
    at the end or when ``should_stop()`` turned true (then ``step < steps``: the caller stops, and the next
    run continues it exactly)."""
    cfg = components.warmup
    params = warmed_parameters(components, params)
    like_opt = jax.eval_shape(warmup_optimizer(cfg.steps, cfg.learning_rate).init, params)
    saved = checkpoints.restore_warmup(params, like_opt)
    progress = (
        None
        if saved is None
        else WarmupProgress(saved[0], saved[1], saved[2]["step"], saved[2]["rng_state"], saved[2]["losses"])
    )
    if progress is None or progress.step < cfg.steps:
        progress = warm_up(components, params, log=log, resume=progress, should_stop=should_stop)
        checkpoints.save_warmup(progress.params, progress.opt_state, progress.step, progress.rng_state, progress.losses)
    return progress


STAGES = ("rl", "warmup")  # what restore_policy reads: RL's latest checkpoint, or the finished warm-up


def restore_policy(components, checkpoints, stage: str) -> Policy:
    """The policy a work directory (``checkpoints``) holds, read-only (no checkpoint is moved): with
    ``stage="warmup"`` the one RL started from (its finished warm-up); with ``stage="rl"`` RL's latest
    checkpoint, its trainable parameters over the base RL trained over (with ``warmup.train_base``, the one the
    warm-up trained). A resumed run takes its base from here, and the evaluation and the export the whole of it."""
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r}: one of {STAGES}")
    train_base = components.warmup is not None and components.warmup.train_base
    why = "warmup.train_base=True, and the RL adapters train over the base the warm-up trained, but its"
    if stage == "warmup":
        if components.warmup is None:
            raise ValueError("the config has no warm-up (warmup.steps=0), so a run of it has no warmed-up policy")
        asked = why if train_base else "the warmed-up policy was asked for, but the"
        return rl_policy(components, restore_finished_warmup(components, checkpoints, asked))
    base = restore_finished_warmup(components, checkpoints, why) if train_base else components.policy.base
    like = abstract_state(components.tx, components.policy.trainable, jax.random.PRNGKey(0))
    restored = checkpoints.restore(like, read_only=True)
    if restored is None:
        raise FileNotFoundError(f"{checkpoints.workdir}: no checkpoint under {checkpoints.workdir / 'checkpoints'}")
    return Policy(base, restored[0].params)


def restore_finished_warmup(components, checkpoints, why: str):
    """What the work directory's finished warm-up trained (``warmed_parameters``); a ``CheckpointError`` that
    names the directory (``why`` opens its reason) when the warm-up checkpoint is missing or unfinished."""
    cfg = components.warmup
    like = warmed_parameters(components, components.policy.trainable)
    like_opt = jax.eval_shape(warmup_optimizer(cfg.steps, cfg.learning_rate).init, like)
    saved = checkpoints.restore_warmup(like, like_opt)
    if saved is None or saved[2]["step"] < cfg.steps:
        found = "none" if saved is None else f"step {saved[2]['step']} of {cfg.steps}"
        raise CheckpointError(
            f"{checkpoints.warmup_path}: {why} finished warm-up checkpoint is missing (found: {found}); restore "
            "that directory or start over in a new workdir"
        )
    return saved[0]
