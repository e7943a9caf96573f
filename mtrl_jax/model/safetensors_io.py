"""safetensors files read and written directly (the format is an 8-byte header length, a JSON header and raw
little-endian data), memory-mapped, so bfloat16 checkpoints load without torch and without a float32 copy of
the whole file. Every field of the framing is checked, naming the file."""

from __future__ import annotations

import json
import os
import pathlib
import struct
from typing import Optional

import ml_dtypes
import numpy as np

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
            header = json.loads(f.read(header_len), object_pairs_hook=no_duplicate_keys(path))
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


def no_duplicate_keys(source):
    """A ``json.loads`` hook that refuses a key given twice, naming ``source``."""

    def hook(pairs):
        seen = {}
        for key, value in pairs:
            if key in seen:
                raise ValueError(f"{source}: duplicate key {key!r}")
            seen[key] = value
        return seen

    return hook
