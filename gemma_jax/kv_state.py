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

import dataclasses
import functools
from typing import Sequence, TypeVar

import jax
import jax.numpy as jnp
import numpy as np
from jax.typing import DTypeLike

from gemma_jax import pytree
from gemma_jax.config import AttentionType, TransformerConfig
from gemma_jax.sharding import to_host

EMPTY = -1  # position of an empty slot


@pytree.dataclass
class LayerKV:
  """One cache-owning layer's cache: S slots per batch row, slot j mod S holding the token of
  sequence index j."""

  k: jax.Array  # [B, S, K, H]
  v: jax.Array  # [B, S, K, H]
  positions: jax.Array  # [B, S] int32, EMPTY where no token was written

  @property
  def num_slots(self) -> int:
    """S, the slots of this layer's cache."""
    return self.k.shape[1]


@pytree.dataclass
class KVState:
  """The KV state every model call takes and returns (a pytree): one LayerKV per cache-owning
  layer and, per batch row, how many tokens were written."""

  layers: tuple[LayerKV, ...]  # one per cache-owning layer, in config.cache_layers order
  fill: jax.Array  # [B] int32: sequence index of the next token

  @property
  def batch_size(self) -> int:
    """B, the batch rows (contexts) the state holds."""
    return self.fill.shape[0]


def local_slots_needed(config: TransformerConfig, tokens_per_call: int) -> int:
  """Smallest ring that keeps a call of `tokens_per_call` tokens correct on local layers."""
  return config.sliding_window + tokens_per_call - 1


# Integer positions (or sequence indices) of either array library: the model's and the
# interpreter's.
Positions = TypeVar('Positions', jax.Array, np.ndarray)


def visible(q_pos: Positions, k_pos: Positions, window: int | None) -> Positions:
  """The visibility rule, the one definition every attention (the reference, the tiled one, the
  Pallas kernel) and the spec's interpreter apply: the key of a slot at position `k_pos` is seen
  by a query at `q_pos` iff the slot holds a token (not EMPTY: k_pos >= 0), at or before the
  query, and on a sliding-window layer less than `window` positions before it. A padding query
  (position EMPTY) sees nothing. Positions broadcast against each other, as jax or NumPy
  integer arrays (sequence indices obey the same rule) -> bool of the broadcast shape."""
  seen = (k_pos >= 0) & (k_pos <= q_pos)
  if window is not None:
    seen = seen & ((q_pos - k_pos) < window)
  return seen


def init_kv_state(config: TransformerConfig, *, batch_size: int, cache_len: int, dtype: DTypeLike,
                  local_cache_len: int | None = None) -> KVState:
  """An empty KV state (every position EMPTY, fill 0), placed on the default device.

  Args:
    config: the model's TransformerConfig (which layers own a cache, their K and H).
    batch_size: B.
    cache_len: S of global layers: the most tokens a context holds.
    dtype: the dtype of k and v.
    local_cache_len: S of local (sliding-window) layers, at most cache_len; None: cache_len.
      A ring needs window + T - 1 slots for calls of T tokens (`local_slots_needed`).

  Returns:
    A KVState: per cache layer k, v [B, S, K, H] zeros in `dtype` and positions int32 [B, S];
    fill int32 [B].
  """
  host = []
  for i in config.cache_layers:
    spec = config.layer_spec(i)
    slots = cache_len
    if spec.attention_type is AttentionType.LOCAL and local_cache_len is not None:
      slots = min(cache_len, local_cache_len)
    shape = (batch_size, slots, spec.num_kv_heads, spec.head_dim)
    host.append((np.zeros(shape, dtype), np.zeros(shape, dtype),
                 np.full((batch_size, slots), EMPTY, np.int32)))
  # Made on the host and placed in one call: no XLA computation per shape (jnp.zeros would
  # compile and dispatch one for every leaf).
  layers, fill = jax.device_put((host, np.zeros((batch_size,), np.int32)))
  return KVState(layers=tuple(LayerKV(k=k, v=v, positions=p) for k, v, p in layers), fill=fill)


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


# ----------------------------------------------------------------------------------------------
# Operations on whole states (host side, batch row 0): named leaves, rows, positions
# ----------------------------------------------------------------------------------------------


def leaf_names(layer_index: int) -> tuple[str, str, str]:
  """The leaf names of a cache-owning layer's K, V and slot positions ('layer_<i>/k', '/v',
  '/positions'): the one spelling artifacts and store blocks use."""
  k, v, positions = (f'layer_{layer_index}/{part}' for part in ('k', 'v', 'positions'))
  return k, v, positions


def block_leaves(rows: 'KVRows', cache_layers: tuple[int, ...]) -> dict[str, np.ndarray]:
  """The K and V leaves of rows, as a store block holds them: per cache-owning layer i (in
  `cache_layers` order, as `rows` holds them) 'layer_<i>/k' and '/v' [T, K, H]. A block holds no
  positions: its rows are at their own (`block_rows`)."""
  out = {}
  for layer_index, k, v in zip(cache_layers, rows.k, rows.v):
    if k is None or v is None:
      raise ValueError(f'layer {layer_index}: its rows were not read')
    k_name, v_name, _ = leaf_names(layer_index)
    out[k_name], out[v_name] = k, v
  return out


