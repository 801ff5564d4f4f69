"""Seeded random numbers made by integer arithmetic: the same bits on every machine and backend.

Random weights (`--weights=random:SEED`) and the draws of sampled decoding enter computations
whose hashes are recorded, so they are made from integers, and turned into floats only by
operations whose IEEE-754 result is defined (docs/determinism.md, "Inputs"):

  words(key, index)    SplitMix64's output number `index` (0-based) for the state `key`: the
                       word mix(key + (index + 1) * GAMMA) mod 2^64 (Steele, Lea and Flood,
                       "Fast splittable pseudorandom number generators", OOPSLA 2014; the mix
                       is Stafford's variant 13). Counter-based: any element is computed from
                       its index alone, so a parameter, a row block or a column panel of it is
                       made on its own, in any order, on any machine.
  key(purpose)         the first 8 bytes of SHA-256(purpose), little-endian: one stream per
                       parameter ('random:SEED/layers/0/mlp/down_proj/w') or per decode.
  normal               a parameter's element: the sum S of the four 16-bit fields of its word
                       (an Irwin-Hall sum of 4 uniforms, mean 131,070 and standard deviation
                       sqrt((2^32 - 1) / 3)), centred as the integer C = S - 131,070 (exact in
                       binary32: |C| < 2^18), times the binary32 number nearest to
                       std / sqrt((2^32 - 1) / 3) (one rounding), plus the mean (one rounding;
                       none where the mean is 0). Mean `mean`, standard deviation `std` (up to the
                       scale's rounding), bounded at +-sqrt(12) std = 3.46 std: a bell-shaped
                       initialisation like the truncated normals Flax's initialisers draw.
  below(key, i, n)     a uniform integer in [0, n) by rejection from the words of (key, i).

Nothing here calls a transcendental function, XLA or a library's random generator, whose bits
follow the CPU (jax.random.normal's inverse error function is compiled for the CPU at hand, with
or without fused multiply-adds).
"""

from __future__ import annotations

import concurrent.futures
import decimal
import functools
import hashlib
import os

import numpy as np

# What a result records as the generator of its random:SEED weights (graft.engine.fingerprint).
WEIGHTS_GENERATOR = 'splitmix64-irwin-hall4/1'

GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's increment (the golden ratio's 64-bit fraction)
_MIX = (30, 0xBF58476D1CE4E5B9, 27, 0x94D049BB133111EB, 31)
_MASK = (1 << 64) - 1
_FIELDS, _FIELD_BITS = 4, 16
CENTRE = _FIELDS * ((1 << _FIELD_BITS) - 1) // 2  # 131,070: the mean of the sum of 4 fields
# The sum's variance: 4 fields, each uniform on [0, 2^16), of variance (2^32 - 1) / 12.
SUM_VARIANCE = decimal.Decimal(_FIELDS * ((1 << 2 * _FIELD_BITS) - 1)) / 12
_CHUNK = 1 << 20  # elements a worker makes at once (its temporaries: about 40 MB)


def key(purpose: str) -> int:
  """The 64-bit stream key of `purpose` (any text): SHA-256's first 8 bytes, little-endian."""
  return int.from_bytes(hashlib.sha256(purpose.encode()).digest()[:8], 'little')


def parameter_key(seed: int, name: str) -> int:
  """The stream key of parameter `name` ('layers/0/mlp/down_proj/w') under random:`seed`."""
  return key(f'random:{seed}/{name}')


def words(stream: int, index: np.ndarray) -> np.ndarray:
  """SplitMix64's words number `index` (uint64 array of any shape, 0-based) of the stream whose
  state starts at `stream`: uint64, index's shape."""
  z = np.asarray(index, np.uint64) + np.uint64(1)
  z *= np.uint64(GAMMA)
  z += np.uint64(stream)
  s1, m1, s2, m2, s3 = (np.uint64(v) for v in _MIX)
  z ^= z >> s1
  z *= m1
  z ^= z >> s2
  z *= m2
  z ^= z >> s3
  return z


def word(stream: int, index: int) -> int:
  """One word (`words` for a single index), in Python integers: the definition, written out."""
  z = (stream + (index + 1) * GAMMA) & _MASK
  z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
  z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
  return z ^ (z >> 31)


