"""95% confidence intervals for the figures the project reports, and paired comparisons.

Two cases, by what a result holds:

* **per-query scores of several seeds** (a ``seeds x queries`` matrix, as an evaluation's trajectories give):
  a two-way bootstrap that resamples the seeds and, independently, the queries (the crossed design of
  "which training runs" and "which queries"), through ``scipy.stats.bootstrap`` with each axis an
  independent sample: the interval covers both the seed-to-seed spread and the finite query set;
* **one figure per seed** (a vector): Student's t interval (``scipy.stats.t``). A percentile bootstrap of
  3 to 5 values has far below its nominal coverage (it cannot reach past the extreme seeds), so seed-only
  figures use t.

A *paired* comparison (the same seeds, the same queries: an ablation's arms, a policy against a baseline on
the same queries) takes the interval of the differences, ``a - b`` cell by cell; it is "separated" only when
that interval excludes 0, and "not resolved" otherwise. docs/decisions.md says why scipy and not rliable.
"""

from __future__ import annotations

import dataclasses

import numpy as np

CONFIDENCE = 0.95
RESAMPLES = 4000


@dataclasses.dataclass(frozen=True)
class Interval:
    """A mean, its 95% interval ``[low, high]``, how many seeds and queries it stands on, and how it was made."""

    mean: float
    low: float
    high: float
    seeds: int
    queries: int  # 0: one figure per seed, no per-query scores
    method: str  # "bootstrap-2way", "bootstrap-queries" (one seed) or "t" (one figure per seed)

    @property
    def excludes_zero(self) -> bool:
        return self.low > 0 or self.high < 0

    def to_json(self) -> dict:
        return {
            "mean": self.mean,
            "ci95": [self.low, self.high],
            "n": {"seeds": self.seeds, "queries": self.queries},
            "method": self.method,
        }

    def text(self, digits: int = 3) -> str:
        """``0.612 [0.571, 0.650] (n = 5 seeds x 200 queries)``: the form every reported figure takes."""
        n = f"{self.seeds} seed" + ("s" if self.seeds != 1 else "")
        n += f" x {self.queries} queries" if self.queries else ""
        return f"{self.mean:.{digits}f} [{self.low:.{digits}f}, {self.high:.{digits}f}] (n = {n})"


def interval(scores, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """The mean of ``scores`` and its interval: a ``[seeds]`` vector (Student's t) or a ``[seeds, queries]``
    matrix (two-way percentile bootstrap over seeds and queries, ``resamples`` draws, seeded)."""
    from scipy import stats

    x = np.asarray(scores, dtype=np.float64)
    if x.ndim not in (1, 2) or x.size == 0 or not np.all(np.isfinite(x)):
        raise ValueError(f"scores must be a finite, non-empty [seeds] or [seeds, queries] array, got shape {x.shape}")
    mean = float(x.mean())
    if x.ndim == 1:
        n = len(x)
        if n < 2 or np.ptp(x) == 0:  # one seed, or no spread: nothing to say beyond the mean itself
            return Interval(mean, mean if n > 1 else -np.inf, mean if n > 1 else np.inf, n, 0, "t")
        low, high = stats.t.interval(confidence, n - 1, loc=mean, scale=stats.sem(x))
        return Interval(mean, float(low), float(high), n, 0, "t")
    seeds, queries = x.shape
    if queries == 1:
        return interval(x[:, 0], confidence, resamples, seed)
    if np.ptp(x) == 0:
        return Interval(mean, mean, mean, seeds, queries, "bootstrap-2way")
    if seeds == 1:  # one run: the queries alone are resampled
        ci = stats.bootstrap(
            (x[0],),
            np.mean,
            n_resamples=resamples,
            confidence_level=confidence,
            method="percentile",
            random_state=np.random.default_rng(seed),
        ).confidence_interval
        return Interval(mean, float(ci.low), float(ci.high), 1, queries, "bootstrap-queries")

    def statistic(seed_index, query_index, axis=-1):  # each: [n] or [batch, n] indices, resampled by scipy
        s, q = np.asarray(seed_index, dtype=np.intp), np.asarray(query_index, dtype=np.intp)
        row_means = x[:, q].mean(axis=-1)  # [seeds] or [seeds, batch]: each seed's mean over the drawn queries
        if s.ndim == 1:
            return row_means[s].mean()
        return np.take_along_axis(row_means.T, s, axis=-1).mean(axis=-1)

    result = stats.bootstrap(
        (np.arange(seeds), np.arange(queries)),
        statistic,
        vectorized=True,
        paired=False,
        n_resamples=resamples,
        confidence_level=confidence,
        method="percentile",
        random_state=np.random.default_rng(seed),
    )
    ci = result.confidence_interval
    return Interval(mean, float(ci.low), float(ci.high), seeds, queries, "bootstrap-2way")


def paired(a, b, confidence: float = CONFIDENCE, resamples: int = RESAMPLES, seed: int = 0) -> Interval:
    """The interval of ``a - b``, cell by cell: the same seeds (rows) and queries (columns) in both."""
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        raise ValueError(f"a paired comparison needs the same seeds and queries on both sides: {a.shape} vs {b.shape}")
    return interval(a - b, confidence, resamples, seed)


def verdict(diff: Interval) -> str:
    """ "separated" when the paired interval excludes 0, else "not resolved"."""
    return "separated" if diff.excludes_zero else "not resolved"
