"""Rotary position encoding (RoPE), computed as the reference implementation computes it, and
the registry of RoPE modes.

Pair i of a head rotates dimension i with dimension i + H/2 by the angle
`position / base^(2i/H) / scale`, everything in float32, with sin and cos recomputed from integer
positions on every call (no table) and the result rounded once to the activation dtype. Gemma 4
global layers rotate only the first `rotary_fraction` of the pairs (the exponent still uses the
full H); the other pairs pass through unchanged.

`MODES` names every RoPE mode: its rotation (sin/cos from positions), the attention score
function it needs, and the attention implementations that support it. The model, the engine,
the position sweep and the figures read this table, so a new mode is one entry here plus its
functions. Besides the model as trained ('float'):
  'relative'      the same model, its rotary encoding evaluated from relative offsets: keys are
                  cached unrotated, q is not turned, and each score is q . R(-(p_q - p_k) θ) k
                  with sin and cos of the integer offset's angle (`RelativeScores`). In exact
                  arithmetic this is what 'float' computes; in floating point no absolute
                  angle enters, so a shifted computation is bit for bit the same computation.
and two controls for the position experiments:
  'none'          no rotation at all (a NoPE variant of the model);
  'quarter_turn'  angles that are integer multiples of pi/2, so rotations compose exactly in
                  floating point: R(a) R(b) == R(a + b) bit for bit; attention then scores from
                  relative rotations (`quarter_turn_logits`).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax.config import LayerSpec
from gemma_jax.numerics import XLA, Numerics
from gemma_jax.spec import functions as spec_functions
from gemma_jax.tiled_attention import TileScores


def timescales(head_dim: int, base: float) -> jax.Array:
  """[H/2] float32: base^(2i/H), the reference's per-pair timescale (XLA's pow)."""
  return XLA.timescales(head_dim, base)


def num_rotated_pairs(head_dim: int, rotary_fraction: float) -> int:
  """The pairs of a head of `head_dim` that RoPE turns: the first rotary_fraction of H/2."""
  return int(rotary_fraction * (head_dim // 2))


def rotation_angles(positions: jax.Array, head_dim: int, *, base: float, scale: float = 1.0,
                    rotary_fraction: float = 1.0, numerics: Numerics = XLA) -> jax.Array:
  """[..., H/2] float32 angles for integer positions [...]; unrotated pairs get angle 0."""
  angles = numerics.angles(positions, head_dim, base, scale)
  rotated = num_rotated_pairs(head_dim, rotary_fraction)
  if rotated < head_dim // 2:
    angles = jnp.where(jnp.arange(head_dim // 2) < rotated, angles, 0.0)
  return angles


def quarter_turn_sin_cos(positions: jax.Array, head_dim: int, numerics: Numerics = XLA, *,
                         rotary_fraction: float = 1.0,
                         **unused: float) -> tuple[jax.Array, jax.Array]:
  """Exact sin/cos for angles (position * m_i) * pi/2 with m_i = 1 + i mod 3 (a linear function
  of the position, so shifts compose exactly). Values are exactly 0, 1 or -1. (The base and
  scale of a layer and the numerics do not enter.) positions [...] -> (sin, cos) float32
  [..., H/2]."""
  del numerics, unused
  half = head_dim // 2
  multiplier = 1 + jnp.arange(half, dtype=jnp.int32) % 3
  quarter = (positions.astype(jnp.int32)[..., None] * multiplier) % 4  # [..., H/2] in 0..3
  rotated = jnp.arange(half) < num_rotated_pairs(head_dim, rotary_fraction)
  quarter = jnp.where(rotated, quarter, 0)
  cos = jnp.asarray(np.array([1.0, 0.0, -1.0, 0.0], np.float32))[quarter]
  sin = jnp.asarray(np.array([0.0, 1.0, 0.0, -1.0], np.float32))[quarter]
  return sin, cos


def float_sin_cos(positions: jax.Array, head_dim: int, numerics: Numerics = XLA, *,
                  base: float, scale: float = 1.0,
                  rotary_fraction: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """sin and cos [..., H/2] of the reference's float32 angles, computed by `numerics`."""
  return numerics.sin_cos(rotation_angles(positions, head_dim, base=base, scale=scale,
                                          rotary_fraction=rotary_fraction, numerics=numerics))


