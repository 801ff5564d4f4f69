"""Numerics: the model's arithmetic, a small value passed through every call.

    numerics = FIXED_ORDER                     # or XLA, or SPEC (gemma_jax.spec)
    hidden, kv = forward(params, config, tokens, positions, kv, attention_fn, numerics)

A value says how every contraction (`matmul`, `dense`, `logits`, the attention's tiles),
reduction (`mean_square`), elementwise function (`exp`, `tanh`, `gelu`, `rsqrt`, `sin_cos`, the
RoPE `angles`) and fusion barrier (`materialize`, `barrier`) is computed. The model reads
nothing ambient: whatever decides a bit arrives in this value. It is a pytree of three parts,
each with one job:

  the arithmetic  its class and its fingerprinted fields (FixedOrder's k_chunk and small, Spec's
                  version): what docs/determinism.md writes; `describe()` is what the engine
                  fingerprint records
  kernel          the dot kernel that computes Spec's contractions (gemma_jax.kernels.DotKernel;
                  None: XLA's dots): it decides no bit
  call            the per-call bundle (`CallBundle`: the run-time zero of the fusion barriers, the
                  call's real row count, its mesh), the pytree leaves a traced call binds
                  (`bind`); unbound, the barriers are identities

Weights reach the contractions in their stored form (gemma_jax.stored: Panels where a kernel
keeps them), which the engine's WeightLayout decided once.

The values (`NUMERICS`):
  xla          XLA's own reductions, contractions and functions: what XLA picks for the shapes
               at hand (the default engine, the HF parity tests).
  fixed_order  reduction orders fixed by construction (the pinned engine): contraction-chunked
               dots, pairwise-tree row sums, products kept out of later adds, fusion barriers on
               the residual stream. Elementwise functions are XLA's (their bits are the
               platform's: see docs/determinism.md for the Intel/AMD rsqrt finding).
  spec         the written arithmetic of docs/determinism.md (gemma_jax/spec): fixed orders as
               above, and every elementwise function built from IEEE binary32 add, subtract,
               multiply, divide and square root in a stated order, so that a NumPy interpreter
               computes the same bits on any machine.
"""

from __future__ import annotations

import dataclasses
import os
import platform
from typing import Any, Callable, ClassVar, TypeVar

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from gemma_jax import pytree
from gemma_jax.kernels import DotKernel
from gemma_jax.sizes import chunk_size
from gemma_jax.stored import OutputTable, Panels, Table, Weight
from gemma_jax.spec import SPEC_VERSION
from gemma_jax.spec import functions as spec_functions

# A finite "minus infinity" for masked attention scores: exp(MASKED - max) is exactly 0 in
# float32, and a row with every slot masked (a padding row) stays finite instead of NaN.
MASKED = -2.3819763e38


# How the spec engine's XLA multiplies decide the flush: 'code' (the spec's rule computed, as on
# aarch64) or 'hardware' (the product as the hardware rounds and flushes it, as on x86); unset: by
# this machine's rule (`flush_in_code`).
FLUSH_ENV = 'GEMMA_JAX_SPEC_FLUSH'


def flush_in_code() -> bool:
  """Whether the spec's multiplies compute its flush rule in code (`spec_multiply`): where this
  host's flush-to-zero mode decides tininess before rounding (aarch64's FPCR.FZ, under which
  XLA:CPU runs), or where $GEMMA_JAX_SPEC_FLUSH says so. Either way the bits are the spec's, so
  the choice is in no fingerprint; it is decided when a function is traced."""
  value = os.environ.get(FLUSH_ENV, '')
  if value not in ('', 'code', 'hardware'):
    raise ValueError(f'${FLUSH_ENV}={value!r}: expected code or hardware')
  if value:
    return value == 'code'
  return platform.machine().lower() in ('aarch64', 'arm64')


