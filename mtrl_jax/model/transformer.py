"""A Qwen2 / Qwen3 / Llama decoder in Flax Linen, read top to bottom.

Parameters (plain pytree once unboxed; ``L`` layers stacked by ``nn.scan``)::

    embed                       [V, D]           (vocab, embed)
    layers/input_norm/scale     [L, D]           (layers, norm)
    layers/attn/q_proj          [L, D, N, H]     (layers, embed, heads, head_dim)
    layers/attn/k_proj, v_proj  [L, D, K, H]     (layers, embed, kv_heads, head_dim)
    layers/attn/{q,k,v}_bias    [L, N|K, H]      Qwen2 only
    layers/attn/{q,k}_norm/scale [L, H]          Qwen3 only
    layers/attn/o_proj          [L, N, H, D]     (layers, heads, head_dim, embed)
    layers/post_attn_norm/scale [L, D]
    layers/mlp/gate_proj, up_proj [L, D, F]      (layers, embed, mlp)
    layers/mlp/down_proj        [L, F, D]        (layers, mlp, embed)
    final_norm/scale            [D]
    lm_head                     [D, V]           untied checkpoints only

The model returns final-normed hidden states ``[B, T, D]``; logits are a separate, explicit
step (``logits_from_hidden``) so training can compute log-probs in chunks without ever holding
``[B, T, V]`` float32 logits.

KV cache: right-padded slots ``[L, B, K, S, H]`` (each KV head's slots contiguous: attention reads
them as they are, where ``[.., S, K, H]`` made every call transpose them first). A call writes its
``T`` new tokens of row ``b`` at cache indices ``offsets[b] + t`` (only where ``valid[b, t]``) and
attends to every cache index ``<= offsets[b] + t``. Positions (RoPE) equal cache indices. The whole
cache is the layer scan's carry, updated in place (a scatter of the new tokens), never re-stacked;
and a call reads only the first ``window`` slots (static, a bucket above the longest row), so its
cost follows the tokens the rows hold, not the cache's capacity. A decode loop runs on a copy of
its window with one array per layer (``KVCache.per_layer``), written back after the loop.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.sharding import param_shardings

Array = jax.Array


class KVCache(NamedTuple):
    k: Array  # [L, B, K, S, H], or a tuple of L arrays [B, K, S, H] (``per_layer``)
    v: Array

    @property
    def max_len(self) -> int:
        return (self.k[0] if isinstance(self.k, tuple) else self.k).shape[-2]

    def per_layer(self, window: int) -> "KVCache":
        """Each layer's first ``window`` slots as its own array: a decode loop's working copy (unstacked
        parameters only). Attention then reads a layer's keys and values where they are, where a window
        of the stacked cache is a slice that XLA's CPU backend copies at every token."""
        return KVCache(
            tuple(self.k[i, :, :, :window] for i in range(self.k.shape[0])),
            tuple(self.v[i, :, :, :window] for i in range(self.v.shape[0])),
        )

    def write_back(self, work: "KVCache") -> "KVCache":
        """This cache with ``work`` (``per_layer``'s copy, updated) written over its first slots."""
        window = work.max_len
        return KVCache(
            self.k.at[:, :, :, :window].set(jnp.stack(work.k)), self.v.at[:, :, :, :window].set(jnp.stack(work.v))
        )


def init_cache(cfg: ModelConfig, batch: int, max_len: int) -> KVCache:
    shape = (cfg.num_layers, batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    return KVCache(jnp.zeros(shape, cfg.compute_dtype), jnp.zeros(shape, cfg.compute_dtype))


# ----------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: ModelConfig) -> np.ndarray:
    """Inverse frequencies ``[H/2]`` (float64 on the host), with optional Llama-3 scaling."""
    inv_freq = 1.0 / (cfg.rope_theta ** (np.arange(0, cfg.head_dim, 2, dtype=np.float64) / cfg.head_dim))
    if cfg.rope_llama3_scaling is not None:
        factor, low_ff, high_ff, old_len = cfg.rope_llama3_scaling
        wavelen = 2 * math.pi / inv_freq
        scaled = np.where(wavelen > old_len / low_ff, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - low_ff) / (high_ff - low_ff)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= old_len / high_ff) & (wavelen <= old_len / low_ff)
        inv_freq = np.where(medium, smoothed, scaled)
    return inv_freq


