"""Self-attention over the explicit KV cache: its implementations, and the `Step` every layer of
a call reads (the layer itself, its projections and norms: gemma_jax.modules.Attention).

The new tokens' K and V are written into the cache first; attention then reduces over the whole
cache buffer (every slot, in slot order) with a mask built from slot positions. Writing first
means a key occupies the same slot whether it arrived in this call or an earlier one, so the
reduction a query row sees does not depend on how the sequence was cut into calls.

`attend` is the reference (XLA) implementation. `IMPLEMENTATIONS` names every implementation an
engine can run ('xla': `attend`; 'pallas': the kernels in gemma_jax/kernels; 'tiled': the
pinned engine's fixed-order tiles, gemma_jax/tiled_attention.py) with what of it
decides bits (its block shapes, recorded in the engine fingerprint); a new kernel is one entry
there plus its module. The model passes each layer's score function (`scores`, from its RoPE
mode in gemma_jax.rope.MODES; None for the plain q . k) to whichever implementation runs.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from gemma_jax import kv_state as kvs
from gemma_jax import pytree
from gemma_jax.numerics import MASKED, XLA, Numerics
from gemma_jax.tiled_attention import DEFAULT_TILE, TiledAttention


def attention_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
  """[B, T, S] bool: slot s is visible to query t (`kv_state.visible`). Empty slots and padding
  queries see nothing."""
  return kvs.visible(q_pos[:, :, None], k_pos[:, None, :], window)


class AttendFn(Protocol):
  """An attention implementation: the signature of `attend`, what decides its bits, and how it
  reads the cache (`tile`, `reading`)."""

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
               k_pos: jax.Array, *, window: int | None, softcap: float | None,
               scores: Callable | None = None, numerics: Numerics = XLA) -> jax.Array:
    ...

  @property
  def tile(self) -> int | None:
    """The KV tile a call may be cut to read whole tiles of (`reading`); None where the
    implementation reads the whole cache."""
    ...

  def reading(self, max_tiles: int | None) -> 'AttendFn':
    """This attention reading only the first `max_tiles` tiles (None: all); itself where it has
    no tiles to cut."""
    ...

  def blocks(self, head_dims: tuple[int, ...], dtype: DTypeLike) -> dict:
    """Block shapes per head dim that change its bits ({} when none): fingerprinted."""
    ...

  def slot_multiple(self, head_dims: tuple[int, ...], dtype: DTypeLike) -> int:
    """Caches sized as a multiple of this run without padding copies."""
    ...


def dot_logits(q: jax.Array, k: jax.Array, q_pos: jax.Array, k_pos: jax.Array) -> jax.Array:
  """q [B, T, K, G, H], k [B, S, K, H] (float32) -> scores [B, T, K, G, S]."""
  del q_pos, k_pos
  return jnp.einsum('btkgh,bskh->btkgs', q, k)


def attend(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array, *,
           window: int | None, softcap: float | None, scores: Callable | None = None,
           numerics: Numerics = XLA) -> jax.Array:
  """Reference attention. q [B, T, N, H] (already scaled), k, v [B, S, K, H], q_pos [B, T],
  k_pos [B, S] -> [B, T, N, H] in v's dtype. `scores` computes the logits from (q, k, q_pos,
  k_pos) in place of `dot_logits` (a RoPE mode's score function, e.g. the quarter-turn control's).

  Everything runs in float32 (bfloat16 inputs are widened exactly first): XLA:CPU's bfloat16
  dot with a float32 result is an order of magnitude slower than widening, and float32 softmax
  is what every Gemma reference does. XLA's own reductions whatever `numerics` says."""
  del numerics
  batch, num_tokens, num_heads, head_dim = q.shape
  num_kv_heads = k.shape[2]
  q = q.reshape(batch, num_tokens, num_kv_heads, num_heads // num_kv_heads, head_dim)
  q, k = q.astype(jnp.float32), k.astype(jnp.float32)
  logits = (scores or dot_logits)(q, k, q_pos, k_pos)
  if softcap is not None:
    logits = jnp.tanh(logits / softcap) * softcap
  mask = attention_mask(q_pos, k_pos, window)[:, :, None, None, :]
  probs = jax.nn.softmax(jnp.where(mask, logits, MASKED), axis=-1)
  out = jnp.einsum('btkgs,bskh->btkgh', probs, v.astype(jnp.float32))
  return out.reshape(batch, num_tokens, num_heads, head_dim).astype(v.dtype)


@dataclasses.dataclass(frozen=True)
class XlaAttention:
  """`attend` as an AttendFn: XLA's own reductions whatever the numerics, over the whole cache,
  no blocks of its own."""

  def __call__(self, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
               k_pos: jax.Array, *, window: int | None, softcap: float | None,
               scores: Callable | None = None, numerics: Numerics = XLA) -> jax.Array:
    return attend(q, k, v, q_pos, k_pos, window=window, softcap=softcap, scores=scores)

  @property
  def tile(self) -> int | None:
    """None: the whole cache in one reduction."""
    return None

  def reading(self, max_tiles: int | None) -> 'XlaAttention':
    """Itself: no tiles to cut."""
    del max_tiles
    return self

  def blocks(self, head_dims: tuple[int, ...], dtype: DTypeLike) -> dict:
    """None: XLA decides its own blocking ({})."""
    del head_dims, dtype
    return {}

  def slot_multiple(self, head_dims: tuple[int, ...], dtype: DTypeLike) -> int:
    """1: any cache size."""
    del head_dims, dtype
    return 1


# The reference attention as an AttendFn: the default of every model call.
XLA_ATTENTION = XlaAttention()


def _xla(tile_size: int | None, platform: str | None) -> AttendFn:
  del platform  # XLA compiles it for whatever it lowers to
  if tile_size is not None:
    raise ValueError('attention_tile applies to the Pallas kernel; XLA attention has no tiles')
  return XlaAttention()


def _pallas(tile_size: int | None, platform: str | None) -> AttendFn:
  from gemma_jax.kernels import pallas_attention  # deferred: Pallas, imported only where it runs
  return pallas_attention.make_pallas_attention(
      tile_size=tile_size, platform=platform,
      interpret=None if platform is None else platform == 'cpu')


def _tiled(tile_size: int | None, platform: str | None) -> AttendFn:
  del platform  # plain XLA ops
  return TiledAttention(tile_size or DEFAULT_TILE)


# name -> a builder taking the KV tile size (None: the implementation's default) and the
# platform to build for ('cpu', 'gpu', 'tpu'; None: the default backend's; another platform than
# this host's gives a function that lowers for it, graft/engine/lowering.py, but does not run).
IMPLEMENTATIONS: dict[str, Callable[[int | None, str | None], AttendFn]] = {
    'xla': _xla, 'pallas': _pallas, 'tiled': _tiled}


def build(name: str, tile_size: int | None = None, platform: str | None = None) -> AttendFn:
  """The attention implementation `name` (a key of IMPLEMENTATIONS) with KV tiles of
  `tile_size` slots (None: its default), built for `platform` (None: the default backend's)."""
  if name not in IMPLEMENTATIONS:
    raise ValueError(f'unknown attention {name!r}; expected one of {tuple(IMPLEMENTATIONS)}')
  return IMPLEMENTATIONS[name](tile_size, platform)


RopeKey = tuple[int, float, float, float]  # (head dim, base, scale, rotary fraction)


@pytree.dataclass
class Step:
  """What every layer of one model call reads besides its input and its cache (a pytree, made
  once per call by gemma_jax.modules.Transformer).

  positions: int32 [B, T], the call's RoPE positions (kv_state.EMPTY: a padding row).
  start: int32 [B], row 0's sequence index (where the call's rows are written).
  angles: per RoPE key (gemma_jax.modules.Attention.rope_key), the (sin, cos) [B, T, H/2] of
    the call's positions (None: no rotation), computed once for the layers that share them.
  per_layer_inputs: [B, T, L, E] (Gemma 4 E-models: one gated input per layer), else None.
  numerics: the call's arithmetic, bound to its per-call bundle (gemma_jax.numerics.CallBundle).
  attention_fn: the attention implementation (static)."""

  positions: jax.Array
  start: jax.Array
  angles: dict[RopeKey, tuple[jax.Array, jax.Array] | None]
  per_layer_inputs: jax.Array | None
  numerics: Numerics
  attention_fn: AttendFn = pytree.field(static=True)
