"""The Pallas attention kernel (interpret mode on CPU): close to the reference `attend`, and a
query row's bits a function of the cache contents and the row's position only.

Closeness uses a stated tolerance (the kernel sums in a different order); invariance uses
np.array_equal on raw bytes and SHA-256, never allclose.
"""

from __future__ import annotations

import hashlib

import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma_jax import config as gcfg
from gemma_jax import kv_state as kvs
from gemma_jax import model as gmodel
from gemma_jax.attention import attend
from gemma_jax.kernels import online_softmax
from gemma_jax.kernels.pallas_attention import default_block_config, make_pallas_attention

# Float32: the kernel folds 16..128-slot tiles with online rescaling (exp(m_old - m_new)) and
# divides by the sum at the end; the reference takes one softmax over all slots and then one dot.
# Same terms, different summation order and rounding points: a few ulp per output, which we bound
# by 1e-5 of the largest output magnitude (measured: <= 2.2e-6).
F32_TOL = 1e-5
# Bfloat16: the reference rounds the *normalized* probabilities to bf16 before the PV dot, the
# kernel rounds the *unnormalized* exp(s - m) (and only divides at the end), and both round the
# output to bf16 (8 significant bits, ulp 2^-7 at 1.0). Expect 1-2 bf16 ulps of the largest
# output: bound 3e-2 (measured: <= 6.8e-3).
BF16_TOL = 3e-2


def _sha(x) -> str:
  a = np.asarray(x)
  return hashlib.sha256(a.dtype.str.encode() + str(a.shape).encode() + a.tobytes()).hexdigest()


def _assert_same_bits(a, b):
  a, b = np.asarray(a), np.asarray(b)
  assert a.dtype == b.dtype and a.shape == b.shape
  assert a.tobytes() == b.tobytes(), f'max |diff| {np.abs(a.astype(np.float64) - b).max()}'
  assert _sha(a) == _sha(b)


def _normwise_error(out, ref) -> float:
  out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
  return float(np.abs(out - ref).max() / np.abs(ref).max())


# ------------------------------------------------------------------------------------------------
# (a) Close to the reference.

# (batch, tokens, heads, kv heads, head dim, slots, window, softcap, tile, ring)
CLOSENESS_CASES = {
    'gqa_h128': (2, 5, 4, 2, 128, 100, None, None, None, False),  # S not a multiple of the tile
    'mqa_h256_softcap_decode': (1, 1, 4, 1, 256, 130, None, 50.0, None, False),
    'mha_h512_window': (1, 3, 2, 2, 512, 64, 32, None, None, False),
    'gqa_h16_ring_window_softcap': (1, 4, 4, 2, 16, 24, 8, 30.0, 16, True),
}


def _closeness_inputs(case, dtype, seed=0):
  b, t, n, k, h, s, window, softcap, tile, ring = case
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((b, t, n, h)) * 3 * h ** -0.5, dtype)
  keys = jnp.asarray(rng.standard_normal((b, s, k, h)), dtype)
  values = jnp.asarray(rng.standard_normal((b, s, k, h)), dtype)
  if ring:  # 50 tokens written into a ring of s slots: token j in slot j % s
    tokens = 50
    k_pos = np.full((b, s), -1)
    for j in range(tokens):
      k_pos[:, j % s] = j
  else:  # a partly filled cache: the last 10% of the slots empty
    tokens = s - s // 10
    k_pos = np.where(np.arange(s) < tokens, np.arange(s), -1)[None].repeat(b, 0)
  q_pos = np.arange(tokens - t, tokens)[None].repeat(b, 0)
  return (q, keys, values, jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32),
          dict(window=window, softcap=softcap), tile)


@pytest.mark.parametrize('name', list(CLOSENESS_CASES))
@pytest.mark.parametrize('dtype, tol', [(jnp.float32, F32_TOL), (jnp.bfloat16, BF16_TOL)],
                         ids=['f32', 'bf16'])
def test_pallas_close_to_reference_attend(name, dtype, tol):
  q, k, v, q_pos, k_pos, kw, tile = _closeness_inputs(CLOSENESS_CASES[name], dtype)
  out = make_pallas_attention(tile_size=tile)(q, k, v, q_pos, k_pos, **kw)
  ref = attend(q, k, v, q_pos, k_pos, **kw)
  assert out.dtype == ref.dtype and out.shape == ref.shape
  assert _normwise_error(out, ref) <= tol


