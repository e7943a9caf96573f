"""Retrievers over a ``Collection``: BM25, dense (faiss), and reciprocal-rank fusion.

A retriever answers ``search(query, k) -> [(doc_id, score), ...]`` best first.
"""

from __future__ import annotations

import logging
import os
import pathlib
from typing import Optional, Sequence

import faiss
import numpy as np

from mtrl_jax.data.collection import Collection
from mtrl_jax.search.bm25 import BM25Index
from mtrl_jax.search.encoders import Encoder
from mtrl_jax.search.text import Analyzer

log = logging.getLogger(__name__)


def doc_text(doc) -> str:
    return f"{doc.title}\n{doc.text}" if doc.title else doc.text


class BM25Retriever:
    def __init__(self, collection: Collection, analyzer: Analyzer = Analyzer(), k1: float = 0.9, b: float = 0.4):
        self.collection, self.analyzer = collection, analyzer
        self.index = BM25Index([analyzer(doc_text(d)) for d in collection.documents], k1=k1, b=b)

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        docs = self.collection.documents
        return [(docs[i].doc_id, s) for i, s in self.index.search(self.analyzer(query), k)]


class DenseRetriever:
    """Inner-product search over L2-normalised embeddings (cosine similarity).

    ``index_type``: ``"flat"`` (exact, default), ``"ivf"`` (``nlist`` cells, ``nprobe`` probed) or
    ``"hnsw"`` (``hnsw_m`` links). Corpus embeddings are cached in ``cache_dir`` under a key made
    of the corpus content hash and the encoder fingerprint.
    """

    def __init__(
        self,
        collection: Collection,
        encoder: Encoder,
        cache_dir: Optional[os.PathLike] = None,
        index_type: str = "flat",
        nlist: int = 256,
        nprobe: int = 16,
        hnsw_m: int = 32,
    ):
        self.collection, self.encoder = collection, encoder
        texts = [doc_text(d) for d in collection.documents]
        encoder.fit(texts)
        embeddings = None
        cache_file = None
        if cache_dir is not None:
            cache_file = pathlib.Path(cache_dir) / f"{collection.fingerprint()}-{encoder.fingerprint}.npy"
            if cache_file.exists():
                embeddings = np.load(cache_file)
                log.info("loaded cached embeddings %s", cache_file)
        if embeddings is None:
            embeddings = encoder.encode(texts)
            if cache_file is not None:
                cache_file.parent.mkdir(parents=True, exist_ok=True)
                tmp = cache_file.with_suffix(".tmp.npy")
                np.save(tmp, embeddings)
                os.replace(tmp, cache_file)
        self.embeddings = np.ascontiguousarray(embeddings, np.float32)
        dim = self.embeddings.shape[1]
        if index_type == "flat":
            self.index = faiss.IndexFlatIP(dim)
        elif index_type == "ivf":
            quantizer = faiss.IndexFlatIP(dim)
            self.index = faiss.IndexIVFFlat(quantizer, dim, min(nlist, len(texts)), faiss.METRIC_INNER_PRODUCT)
            self.index.train(self.embeddings)
            self.index.nprobe = nprobe
            self._quantizer = quantizer
        elif index_type == "hnsw":
            self.index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
        else:
            raise ValueError(f"index_type must be 'flat', 'ivf' or 'hnsw', got {index_type!r}")
        self.index.add(self.embeddings)

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        return self.search_batch([query], k)[0]

    def search_batch(self, queries: Sequence[str], k: int) -> list[list[tuple[str, float]]]:
        scores, ids = self.index.search(self.encoder.encode(list(queries)), min(k, len(self.collection.documents)))
        docs = self.collection.documents
        return [
            [(docs[i].doc_id, float(s)) for s, i in zip(row_s, row_i) if i >= 0] for row_s, row_i in zip(scores, ids)
        ]


def reciprocal_rank_fusion(
    rankings: Sequence[Sequence[str]], k: int = 60, depth: Optional[int] = None
) -> list[tuple[str, float]]:
    """RRF (Cormack et al. 2009): ``score(d) = sum_r 1 / (k + rank_r(d))``, ranks from 1."""
    scores: dict[str, float] = {}
    for ranking in rankings:
        seen = set()
        for rank, doc in enumerate(ranking, start=1):
            if doc in seen:
                continue
            seen.add(doc)
            scores[doc] = scores.get(doc, 0.0) + 1.0 / (k + rank)
    fused = sorted(scores.items(), key=lambda x: (-x[1], x[0]))
    return fused[:depth] if depth else fused


class FusionRetriever:
    def __init__(self, retrievers: Sequence, depth: int = 100, rrf_k: int = 60):
        self.retrievers, self.depth, self.rrf_k = list(retrievers), depth, rrf_k

    def search(self, query: str, k: int) -> list[tuple[str, float]]:
        rankings = [[d for d, _ in r.search(query, self.depth)] for r in self.retrievers]
        return reciprocal_rank_fusion(rankings, self.rrf_k, depth=k)