def apply_rope(x: Array, positions: Array, inv_freq: np.ndarray) -> Array:
    """Rotate ``x [B, T, heads, H]`` by ``positions [B, T]`` (HF ``rotate_half`` layout)."""
    angles = positions[..., None].astype(jnp.float32) * jnp.asarray(inv_freq, jnp.float32)  # [B, T, H/2]
    cos = jnp.concatenate([jnp.cos(angles)] * 2, axis=-1)[:, :, None, :].astype(x.dtype)
    sin = jnp.concatenate([jnp.sin(angles)] * 2, axis=-1)[:, :, None, :].astype(x.dtype)
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos + rotated * sin


# ----------------------------------------------------------------------------- attention


def causal_mask(key_valid: Array) -> Array:
    """``[B, 1, T, T]``: query ``t`` sees key ``s <= t`` where ``key_valid [B, T]``."""
    T = key_valid.shape[1]
    steps = jnp.arange(T)
    return ((steps[:, None] >= steps[None, :])[None] & key_valid[:, None, :])[:, None]


def attend(q: Array, k: Array, v: Array, visible: Array) -> Array:
    """Softmax attention of ``q [B, K, G, C, H]`` (scaled; the ``G`` query heads of each KV head) to
    ``k, v [B, K, S, H]`` where ``visible [B, C, S]`` -> ``[B, K, G, C, H]``.

    Batch dims lead on every operand and each KV head's ``G x C`` queries are the rows of one
    matrix: XLA's CPU backend then runs both products without transposing an operand. Scores and
    the softmax are float32; the softmax is normalised after the product with ``v`` (``C x H``
    divisions instead of ``C x S``). A query with no visible key gets a uniform average, not NaN."""
    B, K, G, C, H = q.shape
    S = k.shape[2]
    scores = jnp.einsum("bkmh,bksh->bkms", q.reshape(B, K, G * C, H), k, preferred_element_type=jnp.float32)
    scores = jnp.where(visible[:, None, None], scores.reshape(B, K, G, C, S), jnp.finfo(jnp.float32).min)
    weights = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
    out = jnp.einsum("bkms,bksh->bkmh", weights.reshape(B, K, G * C, S).astype(v.dtype), v).reshape(B, K, G, C, H)
    return out / jnp.sum(weights, axis=-1, keepdims=True).astype(out.dtype)


def _grouped(q: Array, K: int) -> Array:
    """``q [B, T, N, H]`` -> scaled ``[B, K, N / K, T, H]``: query head ``n`` reads KV head ``n // (N / K)``."""
    B, T, N, H = q.shape
    return (q * (H**-0.5)).reshape(B, T, K, N // K, H).transpose(0, 2, 3, 1, 4)


def _ungrouped(out: Array) -> Array:
    """``[B, K, G, T, H]`` -> ``[B, T, K * G, H]``."""
    B, K, G, T, H = out.shape
    return out.transpose(0, 3, 1, 2, 4).reshape(B, T, K * G, H)


def causal_attention(
    q: Array, k: Array, v: Array, key_valid: Array, chunk: int, prefix: Optional[tuple[Array, Array]] = None
) -> Array:
    """Causal softmax attention, ``q [B, T, N, H]``, ``k, v [B, T, K, H]`` -> ``[B, T, N, H]``.

    The queries go in chunks of ``chunk`` positions; a chunk ending at ``e`` scores only keys
    ``0..e-1``, so about half of the ``T x T`` score matrix is never computed (``attend``).
    ``prefix``: keys and values ``[K, P, H]`` that every row shares and that come before its own (a
    system prompt computed once, ``shared_prefix_logprobs``); every query sees all of them."""
    B, T, K = q.shape[0], q.shape[1], k.shape[2]
    q = _grouped(q, K)
    k, v = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, T, H]
    P = 0
    if prefix is not None:  # the shared keys first, for every row (the backward pass sums the rows' gradients)
        P = prefix[0].shape[1]
        k, v = (
            jnp.concatenate([jnp.broadcast_to(p[None].astype(x.dtype), (B,) + p.shape), x], axis=2)
            for p, x in zip(prefix, (k, v))
        )
        key_valid = jnp.concatenate([jnp.ones((B, P), bool), key_valid], axis=1)
    outs = []
    for start in range(0, T, chunk):
        end = min(start + chunk, T)
        visible = (jnp.arange(P + start, P + end)[:, None] >= jnp.arange(P + end)[None, :])[None] & key_valid[
            :, None, : P + end
        ]
        outs.append(attend(q[:, :, :, start:end], k[:, :, : P + end], v[:, :, : P + end], visible))
    return _ungrouped(jnp.concatenate(outs, axis=3))


