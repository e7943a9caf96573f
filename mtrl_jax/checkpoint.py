"""Orbax checkpoints of a run: the ``TrainState`` with a typed run record, the KL reference, and the
work-directory lock.

``<workdir>/checkpoints/<rl_step>/`` holds ``state`` (params, optimizer state, optimizer step, RNG)
and ``record`` (``RunRecord`` as JSON: RL step, data cursor, staleness counters, the validation
metrics before RL). ``<workdir>/reference/`` holds the KL reference policy, written once.

Restoring falls back to the newest checkpoint that restores completely; the damaged ones after it are
named in a warning and moved to ``<workdir>/damaged/`` (so the resumed run can write those steps again).
Nothing non-finite is written or restored: a NaN or an infinity in the parameters is a ``CheckpointError``.
``<workdir>/config.json`` is the configuration the run started with; a resume whose model or KL settings
differ is refused in one line naming the field (``check_run_config``). ``WorkdirLock`` keeps a second
run out of a work directory that a live run holds, even after the directory was deleted under it.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import os
import pathlib
import shutil
import socket
import tempfile
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from mtrl_jax import distributed
from mtrl_jax.data.schedule import DataCursor
from mtrl_jax.metrics import flatten
from mtrl_jax.model.hf_io import is_float
from mtrl_jax.rl.optimizer import TrainState

log = logging.getLogger("mtrl_jax")


class CheckpointError(RuntimeError):
    """No checkpoint of the work directory restores (or one holds non-finite values)."""


@jax.jit
def _nonfinite_counts(leaves):
    return [jnp.sum(~jnp.isfinite(x)) for x in leaves]


# what a damaged checkpoint raises while restoring (each of the fault drill's five kinds of damage): a file gone
# (FileNotFoundError; Orbax's KeyError for a missing item), cut short or garbled (ValueError, JSONDecodeError
# included, and tensorstore's read errors)
DAMAGE = (FileNotFoundError, KeyError, ValueError)


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


def ensure_space(tree, where: pathlib.Path, what: str) -> None:
    """An ``OSError(ENOSPC)`` naming ``what``, the bytes it needs and those free, when the file system of
    ``where`` cannot hold ``tree``'s arrays (with 5% and 16 MiB to spare): said before a save starts,
    rather than failing in the writer's threads halfway through it."""
    need = int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree) if hasattr(x, "dtype")) * 1.05) + (16 << 20)
    where = pathlib.Path(where)
    while not where.exists():
        where = where.parent
    free = shutil.disk_usage(where).free
    if free < need:
        raise OSError(
            errno.ENOSPC,
            f"No space left on device for {what}: it needs {need / 2**20:.0f} MiB, "
            f"{where} has {free / 2**20:.0f} MiB free",
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
        """Write checkpoint ``record.rl_step`` and wait until it is on disk (refused when a parameter or a value
        of the optimizer state is not finite: no checkpoint holds a broken policy, nor Adam moments that would
        freeze it once resumed)."""
        check_finite(state.params, f"checkpoint {record.rl_step} (not written)")
        check_finite(state.opt_state, f"checkpoint {record.rl_step} (not written): the optimizer state's")
        ensure_space(state, self.workdir, f"checkpoint {record.rl_step}")
        self.manager.save(
            record.rl_step,
            force=True,
            args=ocp.args.Composite(
                state=ocp.args.StandardSave(state._asdict()), record=ocp.args.JsonSave(record.to_json())
            ),
        )
        self.manager.wait_until_finished()

    def restore(self, like: TrainState, read_only: bool = False) -> Optional[tuple[TrainState, RunRecord]]:
        """The newest checkpoint that restores completely onto the shapes, dtypes and shardings of
        ``like`` (arrays or ``jax.ShapeDtypeStruct``); ``None`` when there is none at all. A damaged
        checkpoint (``DAMAGE``: a file missing, truncated or garbled) is skipped with a warning naming it, and
        moved to ``damaged/`` once an older one restores, unless ``read_only`` (an evaluation, an export: they
        never move a checkpoint); if none restores, ``CheckpointError``. Any other error (an I/O error, memory)
        is no sign of damage: it stops the restore as a ``CheckpointError`` naming the step, nothing moved."""
        self.manager.reload()
        steps = sorted(self.manager.all_steps(), reverse=True)
        if not steps:
            logged = self.workdir / "metrics.jsonl"
            if logged.exists() and logged.stat().st_size:
                raise CheckpointError(
                    f"{logged} records RL steps of an earlier run, but {self.workdir / 'checkpoints'} holds no "
                    "checkpoint (deleted?); starting over would log those steps twice. Move the earlier run's files "
                    "away or use another --workdir"
                )
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
            except DAMAGE as e:  # a file missing, truncated or garbled: try the one before
                log.warning(
                    "checkpoint %s is damaged (%s: %s); trying the one before", where, type(e).__name__, str(e)[:300]
                )
                failures.append(f"{where}: {type(e).__name__}")
                continue
            except Exception as e:  # noqa: BLE001 - said in one line; the checkpoint is left where it is
                raise CheckpointError(
                    f"{where} could not be read ({type(e).__name__}: {str(e)[:300]}); this is not a known kind of "
                    "damage, so no checkpoint was set aside: fix the cause and run again"
                ) from e
            state = TrainState(**restored["state"])
            check_finite(state.params, where)
            if not read_only:
                self._set_aside([s for s in steps if s > step])
            return state, record
        raise CheckpointError(f"no checkpoint of {self.workdir} restores: {'; '.join(failures)}")

    def _set_aside(self, steps: list) -> None:
        """Move damaged checkpoints (newer than the one restored) to ``<workdir>/damaged/``: kept for a look,
        and out of the way of the resumed run, which writes those steps again."""
        if steps and distributed.is_primary():
            damaged = self.workdir / "damaged"
            damaged.mkdir(exist_ok=True)
            for step in steps:
                target = damaged / f"{step}-{time.strftime('%Y%m%d-%H%M%S')}"
                os.replace(self.workdir / "checkpoints" / str(step), target)
                log.warning("damaged checkpoint %d moved to %s", step, target)
        distributed.barrier("damaged-set-aside")
        self.manager.reload()

    @property
    def reference_path(self) -> pathlib.Path:
        return self.workdir / "reference"

    def save_reference(self, params) -> None:
        """The KL reference (the policy RL starts from), written once, before the first checkpoint."""
        check_finite(params, f"{self.reference_path} (not written)")
        ensure_space(params, self.workdir, str(self.reference_path))
        checkpointer = ocp.StandardCheckpointer()
        checkpointer.save(self.reference_path, params, force=True)
        checkpointer.wait_until_finished()

    def restore_reference(self, like):
        if not self.reference_path.exists():
            raise CheckpointError(
                f"{self.reference_path} is missing: rl.kl_coef is set, and the KL reference policy this run saved "
                "at its start has been deleted; restore that directory, resume with rl.kl_coef=0, or use a new workdir"
            )
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        params = ocp.StandardCheckpointer().restore(self.reference_path, abstract)
        check_finite(params, str(self.reference_path))
        return params

    # -------------------------------------------------------------- cold start progress

    @property
    def warmup_path(self) -> pathlib.Path:
        return self.workdir / "warmup"

    def save_warmup(self, params, opt_state, step: int, rng_state: dict, losses: list) -> None:
        """The supervised cold start's progress (``<workdir>/warmup``), replaced atomically (refused when a
        parameter or a value of its optimizer state is not finite)."""
        check_finite(params, f"{self.warmup_path} at warm-up step {step} (not written)")
        check_finite(opt_state, f"{self.warmup_path} at warm-up step {step} (not written): the optimizer state's")
        ensure_space((params, opt_state), self.workdir, f"{self.warmup_path} at warm-up step {step}")
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
        """``(params, opt_state, progress)`` of a saved cold start, or ``None``."""
        if not (self.warmup_path / "progress.json").exists():
            return None
        progress = json.loads((self.warmup_path / "progress.json").read_text())
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, {"params": like_params, "opt_state": like_opt_state})
        state = ocp.StandardCheckpointer().restore(self.warmup_path / "state", abstract)
        check_finite(state["params"], str(self.warmup_path))
        return state["params"], state["opt_state"], progress

    def close(self) -> None:
        self.manager.close()


