"""Jitted sampler over a right-padded KV cache with per-row lengths.

* ``prefill`` / ``extend``: append a block of tokens to every row at that row's own offset
  (a prompt, a tool response). History is never re-encoded.
* ``decode``: an on-device ``lax.while_loop`` that samples until each row hits one of its stop
  tokens, ``max_new_tokens``, or the end of the cache. Temperature and top-p are ``[B]`` arrays
  (not static), so changing them never recompiles.
* ``share_prefixes``: a row starting a new sequence takes the keys and values of its longest
  prefix already in the cache (its own stale entries, another row's, or a row of the same call:
  the system prompt, the ``G`` samples of one prompt) instead of computing them again. The state
  records the token at every cache position, and ``forget`` clears that record when the
  parameters change, so only entries computed with the current parameters are shared.

Behaviour log-probs are ``log_softmax(logits / temperature)`` at the sampled id over the full
vocabulary (not the top-p-truncated distribution), exactly what ``rl.logprobs`` recomputes.
Temperature ``<= 0`` means greedy; its recorded log-prob is then that of temperature 1.

The host-side scheduling of these kernels (pieces, windows, prefix sharing, precompilation) is
``mtrl_jax.rollout.engine.Sampler``.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.transformer import KVCache, forward, init_cache, logits_from_hidden, unstack_layers

# Why a row stopped decoding.
STOP_TOKEN, MAX_NEW_TOKENS, CACHE_FULL, INACTIVE = 0, 1, 2, 3
STOP_REASONS = {
    STOP_TOKEN: "stop_token",
    MAX_NEW_TOKENS: "max_new_tokens",
    CACHE_FULL: "cache_full",
    INACTIVE: "inactive",
}


class SamplerState(NamedTuple):
    cache: KVCache  # [L, B, K, S, H]
    lengths: jax.Array  # [B] int32: tokens held per row
    last_hidden: jax.Array  # [B, D]: hidden state of each row's last token (next-token logits)
    # [B, S] int32: the token whose keys and values each cache slot holds, also past a row's length
    # (a reset row's stale entries); -1: none, or computed with other parameters (``forget``)
    tokens: jax.Array


class DecodeOutput(NamedTuple):
    tokens: jax.Array  # [B, M] int32, 0 after a row stopped
    logp: jax.Array  # [B, M] float32 behaviour log-probs, 0 after a row stopped
    num_tokens: jax.Array  # [B] int32
    stop_reason: jax.Array  # [B] int32, one of STOP_REASONS


def init_state(cfg: ModelConfig, batch: int, max_len: int) -> SamplerState:
    return SamplerState(
        init_cache(cfg, batch, max_len),
        jnp.zeros((batch,), jnp.int32),
        jnp.zeros((batch, cfg.hidden_size), cfg.compute_dtype),
        jnp.full((batch, max_len), -1, jnp.int32),
    )


def extend(
    cfg: ModelConfig,
    params,
    state: SamplerState,
    tokens: jax.Array,
    num_new: jax.Array,
    window: Optional[int] = None,
    rows: Optional[jax.Array] = None,
    starts: Optional[jax.Array] = None,
    last: Optional[jax.Array] = None,
) -> SamplerState:
    """Append ``tokens[b, :num_new[b]]`` to row ``b`` (``tokens [B, T]``, right-padded). Attention
    reads the cache's first ``window`` slots (static; default all): every row's length + ``T`` must fit.

    With ``rows [R]``, ``starts [R]`` and ``last [R]``, line ``i`` of the block is a *piece* of cache
    row ``rows[i]``'s new tokens: it goes at that row's length + ``starts[i]``, and ``last[i]`` says it
    ends the row's new tokens (its last hidden state is the row's next-token state). A row may have
    several pieces in one call: each layer writes every piece's keys and values before any piece
    attends, so a piece sees the pieces before it. Rows without a piece are neither computed nor
    changed; padding lines have ``num_new`` 0."""
    T = tokens.shape[1]
    valid = jnp.arange(T)[None, :] < num_new[:, None]
    num_new = num_new.astype(jnp.int32)
    offsets = state.lengths if rows is None else state.lengths[rows] + starts
    hidden, cache = forward(cfg, params, tokens, valid, state.cache, offsets, window, rows)
    final = jnp.take_along_axis(hidden, jnp.maximum(num_new - 1, 0)[:, None, None], axis=1)[:, 0]
    written = jnp.where(
        valid, offsets[:, None] + jnp.arange(T)[None, :], state.tokens.shape[1]
    )  # out of range: not written
    if rows is None:
        held = state.tokens.at[jnp.arange(tokens.shape[0])[:, None], written].set(tokens, mode="drop")
        return SamplerState(
            cache, state.lengths + num_new, jnp.where((num_new > 0)[:, None], final, state.last_hidden), held
        )
    target = jnp.where(last & (num_new > 0), rows, state.lengths.shape[0])  # out of range: not written
    return SamplerState(
        cache,
        state.lengths.at[rows].add(num_new),
        state.last_hidden.at[target].set(final.astype(state.last_hidden.dtype), mode="drop"),
        state.tokens.at[rows[:, None], written].set(tokens, mode="drop"),
    )


def share_prefixes(state: SamplerState, src: jax.Array, dst: jax.Array, count: jax.Array, window: int) -> SamplerState:
    """Row ``dst[i]`` takes the keys, values and tokens of row ``src[i]``'s first ``count[i]`` cache
    slots (``count <= window``, static) and holds ``count[i]`` tokens; its next token is then appended
    with ``extend``. All are read before any is written, so a row may be a source and a destination.
    ``dst`` out of range: a padding pair, nothing written."""
    take = jnp.arange(window)[None, :] < count[:, None]  # [R, W]

    def copy(x, batch_axis, slot_axis):  # the first `window` slots of rows dst from rows src
        part = jax.lax.slice_in_dim(x, 0, window, axis=slot_axis)
        source, target = jnp.take(part, src, axis=batch_axis), jnp.take(part, dst, axis=batch_axis, mode="clip")
        mask = np.ones(x.ndim - batch_axis, int)
        mask[0], mask[slot_axis - batch_axis] = take.shape
        new = jnp.where(take.reshape(tuple(mask)), source, target)
        index = [slice(None)] * x.ndim
        index[batch_axis], index[slot_axis] = dst, slice(0, window)
        return x.at[tuple(index)].set(new, mode="drop")

    cache = KVCache(copy(state.cache.k, 1, 3), copy(state.cache.v, 1, 3))  # [L, B, K, S, H]
    return SamplerState(
        cache, state.lengths.at[dst].set(count, mode="drop"), state.last_hidden, copy(state.tokens, 0, 1)
    )


def forget(state: SamplerState) -> SamplerState:
    """No cache entry can be shared any more (they were computed with parameters no longer in use)."""
    return state._replace(tokens=jnp.full_like(state.tokens, -1))


def prefill(cfg: ModelConfig, params, tokens: jax.Array, lengths: jax.Array, max_len: int) -> SamplerState:
    """A fresh cache of ``max_len`` slots holding ``tokens[b, :lengths[b]]``."""
    return extend(cfg, params, init_state(cfg, tokens.shape[0], max_len), tokens, lengths, tokens.shape[1])


def next_token_logits(cfg: ModelConfig, params, state: SamplerState) -> jax.Array:
    """float32 ``[B, V]`` logits of the token following each row."""
    return logits_from_hidden(cfg, params, state.last_hidden)


def sample_tokens(logits, keys, temperature, top_p):
    """Sample ``[B]`` ids from ``logits [B, V]`` with one PRNG key per row (``keys [B]``);
    returns ``(tokens, behaviour logp)``.

    A row draws one uniform number and takes the first id whose cumulative probability reaches it
    (inverse-CDF sampling: exact, and one random number per row instead of one per vocabulary
    entry). When every row is greedy no sampling is computed at all."""
    greedy = temperature <= 0
    scaled = logits / jnp.where(greedy, 1.0, temperature)[:, None]
    logprobs = jax.nn.log_softmax(scaled, axis=-1)

    def nucleus(scaled):
        sorted_logits = jnp.sort(scaled, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        before = jnp.cumsum(probs, axis=-1) - probs  # mass strictly above each candidate
        keep = jnp.sum(before < top_p[:, None], axis=-1)  # >= 1
        threshold = jnp.take_along_axis(sorted_logits, (keep - 1)[:, None], axis=-1)
        return jnp.where(scaled >= threshold, scaled, -jnp.inf)

    def sample(scaled):
        filtered = jax.lax.cond(jnp.all(top_p >= 1.0), lambda s: s, nucleus, scaled)
        cdf = jnp.cumsum(jax.nn.softmax(filtered, axis=-1), axis=-1)
        u = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32, minval=jnp.finfo(jnp.float32).tiny))(keys)
        drawn = jnp.sum(cdf < (u * cdf[:, -1])[:, None], axis=-1)
        return jnp.minimum(drawn, logits.shape[-1] - 1).astype(jnp.int32)

    argmax = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = jax.lax.cond(jnp.all(greedy), lambda s: argmax, sample, scaled)
    tokens = jnp.where(greedy, argmax, sampled)
    return tokens, jnp.take_along_axis(logprobs, tokens[:, None], axis=-1)[:, 0]


class DecodeRows(NamedTuple):
    """The per-row controls of a ``decode`` call (``[B]`` arrays, ``stop_tokens [B, n]``)."""

    row_keys: jax.Array
    temperature: jax.Array
    top_p: jax.Array
    stop_tokens: jax.Array
    active: jax.Array
    budget: jax.Array


def decode(
    cfg: ModelConfig,
    params,
    state: SamplerState,
    rows: DecodeRows,
    max_new_tokens: int,
    window: Optional[int] = None,
) -> tuple[SamplerState, DecodeOutput]:
    """Sample up to ``min(budget[b], max_new_tokens)`` tokens per active row (``rows``: ``DecodeRows``).

    ``row_keys [B]``: one PRNG key per row; the token at cache position ``p`` is drawn with
    ``fold_in(row_keys[b], p)``, so a row's samples do not depend on its slot, its neighbours or
    how decoding is split into calls. ``temperature``, ``top_p`` ``[B]`` float; ``stop_tokens
    [B, n]`` int32 (-1 = unused); ``active [B]`` bool; ``budget [B]`` int32. A stop token is kept
    (written to the cache and returned). Rows that are inactive or have stopped write nothing.
    Attention reads the first ``window`` cache slots (static; default all): every active row's
    length + ``min(budget, max_new_tokens)`` must fit, or the row stops with ``CACHE_FULL`` at the
    window's end.
    """
    row_keys, temperature, top_p, stop_tokens, active, budget = rows
    B = state.lengths.shape[0]
    capacity = state.cache.max_len
    max_len = min(window or capacity, capacity)
    params = unstack_layers(params)  # once per call, not per token: the loop reads each layer's arrays in place
    room = state.lengths < max_len
    reason = jnp.where(active & ~room, CACHE_FULL, INACTIVE).astype(jnp.int32)
    active = active & room

    def cond(carry):
        i, _, active, *_ = carry
        return (i < max_new_tokens) & jnp.any(active)

    def body(carry):
        i, state, active, out_tokens, out_logp, num_tokens, reason = carry
        logits = next_token_logits(cfg, params, state)
        keys = jax.vmap(jax.random.fold_in)(row_keys, state.lengths)
        token, logp = sample_tokens(logits, keys, temperature, top_p)
        token = jnp.where(active, token, 0)
        state = extend(cfg, params, state, token[:, None], active.astype(jnp.int32), max_len)
        out_tokens = out_tokens.at[:, i].set(token)
        out_logp = out_logp.at[:, i].set(jnp.where(active, logp, 0.0))
        num_tokens = num_tokens + active
        is_stop = jnp.any(token[:, None] == stop_tokens, axis=-1)
        full = state.lengths >= max_len  # the window's end: no further token in this call
        last = (i + 1 >= max_new_tokens) | (num_tokens >= budget)
        # a row that ends its tokens of this call exactly at the end of a window narrower than the cache
        # is not full (the next call attends to a larger window); at the cache's end it is
        out_of_room = full & (~last | (state.lengths >= capacity))
        reason = jnp.where(
            active & is_stop,
            STOP_TOKEN,
            jnp.where(active & out_of_room, CACHE_FULL, jnp.where(active & last, MAX_NEW_TOKENS, reason)),
        )
        active = active & ~is_stop & ~full & ~last
        return i + 1, state, active, out_tokens, out_logp, num_tokens, reason

    # the loop runs on a copy of the window, one array per layer (``KVCache.per_layer``), written back after
    carry = (
        jnp.int32(0),
        state._replace(cache=state.cache.per_layer(max_len)),
        active,
        jnp.zeros((B, max_new_tokens), jnp.int32),
        jnp.zeros((B, max_new_tokens), jnp.float32),
        jnp.zeros((B,), jnp.int32),
        reason,
    )
    _, work, _, tokens, logp, num_tokens, reason = jax.lax.while_loop(cond, body, carry)
    return work._replace(cache=state.cache.write_back(work.cache)), DecodeOutput(tokens, logp, num_tokens, reason)