def block_rows(leaves: dict[str, np.ndarray], cache_layers: tuple[int, ...], start: int,
               num_tokens: int) -> 'KVRows':
  """The rows a store block's leaves (`block_leaves`) hold for sequence indices [start,
  start + num_tokens), at their own positions: per cache-owning layer k, v [T, K, H] (None for a
  layer whose leaves were not read) and positions int32 [T]."""
  names = [leaf_names(i) for i in cache_layers]
  positions = np.arange(start, start + num_tokens, dtype=np.int32)
  return KVRows(start, tuple(leaves.get(k) for k, _, _ in names),
                tuple(leaves.get(v) for _, v, _ in names), (positions,) * len(names))


def to_leaves(kv: KVState, cache_layers: tuple[int, ...]) -> dict[str, np.ndarray]:
  """The canonical leaves of batch row 0: per cache-owning layer, slots [0, min(n, S)) of K, V
  [slots, K, H] and positions [slots] (n = kv.fill, the tokens written; a local ring that
  wrapped is stored whole), with the K/V of empty slots zeroed so the bytes depend on the
  tokens alone."""
  n = int(to_host(kv.fill[0]))
  out = {}
  for layer_index, layer in zip(cache_layers, kv.layers):
    stored = min(n, layer.num_slots)
    positions = to_host(layer.positions[0, :stored])
    filled = (positions != EMPTY)[:, None, None]
    k_name, v_name, p_name = leaf_names(layer_index)
    out[k_name] = np.where(filled, to_host(layer.k[0, :stored]), 0)
    out[v_name] = np.where(filled, to_host(layer.v[0, :stored]), 0)
    out[p_name] = positions
  return out


