"""``TrajectoryBatch``: trajectories as padded ``[B, T]`` arrays, ``T`` bucketed; the one pad/bucket helper."""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

import flax.struct
import numpy as np

from mtrl_jax.rl.turn_credit import TurnCreditConfig, TurnRewards, turn_arrays

REWARD_BASELINES = ("none", "one_search")  # rl.reward_baseline: what make_batch's reward_offset holds


@flax.struct.dataclass
class TrajectoryBatch:
    """A pytree of arrays; ``group_size`` is static (the batch is ``P x G``, groups contiguous)."""

    tokens: np.ndarray  # [B, T] int32, right-padded
    attention_mask: np.ndarray  # [B, T] int32, 1 = real token
    loss_mask: np.ndarray  # [B, T] float32, 1 = sampled by the policy
    behav_logp: np.ndarray  # [B, T] float32, 0 off the loss mask
    reward: np.ndarray  # [B] float32
    group_size: int = flax.struct.field(pytree_node=False, default=1)
    turns: Optional[TurnRewards] = None  # the search turns' rewards, with per-search credit (rl.turn_reward)

    @property
    def shape(self):
        return self.tokens.shape


def bucket(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (at least one multiple)."""
    return max(multiple, -(-length // multiple) * multiple)


def pad_rows(sequences: Sequence[Sequence], length: int, dtype, fill=0) -> np.ndarray:
    """``[len(sequences), length]`` array, each sequence right-padded with ``fill``."""
    out = np.full((len(sequences), length), fill, dtype)
    for i, seq in enumerate(sequences):
        out[i, : len(seq)] = seq
    return out


def make_batch(
    trajectories: Sequence,
    group_size: int,
    length_bucket: int = 128,
    pad_id: int = 0,
    length: Optional[int] = None,
    no_gradient: Sequence[int] = (),
    turn_credit: Optional[TurnCreditConfig] = None,
    reward_offset: Optional[Mapping[str, float]] = None,
) -> TrajectoryBatch:
    """Pad ``trajectories`` (P x G, groups contiguous) to ``T = length``, or, without one, to the
    longest rounded up to a multiple of ``length_bucket``. The trainer passes the context length
    (rounded), so every update has the same shape and compiles once; the update computes each
    micro-batch at its own length (``train_step.switch_on_length``), so the padding costs nothing.
    The rows ``no_gradient`` keep their reward (their group's baseline) with an all-zero loss mask. With
    ``turn_credit`` the batch carries its search turns' rewards (``turn_credit.turn_arrays``). With
    ``reward_offset`` (``{task_id: value}``, ``rl.reward_baseline``) each trajectory's reward is its reward minus
    its task's value: the records keep the reward itself."""
    if not trajectories or len(trajectories) % group_size:
        raise ValueError(f"{len(trajectories)} trajectories do not form groups of {group_size}")
    longest = max(len(t.tokens) for t in trajectories)
    T = bucket(longest, length_bucket) if length is None else length
    if longest > T:
        raise ValueError(f"a trajectory of {longest} tokens does not fit the batch length {T}")
    masked = set(no_gradient)
    offset = (lambda task_id: reward_offset[task_id]) if reward_offset else (lambda task_id: 0)  # noqa: E731
    return TrajectoryBatch(
        tokens=pad_rows([t.tokens for t in trajectories], T, np.int32, pad_id),
        attention_mask=pad_rows([[1] * len(t.tokens) for t in trajectories], T, np.int32),
        loss_mask=pad_rows(
            [[0] * len(t.tokens) if i in masked else t.loss_mask for i, t in enumerate(trajectories)], T, np.float32
        ),
        behav_logp=pad_rows([t.behav_logp for t in trajectories], T, np.float32),
        reward=np.array([t.reward - offset(t.task_id) for t in trajectories], np.float32),
        group_size=group_size,
        turns=None if turn_credit is None else turn_arrays(trajectories, T, turn_credit),
    )
