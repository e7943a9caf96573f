"""Per-search credit (``rl.turn_reward="retrieval_gain"``): each search turn's own reward, folded into
token-level advantages beside the trajectory's (docs/algorithms.md, "Per-search credit").

The environment records, for every turn whose search calls returned documents, ``retrieval_gain`` (how much
the nDCG@10 of the best ranking of every document seen so far rose with this turn's results) and
``repeated_docs`` (the fraction of this turn's results that an earlier turn had already shown). A search
turn's reward is ``retrieval_gain - redundancy * repeated_docs``; a turn without one (the answer, a call that
failed) has none. Then, per group (every search turn of its ``G`` trajectories pooled, as DeepSeekMath's
process supervision normalises its step rewards):

    r~ = (r - mean) / (max(std, std_floor) + 1e-6)      (std with ddof 1; a group with one reward: std 0)
    turn_adv[k] = sum_{k' >= k} gamma^(k' - k) r~[k']   (over the search turns at or after turn k)
    adv[t] = trajectory_adv + coef * turn_adv[turn of token t]

so a token is credited with the normalised search gains that its turn and the turns after it earned. Every
registered loss and estimator takes it unchanged: the estimator gives the trajectory's part, the losses take
``[B, T]`` advantages. A group whose search-turn rewards are all equal gets exactly 0 from this term (the
rewards are shifted by their group's largest first, as the estimators do).

The host side (``turn_rewards``, ``token_turns``, ``turn_arrays``) runs in ``make_batch``; the device side
(``normalized``, ``returns``, ``token_advantages``) in the jitted update."""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

EPS = 1e-6
TURN_REWARDS = ("none", "retrieval_gain")  # rl.turn_reward


@dataclasses.dataclass(frozen=True)
class TurnCreditConfig:
    """Static (hashable) settings of per-search credit; ``UpdateConfig.turn_credit`` is None when it is off.
    The ranges of the ``rl.turn_*`` fields are checked with every other field's (``mtrl_jax.ranges``)."""

    max_turns: int  # K: env.max_turns, the turns a trajectory can have
    coef: float = 1.0  # rl.turn_coef: weight of the turn advantage beside the trajectory's
    gamma: float = 1.0  # rl.turn_gamma: discount over later search turns
    redundancy: float = 0.5  # rl.turn_redundancy: penalty per unit of repeated_docs
    std_floor: float = 0.1  # rl.turn_std_floor: the normaliser's floor (as grpo's std_floor)


@flax.struct.dataclass
class TurnRewards:
    """A batch's search-turn rewards (``TrajectoryBatch.turns``)."""

    reward: np.ndarray  # [B, K] float32, 0 where valid is 0
    valid: np.ndarray  # [B, K] float32, 1 = a search turn with a reward
    token_turn: np.ndarray  # [B, T] int32: the assistant turn that sampled each token, -1 for any other token


# ----------------------------------------------------------------------------- host side


def turn_rewards(turns: Sequence[dict], redundancy: float) -> list[Optional[float]]:
    """Each turn's reward: ``retrieval_gain - redundancy * repeated_docs`` for a search turn, None otherwise."""
    return [t["retrieval_gain"] - redundancy * t["repeated_docs"] if "retrieval_gain" in t else None for t in turns]


def token_turns(loss_mask: Sequence[int]) -> list[int]:
    """The assistant turn of each token: the k-th run of sampled tokens is turn k (a turn's tokens are sampled
    without a break, and a prompt or tool block separates two turns); -1 for a token not sampled."""
    out, turn, previous = [], -1, 0
    for m in loss_mask:
        if m and not previous:
            turn += 1
        out.append(turn if m else -1)
        previous = m
    return out


def empty_turn_rewards(rows: int, length: int, max_turns: int) -> TurnRewards:
    """``TurnRewards`` of ``rows`` trajectories without a search turn: ``turn_arrays``' shapes and dtypes."""
    zeros = np.zeros((rows, max_turns), np.float32)
    return TurnRewards(zeros, zeros.copy(), np.full((rows, length), -1, np.int32))