def test_pallas_gpu_blocks_close_to_reference_in_interpret_mode():
  q, k, v, q_pos, k_pos, kw, _ = _closeness_inputs(CLOSENESS_CASES['gqa_h128'], jnp.float32)
  gpu = make_pallas_attention(platform='gpu', interpret=True)  # 64 rows x 64 slots
  assert _normwise_error(gpu(q, k, v, q_pos, k_pos, **kw), attend(q, k, v, q_pos, k_pos, **kw)
                         ) <= F32_TOL


@pytest.mark.parametrize('name, tile', [('gqa_h128', 32), ('gqa_h16_ring_window_softcap', 8)])
def test_pallas_tpu_grid_driver_bits_equal_loop_driver(name, tile):
  """The tpu driver (tiles on the grid, every tile folded) and the cpu/gpu driver (tile loop,
  fully masked tiles skipped) give the same bits for the same blocks: the same arithmetic, and
  folding a fully masked tile is exact. Both cases have fully masked tiles (empty slots past
  the fill; slots outside the window)."""
  q, k, v, q_pos, k_pos, kw, _ = _closeness_inputs(CLOSENESS_CASES[name], jnp.float32)
  loop = make_pallas_attention(platform='cpu', tile_size=tile, block_q=16)
  grid = make_pallas_attention(platform='tpu', interpret=True, tile_size=tile, block_q=16)
  _assert_same_bits(grid(q, k, v, q_pos, k_pos, **kw), loop(q, k, v, q_pos, k_pos, **kw))


# ------------------------------------------------------------------------------------------------
# (b) A row's bits: independent of its place in the call, T, S and masked slots.

N, K, H = 4, 2, 32  # GQA, G = 2
TILE = 32  # several tiles per cache, so "tiles past the position" is a real difference
TARGET = 40  # the target token's sequence index (= its slot)
OFFSET = 7  # positions = OFFSET + sequence index: positions and slots differ


def _sequence(dtype, seed=0, tokens=64):
  """Per-token q [T, N, H], k, v [T, K, H] of one sequence."""
  rng = np.random.default_rng(seed)
  q = jnp.asarray(rng.standard_normal((tokens, N, H)) * 3 * H ** -0.5, dtype)
  k = jnp.asarray(rng.standard_normal((tokens, K, H)), dtype)
  v = jnp.asarray(rng.standard_normal((tokens, K, H)), dtype)
  return q, k, v


def _cache(k_seq, v_seq, filled: int, slots: int, *, garbage_seed=None, window=None):
  """A cache of `slots` slots holding tokens 0..filled-1 in slots 0..filled-1. Without a
  garbage seed the other slots are empty zeros. With one, slots past TARGET hold random
  "future" tokens or random values in empty slots, and tokens outside TARGET's window get
  random K/V: everything TARGET's row must not see."""
  dtype = k_seq.dtype
  k = np.zeros((slots, K, H), np.float32)
  v = np.zeros((slots, K, H), np.float32)
  k[:filled], v[:filled] = np.asarray(k_seq[:filled], np.float32), np.asarray(v_seq[:filled],
                                                                                np.float32)
  k_pos = np.full((slots,), -1)
  k_pos[:filled] = OFFSET + np.arange(filled)
  if garbage_seed is not None:
    rng = np.random.default_rng(garbage_seed)
    rest = np.arange(TARGET + 1, slots)
    k[rest] = rng.standard_normal((len(rest), K, H)) * 4
    v[rest] = rng.standard_normal((len(rest), K, H)) * 4
    # each later slot holds either a future token (position > TARGET's) or is empty
    k_pos[rest] = np.where(rng.random(len(rest)) < 0.5,
                           OFFSET + TARGET + 1 + rng.integers(0, 1000, len(rest)), -1)
    if window is not None:
      old = np.arange(0, TARGET - window + 1)
      k[old] = rng.standard_normal((len(old), K, H)) * 4
      v[old] = rng.standard_normal((len(old), K, H)) * 4
  return (jnp.asarray(k, dtype)[None], jnp.asarray(v, dtype)[None],
          jnp.asarray(k_pos, jnp.int32)[None])