def cached_attention(q: Array, k: Array, v: Array, mask: Array) -> Array:
    """Attention of ``q [B, T, N, H]`` to cache windows ``k, v [B, K, W, H]`` (read in their cache
    layout) under ``mask [B, 1, T, W]`` -> ``[B, T, N, H]``."""
    return _ungrouped(attend(_grouped(q, k.shape[1]), k, v, mask[:, 0]))


# ----------------------------------------------------------------------------- modules


def dense(x: Array, w: Array, contract: int = 1) -> Array:
    """``x [..., *w.shape[:contract]] @ w`` -> ``[..., *w.shape[contract:]]``, as one 2-D product: the
    leading dims of ``x`` are flattened into rows and ``w`` into a matrix. XLA's CPU backend runs a
    ``[B, T, D] x [D, F]`` contraction, and above all its backward pass, much slower than the same
    ``[B * T, D] x [D, F]`` matmul (its weight gradients transposed a whole activation first); see the
    MLP line of ``benchmarks/bench_train_step.py --components``."""
    inner, outer = w.shape[:contract], w.shape[contract:]
    lead = x.shape[: x.ndim - contract]
    rows = x.reshape(-1, math.prod(inner)) @ w.reshape(math.prod(inner), math.prod(outer))
    return rows.reshape(*lead, *outer)


def _param(module: nn.Module, name: str, shape, axes, init=None):
    init = init or nn.initializers.normal(0.02)
    return module.param(name, nn.with_logical_partitioning(init, axes), shape, module.config.params_dtype)


def project(module: nn.Module, target: str, name: str, x: Array, w: Array, axes: tuple, contract: int = 1) -> Array:
    """``x @ w`` (``dense``) in the compute dtype, plus its LoRA update when ``target`` is adapted."""
    out = dense(x, w.astype(module.config.compute_dtype), contract)
    update = lora_update(module, target, name, x, w.shape, axes, contract)
    return out if update is None else out + update


def lora_update(module: nn.Module, target: str, name: str, x: Array, shape: tuple, axes: tuple, contract: int = 1):
    """``(alpha / r) (x A) B`` of the weight ``name`` (``shape``, logical ``axes``) when ``target`` is adapted,
    else None: ``A [*shape[:contract], r]`` random and ``B [r, *shape[contract:]]`` zero at initialisation,
    float32 parameters with the weight's logical axes and a replicated ``lora`` axis (mtrl_jax/model/lora.py)."""
    cfg = module.config
    if not cfg.lora_rank or target not in cfg.lora_targets:
        return None
    r, dtype = cfg.lora_rank, cfg.compute_dtype
    a_init = nn.with_logical_partitioning(
        nn.initializers.normal(math.prod(shape[:contract]) ** -0.5), (*axes[:contract], "lora")
    )
    b_init = nn.with_logical_partitioning(nn.initializers.zeros, ("lora", *axes[contract:]))
    a = module.param(f"{name}_lora_a", a_init, (*shape[:contract], r), jnp.float32)
    b = module.param(f"{name}_lora_b", b_init, (r, *shape[contract:]), jnp.float32)
    return dense(dense(x, a.astype(dtype), contract), b.astype(dtype)) * jnp.asarray(cfg.lora_alpha / r, dtype)


class RMSNorm(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x: Array) -> Array:
        scale = _param(self, "scale", (x.shape[-1],), ("norm",), nn.initializers.ones)
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.config.rms_norm_eps)
        dtype = self.config.compute_dtype
        return normed.astype(dtype) * scale.astype(dtype)


