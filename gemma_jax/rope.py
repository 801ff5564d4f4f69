"""Rotary position encoding (RoPE), computed as the reference implementation computes it.

Pair i of a head rotates dimension i with dimension i + H/2 by the angle
`position / base^(2i/H) / scale`, everything in float32, with sin and cos recomputed from integer
positions on every call (no table) and the result rounded once to the activation dtype. Gemma 4
global layers rotate only the first `rotary_fraction` of the pairs (the exponent still uses the
full H); the other pairs pass through unchanged.

Two control modes exist for the position experiments (see analysis/ and
experiments/position_sweep.py):
  'none'          no rotation at all (a NoPE variant of the model);
  'quarter_turn'  angles that are integer multiples of pi/2, so rotations compose exactly in
                  floating point: R(a) R(b) == R(a + b) bit for bit (attention then
                  scores from relative rotations: see attention.quarter_turn_logits).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

ROPE_MODES = ('float', 'none', 'quarter_turn')


def timescales(head_dim: int, base: float) -> jax.Array:
  """[H/2] float32: base^(2i/H), the reference's per-pair timescale."""
  fraction = 2.0 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
  return jnp.asarray(base, jnp.float32) ** fraction


def num_rotated_pairs(head_dim: int, rotary_fraction: float) -> int:
  return int(rotary_fraction * (head_dim // 2))


def rotation_angles(positions: jax.Array, head_dim: int, *, base: float, scale: float = 1.0,
                    rotary_fraction: float = 1.0) -> jax.Array:
  """[..., H/2] float32 angles for integer positions [...]; unrotated pairs get angle 0."""
  angles = positions.astype(jnp.float32)[..., None] / timescales(head_dim, base)
  if scale != 1.0:
    angles = angles / jnp.float32(scale)
  rotated = num_rotated_pairs(head_dim, rotary_fraction)
  if rotated < head_dim // 2:
    angles = jnp.where(jnp.arange(head_dim // 2) < rotated, angles, 0.0)
  return angles


def quarter_turn_sin_cos(positions: jax.Array, head_dim: int, rotary_fraction: float = 1.0):
  """Exact sin/cos for angles (position * m_i) * pi/2 with m_i = 1 + i mod 3 (a linear function
  of the position, so shifts compose exactly). Values are exactly 0, 1 or -1."""
  half = head_dim // 2
  multiplier = 1 + jnp.arange(half, dtype=jnp.int32) % 3
  quarter = (positions.astype(jnp.int32)[..., None] * multiplier) % 4  # [..., H/2] in 0..3
  rotated = jnp.arange(half) < num_rotated_pairs(head_dim, rotary_fraction)
  quarter = jnp.where(rotated, quarter, 0)
  cos = jnp.asarray(np.array([1.0, 0.0, -1.0, 0.0], np.float32))[quarter]
  sin = jnp.asarray(np.array([0.0, 1.0, 0.0, -1.0], np.float32))[quarter]
  return sin, cos


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float, scale: float = 1.0,
               rotary_fraction: float = 1.0, mode: str = 'float') -> jax.Array:
  """Rotates x [B, T, N, H] by integer positions [B, T]; returns x's dtype."""
  if mode == 'none':
    return x
  head_dim = x.shape[-1]
  if mode == 'float':
    angles = rotation_angles(positions, head_dim, base=base, scale=scale,
                             rotary_fraction=rotary_fraction)
    sin, cos = jnp.sin(angles), jnp.cos(angles)
  elif mode == 'quarter_turn':
    sin, cos = quarter_turn_sin_cos(positions, head_dim, rotary_fraction)
  else:
    raise ValueError(f'unknown RoPE mode {mode!r}; expected one of {ROPE_MODES}')
  # [B, T, 1, H/2]: broadcast over heads
  return rotate(x, sin[..., None, :], cos[..., None, :]).astype(x.dtype)


def rotate(x: jax.Array, sin: jax.Array, cos: jax.Array) -> jax.Array:
  """Pair i of x [..., H] (dimensions i and i + H/2) turned by the angle whose sin and cos
  [..., H/2] broadcast against it; float32."""
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
