"""Integer sizes of calls, chunks, tiles and buffers, each rule defined once.

Used by the numerics and the written arithmetic (`chunk_size`: how a contraction over K terms
is cut, which decides its bits), the kernels (block and padding sizes) and the engine's plans
(row buckets, cache slots). Bound into the pinned engines' fingerprints with the model's source
(graft.engine.fingerprint).
"""

from __future__ import annotations


def next_power_of_two(n: int) -> int:
  """The smallest power of two >= n (1 for n <= 1)."""
  return 1 << max(0, n - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
  """n rounded up to a multiple of `multiple`."""
  return -(-n // multiple) * multiple


def chunk_size(k: int, limit: int) -> int:
  """The largest divisor of k that is at most `limit`, preferring multiples of 8: the
  contraction chunk of a dot over k terms."""
  divisors = [d for d in range(1, min(k, limit) + 1) if k % d == 0]
  aligned = [d for d in divisors if d % 8 == 0]
  return max(aligned or divisors)