class Attention(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x, positions, mask, key_valid, cache_kv, layer, write_index, cache_rows, prefix=None):
        """``x [B, T, D]``. With ``cache_kv``, the whole cache ``(k, v) [L, slots, K, S, H]``, of which
        this is layer ``layer`` (``layer`` None: this layer's own ``[slots, K, W, H]``, ``KVCache.per_layer``),
        attending to its first ``W`` slots under ``mask [B, 1, T, W]``, and
        ``write_index [B, T]`` the cache index of each new token (out of range = not written); row
        ``b`` of the block is cache row ``cache_rows[b]`` (None: the block holds every cache row).
        Without, causal attention over the block, to the keys where ``key_valid [B, T]``, after this
        layer's ``prefix`` keys and values ``([K, P, H], [K, P, H])`` if given (seen by every query)."""
        cfg = self.config
        D, N, K, H = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        dtype = cfg.compute_dtype
        wq = _param(self, "q_proj", (D, N, H), ("embed", "heads", "head_dim"))
        wk = _param(self, "k_proj", (D, K, H), ("embed", "kv_heads", "head_dim"))
        wv = _param(self, "v_proj", (D, K, H), ("embed", "kv_heads", "head_dim"))
        wo = _param(self, "o_proj", (N, H, D), ("heads", "head_dim", "embed"))
        q = project(self, "q", "q_proj", x, wq, ("embed", "heads", "head_dim"))
        k = project(self, "k", "k_proj", x, wk, ("embed", "kv_heads", "head_dim"))
        v = project(self, "v", "v_proj", x, wv, ("embed", "kv_heads", "head_dim"))
        if cfg.qkv_bias:
            zeros = nn.initializers.zeros
            q = q + _param(self, "q_bias", (N, H), ("heads", "head_dim"), zeros).astype(dtype)
            k = k + _param(self, "k_bias", (K, H), ("kv_heads", "head_dim"), zeros).astype(dtype)
            v = v + _param(self, "v_bias", (K, H), ("kv_heads", "head_dim"), zeros).astype(dtype)
        if cfg.qk_norm:
            q = RMSNorm(cfg, name="q_norm")(q)
            k = RMSNorm(cfg, name="k_norm")(k)
        inv_freq = rope_inv_freq(cfg)
        q = apply_rope(q, positions, inv_freq)
        k = apply_rope(k, positions, inv_freq)
        q = nn.with_logical_constraint(q, ("act_batch", "act_length", "act_heads", "head_dim"))

        if cache_kv is not None:
            rows = (jnp.arange(k.shape[0]) if cache_rows is None else cache_rows)[:, None]
            # [B, T] indices around the heads' slice: the update is [B, T, K, H], k's own layout
            at = (rows, slice(None), write_index) if layer is None else (layer, rows, slice(None), write_index)
            cache_k = cache_kv[0].at[at].set(k.astype(cache_kv[0].dtype), mode="drop")
            cache_v = cache_kv[1].at[at].set(v.astype(cache_kv[1].dtype), mode="drop")
            if layer is None:  # this layer's own cache (``KVCache.per_layer``): the window itself, read in place
                if cache_k.shape[2] != mask.shape[-1]:
                    raise ValueError(
                        f"a per-layer cache of {cache_k.shape[2]} slots is read as a whole, "
                        f"but the call attends to a window of {mask.shape[-1]}"
                    )
                k, v = cache_k, cache_v
            else:
                _, slots, K_, _, H_ = cache_k.shape
                window = (1, slots, K_, mask.shape[-1], H_)
                k = jax.lax.dynamic_slice(cache_k, (layer, 0, 0, 0, 0), window)[0]  # [B, K, W, H]
                v = jax.lax.dynamic_slice(cache_v, (layer, 0, 0, 0, 0), window)[0]
            if cache_rows is not None:  # only the block's rows
                k, v = k[cache_rows], v[cache_rows]
            cache_kv = (cache_k, cache_v)
        if cfg.attention_impl is None:
            out = (
                causal_attention(q, k, v, key_valid, cfg.attention_chunk, prefix)
                if cache_kv is None
                else cached_attention(q, k.astype(dtype), v.astype(dtype), mask)
            )
        else:
            if cache_kv is not None:
                k, v = jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2)  # [B, W, K, H], the library's layout
            mask = mask if mask is not None else causal_mask(key_valid)
            if prefix is not None:  # [K, P, H] -> every row's first keys, all visible
                B, P = k.shape[0], prefix[0].shape[1]
                k, v = (
                    jnp.concatenate(
                        [jnp.broadcast_to(jnp.swapaxes(p, 0, 1)[None].astype(x.dtype), (B, P) + x.shape[2:]), x], axis=1
                    )
                    for p, x in zip(prefix, (k, v))
                )
                mask = jnp.concatenate([jnp.ones(mask.shape[:3] + (P,), bool), mask], axis=-1)
            out = jax.nn.dot_product_attention(
                q,
                k.astype(dtype),
                v.astype(dtype),
                mask=mask,
                implementation=None if cfg.attention_impl == "xla" else cfg.attention_impl,
            )
        out = project(self, "o", "o_proj", out, wo, ("heads", "head_dim", "embed"), contract=2)
        return out, cache_kv


