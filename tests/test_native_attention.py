"""The spec's attention as one native kernel (gemma_jax/kernels/csrc/attention.h) and the
projections' run-time row count (the light engine's fixed call shapes).

The kernel must give the bits of the NumPy reference of the tiled algorithm
(gemma_jax.spec.interpreter.tiled_attention) on every instruction-set path and work split, for
every layout a cache has (slots filled in order, a ring whose positions wrap, empty slots,
padding rows, a sliding window, a soft-cap, grouped query heads, two sequences, a decode step
whose work items transpose their own key tiles), and tiles it
skips must move no bit: the same rows against a cache with more tiles, with garbage in every
slot no row sees, give the same bits. Equality is of raw bits.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma_jax import tiled_attention
from gemma_jax.kernels import native_dot
from gemma_jax.numerics import Spec
from gemma_jax.spec import interpreter

PATHS = native_dot.available_paths()
PARTS = (1, 2, 3)


def bits(x):
  return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.int32)


def random(seed, shape, scale=1.0):
  return (np.random.default_rng(seed).standard_normal(shape) * scale).astype(np.float32)


def attend(dot, q, k, v, q_pos, k_pos, *, window, softcap, tile):
  # The tiled attention with a kernel that `attends`: the kernel computes it whole.
  numerics = Spec(kernel=dot)
  return jax.jit(lambda *a: tiled_attention.TiledAttention(tile)(
      *a, window=window, softcap=softcap, numerics=numerics))(q, k, v, q_pos, k_pos)


def reference(q, k, v, q_pos, k_pos, **kw):
  return np.stack([interpreter.tiled_attention(q[b], k[b], v[b], q_pos[b], k_pos[b], **kw)
                   for b in range(q.shape[0])])


def cache(seed, batch, slots, kv, h, fill, *, ring_start=None):
  """k, v [B, S, K, H] and slot positions [B, S]: `fill` tokens at positions 0 .. fill - 1 in
  slots 0 .. (or, with ring_start, a ring holding positions ring_start .. ring_start + S - 1,
  position p in slot p mod S), every other slot empty (-1)."""
  k, v = random(seed, (batch, slots, kv, h), 0.5), random(seed + 1, (batch, slots, kv, h))
  positions = np.full((batch, slots), -1, np.int32)
  if ring_start is None:
    positions[:, :fill] = np.arange(fill)
  else:
    held = np.arange(ring_start, ring_start + slots)
    positions[:, held % slots] = held
  return k, v, positions


CASES = {
    # name: (tokens, heads, kv heads, head dim, slots, tile, window, softcap, layout)
    'one row, plain': (1, 1, 1, 16, 64, 16, None, None, 'fill'),
    'grouped heads, soft-cap': (7, 4, 2, 32, 96, 32, None, 30.0, 'fill'),
    'sliding window': (20, 4, 1, 24, 128, 32, 9, None, 'fill'),
    'ring that wraps': (12, 2, 1, 16, 64, 16, 40, 50.0, 'ring'),
    'a tile of odd size': (5, 2, 2, 8, 45, 15, None, None, 'fill'),
    'head dim over one chunk': (3, 2, 1, 320, 64, 32, None, None, 'fill'),
    # One token's grouped heads: each work item transposes the key tiles it reads itself (a
    # group's rows are one item); the cases above with more rows than an item share them.
    'a decode step': (1, 4, 1, 64, 96, 32, None, None, 'fill'),
}


@pytest.mark.parametrize('path', PATHS)
@pytest.mark.parametrize('case', list(CASES))
def test_the_kernel_computes_the_tiled_algorithm(path, case):
  tokens, heads, kv, h, slots, tile, window, softcap, layout = CASES[case]
  batch = 2
  q = random(7, (batch, tokens, heads, h), 0.3)
  if layout == 'ring':
    k, v, k_pos = cache(3, batch, slots, kv, h, 0, ring_start=100)
    last = 100 + slots - 1
  else:
    k, v, k_pos = cache(3, batch, slots, kv, h, slots - 10)
    last = slots - 11
  q_pos = np.tile(np.arange(last - tokens + 1, last + 1, dtype=np.int32), (batch, 1))
  q_pos[1, -1] = -1  # a padding row: it sees nothing, its output is +0
  kw = dict(window=window, softcap=softcap, tile=tile)
  want = bits(reference(q, k, v, q_pos, k_pos, k_chunk=256, **kw))
  assert not bits(want[1, -1]).any()
  for parts in PARTS:
    got = attend(native_dot.make_native_dot(path, parts), q, k, v, q_pos, k_pos, **kw)
    assert np.array_equal(bits(got), want), (path, parts)


@pytest.mark.parametrize('path', PATHS)
def test_tiles_no_row_sees_move_no_bit(path):
  """The same rows against the same slots: in a cache of 3 tiles, then of 12 tiles whose other
  slots hold garbage (large keys and values at positions past every row, or out of every row's
  window, in a tile of their own and in one beside such slots): equal bits, so the kernel may skip
  what no row sees, and the cache length decides nothing."""
  heads, kv, h, tile, window = 4, 1, 32, 16, 20
  q = random(1, (1, 6, heads, h), 0.3)
  q_pos = np.arange(30, 36, dtype=np.int32)[None]
  small_k, small_v, small_pos = cache(2, 1, 3 * tile, kv, h, 36)
  big_k, big_v = random(5, (1, 12 * tile, kv, h), 1e3), random(6, (1, 12 * tile, kv, h), 1e3)
  big_pos = np.arange(12 * tile, dtype=np.int32)[None] + 1000  # past every row
  big_pos[:, 80:84] = [0, 1, 2, 3]  # out of every row's window, beside slots past every row
  big_pos[:, 96:112] = 5  # a tile out of every row's window
  big_k[:, :36], big_v[:, :36], big_pos[:, :36] = small_k[:, :36], small_v[:, :36], small_pos[:, :36]
  big_pos[:, 36:48] = -1  # as the small cache's last tile: empty
  dot = native_dot.make_native_dot(path)
  small = attend(dot, q, small_k, small_v, q_pos, small_pos, window=window, softcap=None,
                 tile=tile)
  big = attend(dot, q, big_k, big_v, q_pos, big_pos, window=window, softcap=None, tile=tile)
  assert np.array_equal(bits(small), bits(big))


def test_the_engines_two_attentions_agree():
  """The fused kernel and the tiled attention's XLA ops over the native tile dots (what a mesh
  runs): one algorithm, the same bits."""
  q = random(1, (1, 9, 4, 32), 0.3)
  k, v, k_pos = cache(2, 1, 64, 2, 32, 50)
  q_pos = np.arange(41, 50, dtype=np.int32)[None]
  dot = native_dot.make_native_dot()
  fused = attend(dot, q, k, v, q_pos, k_pos, window=16, softcap=20.0, tile=16)
  numerics = Spec(kernel=dot)
  tiled = jax.jit(lambda *a: tiled_attention.tiled_attend(
      *a[:5], window=16, softcap=20.0, tile=16, numerics=numerics.with_zero(a[5])))(
          q, k, v, q_pos, k_pos, jnp.uint32(0))
  assert np.array_equal(bits(fused), bits(tiled))


@pytest.mark.parametrize('path', PATHS)
@pytest.mark.parametrize('packed', [False, True])
def test_a_projection_computes_its_first_rows_only(path, packed):
  """rows = r: the first r rows are the full call's bits, the rest +0 (a prefill block's padding
  rows are not computed); r past the call computes them all."""
  m, k, n, chunk = 40, 96, 128, 32
  x, w = random(1, (m, k)), random(2, (k, n))
  dot = native_dot.make_native_dot(path)

  def call(x, w, rows):
    if packed:
      return dot.matmul_packed(x, native_dot.pack(w), chunk, rows=rows)
    return dot.matmul(x, w, chunk, rows=rows)

  f = jax.jit(call)
  full = bits(f(x, w, jnp.int32(m)))
  for rows in (0, 1, 13, m, m + 5):
    got = bits(f(x, w, jnp.int32(rows)))
    r = min(rows, m)
    assert np.array_equal(got[:r], full[:r]) and not got[r:].any(), rows


RELATIVE = {
    # name: (tokens, heads, kv heads, head dim, slots, tile, window, softcap, scale, fraction, ring)
    'grouped heads': (6, 4, 1, 32, 96, 32, None, None, 1.0, 1.0, False),
    'window, soft-cap, scale': (9, 2, 2, 16, 64, 16, 20, 30.0, 8.0, 1.0, False),
    'partial rotary, a ring': (5, 2, 1, 32, 64, 16, 40, None, 1.0, 0.25, True),
    # Tiles wider than a path's register tile, and a tile of odd size (the fused turning's
    # vector and slot-by-slot tails); windows that start a tile's run past its first slot.
    'wide tiles, a window': (70, 4, 1, 64, 256, 128, 100, None, 1.0, 1.0, False),
    'a tile of odd size': (11, 2, 1, 8, 45, 15, 7, 30.0, 1.0, 1.0, False),
}


@pytest.mark.parametrize('path', PATHS)
@pytest.mark.parametrize('case', list(RELATIVE))
def test_the_kernel_turns_keys_as_the_relative_mode_does(path, case):
  """The relative RoPE mode inside the kernel (each key turned back by the angle of its offset
  from the query, in the kernel's own table of offsets) against the reference, and against the
  tiled attention's XLA formulation (gemma_jax.rope.RelativeScores over the native tile dots)."""
  from gemma_jax import rope
  tokens, heads, kv, h, slots, tile, window, softcap, scale, fraction, ring = RELATIVE[case]
  base = 10_000.0
  q = random(7, (1, tokens, heads, h), 0.3)
  if ring:
    k, v, k_pos = cache(3, 1, slots, kv, h, 0, ring_start=50)
    last = 50 + slots - 1
  else:
    k, v, k_pos = cache(3, 1, slots, kv, h, slots - 7)
    last = slots - 8
  q_pos = np.arange(last - tokens + 1, last + 1, dtype=np.int32)[None]
  table = interpreter.Interpreter.angles(np.arange(slots), h, base, scale, fraction)
  want = bits(reference(q, k, v, q_pos, k_pos, k_chunk=256, window=window, softcap=softcap,
                        tile=tile, relative=table))
  dot = native_dot.make_native_dot(path)
  numerics = Spec(kernel=dot)
  scores = rope.RelativeScores(h, base, scale, fraction, numerics)
  got = jax.jit(lambda *a: tiled_attention.TiledAttention(tile)(
      *a, window=window, softcap=softcap, scores=scores, numerics=numerics))(q, k, v, q_pos, k_pos)
  assert np.array_equal(bits(got), want), path
  tiled = jax.jit(lambda *a: tiled_attention.tiled_attend(
      *a[:5], window=window, softcap=softcap, tile=tile,
      scores=dataclasses.replace(scores, numerics=numerics.with_zero(a[5])),
      numerics=numerics.with_zero(a[5])))(q, k, v, q_pos, k_pos, jnp.uint32(0))
  assert np.array_equal(bits(tiled), want)