def _call(fn, q_seq, cache, rows: int, target_index: int, *, window, softcap, seed=1):
  """A call of `rows` query rows with TARGET's query at `target_index`; the other rows are random
  queries at random positions (some padding). Returns TARGET's output row [N, H]."""
  rng = np.random.default_rng(seed)
  q = np.asarray(rng.standard_normal((rows, N, H)) * 3 * H ** -0.5, np.float32)
  q_pos = rng.integers(-1, OFFSET + 64, rows)
  q[target_index] = np.asarray(q_seq[TARGET], np.float32)
  q_pos[target_index] = OFFSET + TARGET
  k, v, k_pos = cache
  out = fn(jnp.asarray(q, q_seq.dtype)[None], k, v, jnp.asarray(q_pos, jnp.int32)[None], k_pos,
           window=window, softcap=softcap)
  return out[0, target_index]


BIT_SCENARIOS = [(jnp.float32, None, None), (jnp.bfloat16, 16, 50.0)]
BIT_IDS = ['f32', 'bf16_window_softcap']


@pytest.mark.parametrize('dtype, window, softcap', BIT_SCENARIOS, ids=BIT_IDS)
def test_pallas_row_bits_independent_of_row_index_and_num_rows(dtype, window, softcap):
  fn = make_pallas_attention(tile_size=TILE)
  q_seq, k_seq, v_seq = _sequence(dtype)
  cache = _cache(k_seq, v_seq, TARGET + 1, 256)
  kw = dict(window=window, softcap=softcap)
  alone = _call(fn, q_seq, cache, 1, 0, **kw)
  # T = 7 with the row at index 0 and at index 5; T = 32 with the row in the third row block.
  for rows, index, seed in [(7, 0, 1), (7, 5, 2), (32, 17, 3), (32, 31, 4)]:
    _assert_same_bits(_call(fn, q_seq, cache, rows, index, seed=seed, **kw), alone)


@pytest.mark.parametrize('dtype, window, softcap', BIT_SCENARIOS, ids=BIT_IDS)
def test_pallas_row_bits_independent_of_tiles_past_position_and_masked_garbage(
    dtype, window, softcap):
  fn = make_pallas_attention(tile_size=TILE)
  q_seq, k_seq, v_seq = _sequence(dtype)
  kw = dict(window=window, softcap=softcap)
  short = _call(fn, q_seq, _cache(k_seq, v_seq, TARGET + 1, 64), 1, 0, **kw)  # 2 tiles
  long_empty = _call(fn, q_seq, _cache(k_seq, v_seq, TARGET + 1, 256), 1, 0, **kw)  # 8 tiles
  _assert_same_bits(long_empty, short)
  for garbage_seed in (10, 11):  # two different garbage fills of everything masked
    for slots in (64, 256):
      cache = _cache(k_seq, v_seq, TARGET + 1, slots, garbage_seed=garbage_seed, window=window)
      _assert_same_bits(_call(fn, q_seq, cache, 1, 0, **kw), short)
  # and inside a multi-row call over a garbage-filled cache
  cache = _cache(k_seq, v_seq, TARGET + 1, 256, garbage_seed=12, window=window)
  _assert_same_bits(_call(fn, q_seq, cache, 7, 5, seed=2, **kw), short)


def test_pallas_row_bits_independent_of_tiles_with_default_blocks():
  """The same claim under the cpu default blocks (16 rows x 128 slots): 1 tile vs 2 tiles."""
  fn = make_pallas_attention()
  q_seq, k_seq, v_seq = _sequence(jnp.float32)
  short = _call(fn, q_seq, _cache(k_seq, v_seq, TARGET + 1, 64), 1, 0, window=None, softcap=None)
  cache = _cache(k_seq, v_seq, TARGET + 1, 256, garbage_seed=3)
  _assert_same_bits(_call(fn, q_seq, cache, 32, 17, window=None, softcap=None), short)


