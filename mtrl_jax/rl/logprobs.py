"""Token log-probs and entropy from hidden states, chunked so ``[B, T, V]`` float32 never exists.

Both quantities are of the temperature-scaled distribution ``softmax(logits / temperature)``,
the same quantity the sampler records as ``behav_logp`` (ARCHITECTURE.md, "Behaviour log-probs").
The chunked path flattens ``B*T`` tokens, pads them to whole chunks, and scans over chunks with
the per-chunk computation under ``jax.checkpoint``: the backward pass recomputes one chunk's
logits at a time, so peak memory is ``O(chunk * V)`` instead of ``O(B * T * V)``.
"""

from __future__ import annotations

import functools

import chex
import jax
import jax.numpy as jnp

from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.transformer import forward, head_kernel


def _logp_entropy(hidden, head, targets, temperature):
    """``hidden [N, D]``, ``head [D, V]``, ``targets [N]``, ``temperature [N]`` -> ``[N]``, ``[N]``."""
    logits = jnp.einsum("nd,dv->nv", hidden, head.astype(hidden.dtype), preferred_element_type=jnp.float32)
    logits = logits / temperature[:, None]
    lse = jax.nn.logsumexp(logits, axis=-1)
    logp = jnp.take_along_axis(logits, targets[:, None], axis=-1)[:, 0] - lse
    probs = jnp.exp(logits - lse[:, None])
    entropy = lse - jnp.sum(probs * logits, axis=-1)
    return logp, entropy


def _per_token_temperature(temperature, shape):
    temperature = jnp.asarray(temperature, jnp.float32)
    if temperature.ndim == 1:
        temperature = temperature[:, None]
    return jnp.broadcast_to(temperature, shape)


def token_logprobs_dense(hidden, head, targets, temperature=1.0):
    """Reference path: ``hidden [B, T, D]``, ``head [D, V]``, ``targets [B, T]``, ``temperature``
    scalar or ``[B]`` -> ``(logp, entropy)`` float32 ``[B, T]``. Materialises all logits."""
    B, T, D = hidden.shape
    temp = _per_token_temperature(temperature, (B, T)).reshape(-1)
    logp, entropy = _logp_entropy(hidden.reshape(B * T, D), head, targets.reshape(-1), temp)
    return logp.reshape(B, T), entropy.reshape(B, T)


def token_logprobs(hidden, head, targets, temperature=1.0, chunk_size: int = 512):
    """Chunked, rematerialised version of ``token_logprobs_dense`` (same values and gradients)."""
    B, T, D = hidden.shape
    chex.assert_shape(targets, (B, T))
    chex.assert_rank(head, 2)
    n = B * T
    chunk = max(1, min(chunk_size, n))
    n_chunks = -(-n // chunk)
    pad = n_chunks * chunk - n
    flat_h = jnp.pad(hidden.reshape(n, D), ((0, pad), (0, 0))).reshape(n_chunks, chunk, D)
    flat_t = jnp.pad(targets.reshape(n), (0, pad)).reshape(n_chunks, chunk)
    temp = _per_token_temperature(temperature, (B, T)).reshape(n)
    flat_temp = jnp.pad(temp, (0, pad), constant_values=1.0).reshape(n_chunks, chunk)

    body = jax.checkpoint(functools.partial(_logp_entropy, head=head))

    def step(carry, xs):
        h, t, tau = xs
        return carry, body(h, targets=t, temperature=tau)

    _, (logp, entropy) = jax.lax.scan(step, None, (flat_h, flat_t, flat_temp))
    return logp.reshape(-1)[:n].reshape(B, T), entropy.reshape(-1)[:n].reshape(B, T)


def sequence_logprobs(cfg: ModelConfig, params, tokens, attention_mask, temperature=1.0, chunk_size: int = 512):
    """Teacher-forced ``log p(tokens[:, t] | tokens[:, :t])`` and entropy, ``[B, T]`` float32.

    Column 0 (no context) is 0. This is the training path the sampler's ``behav_logp`` is
    checked against.
    """
    hidden, _ = forward(cfg, params, tokens, attention_mask)
    logp, entropy = token_logprobs(hidden[:, :-1], head_kernel(cfg, params), tokens[:, 1:], temperature, chunk_size)
    zeros = jnp.zeros((tokens.shape[0], 1), jnp.float32)
    return jnp.concatenate([zeros, logp], axis=1), jnp.concatenate([zeros, entropy], axis=1)