@functools.lru_cache(maxsize=None)
def scale(std: float) -> np.float32:
  """The binary32 number nearest to std / sqrt(SUM_VARIANCE) (computed with 40 significant
  digits, then rounded once, ties to even): what a centred sum is multiplied by."""
  context = decimal.Context(prec=40)
  exact = context.divide(decimal.Decimal(std), context.sqrt(SUM_VARIANCE))
  return _nearest_binary32(exact, context)


def _nearest_binary32(exact: decimal.Decimal, context: decimal.Context) -> np.float32:
  guess = np.float32(float(exact))
  candidates = [np.nextafter(guess, np.float32(-np.inf)), guess,
                np.nextafter(guess, np.float32(np.inf))]
  def error(c):
    return (abs(context.subtract(decimal.Decimal(float(c)), exact)),
            int(np.asarray(c).view(np.int32)) & 1)
  return min(candidates, key=error)


def centred_sums(w: np.ndarray) -> np.ndarray:
  """The centred Irwin-Hall sums C = f0 + f1 + f2 + f3 - CENTRE of words' four 16-bit fields
  (f_k = (w >> 16 k) & 0xFFFF), exact: uint64 words of any shape -> int32, the same shape."""
  total = np.zeros(w.shape, np.int32)
  for k in range(_FIELDS):
    total += ((w >> np.uint64(_FIELD_BITS * k)) & np.uint64(0xFFFF)).astype(np.int32)
  total -= np.int32(CENTRE)
  return total


def normal_at(stream: int, index: np.ndarray, mean: float, std: float) -> np.ndarray:
  """The elements number `index` (any shape) of a parameter drawn with `mean` and `std` from
  `stream`: float32, index's shape (see the module's docstring, "normal")."""
  value = centred_sums(words(stream, index)).astype(np.float32)  # exact: |C| < 2^24
  value *= scale(std)  # one binary32 rounding (NumPy's multiply: IEEE, never fused)
  if mean:
    value += np.float32(mean)  # one binary32 rounding
  return value


def normal(seed: int, name: str, shape: tuple[int, ...], mean: float, std: float,
           start: int = 0, stop: int | None = None) -> np.ndarray:
  """Parameter `name` of random:`seed` (its `shape`, `mean` and `std`: gemma_jax.model's
  `parameter_distributions`), or the elements start .. stop - 1 of it in row-major order
  (a row block of a [rows, ...] parameter is start = first row * row size): float32, `shape`
  when whole, else flat [stop - start]. Made in chunks, in threads; any part equals the same
  elements of the whole, bit for bit."""
  size = int(np.prod(shape, dtype=np.int64))
  stop = size if stop is None else stop
  if not 0 <= start <= stop <= size:
    raise ValueError(f'{name}: elements {start}..{stop} outside its {size}')
  stream = parameter_key(seed, name)
  out = np.empty(stop - start, np.float32)
  def fill(lo: int) -> None:
    hi = min(lo + _CHUNK, stop)
    out[lo - start:hi - start] = normal_at(stream, np.arange(lo, hi, dtype=np.uint64), mean,
                                           std)
  lows = range(start, stop, _CHUNK)
  if len(lows) > 1 and _WORKERS > 1:
    list(_pool().map(fill, lows))
  else:
    for lo in lows:
      fill(lo)
  return out.reshape(shape) if (start, stop) == (0, size) else out


_WORKERS = os.cpu_count() or 1


@functools.lru_cache(maxsize=1)
def _pool() -> concurrent.futures.ThreadPoolExecutor:
  return concurrent.futures.ThreadPoolExecutor(_WORKERS, thread_name_prefix='seeded')


def below(stream: int, index: int, n: int) -> int:
  """A uniform integer in [0, n) (1 <= n <= 2^64), the draw number `index` of `stream`: the
  first of the words number index * 2^32 + attempt (attempt 0, 1, ...) below the largest
  multiple of n at most 2^64, modulo n (exactly uniform; a second word is needed with
  probability under n / 2^64)."""
  if not 1 <= n <= 1 << 64:
    raise ValueError(f'cannot draw below {n}')
  limit = (1 << 64) - (1 << 64) % n
  attempt = 0
  while True:
    w = word(stream, (index << 32) + attempt)
    if w < limit:
      return w % n
    attempt += 1
