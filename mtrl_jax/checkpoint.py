"""Orbax checkpoints of a run: the ``TrainState`` with a typed run record, the KL reference, and the
work-directory lock.

``<workdir>/checkpoints/<rl_step>/`` holds ``state`` (params, optimizer state, optimizer step, RNG)
and ``record`` (``RunRecord`` as JSON: RL step, data cursor, staleness counters, the validation
metrics before RL). ``<workdir>/reference/`` holds the KL reference policy, written once.

Restoring falls back to the newest checkpoint that restores completely (a damaged one is named in
a warning), and refuses parameters that are not finite. ``WorkdirLock`` keeps a second run out of a
work directory that a live run holds; the lock of a killed run is released with its process.
"""

from __future__ import annotations

import dataclasses
import fcntl
import json
import logging
import os
import pathlib
import shutil
import socket
from typing import Any, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from mtrl_jax import distributed
from mtrl_jax.data.schedule import DataCursor
from mtrl_jax.model.hf_io import is_float
from mtrl_jax.rl.train_step import TrainState

log = logging.getLogger("mtrl_jax")


class CheckpointError(RuntimeError):
    """No checkpoint of the work directory restores (or one holds non-finite values)."""


@jax.jit
def _nonfinite_counts(leaves):
    return [jnp.sum(~jnp.isfinite(x)) for x in leaves]


