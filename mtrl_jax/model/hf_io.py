"""HF safetensors checkpoints in and out, through one strict key map.

Every HF tensor name maps to exactly one parameter path (per-layer tensors are stacked along the
leading ``layers`` axis). Loading fails, naming the tensor, on any tensor that is unmapped,
duplicated (within the index or across shard files), mis-shaped, or missing.

safetensors files are read and written by ``safetensors_io`` (memory-mapped, no torch).
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np

from mtrl_jax.model.config import ModelConfig, dtype_from_name
from mtrl_jax.model.transformer import Transformer, abstract_params

from mtrl_jax.model.safetensors_io import (  # noqa: F401 - read_safetensors, write_safetensors: hf_io's names too
    is_float,
    no_duplicate_keys,
    read_header,
    read_safetensors,
    write_safetensors,
)


# ----------------------------------------------------------------------------- key map


@dataclasses.dataclass(frozen=True)
class Rule:
    """One HF tensor name pattern (``{i}`` = layer index) <-> one parameter path."""

    hf: str
    path: tuple[str, ...]
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    to_ours: Callable[[np.ndarray, ModelConfig], np.ndarray] = lambda w, c: w
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray] = lambda w, c: w

    @property
    def per_layer(self) -> bool:
        return "{i}" in self.hf

    @property
    def regex(self) -> re.Pattern:
        return re.compile("^" + re.escape(self.hf).replace(re.escape("{i}"), r"(\d+)") + "$")


def _proj_in(heads: Callable[[ModelConfig], int]) -> dict:
    """q/k/v: HF ``[heads*H, D]`` <-> ours ``[D, heads, H]``."""
    return dict(
        hf_shape=lambda c: (heads(c) * c.head_dim, c.hidden_size),
        to_ours=lambda w, c: w.T.reshape(c.hidden_size, heads(c), c.head_dim),
        to_hf=lambda w, c: w.reshape(c.hidden_size, -1).T,
    )


def _bias(heads: Callable[[ModelConfig], int]) -> dict:
    return dict(
        hf_shape=lambda c: (heads(c) * c.head_dim,),
        to_ours=lambda w, c: w.reshape(heads(c), c.head_dim),
        to_hf=lambda w, c: w.reshape(-1),
    )


_T = dict(to_ours=lambda w, c: w.T, to_hf=lambda w, c: w.T)
_N = lambda c: c.num_heads  # noqa: E731
_K = lambda c: c.num_kv_heads  # noqa: E731
_P = "model.layers.{i}."


def key_map(cfg: ModelConfig) -> list[Rule]:
    """The rules for ``cfg`` (which optional tensors exist depends on the architecture)."""
    D, F, V, H = cfg.hidden_size, cfg.intermediate_size, cfg.valid_vocab, cfg.head_dim  # the file's vocabulary
    rules = [
        Rule("model.embed_tokens.weight", ("embed",), lambda c: (V, D)),
        Rule("model.norm.weight", ("final_norm", "scale"), lambda c: (D,)),
        Rule(_P + "input_layernorm.weight", ("layers", "input_norm", "scale"), lambda c: (D,)),
        Rule(_P + "post_attention_layernorm.weight", ("layers", "post_attn_norm", "scale"), lambda c: (D,)),
        Rule(_P + "self_attn.q_proj.weight", ("layers", "attn", "q_proj"), **_proj_in(_N)),
        Rule(_P + "self_attn.k_proj.weight", ("layers", "attn", "k_proj"), **_proj_in(_K)),
        Rule(_P + "self_attn.v_proj.weight", ("layers", "attn", "v_proj"), **_proj_in(_K)),
        Rule(
            _P + "self_attn.o_proj.weight",
            ("layers", "attn", "o_proj"),
            hf_shape=lambda c: (D, c.num_heads * H),
            to_ours=lambda w, c: w.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
            to_hf=lambda w, c: w.reshape(-1, c.hidden_size).T,
        ),
        Rule(_P + "mlp.gate_proj.weight", ("layers", "mlp", "gate_proj"), lambda c: (F, D), **_T),
        Rule(_P + "mlp.up_proj.weight", ("layers", "mlp", "up_proj"), lambda c: (F, D), **_T),
        Rule(_P + "mlp.down_proj.weight", ("layers", "mlp", "down_proj"), lambda c: (D, F), **_T),
    ]
    if not cfg.tie_word_embeddings:
        rules.append(Rule("lm_head.weight", ("lm_head",), lambda c: (V, D), **_T))
    if cfg.qkv_bias:
        rules += [
            Rule(_P + f"self_attn.{x}_proj.bias", ("layers", "attn", f"{x}_bias"), **_bias(n))
            for x, n in (("q", _N), ("k", _K), ("v", _K))
        ]
    if cfg.qk_norm:
        rules += [
            Rule(_P + f"self_attn.{x}_norm.weight", ("layers", "attn", f"{x}_norm", "scale"), lambda c: (H,))
            for x in ("q", "k")
        ]
    return rules


# ----------------------------------------------------------------------------- loading


def _tensor_sources(path: pathlib.Path) -> dict[str, pathlib.Path]:
    """HF tensor name -> the file holding it; errors on duplicates across or within files."""
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text(), object_pairs_hook=no_duplicate_keys(index))["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors files (and no model.safetensors.index.json)")
    sources: dict[str, pathlib.Path] = {}
    for name in files:
        file = path / name
        if not file.exists():
            raise FileNotFoundError(f"{file}: listed in {index.name} but missing")
        header, _ = read_header(file)
        for tensor in header:
            if tensor == "__metadata__":
                continue
            if tensor in sources:
                raise ValueError(f"tensor {tensor!r} is duplicated: in {sources[tensor].name} and {file.name}")
            if weight_map is not None and weight_map.get(tensor) != name:
                raise ValueError(
                    f"tensor {tensor!r} is in {file.name} but the index maps it to {weight_map.get(tensor)!r}"
                )
            sources[tensor] = file
    if weight_map is not None:
        for tensor, name in weight_map.items():
            if tensor not in sources:
                raise ValueError(f"tensor {tensor!r}: the index lists it in {name} but that file does not hold it")
    return sources


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def load_hf_checkpoint(
    path: os.PathLike,
    param_dtype: str | jnp.dtype = "float32",
    mesh: Optional[jax.sharding.Mesh] = None,
    *,
    dtype: Optional[str] = None,
    vocab_multiple: int = 1,
    **runtime,
) -> tuple[Transformer, dict]:
    """Load a local HF directory (``config.json`` + safetensors) as ``(Transformer, params)``.

    ``param_dtype``: parameter dtype (``"float32"`` or ``"bfloat16"``). ``mesh``: place every
    parameter straight onto it with the logical sharding table. ``dtype``: activation/matmul dtype,
    as in Flax (defaults to ``param_dtype``; ``"bfloat16"`` with float32 parameters is mixed precision).
    ``runtime``: other ``ModelConfig`` runtime fields (``remat``, ``attention_impl``). ``vocab_multiple``: the
    vocabulary padded up to a multiple of it (zero rows and columns, masked out of every logit) when it is not
    one already, so that every mesh axis divides it (``ModelConfig.padded_vocab``; an export drops the padding).
    """
    path = pathlib.Path(path)
    param_dtype = jnp.dtype(param_dtype).name
    runtime["dtype"] = jnp.dtype(dtype or param_dtype).name
    cfg = read_hf_config(path / "config.json", param_dtype, runtime).padded_vocab(vocab_multiple)
    rules = key_map(cfg)
    boxed = abstract_params(cfg)
    shardings = None
    if mesh is not None:
        from mtrl_jax.model.sharding import param_shardings

        shardings = param_shardings(boxed, mesh)
    sources = _tensor_sources(path)
    by_rule = _match_tensors(sources, rules, cfg)
    np_dtype = np.dtype(dtype_from_name(param_dtype))
    open_files: dict[pathlib.Path, dict] = {}
    params: dict = {}
    for r, rule in enumerate(rules):
        value = _rule_value(rule, by_rule[r], sources, open_files, cfg, np_dtype)
        leaf = boxed
        for key in rule.path:
            leaf = leaf[key]
        if cfg.real_vocab_size and rule.path in (("embed",), ("lm_head",)):  # zero rows / columns up to the padding
            axis = 0 if rule.path == ("embed",) else 1
            pad = [(0, 0), (0, 0)]
            pad[axis] = (0, cfg.vocab_size - value.shape[axis])
            value = np.pad(value, pad)
        if tuple(value.shape) != tuple(leaf.value.shape):
            raise AssertionError(
                f"key map bug: {rule.hf} -> {rule.path} gives {value.shape}, model wants {leaf.value.shape}"
            )
        if shardings is not None:
            sharding = shardings
            for key in rule.path:
                sharding = sharding[key]
            _set(params, rule.path, jax.device_put(value, sharding))
        else:
            _set(params, rule.path, jnp.asarray(value))
    return Transformer(cfg), params


def read_hf_config(config_file: pathlib.Path, param_dtype: str, runtime: dict) -> ModelConfig:
    """The ``ModelConfig`` of an HF ``config.json``; a missing or malformed file is an error naming it."""
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file}: not found (expected an HF checkpoint directory)")
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{config_file}: expected a JSON object")
    return ModelConfig.from_hf(hf_config, source=str(config_file), param_dtype=param_dtype, **runtime)


def _match_tensors(sources: dict, rules: list[Rule], cfg: ModelConfig) -> dict[int, dict[int, str]]:
    """``{rule index: {layer: tensor name}}``; a tensor no rule maps, or of a layer past the model's, is an error."""
    by_rule: dict[int, dict[int, str]] = {i: {} for i in range(len(rules))}
    for tensor in sorted(sources):
        for r, rule in enumerate(rules):
            match = rule.regex.match(tensor)
            if match:
                layer = int(match.group(1)) if rule.per_layer else 0
                if layer >= cfg.num_layers:
                    raise ValueError(f"tensor {tensor!r}: layer {layer} but num_hidden_layers={cfg.num_layers}")
                by_rule[r][layer] = tensor
                break
        else:
            raise ValueError(
                f"tensor {tensor!r} in {sources[tensor].name} is not mapped to any parameter of a "
                f"{cfg.model_type} model" + (" (tie_word_embeddings is true)" if tensor == "lm_head.weight" else "")
            )
    return by_rule