def turn_arrays(trajectories: Sequence, length: int, cfg: TurnCreditConfig) -> TurnRewards:
    """The ``TurnRewards`` of ``trajectories`` padded to ``[B, cfg.max_turns]`` and ``[B, length]``."""
    K = cfg.max_turns
    empty = empty_turn_rewards(len(trajectories), length, K)
    reward, valid, token_turn = empty.reward, empty.valid, empty.token_turn
    for i, t in enumerate(trajectories):
        owner = token_turns(t.loss_mask)
        # a turn cut off by the context limit never reached the environment: its tokens have a turn, it no record
        if max(owner, default=-1) >= K or len(t.turns) > K:
            raise ValueError(
                f"trajectory {t.task_id!r} (sample {t.sample_index}) has {max(len(t.turns), max(owner) + 1)} turns, "
                f"more than env.max_turns = {K}"
            )
        token_turn[i, : len(owner)] = owner
        for k, r in enumerate(turn_rewards(t.turns, cfg.redundancy)):
            if r is not None:
                reward[i, k], valid[i, k] = r, 1.0
    return TurnRewards(reward, valid, token_turn)


def rewards_vary(group: Sequence, redundancy: float) -> bool:
    """Whether the search-turn rewards of ``group`` differ (its turn advantages are not all 0)."""
    return len({r for t in group for r in turn_rewards(t.turns, redundancy) if r is not None}) > 1


# ----------------------------------------------------------------------------- device side (jitted)


def normalized(reward: jax.Array, valid: jax.Array, group_size: int, std_floor: float) -> jax.Array:
    """``[B, K]``: each valid turn reward minus its group's mean (over every valid turn of the group's ``G`` rows),
    over ``max(std, std_floor) + 1e-6`` (ddof 1; fewer than two rewards: std 0); 0 where not valid."""
    B, K = reward.shape
    r = reward.astype(jnp.float32).reshape(-1, group_size * K)
    v = valid.astype(jnp.float32).reshape(-1, group_size * K) > 0
    n = v.sum(axis=1, keepdims=True).astype(jnp.float32)
    top = jnp.where(v, r, -jnp.inf).max(axis=1, keepdims=True)
    shifted = jnp.where(v, r - jnp.where(n > 0, top, 0.0), 0.0)  # all-equal groups: exactly 0 from here on
    centred = jnp.where(v, shifted - shifted.sum(axis=1, keepdims=True) / jnp.maximum(n, 1.0), 0.0)
    std = jnp.where(n > 1, jnp.sqrt((centred**2).sum(axis=1, keepdims=True) / jnp.maximum(n - 1.0, 1.0)), 0.0)
    return (centred / (jnp.maximum(std, std_floor) + EPS)).reshape(B, K)


def returns(rewards: jax.Array, gamma: float) -> jax.Array:
    """``[B, K]``: ``sum_{k' >= k} gamma^(k' - k) rewards[:, k']`` (a reverse scan over the turns)."""

    def back(later, r):
        now = r + gamma * later
        return now, now

    _, out = jax.lax.scan(back, jnp.zeros(rewards.shape[:1], rewards.dtype), rewards.T, reverse=True)
    return out.T


def token_advantages(
    trajectory_adv: jax.Array, turns: TurnRewards, group_size: int, cfg: TurnCreditConfig
) -> tuple[jax.Array, jax.Array]:
    """``(advantages [B, T], turn advantages [B, K])``: ``trajectory_adv [B]`` plus ``cfg.coef`` times the turn
    advantage of the turn that sampled each token (0 for a token no turn sampled)."""
    turn_adv = returns(normalized(turns.reward, turns.valid, group_size, cfg.std_floor), cfg.gamma)
    padded = jnp.pad(turn_adv, ((0, 0), (0, 1)))  # column K: the tokens of no turn
    index = jnp.where(turns.token_turn >= 0, turns.token_turn, turn_adv.shape[1])
    per_token = jnp.take_along_axis(padded, index, axis=1)
    return trajectory_adv[:, None] + cfg.coef * per_token, turn_adv