# the settings that fix what a checkpoint holds: a resume that changes one of them is refused
RUN_DEFINING = ("model.", "rl.kl_coef")
# model settings that change how the same parameters are computed, not what they are
RUNTIME_ONLY = {"model.remat", "model.attention_impl", "model.attention_chunk", "model.scan_unroll", "model.dtype"}


def check_run_config(workdir: pathlib.Path, config) -> None:
    """``<workdir>/config.json``: written when the run starts (no checkpoint yet); on a resume, a model or
    ``rl.kl_coef`` setting that differs from it is a ``CheckpointError`` naming the field and both values."""
    path = pathlib.Path(workdir) / "config.json"
    resuming = any(p.name.isdigit() for p in (pathlib.Path(workdir) / "checkpoints").glob("*"))
    if resuming and path.exists():
        _compare_run_config(path, config, RUN_DEFINING, "resume it with the same setting or use a new --workdir")
    elif distributed.is_primary():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(json.loads(config.to_json_best_effort()), indent=2, sort_keys=True))


# what a read-only tool (evaluation, export) must take as the run had it: the model and how its trees were trained
READ_DEFINING = ("model.", "warmup.train_base", "warmup.steps")


def check_saved_config(workdir: pathlib.Path, config, tool: str) -> None:
    """For a tool that reads a trained work directory (``tool``: its name): every setting that defines the saved
    trees (``READ_DEFINING``) must be the run's, read from ``<workdir>/config.json``; a conflicting flag is a
    ``CheckpointError`` naming the field, both values and the file. Nothing is written."""
    path = pathlib.Path(workdir) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{path}: missing, so the run's settings cannot be checked; {tool} refuses to guess")
    _compare_run_config(path, config, READ_DEFINING, f"give {tool} the run's setting (its config and --config flags)")


