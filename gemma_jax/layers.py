"""Small building blocks: RMSNorm, a weight-only dense projection, the gated MLP.

Parameters are created by `init_param`, which draws from a seeded generator when the model is built
with random weights (`nnx.Rngs`) and is never called when weights come from a checkpoint (the model
is then built abstractly with `nnx.eval_shape` and filled from the checkpoint's arrays).
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from gemma_jax import sharding


@dataclasses.dataclass(frozen=True)
class FixedOrder:
  """Reduction orders fixed by construction (the pinned engine's numerics, see graft/engine.py).

  k_chunk: a projection contracting over more than k_chunk inputs is computed as a batched dot
  over equal contraction chunks of at most k_chunk (a free reshape of the weight), and the chunk
  products are added in chunk order by explicit elementwise adds. On XLA:CPU (Eigen) a dot that
  contracts over at most ~256-320 terms accumulates them in one pass (measured: 128, 160, 256,
  320; not 512), the same way for a GEMV
  (one row) as for a GEMM, so a row's bits stop depending on how many rows the call has.
  Row sums (RMSNorm) are explicit pairwise trees (`tree_sum`), not XLA reductions, whose
  vectorization (and so their order) is chosen from the shape.
  small: a projection with at most `small` weights (the tiny test configs) is a broadcast
  product summed by `tree_sum`: XLA:CPU runs a one-row dot of such a size through another
  kernel than a many-row one (measured in tiny_gemma4's per-layer-input path)."""

  k_chunk: int = 256
  small: int = 65536


_FIXED_ORDER: contextvars.ContextVar[FixedOrder | None] = contextvars.ContextVar(
    'gemma_jax_fixed_order', default=None)


@contextlib.contextmanager
def fixed_order(numerics: FixedOrder | None):
  """Traces the model with fixed reduction orders (None: XLA's own, the default)."""
  token = _FIXED_ORDER.set(numerics)
  try:
    yield
  finally:
    _FIXED_ORDER.reset(token)


def current_fixed_order() -> FixedOrder | None:
  return _FIXED_ORDER.get()


_OPAQUE_ZERO: contextvars.ContextVar[jax.Array | None] = contextvars.ContextVar(
    'gemma_jax_opaque_zero', default=None)


@contextlib.contextmanager
def opaque_zero(zero: jax.Array):
  """Provides `materialize` with a uint32 scalar that is 0 at run time but unknown to the
  compiler (the model derives it from its inputs while tracing)."""
  token = _OPAQUE_ZERO.set(zero)
  try:
    yield
  finally:
    _OPAQUE_ZERO.reset(token)


def materialize(x: jax.Array) -> jax.Array:
  """Under `fixed_order`, x passed through an integer identity the compiler cannot see through
  (its bits OR a run-time zero), so that no later add can be contracted with the multiply that
  produced x. XLA:CPU contracts a multiply and an add that share a fusion into an FMA, and which
  ops share a fusion follows the shapes, so an add whose operand is a product (a residual add
  after a norm, an embedding or skip scale, the online softmax's rescaled state) could round
  differently for different row counts (measured on tiny_gemma4 at one row; an XLA
  optimization barrier does not stop it: XLA:CPU removes barriers before fusion).
  Identity otherwise."""
  zero = _OPAQUE_ZERO.get()
  if current_fixed_order() is None or zero is None:
    return x
  bits = {2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(x.dtype).itemsize]
  word = jax.lax.bitcast_convert_type(x, bits) | zero.astype(bits)
  return jax.lax.bitcast_convert_type(word, x.dtype)


def fusion_barrier(x: jax.Array) -> jax.Array:
  """Under `fixed_order`, x computed into its own buffer: the value leaves a `lax.cond` on a
  run-time predicate, which XLA:CPU cannot fuse through (it removes optimization barriers before
  fusion). Without it XLA fuses the residual stream's cheap adds into every consumer and
  recomputes the whole stream, all layers of it, inside each later norm and projection input.
  Also a `materialize`. Identity otherwise."""
  zero = _OPAQUE_ZERO.get()
  if current_fixed_order() is None or zero is None:
    return x
  return jax.lax.cond(zero == 0, lambda y: y, jnp.zeros_like, materialize(x))


def tree_sum(x: jax.Array) -> jax.Array:
  """Sum over the last axis (kept, size 1) in a fixed pairwise order: halves are added
  elementwise until one element is left (an odd element rides along to the next level).
  Elementwise adds have no order to choose, so the result is the same for any leading shape."""
  while x.shape[-1] > 1:
    n = x.shape[-1]
    h = n // 2
    y = x[..., :h] + x[..., h:2 * h]
    x = y if n % 2 == 0 else jnp.concatenate([y, x[..., 2 * h:]], axis=-1)
  return x


def _chunk_size(k: int, limit: int) -> int:
  """The largest divisor of k that is at most `limit`, preferring multiples of 8."""
  divisors = [d for d in range(1, min(k, limit) + 1) if k % d == 0]
  aligned = [d for d in divisors if d % 8 == 0]
  return max(aligned or divisors)


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
  """x [M, K] @ w [K, N]; under `fixed_order`, contraction-chunked (see FixedOrder)."""
  numerics = current_fixed_order()
  k, n = w.shape
  if numerics is None:
    return x @ w
  if k * n <= numerics.small:
    products = x.astype(jnp.float32)[:, None, :] * w.astype(jnp.float32).T[None]  # [M, N, K]
    return tree_sum(materialize(products))[..., 0].astype(x.dtype)
  if k <= numerics.k_chunk:
    return x @ w
  c = _chunk_size(k, numerics.k_chunk)
  j = k // c
  parts = jnp.einsum('jmc,jcn->jmn', x.reshape(-1, j, c).transpose(1, 0, 2), w.reshape(j, c, n))
  acc = parts[0].astype(jnp.float32)
  for i in range(1, j):
    acc = acc + parts[i].astype(jnp.float32)
  return acc.astype(parts.dtype)


def init_param(rngs: nnx.Rngs, shape: tuple[int, ...], dtype, *, std: float, mean: float = 0.0):
  """A parameter drawn from N(mean, std^2); the single place random weights come from."""
  value = mean + std * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value.astype(dtype))


class RMSNorm(nnx.Module):
  """x * rsqrt(mean(x^2) + eps) * (offset + scale), computed in float32.

  Gemma 2/3 store the scale zero-centred (offset 1); Gemma 4 stores it directly (offset 0).
  rsqrt rather than 1/sqrt: they round differently, and the reference implementation uses rsqrt.
  float32 because a bfloat16 mean of squares loses most of its mantissa over a 2,560-wide row.
  """

  def __init__(self, dim: int, *, offset: float, eps: float, dtype, rngs: nnx.Rngs,
               with_scale: bool = True):
    self.offset = offset
    self.eps = eps
    if with_scale:
      self.scale = init_param(rngs, (dim,), dtype, std=0.1, mean=1.0 - offset)
    else:
      self.scale = None

  def __call__(self, x: jax.Array) -> jax.Array:
    x32 = x.astype(jnp.float32)
    if current_fixed_order() is None:
      mean_square = jnp.mean(jnp.square(x32), axis=-1, keepdims=True)
    else:
      mean_square = tree_sum(materialize(jnp.square(x32))) / jnp.float32(x.shape[-1])
    normed = x32 * jax.lax.rsqrt(mean_square + self.eps)
    if self.scale is not None:
      normed = normed * (self.offset + self.scale[...].astype(jnp.float32))
    return materialize(normed.astype(x.dtype))  # see `materialize`


class Dense(nnx.Module):
  """A weight `w` of shape in_shape + out_shape applied as one 2D matmul (no bias).

  Every projection is stored [inputs..., outputs...] so that x [..., *in] @ w is a plain
  [rows, prod(in)] x [prod(in), prod(out)] matmul: XLA:CPU runs the official einsum layouts
  ([N, D, H], [2, F, D]) with a transposed copy of the weight on every call, which made a decode
  step several times slower (measured: 68 ms vs 7 ms for 18 Q/O projection pairs).
  """

  def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...], *, dtype,
               rngs: nnx.Rngs):
    self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
    self.w = init_param(rngs, self.in_shape + self.out_shape, dtype,
                        std=math.prod(self.in_shape) ** -0.5)

  def __call__(self, x: jax.Array) -> jax.Array:
    batch = x.shape[:x.ndim - len(self.in_shape)]
    w = self.w[...].reshape(math.prod(self.in_shape), math.prod(self.out_shape))
    y = matmul(x.reshape(-1, w.shape[0]), w)
    return y.reshape(batch + self.out_shape)


def gelu_tanh(x: jax.Array) -> jax.Array:
  """GELU with the tanh approximation, as every Gemma uses."""
  return jax.nn.gelu(x, approximate=True)


class FeedForward(nnx.Module):
  """GeGLU MLP. gate_up_proj w: [D, 2, F] (index 0 is the gate branch); down_proj w: [F, D]."""

  def __init__(self, embed_dim: int, hidden_dim: int, *, dtype, rngs: nnx.Rngs):
    self.gate_up_proj = Dense((embed_dim,), (2, hidden_dim), dtype=dtype, rngs=rngs)
    self.down_proj = Dense((hidden_dim,), (embed_dim,), dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    gate_up = self.gate_up_proj(x)  # [B, T, 2, F]
    hidden = gelu_tanh(gate_up[..., 0, :]) * gate_up[..., 1, :]
    return self.down_proj(sharding.gather_contraction(hidden))
