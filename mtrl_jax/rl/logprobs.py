"""Token log-probs and entropy from hidden states, chunked so ``[B, T, V]`` float32 never exists.

Both quantities are of the temperature-scaled distribution ``softmax(logits / temperature)``,
the same quantity the sampler records as ``behav_logp`` (docs/architecture.md, "Behaviour log-probs").
The chunked path scans over chunks of positions (every row's next few tokens) with the per-chunk
computation under ``jax.checkpoint``: the backward pass recomputes one chunk's logits at a time,
so peak memory is ``O(chunk * V)`` instead of ``O(B * T * V)``. ``score`` gives the update the log-probs of
several parameter sets (the old policy, the KL reference) in one pass over its micro-batches.
"""

from __future__ import annotations

import chex
import jax
import jax.numpy as jnp

from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.sharding import constrain_rows
from mtrl_jax.model.transformer import forward, head_kernel, init_cache, mask_padded_vocab
from mtrl_jax.rl.lengths import switch_on_length


def _logp_entropy(hidden, head, targets, temperature, valid_vocab=None):
    """``hidden [N, D]``, ``head [D, V]``, ``targets [N]``, ``temperature [N]`` -> ``[N]``, ``[N]``; the
    entries at or past ``valid_vocab`` (a padded vocabulary's) masked out."""
    logits = jnp.einsum("nd,dv->nv", hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)
    logits = mask_padded_vocab(logits / temperature[:, None], valid_vocab or head.shape[1])
    lse = jax.nn.logsumexp(logits, axis=-1)
    # the target's logit as its hidden state times the target's column of the head ([N, D] gathered),
    # not picked out of the [N, V] logits: a gather from the logits has a scatter into a zeroed [N, V]
    # array for gradient, and a comparison with the vocabulary's iota (where(hit, logits, 0)) is
    # written out as a whole [N, V] array before its sum, which XLA's CPU backend runs as a library
    # reduction that fuses nothing (the tiny update: 1.07x, ``bench_train_step.py --baseline 058f034``)
    target = (
        jnp.einsum(
            "nd,nd->n",
            hidden,
            jnp.take(head.T, targets, axis=0).astype(hidden.dtype),
            preferred_element_type=jnp.float32,
        )
        / temperature
    )
    logp = target - lse
    probs = jnp.exp(logits - lse[:, None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return logp, entropy


def _per_token_temperature(temperature, shape):
    temperature = jnp.asarray(temperature, jnp.float32)
    if temperature.ndim == 1:
        temperature = temperature[:, None]
    return jnp.broadcast_to(temperature, shape)


def token_logprobs_dense(hidden, head, targets, temperature=1.0, valid_vocab=None):
    """Reference path: ``hidden [B, T, D]``, ``head [D, V]``, ``targets [B, T]``, ``temperature``
    scalar or ``[B]`` -> ``(logp, entropy)`` float32 ``[B, T]``. Materialises all logits."""
    B, T, D = hidden.shape
    temp = _per_token_temperature(temperature, (B, T)).reshape(-1)
    logp, entropy = _logp_entropy(hidden.reshape(B * T, D), head, targets.reshape(-1), temp, valid_vocab)
    return logp.reshape(B, T), entropy.reshape(B, T)


def token_logprobs(hidden, head, targets, temperature=1.0, chunk_size: int = 512, valid_vocab=None):
    """Chunked, rematerialised version of ``token_logprobs_dense`` (same values and gradients).
    With ``chunk_size >= B * T`` it is the dense path itself: the ``[B, T, V]`` float32 logits are
    held for the backward pass instead of recomputed (a third less work in the output projection,
    for the memory; fine on a CPU-sized model).

    A chunk is every row's next ``ceil(T / n)`` positions, ``n`` the fewest chunks of at most
    ``max(1, chunk_size // B)`` positions each (at most about ``chunk_size`` tokens; fewer than ``n``
    padding positions per row):
    the scan runs over time, so each chunk keeps the batch axis, and its sharding over the mesh's
    ``data`` x ``fsdp`` devices (a chunk of flattened tokens would sit on one device and be computed
    on all of them)."""
    B, T, D = hidden.shape
    chex.assert_shape(targets, (B, T))
    chex.assert_rank(head, 2)
    n_chunks = -(-T // max(1, min(T, chunk_size // B)))
    width = -(-T // n_chunks)  # balanced: T = 310 in chunks of 256 is two of 155, not 512 positions
    if n_chunks == 1:  # one chunk holds every token: no scan, and no recompute in the backward pass
        return token_logprobs_dense(hidden, head, targets, temperature, valid_vocab)
    pad = n_chunks * width - T

    def chunked(x, fill=0):  # [B, T, ...] -> [n_chunks, B, width, ...]
        x = jnp.pad(x, ((0, 0), (0, pad)) + ((0, 0),) * (x.ndim - 2), constant_values=fill)
        return jnp.moveaxis(x.reshape(B, n_chunks, width, *x.shape[2:]), 1, 0)

    temp = _per_token_temperature(temperature, (B, T))
    xs = (chunked(hidden), chunked(targets), chunked(temp, fill=1.0))

    @jax.checkpoint
    def body(h, t, tau):
        logp, entropy = _logp_entropy(h.reshape(B * width, D), head, t.reshape(-1), tau.reshape(-1), valid_vocab)
        return logp.reshape(B, width), entropy.reshape(B, width)

    def step(carry, x):
        return carry, body(*x)

    _, (logp, entropy) = jax.lax.scan(step, None, xs)
    unchunk = lambda x: jnp.moveaxis(x, 0, 1).reshape(B, n_chunks * width)[:, :T]  # noqa: E731
    return unchunk(logp), unchunk(entropy)


def sequence_logprobs(cfg: ModelConfig, params, tokens, attention_mask, temperature=1.0, chunk_size: int = 512):
    """Teacher-forced ``log p(tokens[:, t] | tokens[:, :t])`` and entropy, ``[B, T]`` float32.

    Column 0 (no context) is 0. This is the training path the sampler's ``behav_logp`` is
    checked against.
    """
    hidden, _ = forward(cfg, params, tokens, attention_mask)
    logp, entropy = token_logprobs(
        hidden[:, :-1], head_kernel(cfg, params), tokens[:, 1:], temperature, chunk_size, cfg.valid_vocab
    )
    zeros = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([zeros, logp], axis=1), jnp.concatenate([zeros, entropy], axis=1)


def shared_prefix_logprobs(
    cfg: ModelConfig, params, prefix, tokens, attention_mask, temperature=1.0, chunk_size: int = 512
):
    """``sequence_logprobs`` of rows that all begin with the same ``prefix [P]``, given only what
    follows it, ``tokens [B, S]`` (right-padded, ``attention_mask [B, S]``): ``(logp, entropy)``
    ``[B, S]`` of those tokens, the first predicted from the prefix's last position. Equal, values
    and gradients, to ``sequence_logprobs`` of ``prefix + row`` at columns ``P`` onwards, but the
    prefix (a system prompt every demonstration opens with) is computed once instead of once per
    row: its keys and values, computed as a one-row cache, are what every row's continuation attends
    to before its own (``causal_attention``'s ``prefix``: causal in chunks like any training
    forward; the backward pass sums the rows' gradients through them)."""
    P = prefix.shape[0]
    B = tokens.shape[0]
    hidden_p, cache = forward(cfg, params, prefix[None], None, init_cache(cfg, 1, P), jnp.zeros((1,), jnp.int32))
    hidden, _ = forward(cfg, params, tokens, attention_mask, prefix=cache)
    last = jnp.broadcast_to(hidden_p[:, -1:], (B, 1, hidden.shape[-1]))
    return token_logprobs(
        jnp.concatenate([last, hidden[:, :-1]], axis=1),
        head_kernel(cfg, params),
        tokens,
        temperature,
        chunk_size,
        cfg.valid_vocab,
    )


def logprobs_at(
    cfg: ModelConfig, params, tokens, attention_mask, columns, temperature=1.0, chunk_size: int = 512, prefix=None
):
    """Log-prob and entropy of ``tokens[b, columns[b, k]]`` only, ``[B, K]`` float32 (``columns [B, K]``,
    each >= 1, or >= 0 with a ``prefix``): the output projection runs at those columns alone (the tokens a
    loss is taken on), not at every position. Equal, value and gradient, to ``sequence_logprobs`` (or
    ``shared_prefix_logprobs`` with ``prefix [P]``: ``tokens`` then follow it) read at those columns."""
    if prefix is None:
        hidden, _ = forward(cfg, params, tokens, attention_mask)
        predictors = jnp.concatenate([jnp.zeros_like(hidden[:, :1]), hidden[:, :-1]], axis=1)  # column j <- state j-1
    else:
        B, P = tokens.shape[0], prefix.shape[0]
        hidden_p, cache = forward(cfg, params, prefix[None], None, init_cache(cfg, 1, P), jnp.zeros((1,), jnp.int32))
        hidden, _ = forward(cfg, params, tokens, attention_mask, prefix=cache)
        last = jnp.broadcast_to(hidden_p[:, -1:], (B, 1, hidden.shape[-1]))
        predictors = jnp.concatenate([last, hidden[:, :-1]], axis=1)
    picked = jnp.take_along_axis(predictors, columns[..., None], axis=1)  # [B, K, D]
    targets = jnp.take_along_axis(tokens, columns, axis=1)
    return token_logprobs(picked, head_kernel(cfg, params), targets, temperature, chunk_size, cfg.valid_vocab)


def score(
    logprobs,
    param_sets: list,
    names: list[str],
    tokens: jax.Array,
    attention_mask: jax.Array,
    buckets: tuple[int, ...],
    groups: jax.Array,
) -> dict:
    """``{name: log-probs [B, T]}`` of every parameter set in one pass over the batch, group by group
    (``groups [n, g]``: row indices, every row once), each group computed at its own length
    (``switch_on_length``) under every parameter set (the old and the reference policy) in turn.
    The update passes its first epoch's micro-batches as the groups, so each group is scored at the
    length its micro-batch trains at. Positions past a row's length get 0."""
    B, T = tokens.shape
    tokens, attention_mask = jnp.asarray(tokens), jnp.asarray(attention_mask)

    def group_logprobs(length, tok, att):
        return tuple(
            jnp.pad(jax.lax.stop_gradient(logprobs(p, tok[:, :length], att[:, :length])[0]), ((0, 0), (0, T - length)))
            for p in param_sets
        )

    def body(_, rows):
        tok, att = constrain_rows(tokens[rows]), constrain_rows(attention_mask[rows])
        return None, switch_on_length(buckets, att, group_logprobs, tok, att)

    _, per_group = jax.lax.scan(body, None, groups)
    rows = groups.reshape(-1)
    return {
        name: jnp.zeros((B, T), jnp.float32).at[rows].set(x.reshape(B, T) * (attention_mask[rows] > 0))
        for name, x in zip(names, per_group)
    }
