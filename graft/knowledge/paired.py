"""Paired comparisons of two conditions on the same problems: is the difference real?

Each problem is answered under both conditions (base and library), so the comparison is paired:
`bootstrap_ci` resamples problems (not answers) to give a percentile interval for the accuracy
difference, and `mcnemar_exact` tests whether the discordant problems (solved by one condition
only) split evenly, with the exact binomial distribution (no normal approximation: the counts
are small).
"""

from __future__ import annotations

import math

import numpy as np


def _check(base: list[bool], other: list[bool]) -> None:
  if len(base) != len(other):
    raise ValueError(f'paired conditions differ in length: {len(base)} and {len(other)}')


def delta(base: list[bool], other: list[bool]) -> float | None:
  """Accuracy of `other` minus accuracy of `base` (the same problems, in the same order)."""
  _check(base, other)
  return (sum(other) - sum(base)) / len(base) if base else None


def bootstrap_ci(base: list[bool], other: list[bool], *, level: float = 0.95,
                 resamples: int = 10_000, seed: int = 0) -> list[float] | None:
  """[low, high]: the percentile bootstrap interval of `delta`, problems resampled with
  replacement `resamples` times (seeded, so the interval is reproducible)."""
  _check(base, other)
  if not base:
    return None
  diff = np.asarray(other, np.float64) - np.asarray(base, np.float64)
  picks = np.random.default_rng(seed).integers(0, len(diff), (resamples, len(diff)))
  means = diff[picks].mean(axis=1)
  tail = (1 - level) / 2
  return [float(np.quantile(means, tail)), float(np.quantile(means, 1 - tail))]


def mcnemar_exact(base: list[bool], other: list[bool]) -> float | None:
  """The two-sided exact McNemar p-value: with b problems solved by `base` only and c by
  `other` only, 2 P(X <= min(b, c)) for X ~ Binomial(b + c, 1/2), at most 1 (1 when no
  problem is discordant)."""
  _check(base, other)
  if not base:
    return None
  b = sum(x and not y for x, y in zip(base, other))
  c = sum(y and not x for x, y in zip(base, other))
  n = b + c
  if n == 0:
    return 1.0
  tail = sum(math.comb(n, i) for i in range(min(b, c) + 1)) / 2 ** n
  return min(1.0, 2 * tail)