def _compare_run_config(path: pathlib.Path, config, defining: tuple, advice: str) -> None:
    then = flatten(json.loads(path.read_text()), sep=".")
    for field, value in flatten(json.loads(config.to_json_best_effort()), sep=".").items():
        if field.startswith(defining) and field not in RUNTIME_ONLY and then.get(field, value) != value:
            raise CheckpointError(f"{path}: this run started with {field}={then[field]!r}, not {value!r}; {advice}")


class WorkdirInUse(RuntimeError):
    """Another live run holds the work directory."""


def _lock(path: pathlib.Path, what: str):
    """An exclusive ``flock`` on ``path`` (its file handle), or ``WorkdirInUse`` naming the holder."""
    handle = open(path, "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise WorkdirInUse(f"{what} is in use by {holder}; wait for that run to end or use another --workdir") from None
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}: {what}\n")
    handle.flush()
    return handle


class WorkdirLock:
    """Exclusive ``flock`` s for the life of a run: on ``<workdir>/run.lock`` (seen by every machine that
    shares the file system) and on a file of this machine's temporary directory named after the work
    directory's resolved path (links and ``..`` followed: every spelling of one directory is one lock), which
    deleting the work directory does not remove: a second run on the same
    path fails at once, naming the holder, even after an ``rm -rf`` of the directory under the first. The
    kernel drops the locks of a killed process, so stale lock files are simply taken over. In a
    multi-process run the primary process holds them for all of them."""

    def __init__(self, workdir: pathlib.Path):
        workdir = pathlib.Path(workdir).resolve()  # LINK/wd, wd/../x/../wd and wd: one directory, one lock
        self.path = workdir / "run.lock"
        key = hashlib.sha256(str(workdir).encode()).hexdigest()[:24]
        self.local = pathlib.Path(tempfile.gettempdir()) / f"mtrl_jax-locks-{os.getuid()}" / f"{key}.lock"
        self.what = f"the work directory {workdir}"
        self.files = []

    def acquire(self) -> "WorkdirLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if not distributed.is_primary():
            return self
        self.local.parent.mkdir(mode=0o700, exist_ok=True)
        try:
            for path in (self.local, self.path):
                self.files.append(_lock(path, self.what))
        except WorkdirInUse:
            self.release()
            raise
        return self

    def release(self) -> None:
        for handle in self.files:
            fcntl.flock(handle, fcntl.LOCK_UN)
            handle.close()
        self.files = []

    def __enter__(self):
        return self.acquire()

    def __exit__(self, *exc):
        self.release()