def _rule_value(rule: Rule, tensors: dict[int, str], sources: dict, open_files: dict, cfg, np_dtype) -> np.ndarray:
    """The parameter of ``rule`` from its tensors (stacked over layers), in ours layout and ``np_dtype``; a
    missing, mis-shaped or non-finite tensor is an error naming it."""
    count = cfg.num_layers if rule.per_layer else 1
    missing = [rule.hf.format(i=i) for i in range(count) if i not in tensors]
    if missing:
        raise ValueError(
            f"missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    arrays = []
    for i in range(count):
        tensor = tensors[i]
        file = sources[tensor]
        if file not in open_files:
            open_files[file] = read_safetensors(file)
        w = open_files[file][tensor]
        expected = rule.hf_shape(cfg)
        if tuple(w.shape) != expected:
            raise ValueError(f"tensor {tensor!r} has shape {tuple(w.shape)}, expected {expected}")
        if is_float(w.dtype) and not np.isfinite(w).all():
            raise ValueError(
                f"{file}: tensor {tensor!r} holds non-finite values ({int((~np.isfinite(w)).sum())} of {w.size})"
            )
        arrays.append(rule.to_ours(np.asarray(w).astype(np_dtype), cfg))
    return np.stack(arrays) if rule.per_layer else arrays[0]


# ----------------------------------------------------------------------------- export


def save_hf_checkpoint(
    model: Transformer, params: dict, path: os.PathLike, max_shard_bytes: Optional[int] = None
) -> None:
    """Write ``config.json`` and safetensors (sharded with an index when ``max_shard_bytes`` is set)."""
    cfg = model.config
    path = pathlib.Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, np.ndarray] = {}
    for rule in key_map(cfg):
        value = params
        for key in rule.path:
            value = value[key]
        value = np.asarray(jax.device_get(value))
        if rule.path == ("embed",):  # a padded vocabulary's extra rows / columns are not part of the checkpoint
            value = value[: cfg.valid_vocab]
        elif rule.path == ("lm_head",):
            value = value[:, : cfg.valid_vocab]
        if rule.per_layer:
            for i in range(cfg.num_layers):
                tensors[rule.hf.format(i=i)] = rule.to_hf(value[i], cfg)
        else:
            tensors[rule.hf] = rule.to_hf(value, cfg)
    (path / "config.json").write_text(json.dumps(cfg.to_hf(), indent=2, sort_keys=True))
    if max_shard_bytes is None:
        write_safetensors(tensors, path / "model.safetensors")
        return
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name in sorted(tensors):
        nbytes = tensors[name].nbytes
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensors[name]
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        write_safetensors(shard, path / file)
        weight_map.update({name: file for name in shard})
    total = sum(t.nbytes for t in tensors.values())
    (path / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2, sort_keys=True)
    )
