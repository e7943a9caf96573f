"""``ModelConfig``: the static description of a Qwen2 / Qwen3 / Llama decoder.

Built from an HF ``config.json`` (``ModelConfig.from_hf``) or directly (tiny models, tests).
It is a frozen dataclass, so jitted functions take it as a static argument.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Optional

import jax.numpy as jnp

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama")
# the projections LoRA can adapt (mtrl_jax/model/lora.py)
LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down")

_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def dtype_from_name(name: str):
    try:
        return _DTYPES[name]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; expected one of {sorted(_DTYPES)}") from None


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    model_type: str = "qwen3"
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    # Llama-3 style frequency scaling: (factor, low_freq_factor, high_freq_factor, original_max_pos)
    rope_llama3_scaling: Optional[tuple[float, float, float, int]] = None
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k, before RoPE
    max_position_embeddings: int = 32768
    # Runtime choices (not part of the HF checkpoint).
    dtype: str = "float32"  # compute dtype of activations and matmuls
    param_dtype: str = "float32"
    remat: bool = False  # rematerialise each layer in the backward pass
    scan_unroll: int = 1  # layers per iteration of the layer scan; 0 or num_layers: no loop (XLA's FLOP count; CPU)
    # Training / scoring attention (no KV cache). None: causal attention in query chunks of
    # ``attention_chunk`` positions, each attending only to the keys at or before its end (half the
    # score matrix is never computed; plain einsums, grouped-query heads never repeated). "xla" or
    # "cudnn": ``jax.nn.dot_product_attention`` with that implementation (cuDNN's fused kernel on GPU).
    attention_impl: Optional[str] = None
    attention_chunk: int = 128
    # LoRA adapters on ``lora_targets`` (a subset of LORA_TARGETS) of rank ``lora_rank`` (0: none), scaled by
    # ``lora_alpha / lora_rank``; their parameters are always float32 (mtrl_jax/model/lora.py)
    lora_rank: int = 0
    lora_alpha: float = 16.0
    lora_targets: tuple[str, ...] = LORA_TARGETS
    # the real vocabulary when ``vocab_size`` is padded up (so that every mesh axis divides it): the embedding
    # rows and head columns past it exist but are never sampled, their logits masked (0: no padding)
    real_vocab_size: int = 0
    # The original HF config.json (as JSON text), kept so an export round-trips extra fields.
    hf_config_json: str = dataclasses.field(default="{}", compare=False, repr=False)

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"model_type {self.model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads={self.num_heads} is not a multiple of num_key_value_heads={self.num_kv_heads}"
            )
        dtype_from_name(self.dtype)
        dtype_from_name(self.param_dtype)
        if self.attention_impl not in (None, "xla", "cudnn"):
            raise ValueError(
                f"attention_impl must be None (chunked causal einsums), 'xla' or 'cudnn', got {self.attention_impl!r}"
            )
        if self.attention_chunk < 1:
            raise ValueError(f"attention_chunk must be >= 1, got {self.attention_chunk}")
        if self.lora_rank < 0:
            raise ValueError(f"lora_rank must be >= 0 (0: no adapters), got {self.lora_rank}")
        unknown = sorted(set(self.lora_targets) - set(LORA_TARGETS))
        if unknown or (self.lora_rank and not self.lora_targets):
            raise ValueError(f"lora_targets must be a non-empty subset of {LORA_TARGETS}, got {self.lora_targets}")
        if not 0 <= self.real_vocab_size <= self.vocab_size:
            raise ValueError(f"real_vocab_size={self.real_vocab_size} must be in [0, vocab_size={self.vocab_size}]")
        if self.lora_rank and not self.lora_alpha > 0:
            raise ValueError(f"lora_alpha must be > 0, got {self.lora_alpha}")
        if len(set(self.lora_targets)) != len(self.lora_targets):
            raise ValueError(f"lora_targets names a projection more than once: {self.lora_targets}")
        if self.lora_rank > self.hidden_size:
            raise ValueError(f"lora_rank={self.lora_rank} is above the hidden size {self.hidden_size}")

    @property
    def valid_vocab(self) -> int:
        """The vocabulary entries that are real tokens (the logits past them are masked)."""
        return self.real_vocab_size or self.vocab_size

    def padded_vocab(self, multiple: int) -> "ModelConfig":
        """This config with ``vocab_size`` rounded up to a multiple of ``multiple`` (the real size kept)."""
        padded = -(-self.valid_vocab // multiple) * multiple
        return self.replace(vocab_size=padded, real_vocab_size=self.valid_vocab if padded != self.valid_vocab else 0)

    @property
    def compute_dtype(self):
        return dtype_from_name(self.dtype)

    @property
    def params_dtype(self):
        return dtype_from_name(self.param_dtype)

    def replace(self, **changes) -> "ModelConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF config.json

    @classmethod
    def from_hf(cls, hf: dict[str, Any], source: str = "config.json", **runtime) -> "ModelConfig":
        """Parse an HF ``config.json`` dict; every unsupported setting is an error naming the field."""

        def need(field: str):
            if field not in hf:
                raise ValueError(f"{source}: missing field {field!r}")
            return hf[field]

        model_type = need("model_type")
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(
                f"{source}: model_type {model_type!r} is not supported; expected one of {SUPPORTED_MODEL_TYPES}"
            )
        if hf.get("use_sliding_window"):
            raise ValueError(f"{source}: use_sliding_window=true is not supported")
        if hf.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"{source}: hidden_act {act!r} is not supported (only 'silu')")

        rope = hf.get("rope_parameters") or {}
        rope_theta = hf.get("rope_theta", rope.get("rope_theta"))
        if rope_theta is None:
            raise ValueError(f"{source}: missing rope theta (neither 'rope_theta' nor 'rope_parameters.rope_theta')")
        scaling = hf.get("rope_scaling") or rope
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        llama3 = None
        if rope_type == "llama3":
            llama3 = (
                float(scaling["factor"]),
                float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]),
                int(scaling["original_max_position_embeddings"]),
            )
        elif rope_type not in ("default", None):
            raise ValueError(f"{source}: rope_type {rope_type!r} is not supported (only 'default' and 'llama3')")

        num_heads = need("num_attention_heads")
        hidden = need("hidden_size")
        qkv_bias = model_type == "qwen2" or bool(hf.get("attention_bias", False))
        return cls(
            vocab_size=need("vocab_size"),
            hidden_size=hidden,
            intermediate_size=need("intermediate_size"),
            num_layers=need("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            model_type=model_type,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            rope_llama3_scaling=llama3,
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            qk_norm=model_type == "qwen3",
            max_position_embeddings=int(hf.get("max_position_embeddings", 32768)),
            hf_config_json=json.dumps(hf, sort_keys=True),
            **runtime,
        )

    def to_hf(self) -> dict[str, Any]:
        """The HF ``config.json`` dict for this model (original extra fields preserved)."""
        hf = json.loads(self.hf_config_json)
        architectures = {"qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM", "llama": "LlamaForCausalLM"}
        hf.update(
            model_type=self.model_type,
            architectures=[architectures[self.model_type]],
            vocab_size=self.valid_vocab,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads,
            num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings,
            hidden_act="silu",
            torch_dtype=self.param_dtype,
        )
        if self.model_type != "qwen2":
            hf["attention_bias"] = self.qkv_bias
        if "rope_parameters" in hf:
            hf["rope_parameters"] = {**hf["rope_parameters"], "rope_theta": self.rope_theta}
        else:
            hf["rope_theta"] = self.rope_theta
        if self.rope_llama3_scaling is not None and "rope_parameters" not in hf:
            f, lo, hi, orig = self.rope_llama3_scaling
            hf["rope_scaling"] = {
                "rope_type": "llama3",
                "factor": f,
                "low_freq_factor": lo,
                "high_freq_factor": hi,
                "original_max_position_embeddings": orig,
            }
        return hf