def spec_multiply(a: jax.Array, b: jax.Array,
                  opaque: Callable[[jax.Array], jax.Array] = lambda x: x) -> jax.Array:
  """a * b by the spec's flush rule under a flush-to-zero mode of either rule (docs/determinism.md,
  "aarch64"): r = a b, and s = (a 2^24) b, which rounds the exact product times 2^24 at 24 bits in
  the normal range; where |s| < 2^-101 the result is s 2^-24 (2^-126 where the product rounds up
  to it, a zero of its sign where it is tiny), elsewhere r. `opaque` (a numerics' `materialize`)
  keeps XLA from refolding the scalings. a, b float32 of any shape (broadcast)."""
  with jax.named_scope('spec_flush'):
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    r = a * b
    s = opaque(opaque(a * jnp.float32(2.0 ** 24)) * b)
    return jnp.where(jnp.abs(s) < jnp.float32(2.0 ** -101), s * jnp.float32(2.0 ** -24), r)


def tree_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis (kept, size 1) in a fixed pairwise order: halves are added
  elementwise until one element is left (an odd element rides along to the next level).
  Elementwise adds have no order to choose, so the result is the same for any leading shape.
  [..., X] -> [..., 1]."""
  while x.shape[-1] > 1:
    n = x.shape[-1]
    h = n // 2
    y = x[..., :h] + x[..., h:2 * h]
    x = y if n % 2 == 0 else jnp.concatenate([y, x[..., 2 * h:]], axis=-1)
  return x


@pytree.dataclass
class CallBundle:
  """The per-call bundle: what one traced call binds (a pytree; `Numerics.bind`). zero: a uint32
  scalar [] that is 0 at run time but unknown to the compiler (the fusion barriers OR it in);
  rows: the call's real rows (an int32 scalar [] known at run time: a kernel may skip the
  padding rows after them, whose values nothing reads; None: every row); mesh: where the call
  runs (a static field; None: one device). None of them decides a bit."""

  zero: jax.Array | None = None
  rows: jax.Array | None = None
  mesh: Mesh | None = pytree.field(static=True, default=None)


def fingerprinted(default: Any) -> Any:
  """A field of an arithmetic that decides bits: static, and recorded by `describe()`."""
  return pytree.field(static=True, default=default, metadata={'fingerprinted': True})


_N = TypeVar('_N', bound='Numerics')


@pytree.dataclass
class Numerics:
  """XLA's own arithmetic (name 'xla'): the base the other values refine. Its fields: `kernel`
  (static) and `call` (the per-call bundle); the arithmetics below add their fingerprinted
  parameters."""

  name: ClassVar[str] = 'xla'
  kernel: DotKernel | None = pytree.field(static=True, default=None)
  call: CallBundle = CallBundle()

  def bind(self: _N, call: CallBundle) -> _N:
    """This arithmetic for one traced call (its kernel kept)."""
    return dataclasses.replace(self, call=call)

  def with_zero(self: _N, zero: jax.Array | None) -> _N:
    """This value with the run-time zero `zero` (a uint32 scalar) in its call bundle (the rest
    kept)."""
    return self.bind(dataclasses.replace(self.call, zero=zero))

  def describe(self) -> dict:
    """What the engine fingerprint records: the name and every field that decides a bit."""
    return {'name': self.name, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                                  if f.metadata.get('fingerprinted')}}

  def chunk(self, k: int) -> int:
    """The contraction chunk of a dot over k terms (here all of them)."""
    return k

  def _kernel(self) -> DotKernel:
    if self.kernel is None:
      raise ValueError(f'the {self.name} numerics have no dot kernel for packed weights')
    return self.kernel

  # Fusion barriers ------------------------------------------------------------------------------

  def materialize(self, x: jax.Array) -> jax.Array:
    """x as a value no later add can be contracted with (identity here). Any shape."""
    return x

  def barrier(self, x: jax.Array) -> jax.Array:
    """x computed into its own buffer (identity here). Any shape."""
    return x

  def product(self, a: jax.Array, b: jax.Array) -> jax.Array:
    """a * b where the product feeds an add (rotations): here XLA may contract the two. Any
    shape (broadcast)."""
    return a * b

  def mul(self, a: jax.Array, b: jax.Array) -> jax.Array:
    """a * b, elementwise (any shape): the hardware's product here (the spec's flush rule in
    Spec)."""
    return a * b

  # Contractions and reductions -----------------------------------------------------------------

  def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
    """x [M, I] @ w [I, O]."""
    return x @ w

  def dense(self, x: jax.Array, w: Weight, k: int, n: int) -> jax.Array:
    """x [M, k] @ a weight of k x n values in its stored form (gemma_jax.stored): a parameter
    of any shape holding them in [k, n] order, or the kernel's Panels."""
    if isinstance(w, Panels):
      return self._kernel().matmul_packed(x, w.data, self.chunk(k), rows=self.call.rows)
    return self.matmul(x, w.reshape(k, n))

  def logits(self, table: Table, rows: jax.Array) -> jax.Array:
    """rows [R, D] (float32) against the output table: the tied embedding [V, D] (float32), or
    the OutputTable ([D, V] or its Panels) -> [R, V] float32."""
    if isinstance(table, OutputTable):
      return self._table_logits(table, rows)
    return rows @ table.T

  def _table_logits(self, table: OutputTable, rows: jax.Array) -> jax.Array:
    d = rows.shape[-1]
    data = table.data.data if isinstance(table.data, Panels) else table.data
    return self.dense(rows, table.data, d, data.size // d)

  def tile_scores(self, q: jax.Array, k: jax.Array) -> jax.Array:
    """Attention scores per KV tile: q [B, K, R, H] . k [B, K, n, S, H] -> [B, K, n, R, S]
    (gemma_jax.tiled_attention): the same rows against every tile."""
    return jnp.einsum('bkjrh,bkjsh->bkjrs', _per_tile(q, k), k)

  def row_scores(self, q: jax.Array, k: jax.Array) -> jax.Array:
    """q [M, H] . k [M, S, H] -> [M, S]: each row against keys of its own (the relative RoPE
    mode, gemma_jax.rope.RelativeScores), contracted as `tile_scores` contracts a row: one
    `tile_scores` call per row, padded to two rows (a one-row dot takes another path on
    XLA:CPU)."""
    rows = jnp.stack([q, jnp.zeros_like(q)], axis=1)[:, None]  # [M, 1, 2, H]
    return self.tile_scores(rows, k[:, None, None])[:, 0, 0, 0]

  def tile_values(self, p: jax.Array, v: jax.Array) -> jax.Array:
    """Probabilities times values per KV tile: p [B, K, n, R, S] . v [B, K, n, S, H] ->
    [B, K, n, R, H] (gemma_jax.tiled_attention)."""
    return jnp.einsum('bkjrs,bkjsh->bkjrh', p, v)

  def mean_square(self, x: jax.Array) -> jax.Array:
    """mean(x^2) over the last axis (kept), float32 in and out: [..., X] -> [..., 1]."""
    return jnp.mean(jnp.square(x), axis=-1, keepdims=True)

  # Elementwise functions -----------------------------------------------------------------------

  def rsqrt(self, x: jax.Array) -> jax.Array:
    """1 / sqrt(x), elementwise (any shape)."""
    return jax.lax.rsqrt(x)

  def exp(self, x: jax.Array) -> jax.Array:
    """e^x, elementwise (any shape)."""
    return jnp.exp(x)

  def tanh(self, x: jax.Array) -> jax.Array:
    """tanh x, elementwise (any shape)."""
    return jnp.tanh(x)

  def gelu(self, x: jax.Array) -> jax.Array:
    """GELU with the tanh approximation, as every Gemma uses; elementwise (any shape)."""
    return jax.nn.gelu(x, approximate=True)

  def softcap(self, x: jax.Array, cap: float) -> jax.Array:
    """tanh(x / cap) * cap, elementwise (any shape)."""
    return jnp.tanh(x / cap) * cap

  def timescales(self, head_dim: int, base: float) -> jax.Array:
    """[H/2] float32: base^(2i/H), the reference implementation's per-pair timescale."""
    fraction = 2.0 * jnp.arange(head_dim // 2, dtype=jnp.float32) / head_dim
    return jnp.asarray(base, jnp.float32) ** fraction

  def angles(self, positions: jax.Array, head_dim: int, base: float,
             scale: float = 1.0) -> jax.Array:
    """[..., H/2] float32 RoPE angles position / timescale / scale for integer positions."""
    angles = positions.astype(jnp.float32)[..., None] / self.timescales(head_dim, base)
    return angles if scale == 1.0 else angles / jnp.float32(scale)

  def sin_cos(self, angles: jax.Array) -> tuple[jax.Array, jax.Array]:
    """sin and cos of float32 angles [..., H/2], each computed into its own buffer when the value
    has barriers (XLA:CPU otherwise recomputes them inside every layer's fusions)."""
    return jnp.sin(angles), jnp.cos(angles)


@pytree.dataclass
class FixedOrder(Numerics):
  """Reduction orders fixed by construction (name 'fixed_order'; the pinned engine).

  k_chunk: a projection contracting over more than k_chunk inputs is computed as a batched dot
  over equal contraction chunks of at most k_chunk (a free reshape of the weight), and the chunk
  products are added in chunk order by explicit elementwise adds. On XLA:CPU (Eigen) a dot that
  contracts over at most ~256-320 terms accumulates them in one pass, the same way for a GEMV
  (one row) as for a GEMM, so a row's bits stop depending on how many rows the call has.
  Row sums (RMSNorm) are explicit pairwise trees (`tree_sum`), not XLA reductions, whose
  vectorization (and so their order) is chosen from the shape.
  small: a projection with at most `small` weights (the tiny test configs) is a broadcast
  product summed by `tree_sum`: XLA:CPU runs a one-row dot of such a size through another
  kernel than a many-row one (tiny_gemma4's per-layer-input path).
  docs/determinism.md gives the measurements behind each rule."""

  name: ClassVar[str] = 'fixed_order'
  k_chunk: int = fingerprinted(256)
  small: int = fingerprinted(65536)

  def chunk(self, k: int) -> int:
    """The contraction chunk of a dot over k terms (all of them up to k_chunk)."""
    return chunk_size(k, self.k_chunk) if k > self.k_chunk else k

  def materialize(self, x: jax.Array) -> jax.Array:
    """x passed through an integer identity the compiler cannot see through (its bits OR the
    run-time zero), so that no later add can be contracted with the multiply that produced x.
    XLA:CPU contracts a multiply and an add that share a fusion into an FMA, and which ops share
    a fusion follows the shapes; an XLA optimization barrier does not stop it (XLA:CPU removes
    barriers before fusion). Any shape, 16- or 32-bit floats."""
    zero = self.call.zero
    if zero is None:
      return x
    bits = {2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
    word = jax.lax.bitcast_convert_type(x, bits) | zero.astype(bits)
    return jax.lax.bitcast_convert_type(word, x.dtype)

  def barrier(self, x: jax.Array) -> jax.Array:
    """x computed into its own buffer: the value leaves a `lax.cond` on a run-time predicate,
    which XLA:CPU cannot fuse through. Without it XLA fuses the residual stream's cheap adds
    into every consumer and recomputes the whole stream inside each later norm and projection
    input. Also a `materialize`. Any shape."""
    zero = self.call.zero
    if zero is None:
      return x
    return jax.lax.cond(zero == 0, lambda y: y, jnp.zeros_like, self.materialize(x))

  def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
    k, n = w.shape
    if k * n <= self.small:
      products = self.mul(x.astype(jnp.float32)[:, None, :], w.astype(jnp.float32).T[None])
      return tree_sum(self.materialize(products))[..., 0].astype(x.dtype)
    if k <= self.k_chunk:
      return x @ w
    c = chunk_size(k, self.k_chunk)
    j = k // c
    parts = jnp.einsum('jmc,jcn->jmn', x.reshape(-1, j, c).transpose(1, 0, 2), w.reshape(j, c, n))
    acc = parts[0].astype(jnp.float32)
    for i in range(1, j):
      acc = acc + parts[i].astype(jnp.float32)
    return acc.astype(parts.dtype)

  def logits(self, table: Table, rows: jax.Array) -> jax.Array:
    if isinstance(table, OutputTable):
      return self._table_logits(table, rows)
    if rows.shape[0] == 1:
      # One row: the matrix-vector form table @ row, which XLA:CPU streams the table through
      # faster than row @ table.T (docs/determinism.md).
      return (table @ rows[0])[None]
    return rows @ table.T

  def mean_square(self, x: jax.Array) -> jax.Array:
    return tree_sum(self.materialize(jnp.square(x))) / jnp.float32(x.shape[-1])

  def sin_cos(self, angles: jax.Array) -> tuple[jax.Array, jax.Array]:
    return self.barrier(jnp.sin(angles)), self.barrier(jnp.cos(angles))


def _per_tile(q: jax.Array, k: jax.Array) -> jax.Array:
  """q [B, K, R, H] broadcast to every tile of k [B, K, n, S, H]: one dot per tile (XLA would
  otherwise merge the tiles into one wide dot, whose bits, for few rows, differ)."""
  return jnp.broadcast_to(q[:, :, None], k.shape[:3] + q.shape[-2:])


class _SpecOps:
  """The operations of gemma_jax.spec.functions as XLA ops (a spec_functions.Backend): every
  product is materialized (no FMA contraction with a later add) and every divisor too (XLA
  cannot turn a division by a constant into a multiplication, nor 1 / sqrt into an rsqrt
  estimate)."""

  def __init__(self, numerics: 'Spec'):
    self.n = numerics

  def const(self, x: Any) -> jax.Array:
    return jnp.float32(x)

  def neg(self, a: jax.Array) -> jax.Array:
    return jnp.negative(a)

  def abs(self, a: jax.Array) -> jax.Array:
    return jnp.abs(a)

  def min(self, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.minimum(a, b)

  def max(self, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.maximum(a, b)

  def floor(self, a: jax.Array) -> jax.Array:
    return jnp.floor(a)

  def sqrt(self, a: jax.Array) -> jax.Array:
    return jnp.sqrt(a)

  def where(self, mask: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.where(mask, a, b)

  def lt(self, a: jax.Array, b: jax.Array) -> jax.Array:
    return jnp.less(a, b)

  def add(self, a: jax.Array, b: jax.Array) -> jax.Array:
    return a + b

  def sub(self, a: jax.Array, b: jax.Array) -> jax.Array:
    return a - b

  def mul(self, a: jax.Array, b: jax.Array) -> jax.Array:
    return self.n.materialize(self.n.mul(a, b))

  def div(self, a: jax.Array, b: jax.Array) -> jax.Array:
    return a / self.n.materialize(jnp.broadcast_to(b, jnp.shape(b)).astype(jnp.float32))

  def ldexp(self, y: jax.Array, n: jax.Array) -> jax.Array:
    scale = jax.lax.bitcast_convert_type((n.astype(jnp.int32) + 127) << 23, jnp.float32)
    return self.mul(y, scale)

  def quadrant(self, k: jax.Array) -> jax.Array:
    return k.astype(jnp.int32) & 3


@pytree.dataclass
class Spec(FixedOrder):
  """The written arithmetic (name 'spec'; docs/determinism.md, gemma_jax/spec): FixedOrder's
  contractions and sums, every elementwise function from gemma_jax.spec.functions, RoPE angles
  from a correctly rounded table of inverse frequencies, RMSNorm's reciprocal square root as
  1 / sqrt, divisions by a row's shared value as multiplications by its reciprocal, no product
  contracted with an add outside a dot, and the logits as a chunked dot against the output
  table (the transposed embedding, gemma_jax.stored.OutputTable). float32 only.

  Its contractions, each output one sequential FMA chain per chunk of at most k_chunk terms,
  are computed by its `kernel` (gemma_jax.kernels.DotKernel: the native CPU kernels or the
  Pallas kernel for accelerators), or, without one, by XLA's own dot (Eigen on XLA:CPU, which
  does so for these sizes on some CPUs: the self-check says where)."""

  name: ClassVar[str] = 'spec'
  version: int = fingerprinted(SPEC_VERSION)  # the written arithmetic's version

  def _ops(self) -> _SpecOps:
    return _SpecOps(self)

  def matmul(self, x: jax.Array, w: jax.Array) -> jax.Array:
    k, n = w.shape
    if self.kernel is None or k * n <= self.small:
      return super().matmul(x, w)
    return self.kernel.matmul(x, w, self.chunk(k), rows=self.call.rows)

  def product(self, a: jax.Array, b: jax.Array) -> jax.Array:
    return self.materialize(self.mul(a, b))

  def mul(self, a: jax.Array, b: jax.Array) -> jax.Array:
    if flush_in_code():
      return spec_multiply(a, b, self.materialize)
    return jnp.multiply(a, b)

  def logits(self, table: Table, rows: jax.Array) -> jax.Array:
    if not isinstance(table, OutputTable):
      raise ValueError(f'the {self.name} numerics read the output table (the transposed '
                       'embedding, gemma_jax.stored.OutputTable), not the tied embedding')
    return self._table_logits(table, rows)

  def tile_scores(self, q: jax.Array, k: jax.Array) -> jax.Array:
    if self.kernel is not None:
      return self.kernel.tile_scores(q, k, self.chunk(q.shape[-1]))
    h = q.shape[-1]  # contracted over chunks of at most k_chunk, added in order
    c = self.chunk(h)
    q = _per_tile(q, k)
    part = lambda j: jnp.einsum('bkjrh,bkjsh->bkjrs', q[..., j * c:(j + 1) * c],
                                k[..., j * c:(j + 1) * c])
    acc = part(0)
    for j in range(1, h // c):
      acc = acc + part(j)
    return acc

  def tile_values(self, p: jax.Array, v: jax.Array) -> jax.Array:
    return super().tile_values(p, v) if self.kernel is None else self.kernel.tile_values(p, v)

  def mean_square(self, x: jax.Array) -> jax.Array:
    ops = self._ops()
    one_over_n = spec_functions.reciprocal(ops, jnp.float32(x.shape[-1]))
    square = self.mul(x, x) if flush_in_code() else jnp.square(x)
    return ops.mul(tree_sum(self.materialize(square)), one_over_n)

  def rsqrt(self, x: jax.Array) -> jax.Array:
    return spec_functions.rsqrt(self._ops(), x)

  def exp(self, x: jax.Array) -> jax.Array:
    return spec_functions.exp(self._ops(), x)

  def tanh(self, x: jax.Array) -> jax.Array:
    return spec_functions.tanh(self._ops(), x)

  def gelu(self, x: jax.Array) -> jax.Array:
    return spec_functions.gelu(self._ops(), x)

  def softcap(self, x: jax.Array, cap: float) -> jax.Array:
    return spec_functions.softcap(self._ops(), x, cap)

  def angles(self, positions: jax.Array, head_dim: int, base: float,
             scale: float = 1.0) -> jax.Array:
    ops = self._ops()
    inverse = jnp.asarray(spec_functions.inverse_frequencies(head_dim, base))
    angles = ops.mul(positions.astype(jnp.float32)[..., None], inverse)
    if scale == 1.0:
      return angles
    return ops.mul(angles, spec_functions.reciprocal(ops, jnp.float32(scale)))

  def sin_cos(self, angles: jax.Array) -> tuple[jax.Array, jax.Array]:
    sin, cos = spec_functions.sin_cos(self._ops(), angles)
    return self.barrier(sin), self.barrier(cos)


XLA = Numerics()
FIXED_ORDER = FixedOrder()
SPEC = Spec()

# name -> the Numerics class (constructed with its parameters by an engine plan).
NUMERICS: dict[str, type[Numerics]] = {cls.name: cls for cls in (Numerics, FixedOrder, Spec)}

