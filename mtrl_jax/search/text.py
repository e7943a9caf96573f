"""The lexical analyzer: lower-casing, word tokens, stop words, Snowball stemming (configurable)."""

from __future__ import annotations

import dataclasses
import functools
import re
import threading

import snowballstemmer

# A standard English stop-word list (the one Lucene/BEIR BM25 baselines use, plus a few).
STOPWORDS = frozenset(
    "a an and are as at be but by for if in into is it no not of on or such that the their then there these "
    "they this to was will with what which who whom how why when where do does did has have had been being "
    "were can could would should may might its our we you your he she his her him i me my from than too very "
    "s t so up out about over under again further once here all any both each few more most other some own "
    "same only just".split()
)
_TOKEN = re.compile(r"[a-z0-9]+(?:[._-][a-z0-9]+)*")


@dataclasses.dataclass(frozen=True)
class Analyzer:
    """Text -> terms. ``stem`` names a Snowball language or is None; ``stopwords`` may be empty.

    Identifiers such as ``XR-7731`` or ``v2.1`` stay single terms (``xr-7731``), so look-ups by
    identifier work lexically.
    """

    lowercase: bool = True
    stopwords: frozenset = STOPWORDS
    stem: str | None = "english"

    def __call__(self, text: str) -> list[str]:
        if self.lowercase:
            text = text.lower()
        terms = [t for t in _TOKEN.findall(text) if t not in self.stopwords]
        if self.stem:
            stem = _stemmer(self.stem)
            terms = [stem(t) for t in terms]
        return terms


@functools.lru_cache(maxsize=None)
def _stemmer(language: str):
    """A cached ``stemWord`` that is safe to call from many threads (the rollout's tool workers):
    a Snowball stemmer object keeps its working string in itself, so each thread gets its own."""
    snowballstemmer.stemmer(language)  # an unknown language fails here, in the caller's thread
    local = threading.local()

    def stem(word: str) -> str:
        stemmer = getattr(local, "stemmer", None)
        if stemmer is None:
            stemmer = local.stemmer = snowballstemmer.stemmer(language)
        return stemmer.stemWord(word)

    return functools.lru_cache(maxsize=1 << 20)(stem)
