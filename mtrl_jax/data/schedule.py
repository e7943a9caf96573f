"""The training task schedule: a seeded shuffle per epoch, consumed ``batch_size`` prompts at a time.

The position in it is a ``DataCursor`` (epoch, index into that epoch's shuffled order, shuffle
seed). The cursor is saved with every checkpoint and read back on resume, so a resumed run continues
with exactly the tasks it had not trained on yet, whatever ``global_batch_size`` it resumes with.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from mtrl_jax import rng


@dataclasses.dataclass(frozen=True)
class DataCursor:
    epoch: int = 0
    index: int = 0  # into the epoch's shuffled order
    shuffle_seed: int = 0

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, record: dict, source: str) -> "DataCursor":
        try:
            cursor = cls(**{k: int(record[k]) for k in ("epoch", "index", "shuffle_seed")})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{source}: malformed data cursor {record!r} ({e})") from None
        if cursor.epoch < 0 or cursor.index < 0:
            raise ValueError(f"{source}: negative data cursor {record!r}")
        return cursor


class TaskSchedule:
    """``batch_size`` tasks per step from a per-epoch shuffle of ``tasks``; an epoch's remainder of
    fewer than ``batch_size`` tasks is skipped (every step trains on a full batch of prompts)."""

    def __init__(self, tasks: Sequence, batch_size: int):
        if batch_size < 1:
            raise ValueError(f"global_batch_size must be >= 1, got {batch_size}")
        if len(tasks) < batch_size:
            raise ValueError(f"global_batch_size={batch_size} is more than the {len(tasks)} training tasks")
        self.tasks, self.batch_size = list(tasks), batch_size

    @property
    def steps_per_epoch(self) -> int:
        return len(self.tasks) // self.batch_size

    def _aligned(self, cursor: DataCursor) -> DataCursor:
        if cursor.index + self.batch_size > len(self.tasks):
            return DataCursor(cursor.epoch + 1, 0, cursor.shuffle_seed)
        return cursor

    def batch(self, cursor: DataCursor) -> list:
        """The tasks of the step that starts at ``cursor``."""
        cursor = self._aligned(cursor)
        order = np.random.default_rng(rng.numpy_seed(cursor.shuffle_seed, "schedule", cursor.epoch)).permutation(
            len(self.tasks)
        )
        return [self.tasks[i] for i in order[cursor.index : cursor.index + self.batch_size]]

    def advance(self, cursor: DataCursor, steps: int = 1) -> DataCursor:
        """The cursor ``steps`` steps after ``cursor``."""
        for _ in range(steps):
            cursor = self._aligned(cursor)
            cursor = DataCursor(cursor.epoch, cursor.index + self.batch_size, cursor.shuffle_seed)
        return cursor
