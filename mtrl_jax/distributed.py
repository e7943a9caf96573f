"""Multi-process (multi-host) runs: start-up, each process's share of the work, and the host-side
exchanges between processes.

Every process (one per host: a GPU node, a TPU VM) runs the same program. The update, the cold start
and the log-prob recomputation run on the global ``("data", "fsdp", "tensor")`` mesh over every
process's devices. Rollouts do not: each process generates its contiguous share of a step's groups
with its own rollout slots, on a *rollout mesh* of its own devices, with its own tools (or the one
HTTP tool service, ``search.remote_url``). The finished trajectories (token ids, masks, behaviour
log-probs, rewards; small next to the model) are then exchanged, so that every process builds the
same global batch and each device receives only its shard of it.

Every function here that talks to the other processes is a collective: all processes call it, in
the same order, from the main thread (the rollout thread only runs process-local programs). With
one process they are all cheap no-ops, so single-host code paths are unchanged.
"""

from __future__ import annotations

import logging
import math
import os
import pickle
from typing import Optional, Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding

log = logging.getLogger("mtrl_jax")


def initialize(
    coordinator_address: str = "", num_processes: int = 0, process_id: int = -1, auto_detect: bool = False
) -> bool:
    """Join a multi-process run before any JAX computation; returns whether one was joined.

    Explicit values win; empty ones fall back to ``JAX_COORDINATOR_ADDRESS``, ``JAX_NUM_PROCESSES``
    and ``JAX_PROCESS_ID``. ``auto_detect`` leaves the rest to JAX's cluster detection (SLURM, a
    Cloud TPU pod slice, Open MPI, Kubernetes). With nothing set and no ``auto_detect``: one process.
    """
    coordinator_address = coordinator_address or os.environ.get("JAX_COORDINATOR_ADDRESS", "")
    num_processes = num_processes or int(os.environ.get("JAX_NUM_PROCESSES", "0") or 0)
    if process_id < 0:
        process_id = int(os.environ.get("JAX_PROCESS_ID", "-1") or -1)
    if not (coordinator_address or num_processes or process_id >= 0 or auto_detect):
        return False
    if not auto_detect:
        missing = [
            name
            for name, given in (
                ("coordinator_address", coordinator_address),
                ("num_processes", num_processes),
                ("process_id", process_id >= 0),
            )
            if not given
        ]
        if missing:
            raise ValueError(
                f"a multi-process run needs --coordinator_address, --num_processes and --process_id "
                f"(or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID); missing: {', '.join(missing)}; "
                "or pass --distributed to let JAX detect SLURM / a TPU pod slice"
            )
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id {process_id} is not in [0, num_processes={num_processes})")
    # CPU devices talk to other processes through gloo (GPUs use NCCL, TPUs their interconnect)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    kwargs = (
        {}
        if auto_detect and not coordinator_address
        else dict(coordinator_address=coordinator_address, num_processes=num_processes, process_id=process_id)
    )
    jax.distributed.initialize(**kwargs)
    log.info(
        "process %d of %d: %d local devices, %d in all",
        jax.process_index(),
        jax.process_count(),
        jax.local_device_count(),
        jax.device_count(),
    )
    return True


def is_primary() -> bool:
    """The process that writes the work directory's logs, trajectories, tokenizer and summary."""
    return jax.process_index() == 0


def share(items: Sequence, unit: int = 1) -> list:
    """This process's contiguous share of ``items``, in whole blocks of ``unit`` (a group's samples
    stay together); process ``p`` of ``P`` takes blocks ``[p * n // P, (p + 1) * n // P)``, so the
    shares of processes ``0, 1, ...`` concatenated are ``items`` again."""
    if len(items) % unit:
        raise ValueError(f"{len(items)} items do not split into blocks of {unit}")
    blocks, count, index = len(items) // unit, jax.process_count(), jax.process_index()
    return list(items[index * blocks // count * unit : (index + 1) * blocks // count * unit])


def exchange(items: Sequence) -> list:
    """Every process's ``items`` (any picklable values), concatenated in process order. Collective."""
    if jax.process_count() == 1:
        return list(items)
    data = np.frombuffer(pickle.dumps(list(items), protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = multihost_utils.process_allgather(np.array([data.size], np.int32)).reshape(-1)
    buffer = np.zeros(int(sizes.max()), np.uint8)
    buffer[: data.size] = data
    gathered = multihost_utils.process_allgather(buffer).reshape(len(sizes), -1)
    out = []
    for p, size in enumerate(sizes):
        out += pickle.loads(gathered[p, : int(size)].tobytes())
    return out


def fetch(x) -> np.ndarray:
    """All of a global array on every process, as numpy (a collective when there are several
    processes: each holds only its devices' part of a batch-sharded array)."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def any_process(flag: bool) -> bool:
    """Whether ``flag`` is true on any process (a SIGTERM seen by one stops all at the same step). Collective."""
    if jax.process_count() == 1:
        return bool(flag)
    return bool(multihost_utils.process_allgather(np.array([int(bool(flag))], np.int32)).any())


def barrier(name: str) -> None:
    """Wait until every process got here. Collective."""
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


def rollout_mesh(mesh: Optional[Mesh]) -> Optional[Mesh]:
    """The mesh rollouts run on: ``mesh`` itself with one process; otherwise this process's devices,
    rows over ``data`` and KV heads over ``tensor`` (the global mesh's tensor size, where it divides)."""
    if mesh is None or jax.process_count() == 1:
        return mesh
    from mtrl_jax.model.sharding import make_mesh

    local = jax.local_devices()
    tensor = math.gcd(mesh.shape["tensor"], len(local))
    return make_mesh((len(local) // tensor, 1, tensor), local)


def to_rollout_mesh(params, mesh: Optional[Mesh]):
    """``params`` (on the global mesh) as a copy on this process's ``rollout_mesh``, each tensor with
    the same partition spec. Identity with one process. Collective (an all-gather)."""
    if mesh is None or jax.process_count() == 1:
        return params
    host = multihost_utils.process_allgather(params, tiled=True)
    shardings = jax.tree.map(lambda x: NamedSharding(mesh, x.sharding.spec), params)
    return jax.device_put(host, shardings)
