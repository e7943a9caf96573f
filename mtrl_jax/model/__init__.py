"""Policy model: config, Flax decoder, HF checkpoint import/export, sharding table."""

import jax.numpy as jnp

from mtrl_jax.model.config import ModelConfig  # noqa: F401
from mtrl_jax.model.hf_io import load_hf_checkpoint, save_hf_checkpoint  # noqa: F401
from mtrl_jax.model.transformer import (  # noqa: F401
    KVCache,
    Transformer,
    abstract_params,
    forward,
    head_kernel,
    init_cache,
    init_params,
    logits_from_hidden,
)


def compute_logits(model: Transformer, params, tokens, attention_mask=None) -> jnp.ndarray:
    """float32 logits ``[B, T, V]`` of right-padded ``tokens [B, T]`` (tests and small models only;
    training goes through hidden states and ``mtrl_jax.rl.logprobs``)."""
    hidden, _ = forward(model.config, params, tokens, attention_mask)
    return logits_from_hidden(model.config, params, hidden)
