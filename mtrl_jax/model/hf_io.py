"""HF safetensors checkpoints in and out, through one strict key map.

Every HF tensor name maps to exactly one parameter path (per-layer tensors are stacked along the
leading ``layers`` axis). Loading fails, naming the tensor, on any tensor that is unmapped,
duplicated (within the index or across shard files), mis-shaped, or missing.

safetensors files are read and written here directly (the format is an 8-byte header length,
a JSON header and raw little-endian data), memory-mapped, so bfloat16 checkpoints load without
torch and without a float32 copy of the whole file.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import struct
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from mtrl_jax.model.config import ModelConfig, dtype_from_name
from mtrl_jax.model.transformer import Transformer, abstract_params

# ----------------------------------------------------------------------------- safetensors

_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_ST_NAMES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}


def is_float(dtype) -> bool:
    """numpy's floating types and ml_dtypes' bfloat16 (which numpy does not count as floating)."""
    return np.issubdtype(dtype, np.floating) or dtype == ml_dtypes.bfloat16


def read_header(path: os.PathLike) -> tuple[dict, int]:
    """``(header, header length)`` of a ``.safetensors`` file, every field of its framing checked: a file too
    short for its length field, a length that does not fit the file (or over 100 MiB), a header that is not
    a JSON object are errors naming the file, never a ``struct.error`` or a ``MemoryError``."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: not a safetensors file ({size} bytes; truncated or empty)")
        (header_len,) = struct.unpack("<Q", prefix)
        if header_len > size - 8 or header_len > 100 * 2**20:
            raise ValueError(
                f"{path}: safetensors header of {header_len} bytes does not fit in a file of {size} bytes "
                "(truncated or not a safetensors file)"
            )
        try:
            header = json.loads(f.read(header_len), object_pairs_hook=_no_duplicate_keys(path))
        except (ValueError, RecursionError) as e:
            raise ValueError(f"{path}: bad safetensors header: {e}") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: bad safetensors header: not a JSON object")
    return header, header_len


def read_safetensors(path: os.PathLike) -> dict[str, np.ndarray]:
    """Memory-mapped tensors of one ``.safetensors`` file (``__metadata__`` is skipped)."""
    path = pathlib.Path(path)
    size = path.stat().st_size
    header, header_len = read_header(path)
    data_len = size - 8 - header_len
    data = np.memmap(path, dtype=np.uint8, mode="r", offset=8 + header_len) if data_len > 0 else np.zeros(0, np.uint8)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype_name, shape, (start, end) = info["dtype"], [int(d) for d in info["shape"]], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {name!r} has a malformed header entry {info!r}") from None
        if dtype_name not in _ST_DTYPES:
            raise ValueError(f"{path}: tensor {name!r} has unsupported dtype {dtype_name}")
        dtype = np.dtype(_ST_DTYPES[dtype_name])
        expected = int(np.prod(shape)) * dtype.itemsize
        if not (0 <= start <= end <= data_len) or end - start != expected:
            raise ValueError(
                f"{path}: tensor {name!r} needs bytes {start}..{end} ({expected} for shape {shape}) "
                f"but the data section has {data_len} (truncated file?)"
            )
        tensors[name] = data[start:end].view(dtype).reshape(shape)
    return tensors


def write_safetensors(tensors: dict[str, np.ndarray], path: os.PathLike, metadata: Optional[dict] = None) -> None:
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        array = np.ascontiguousarray(tensors[name])
        if array.dtype not in _ST_NAMES:
            raise ValueError(f"tensor {name!r}: dtype {array.dtype} cannot be written to safetensors")
        blob = array.tobytes()
        header[name] = {
            "dtype": _ST_NAMES[array.dtype],
            "shape": list(array.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        offset += len(blob)
        blobs.append(blob)
    header["__metadata__"] = {"format": "pt", **(metadata or {})}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for blob in blobs:
            f.write(blob)


def _no_duplicate_keys(source):
    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"{source}: duplicate key {key!r}")
            seen[key] = value
        return seen

    return hook


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
        weight_map = json.loads(index.read_text(), object_pairs_hook=_no_duplicate_keys(index))["weight_map"]
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
    config_file = path / "config.json"
    if not config_file.exists():
        raise FileNotFoundError(f"{config_file}: not found (expected an HF checkpoint directory)")
    param_dtype = jnp.dtype(param_dtype).name
    runtime["dtype"] = jnp.dtype(dtype or param_dtype).name
    try:
        hf_config = json.loads(config_file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as e:
        raise ValueError(f"{config_file}: not valid JSON ({e})") from None
    if not isinstance(hf_config, dict):
        raise ValueError(f"{config_file}: expected a JSON object")
    cfg = ModelConfig.from_hf(hf_config, source=str(config_file), param_dtype=param_dtype, **runtime)
    cfg = cfg.padded_vocab(vocab_multiple)
    rules = key_map(cfg)
    boxed = abstract_params(cfg)
    shardings = None
    if mesh is not None:
        from mtrl_jax.model.sharding import param_shardings

        shardings = param_shardings(boxed, mesh)

    sources = _tensor_sources(path)
    open_files: dict[pathlib.Path, dict] = {}
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

    np_dtype = np.dtype(dtype_from_name(param_dtype))
    params: dict = {}
    for r, rule in enumerate(rules):
        count = cfg.num_layers if rule.per_layer else 1
        missing = [rule.hf.format(i=i) for i in range(count) if i not in by_rule[r]]
        if missing:
            raise ValueError(
                f"missing tensor {missing[0]!r}" + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        arrays = []
        for i in range(count):
            tensor = by_rule[r][i]
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
        value = np.stack(arrays) if rule.per_layer else arrays[0]
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
