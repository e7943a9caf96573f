"""The cold start's scripted teacher: it calls a *random* search tool with the question verbatim, asking for a
*random* number of results; with probability ``hop`` it then makes a second search on a query drawn from what
the first search showed (an identifier, a title, the question's content words, or the question again); then it
answers (without ids, so that the environment's answer fallback ranks the results, or with the ids shown). It
never learns which tool suits which question, how many results pay, which questions need the second search or
what to follow: RL has to.

A tiny model trained on a few hundred questions memorises their words rather than learning to copy them;
``augment_question`` adds copies of each question whose identifier-like words (those with a digit) are rewritten
with random characters and whose other words are often swapped for other question words, so copying is what
generalises.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import numpy as np

from mtrl_jax.chat import render_answer, render_tool_call
from mtrl_jax.search.results import has_digit, question_keywords, result_identifiers, result_ids, result_titles

ANSWERS = ("empty", "ids")  # warmup.teacher_answers


def augment_question(
    text: str, rng: np.random.Generator, vocabulary: Sequence[str] = (), word_rate: float = 0.5
) -> str:
    """A variant of ``text`` to copy: every character of each word that contains a digit is rewritten
    with a random one of its class (upper-case letter, lower-case letter, digit); each other word is,
    with probability ``word_rate``, replaced by a random word of ``vocabulary`` (none if empty)."""

    def scramble(word: str) -> str:
        if not has_digit(word):
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
    return sorted({w for t in tasks for w in t.query.split(" ") if w and not has_digit(w)})


def augmented_tasks(task, copies: int, rng: np.random.Generator, vocabulary: Sequence[str] = ()) -> list:
    """``copies`` variants of ``task`` rewritten by ``augment_question`` (ids ``<task_id>#aug<i>``, no
    qrels: only the demonstration matters); none when there is nothing to rewrite."""
    if not len(vocabulary) and not has_digit(task.query):
        return []
    return [
        dataclasses.replace(
            task, task_id=f"{task.task_id}#aug{i}", query=augment_question(task.query, rng, vocabulary), qrels={}
        )
        for i in range(copies)
    ]


# what warmup.special_copies writes into a question, one edit a copy: a word in double quotes, a backslash inside
# a word, a letter given an accent (characters a copied query must escape, or carry outside ASCII, in its JSON)
ACCENTED = {"a": "á", "e": "é", "i": "í", "o": "ö", "u": "ü", "n": "ñ", "c": "ç"}


def special_question(text: str, rng: np.random.Generator) -> str:
    """``text`` with one word edited by one of three kinds drawn uniformly: wrapped in double quotes, given a
    backslash after its first character, or one of its letters accented (``ACCENTED``; a word without one of
    those letters gets "é" appended)."""
    words = text.split(" ")
    i = int(rng.integers(len(words)))
    kind, word = int(rng.integers(3)), words[i]
    if kind == 0:
        words[i] = f'"{word}"'
    elif kind == 1:
        words[i] = word[:1] + "\\" + word[1:]
    else:
        spots = [j for j, ch in enumerate(word) if ch in ACCENTED]
        if spots:
            j = spots[int(rng.integers(len(spots)))]
            words[i] = word[:j] + ACCENTED[word[j]] + word[j + 1 :]
        else:
            words[i] = word + "é"
    return " ".join(words)


def special_tasks(task, copies: int, rng: np.random.Generator) -> list:
    """``copies`` variants of ``task`` edited by ``special_question`` (ids ``<task_id>#special<i>``, no qrels:
    only copying the question into the call, escaped, matters)."""
    return [
        dataclasses.replace(
            task, task_id=f"{task.task_id}#special{i}", query=special_question(task.query, rng), qrels={}
        )
        for i in range(copies)
    ]


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
        self,
        render,
        first,
        second,
        pick: float,
        hop_query: str = "identifier",
        answer: str = "empty",
        fits=None,
        queries: int = 1,
    ):
        self.render, self.first, self.second, self.pick = render, first, second, pick
        self.hop_query, self.answer = hop_query, answer
        # > 1: each search gives a list of up to this many queries (the question and its content words; the
        # hop's candidates from the picked one on), where there are two or more
        self.queries = queries
        # fits(text): whether a turn of this text fits the per-turn token limit (None: no limit); an answer of ids
        # is cut to fit, so that no demonstration shows a turn the sampler would cut short
        self.fits = fits

    @property
    def hops(self) -> bool:
        return self.second is not None

    def without_hop(self) -> "TeacherPolicy":
        """The same episode with no second search (when the hop's results overflow the context)."""
        return TeacherPolicy(self.render, self.first, None, 0.0, self.hop_query, self.answer, self.fits, self.queries)

    def _query(self, candidates: list[str]):
        """The first candidate, or with ``queries > 1`` a list of the first ones (distinct) when there are two."""
        chosen = list(dict.fromkeys(candidates))[: self.queries]
        return chosen if len(chosen) > 1 else candidates[0]

    def __call__(self, messages) -> str:
        if messages[-1]["role"] == "user":
            question = messages[-1]["content"]
            return self.render(self.first, self._query([question] + question_keywords(question)))
        shown = "\n".join(m["content"] for m in messages if m["role"] == "tool")
        if self.second is not None and sum(m["role"] == "assistant" for m in messages) == 1:
            question = next(m["content"] for m in messages if m["role"] == "user")
            queries = HOP_QUERY_SOURCES[self.hop_query](shown, question)
            if queries:
                first = int(self.pick * len(queries))
                return self.render(self.second, self._query(queries[first:] + queries[:first]))
        ids = result_ids(shown)[:10] if self.answer == "ids" else []
        while ids and self.fits is not None and not self.fits(render_answer(ids)):
            ids.pop()
        return render_answer(ids)


@dataclasses.dataclass(frozen=True)
class Teacher:
    """The teacher's draws (``warmup.teacher_*``). A probability vector of ``None`` is uniform; a choice with a
    single option draws nothing."""

    tools: tuple[str, ...]  # the search tools it may call
    tool_probs: Optional[Sequence[float]] = None  # the first search's tool (warmup.teacher_tools)
    top_ks: tuple[Optional[int], ...] = (None,)  # each search's number of results (None: no top_k argument)
    top_k_probs: Optional[Sequence[float]] = None  # (warmup.teacher_top_k)
    hop: float = 0.0  # probability of a second search (warmup.teacher_hop)
    hop_tool_probs: Optional[Sequence[float]] = None  # that search's tool (warmup.teacher_hop_tools)
    hop_other: bool = False  # that search uses a tool the first did not (warmup.teacher_hop_tools="other")
    hop_queries: tuple[str, ...] = ("identifier",)  # what it looks for (warmup.teacher_hop_queries)
    hop_query_probs: Optional[Sequence[float]] = None
    answers: tuple[str, ...] = ("empty",)  # how it answers (warmup.teacher_answers)
    answer_probs: Optional[Sequence[float]] = None
    multi_query: float = 0.0  # probability that an episode's searches give query lists (warmup.teacher_multi_query)
    max_queries: int = 1  # how many at most (search.max_queries)


def _probs(p) -> Optional[np.ndarray]:
    return None if p is None else np.asarray(p, dtype=float)


def teacher_turns(rng: np.random.Generator, teacher: Teacher, hop: Optional[float] = None) -> TeacherPolicy:
    """One episode's scripted policy, drawn from ``teacher``: a search with the question verbatim; with
    probability ``hop`` (``teacher.hop`` unless given: 1.0 forces it, as hop drills do) a second search on a
    query drawn uniformly from the first search's results, of a kind drawn from ``hop_queries`` (an identifier,
    ``result_identifiers``; a result's title, ``result_titles``; the question's content words,
    ``question_keywords``; or the question itself; none to follow: no second search); then an answer of a kind
    drawn from ``answers`` ("empty": the environment's fallback ranks the results; "ids": the ids the searches
    showed, in order). The first search's tool is drawn from ``tool_probs``, the second's from ``hop_tool_probs``
    (with ``hop_other``, uniformly among the tools the first search did not use), each search's number of
    results from ``top_ks``, whatever the question. With probability ``multi_query`` the episode's searches give a
    list of queries where there are two or more to give (``TeacherPolicy.queries``). Every draw is made here, in a
    fixed order."""
    t, names = teacher, teacher.tools
    hop = t.hop if hop is None else hop
    top_k_probs = _probs(t.top_k_probs)

    def pick_one(options, p):
        return options[0] if len(options) == 1 else options[rng.choice(len(options), p=_probs(p))]

    def draw(p):
        return names[rng.choice(len(names), p=p)], t.top_ks[rng.choice(len(t.top_ks), p=top_k_probs)]

    def render(tool_and_top_k, query):
        tool, top_k = tool_and_top_k
        return render_tool_call(tool, {"query": query} | ({} if top_k is None else {"top_k": int(top_k)}))

    first = draw(_probs(t.tool_probs))
    hop_probs = _probs(t.hop_tool_probs)
    if t.hop_other and len(names) > 1:
        hop_probs = np.array([0.0 if name == first[0] else 1.0 for name in names]) / (len(names) - 1)
    second = draw(hop_probs) if hop > 0 and rng.random() < hop else None
    pick = rng.random() if second is not None else 0.0
    hop_query = pick_one(t.hop_queries, t.hop_query_probs) if second is not None else t.hop_queries[0]
    answer = pick_one(t.answers, t.answer_probs)
    queries = t.max_queries if t.multi_query > 0 and rng.random() < t.multi_query else 1  # drawn last, when on
    return TeacherPolicy(render, first, second, pick, hop_query, answer, None, queries)
