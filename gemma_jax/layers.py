"""Small building blocks: RMSNorm, a weight-only dense projection, the gated MLP.

Every call takes the `Numerics` value that says how its arithmetic is computed
(gemma_jax/numerics.py).

Parameters are declared by `init_param`: their shape, dtype and the distribution random weights
draw them from. Models are built abstract and filled from a checkpoint's arrays or by
gemma_jax.model.init_params.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gemma_jax import sharding
from gemma_jax.numerics import Numerics


def init_param(shape: tuple[int, ...], dtype: DTypeLike, *, std: float,
               mean: float = 0.0) -> nnx.Param:
  """A parameter of `shape` and `dtype` as its jax.ShapeDtypeStruct, carrying the distribution
  random weights draw it from (metadata `init_mean`, `init_std`): the single place that
  distribution is stated. Every model is built abstract (no memory, no tracing); a checkpoint
  fills it, or gemma_jax.model.init_params draws each parameter by its name
  (gemma_jax.seeded: integer bits, the same on every machine). `std` must be computed by
  correctly rounded operations (1 / math.sqrt(n), not n ** -0.5: pow is the C library's, whose
  last bit may follow the CPU)."""
  return nnx.Param(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)), init_mean=float(mean),
                   init_std=float(std))


class RMSNorm(nnx.Module):
  """x * rsqrt(mean(x^2) + eps) * (offset + scale), computed in float32.

  Gemma 2/3 store the scale zero-centred (offset 1); Gemma 4 stores it directly (offset 0).
  rsqrt rather than 1/sqrt: they round differently, and the reference implementation uses rsqrt.
  float32 because a bfloat16 mean of squares loses most of its mantissa over a 2,560-wide row.
  """

  def __init__(self, dim: int, *, offset: float, eps: float, dtype: DTypeLike,
               with_scale: bool = True):
    self.offset = offset
    self.eps = eps
    self.scale: nnx.Param | None = (
        init_param((dim,), dtype, std=0.1, mean=1.0 - offset) if with_scale else None)

  def __call__(self, x: jax.Array, numerics: Numerics) -> jax.Array:
    """x [..., X] normed over its last axis, in x's dtype."""
    x32 = x.astype(jnp.float32)
    normed = numerics.mul(x32, numerics.rsqrt(numerics.mean_square(x32) + self.eps))
    if self.scale is not None:
      scale = self.scale[...].astype(jnp.float32)
      normed = numerics.mul(normed, self.offset + scale if self.offset else scale)
    return numerics.materialize(normed.astype(x.dtype))  # it feeds the residual add


class Dense(nnx.Module):
  """A weight `w` of shape in_shape + out_shape applied as one 2D matmul (no bias).

  Every projection is stored [inputs..., outputs...] so that x [..., *in] @ w is a plain
  [rows, prod(in)] x [prod(in), prod(out)] matmul: XLA:CPU runs the official einsum layouts
  ([N, D, H], [2, F, D]) with a transposed copy of the weight on every call (docs/determinism.md,
  "Layouts and speed").
  """

  def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...], *, dtype: DTypeLike):
    self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
    self.w = init_param(self.in_shape + self.out_shape, dtype,
                        std=1 / math.sqrt(math.prod(self.in_shape)))

  def __call__(self, x: jax.Array, numerics: Numerics) -> jax.Array:
    """x [..., *in_shape] -> [..., *out_shape]."""
    batch = x.shape[:x.ndim - len(self.in_shape)]
    k, n = math.prod(self.in_shape), math.prod(self.out_shape)
    # w in its stored form (gemma_jax.stored: the array, or a kernel's Panels)
    y = numerics.dense(x.reshape(-1, k), self.w.get_value(), k, n)
    # On a mesh each device made its own block of the output columns (the weight is kept as
    # its [I, O] matrix, split by columns: gemma_jax.sharding): whole again, as the model
    # reads its outputs by head.
    return sharding.whole(y.reshape(batch + self.out_shape), numerics.call.mesh)


class FeedForward(nnx.Module):
  """GeGLU MLP. gate_up_proj w: [D, 2, F] (index 0 is the gate branch); down_proj w: [F, D]."""

  def __init__(self, embed_dim: int, hidden_dim: int, *, dtype: DTypeLike):
    self.gate_up_proj = Dense((embed_dim,), (2, hidden_dim), dtype=dtype)
    self.down_proj = Dense((hidden_dim,), (embed_dim,), dtype=dtype)

  def __call__(self, x: jax.Array, numerics: Numerics) -> jax.Array:
    """x [B, T, D] -> [B, T, D]."""
    gate_up = self.gate_up_proj(x, numerics)  # [B, T, 2, F]
    hidden = numerics.mul(numerics.gelu(gate_up[..., 0, :]), gate_up[..., 1, :])
    mesh = numerics.call.mesh
    return self.down_proj(sharding.whole(hidden, mesh), numerics)
