"""Orbax checkpoints of a run: the ``TrainState`` with a typed run record, and the KL reference.

``<workdir>/checkpoints/<rl_step>/`` holds ``state`` (params, optimizer state, optimizer step, RNG)
and ``record`` (``RunRecord`` as JSON: RL step, data cursor, staleness counters, the validation
metrics before RL). ``<workdir>/reference/`` holds the KL reference policy, written once.
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

from mtrl_jax.data.schedule import DataCursor
from mtrl_jax.rl.train_step import TrainState


@dataclasses.dataclass
class RunRecord:
    """The host-side state saved next to the ``TrainState``."""

    rl_step: int = 0  # RL steps done
    cursor: DataCursor = DataCursor()  # where the next RL step's tasks start
    dropped_groups: int = 0  # groups filtered as too stale, over the run
    max_staleness_seen: int = 0
    before: Optional[dict] = None  # validation metrics of the policy RL started from

    def to_json(self) -> dict:
        return {"rl_step": self.rl_step, "cursor": self.cursor.to_json(), "before": self.before,
                "staleness": {"dropped_groups": self.dropped_groups, "max_seen": self.max_staleness_seen}}

    @classmethod
    def from_json(cls, record: Any, source: str) -> "RunRecord":
        try:
            return cls(rl_step=int(record["rl_step"]), cursor=DataCursor.from_json(record["cursor"], source),
                       dropped_groups=int(record["staleness"]["dropped_groups"]),
                       max_staleness_seen=int(record["staleness"]["max_seen"]), before=record["before"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: malformed run record ({e!r})") from None


def abstract_state(tx, params, rng) -> TrainState:
    """Shapes and dtypes of the ``TrainState`` for ``params`` and optimizer ``tx`` (nothing allocated)."""
    import jax.numpy as jnp

    return jax.eval_shape(lambda p, r: TrainState(p, tx.init(p), jnp.zeros((), jnp.int32), r), params, rng)


class Checkpoints:
    """The checkpoints of one work directory."""

    def __init__(self, workdir: pathlib.Path, keep: int = 2):
        self.workdir = pathlib.Path(workdir).absolute()
        self.manager = ocp.CheckpointManager(self.workdir / "checkpoints",
                                             options=ocp.CheckpointManagerOptions(max_to_keep=keep, create=True))

    def latest_step(self) -> Optional[int]:
        return self.manager.latest_step()

    def save(self, state: TrainState, record: RunRecord) -> None:
        """Write checkpoint ``record.rl_step`` and wait until it is on disk."""
        self.manager.save(record.rl_step, force=True, args=ocp.args.Composite(
            state=ocp.args.StandardSave(state._asdict()), record=ocp.args.JsonSave(record.to_json())))
        self.manager.wait_until_finished()

    def restore(self, like: TrainState) -> Optional[tuple[TrainState, RunRecord]]:
        """The latest checkpoint restored onto the shapes, dtypes and shardings of ``like`` (arrays
        or ``jax.ShapeDtypeStruct``), or ``None`` when there is none."""
        step = self.latest_step()
        if step is None:
            return None
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like._asdict())
        restored = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                      record=ocp.args.JsonRestore()))
        record = RunRecord.from_json(restored["record"], str(self.workdir / "checkpoints" / str(step)))
        return TrainState(**restored["state"]), record

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
            raise FileNotFoundError(f"{self.reference_path}: rl.kl_coef is set but this run has no KL reference policy "
                                    "(it started with rl.kl_coef=0); resume it with rl.kl_coef=0 or use a new workdir")
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, like)
        return ocp.StandardCheckpointer().restore(self.reference_path, abstract)

    def close(self) -> None:
        self.manager.close()
