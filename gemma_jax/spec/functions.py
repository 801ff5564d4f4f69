"""The elementwise functions of the written arithmetic, as sequences of binary32 operations.

Each function is written once, over a backend `o` that performs the operations: the engine's
(gemma_jax.numerics.Spec, XLA) and the NumPy interpreter's (gemma_jax.spec.binary32). So the two
compute the same sequence by construction, and a machine that gives each operation its IEEE-754
result gives the same bits in both. docs/determinism.md states the arithmetic; this module is
that statement in code.

The operations a backend provides (float32 arrays; every result rounded to nearest even, then
flushed to zero when it is subnormal, as XLA:CPU runs):
  add, sub, mul, div, sqrt   IEEE binary32; `mul` never contracts with a later add
  neg, abs, min, max, floor  exact
  lt(a, b) -> mask; where(mask, a, b); const(x) -> x rounded to binary32
  ldexp(y, n)                y * 2^n for integral float n in [-126, 127] (an exact multiply
                             by a power of two built from its exponent bits)
  quadrant(k)                integral float k mod 4, as an integer array

Coefficients are binary32 numbers (written as the decimal strings Cephes gives; `const` rounds
them once). Domains: exp clamps its argument to [-87, 88] (results are normal numbers or
exp(-87)); sin_cos is exact in its range reduction for |angle| < 2^19 * pi/2 (positions below
823,000 for a timescale of 1).
"""

from __future__ import annotations

import decimal
import functools
from typing import Any, Protocol, Sequence

import numpy as np

# exp: x = n ln2 + r (Cody-Waite, ln2 in two parts), exp(r) by Cephes expf's polynomial.
EXP_LO, EXP_HI = -87.0, 88.0
LOG2E = 1.44269504088896341
LN2_HI, LN2_LO = 0.693359375, -2.12194440e-4  # LN2_HI has 9 bits: n * LN2_HI is exact
EXP_P = (1.9875691500e-4, 1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
         5.0000001201e-1)

# tanh: Cephes tanhf: an odd polynomial below 0.625, 1 - 2 / (exp(2|x|) + 1) above.
TANH_SMALL = 0.625
TANH_P = (-5.70498872745e-3, 2.06390887954e-2, -5.37397155531e-2, 1.33314422036e-1,
          -3.33332819422e-1)

# GELU, tanh approximation: x * 0.5 * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))).
GELU_C, GELU_A = 0.7978845608028654, 0.044715

# sin, cos: angle = k pi/2 + r, k = floor(angle * 2/pi + 1/2); pi/2 in seven binary32 parts of at
# most 5 significant bits each (k * part is exact for |k| < 2^19); Cephes sinf / cosf
# polynomials on |r| <= pi/4; the quadrant k mod 4 picks signs and which is which.
TWO_OVER_PI = 0.63661977236758134
PIO2_PARTS = (1.5625, 0.00830078125, -4.5299530029296875e-06, 7.450580596923828e-08,
              9.89530235528946e-10, 2.6147972675971687e-12, -5.1514348342607263e-14)
SIN_P = (-1.9515295891e-4, 8.3321608736e-3, -1.6666654611e-1)
COS_P = (2.443315711809948e-5, -1.388731625493765e-3, 4.166664568298827e-2)


# A binary32 array of the backend's kind: NumPy's (gemma_jax.spec.binary32) or XLA's
# (gemma_jax.numerics); the functions below are written over either.
Value = Any


class Backend(Protocol):
  """The operations a backend provides (see the module's docstring)."""

  def const(self, x: Any) -> Value:
    """x rounded to binary32. Elementwise (any shape)."""

  def add(self, a: Value, b: Value) -> Value:
    """a + b. Elementwise (any shape)."""

  def sub(self, a: Value, b: Value) -> Value:
    """a - b. Elementwise (any shape)."""

  def mul(self, a: Value, b: Value) -> Value:
    """a * b, never contracted with a later add. Elementwise (any shape)."""

  def div(self, a: Value, b: Value) -> Value:
    """a / b. Elementwise (any shape)."""

  def sqrt(self, a: Value) -> Value:
    """The square root of a. Elementwise (any shape)."""

  def neg(self, a: Value) -> Value:
    """-a (exact). Elementwise (any shape)."""

  def abs(self, a: Value) -> Value:
    """|a| (exact). Elementwise (any shape)."""

  def min(self, a: Value, b: Value) -> Value:
    """The smaller of a and b. Elementwise (any shape)."""

  def max(self, a: Value, b: Value) -> Value:
    """The larger of a and b. Elementwise (any shape)."""

  def floor(self, a: Value) -> Value:
    """The largest integer <= a (exact). Elementwise (any shape)."""

  def lt(self, a: Value, b: Value) -> Value:
    """a < b, a mask. Elementwise (any shape)."""

  def where(self, mask: Value, a: Value, b: Value) -> Value:
    """a where mask holds, else b. Elementwise (any shape)."""

  def ldexp(self, y: Value, n: Value) -> Value:
    """y * 2^n for integral n (exact). Elementwise (any shape)."""

  def quadrant(self, k: Value) -> Value:
    """Integral k mod 4, as integers. Elementwise (any shape)."""


