"""The KV state: an explicit, typed pytree that every model call takes and returns.

Layout. Each cache-owning layer holds `k`, `v` [B, S, K, H] and `positions` [B, S] (the RoPE
position of the token in each slot, -1 for an empty slot). `fill` [B] counts the tokens written so
far; the token with sequence index j (0-based, in the order tokens were fed) lives in slot j mod S.
A call's rows sit at consecutive sequence indices; padding rows (position EMPTY) may come before
the real tokens (an engine that aligns its calls to the sequence) or after them, and write
nothing.
Slots are assigned by sequence index, never by position, so the same tokens occupy the same slots
whatever positions they were given (the position experiments shift positions, not slots) and
whatever calls they were fed in (the graft experiments cut sequences into calls).

Global layers need S >= the number of tokens the context will ever hold. Local (sliding-window)
layers may use a smaller ring of S_local slots: a call of T tokens needs S_local >= W + T - 1 so
that writing the call's tokens never evicts a key that one of its own queries still sees. Masks
come from `positions`, so a ring holds the right keys however far past the window the context
runs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct

from gemma_jax.config import AttentionType, TransformerConfig

EMPTY = -1  # position of an empty slot


@struct.dataclass
class LayerKV:
  k: jax.Array  # [B, S, K, H]
  v: jax.Array  # [B, S, K, H]
  positions: jax.Array  # [B, S] int32, EMPTY where no token was written

  @property
  def num_slots(self) -> int:
    return self.k.shape[1]


@struct.dataclass
class KVState:
  layers: tuple[LayerKV, ...]  # one per cache-owning layer, in config.cache_layers order
  fill: jax.Array  # [B] int32: sequence index of the next token

  @property
  def batch_size(self) -> int:
    return self.fill.shape[0]


def local_slots_needed(config: TransformerConfig, tokens_per_call: int) -> int:
  """Smallest ring that keeps a call of `tokens_per_call` tokens correct on local layers."""
  return config.sliding_window + tokens_per_call - 1


def init_kv_state(config: TransformerConfig, *, batch_size: int, cache_len: int, dtype,
                  local_cache_len: int | None = None) -> KVState:
  """An empty KV state: `cache_len` slots on global layers, `local_cache_len` (default: the same)
  on local layers."""
  layers = []
  for i in config.cache_layers:
    spec = config.layer_spec(i)
    slots = cache_len
    if spec.attention_type is AttentionType.LOCAL and local_cache_len is not None:
      slots = min(cache_len, local_cache_len)
    shape = (batch_size, slots, spec.num_kv_heads, spec.head_dim)
    layers.append(LayerKV(k=jnp.zeros(shape, dtype), v=jnp.zeros(shape, dtype),
                          positions=jnp.full((batch_size, slots), EMPTY, jnp.int32)))
  return KVState(layers=tuple(layers), fill=jnp.zeros((batch_size,), jnp.int32))


def write(layer: LayerKV, k: jax.Array, v: jax.Array, positions: jax.Array,
          start: jax.Array) -> LayerKV:
  """Writes a call's T rows (k, v [B, T, K, H], positions [B, T]) at sequence indices
  start .. start+T-1. Rows whose position is EMPTY (padding, before or after the real tokens)
  leave their slot as it was, so a slot always holds the last real token written to it, however
  the sequence was cut into calls.

  When the T slots are contiguous (no wrap around the ring) the write is a dynamic_update_slice,
  which XLA performs in place when the caller donates the cache; a wrapping write is one
  elementwise select over the buffer. (XLA:CPU lowers a scatter here with a transposed copy of
  the whole cache before and after, three passes instead of one.)
  """
  num_tokens, num_slots = k.shape[1], layer.num_slots
  if num_tokens > num_slots:
    raise ValueError(f'a call of {num_tokens} tokens does not fit a cache of {num_slots} slots')
  new = LayerKV(k=k.astype(layer.k.dtype), v=v.astype(layer.v.dtype),
                positions=positions.astype(jnp.int32))
  padding = positions == EMPTY  # [B, T]
  if k.shape[0] != 1:  # batched rows may each wrap differently: always select
    return _write_select(layer, new, padding, start)
  first = start[0] % num_slots
  return jax.lax.cond(first + num_tokens <= num_slots,
                      lambda: _write_slice(layer, new, padding, first),
                      lambda: _write_select(layer, new, padding, start))


def _rows_mask(mask: jax.Array, like: jax.Array) -> jax.Array:
  return mask.reshape(mask.shape + (1,) * (like.ndim - 2))


def _write_slice(layer: LayerKV, new: LayerKV, padding: jax.Array, first: jax.Array) -> LayerKV:
  num_tokens = padding.shape[1]

  def put(old, rows):
    current = jax.lax.dynamic_slice_in_dim(old, first, num_tokens, axis=1)
    rows = jnp.where(_rows_mask(padding, rows), current, rows)
    return jax.lax.dynamic_update_slice_in_dim(old, rows, first, axis=1)

  return jax.tree.map(put, layer, new)


def _write_select(layer: LayerKV, new: LayerKV, padding: jax.Array, start: jax.Array) -> LayerKV:
  """Slot s takes new row (s - start) mod S when that row exists and is not padding."""
  num_tokens, num_slots = new.k.shape[1], layer.num_slots
  row = (jnp.arange(num_slots, dtype=jnp.int32)[None, :] - start[:, None]) % num_slots  # [B, S]
  source = jnp.minimum(row, num_tokens - 1)
  written = (row < num_tokens) & ~jnp.take_along_axis(padding, source, axis=1)

  def merge(old, rows):
    gathered = jnp.take_along_axis(rows, _rows_mask(source, rows), axis=1)
    return jnp.where(_rows_mask(written, rows), gathered, old)

  return jax.tree.map(merge, layer, new)
