"""IEEE-754 binary32 arithmetic in NumPy, independent of XLA: the interpreter's operations.

Every operation returns the binary32 result rounded to nearest even and then flushes a tiny
result to a zero of its sign (XLA:CPU runs with flush-to-zero and denormals-are-zero, and the
written arithmetic says so). Inputs are binary32 arrays that are already flushed. A result is
tiny when, rounded to 24 significant bits with an unbounded exponent, its magnitude is below
2^-126 (IEEE 754's tininess after rounding, which is what x86's MXCSR.FTZ does, measured): an
exact value in [2^-126 - 2^-150, 2^-126 - 2^-151) rounds to 2^-126 on the subnormal grid but is
flushed, so results that land on +-2^-126 are decided again at a scaled exponent (`_tiny`).

The fused multiply-add is emulated exactly: the product of two binary32 numbers is exact in
binary64 (48 significant bits), the binary64 sum p + c rounds once, and rounding that to binary32
can round twice only when the binary64 sum lands exactly on a binary32 midpoint; there the exact
error of the binary64 sum (TwoSum) decides the direction. `dot` is the sequential FMA chain of the
written arithmetic, `tree_sum` its pairwise row sum, `matmul` its contraction of a projection.
"""

from __future__ import annotations

import concurrent.futures
import functools
import os

import numpy as np
from numpy.typing import ArrayLike

from gemma_jax.sizes import chunk_size

F32, F64 = np.float32, np.float64
TINY = np.float32(2.0 ** -126)  # the smallest normal binary32 number


MIN_NORMAL_BITS = 0x00800000  # 2^-126
_SCALE = F64(2.0 ** 64)  # moves a result near 2^-126 into binary32's normal range, exactly


def _tiny(r: np.ndarray, exact) -> np.ndarray:
  """r with each +-2^-126 whose exact value `exact()` (binary64 operands of one correctly
  rounded binary32 result, scaled by 2^64: see _round_sum) rounds, at 24 bits, below 2^-126
  replaced by a zero of its sign."""
  edge = (r.view(np.int32) & 0x7FFFFFFF) == MIN_NORMAL_BITS
  if not edge.any():
    return r
  scaled = exact()
  tiny = edge & (np.abs(scaled) < F32(2.0 ** -62))
  return np.where(tiny, np.copysign(F32(0.0), r), r).astype(F32)


def flush(x: np.ndarray) -> np.ndarray:
  """Subnormal values as zeros of their sign (flush-to-zero); any shape, kept, as binary32."""
  x = np.asarray(x, F32)
  # Subnormal: |bits| in [1, 2^23 - 1], i.e. |bits| - 1 < 2^23 - 1 in uint32 (zeros wrap around
  # and are left alone: they are no work, and most arrays of the model hold some).
  magnitude = np.bitwise_and(x.view(np.uint32), np.uint32(0x7FFFFFFF))
  tiny = np.less(np.subtract(magnitude, np.uint32(1)), np.uint32(0x007FFFFF))
  if not tiny.any():
    return x
  return np.where(tiny, np.copysign(F32(0.0), x), x).astype(F32)