class MLP(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, x):
        cfg = self.config
        D, F, dtype = cfg.hidden_size, cfg.intermediate_size, cfg.compute_dtype
        gate = _param(self, "gate_proj", (D, F), ("embed", "mlp"))
        up = _param(self, "up_proj", (D, F), ("embed", "mlp"))
        h = nn.silu(project(self, "gate", "gate_proj", x, gate, ("embed", "mlp"))) * project(
            self, "up", "up_proj", x, up, ("embed", "mlp")
        )
        h = nn.with_logical_constraint(h, ("act_batch", "act_length", "act_mlp"))
        if self.has_variable("params", "down_proj_t"):  # [D, F]: the decode layout (``unstack_layers``)
            out = jnp.einsum("...f,df->...d", h, self.get_variable("params", "down_proj_t").astype(dtype))
            update = lora_update(self, "down", "down_proj", h, (F, D), ("mlp", "embed"))
            return out if update is None else out + update
        return project(
            self, "down", "down_proj", h, _param(self, "down_proj", (F, D), ("mlp", "embed")), ("mlp", "embed")
        )


class DecoderLayer(nn.Module):
    config: ModelConfig

    @nn.compact
    def __call__(self, carry, layer, positions, mask, key_valid, write_index, cache_rows, prefix=None):
        """``carry = (x, cache)``: the hidden states and the whole cache (or None), layer ``layer``'s turn;
        ``prefix``: this layer's shared prefix keys and values (``Transformer``), or None."""
        x, cache_kv = carry
        attn_out, cache_kv = Attention(self.config, name="attn")(
            RMSNorm(self.config, name="input_norm")(x),
            positions,
            mask,
            key_valid,
            cache_kv,
            layer,
            write_index,
            cache_rows,
            prefix,
        )
        x = x + attn_out
        x = x + MLP(self.config, name="mlp")(RMSNorm(self.config, name="post_attn_norm")(x))
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))
        return (x, cache_kv), None


