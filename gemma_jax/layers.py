"""Small building blocks: RMSNorm, a weight-only dense projection, the gated MLP.

Every call takes the `Numerics` value that says how its arithmetic is computed
(gemma_jax/numerics.py).

Parameters are created by `init_param`, which draws from a seeded generator when the model is built
with random weights (`nnx.Rngs`); built with rngs None it gives each parameter's shape and dtype
only (jax.ShapeDtypeStruct, no tracing), the abstract model gemma_jax.model binds a checkpoint's
arrays to.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gemma_jax import sharding
from gemma_jax.numerics import Numerics


def init_param(rngs: nnx.Rngs | None, shape: tuple[int, ...], dtype: DTypeLike, *, std: float,
               mean: float = 0.0) -> nnx.Param:
  """A parameter drawn from N(mean, std^2); the single place random weights come from. rngs
  None: its shape and dtype only (jax.ShapeDtypeStruct), for the abstract model every process
  builds to bind parameters (gemma_jax.model), at no tracing cost."""
  if rngs is None:
    return nnx.Param(jax.ShapeDtypeStruct(shape, jnp.dtype(dtype)))
  value = mean + std * jax.random.normal(rngs.params(), shape, jnp.float32)
  return nnx.Param(value.astype(dtype))


class RMSNorm(nnx.Module):
  """x * rsqrt(mean(x^2) + eps) * (offset + scale), computed in float32.

  Gemma 2/3 store the scale zero-centred (offset 1); Gemma 4 stores it directly (offset 0).
  rsqrt rather than 1/sqrt: they round differently, and the reference implementation uses rsqrt.
  float32 because a bfloat16 mean of squares loses most of its mantissa over a 2,560-wide row.
  """

  def __init__(self, dim: int, *, offset: float, eps: float, dtype: DTypeLike,
               rngs: nnx.Rngs | None, with_scale: bool = True):
    self.offset = offset
    self.eps = eps
    self.scale: nnx.Param | None = (
        init_param(rngs, (dim,), dtype, std=0.1, mean=1.0 - offset) if with_scale else None)

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

  def __init__(self, in_shape: tuple[int, ...], out_shape: tuple[int, ...], *, dtype: DTypeLike,
               rngs: nnx.Rngs | None):
    self.in_shape, self.out_shape = tuple(in_shape), tuple(out_shape)
    self.w = init_param(rngs, self.in_shape + self.out_shape, dtype,
                        std=math.prod(self.in_shape) ** -0.5)

  def __call__(self, x: jax.Array, numerics: Numerics) -> jax.Array:
    """x [..., *in_shape] -> [..., *out_shape]."""
    batch = x.shape[:x.ndim - len(self.in_shape)]
    k, n = math.prod(self.in_shape), math.prod(self.out_shape)
    # w in its stored form (gemma_jax.stored: the array, or a kernel's Panels)
    y = numerics.dense(x.reshape(-1, k), self.w.get_value(), k, n)
    return y.reshape(batch + self.out_shape)


class FeedForward(nnx.Module):
  """GeGLU MLP. gate_up_proj w: [D, 2, F] (index 0 is the gate branch); down_proj w: [F, D]."""

  def __init__(self, embed_dim: int, hidden_dim: int, *, dtype: DTypeLike,
               rngs: nnx.Rngs | None):
    self.gate_up_proj = Dense((embed_dim,), (2, hidden_dim), dtype=dtype, rngs=rngs)
    self.down_proj = Dense((hidden_dim,), (embed_dim,), dtype=dtype, rngs=rngs)

  def __call__(self, x: jax.Array, numerics: Numerics) -> jax.Array:
    """x [B, T, D] -> [B, T, D]."""
    gate_up = self.gate_up_proj(x, numerics)  # [B, T, 2, F]
    hidden = numerics.mul(numerics.gelu(gate_up[..., 0, :]), gate_up[..., 1, :])
    mesh = numerics.call.mesh
    return sharding.whole(self.down_proj(sharding.whole(hidden, mesh), numerics), mesh)