def check_finite(tree, what: str) -> None:
    """Raise ``CheckpointError`` naming the first leaf of ``tree`` with a NaN or an infinity. Counted
    on the devices (shards stay where they are; with several processes every one takes part)."""
    leaves = [(path, leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(tree) if is_float(leaf.dtype)]
    counts = jax.device_get(_nonfinite_counts([leaf for _, leaf in leaves]))
    for (path, leaf), count in zip(leaves, counts):
        if count:
            raise CheckpointError(
                f"{what}: tensor {jax.tree_util.keystr(path)} holds non-finite values ({int(count)} of {leaf.size})"
            )


@dataclasses.dataclass
class RunRecord:
    """The host-side state saved next to the ``TrainState``."""

    rl_step: int = 0  # RL steps done
    cursor: DataCursor = DataCursor()  # where the next RL step's tasks start
    dropped_groups: int = 0  # groups filtered as too stale, over the run
    max_staleness_seen: int = 0
    before: Optional[dict] = None  # validation metrics of the policy RL started from

    def to_json(self) -> dict:
        return {
            "rl_step": self.rl_step,
            "cursor": self.cursor.to_json(),
            "before": self.before,
            "staleness": {"dropped_groups": self.dropped_groups, "max_seen": self.max_staleness_seen},
        }

    @classmethod
    def from_json(cls, record: Any, source: str) -> "RunRecord":
        try:
            return cls(
                rl_step=int(record["rl_step"]),
                cursor=DataCursor.from_json(record["cursor"], source),
                dropped_groups=int(record["staleness"]["dropped_groups"]),
                max_staleness_seen=int(record["staleness"]["max_seen"]),
                before=record["before"],
            )
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: malformed run record ({e!r})") from None


def abstract_state(tx, params, rng) -> TrainState:
    """Shapes and dtypes of the ``TrainState`` for ``params`` and optimizer ``tx`` (nothing allocated)."""
    return jax.eval_shape(lambda p, r: TrainState(p, tx.init(p), jnp.zeros((), jnp.int32), r), params, rng)


class Checkpoints:
    """The checkpoints of one work directory."""

    def __init__(self, workdir: pathlib.Path, keep: int = 2):
        self.workdir = pathlib.Path(workdir).absolute()
        self.manager = ocp.CheckpointManager(
            self.workdir / "checkpoints", options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True)
        )

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, state: TrainState, record: RunRecord) -> None:
        """Write checkpoint ``record.rl_step`` and wait until it is on disk."""
        self.manager.save(
            record.rl_step,
            force=True,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state._asdict()), record=ocp.args.JsonSave(record.to_json())
            ),
        )
        self.manager.wait_until_finished()

    def restore(self, like: TrainState) -> Optional[tuple[TrainState, RunRecord]]:
        """The newest checkpoint that restores completely onto the shapes, dtypes and shardings of
        ``like`` (arrays or ``jax.ShapeDtypeStruct``); ``None`` when there is none at all. A damaged
        checkpoint is skipped with a warning naming it; if none restores, ``CheckpointError``."""
        self.manager.reload()
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like._asdict())
        failures = []
        for step in steps:
            where = str(self.workdir / "checkpoints" / str(step))
            try:
                restored = self.manager.restore(
                    step,
                    args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract), record=ocp.args.JsonRestore()),
                )
                record = RunRecord.from_json(restored["record"], where)
                if record.rl_step != step:
                    raise ValueError(f"{where}: its run record says RL step {record.rl_step}")
            except Exception as e:  # noqa: BLE001 - any damage: try the one before
                log.warning(
                    "checkpoint %s is damaged (%s: %s); trying the one before", where, type(e).__name__, str(e)[:300]
                )
                failures.append(f"{where}: {type(e).__name__}")
                continue
            state = TrainState(**restored["state"])
            check_finite(state.params, where)
            return state, record
        raise CheckpointError(f"no checkpoint of {self.workdir} restores: {'; '.join(failures)}")

    @property
    def reference_path(self) -> pathlib.Path:
        return self.workdir / "reference"

    def save_reference(self, params) -> None:
        """The KL reference (the policy RL starts from), written once, before the first checkpoint."""
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(self.reference_path, params, force=True)
        checkpointer.wait_until_finished()

    def restore_reference(self, like):
        if not self.reference_path.exists():
            raise FileNotFoundError(
                f"{self.reference_path}: rl.kl_coef is set but this run has no KL reference policy "
                "(it started with rl.kl_coef=0); resume it with rl.kl_coef=0 or use a new workdir"
            )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        params = ocp.StandardCheckpointer().restore(self.reference_path, abstract)
        check_finite(params, str(self.reference_path))
        return params

    # -------------------------------------------------------------- warm-up progress

    @property
    def warmup_path(self) -> pathlib.Path:
        return self.workdir / "warmup"

    def save_warmup(self, params, opt_state, step: int, rng_state: dict, losses: list) -> None:
        """The supervised warm-up's progress (``<workdir>/warmup``), replaced atomically."""
        tmp = self.workdir / "warmup.tmp"
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(tmp / "state", {"params": params, "opt_state": opt_state}, force=True)
        checkpointer.wait_until_finished()
        if distributed.is_primary():  # every process wrote its shards; one moves the directory into place
            (tmp / "progress.json").write_text(json.dumps({"step": step, "rng_state": rng_state, "losses": losses}))
            if self.warmup_path.exists():
                shutil.rmtree(self.warmup_path)
            os.replace(tmp, self.warmup_path)
        distributed.barrier("warmup-saved")

    def restore_warmup(self, like_params, like_opt_state) -> Optional[tuple[Any, Any, dict]]:
        """``(params, opt_state, progress)`` of a saved warm-up, or ``None``."""
        if not (self.warmup_path / "progress.json").exists():
            return None
        progress = json.loads((self.warmup_path / "progress.json").read_text())
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": like_params, "opt_state": like_opt_state})
        state = ocp.StandardCheckpointer().restore(self.warmup_path / "state", abstract)
        check_finite(state["params"], str(self.warmup_path))
        return state["params"], state["opt_state"], progress

    def close(self) -> None:
        self.manager.close()


class WorkdirLock:
    """An exclusive ``flock`` on ``<workdir>/run.lock`` for the life of a run. A second run on the same
    work directory fails at once, naming the holder; the kernel drops the lock of a killed process,
    so a stale lock file is simply taken over. In a multi-process run the primary process holds it
    for all of them."""

    def __init__(self, workdir: pathlib.Path):
        self.path = pathlib.Path(workdir) / "run.lock"
        self.file = None

    def acquire(self) -> "WorkdirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not distributed.is_primary():
            return self
        handle = open(self.path, "a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            handle.seek(0)
            holder = handle.read().strip() or "another process"
            handle.close()
            raise RuntimeError(
                f"{self.path}: the work directory is in use by {holder}; "
                "wait for that run to end or use another --workdir"
            ) from None
        handle.seek(0)
        handle.truncate()
        handle.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
        handle.flush()
        self.file = handle
        return self

    def release(self) -> None:
        if self.file is not None:
            fcntl.flock(self.file, fcntl.LOCK_UN)
            self.file.close()
            self.file = None

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