def sin_cos(positions: jax.Array, head_dim: int, *, base: float, scale: float = 1.0,
            rotary_fraction: float = 1.0, mode: str = 'float',
            numerics: Numerics = XLA) -> tuple[jax.Array, jax.Array] | None:
  """sin and cos [..., H/2] of RoPE mode `mode` at integer positions [...] (None: the mode
  does not rotate)."""
  fn = get_mode(mode).sin_cos
  if fn is None:
    return None
  return fn(positions, head_dim, numerics, base=base, scale=scale,
            rotary_fraction=rotary_fraction)


def apply_rope(x: jax.Array, positions: jax.Array, *, base: float, scale: float = 1.0,
               rotary_fraction: float = 1.0, mode: str = 'float',
               numerics: Numerics = XLA) -> jax.Array:
  """Rotates x [B, T, N, H] by integer positions [B, T] as RoPE mode `mode` does; returns x's
  dtype."""
  angles = sin_cos(positions, x.shape[-1], base=base, scale=scale,
                   rotary_fraction=rotary_fraction, mode=mode, numerics=numerics)
  return x if angles is None else rotate_heads(x, angles, numerics)


def rotate_heads(x: jax.Array, angles: tuple[jax.Array, jax.Array] | None,
                 numerics: Numerics = XLA) -> jax.Array:
  """x [B, T, N, H] turned by (sin, cos) [B, T, H/2] (broadcast over heads; None: unturned);
  returns x's dtype."""
  if angles is None:
    return x
  sin, cos = angles
  return rotate(x, sin[..., None, :], cos[..., None, :], numerics).astype(x.dtype)


def rotate(x: jax.Array, sin: jax.Array, cos: jax.Array, numerics: Numerics = XLA) -> jax.Array:
  """Pair i of x [..., H] (dimensions i and i + H/2) turned by the angle whose sin and cos
  [..., H/2] broadcast against it; float32."""
  first, second = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  mul = numerics.product
  return jnp.concatenate([mul(first, cos) - mul(second, sin), mul(second, cos) + mul(first, sin)],
                         axis=-1)


def quarter_turn_logits(q: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
                        rotary_fraction: float = 1.0) -> jax.Array:
  """Attention scores for the quarter-turn control, computed from relative rotations:
  q [B, T, K, G, H], k [B, S, K, H] (float32) -> [B, T, K, G, S].

  Quarter turns compose exactly, yet a plain q . k is not translation-invariant under them: a
  shift by an odd δ turns pairs by a quarter, which moves the products q_i k_i and
  q_{i+H/2} k_{i+H/2} into each other's dimension, and the dot adds the same terms in another
  order (XLA:CPU also contracts a product and an add into a multiply-add, so no elementwise
  rewrite of the sum is safe). Instead q is turned back to position 0 and every key by the
  query's position (both exact: signed permutations), so the dot sees R(p_k - p_q) k and the
  unrotated q, which a shift does not change. Costs a [B, T, S, K, H] key tensor: controls only.
  """
  del k_pos  # each key already carries its own rotation
  sin, cos = quarter_turn_sin_cos(-q_pos, q.shape[-1], rotary_fraction=rotary_fraction)
  sin, cos = sin[:, :, None, None], cos[:, :, None, None]  # [B, T, 1, 1, H/2]
  q = rotate(q, sin, cos)
  relative = rotate(k[:, None], sin, cos)  # [B, T, S, K, H]
  return jnp.einsum('btkgh,btskh->btkgs', q, relative)


@dataclasses.dataclass(frozen=True)
class RopeMode:
  """A RoPE mode: how positions rotate q and k, and what attention must do with them.

  sin_cos: (positions, head_dim, numerics, *, base, scale, rotary_fraction) -> (sin, cos)
    [..., H/2], or None for no rotation.
  scores: (layer spec, numerics) -> a score function (q, k, q_pos, k_pos) -> logits replacing
    the plain q . k in the reference attention, or None for the plain dot. The tiled attention
    runs a score function that also has `tiles` (RelativeScores).
  attention: the attention implementations (gemma_jax.attention.IMPLEMENTATIONS) that support
    the mode; `why` says why the others do not.
  """

  name: str
  sin_cos: Callable | None
  scores: Callable[[LayerSpec, Numerics], Callable] | None = None
  attention: tuple[str, ...] = ('xla', 'pallas', 'tiled')
  why: str = ''


