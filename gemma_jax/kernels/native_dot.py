"""The written arithmetic's contractions as native CPU kernels behind XLA's FFI.

    dot = make_native_dot()                    # the best path of this CPU
    y = dot.matmul(x, w, chunk)                # x [M, I] @ w [I, O], chunks of `chunk` terms
    s = dot.tile_scores(q, k, chunk)           # q [B, K, R, H] . k [B, K, n, S, H]
    o = dot.tile_values(p, v)                  # p [B, K, n, R, S] @ v [B, K, n, S, H]

Each output is the spec's chain (docs/determinism.md): per contraction chunk, acc = fma(a, b,
acc) with k in order from +0, the chunk results added in chunk order; subnormals flushed. The
loops are ours (gemma_jax/kernels/csrc), so no library chooses an order: a vector lane only
holds independent outputs, and threads split rows and columns, never a contraction. The result
is the same on every path (AVX-512, AVX2+FMA, NEON, portable std::fma) and at every thread
count, which tests/test_native_dot.py checks against gemma_jax.spec.binary32.

The path is chosen when the kernel is made: $GEMMA_JAX_NATIVE_ISA (a name in ISAS, listed once in
native_build) forces one; otherwise the best the CPU has, capped by XLA's own cap where
XLA_FLAGS sets --xla_cpu_max_isa (SSE4_2 or AVX: the portable path; AVX2: avx2). Neither the
path nor the thread count decides a bit, so neither is in the engine fingerprint.

The kernels are compiled on first use (gemma_jax.kernels.native_build) and registered with XLA
as CPU custom calls.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import os
import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from gemma_jax import sharding
from gemma_jax.kernels import native_build

ISAS = native_build.ISAS  # the paths; the index is the kernel's `isa` code
ISA_VARIABLE = 'GEMMA_JAX_NATIVE_ISA'
_TARGETS = {'gemma_spec_matmul': 'GemmaSpecMatmul', 'gemma_spec_matmul_packed': 'GemmaSpecMatmulPacked',
            'gemma_spec_scores': 'GemmaSpecScores', 'gemma_spec_values': 'GemmaSpecValues',
            'gemma_spec_attend': 'GemmaSpecAttend'}
PANEL = 64  # columns of a packed weight panel (ffi.cc kPanel)
# --xla_cpu_max_isa -> the most this kernel uses under it.
_XLA_CAPS = {'SSE4_2': 'portable', 'AVX': 'portable', 'AVX2': 'avx2'}


@functools.lru_cache(maxsize=1)
def _library() -> ctypes.CDLL:
  """The compiled kernels, loaded and registered with XLA once per process."""
  lib = ctypes.cdll.LoadLibrary(native_build.library())
  for target, symbol in _TARGETS.items():
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform='cpu')
  for name in ('gemma_spec_resolve', 'gemma_spec_path_calls'):
    getattr(lib, name).restype = ctypes.c_int64
    getattr(lib, name).argtypes = [ctypes.c_int64]
  return lib


def resolve(isa: str) -> str:
  """The path `isa` runs on this CPU ('auto': the best); ValueError where it cannot run here."""
  if isa not in ISAS:
    raise ValueError(f'unknown native kernel path {isa!r}; expected one of {ISAS}')
  code = _library().gemma_spec_resolve(ISAS.index(isa))
  if code < 0:
    raise ValueError(f'this CPU cannot run the native kernel path {isa!r}')
  return ISAS[code]


def available_paths() -> tuple[str, ...]:
  """The paths this CPU runs (portable always)."""
  lib = _library()
  return tuple(name for i, name in enumerate(ISAS) if i and lib.gemma_spec_resolve(i) == i)


def path_calls() -> dict[str, int]:
  """Work items each path this library has (portable, and avx2 and avx512 or neon) has run in
  this process, as counted by the path's own code: which path a request ran on (no bit tells)."""
  lib = _library()
  counts = {name: lib.gemma_spec_path_calls(i) for i, name in enumerate(ISAS) if i}
  return {name: count for name, count in counts.items() if count >= 0}


def default_isa() -> str:
  """$GEMMA_JAX_NATIVE_ISA, else XLA's --xla_cpu_max_isa cap, else 'auto'."""
  forced = os.environ.get(ISA_VARIABLE)
  if forced:
    return forced
  cap = re.search(r'--xla_cpu_max_isa=(\w+)', sharding.xla_flags())
  return _XLA_CAPS.get(cap.group(1).upper(), 'auto') if cap else 'auto'


