"""Pallas attention over the explicit KV cache, with the signature of `gemma_jax.attention.attend`.

    attention_fn = make_pallas_attention()          # backend defaults
    out = attention_fn(q, k, v, q_pos, k_pos, window=None, softcap=None)

q [B, T, N, H] (already scaled), k, v [B, S, K, H] (the cache buffers), q_pos [B, T] (-1: padding
row), k_pos [B, S] (-1: empty slot) -> [B, T, N, H] in v's dtype. One kernel serves prefill
blocks (T rows) and decode (T = 1 or a few rows).

Layout. The G = N / K query heads that share a KV head are grouped: for KV head h the kernel sees
the T * G rows (token t, head g) -> row t * G + g, zero-padded to a multiple of `block_q` with
q_pos = -1. The cache is padded with empty slots (k_pos = -1) to a multiple of `tile_size` (a copy
of the cache: engines should size S as a multiple of the tile) and viewed as [B, S, K * H] (a free
reshape), so KV head h is the column block h and the cache is never transposed.

Algorithm. For each (batch, KV head, block of `block_q` rows) the kernel walks the KV tiles
j = 0, 1, ..., S / tile_size - 1 in ascending order, tile j being slots [j * tile, (j + 1) * tile),
and folds each into a running (max m, sum l, accumulator acc) in float32 (`online_softmax`).
On cpu/gpu a tile that no row of the block can see is skipped (the tpu driver folds it, which
gives the same bits, see 3. below).

Why a row's bits depend only on the cache contents and the row's position
(the invariance argument; tests/test_pallas_kernel.py checks each clause bit for bit):

1. Fixed shapes. Every dot, reduction and elementwise op runs on [block_q, tile_size],
   [block_q, H] or [tile_size, H] arrays whatever T, S, B or the row's index are: `block_q` and
   `tile_size` are fixed per (backend, head dim, dtype) by `BlockConfig`, never chosen from T or S.
   At a fixed shape each output row of a dot or a row-wise reduction is computed by the same
   instruction sequence for every row and never mixes rows (measured for XLA:CPU, see
   docs/determinism.md; how MMA tiles work on GPU), so the other rows (real, padding, or
   another call's tokens) and the row's place in the block cannot change its bits.
2. Fixed order. Tiles are aligned to absolute slot indices and folded in ascending order, so the
   floating-point reduction over the cache is the same sequence of operations for every call that
   sees the same cache. Slots are assigned by sequence index (kv_state), so a token occupies the
   same slot whether it was written by this call or an earlier one.
3. Masked means absent. A masked logit enters as an exact 0 in p (`where`, not exp(-big)), and a
   row that sees nothing in a tile keeps its (m, l, acc) bit for bit (the state update is a
   `where` on "this row saw something"). So tiles past a row's position, empty slots, padding and
   whatever finite values they hold do not change the row's bits, and skipping a tile is exact.
   (Masked slots must hold finite values, as for the reference: 0 * inf is NaN in any kernel.)
4. Nothing else enters: no split-K, no atomics, no cross-program reduction; the output block of a
   row is written once by one program.

Hence a row's output is a function of (q row, its position, the cache contents and positions) and
of the BlockConfig, the backend and the compiler: put the config in the engine fingerprint.

Block shapes per backend (`default_block_config`):

  cpu (interpret): block_q 16, tile 128. Interpret mode runs the kernel body as XLA:CPU ops; small
      row blocks keep decode cheap, large tiles keep the tile loop short.
  gpu (Triton via pl.pallas_call): power-of-two blocks as Triton requires. H <= 128: 64 rows x 64
      slots, num_warps 4; H = 256: 64 x 64, num_warps 8; H = 512: 32 x 32, num_warps 8 (keeps the
      f32 accumulator in registers and K/V tiles in shared memory); num_stages 2 (1 for float32).
      Float32 dots use IEEE (precision HIGHEST), not TF32. Head dims must be powers of two.
      K/V of one (batch, KV head) are one block [S, H] in global memory that the kernel reads tile
      by tile (the pattern of jax.experimental.pallas.ops.gpu.attention).
  tpu (Mosaic): 128 rows x 512 slots; grid (B, K, row blocks, tiles) with the tile axis
      "arbitrary" and (m, l, acc) in VMEM scratch (the pattern of ops/tpu/flash_attention); the
      last two block dims are multiples of (8, 128): q_pos is lane-replicated [B, R, 128], k_pos
      sublane-replicated [B, 8, S], H a multiple of 128.

The gpu and tpu configurations were checked in interpret mode on CPU (same arithmetic, same
bits as the cpu driver for equal blocks) and lowered for cuda (Triton) and tpu (Mosaic) from a
CPU-only host (tests/test_lowering.py), not yet compiled on the hardware.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.typing import DTypeLike

from gemma_jax.kernels import online_softmax as osm
from gemma_jax.sizes import round_up

PLATFORMS = ('cpu', 'gpu', 'tpu')
_TPU_LANES = 128
_TPU_SUBLANES = 8


@dataclasses.dataclass(frozen=True)
class BlockConfig:
  """Everything about the kernel that can change its bits (with the backend and compiler).

  platform: 'cpu' and 'gpu' run the tile loop inside one program per row block; 'tpu' puts the
  tiles on the grid. block_q: query rows per program. tile_size: KV slots per tile.
  num_warps, num_stages: Triton only."""
  platform: str
  block_q: int
  tile_size: int
  num_warps: int | None = None
  num_stages: int | None = None

  def __post_init__(self):
    if self.platform not in PLATFORMS:
      raise ValueError(f'platform must be one of {PLATFORMS}, got {self.platform!r}')
    if self.block_q < 1 or self.tile_size < 1:
      raise ValueError(f'block sizes must be positive: {self}')


def default_block_config(platform: str, head_dim: int, dtype: DTypeLike, *, tile_size: int | None = None,
                         block_q: int | None = None) -> BlockConfig:
  """The block shapes for a backend, head dim and dtype (see the module docstring)."""
  itemsize = jnp.dtype(dtype).itemsize
  if platform == 'cpu':
    bq, tile, warps, stages = 16, 128, None, None
  elif platform == 'gpu':
    if head_dim <= 128:
      bq, tile, warps = 64, 64, 4
    elif head_dim <= 256:
      bq, tile, warps = 64, 64, 8
    else:
      bq, tile, warps = 32, 32, 8
    stages = 2 if itemsize <= 2 else 1
  elif platform == 'tpu':
    bq, tile, warps, stages = 128, 512, None, None
  else:
    raise ValueError(f'platform must be one of {PLATFORMS}, got {platform!r}')
  return BlockConfig(platform=platform, block_q=block_q or bq, tile_size=tile_size or tile,
                     num_warps=warps, num_stages=stages)


def _check_config(config: BlockConfig, head_dim: int, interpret: bool) -> None:
  if interpret:
    return
  pow2 = lambda n: n & (n - 1) == 0
  if config.platform == 'gpu' and not all(map(pow2, (config.block_q, config.tile_size, head_dim))):
    raise ValueError(f'Triton needs power-of-two blocks and head dim: {config}, H={head_dim}')
  if config.platform == 'tpu' and (config.block_q % _TPU_SUBLANES or config.tile_size % _TPU_LANES
                                   or head_dim % _TPU_LANES):
    raise ValueError(f'Mosaic needs block_q % 8, tile % 128 and H % 128 == 0: {config}, '
                     f'H={head_dim}')


# ---------------------------------------------------------------------------------------------
# cpu / gpu driver: one program per (batch, KV head, row block), the tile loop inside it.


def _loop_kernel(q_pos_ref, k_pos_ref, q_ref, k_ref, v_ref, o_ref, *, tile: int, window,
                 softcap):
  # q_pos_ref [bq], k_pos_ref [S], q_ref [bq, H], k_ref, v_ref [S, H], o_ref [bq, H]
  block_q, head_dim = q_ref.shape
  num_tiles = k_ref.shape[0] // tile
  q = q_ref[...]
  q_pos = q_pos_ref[...][:, None]  # [bq, 1]

  def fold(j, state):
    slots = pl.ds(pl.multiple_of(j * tile, tile), tile)
    visible = osm.visible_slots(q_pos, k_pos_ref[slots][None, :], window)  # [bq, tile]
    return jax.lax.cond(
        osm.any_visible(visible),
        lambda s: osm.fold_tile(s, q, k_ref[slots, :], v_ref[slots, :], visible, softcap=softcap),
        lambda s: s, state)

  state = jax.lax.fori_loop(0, num_tiles, fold, osm.initial_state(block_q, head_dim))
  o_ref[...] = osm.finish(state).astype(o_ref.dtype)


def _loop_call(q_pos, k_pos, q, k, v, *, config: BlockConfig, window, softcap, interpret):
  # q_pos [B, R], k_pos [B, S], q [B, K, R, H], k, v [B, S, K * H] -> [B, K, R, H]
  batch, num_kv_heads, rows, head_dim = q.shape
  slots = k.shape[1]
  bq = config.block_q
  compiler_params = None
  if config.platform == 'gpu' and not interpret:
    from jax.experimental.pallas import triton as plgpu  # Pallas's GPU backend: only on a GPU
    compiler_params = plgpu.CompilerParams(num_warps=config.num_warps,
                                           num_stages=config.num_stages)
  kv_spec = pl.BlockSpec((None, slots, head_dim), lambda b, h, i: (b, 0, h))
  row_spec = pl.BlockSpec((None, None, bq, head_dim), lambda b, h, i: (b, h, i, 0))
  return pl.pallas_call(
      functools.partial(_loop_kernel, tile=config.tile_size, window=window, softcap=softcap),
      out_shape=jax.ShapeDtypeStruct(q.shape, v.dtype),
      grid=(batch, num_kv_heads, rows // bq),
      in_specs=[
          pl.BlockSpec((None, bq), lambda b, h, i: (b, i)),
          pl.BlockSpec((None, slots), lambda b, h, i: (b, 0)),
          row_spec, kv_spec, kv_spec,
      ],
      out_specs=row_spec,
      compiler_params=compiler_params,
      interpret=interpret,
      name='gemma_pallas_attention',
  )(q_pos, k_pos, q, k, v)


# ---------------------------------------------------------------------------------------------
# tpu driver: tiles on the grid's last ("arbitrary") axis, the state in VMEM scratch.


def _grid_kernel(q_pos_ref, k_pos_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, acc_ref, *,
                 window, softcap):
  # q_pos_ref [bq, 128] (lane-replicated), k_pos_ref [8, tile] (sublane-replicated),
  # q_ref [bq, H], k_ref, v_ref [tile, H], o_ref [bq, H]; scratch m, l [bq, 128], acc [bq, H]
  j = pl.program_id(3)

  def load_state():
    return m_ref[...][:, :1], l_ref[...][:, :1], acc_ref[...]

  def store_state(state):
    m, l, acc = state
    m_ref[...] = jnp.broadcast_to(m, m_ref.shape)
    l_ref[...] = jnp.broadcast_to(l, l_ref.shape)
    acc_ref[...] = acc

  @pl.when(j == 0)
  def _():
    store_state(osm.initial_state(*acc_ref.shape))

  # Every tile is folded, none skipped: a fully masked tile leaves the state bit-identical, so
  # this equals the loop driver's skipping; skipping here would need a scalar predicate
  # (e.g. scalar-prefetched tile bounds) rather than one reduced from a vector.
  visible = osm.visible_slots(q_pos_ref[...][:, :1], k_pos_ref[...][:1, :], window)
  store_state(osm.fold_tile(load_state(), q_ref[...], k_ref[...], v_ref[...], visible,
                            softcap=softcap))

  @pl.when(j == pl.num_programs(3) - 1)
  def _():
    o_ref[...] = osm.finish(load_state()).astype(o_ref.dtype)


def _grid_call(q_pos, k_pos, q, k, v, *, config: BlockConfig, window, softcap, interpret):
  from jax.experimental.pallas import tpu as pltpu  # Pallas's TPU backend (heavy): only for a TPU
  batch, num_kv_heads, rows, head_dim = q.shape
  slots = k.shape[1]
  bq, tile = config.block_q, config.tile_size
  q_pos = jnp.broadcast_to(q_pos[:, :, None], (batch, rows, _TPU_LANES))
  k_pos = jnp.broadcast_to(k_pos[:, None, :], (batch, _TPU_SUBLANES, slots))
  row_spec = pl.BlockSpec((None, None, bq, head_dim), lambda b, h, i, j: (b, h, i, 0))
  kv_spec = pl.BlockSpec((None, tile, head_dim), lambda b, h, i, j: (b, j, h))
  return pl.pallas_call(
      functools.partial(_grid_kernel, window=window, softcap=softcap),
      out_shape=jax.ShapeDtypeStruct(q.shape, v.dtype),
      grid=(batch, num_kv_heads, rows // bq, slots // tile),
      in_specs=[
          pl.BlockSpec((None, bq, _TPU_LANES), lambda b, h, i, j: (b, i, 0)),
          pl.BlockSpec((None, _TPU_SUBLANES, tile), lambda b, h, i, j: (b, 0, j)),
          row_spec, kv_spec, kv_spec,
      ],
      out_specs=row_spec,
      scratch_shapes=[pltpu.VMEM((bq, _TPU_LANES), jnp.float32),
                      pltpu.VMEM((bq, _TPU_LANES), jnp.float32),
                      pltpu.VMEM((bq, head_dim), jnp.float32)],
      compiler_params=pltpu.CompilerParams(
          dimension_semantics=('parallel', 'parallel', 'parallel', 'arbitrary')),
      interpret=interpret,
      name='gemma_pallas_attention',
  )(q_pos, k_pos, q, k, v)


# ---------------------------------------------------------------------------------------------
# The attend-compatible wrapper.


@functools.partial(jax.jit, static_argnames=('window', 'softcap', 'config', 'interpret'))
def pallas_attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
                  window: int | None, softcap: float | None, config: BlockConfig,
                  interpret: bool) -> jax.Array:
  """`attend` computed by the Pallas kernel under an explicit BlockConfig."""
  batch, num_tokens, num_heads, head_dim = q.shape
  slots, num_kv_heads = k.shape[1], k.shape[2]
  if num_heads % num_kv_heads:
    raise ValueError(f'num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}')
  if k.shape != v.shape or (k.shape[0], k.shape[3]) != (batch, head_dim):
    raise ValueError(f'shapes do not match: q {q.shape}, k {k.shape}, v {v.shape}')
  _check_config(config, head_dim, interpret)
  if q.dtype != k.dtype:  # the reference's einsum promotes; so do we
    dtype = jnp.promote_types(q.dtype, k.dtype)
    q, k = q.astype(dtype), k.astype(dtype)
  group = num_heads // num_kv_heads
  rows = num_tokens * group
  padded_rows = round_up(rows, config.block_q)
  padded_slots = round_up(slots, config.tile_size)

  # Rows: (token t, head g of KV head h) -> [B, K, t * G + g, H]; pad rows are queries at -1.
  q_rows = q.reshape(batch, num_tokens, num_kv_heads, group, head_dim).transpose(0, 2, 1, 3, 4)
  q_rows = q_rows.reshape(batch, num_kv_heads, rows, head_dim)
  q_rows = jnp.pad(q_rows, ((0, 0), (0, 0), (0, padded_rows - rows), (0, 0)))
  row_pos = jnp.repeat(q_pos.astype(jnp.int32), group, axis=1)
  row_pos = jnp.pad(row_pos, ((0, 0), (0, padded_rows - rows)), constant_values=-1)
  # Slots: empty slots up to a whole number of tiles; [B, S, K * H] is a free reshape.
  k_pos = k_pos.astype(jnp.int32)
  if padded_slots != slots:
    pad = ((0, 0), (0, padded_slots - slots), (0, 0), (0, 0))
    k, v = jnp.pad(k, pad), jnp.pad(v, pad)
    k_pos = jnp.pad(k_pos, ((0, 0), (0, padded_slots - slots)), constant_values=-1)
  k = k.reshape(batch, padded_slots, num_kv_heads * head_dim)
  v = v.reshape(batch, padded_slots, num_kv_heads * head_dim)

  call = _grid_call if config.platform == 'tpu' else _loop_call
  out = call(row_pos, k_pos, q_rows, k, v, config=config, window=window, softcap=softcap,
             interpret=interpret)  # [B, K, R, H]
  out = out[:, :, :rows].reshape(batch, num_kv_heads, num_tokens, group, head_dim)
  return out.transpose(0, 2, 1, 3, 4).reshape(batch, num_tokens, num_heads, head_dim)


@dataclasses.dataclass(frozen=True)
class PallasAttention:
  """An `AttendFn` (see gemma_jax.attention): hashable, so it can be a static jit argument.

  platform: which block table and driver ('cpu', 'gpu', 'tpu'). tile_size, block_q: override the
  table (None: the table's value for the call's head dim and dtype). interpret: run the kernel
  body as XLA ops (required on CPU)."""
  platform: str
  interpret: bool
  tile_size: int | None = None
  block_q: int | None = None

  def block_config(self, head_dim: int, dtype: DTypeLike) -> BlockConfig:
    """The resolved blocks for a layer: what an engine fingerprint should record."""
    return default_block_config(self.platform, head_dim, dtype, tile_size=self.tile_size,
                                block_q=self.block_q)

  def blocks(self, head_dims: tuple[int, ...], dtype: DTypeLike) -> dict:
    """{head dim: resolved BlockConfig as a dict} (an engine fingerprints these)."""
    return {str(h): dataclasses.asdict(self.block_config(h, dtype)) for h in sorted(head_dims)}

  def slot_multiple(self, head_dims: tuple[int, ...], dtype: DTypeLike) -> int:
    """The largest KV tile: caches that are a multiple of it are never padded by a copy."""
    return max(self.block_config(h, dtype).tile_size for h in head_dims)

  @property
  def tile(self) -> int | None:
    """None: the kernel walks every tile of the cache, skipping what no row sees itself."""
    return None

  def reading(self, max_tiles: int | None) -> 'PallasAttention':
    """Itself: the kernel skips unseen tiles on its own."""
    del max_tiles
    return self

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
               k_pos: jax.Array, *, window: int | None, softcap: float | None,
               scores: Callable | None = None, numerics: object = None) -> jax.Array:
    del numerics  # the kernel's own fixed order (gemma_jax/kernels/online_softmax.py)
    if scores is not None:
      raise ValueError('the Pallas kernel computes plain q . k scores; a RoPE mode with its own '
                       'score function needs attention=xla')
    config = self.block_config(q.shape[-1], jnp.promote_types(q.dtype, k.dtype))
    return pallas_attend(q, k, v, q_pos, k_pos, window=window,
                         softcap=None if softcap is None else float(softcap),
                         config=config, interpret=self.interpret)


def make_pallas_attention(*, tile_size: int | None = None, block_q: int | None = None,
                          interpret: bool | None = None,
                          platform: str | None = None) -> PallasAttention:
  """An attend-compatible Pallas attention function.

  platform defaults to jax.default_backend() ('cpu', 'gpu' (also for 'cuda'/'rocm'), 'tpu');
  interpret defaults to True on CPU and False elsewhere. Passing platform='gpu' or 'tpu' with
  interpret=True runs that backend's blocks and driver in interpret mode (how the tests check
  them on CPU). Passing platform='gpu' or 'tpu' with interpret=False on any host builds the
  compiled kernel for that platform: on a host without it, functions using it can be lowered
  for it (graft/engine/lowering.py) but not run. The cpu driver exists only in interpret mode."""
  backend = jax.default_backend()
  if platform is None:
    platform = {'cuda': 'gpu', 'rocm': 'gpu'}.get(backend, backend)
  if interpret is None:
    interpret = backend == 'cpu'
  if platform == 'cpu' and not interpret:
    raise ValueError('Pallas kernels run on CPU only in interpret mode')
  if platform not in PLATFORMS:
    raise ValueError(f'no Pallas attention for platform {platform!r}')
  return PallasAttention(platform=platform, interpret=bool(interpret), tile_size=tile_size,
                         block_q=block_q)
