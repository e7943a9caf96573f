"""The one table from logical axis names to mesh axes, and the mesh helpers around it.

The mesh always has the axes ``("data", "fsdp", "tensor")``. Parameters are sharded FSDP-style
over their ``embed`` dimension and Megatron-style over heads / MLP / vocab; activations are
sharded over the batch on ``data`` x ``fsdp``. A dimension that the mesh axes of its rule do not
divide (2 KV heads on a tensor axis of 4) is replicated over them instead (``divisible_spec``) where an
array is placed (parameters, the KV cache; an activation constraint may split unevenly, the compiler pads);
the vocabulary is padded up instead (``ModelConfig.padded_vocab``), so that the largest arrays stay split.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator, Optional, Sequence

import flax.linen as nn
import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

MESH_AXES = ("data", "fsdp", "tensor")

# logical axes of the KV cache [layers, batch, KV heads, cache slots, head dim]
CACHE_AXES = ("layers", "act_batch", "act_kv_heads", "cache_length", "head_dim")

# logical axis name -> mesh axis (or axes, or None = replicated)
LOGICAL_AXIS_RULES: tuple[tuple[str, Optional[str | tuple[str, ...]]], ...] = (
    # parameters
    ("vocab", "tensor"),
    ("embed", "fsdp"),
    ("mlp", "tensor"),
    ("heads", "tensor"),
    ("kv_heads", "tensor"),
    ("head_dim", None),
    ("norm", None),
    ("layers", None),
    ("lora", None),  # an adapter's rank: its other axes follow the weight it adapts
    # activations
    ("act_batch", ("data", "fsdp")),
    ("act_length", None),
    ("act_embed", None),
    ("act_heads", "tensor"),
    ("act_kv_heads", "tensor"),
    ("act_mlp", "tensor"),
    ("act_vocab", "tensor"),
    ("cache_length", None),
)


def make_mesh(shape: Sequence[int] = (1, 1, 1), devices: Optional[Sequence[jax.Device]] = None) -> Mesh:
    """A ``("data", "fsdp", "tensor")`` mesh; ``-1`` in one position takes the remaining devices."""
    devices = list(jax.devices() if devices is None else devices)
    shape = list(shape)
    if len(shape) != 3:
        raise ValueError(f"mesh shape must have 3 entries (data, fsdp, tensor), got {shape}")
    if shape.count(-1) > 1:
        raise ValueError(f"mesh shape {shape}: at most one -1")
    if -1 in shape:
        known = int(np.prod([s for s in shape if s != -1]))
        shape[shape.index(-1)] = len(devices) // known
    size = int(np.prod(shape))
    if size > len(devices):
        raise ValueError(f"mesh shape {tuple(shape)} needs {size} devices, only {len(devices)} available")
    return Mesh(np.asarray(devices[:size]).reshape(shape), MESH_AXES)


def logical_to_spec(logical_axes: Sequence[Optional[str]]) -> PartitionSpec:
    return nn.logical_to_mesh_axes(tuple(logical_axes), LOGICAL_AXIS_RULES)


def divisible_spec(spec: PartitionSpec, shape: Sequence[int], mesh) -> PartitionSpec:
    """``spec`` with every dimension whose mesh axes do not divide its size replicated (``None``)."""
    out = []
    for size, axes in zip(shape, tuple(spec) + (None,) * (len(shape) - len(spec))):
        names = axes if isinstance(axes, tuple) else (() if axes is None else (axes,))
        out.append(axes if size % math.prod(mesh.shape[n] for n in names) == 0 else None)
    return PartitionSpec(*out)


def param_shardings(abstract_params, mesh: Mesh):
    """NamedShardings for a params tree whose leaves are ``nn.LogicallyPartitioned`` boxes (a dimension its
    mesh axes do not divide is replicated, ``divisible_spec``)."""
    specs = nn.logical_to_mesh(nn.get_partition_spec(abstract_params), LOGICAL_AXIS_RULES)
    shapes = jax.tree.map(lambda box: box.value.shape, abstract_params, is_leaf=lambda x: isinstance(x, nn.Partitioned))
    return jax.tree.map(
        lambda spec, shape: NamedSharding(mesh, divisible_spec(spec, shape, mesh)),
        specs,
        shapes,
        is_leaf=lambda x: isinstance(x, PartitionSpec),
    )


def batch_sharding(mesh: Mesh, ndim: int = 2) -> NamedSharding:
    """Sharding of a ``[B, ...]`` activation: batch over ``data`` x ``fsdp``, the rest replicated."""
    return NamedSharding(mesh, PartitionSpec(("data", "fsdp"), *([None] * (ndim - 1))))


def axis_rules():
    """Context manager activating the table for ``nn.with_logical_constraint`` inside a mesh."""
    return nn.logical_axis_rules(LOGICAL_AXIS_RULES)


@contextlib.contextmanager
def activate(mesh: Optional[Mesh]) -> Iterator[None]:
    """The mesh and the logical-axis rules, active while jitted code is traced and run, so every
    ``nn.with_logical_constraint`` in the model takes effect. Both are thread-local: each thread that
    calls a jitted function (the rollout thread too) enters this itself. ``None``: a no-op."""
    if mesh is None:
        yield
        return
    # jax.set_mesh, not ``with mesh``: since JAX 0.7 the latter no longer reaches the sharding
    # constraints, and every nn.with_logical_constraint would silently be a no-op
    with _set_mesh(mesh), axis_rules():
        yield


_set_mesh = getattr(jax, "set_mesh", None) or jax.sharding.use_mesh


def constrain_rows(x: jax.Array) -> jax.Array:
    """Inside jitted code: ``x [B, ...]`` with its rows over ``data`` x ``fsdp`` (the ``act_batch``
    rule), the rest replicated; a no-op unless ``activate(mesh)`` is in effect."""
    return nn.with_logical_constraint(x, ("act_batch",) + (None,) * (x.ndim - 1))


def cache_sharding(mesh: Mesh, num_kv_heads: int = 0) -> NamedSharding:
    """The KV cache ``[L, B, K, S, H]``: rows over ``data`` x ``fsdp``, KV heads over ``tensor`` (replicated
    when ``num_kv_heads``, if given, does not divide by it)."""
    spec = logical_to_spec(CACHE_AXES)
    if num_kv_heads:
        spec = divisible_spec(spec, (1, 0, num_kv_heads, 1, 1), mesh)
    return NamedSharding(mesh, spec)


def on_mesh(tree, mesh: Optional[Mesh]):
    """``tree`` with every leaf that is not yet on ``mesh`` (an optimizer's step counter, a PRNG key:
    values created eagerly on one device) replicated over it, so that every process of a multi-process
    run holds it as a part of one global array (what Orbax saves, and jitted programs accept)."""
    if mesh is None:
        return tree

    def put(x):
        if isinstance(x, jax.Array) and isinstance(x.sharding, NamedSharding) and x.sharding.mesh == mesh:
            return x
        return jax.device_put(np.asarray(x), NamedSharding(mesh, PartitionSpec()))

    return jax.tree.map(put, tree)


def batch_placement(shape: tuple, mesh: Mesh) -> NamedSharding:
    """Where ``place_batch`` puts an array of ``shape``: its leading (batch) axis over ``data`` x ``fsdp``, a scalar
    replicated; a batch those devices do not divide is an error."""
    if not shape:
        return NamedSharding(mesh, PartitionSpec())
    shards = mesh.shape["data"] * mesh.shape["fsdp"]
    if shape[0] % shards:
        raise ValueError(f"a batch of {shape[0]} rows does not split over the mesh's data x fsdp = {shards} devices")
    return batch_sharding(mesh, len(shape))


def abstract_batch(tree, mesh: Optional[Mesh]):
    """``place_batch``'s placement as ``jax.ShapeDtypeStruct``s: nothing is transferred or run, so a program can be
    lowered ahead of time from another thread while the devices run the main thread's programs (on several CPU
    devices, a program run from a second thread can interleave its collectives with theirs)."""

    def abstract(x):
        shape, dtype = tuple(np.shape(x)), x.dtype if hasattr(x, "dtype") else np.asarray(x).dtype
        return jax.ShapeDtypeStruct(shape, dtype, sharding=None if mesh is None else batch_placement(shape, mesh))

    return jax.tree.map(abstract, tree)


def place_batch(tree, mesh: Optional[Mesh]):
    """``device_put`` every array of ``tree`` with its leading (batch) axis over ``data`` x ``fsdp``."""
    if mesh is None:
        return jax.device_put(tree)

    def put(x):
        x = np.asarray(x) if not isinstance(x, jax.Array) else x
        return jax.device_put(x, batch_placement(x.shape, mesh))

    return jax.tree.map(put, tree)
