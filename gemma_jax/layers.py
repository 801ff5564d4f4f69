"""Small building blocks: RMSNorm, a weight-only einsum, the gated MLP.

Parameters are created by `init_param`, which draws from a seeded generator when the model is built
with random weights (`nnx.Rngs`) and is never called when weights come from a checkpoint (the model
is then built abstractly with `nnx.eval_shape` and filled from the checkpoint's arrays).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


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
    normed = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + self.eps)
    if self.scale is not None:
      normed = normed * (self.offset + self.scale[...].astype(jnp.float32))
    return normed.astype(x.dtype)


class Einsum(nnx.Module):
  """A weight `w` applied with a fixed einsum equation (no bias)."""

  def __init__(self, equation: str, shape: tuple[int, ...], *, fan_in: int, dtype, rngs: nnx.Rngs):
    self.equation = equation
    self.w = init_param(rngs, shape, dtype, std=fan_in ** -0.5)

  def __call__(self, x: jax.Array) -> jax.Array:
    return jnp.einsum(self.equation, x, self.w[...])


def gelu_tanh(x: jax.Array) -> jax.Array:
  """GELU with the tanh approximation, as every Gemma uses."""
  return jax.nn.gelu(x, approximate=True)


class FeedForward(nnx.Module):
  """GeGLU MLP. gating_einsum w: [2, F, D] (index 0 is the gate branch); linear w: [F, D]."""

  def __init__(self, embed_dim: int, hidden_dim: int, *, dtype, rngs: nnx.Rngs):
    self.gating_einsum = Einsum('btd,cfd->cbtf', (2, hidden_dim, embed_dim), fan_in=embed_dim,
                                dtype=dtype, rngs=rngs)
    self.linear = Einsum('btf,fd->btd', (hidden_dim, embed_dim), fan_in=hidden_dim, dtype=dtype,
                         rngs=rngs)

  def __call__(self, x: jax.Array) -> jax.Array:
    gate, up = self.gating_einsum(x)  # each [B, T, F]
    return self.linear(gelu_tanh(gate) * up)
