"""Self-attention over the explicit KV cache.

The new tokens' K and V are written into the cache first; attention then reduces over the whole
cache buffer (every slot, in slot order) with a mask built from slot positions. Writing first
means a key occupies the same slot whether it arrived in this call or an earlier one, so the
reduction a query row sees does not depend on how the sequence was cut into calls.

`attend` is the reference (XLA) implementation; `gemma_jax.kernels` provides a Pallas one with the
same signature, selected through the model's `attention_fn` argument.
"""

from __future__ import annotations

import functools
from typing import Protocol

import jax
import jax.numpy as jnp
from flax import nnx

from gemma_jax import kv_state as kvs
from gemma_jax import rope
from gemma_jax.config import LayerSpec, TransformerConfig
from gemma_jax.layers import Dense, RMSNorm

# A finite "minus infinity": exp(MASKED - max) is exactly 0 in float32, and a row with every slot
# masked (a padding row) stays finite instead of turning into NaN.
MASKED = -2.3819763e38


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
  """[B, T, S] bool: slot s is visible to query t. Empty slots and padding queries see nothing."""
  q = q_pos[:, :, None]
  k = k_pos[:, None, :]
  visible = (k >= 0) & (k <= q)
  if window is not None:
    visible &= (q - k) < window
  return visible


class AttendFn(Protocol):

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
               k_pos: jax.Array, *, window: int | None, softcap: float | None) -> jax.Array:
    ...


