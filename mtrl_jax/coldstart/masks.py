"""Loss masks of multi-turn trajectories read as turns: the runs of ones are the assistant's turns."""

from __future__ import annotations

import itertools
from typing import Sequence


def decision_untrained(mask: Sequence[int]) -> list[int]:
    """``mask`` with no loss on the second assistant turn's first token: the choice between a second
    search and an answer (a hop drill's hop is forced, so that choice is not the teacher's)."""
    mask = list(mask)
    start = mask.index(1, turn_end(mask, 1))
    mask[start] = 0
    return mask


def turn_end(mask: Sequence[int], turns: int) -> int:
    """Index just past the ``turns``-th run of assistant tokens (the whole length when there are fewer)."""
    end, seen = 0, 0
    mask = list(mask)
    while seen < turns:
        try:
            end = mask.index(1, end)
        except ValueError:
            return len(mask)
        while end < len(mask) and mask[end] == 1:
            end += 1
        seen += 1
    return end


def turn_lengths(mask: Sequence[int]) -> list[int]:
    """The tokens of each assistant turn, in order (the runs of loss-mask ones, each end token included)."""
    return [sum(1 for _ in run) for trained, run in itertools.groupby(mask) if trained]


def longest_turn(mask: Sequence[int]) -> int:
    """The tokens of the longest assistant turn (0 without one)."""
    return max(turn_lengths(mask), default=0)


def last_turn(mask: Sequence[int]) -> int:
    """The tokens of the last assistant turn (the answer of a finished demonstration; 0 without one)."""
    return (turn_lengths(mask) or [0])[-1]


def assistant_turns(mask: Sequence[int]) -> int:
    return sum(1 for i, m in enumerate(mask) if m == 1 and (i == 0 or mask[i - 1] == 0))
