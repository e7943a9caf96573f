"""Okapi BM25 over a sparse term-document weight matrix.

Scores equal rank-bm25's ``BM25Okapi`` for the same terms, ``k1``, ``b`` and ``epsilon``
(idf ``log(N - n + 0.5) - log(n + 0.5)``, negative idfs floored at ``epsilon * mean idf``;
a repeated query term counts each time). Every document's term weight is precomputed once,
so a query is a sum of a few sparse rows instead of a loop over the corpus.
"""

from __future__ import annotations

import collections
from typing import Callable, Sequence

import numpy as np
import scipy.sparse as sp


class BM25Index:
    def __init__(self, documents: Sequence[Sequence[str]], k1: float = 0.9, b: float = 0.4, epsilon: float = 0.25):
        """``documents``: each document's list of terms (already analysed)."""
        if not documents:
            raise ValueError("BM25Index: empty corpus")
        self.k1, self.b, self.epsilon = k1, b, epsilon
        self.vocab: dict[str, int] = {}
        rows, cols, tfs = [], [], []
        doc_len = np.zeros(len(documents), np.float64)
        for d, terms in enumerate(documents):
            doc_len[d] = len(terms)
            for term, tf in collections.Counter(terms).items():
                rows.append(self.vocab.setdefault(term, len(self.vocab)))
                cols.append(d)
                tfs.append(tf)
        n_docs = len(documents)
        tf = sp.csr_matrix((np.asarray(tfs, np.float64), (rows, cols)), shape=(len(self.vocab), n_docs))
        df = np.diff(tf.indptr).astype(np.float64)
        idf = np.log(n_docs - df + 0.5) - np.log(df + 0.5)
        idf = np.where(idf < 0, epsilon * (idf.mean() if idf.size else 0.0), idf)
        avgdl = doc_len.mean() if doc_len.any() else 1.0  # no document has a term: every score is 0
        norm = k1 * (1 - b + b * doc_len / avgdl)  # per document
        data = tf.data * (k1 + 1) / (tf.data + norm[tf.indices])
        data *= np.repeat(idf, np.diff(tf.indptr))
        self.weights = sp.csr_matrix((data, tf.indices, tf.indptr), shape=tf.shape)
        self.idf = idf
        self.num_docs = n_docs

    def scores(self, query_terms: Sequence[str]) -> np.ndarray:
        """BM25 score of every document ``[N]`` (float64)."""
        ids = [self.vocab[t] for t in query_terms if t in self.vocab]
        out = np.zeros(self.num_docs)
        if ids:
            counts = collections.Counter(ids)
            terms = np.fromiter(counts, np.int64)
            mult = np.fromiter(counts.values(), np.float64)
            out = np.asarray(self.weights[terms].T @ mult).ravel()
        return out

    def search(self, query_terms: Sequence[str], k: int) -> list[tuple[int, float]]:
        """Top ``k`` ``(doc index, score)`` by score (ties by index); documents scoring 0 are dropped."""
        return top_k(self.scores(query_terms), k)


def top_k(
    scores: np.ndarray, k: int, keep: Callable[[np.ndarray], np.ndarray] = lambda s: s > 0
) -> list[tuple[int, float]]:
    candidates = np.flatnonzero(keep(scores))
    if len(candidates) > k:
        part = np.argpartition(-scores[candidates], k - 1)[:k]
        candidates = candidates[part]
    order = np.lexsort((candidates, -scores[candidates]))
    return [(int(i), float(scores[i])) for i in candidates[order]]