def _quarter_turn_scores(spec, numerics: Numerics) -> Callable:
  del numerics  # exact values: no arithmetic to choose
  return lambda q, k, q_pos, k_pos: quarter_turn_logits(q, k, q_pos, k_pos,
                                                        rotary_fraction=spec.rotary_fraction)


def offset_sin_cos(size: int, head_dim: int, numerics: Numerics = XLA, *, base: float,
                   scale: float = 1.0, rotary_fraction: float = 1.0) -> tuple[jax.Array, jax.Array]:
  """sin and cos [size, H/2] of the float mode's angles at integer offsets 0 .. size - 1: the
  relative mode's table (an offset's angle is computed as a position's is)."""
  return float_sin_cos(jnp.arange(size, dtype=jnp.int32), head_dim, numerics, base=base,
                       scale=scale, rotary_fraction=rotary_fraction)


# The most bytes of turned keys the reference attention makes at once (RelativeScores).
TURNED_BYTES = 1 << 28


@dataclasses.dataclass(frozen=True)
class RelativeScores(TileScores):
  """The relative mode's attention scores for one layer: q . R(-a(d)) k, d = p_q - p_k, where
  R(-a(d)) turns pair i back by the float mode's angle of the integer offset d (from a table of
  offsets 0 .. size - 1, `offset_sin_cos`). Unrotated q and k and the offset are all it reads, so
  the score of a (query, key) pair is the same bits wherever the pair sits. Every query row sees
  its own turned copy of the keys, [rows, slots, H], so that each row's score is the numerics'
  ordinary dot: the spec's native FMA-chain kernels and its interpreter compute it unchanged.
  Summing cos and sin of the offset times per-pair products instead fuses better under XLA's own
  numerics (experiments/rope_formulation.py measures both) but would need a sum of its own
  written into the spec.

  A visible key's offset must be below the table's size: the engines write a sequence's
  positions contiguously into its slots (and a local layer sees fewer offsets than its ring has
  slots), so the slots read bound every offset; one that does not fit reads NaN, never another
  offset's angle."""

  head_dim: int
  base: float
  scale: float
  rotary_fraction: float
  numerics: Numerics = XLA

  @classmethod
  def for_layer(cls, spec: LayerSpec, numerics: Numerics) -> 'RelativeScores':
    """The scores of a layer of LayerSpec `spec` under `numerics`."""
    return cls(spec.head_dim, spec.rope_base, spec.rope_scale, spec.rotary_fraction, numerics)

  @property
  def rotated_pairs(self) -> int:
    """The pairs of a head that turn (the rest have angle 0)."""
    return num_rotated_pairs(self.head_dim, self.rotary_fraction)

  def kernel_parameters(self) -> tuple:
    """(inverse frequencies [H/2] float32, rotated pairs, scale): the angles' parameters, from
    which a kernel that computes the attention whole makes the offsets' table
    (gemma_jax.kernels.native_dot.NativeDot.attend)."""
    return (spec_functions.inverse_frequencies(self.head_dim, self.base), self.rotated_pairs,
            self.scale)

  def table(self, size: int) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) float32 [size, H/2]: the turn of every offset 0 .. size - 1
    (`offset_sin_cos`)."""
    return offset_sin_cos(size, self.head_dim, self.numerics, base=self.base, scale=self.scale,
                          rotary_fraction=self.rotary_fraction)

  def turned_keys(self, k: jax.Array, offsets: jax.Array, visible: jax.Array,
                  size: int) -> jax.Array:
    """k [..., S, H] as the rows with `offsets` [..., R, S] (int) see them -> [..., R, S, H]
    float32; a slot a row does not see is turned by offset 0 (its score is masked)."""
    sin, cos = self.table(size)
    index = jnp.where(visible, offsets, 0)
    sin = jnp.take(sin, index, axis=0, mode='fill', fill_value=jnp.nan)
    cos = jnp.take(cos, index, axis=0, mode='fill', fill_value=jnp.nan)
    k = k[..., None, :, :].astype(jnp.float32)
    keys = jnp.broadcast_to(k, jnp.broadcast_shapes(k.shape[:-1], offsets.shape) + k.shape[-1:])
    return rotate(keys, -sin, cos, self.numerics)  # R(-a) = R(a) with sin negated (exact)

  def __call__(self, q: jax.Array, k: jax.Array, q_pos: jax.Array,
               k_pos: jax.Array) -> jax.Array:
    """The reference attention's scores: q [B, T, K, G, H], k [B, S, K, H] (float32),
    q_pos [B, T], k_pos [B, S] -> [B, T, K, G, S], computed for a few tokens at a time (the
    turned keys of a whole prompt against a whole cache would not fit in memory)."""
    keys = k.transpose(0, 2, 1, 3)  # [B, K, S, H]
    step = max(1, TURNED_BYTES // (4 * keys[0].size))
    parts = []
    for lo in range(0, q.shape[1], step):
      offsets = q_pos[:, lo:lo + step, None] - k_pos[:, None, :]  # [B, t, S]
      visible = kvs.visible(q_pos[:, lo:lo + step, None], k_pos[:, None, :], None)
      turned = self.turned_keys(keys, offsets[:, None], visible[:, None],
                                k.shape[1])  # [B, K, t, S, H]
      parts.append(jnp.einsum('btkgh,bktsh->btkgs', q[:, lo:lo + step], turned))
    return jnp.concatenate(parts, axis=1)

  def tiles(self, q: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
            visible: jax.Array) -> jax.Array:
    """The tiled attention's scores: q [B, K, R, H], k [B, K, n, S, H] (n tiles of S slots),
    q_pos [B, R], k_pos [B, n, S], visible [B, n, R, S] -> [B, K, n, R, S], each row against
    its own turned keys by the numerics' `row_scores` (the same chain as `tile_scores`)."""
    b, kv, n, s, h = k.shape
    rows = q.shape[2]
    offsets = q_pos[:, None, :, None] - k_pos[:, :, None, :]  # [B, n, R, S]
    q = jnp.broadcast_to(q[:, :, None], (b, kv, 1, rows, h)).reshape(-1, h)
    tiles = []
    for j in range(n):  # one tile's turned keys at a time: [B, K, 1, R, S, H]
      keys = self.turned_keys(k[:, :, j:j + 1], offsets[:, None, j:j + 1],
                              visible[:, None, j:j + 1], n * s)
      tiles.append(self.numerics.row_scores(q, keys.reshape(-1, s, h)).reshape(b, kv, 1, rows, s))
    return jnp.concatenate(tiles, axis=2)