@dataclasses.dataclass(frozen=True)
class NativeDot:
  """The spec's contractions on `isa` (a name in ISAS, resolved on this CPU) in up to `parts`
  work items at once (0: as many as XLA's intra-op thread pool has threads). Neither decides a
  bit.

  partitioned: on a mesh, each call is split by XLA's partitioner over the factors a kernel
  never contracts (rows and columns of a projection, batch and KV heads of attention), so each
  device computes its own outputs; a contraction is never split (`_partitioned`). Off a mesh the
  calls are plain custom calls (a partitioned call holds a Python callback, which keeps its
  executable out of the persistent compilation cache)."""

  isa: str = 'auto'
  parts: int = 0
  partitioned: bool = False

  def _call(self, target, out_shape, *args, **attrs):
    _library()
    return jax.ffi.ffi_call(target, jax.ShapeDtypeStruct(out_shape, jnp.float32))(
        *args, isa=np.int64(ISAS.index(self.isa)), parts=np.int64(self.parts),
        **{k: v if isinstance(v, np.floating) else np.int64(v) for k, v in attrs.items()})

  def matmul(self, x: jax.Array, w: jax.Array, chunk: int,
             rows: jax.Array | None = None) -> jax.Array:
    """x [M, I] @ w [I, O] (float32) over chunks of `chunk` terms added in chunk order. rows: an
    int32 scalar, the first rows to compute (the rest of the output is +0; None: all M)."""
    _check_f32(x, w)
    if self.partitioned:  # each device's shard of rows is computed whole
      call = lambda a, b: self._call('gemma_spec_matmul', (a.shape[0], b.shape[1]), a, b,  # noqa
                                     _valid(None, a.shape[0]), chunk=chunk)
      return _partitioned(call, 'm k, k n -> m n', keep='mn')(x, w)
    return self._call('gemma_spec_matmul', (x.shape[0], w.shape[1]), x, w,
                      _valid(rows, x.shape[0]), chunk=chunk)

  def packs(self, k: int, n: int) -> bool:
    """Whether a [k, n] weight is kept packed (`pack`): whole panels only, and not on a mesh
    (the weights keep the layout the mesh places them in; calls are partitioned instead)."""
    return not self.partitioned and n % PANEL == 0

  def matmul_packed(self, x: jax.Array, panels: jax.Array, chunk: int,
                    rows: jax.Array | None = None) -> jax.Array:
    """x [M, I] @ the weight `pack` made `panels` from -> [M, O], bit for bit `matmul`'s (rows:
    as there)."""
    _check_f32(x, panels)
    return self._call('gemma_spec_matmul_packed', (x.shape[0], panels.shape[0] * PANEL), x,
                      panels, _valid(rows, x.shape[0]), chunk=chunk)

  @property
  def attends(self) -> bool:
    """Whether `attend` computes attention whole here (not on a mesh: its calls stay whole)."""
    return not self.partitioned

  def on_mesh(self, mesh: Mesh | None) -> 'NativeDot':
    """This kernel partitioned by XLA's partitioner where it runs on a mesh (`partitioned`)."""
    return dataclasses.replace(self, partitioned=mesh is not None)

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
             k_pos: jax.Array, *, window: int | None, softcap: float | None, tile: int,
             chunk: int, relative: tuple | None = None) -> jax.Array:
    """The spec's tiled attention whole (csrc/attention.h): q [B, T, N, H] (scaled), the cache's
    k, v [B, S, K, H] (float32), q_pos [B, T], k_pos [B, S] (int32, -1: a padding row, an empty
    slot) -> [B, T, N, H] float32, with `tile` slots per tile and scores over H in chunks of
    `chunk`. Only the tiles some row sees are computed: the work follows the context, the bits
    do not (gemma_jax.tiled_attention computes the same with XLA ops over the tiles read).
    relative: (inverse frequencies [H/2] float32, rotated pairs, scale) of the relative RoPE
    mode (gemma_jax.rope.RelativeScores): q and k unrotated, each key turned back by the angle
    of its offset from the query, inside the kernel; None: q and k rotated already."""
    _check_f32(q, k, v)
    inverse, rotated, scale = relative if relative is not None else (np.zeros(1), 0, 1.0)
    return self._call('gemma_spec_attend', q.shape, q, k, v, q_pos.astype(jnp.int32),
                      k_pos.astype(jnp.int32), jnp.asarray(inverse, jnp.float32), tile=tile,
                      chunk=chunk, window=window or 0, softcap=np.float32(softcap or 0.0),
                      relative=int(relative is not None), rotated=rotated,
                      rope_scale=np.float32(scale))

  def tile_scores(self, q: jax.Array, k: jax.Array, chunk: int) -> jax.Array:
    """q [B, K, R, H] . k [B, K, n, S, H] -> [B, K, n, R, S]: every tile's scores against the
    same rows, contracted over H in chunks of `chunk`."""
    _check_f32(q, k)

    def call(q, k):
      b, kv, r, h = q.shape
      n, s = k.shape[2], k.shape[3]
      out = self._call('gemma_spec_scores', (b * kv, n, r, s), q.reshape(b * kv, r, h),
                       k.reshape(b * kv, n, s, h), chunk=chunk)
      return out.reshape(b, kv, n, r, s)

    if self.partitioned:
      return _partitioned(call, 'b k r h, b k n s h -> b k n r s', keep='bk')(q, k)
    return call(q, k)

  def tile_values(self, p: jax.Array, v: jax.Array) -> jax.Array:
    """p [B, K, n, R, S] @ v [B, K, n, S, H] -> [B, K, n, R, H], one chain over a tile's S
    slots."""
    _check_f32(p, v)

    def call(p, v):
      b, kv, n, r, s = p.shape
      h = v.shape[-1]
      out = self._call('gemma_spec_values', (b * kv, n, r, h), p.reshape(b * kv, n, r, s),
                       v.reshape(b * kv, n, s, h))
      return out.reshape(b, kv, n, r, h)

    if self.partitioned:
      return _partitioned(call, 'b k n r s, b k n s h -> b k n r h', keep='bk')(p, v)
    return call(p, v)