def dot_logits(q: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
  """q [B, T, K, G, H], k [B, S, K, H] (float32) -> scores [B, T, K, G, S]."""
  del q_pos, k_pos
  return jnp.einsum('btkgh,bskh->btkgs', q, k)


def quarter_turn_logits(q: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
                        rotary_fraction: float = 1.0) -> jax.Array:
  """dot_logits for the quarter-turn control (rope.py), computed from relative rotations.

  Quarter turns compose exactly, yet a plain q . k is not translation-invariant under them: a
  shift by an odd δ turns pairs by a quarter, which moves the products q_i k_i and
  q_{i+H/2} k_{i+H/2} into each other's dimension, and the dot adds the same terms in another
  order (XLA:CPU also contracts a product and an add into a multiply-add, so no elementwise
  rewrite of the sum is safe). Instead q is turned back to position 0 and every key by the
  query's position (both exact: signed permutations), so the dot sees R(p_k - p_q) k and the
  unrotated q, which a shift does not change. Costs a [B, T, S, K, H] key tensor: controls only.
  """
  del k_pos  # each key already carries its own rotation
  sin, cos = rope.quarter_turn_sin_cos(-q_pos, q.shape[-1], rotary_fraction)  # [B, T, H/2]
  sin, cos = sin[:, :, None, None], cos[:, :, None, None]
  q = rope.rotate(q, sin, cos)
  relative = rope.rotate(k[:, None], sin, cos)  # [B, T, S, K, H]
  return jnp.einsum('btkgh,btskh->btkgs', q, relative)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
           window: int | None, softcap: float | None, logits_fn=dot_logits) -> jax.Array:
  """Reference attention. q [B, T, N, H] (already scaled), k, v [B, S, K, H], q_pos [B, T],
  k_pos [B, S] -> [B, T, N, H] in v's dtype. `logits_fn` computes the scores (dot_logits, or
  quarter_turn_logits for that control).

  Everything runs in float32 (bfloat16 inputs are widened exactly first): XLA:CPU's bfloat16
  dot with a float32 result is an order of magnitude slower than widening, and float32 softmax
  is what every Gemma reference does."""
  batch, num_tokens, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  q = q.reshape(batch, num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
  q, k = q.astype(jnp.float32), k.astype(jnp.float32)
  logits = logits_fn(q, k, q_pos, k_pos)
  if softcap is not None:
    logits = jnp.tanh(logits / softcap) * softcap
  mask = attention_mask(q_pos, k_pos, window)[:, :, None, None, :]
  probs = jax.nn.softmax(jnp.where(mask, logits, MASKED), axis=-1)
  out = jnp.einsum('btkgs,bskh->btkgh', probs, v.astype(jnp.float32))
  return out.reshape(batch, num_tokens, num_heads, head_dim).astype(v.dtype)


class Attention(nnx.Module):
  """Projections, QK(V)-norms, RoPE, cache write, attention, output projection.

  Weights, stored [inputs..., outputs...]: q_proj [D, N, H]; kv_proj [D, 2, K, H], or k_proj
  [D, K, H] when one projection feeds K and V; o_proj [N, H, D]. A KV-shared layer owns no K/V
  weights and reads the cache of its source layer.
  """

  def __init__(self, config: TransformerConfig, spec: LayerSpec, *, owns_kv: bool, dtype,
               rngs: nnx.Rngs):
    d, n, k, h = config.embed_dim, config.num_heads, spec.num_kv_heads, spec.head_dim
    self.config = config
    self.spec = spec
    self.owns_kv = owns_kv
    self.q_proj = Dense((d,), (n, h), dtype=dtype, rngs=rngs)
    self.o_proj = Dense((n, h), (d,), dtype=dtype, rngs=rngs)
    norm = dict(offset=config.norm_scale_offset, eps=config.rms_norm_eps, dtype=dtype, rngs=rngs)
    self.query_norm = RMSNorm(h, **norm) if config.use_qk_norm else None
    self.key_norm = RMSNorm(h, **norm) if config.use_qk_norm and owns_kv else None
    self.value_norm = (RMSNorm(h, with_scale=False, **norm)
                       if config.use_v_norm and owns_kv else None)
    self.k_proj = (Dense((d,), (k, h), dtype=dtype, rngs=rngs)
                   if owns_kv and spec.k_eq_v else None)
    self.kv_proj = (Dense((d,), (2, k, h), dtype=dtype, rngs=rngs)
                    if owns_kv and not spec.k_eq_v else None)

  def _rope(self, x: jax.Array, positions: jax.Array) -> jax.Array:
    return rope.apply_rope(x, positions, base=self.spec.rope_base, scale=self.spec.rope_scale,
                           rotary_fraction=self.spec.rotary_fraction, mode=self.config.rope_mode)

  def keys_values(self, x: jax.Array, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """The cache entries of new tokens: normed K (rotated unless the config caches keys before
    RoPE) and normed V, each [B, T, K, H]."""
    if self.k_proj is not None:
      k = v = self.k_proj(x)
    else:
      kv = self.kv_proj(x)  # [B, T, 2, K, H]
      k, v = kv[:, :, 0], kv[:, :, 1]
    if self.key_norm is not None:
      k = self.key_norm(k)
    if self.value_norm is not None:
      v = self.value_norm(v)
    return (k if self.config.kv_cache_pre_rope else self._rope(k, positions)), v

  def __call__(self, x: jax.Array, positions: jax.Array, cache: kvs.LayerKV, start: jax.Array,
               attention_fn: AttendFn) -> tuple[jax.Array, kvs.LayerKV]:
    """x [B, T, D], positions [B, T] -> ([B, T, D], the layer cache after this call's write).
    For a KV-shared layer `cache` is the source layer's, already updated, and is returned as is."""
    q = self.q_proj(x)
    if self.query_norm is not None:
      q = self.query_norm(q)
    q = self._rope(q, positions)
    if self.config.query_pre_attn_scalar is not None:
      q = q * jnp.asarray(self.config.query_pre_attn_scalar ** -0.5, q.dtype)
    if self.owns_kv:
      k, v = self.keys_values(x, positions)
      cache = kvs.write(cache, k, v, positions, start)
    keys = cache.k
    if self.config.kv_cache_pre_rope:  # every slot rotated by its own position (empty: masked)
      keys = self._rope(keys, cache.positions)
    if self.config.rope_mode == 'quarter_turn':
      # The control needs scores a shift leaves bit-identical: only the reference attention
      # computes those (the engine refuses other attention functions with it).
      attention_fn = functools.partial(attend, logits_fn=functools.partial(
          quarter_turn_logits, rotary_fraction=self.spec.rotary_fraction))
    encoded = attention_fn(q, keys, cache.v, positions, cache.positions,
                           window=self.spec.window, softcap=self.config.attn_logits_softcap)
    return self.o_proj(encoded), cache