MODES: dict[str, RopeMode] = {m.name: m for m in (
    RopeMode('float', float_sin_cos),
    RopeMode('relative', None, scores=RelativeScores.for_layer, attention=('xla', 'tiled'),
             why='its scores are computed from offsets, each query row against its own turned '
                 'keys (RelativeScores), which the reference and the tiled attention do and the '
                 'Pallas kernels do not'),
    RopeMode('none', None),
    RopeMode('quarter_turn', quarter_turn_sin_cos, scores=_quarter_turn_scores,
             attention=('xla',),
             why='its scores come from relative rotations (quarter_turn_logits), which only the '
                 'reference attention computes'),
)}


def get_mode(name: str) -> RopeMode:
  """The RoPE mode `name` of MODES (ValueError naming the modes otherwise)."""
  if name not in MODES:
    raise ValueError(f'unknown RoPE mode {name!r}; expected one of {tuple(MODES)}')
  return MODES[name]


def check_attention(mode: str, attention: str) -> None:
  """Raises ValueError, with the reason, when `attention` cannot run RoPE mode `mode`."""
  entry = get_mode(mode)
  if attention not in entry.attention:
    raise ValueError(f'the {mode!r} RoPE mode needs attention in {entry.attention}, not '
                     f'{attention!r}: {entry.why}')
