"""Policy model: config, Flax decoder, HF checkpoint import/export, sharding table."""

from mtrl_jax.model.config import ModelConfig  # noqa: F401
from mtrl_jax.model.transformer import (  # noqa: F401
    KVCache, Transformer, abstract_params, forward, head_kernel, init_cache, init_params, logits_from_hidden)