def _partitioned(call, rule: str, keep: str):
  """`call` (one device's kernel call) as a function XLA's partitioner splits over the factors
  of `rule` (einsum-like, one letter per dimension) named in `keep`: each operand keeps its
  sharding along those and is gathered whole along every other (the contracted ones among
  them), and each device runs `call` on its shards. A factor sharded in several operands takes
  the first operand's axes."""
  operands, result = (side.strip() for side in rule.split('->'))
  names = [part.split() for part in operands.split(',')]
  out_names = result.split()

  def shardings(mesh: Mesh, arg_shapes: tuple) -> tuple[tuple[NamedSharding, ...], NamedSharding]:
    axes: dict[str, str] = {}
    for factors, shape in zip(names, arg_shapes):
      spec = tuple(shape.sharding.spec) + (None,) * (len(factors) - len(shape.sharding.spec))
      for factor, axis in zip(factors, spec):
        if factor in keep and axis is not None:
          axes.setdefault(factor, axis)
    args = tuple(NamedSharding(mesh, PartitionSpec(*(axes.get(f) for f in factors)))
                 for factors in names)
    return args, NamedSharding(mesh, PartitionSpec(*(axes.get(f) for f in out_names)))

  def infer(mesh, arg_shapes, result_shape):
    del result_shape
    return shardings(mesh, arg_shapes)[1]

  def partition(mesh, arg_shapes, result_shape):
    del result_shape
    args, out = shardings(mesh, arg_shapes)
    return mesh, call, out, args

  function = custom_partitioning(call)
  function.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule)
  return function


def pack(w: jax.Array) -> jax.Array:
  """An [I, O] weight (O a multiple of PANEL) as column panels [O / PANEL, I, PANEL]: panel j
  holds columns [j PANEL, (j + 1) PANEL), each term's PANEL columns contiguous, so that a call reads a
  weight as one contiguous run per panel whatever its row count (a layout, not a value: the
  products and their order are `matmul`'s)."""
  k, n = w.shape
  return w.reshape(k, n // PANEL, PANEL).transpose(1, 0, 2)


def _valid(rows: jax.Array | None, m: int) -> jax.Array:
  """The kernels' row-count operand: int32 [1]."""
  return jnp.full((1,), m, jnp.int32) if rows is None else jnp.reshape(rows, (1,)).astype(
      jnp.int32)


def _check_f32(*arrays):
  for a in arrays:
    if a.dtype != jnp.float32:
      raise ValueError(f'the native spec kernels are binary32; got {a.dtype}')


def make_native_dot(isa: str | None = None, parts: int = 0) -> NativeDot:
  """The native kernels on `isa` (None: `default_isa()`), resolved on this CPU: builds and loads
  them on first use (native_build.BuildError where this machine cannot)."""
  return NativeDot(isa=resolve(default_isa() if isa is None else isa), parts=parts)