def _horner(o: Backend, coefficients: Sequence[float], x: Value) -> Value:
  """((c0 x + c1) x + c2) ...: a multiply, then an add, per coefficient after the first."""
  p = o.const(coefficients[0])
  for c in coefficients[1:]:
    p = o.add(o.mul(p, x), o.const(c))
  return p


def exp(o: Backend, x: Value) -> Value:
  """e^x over backend `o`: Cody-Waite reduction by ln 2, Cephes expf's polynomial, then
  scaling by 2^n (x of any shape, clamped to [EXP_LO, EXP_HI])."""
  x = o.max(o.min(x, o.const(EXP_HI)), o.const(EXP_LO))
  n = o.floor(o.add(o.mul(x, o.const(LOG2E)), o.const(0.5)))
  r = o.sub(x, o.mul(n, o.const(LN2_HI)))
  r = o.sub(r, o.mul(n, o.const(LN2_LO)))
  y = o.mul(_horner(o, EXP_P, r), o.mul(r, r))
  y = o.add(o.add(y, r), o.const(1.0))
  return o.ldexp(y, n)


def tanh(o: Backend, x: Value) -> Value:
  """tanh x over backend `o`: an odd polynomial for |x| < TANH_SMALL, else
  1 - 2 / (e^(2|x|) + 1) with x's sign (any shape)."""
  z = o.mul(x, x)
  small = o.add(o.mul(o.mul(_horner(o, TANH_P, z), z), x), x)
  e = exp(o, o.add(o.abs(x), o.abs(x)))
  big = o.sub(o.const(1.0), o.div(o.const(2.0), o.add(e, o.const(1.0))))
  big = o.where(o.lt(x, o.const(0.0)), o.neg(big), big)
  return o.where(o.lt(o.abs(x), o.const(TANH_SMALL)), small, big)


def gelu(o: Backend, x: Value) -> Value:
  """GELU's tanh approximation, x * 0.5 * (1 + tanh(GELU_C (x + GELU_A x^3))), over backend
  `o` (any shape)."""
  cube = o.mul(o.mul(x, x), x)
  inner = o.mul(o.const(GELU_C), o.add(x, o.mul(o.const(GELU_A), cube)))
  return o.mul(x, o.mul(o.const(0.5), o.add(o.const(1.0), tanh(o, inner))))


def sin_cos(o: Backend, angle: Value) -> tuple[Value, Value]:
  """(sin, cos) of float32 angles over backend `o`: reduction by pi/2 in PIO2_PARTS, Cephes
  sinf / cosf polynomials, the quadrant's signs (any shape; exact reduction for
  |angle| < 2^19 pi/2)."""
  k = o.floor(o.add(o.mul(angle, o.const(TWO_OVER_PI)), o.const(0.5)))
  r = angle
  for part in PIO2_PARTS:
    r = o.sub(r, o.mul(k, o.const(part)))
  z = o.mul(r, r)
  s = o.add(o.mul(o.mul(_horner(o, SIN_P, z), z), r), r)
  c = o.mul(o.mul(_horner(o, COS_P, z), z), z)
  c = o.add(o.sub(c, o.mul(o.const(0.5), z)), o.const(1.0))
  q = o.quadrant(k)
  # quadrant 0: (s, c); 1: (c, -s); 2: (-s, -c); 3: (-c, s)
  sin = o.where(q == 0, s, o.where(q == 1, c, o.where(q == 2, o.neg(s), o.neg(c))))
  cos = o.where(q == 0, c, o.where(q == 1, o.neg(s), o.where(q == 2, o.neg(c), s)))
  return sin, cos


def reciprocal(o: Backend, d: Value) -> Value:
  """1 / d, correctly rounded: a division by a value shared across a row (a constant, a row's
  sum) is a multiplication by this (XLA rewrites such divisions so; the spec says it)."""
  return o.div(o.const(1.0), d)


def softcap(o: Backend, x: Value, cap: float) -> Value:
  """tanh(x * (1 / cap)) * cap."""
  return o.mul(tanh(o, o.mul(x, reciprocal(o, o.const(cap)))), o.const(cap))


def rsqrt(o: Backend, x: Value) -> Value:
  """1 / sqrt(x): two correctly rounded operations (no reciprocal-square-root estimate, whose
  bits each CPU vendor defines its own way)."""
  return o.div(o.const(1.0), o.sqrt(x))


@functools.lru_cache(maxsize=None)
def inverse_frequencies(head_dim: int, base: float) -> np.ndarray:
  """[H/2] binary32: the RoPE inverse frequency base^(-2i/H) of pair i, correctly rounded
  (computed with 40 significant decimal digits, then rounded to the nearest binary32, ties to
  even). A pair's angle is position * inverse frequency * (1 / scale)."""
  context = decimal.Context(prec=40)
  ln_base = context.ln(decimal.Decimal(base))
  out = []
  for i in range(head_dim // 2):
    exact = context.exp(context.multiply(ln_base, decimal.Decimal(-2 * i) / head_dim))
    out.append(_nearest_binary32(exact))
  return np.asarray(out, np.float32)


def _nearest_binary32(exact: decimal.Decimal) -> np.float32:
  guess = np.float32(float(exact))
  candidates = [np.nextafter(guess, np.float32(-np.inf)), guess,
                np.nextafter(guess, np.float32(np.inf))]
  def error(c):
    return (abs(decimal.Decimal(float(c)) - exact), int(np.asarray(c).view(np.int32)) & 1)
  return min(candidates, key=error)