class Ops:
  """The operations of gemma_jax.spec.functions, on NumPy binary32 arrays."""

  @staticmethod
  def const(x: ArrayLike) -> np.ndarray | np.float32:
    """x as a binary32 value (a scalar stays a scalar). Elementwise over arrays of any
    shape."""
    values = np.asarray(x, F32)
    return values[()] if values.ndim == 0 else values


  @staticmethod
  def add(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """a + b, rounded to binary32, flushed. Elementwise over arrays of any shape."""
    with np.errstate(over='ignore', invalid='ignore'):
      return flush(np.add(a, b, dtype=F32))

  @staticmethod
  def sub(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """a - b, rounded to binary32, flushed. Elementwise over arrays of any shape."""
    return flush(np.subtract(a, b, dtype=F32))

  @staticmethod
  def mul(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """a * b, rounded once to binary32 (also below 2^-126), flushed. Elementwise over arrays of any shape."""
    with np.errstate(over='ignore'):
      r = flush(np.multiply(a, b, dtype=F32))
    # The binary64 product is exact; scaled, one rounding to binary32 is the unbounded one.
    return _tiny(r, lambda: (np.multiply(a, b, dtype=F64) * _SCALE).astype(F32))

  @staticmethod
  def div(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """a / b, rounded to binary32, flushed. Elementwise over arrays of any shape."""
    with np.errstate(divide='ignore', invalid='ignore', over='ignore'):
      r = flush(np.divide(a, b, dtype=F32))
      # A binary64 quotient rounded again: the unbounded rounding but where it lands exactly on
      # a binary32 midpoint (no such quotient has reached 2^-126 in any probe).
      return _tiny(r, lambda: (np.divide(a, b, dtype=F64) * _SCALE).astype(F32))

  @staticmethod
  def sqrt(a: ArrayLike) -> np.ndarray:
    """The square root of a, correctly rounded to binary32, flushed. Elementwise over arrays of any shape."""
    return flush(np.sqrt(a, dtype=F32))

  @staticmethod
  def neg(a: ArrayLike) -> np.ndarray:
    """-a (exact). Elementwise over arrays of any shape."""
    return np.negative(a, dtype=F32)

  @staticmethod
  def abs(a: ArrayLike) -> np.ndarray:
    """|a| (exact). Elementwise over arrays of any shape."""
    return np.abs(a).astype(F32)

  @staticmethod
  def min(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """The smaller of a and b (exact). Elementwise over arrays of any shape."""
    return np.minimum(a, b, dtype=F32)

  @staticmethod
  def max(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """The larger of a and b (exact). Elementwise over arrays of any shape."""
    return np.maximum(a, b, dtype=F32)

  @staticmethod
  def floor(a: ArrayLike) -> np.ndarray:
    """The largest integer <= a, as binary32 (exact). Elementwise over arrays of any shape."""
    return np.floor(a).astype(F32)

  @staticmethod
  def lt(a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """a < b (bool). Elementwise over arrays of any shape."""
    return np.less(a, b)

  @staticmethod
  def where(mask: ArrayLike, a: ArrayLike, b: ArrayLike) -> np.ndarray:
    """a where mask holds, else b. Elementwise over arrays of any shape."""
    return np.where(mask, a, b).astype(F32)

  @staticmethod
  def ldexp(y: ArrayLike, n: ArrayLike) -> np.ndarray:
    """y * 2^n for integer n, built from the exponent bits (flushed). Elementwise over arrays of any shape."""
    scale = ((np.asarray(n).astype(np.int32) + 127) << 23).astype(np.int32).view(F32)
    return flush(np.multiply(y, scale, dtype=F32))

  @staticmethod
  def quadrant(k: ArrayLike) -> np.ndarray:
    """k mod 4 of integer-valued k (the quadrant of a reduced angle), as integers. Elementwise over arrays of any shape."""
    return np.asarray(k).astype(np.int64) & 3


OPS = Ops()


def fma(a: ArrayLike, b: ArrayLike, c: ArrayLike) -> np.ndarray:
  """a * b + c, rounded once (binary32 arrays of any shape, broadcast), then flushed."""
  p = np.multiply(np.asarray(a, F64), np.asarray(b, F64))
  return _round_sum(p, np.asarray(c, F64))


def _round_sum(p: np.ndarray, c: np.ndarray) -> np.ndarray:
  """RN_binary32(p + c) for binary64 p (an exact product) and binary32-valued c, flushed when
  tiny (see the module doc)."""
  r = _round_sum_gradual(p, c)
  return _tiny(r, lambda: _round_sum_gradual(p * _SCALE, c * _SCALE, flushed=False))


def _round_sum_gradual(p: np.ndarray, c: np.ndarray, flushed: bool = True) -> np.ndarray:
  """RN_binary32(p + c) on binary32's grid (subnormals included), then flushed if `flushed`."""
  s = p + c
  r = s.astype(F32)
  midpoint = (s.view(np.int64) & 0x1FFFFFFF) == 0x10000000
  if midpoint.any():
    # TwoSum: the exact error of s = fl64(p + c); at a binary32 midpoint it breaks the tie.
    b = s - p
    err = (p - (s - b)) + (c - b)
    r64 = r.astype(F64)
    away = midpoint & (err != 0) & (np.sign(err) == np.sign(s - r64))
    if away.any():
      r = np.where(away, (r64 + 2 * (s - r64)).astype(F32), r)
  return flush(r) if flushed else r


def dot(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  """x [M, I] @ w [I, O] as the sequential chain c = fma(x[:, i], w[i], c), i = 0, 1, ...,
  from c = +0. Large ones run their rows in threads (NumPy releases the GIL in its loops)."""
  m = x.shape[0]
  if m * w.shape[1] < _THREADED or _WORKERS == 1 or m < 2:
    return _dot(x, w)
  parts = np.array_split(np.arange(m), min(_WORKERS, m))
  futures = [_pool().submit(_dot, x[rows], w) for rows in parts]
  return np.concatenate([f.result() for f in futures])


def _dot(x: np.ndarray, w: np.ndarray) -> np.ndarray:
  m, k = x.shape
  x64, w64 = np.asarray(x, F64), np.asarray(w, F64)
  c = np.zeros((m, w.shape[1]), F64)
  p = np.empty_like(c)
  for i in range(k):
    np.multiply(x64[:, i:i + 1], w64[i:i + 1], out=p)
    c = _round_sum(p, c).astype(F64)
  return c.astype(F32)


_THREADED = 1 << 16  # outputs above which a dot runs its rows in threads
_WORKERS = os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def _pool() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(_WORKERS, thread_name_prefix='binary32-dot')


def tree_sum(x: np.ndarray) -> np.ndarray:
  """The pairwise tree sum of gemma_jax.numerics.tree_sum over the last axis (kept):
  [..., X] -> [..., 1]."""
  while x.shape[-1] > 1:
    n = x.shape[-1]
    h = n // 2
    y = OPS.add(x[..., :h], x[..., h:2 * h])
    x = y if n % 2 == 0 else np.concatenate([y, x[..., 2 * h:]], axis=-1)
  return x


def chunked_dot(x: np.ndarray, w: np.ndarray, k_chunk: int) -> np.ndarray:
  """x [M, I] @ w [I, O] over contraction chunks of chunk_size(I, k_chunk) terms (all I when
  I <= k_chunk), each a `dot` chain, the chunk results added in chunk order."""
  k = x.shape[1]
  c = chunk_size(k, k_chunk) if k > k_chunk else k
  acc = dot(x[:, :c], w[:c])
  for j in range(1, k // c):
    acc = OPS.add(acc, dot(x[:, j * c:(j + 1) * c], w[j * c:(j + 1) * c]))
  return acc


def matmul(x: np.ndarray, w: np.ndarray, *, k_chunk: int, small: int,
           weight_count: int | None = None) -> np.ndarray:
  """A projection x [M, I] @ w [I, O] as the written arithmetic contracts it -> binary32
  [M, O]: with at most `small` weights, the products rounded and summed by a pairwise tree;
  otherwise `chunked_dot`. weight_count: the whole weight's size when `w` holds some of its
  columns (it decides the form)."""
  k, n = w.shape
  if (k * n if weight_count is None else weight_count) <= small:
    return tree_sum(OPS.mul(x[:, None, :], w.T[None]))[..., 0]
  return chunked_dot(x, w, k_chunk)
