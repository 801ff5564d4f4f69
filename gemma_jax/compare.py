"""How two computations compare: hash equality first, then how far apart when they differ.

Equality is always SHA-256 of raw bytes (C order), never a tolerance; the dtype and shape are
the caller's to record beside the hash. When bytes differ we measure the distance in ways that
matter for a language model: max absolute difference, distance in units in the last place
(ULP), KL divergence of the next-token distributions, argmax agreement and top-5 overlap.

This module sits in gemma_jax (not graft/ or analysis/) because both the engine side (graft:
artifacts, exactness checks, shifted grafts) and the measurement side (analysis: the RoPE float
account) need the same hash and the same ULP, and neither may import the other.
"""

from __future__ import annotations

import hashlib
from typing import Iterable

import numpy as np
from numpy.typing import ArrayLike


def sha256_bytes(array: ArrayLike) -> str:
  """SHA-256 of an array's raw bytes in C order."""
  return hashlib.sha256(np.ascontiguousarray(np.asarray(array)).tobytes()).hexdigest()


def token_ids_sha256(ids: Iterable[int]) -> str:
  """SHA-256 of token ids as int32 (little-endian on every machine this runs on)."""
  return sha256_bytes(np.asarray(list(ids), np.int32))


def bits_equal(a: ArrayLike, b: ArrayLike) -> np.ndarray:
  """Elementwise equality of raw bytes (so -0.0 != +0.0, and a NaN equals the same NaN): a, b
of any shape and one dtype -> bool of that shape."""
  a, b = np.asarray(a), np.asarray(b)
  if a.dtype != b.dtype:
    raise ValueError(f'cannot compare the bits of {a.dtype} with {b.dtype}')
  view = {2: np.uint16, 4: np.uint32, 8: np.uint64}[a.dtype.itemsize]
  return a.view(view) == b.view(view)


def ordered_int(array: ArrayLike) -> np.ndarray:
  """Maps floats to integers whose order and spacing follow the floats' ULP grid: consecutive
  representable floats map to consecutive integers, and -0.0 and +0.0 both map to 0.
  int64 for 16- and 32-bit floats; exact Python integers (object dtype) for float64. Any shape,
kept."""
  array = np.asarray(array)
  kinds = {'float32': (np.uint32, 32), 'bfloat16': (np.uint16, 16), 'float16': (np.uint16, 16),
           'float64': (np.uint64, 64)}
  if array.dtype.name not in kinds:
    raise TypeError(f'ULP distance is defined for {sorted(kinds)}, not {array.dtype}')
  view, bits = kinds[array.dtype.name]
  raw = array.view(view)
  magnitude = raw & view((1 << (bits - 1)) - 1)
  negative = (raw >> view(bits - 1)).astype(bool)
  magnitude = magnitude.astype(object if bits == 64 else np.int64)
  return np.where(negative, -magnitude, magnitude)


def ulp_distance(a: ArrayLike, b: ArrayLike) -> np.ndarray:
  """Elementwise number of representable floats between a and b (any shape, the same for
  both; same dtype, finite)."""
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    raise ValueError(f'cannot compare {a.dtype}{a.shape} with {b.dtype}{b.shape}')
  return np.abs(ordered_int(a) - ordered_int(b))


def max_ulp(a: ArrayLike, b: ArrayLike) -> float:
  """Largest ulp_distance (0 iff bit-equal up to the sign of zero); NaNs are infinitely far."""
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    raise ValueError(f'cannot compare {a.dtype}{a.shape} with {b.dtype}{b.shape}')
  if a.size == 0:
    return 0.0
  if np.isnan(a.astype(np.float64)).any() or np.isnan(b.astype(np.float64)).any():
    return float('inf')
  return float(np.max(ulp_distance(a, b)))


def max_abs(a: ArrayLike, b: ArrayLike) -> float:
  """The largest |a - b| in float64 (0 for empty arrays)."""
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b))) if a.size else 0.0


def log_softmax(logits: ArrayLike) -> np.ndarray:
  """log softmax over the last axis, in float64: logits [..., V] -> [..., V]."""
  x = np.asarray(logits, np.float64)
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_per_position(reference_logits: ArrayLike, other_logits: ArrayLike) -> np.ndarray:
  """KL(reference || other) of the softmax distributions, per row, in nats: logits [R, V]
  each -> float64 [R]."""
  p_log, q_log = log_softmax(reference_logits), log_softmax(other_logits)
  return np.sum(np.exp(p_log) * (p_log - q_log), axis=-1)


def argmax_agreement(a: ArrayLike, b: ArrayLike) -> float:
  """Fraction of rows whose argmax is the same (1.0 = all)."""
  return float(np.mean(np.argmax(a, axis=-1) == np.argmax(b, axis=-1)))


def top_k_overlap(a: ArrayLike, b: ArrayLike, k: int = 5) -> float:
  """Mean over rows of |top-k(a) ∩ top-k(b)| / k."""
  top_a = np.argpartition(-np.asarray(a), k, axis=-1)[..., :k]
  top_b = np.argpartition(-np.asarray(b), k, axis=-1)[..., :k]
  rows = [len(set(x) & set(y)) / k for x, y in zip(top_a.reshape(-1, k), top_b.reshape(-1, k))]
  return float(np.mean(rows))


# Rows compared at a time: each measure works in float64 over [rows, V] (262,144 columns for
# Gemma), so a long query compared whole would hold gigabytes of temporaries.
_ROWS_AT_A_TIME = 8


def compare_logits(reference: ArrayLike, other: ArrayLike) -> dict:
  """Every measure for two [T, V] float32 logit arrays, as JSON-ready values: the measures of
  bit-equal arrays are those of identity (nothing to compute), others are taken a few rows at a
  time (the same values as whole: maxima and means over rows)."""
  reference, other = np.asarray(reference), np.asarray(other)
  equal = sha256_bytes(reference) == sha256_bytes(other)
  if equal and reference.shape == other.shape and reference.dtype == other.dtype:
    return {'equal': True, 'max_abs': 0.0, 'max_ulp': 0.0, 'kl': 0.0, 'argmax_agreement': 1.0,
            'top5_overlap': 1.0}
  rows_a = reference.reshape(-1, reference.shape[-1])
  rows_b = other.reshape(-1, other.shape[-1])
  parts = []
  for lo in range(0, len(rows_a), _ROWS_AT_A_TIME):
    a, b = rows_a[lo:lo + _ROWS_AT_A_TIME], rows_b[lo:lo + _ROWS_AT_A_TIME]
    parts.append((len(a), max_abs(a, b), max_ulp(a, b), float(np.max(kl_per_position(a, b))),
                  argmax_agreement(a, b), top_k_overlap(a, b, 5)))
  total = sum(p[0] for p in parts)
  mean = lambda i: sum(p[0] * p[i] for p in parts) / total  # noqa: E731
  return {
      'equal': equal,
      'max_abs': max(p[1] for p in parts),
      'max_ulp': max(p[2] for p in parts),
      'kl': max(p[3] for p in parts),
      'argmax_agreement': mean(4),
      'top5_overlap': mean(5),
  }


def first_differing_layer(layers: list[dict]) -> int | None:
  """The first layer of a per-layer K/V comparison ({'layer', 'k_equal', 'v_equal'} rows, in
  any order) whose K or V bytes differ; None when every layer is equal."""
  differing = sorted(l['layer'] for l in layers if not (l['k_equal'] and l['v_equal']))
  return differing[0] if differing else None
