"""LoRA adapters (Hu et al. 2021): a frozen base and, on each adapted projection ``W``, a trainable
low-rank update ``x W + (alpha / r) (x A) B``.

The adapters are ordinary parameters of the Flax decoder (``<proj>_lora_a``, ``<proj>_lora_b``, declared
next to the weight they adapt, with its logical axes plus a replicated ``lora`` axis, so the sharding
table places them where that weight is); ``A`` starts random and ``B`` at zero, so at initialisation the
adapted model computes exactly the base model. Training splits the parameters into the frozen base and
the trainable adapters (``split``): gradients, the optimizer state and checkpoints hold the adapters only,
and the forward pass merges the two trees (``merge``: no array is copied). ``merged_weights`` folds the
adapters into the base weights for an HF export that transformers loads; ``save_peft_adapters`` writes
the adapters alone in PEFT's layout.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mtrl_jax.model.config import LORA_TARGETS, ModelConfig

SUFFIXES = ("_lora_a", "_lora_b")
# our projection name -> its HF module inside a layer
_HF_MODULES = {
    "q": "self_attn.q_proj",
    "k": "self_attn.k_proj",
    "v": "self_attn.v_proj",
    "o": "self_attn.o_proj",
    "gate": "mlp.gate_proj",
    "up": "mlp.up_proj",
    "down": "mlp.down_proj",
}
# the number of leading axes of each weight that its input contracts (o_proj [N, H, D]: two)
_CONTRACT = {"o": 2}
_MODULE = {"q": "attn", "k": "attn", "v": "attn", "o": "attn", "gate": "mlp", "up": "mlp", "down": "mlp"}


def is_adapter(name: str) -> bool:
    return name.endswith(SUFFIXES)


class Policy(NamedTuple):
    """A policy's parameters as the two trees the code keeps apart: ``base``, which does not train (the frozen
    model under LoRA adapters; empty without adapters), and ``trainable`` (the adapters, or every parameter).
    One value, passed to whatever needs it (the update, the sampler, an export); nothing holds one to assign."""

    base: Any
    trainable: Any

    def full(self) -> dict:
        """The whole parameter tree the model runs."""
        return merge(self.base, self.trainable)


def split(params: dict) -> tuple[dict, dict]:
    """``(frozen, adapters)``: the tree without its adapter leaves, and the adapter leaves alone (the
    same nesting); without adapters, ``({}, params)`` (every parameter trains)."""
    if not has_adapters(params):
        return {}, params

    def walk(tree):
        frozen, adapters = {}, {}
        for key, value in tree.items():
            if isinstance(value, dict):
                f, a = walk(value)
                if f:
                    frozen[key] = f
                if a:
                    adapters[key] = a
            elif is_adapter(key):
                adapters[key] = value
            else:
                frozen[key] = value
        return frozen, adapters

    return walk(params)


def merge(frozen: dict, trainable: dict) -> dict:
    """The whole parameter tree from ``split``'s two halves (nested dicts merged; arrays not copied)."""
    if not frozen:
        return trainable
    out = dict(frozen)
    for key, value in trainable.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and key in out else value
    return out


def has_adapters(params: dict) -> bool:
    return any(is_adapter(str(getattr(path[-1], "key", ""))) for path, _ in jax.tree_util.tree_leaves_with_path(params))


def init_adapters(cfg: ModelConfig, rng: jax.Array, mesh=None) -> dict:
    """The adapters of ``cfg`` (``A`` random, ``B`` zero), created directly sharded on ``mesh``: the
    model's whole initialisation traced, the base weights' part dropped unused by the compiler."""
    from mtrl_jax.model.sharding import param_shardings
    from mtrl_jax.model.transformer import abstract_params, init_params_fn

    if not cfg.lora_rank:
        raise ValueError("init_adapters: the config has no adapters (lora_rank 0)")
    init = lambda: split(init_params_fn(cfg, rng)())[1]  # noqa: E731
    if mesh is None:
        return jax.jit(init)()
    return jax.jit(init, out_shardings=split(param_shardings(abstract_params(cfg), mesh))[1])()


