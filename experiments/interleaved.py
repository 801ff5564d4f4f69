"""Several systems' timed operations, measured interleaved: repeat r of every system's operation
before repeat r + 1 of any (A B A B ...), so that what the machine does meanwhile (another
process, a frequency change, the page cache) falls on every system alike.

  times = interleaved.run({'a': {'prefill': f, 'decode': g}, 'b': {'prefill': h}}, repeats=5)
  times['a']['prefill']  -> [seconds of each timed repeat]

A ratio of two systems is taken repeat by repeat (repeat r of A against repeat r of B, measured
seconds apart) and summarized by its median and spread (`paired`); a system's own figure by
its median and spread (`summary`). On a shared 2-core VM whose timings move by 15-20% between
runs, block measurement (every repeat of A, then every repeat of B) let that drift into the
ratios; paired repeats cancel what the two share.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

Ops = dict[str, Callable[[], object]]


def run(systems: dict[str, Ops], repeats: int, warmup: int = 1,
        log: Callable[[str], None] | None = None) -> dict[str, dict[str, list[float]]]:
  """Times every system's operations `repeats` times, interleaved.

  Args:
    systems: system name -> {operation name -> a closure to time}. Operations are taken in the
      order they are first named; within an operation, systems in the order given.
    repeats: timed runs of each (system, operation).
    warmup: untimed runs of each first (compilation, first touch), interleaved the same way.
    log: called with a line after each repeat (progress).

  Returns:
    system -> operation -> the seconds of each timed run, in repeat order.
  """
  names = list(dict.fromkeys(op for ops in systems.values() for op in ops))
  times = {system: {op: [] for op in ops} for system, ops in systems.items()}
  for r in range(warmup + repeats):
    for op in names:
      for system, ops in systems.items():
        if op not in ops:
          continue
        start = time.perf_counter()
        ops[op]()
        seconds = time.perf_counter() - start
        if r >= warmup:
          times[system][op].append(seconds)
    if log is not None:
      log(f'{"warm-up" if r < warmup else "repeat"} {r + 1 - (warmup if r >= warmup else 0)} of '
          f'{warmup if r < warmup else repeats} done')
  return times


def summary(seconds: list[float]) -> dict:
  """{'median_s', 'min_s', 'max_s', 'spread'}: spread = (max - min) / median."""
  median = statistics.median(seconds)
  return {'median_s': median, 'min_s': min(seconds), 'max_s': max(seconds),
          'spread': (max(seconds) - min(seconds)) / median if median else 0.0}


def paired(numerator: list[float], denominator: list[float]) -> dict:
  """The ratio numerator[r] / denominator[r] of each repeat: {'median', 'min', 'max',
  'spread'} (spread = (max - min) / median), and each repeat's under 'by_repeat'."""
  if len(numerator) != len(denominator) or not numerator:
    raise ValueError(f'paired ratios need repeats of equal count, not {len(numerator)} and '
                     f'{len(denominator)}')
  ratios = [a / b for a, b in zip(numerator, denominator)]
  median = statistics.median(ratios)
  return {'median': median, 'min': min(ratios), 'max': max(ratios),
          'spread': (max(ratios) - min(ratios)) / median if median else 0.0,
          'by_repeat': ratios}
