"""``TrajectoryBatch``: trajectories as padded ``[B, T]`` device arrays, ``T`` bucketed."""

from __future__ import annotations

from typing import NamedTuple, Sequence

import numpy as np


class TrajectoryBatch(NamedTuple):
    tokens: np.ndarray  # [B, T] int32, right-padded
    attention_mask: np.ndarray  # [B, T] int32, 1 = real token
    loss_mask: np.ndarray  # [B, T] float32, 1 = sampled by the policy
    behav_logp: np.ndarray  # [B, T] float32, 0 off the loss mask
    reward: np.ndarray  # [B] float32
    group_size: int  # the batch is P x G, groups contiguous

    @property
    def shape(self):
        return self.tokens.shape


def bucket(length: int, multiple: int) -> int:
    return max(multiple, -(-length // multiple) * multiple)


def make_batch(trajectories: Sequence, group_size: int, length_bucket: int = 128, pad_id: int = 0) -> TrajectoryBatch:
    """Pad ``trajectories`` (P x G, groups contiguous) to ``T`` = the longest, rounded up to a
    multiple of ``length_bucket`` so the train step compiles a few shapes, not one per batch."""
    if not trajectories or len(trajectories) % group_size:
        raise ValueError(f"{len(trajectories)} trajectories do not form groups of {group_size}")
    B = len(trajectories)
    T = bucket(max(len(t.tokens) for t in trajectories), length_bucket)
    tokens = np.full((B, T), pad_id, np.int32)
    attention = np.zeros((B, T), np.int32)
    loss_mask = np.zeros((B, T), np.float32)
    behav = np.zeros((B, T), np.float32)
    for b, t in enumerate(trajectories):
        n = len(t.tokens)
        tokens[b, :n], attention[b, :n] = t.tokens, 1
        loss_mask[b, :n], behav[b, :n] = t.loss_mask, t.behav_logp
    reward = np.array([t.reward for t in trajectories], np.float32)
    return TrajectoryBatch(tokens, attention, loss_mask, behav, reward, group_size)