def _scale(cfg: ModelConfig) -> float:
    return cfg.lora_alpha / cfg.lora_rank


def delta(cfg: ModelConfig, target: str, a: jax.Array, b: jax.Array) -> jax.Array:
    """``(alpha / r) A B`` in the shape of the adapted weight (stacked over layers when ``a`` is)."""
    contract = _CONTRACT.get(target, 1)
    lead = a.ndim - contract - 1  # a layer axis, if stacked
    a2 = a.reshape(*a.shape[:lead], math.prod(a.shape[lead : lead + contract]), a.shape[-1])
    b2 = b.reshape(*b.shape[:lead], b.shape[lead], math.prod(b.shape[lead + 1 :]))
    w = jnp.matmul(a2.astype(jnp.float32), b2.astype(jnp.float32)) * _scale(cfg)
    return w.reshape(*a.shape[:-1], *b.shape[lead + 1 :])


def merged_weights(cfg: ModelConfig, params: dict) -> tuple[ModelConfig, dict]:
    """``(the base config, its parameters with every adapter folded in: W + (alpha / r) A B)``, for an HF
    export (``save_hf_checkpoint``) that transformers reloads as a plain model. The export is float32
    whatever the base's dtype: a trained update below a bfloat16 weight's rounding step (about 1/256 of it)
    would be rounded away in a bfloat16 merge, and the export would not be the trained policy."""
    frozen, adapters = split(params)
    if not adapters or not cfg.lora_rank:
        return cfg, params
    out = jax.tree.map(lambda x: x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x, frozen)
    layers = adapters["layers"]
    for target in cfg.lora_targets:
        module = _MODULE[target]
        name = "down_proj" if target == "down" else f"{target}_proj"
        a, b = layers[module][f"{name}_lora_a"], layers[module][f"{name}_lora_b"]
        out["layers"][module][name] = out["layers"][module][name] + delta(cfg, target, a, b)
    return cfg.replace(lora_rank=0, param_dtype="float32"), out


def save_peft_adapters(cfg: ModelConfig, params: dict, path: os.PathLike, base_model: Optional[str] = None) -> None:
    """The adapters alone in PEFT's layout: ``adapter_config.json`` and ``adapter_model.safetensors`` with
    ``base_model.model.model.layers.<i>.<module>.lora_A.weight [r, in]`` and ``lora_B.weight [out, r]``."""
    from mtrl_jax.model.hf_io import write_safetensors

    _, adapters = split(params)
    if not adapters or not cfg.lora_rank:
        raise ValueError("save_peft_adapters: the parameters hold no adapters")
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors = {}
    layers = adapters["layers"]
    for target in cfg.lora_targets:
        module = _MODULE[target]
        name = "down_proj" if target == "down" else f"{target}_proj"
        a = np.asarray(jax.device_get(layers[module][f"{name}_lora_a"]), np.float32)  # [L, *in, r]
        b = np.asarray(jax.device_get(layers[module][f"{name}_lora_b"]), np.float32)  # [L, r, *out]
        for i in range(cfg.num_layers):
            # ours: x [.., in] @ A [in, r] @ B [r, out], in and out flattened in the weight's own order, which is
            # the row order of HF's [out, in] weight; PEFT: W + scale * B_hf [out, r] @ A_hf [r, in]
            prefix = f"base_model.model.model.layers.{i}.{_HF_MODULES[target]}"
            tensors[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(a[i].reshape(-1, cfg.lora_rank).T)
            tensors[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(b[i].reshape(cfg.lora_rank, -1).T)
    write_safetensors(tensors, path / "adapter_model.safetensors")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": cfg.lora_rank,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": [_HF_MODULES[t].split(".")[-1] for t in cfg.lora_targets],
        "base_model_name_or_path": base_model,
    }
    (path / "adapter_config.json").write_text(json.dumps(config, indent=2))


__all__ = [
    "LORA_TARGETS",
    "SUFFIXES",
    "delta",
    "init_adapters",
    "merge",
    "merged_weights",
    "save_peft_adapters",
    "split",
]