def test_kernel_fully_masked_tile_leaves_state_bits():
  """Folding a tile nobody sees returns (m, l, acc) bit for bit, -0.0 entries included, so
  skipping such a tile (as the kernel does) and computing it agree."""
  rng = np.random.default_rng(0)
  bq, tile, h = 8, 16, 32
  m = jnp.asarray(rng.standard_normal((bq, 1)), jnp.float32).at[0].set(online_softmax.MASKED)
  l = jnp.asarray(rng.random((bq, 1)) + 1, jnp.float32).at[0].set(0.0)
  acc = jnp.asarray(rng.standard_normal((bq, h)), jnp.float32).at[1, :4].set(-0.0)
  q = jnp.asarray(rng.standard_normal((bq, h)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((tile, h)) * 100, jnp.float32)
  v = jnp.asarray(rng.standard_normal((tile, h)) * 100, jnp.float32)
  q_pos = jnp.asarray(rng.integers(-1, 50, (bq, 1)), jnp.int32)
  k_pos = jnp.asarray(rng.choice([-1, 60, 70], (1, tile)), jnp.int32)  # empty or in the future
  visible = online_softmax.visible_slots(q_pos, k_pos, None)
  assert not bool(visible.any())
  for softcap in (None, 30.0):
    state = online_softmax.fold_tile((m, l, acc), q, k, v, visible, softcap=softcap)
    for before, after in zip((m, l, acc), state):
      _assert_same_bits(after, before)


# ------------------------------------------------------------------------------------------------
# (c) One call or a prefix already in the cache: same bits for every row.

HYP_SLOTS, HYP_TILE, HYP_MAX_TOKENS = 48, 16, 40
HYP_BUCKETS = (8, HYP_MAX_TOKENS)  # calls are padded to one of two shapes (as an engine does)


def _hyp_rows(fn, dtype, q_seq, k_seq, v_seq, positions, start, end, **kw):
  """Outputs [end - start, N, H] of tokens start..end-1 fed as one call (padded to a bucket),
  the cache holding tokens 0..end-1 in slots 0..end-1 (the call's own K/V written first)."""
  count = end - start
  rows = min(b for b in HYP_BUCKETS if b >= count)
  q = np.zeros((1, rows, N, H), np.float32)
  q[0, :count] = q_seq[start:end]
  q_pos = np.full((1, rows), -1)
  q_pos[0, :count] = positions[start:end]
  k = np.zeros((1, HYP_SLOTS, K, H), np.float32)
  v = np.zeros((1, HYP_SLOTS, K, H), np.float32)
  k[0, :end], v[0, :end] = k_seq[:end], v_seq[:end]
  k_pos = np.full((1, HYP_SLOTS), -1)
  k_pos[0, :end] = positions[:end]
  out = fn(jnp.asarray(q, dtype), jnp.asarray(k, dtype), jnp.asarray(v, dtype),
           jnp.asarray(q_pos, jnp.int32), jnp.asarray(k_pos, jnp.int32), **kw)
  return np.asarray(out[0, :count])


@pytest.mark.parametrize('dtype, window, softcap', [(jnp.float32, None, None),
                                                    (jnp.bfloat16, 12, 30.0)],
                         ids=['f32', 'bf16_window_softcap'])
@hypothesis.settings(max_examples=40, deadline=None, derandomize=True,
                     suppress_health_check=[hypothesis.HealthCheck.too_slow])
@hypothesis.given(data=st.data())
def test_pallas_kernel_row_bits_same_in_one_call_or_after_cached_prefix(dtype, window, softcap,
                                                                       data):
  tokens = data.draw(st.integers(2, HYP_MAX_TOKENS), label='tokens')
  cuts = data.draw(st.lists(st.integers(1, tokens - 1), max_size=3, unique=True), label='cuts')
  offset = data.draw(st.integers(0, 500), label='first position')
  seed = data.draw(st.integers(0, 2 ** 16), label='seed')
  fn = make_pallas_attention(tile_size=HYP_TILE)
  rng = np.random.default_rng(seed)  # numpy only: no per-shape XLA compiles in the loop
  as_dtype = lambda x: x.astype(dtype).astype(np.float32)  # values exactly representable
  q_seq = as_dtype(rng.standard_normal((tokens, N, H)) * 3 * H ** -0.5)
  k_seq, v_seq = (as_dtype(rng.standard_normal((tokens, K, H))) for _ in range(2))
  positions = offset + np.arange(tokens)
  kw = dict(window=window, softcap=softcap)
  one_call = _hyp_rows(fn, dtype, q_seq, k_seq, v_seq, positions, 0, tokens, **kw)
  bounds = [0, *sorted(cuts), tokens]
  split = np.concatenate([_hyp_rows(fn, dtype, q_seq, k_seq, v_seq, positions, a, b, **kw)
                          for a, b in zip(bounds[:-1], bounds[1:])])
  _assert_same_bits(split, one_call)


# ------------------------------------------------------------------------------------------------
# (d) Padding rows.


def test_pallas_padding_rows_finite():
  fn = make_pallas_attention(tile_size=TILE)
  q_seq, k_seq, v_seq = _sequence(jnp.float32)
  for window, softcap in [(None, None), (16, 50.0)]:
    # every row padding, over an empty cache and over a full one; padding queries huge
    for filled in (0, 64):
      k, v, k_pos = _cache(k_seq, v_seq, filled, 64)
      q = jnp.full((1, 7, N, H), 1e30, jnp.float32)
      out = fn(q, k, v, jnp.full((1, 7), -1, jnp.int32), k_pos, window=window, softcap=softcap)
      assert np.isfinite(np.asarray(out)).all()
    # padding rows next to real rows: finite, and the real rows unaffected
    k, v, k_pos = _cache(k_seq, v_seq, TARGET + 1, 64)
    q = jnp.asarray(np.asarray(q_seq[:7]))[None]
    q_pos = jnp.asarray([[OFFSET, -1, OFFSET + 2, -1, -1, OFFSET + 5, -1]], jnp.int32)
    out = np.asarray(fn(q, k, v, q_pos, k_pos, window=window, softcap=softcap))
    assert np.isfinite(out).all()
    ref = np.asarray(attend(q, k, v, q_pos, k_pos, window=window, softcap=softcap))
    real = np.asarray(q_pos[0] >= 0)
    assert _normwise_error(out[0, real], ref[0, real]) <= F32_TOL


# ------------------------------------------------------------------------------------------------
# The API and the model.


def test_make_pallas_attention_defaults_on_cpu():
  fn = make_pallas_attention()
  assert fn.platform == 'cpu' and fn.interpret
  assert hash(fn) == hash(make_pallas_attention())  # a valid static jit argument
  assert fn.block_config(256, jnp.bfloat16) == default_block_config('cpu', 256, jnp.bfloat16)
  gpu = default_block_config('gpu', 128, jnp.bfloat16)
  assert (gpu.block_q, gpu.tile_size, gpu.num_warps) == (64, 64, 4)
  tpu = default_block_config('tpu', 256, jnp.bfloat16)
  assert tpu.block_q % 8 == 0 and tpu.tile_size % 128 == 0
  with pytest.raises(ValueError):
    make_pallas_attention(interpret=False)  # CPU has no compiled Pallas


def test_pallas_kernel_as_model_attention_fn():
  """tiny_gemma2 (GQA, softcap, sliding window) with the kernel as attention_fn: close to the
  reference attention's hidden states (float32)."""
  config = gcfg.get_config('tiny_gemma2')
  # Seeded random weights straight from numpy (init_params builds the NNX model eagerly, which
  # costs seconds here); any weights do for checking the attention_fn plumbing.
  rng = np.random.default_rng(0)
  params = jax.tree.map(lambda s: jnp.asarray(rng.standard_normal(s.shape) * 0.2, s.dtype),
                        gmodel.abstract_params(config))
  tokens = jnp.asarray([[2, 17, 5, 9, 33, 4, 8, 21, 60, 3, 11, 40]], jnp.int32)
  positions = jnp.arange(tokens.shape[1], dtype=jnp.int32)[None]
  kv = kvs.init_kv_state(config, batch_size=1, cache_len=16, dtype=jnp.float32)

  ref = jax.jit(lambda: gmodel.forward(params, config, tokens, positions, kv)[0])()
  out = jax.jit(lambda: gmodel.forward(params, config, tokens, positions, kv,
                                       make_pallas_attention())[0])()
  assert _normwise_error(out, ref) <= 1e-4  # 4 layers of F32_TOL-sized differences, amplified