def expected_positions(start: int, num_tokens: int, slots: int) -> np.ndarray:
  """The positions a layer of `slots` slots holds after `num_tokens` tokens from position
  `start` (slots [0, min(n, slots)); slot s holds the last token whose sequence index is
  s mod slots): what to_leaves stores and what assemble must rebuild. -> int32 [min(n, S)]
  (S = slots)."""
  stored = min(num_tokens, slots)
  s = np.arange(stored)
  index = s + slots * ((num_tokens - 1 - s) // slots)
  return (start + index).astype(np.int32)


def rows_from_leaves(leaves: dict[str, np.ndarray], cache_layers: tuple[int, ...],
                     num_tokens: int, start_position: int) -> list['KVRows']:
  """The rows that leaves, as to_leaves writes them, hold for `num_tokens` tokens from
  `start_position`: [0, n - S) from the layers that keep every token (the others read None
  there), [n - S, n) from every layer (S: the smallest ring), each KVRows holding k, v [T, K, H]
  and positions int32 [T] per layer. Raises ValueError when a leaf is missing or does not hold at
  most n slots."""
  stored = []
  for layer_index in cache_layers:
    k_name, v_name, p_name = leaf_names(layer_index)
    if not {k_name, v_name, p_name} <= set(leaves):
      raise ValueError(f'layer {layer_index} has no stored K, V or positions')
    k, v, positions = leaves[k_name], leaves[v_name], leaves[p_name]
    if not 0 < k.shape[0] <= num_tokens or v.shape != k.shape or positions.shape != k.shape[:1]:
      raise ValueError(f'layer {layer_index}: stored K {k.shape}, V {v.shape}, positions '
                       f'{positions.shape} do not hold {num_tokens} tokens')
    stored.append((k, v, positions))
  cuts = sorted({num_tokens - k.shape[0] for k, _, _ in stored} | {0, num_tokens})
  rows = []
  for lo, hi in zip(cuts, cuts[1:]):
    index = np.arange(lo, hi)
    held = [num_tokens - k.shape[0] <= lo for k, _, _ in stored]
    slot = [index % k.shape[0] for k, _, _ in stored]
    rows.append(KVRows(lo, tuple(k[s] if h else None for (k, _, _), s, h in zip(stored, slot, held)),
                       tuple(v[s] if h else None for (_, v, _), s, h in zip(stored, slot, held)),
                       tuple(p[s] if h else (start_position + index).astype(np.int32)
                             for (_, _, p), s, h in zip(stored, slot, held))))
  return rows


@dataclasses.dataclass(frozen=True)
class KVRows:
  """The K/V of consecutive tokens, sequence indices [start, start + T), on the host: the unit
  a store keeps. Per cache-owning layer (config.cache_layers order): k, v [T, K, H] (None for a
  layer that was not read) and positions [T]."""

  start: int
  k: tuple[np.ndarray | None, ...]
  v: tuple[np.ndarray | None, ...]
  positions: tuple[np.ndarray, ...]

  @property
  def num_tokens(self) -> int:
    """T, the tokens the rows cover."""
    return int(self.positions[0].shape[0]) if self.positions else 0

  def layer(self, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Cache layer j's rows.

    Args:
      j: the cache layer's index (in config.cache_layers order, as k and v hold them).
    Returns:
      (k, v), each [T, K, H]; ValueError where they were not read.
    """
    k, v = self.k[j], self.v[j]
    if k is None or v is None:
      raise ValueError(f'cache layer {j}: its rows were not read')
    return k, v

  def prefix(self, n: int) -> 'KVRows':
    """The first n rows. Under the pinned engine a row's bits never depend on the rows after
    it, so a prefix of a block's rows is the KV of that prefix (tests/test_store.py)."""
    if not 0 <= n <= self.num_tokens:
      raise ValueError(f'a prefix of {n} rows out of {self.num_tokens}')
    k = tuple(None if a is None else a[:n] for a in self.k)
    v = tuple(None if a is None else a[:n] for a in self.v)
    return KVRows(self.start, k, v, tuple(p[:n] for p in self.positions))


@functools.partial(jax.jit, static_argnames=('count',))
def _gather_rows(kv: KVState, start: jax.Array, count: int):
  """Per layer, K, V [count, K, H] and positions [count] of sequence indices start.. (row 0)."""
  out = []
  for layer in kv.layers:
    slots = (start + jnp.arange(count)) % layer.num_slots
    out.append((layer.k[0, slots], layer.v[0, slots], layer.positions[0, slots]))
  return out


def take_rows(kv: KVState, start: int, stop: int) -> KVRows:
  """Rows of sequence indices [start, stop) of batch row 0, copied to the host (only those rows
  move): per layer k, v [stop - start, K, H] and positions int32 [stop - start]. Every layer
  must still hold them: a local ring of S slots holds only the last S tokens written."""
  n = int(kv.fill[0])
  if not 0 <= start <= stop <= n:
    raise ValueError(f'rows [{start}, {stop}) of a state holding {n} tokens')
  smallest = min(layer.num_slots for layer in kv.layers)
  if n - start > smallest:
    raise ValueError(f'rows from {start} were overwritten in a ring of {smallest} slots (the '
                     f'state holds {n} tokens)')
  gathered = jax.device_get(_gather_rows(kv, jnp.int32(start), stop - start))
  return KVRows(start, tuple(np.asarray(k) for k, _, _ in gathered),
                tuple(np.asarray(v) for _, v, _ in gathered),
                tuple(np.asarray(p) for _, _, p in gathered))


def first_position(rows: Sequence[KVRows], default: int = 0) -> int:
  """The position of sequence index 0 of a run of rows (the first row's position less its
  sequence index): where the tokens they hold start. `default` where there are no rows."""
  if not rows or not rows[0].num_tokens:
    return default
  return int(rows[0].positions[0][0]) - rows[0].start


def assemble(empty: KVState, rows: list[KVRows], num_tokens: int) -> KVState:
  """A KV state holding sequence indices [0, num_tokens), built on the host from rows (batch
  row 0, the shapes and dtype of `empty`). Each layer keeps the rows its slots hold after all
  `num_tokens` tokens, as a fresh computation leaves them (the last S on a ring of S slots);
  a layer a KVRows has no K/V for (None) takes nothing from it, so a caller reads for each
  layer only the rows that layer keeps. `empty` may be abstract (jax.eval_shape); the result
  holds NumPy arrays: per layer k, v [1, S, K, H] and positions [1, S], fill [1]."""
  buffers = [(np.zeros(layer.k.shape[1:], layer.k.dtype), np.zeros(layer.v.shape[1:], layer.v.dtype),
              np.full(layer.positions.shape[1:], EMPTY, np.int32)) for layer in empty.layers]
  for block in rows:
    index = np.arange(block.start, block.start + block.num_tokens)
    for (k_buf, v_buf, p_buf), k, v, positions in zip(buffers, block.k, block.v,
                                                       block.positions):
      slots = k_buf.shape[0]
      keep = (index < num_tokens) & (index >= num_tokens - slots)
      if not keep.any():
        continue
      if k is None or v is None:
        raise ValueError(f'rows {block.start}.. are needed on a layer of {slots} slots but were '
                         'not read')
      k_buf[index[keep] % slots] = k[keep]
      v_buf[index[keep] % slots] = v[keep]
      p_buf[index[keep] % slots] = positions[keep]
  start = first_position(rows)
  for (_, _, p_buf) in buffers:  # every slot a fresh computation fills, and no other
    stored = min(num_tokens, p_buf.shape[0])
    if not (np.array_equal(p_buf[:stored], expected_positions(start, num_tokens, p_buf.shape[0]))
            and (p_buf[stored:] == EMPTY).all()):
      raise ValueError(f'the rows do not cover sequence indices [0, {num_tokens}) of every '
                       'layer')
  layers = tuple(LayerKV(k=jnp.asarray(k[None]), v=jnp.asarray(v[None]),
                         positions=jnp.asarray(p[None]))
                 for k, v, p in buffers)
  return KVState(layers=layers, fill=jnp.full(empty.fill.shape, num_tokens, jnp.int32))
