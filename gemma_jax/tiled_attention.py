"""Attention over the KV cache in fixed tiles, with the signature of `gemma_jax.attention.attend`.

    attention_fn = TiledAttention(tile=256).reading(4)  # the first 4 tiles
    out = attention_fn(q, k, v, q_pos, k_pos, window=None, softcap=None)

The spec and pinned engines' attention (graft/engine/plans.py). Plain XLA (no Pallas), built so that a query
row's bits are a function of the row (its q and position) and of the cache alone, whatever the
number of rows in the call and however many tiles are read, so that the cost follows the
context, not the cache length:

1. Fixed tiles. The cache's S slots are cut into S / tile tiles aligned to slot indices; only
   the first `max_tiles` are read (the engine passes the tiles holding the context, rounded up
   to a power of two). Every dot has a fixed shape but for its row count: per tile, scores
   q [R, H] . k [tile, H] and p [R, tile] @ v [tile, H], R = T * G rows (token, query head of the
   KV head), batched over tiles with q broadcast (XLA would otherwise merge the tiles into one
   wide dot, whose bits for few rows differ). On XLA:CPU (Eigen) these dots give a row the same
   bits for every R >= 2 (a call with one row is padded to two) and every tile count (measured).
2. Two passes in a fixed order. The row's max over everything it sees (exact in any order), then
   p = exp(s - max) and the tiles' row sums (pairwise trees) and p @ v products added in slot
   order. A masked score enters as an exact 0 (`where`), and a tile a row sees nothing of is not
   added at all (`where`), so reading tiles past the context changes no bit.
3. The products that feed adds are passed through `numerics.materialize` (no FMA contraction
   that depends on how XLA fused them), and exp and the soft-cap come from the numerics.

Registered as attention 'tiled' in gemma_jax.attention.IMPLEMENTATIONS. Under the XLA numerics
`materialize` is an identity and this is a plain two-pass softmax over tiles.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from jax.typing import DTypeLike

from gemma_jax import kv_state as kvs
from gemma_jax.numerics import MASKED, XLA, Numerics, tree_sum


class TileScores(abc.ABC):
  """A RoPE mode's score function that the tiled attention can run (gemma_jax.rope's
  RelativeScores): scores per tile, and the parameters a kernel computes them from."""

  @abc.abstractmethod
  def tiles(self, q: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
            visible: jax.Array) -> jax.Array:
    """q [B, K, R, H] against each tile of k [B, K, n, S, H] -> [B, K, n, R, S]."""

  @abc.abstractmethod
  def kernel_parameters(self) -> tuple:
    """(inverse frequencies [H/2] float32, rotated pairs, scale): what a kernel turns keys by."""


def tiled_attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                 *, window: int | None, softcap: float | None, tile: int,
                 max_tiles: int | None = None, scores: TileScores | None = None,
                 numerics: Numerics = XLA) -> jax.Array:
  """q [B, T, N, H] (already scaled), k, v [B, S, K, H], q_pos [B, T], k_pos [B, S] ->
  [B, T, N, H] in v's dtype. S must be a multiple of `tile`; only the first `max_tiles` tiles
  are read (None: all), which the caller guarantees hold every slot a row of the call sees.
  `scores`: a RoPE mode's score function with a `tiles` method (the relative mode's,
  gemma_jax.rope.RelativeScores) in place of the plain per-tile q . k."""
  batch, num_tokens, num_heads, head_dim = q.shape
  num_slots, num_kv_heads = k.shape[1], k.shape[2]
  if num_slots % tile:
    raise ValueError(f'the cache has {num_slots} slots, not a multiple of the tile {tile}')
  n = num_slots // tile if max_tiles is None else min(max_tiles, num_slots // tile)
  groups = num_heads // num_kv_heads
  rows = num_tokens * groups
  # [B, K, R, H], row r = (token r // G, head r % G); q_pos per row.
  qr = q.astype(jnp.float32).reshape(batch, num_tokens, num_kv_heads, groups, head_dim)
  qr = qr.transpose(0, 2, 1, 3, 4).reshape(batch, num_kv_heads, rows, head_dim)
  row_pos = jnp.broadcast_to(q_pos[:, :, None], (batch, num_tokens, groups)).reshape(batch, rows)
  padded_rows = max(rows, 2)  # one-row dots take another path on XLA:CPU
  if padded_rows != rows:
    qr = jnp.pad(qr, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
    row_pos = jnp.pad(row_pos, ((0, 0), (0, padded_rows - rows)), constant_values=-1)

  def tiles(x):  # [B, S, K, H] -> [B, K, n, tile, H], float32
    x = x[:, :n * tile].astype(jnp.float32).reshape(batch, n, tile, num_kv_heads, head_dim)
    return x.transpose(0, 3, 1, 2, 4)

  kt, vt = tiles(k), tiles(v)
  kp = k_pos[:, :n * tile].reshape(batch, 1, n, 1, tile)
  qp = row_pos[:, None, None, :, None]  # [B, 1, 1, R, 1]
  visible = kvs.visible(qp, kp, window)
  if scores is None:
    s = numerics.tile_scores(qr, kt)  # [B, K, n, R, tile]: one dot per tile
  else:
    s = scores.tiles(qr, kt, row_pos, kp[:, 0, :, 0], visible[:, 0])
  if softcap is not None:
    s = numerics.materialize(numerics.softcap(s, softcap))
  tile_max = jnp.max(jnp.where(visible, s, MASKED), axis=-1, keepdims=True)  # [B, K, n, R, 1]
  saw = tile_max > MASKED  # scores are finite, so a row that sees a slot has a larger max
  m = jnp.max(tile_max, axis=2, keepdims=True)  # the row's max over everything it sees (exact)
  p = numerics.materialize(jnp.where(visible, numerics.exp(s - m), 0.0))
  pv = numerics.tile_values(p, vt)  # [B, K, n, R, H]
  sums = tree_sum(p)  # [B, K, n, R, 1]
  # Tiles are added in slot order; a tile the row does not see leaves its sums as they were
  # (so reading more tiles than needed does not change a bit).
  l = jnp.zeros((batch, num_kv_heads, padded_rows, 1), jnp.float32)
  acc = jnp.zeros((batch, num_kv_heads, padded_rows, head_dim), jnp.float32)
  for j in range(n):
    l = jnp.where(saw[:, :, j], l + sums[:, :, j], l)
    acc = jnp.where(saw[:, :, j], acc + pv[:, :, j], acc)
  # 1 / l once per row, then a multiply (what XLA makes of acc / l anyway; the spec says it).
  out = numerics.mul(acc, numerics.materialize(1.0 / jnp.where(l > 0.0, l, 1.0)))
  out = out[:, :, :rows].reshape(batch, num_kv_heads, num_tokens, groups, head_dim)
  out = out.transpose(0, 2, 1, 3, 4).reshape(batch, num_tokens, num_heads, head_dim)
  return out.astype(v.dtype)


DEFAULT_TILE = 256


@dataclasses.dataclass(frozen=True)
class TiledAttention:
  """`tiled_attend` as an AttendFn. max_tiles: the tiles a call reads (None: all); the engine
  picks it per call from the context length (`reading`), which changes cost, not bits."""

  tile: int = DEFAULT_TILE
  max_tiles: int | None = None

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
               k_pos: jax.Array, *, window: int | None, softcap: float | None,
               scores: Callable | None = None, numerics: Numerics = XLA) -> jax.Array:
    if scores is not None and not isinstance(scores, TileScores):
      raise ValueError('tiled attention computes the plain q . k or scores with a `tiles` '
                       'method (see gemma_jax.rope.MODES)')
    kernel = numerics.kernel
    if kernel is not None and kernel.attends:
      # The numerics' kernel computes it whole, over the tiles it needs (plain scores, or the
      # relative mode's, which it turns inside, from the angles' parameters).
      relative = None if scores is None else scores.kernel_parameters()
      whole = kernel.attend(q.astype(jnp.float32), k.astype(jnp.float32),
                            v.astype(jnp.float32), q_pos, k_pos, window=window,
                            softcap=softcap, tile=self.tile, chunk=numerics.chunk(q.shape[-1]),
                            relative=relative)
      return whole.astype(v.dtype)
    return tiled_attend(q, k, v, q_pos, k_pos, window=window, softcap=softcap, tile=self.tile,
                        max_tiles=self.max_tiles, scores=scores, numerics=numerics)

  def reading(self, max_tiles: int | None) -> 'TiledAttention':
    """This attention reading only the first `max_tiles` tiles (None: all)."""
    return dataclasses.replace(self, max_tiles=max_tiles)

  def blocks(self, head_dims: tuple[int, ...], dtype: DTypeLike) -> dict:
    """Per head dim, the tile size: it orders the sums, so the fingerprint records it."""
    del dtype
    return {str(h): {'tile_size': self.tile} for h in head_dims}

  def slot_multiple(self, head_dims: tuple[int, ...], dtype: DTypeLike) -> int:
    """The tile: caches are whole tiles."""
    del head_dims, dtype
    return self.tile
