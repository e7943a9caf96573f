"""The policy from a run's config: an HF checkpoint or the tiny model, with LoRA adapters or not, and the checks
the model fields need before anything is loaded (what no range in ``mtrl_jax.ranges`` can say)."""

from __future__ import annotations

import json
import os
import pathlib
from typing import Any

import jax

from mtrl_jax import rng
from mtrl_jax.data.build import csv
from mtrl_jax.model import lora
from mtrl_jax.model.config import ModelConfig
from mtrl_jax.model.hf_io import load_hf_checkpoint
from mtrl_jax.model.transformer import init_params


DTYPES = ("float32", "bfloat16", "float16")
MIN_LORA_SCALE = 1e-4  # lora_alpha / lora_rank below this: the adapters' output is rounded away (a no-op)


def check_model_fields(config) -> None:
    """The model fields no range covers, refused naming the field before any data or file is touched: the
    dtypes, LoRA targets named twice (each projection has one adapter; export would fold a repeated one
    twice), a LoRA scale that makes training a no-op, and a rank above the tiny model's hidden size."""
    m = config.model
    for field in ("dtype", "param_dtype"):
        if m[field] not in DTYPES:
            raise ValueError(f"model.{field}={m[field]!r}: expected one of {DTYPES}")
    targets = csv(m.lora_targets)
    repeated = sorted({t for t in targets if targets.count(t) > 1})
    if repeated:
        raise ValueError(
            f"model.lora_targets={m.lora_targets!r} names {repeated} more than once: each projection has one adapter"
        )
    if m.lora_rank:
        if m.lora_alpha / m.lora_rank < MIN_LORA_SCALE:
            raise ValueError(
                f"model.lora_alpha={m.lora_alpha!r} with model.lora_rank={m.lora_rank} scales the adapters by "
                f"{m.lora_alpha / m.lora_rank:.3g} < {MIN_LORA_SCALE}: their output rounds away and training is a no-op"
            )
        if not m.checkpoint and m.lora_rank > m.tiny_hidden:
            raise ValueError(
                f"model.lora_rank={m.lora_rank} is above the model's hidden size model.tiny_hidden={m.tiny_hidden}: "
                "a rank past the smaller side of a projection adds nothing (a checkpoint's size is checked at load)"
            )


def build_model(config, vocab_size: int, mesh) -> tuple[ModelConfig, Any, Any]:
    """``(model config, frozen parameters, trainable parameters)``: an HF checkpoint or the tiny model; with
    ``model.lora_rank > 0`` the base is frozen and fresh adapters train (``model/lora.py``), else every
    parameter trains and the frozen tree is empty. A vocabulary that the mesh's devices do not divide is
    padded up (its extra entries masked out of every logit: ``ModelConfig.padded_vocab``)."""
    m = config.model
    runtime = dict(
        remat=m.remat,
        attention_impl=m.attention_impl or None,
        attention_chunk=m.attention_chunk,
        scan_unroll=m.scan_unroll,
    )
    adapters = dict(lora_rank=m.lora_rank, lora_alpha=m.lora_alpha, lora_targets=tuple(csv(m.lora_targets)))
    # the vocabulary padded to a multiple of the mesh's devices, so that the axes it is split over divide it
    vocab_multiple = 1 if mesh is None else int(mesh.devices.size)
    if m.param_dtype != "float32" and not m.lora_rank:
        raise ValueError(
            f"model.param_dtype={m.param_dtype!r}: the trained parameters would be updated in {m.param_dtype}, where "
            "an optimizer step at a small learning rate rounds away; keep model.param_dtype='float32' (the master "
            "copy) with model.dtype='bfloat16' for bfloat16 compute, or train LoRA adapters (model.lora_rank > 0: "
            "the frozen base may then be bfloat16, the adapters stay float32)"
        )
    if m.checkpoint:
        model, params = load_hf_checkpoint(
            m.checkpoint, m.param_dtype, mesh, dtype=m.dtype, vocab_multiple=vocab_multiple, **runtime
        )
        if model.config.valid_vocab < vocab_size:
            raise ValueError(
                f"tokenizer has {vocab_size} tokens but the model's vocabulary is {model.config.valid_vocab}"
            )
        if not m.lora_rank:
            return model.config, {}, params
        cfg = model.config.replace(**adapters)
        return cfg, params, lora.init_adapters(cfg, rng.key(config.seed, "adapters"), mesh)
    cfg = ModelConfig(
        vocab_size=vocab_size,
        hidden_size=m.tiny_hidden,
        intermediate_size=m.tiny_intermediate,
        num_layers=m.tiny_layers,
        num_heads=m.tiny_heads,
        num_kv_heads=m.tiny_kv_heads,
        head_dim=m.tiny_head_dim,
        model_type="qwen3",
        qk_norm=True,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        dtype=m.dtype,
        param_dtype=m.param_dtype,
        **runtime,
        **adapters,
    ).padded_vocab(vocab_multiple)
    frozen, trainable = lora.split(init_params(cfg, rng.key(config.seed, "params"), mesh))
    return cfg, frozen, trainable


def device_memory_bytes() -> int:
    """What one device of this process can hold: its memory limit where the backend reports one (GPU, TPU),
    else the machine's physical memory (CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_kv_cache(config, rows: int) -> None:
    """Refuse, with an estimate, a KV cache (``rows`` generation rows of ``rollout.max_len`` tokens) that
    cannot fit one device, before the model is loaded (rather than being killed for memory later)."""
    m = config.model
    if m.checkpoint and (pathlib.Path(m.checkpoint) / "config.json").exists():
        shape = json.loads((pathlib.Path(m.checkpoint) / "config.json").read_text())
        layers, heads = shape.get("num_hidden_layers", 1), shape.get("num_attention_heads", 1)
        kv, head_dim = (
            shape.get("num_key_value_heads") or heads,
            shape.get("head_dim") or shape.get("hidden_size", 0) // heads,
        )
    else:
        layers, kv, head_dim = m.tiny_layers, m.tiny_kv_heads, m.tiny_head_dim
    per_row = config.rollout.max_len * layers * 2 * kv * head_dim * jax.numpy.dtype(m.dtype).itemsize
    limit = device_memory_bytes()
    if rows * per_row > limit:
        raise ValueError(
            f"rollout.max_len={config.rollout.max_len}: the KV cache of {rows} generation rows "
            f"(rollout_max_concurrency) x {config.rollout.max_len} tokens would take {rows * per_row / 2**30:.1f} GiB, "
            f"more than the {limit / 2**30:.1f} GiB a device here holds"
        )
