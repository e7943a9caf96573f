"""The few shapes the sampler's calls take: an extend call's lines (``call_lines``), the windows of cache slots
a call attends to (``windows``, ``window_for``), and the token counts an extend call returns (``ExtendCounts``)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class ExtendCounts:
    """What ``Sampler.extend`` appended: real tokens computed, tokens computed (padding included), and
    tokens copied from a cached prefix instead of computed. Counts of several calls add up."""

    extended: int = 0
    computed: int = 0
    shared: int = 0

    def __add__(self, other: "ExtendCounts") -> "ExtendCounts":
        return ExtendCounts(self.extended + other.extended, self.computed + other.computed, self.shared + other.shared)

    def fractions(self) -> dict:
        """The share of the computed tokens that were real (not padding), and the share of the tokens
        appended to the cache that were copied from a cached prefix instead of computed."""
        return {
            "extend_useful_fraction": self.extended / max(self.computed, 1),
            "extend_shared_fraction": self.shared / max(self.extended + self.shared, 1),
        }


def bucket_length(n: int, minimum: int = 16) -> int:
    """Smallest power of two >= max(n, minimum): the padded block length for ``extend``."""
    return max(minimum, 1 << max(0, int(n) - 1).bit_length())


def call_lines(pieces: int, max_lines: int, fill: float) -> list[int]:
    """The line counts of the ``extend`` calls that take ``pieces`` pieces, in order (each a power
    of two >= 8, at most ``max_lines``, itself a power of two). A call takes as many pieces as it
    has lines; the last call's extra lines are padding. Where padding the rest up to one power of
    two would leave less than ``fill`` of the lines useful, the largest power of two below goes
    first and the rest is planned again, if that computes fewer lines in all: e.g. 40 pieces are
    32 + 8 lines at ``fill`` 0.75, not 64. The calls use the same few shapes; only their number
    grows. ``fill`` 0: one padded call per ``max_lines`` pieces."""
    if pieces <= 0:
        return []
    lines = min(max_lines, bucket_length(pieces, 8))
    if lines > 8 and pieces < fill * lines:  # first a power of two below `pieces` (every line useful), then the rest
        split = [lines // 2] + call_lines(pieces - lines // 2, max_lines, fill)
        if sum(split) < lines:  # fewer lines in all (not so for 16 lines: 8 + 8)
            return split
    return [lines] + call_lines(pieces - lines, max_lines, fill)


def windows(max_len: int, at_least: int = 0, fine: bool = False) -> list[int]:
    """The attention windows calls use: powers of two >= 64 (and >= ``at_least``'s window) below
    ``max_len``, and ``max_len``; ``fine`` adds 1.5x each power of two (64, 96, 128, 192, 256, 384,
    ...), two windows an octave: a decode call reads at most a third more slots than it needs,
    not twice as many, for one more program per octave."""
    out, w = [], 64
    while w < max_len:
        out += [w] + ([w * 3 // 2] if fine and w * 3 // 2 < max_len else [])
        w *= 2
    return [x for x in out if x >= min(max(at_least, 1), max_len)] + [max_len]


def window_for(reach: int, max_len: int, fine: bool = False) -> int:
    """The smallest of ``windows(max_len, fine=fine)`` that holds ``reach`` slots."""
    return next(w for w in windows(max_len, fine=fine) if w >= min(reach, max_len))