class Transformer(nn.Module):
    """Decoder-only LM. ``__call__`` returns ``(hidden [B, T, D], new_cache | None)``.

    ``unstacked``: the parameters hold layer ``i`` as ``layers_i`` (``unstack_layers``) instead of
    one stacked ``layers`` tree; the same computation, as a loop over separate arrays."""

    config: ModelConfig
    unstacked: bool = False

    @nn.compact
    def __call__(
        self,
        tokens: Array,
        attention_mask: Optional[Array] = None,
        cache: Optional[KVCache] = None,
        offsets: Optional[Array] = None,
        window: Optional[int] = None,
        cache_rows: Optional[Array] = None,
        prefix: Optional[KVCache] = None,
    ):
        """Two modes.

        * No cache (training, scoring): ``tokens [B, T]`` right-padded with ``attention_mask [B, T]``
          (1 = real token); positions are ``0..T-1``.
        * With ``cache`` and ``offsets [B]`` (sampling): the new ``tokens [B, T]`` of row ``b`` go to
          cache indices ``offsets[b] + t`` where ``attention_mask[b, t]``; returns the updated cache.
          Attention reads the first ``window`` slots (default: all); every row's ``offsets[b] + T``
          must be within it. With ``cache_rows [B]``, row ``b`` of the block is cache row
          ``cache_rows[b]`` (a block of some of the cache's rows; ``offsets`` are of those rows).

        Without a cache, ``prefix`` (a one-row cache ``[L, 1, K, P, H]`` filled with ``P`` tokens, e.g.
        a system prompt) is what every row continues: the rows' positions are ``P..P+T-1`` and each
        query also sees the ``P`` prefix keys (``shared_prefix_logprobs``: the prefix computed once).
        """
        cfg = self.config
        B, T = tokens.shape
        if attention_mask is None:
            attention_mask = jnp.ones((B, T), bool)
        attention_mask = attention_mask.astype(bool)
        embed = _param(self, "embed", (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"))
        if not cfg.tie_word_embeddings:
            _param(self, "lm_head", (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"))
        x = jnp.take(embed, tokens, axis=0).astype(cfg.compute_dtype)
        x = nn.with_logical_constraint(x, ("act_batch", "act_length", "act_embed"))

        steps = jnp.arange(T)
        if prefix is not None and cache is not None:
            raise ValueError("prefix is for the cache-free (training) mode; with a cache, the prefix is in the cache")
        prefix_kv = None if prefix is None else (prefix.k[:, 0], prefix.v[:, 0])  # [L, K, P, H] each
        if cache is None:
            positions = jnp.broadcast_to(steps + (0 if prefix is None else prefix.max_len), (B, T))
            mask = None  # causal over the block, built by the attention (in chunks, by default)
            write_index = None  # no cache to write
            layer_cache = None
        else:
            positions = offsets[:, None] + steps[None, :]
            key_index = jnp.arange(min(window or cache.max_len, cache.max_len))
            mask = (key_index[None, None, :] <= positions[:, :, None])[:, None]  # [B, 1, T, W]
            write_index = jnp.where(attention_mask, positions, cache.max_len)  # out of range: dropped
            layer_cache = (cache.k, cache.v)

        layer = DecoderLayer
        if cfg.remat:
            layer = nn.remat(layer, prevent_cse=False)
        if self.unstacked:  # one parameter tree per layer (``unstack_layers``): a plain loop, no slicing
            per_layer = cache is not None and isinstance(cache.k, (tuple, list))  # ``KVCache.per_layer``
            carry, ks, vs = (x, layer_cache), [], []
            for i in range(cfg.num_layers):
                if per_layer:
                    carry = (carry[0], (cache.k[i], cache.v[i]))
                carry, _ = layer(cfg, name=f"layers_{i}")(
                    carry,
                    None if per_layer else i,
                    positions,
                    mask,
                    attention_mask,
                    write_index,
                    cache_rows,
                    None if prefix_kv is None else (prefix_kv[0][i], prefix_kv[1][i]),
                )
                if per_layer:
                    ks.append(carry[1][0])
                    vs.append(carry[1][1])
            x, new_cache = carry[0], ((tuple(ks), tuple(vs)) if per_layer else carry[1])
        else:
            stack = nn.scan(
                layer,
                variable_axes={"params": 0},
                split_rngs={"params": True},
                # the layer index (and each layer's prefix) scanned; the rest shared
                in_axes=(
                    0,
                    nn.broadcast,
                    nn.broadcast,
                    nn.broadcast,
                    nn.broadcast,
                    nn.broadcast,
                    nn.broadcast if prefix_kv is None else 0,
                ),
                length=cfg.num_layers,
                unroll=cfg.scan_unroll or cfg.num_layers,
                metadata_params={nn.PARTITION_NAME: "layers"},
            )
            (x, new_cache), _ = stack(cfg, name="layers")(
                (x, layer_cache),
                jnp.arange(cfg.num_layers),
                positions,
                mask,
                attention_mask,
                write_index,
                cache_rows,
                prefix_kv,
            )
        x = RMSNorm(cfg, name="final_norm")(x)
        return x, (None if cache is None else KVCache(*new_cache))


# ----------------------------------------------------------------------------- functional API


def head_kernel(cfg: ModelConfig, params) -> Array:
    """The output projection ``[D, V]`` (the transposed embedding when tied)."""
    return params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]


def logits_from_hidden(cfg: ModelConfig, params, hidden: Array) -> Array:
    """float32 logits ``[..., V]`` of hidden states ``[..., D]``; a padded vocabulary's extra entries get the
    lowest float (``mask_padded_vocab``)."""
    head = head_kernel(cfg, params)
    logits = jnp.einsum("...d,dv->...v", hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)
    return mask_padded_vocab(logits, cfg.valid_vocab)


def mask_padded_vocab(logits: Array, valid: int) -> Array:
    """``logits [..., V]`` with the entries at or past ``valid`` set to the lowest float32: never sampled, a
    probability of exactly 0, and no NaN in an entropy (0 x that value is 0, where 0 x -inf is not)."""
    if valid >= logits.shape[-1]:
        return logits
    return jnp.where(jnp.arange(logits.shape[-1]) < valid, logits, jnp.finfo(jnp.float32).min)


def forward(
    cfg: ModelConfig,
    params,
    tokens,
    attention_mask=None,
    cache=None,
    offsets=None,
    window=None,
    cache_rows=None,
    prefix=None,
):
    """Pure function form of ``Transformer(cfg).apply``: ``(hidden [B, T, D], cache)``. ``params``
    stacked (as stored) or unstacked (``unstack_layers``)."""
    unstacked = "layers" not in params
    return Transformer(cfg, unstacked).apply(
        {"params": params}, tokens, attention_mask, cache, offsets, window, cache_rows, prefix
    )


def unstack_layers(params):
    """The parameters in the decode layout: layer ``i``'s arrays as their own tree ``layers_i``
    instead of the ``[L, ...]`` stacked ``layers``, and each MLP's ``down_proj [F, D]`` as
    ``down_proj_t [D, F]``; ``forward`` takes either layout and computes the same.

    For loops that run the model many times on the same parameters (decoding): a stacked layer's
    weights are sliced out of ``[L, ...]`` inside every iteration, and XLA's CPU backend copies each
    slice (the per-token decode step of a 30M model spent a third of its time copying weights).
    Sliced once before the loop, the loop body reads the arrays in place. And a few rows times
    ``[F, D]`` (``F`` = 3 ``D``) ran at half the memory bandwidth of the same product with ``[D, F]``
    (the 30M model's decode: 1.16x tokens/s, same tokens)."""
    if "layers" not in params:
        return params
    out = {k: v for k, v in params.items() if k != "layers"}
    for i in range(jax.tree.leaves(params["layers"])[0].shape[0]):
        layer = jax.tree.map(lambda a, i=i: a[i], params["layers"])
        mlp = dict(layer["mlp"])
        mlp["down_proj_t"] = mlp.pop("down_proj").T
        out[f"layers_{i}"] = {**layer, "mlp": mlp}
    return out


def abstract_params(cfg: ModelConfig):
    """Shapes and logical axes of the parameters, without allocating them (boxed tree)."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return jax.eval_shape(lambda: Transformer(cfg).init(jax.random.PRNGKey(0), tokens))["params"]


def init_params_fn(cfg: ModelConfig, rng: Array):
    """A function that returns random parameters (plain pytree): jit it, with output shardings if wanted."""
    tokens = jnp.zeros((1, 1), jnp.int32)
    return lambda: nn.unbox(Transformer(cfg).init(rng, tokens)["params"])


def init_params(cfg: ModelConfig, rng: Array, mesh=None):
    """Random parameters (plain pytree), created directly sharded when ``mesh`` is given."""
    init = init_params_fn(cfg, rng)
    if mesh is None:
        return jax.jit(init)()
    return jax.jit(init, out_shardings=param_shardings(abstract_params(cfg), mesh))()


def pad_vocab(cfg: ModelConfig, params, multiple: int):
    """``(cfg.padded_vocab(multiple), params)`` with the embedding's rows and an untied head's columns padded
    with zeros to the new size: the same model on every real token (the padding's logits are masked)."""
    padded = cfg.padded_vocab(multiple)
    extra = padded.vocab_size - cfg.vocab_size
    if not extra:
        return cfg, params
    params = dict(params, embed=jnp.pad(params["embed"], ((0, extra), (0, 0))))
    if "lm_head" in params:
        params["lm_head"] = jnp.pad(params["lm_head"], ((0, 0), (0, extra)))
    return padded, params
