"""How two computations compare: hash equality first, then how far apart when they differ.

Equality is always SHA-256 of raw bytes (C order), never a tolerance. When bytes differ we measure
the distance in ways that matter for a language model: max absolute difference, max distance in
units in the last place (ULP), KL divergence of the next-token distributions, argmax agreement,
and top-5 overlap.
"""

from __future__ import annotations

import hashlib

import numpy as np


def sha256_bytes(array) -> str:
  """SHA-256 of an array's raw bytes in C order (dtype and shape are the caller's to record)."""
  return hashlib.sha256(np.ascontiguousarray(np.asarray(array)).tobytes()).hexdigest()


def _ordered_int(array: np.ndarray) -> np.ndarray:
  """Maps floats to integers whose order and spacing follow the floats' ULP grid:
  consecutive representable floats map to consecutive integers (and -0.0 == +0.0)."""
  array = np.asarray(array)
  if array.dtype == np.float32:
    bits = array.view(np.int32).astype(np.int64)
    sign_bit = np.int64(1) << 31
  elif array.dtype == np.float64:
    bits = array.view(np.int64).astype(object)  # exact big integers
    sign_bit = 1 << 63
  elif array.dtype.name == 'bfloat16':
    bits = array.view(np.int16).astype(np.int64)
    sign_bit = np.int64(1) << 15
  else:
    raise TypeError('ULP distance is defined here for float32, float64 and bfloat16, not '
                    f'{array.dtype}')
  return np.where(bits < 0, -(bits + sign_bit), bits)


def max_ulp(a, b) -> float:
  """Largest distance between corresponding elements in ULPs of their dtype (0 iff bit-equal up
  to the sign of zero). NaNs count as infinitely far."""
  a, b = np.asarray(a), np.asarray(b)
  if a.shape != b.shape or a.dtype != b.dtype:
    raise ValueError(f'cannot compare {a.dtype}{a.shape} with {b.dtype}{b.shape}')
  if a.size == 0:
    return 0.0
  if np.isnan(a.astype(np.float32)).any() or np.isnan(b.astype(np.float32)).any():
    return float('inf')
  return float(np.max(np.abs(_ordered_int(a) - _ordered_int(b))))


def max_abs(a, b) -> float:
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  return float(np.max(np.abs(a - b))) if a.size else 0.0


def log_softmax(logits) -> np.ndarray:
  x = np.asarray(logits, np.float64)
  x = x - x.max(axis=-1, keepdims=True)
  return x - np.log(np.exp(x).sum(axis=-1, keepdims=True))


def kl_per_position(reference_logits, other_logits) -> np.ndarray:
  """KL(reference || other) of the softmax distributions, per row, in nats (float64)."""
  p_log, q_log = log_softmax(reference_logits), log_softmax(other_logits)
  return np.sum(np.exp(p_log) * (p_log - q_log), axis=-1)


def argmax_agreement(a, b) -> float:
  """Fraction of rows whose argmax is the same (1.0 = all)."""
  return float(np.mean(np.argmax(a, axis=-1) == np.argmax(b, axis=-1)))


def top_k_overlap(a, b, k: int = 5) -> float:
  """Mean over rows of |top-k(a) ∩ top-k(b)| / k."""
  top_a = np.argpartition(-np.asarray(a), k, axis=-1)[..., :k]
  top_b = np.argpartition(-np.asarray(b), k, axis=-1)[..., :k]
  rows = [len(set(x) & set(y)) / k for x, y in zip(top_a.reshape(-1, k), top_b.reshape(-1, k))]
  return float(np.mean(rows))


def compare_logits(reference, other) -> dict:
  """Every measure for two [T, V] float32 logit arrays, as JSON-ready values."""
  reference, other = np.asarray(reference), np.asarray(other)
  return {
      'equal': sha256_bytes(reference) == sha256_bytes(other),
      'max_abs': max_abs(reference, other),
      'max_ulp': max_ulp(reference, other),
      'kl': float(np.max(kl_per_position(reference, other))),
      'argmax_agreement': argmax_agreement(reference, other),
      'top5_overlap': top_k_overlap(reference, other, 5),
  }
