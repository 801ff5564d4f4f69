"""Self-attention over the explicit KV cache.

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
import functools
from typing import Callable, Protocol

import jax
import jax.numpy as jnp
from flax import nnx, struct
from jax.typing import DTypeLike

from gemma_jax import kv_state as kvs
from gemma_jax import rope, sharding
from gemma_jax.config import LayerSpec, TransformerConfig
from gemma_jax.kernels import pallas_attention
from gemma_jax.layers import Dense, RMSNorm
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


@struct.dataclass
class Step:
  """What every layer of one model call reads besides its input and its cache (a pytree, made
  once per call by gemma_jax.model.Transformer).

  positions: int32 [B, T], the call's RoPE positions (kv_state.EMPTY: a padding row).
  start: int32 [B], row 0's sequence index (where the call's rows are written).
  angles: per RoPE key (`Attention.rope_key`), the (sin, cos) [B, T, H/2] of the call's
    positions (None: no rotation), computed once for the layers that share them.
  per_layer_inputs: [B, T, L, E] (Gemma 4 E-models: one gated input per layer), else None.
  numerics: the call's arithmetic, bound to its per-call bundle (gemma_jax.numerics.CallBundle).
  attention_fn: the attention implementation (static)."""

  positions: jax.Array
  start: jax.Array
  angles: dict[RopeKey, tuple[jax.Array, jax.Array] | None]
  per_layer_inputs: jax.Array | None
  numerics: Numerics
  attention_fn: AttendFn = struct.field(pytree_node=False)


class Attention(nnx.Module):
  """Projections, QK(V)-norms, RoPE, cache write, attention, output projection.

  Weights, stored [inputs..., outputs...]: q_proj [D, N, H]; kv_proj [D, 2, K, H], or k_proj
  [D, K, H] when one projection feeds K and V; o_proj [N, H, D]. A KV-shared layer owns no K/V
  weights and reads the cache of its source layer.
  """

  def __init__(self, config: TransformerConfig, spec: LayerSpec, *, owns_kv: bool,
               dtype: DTypeLike):
    d, n, k, h = config.embed_dim, config.num_heads, spec.num_kv_heads, spec.head_dim
    self.config = config
    self.spec = spec
    self.owns_kv = owns_kv
    self.q_proj = Dense((d,), (n, h), dtype=dtype)
    self.o_proj = Dense((n, h), (d,), dtype=dtype)
    norm = functools.partial(RMSNorm, offset=config.norm_scale_offset, eps=config.rms_norm_eps,
                           dtype=dtype)
    self.query_norm = norm(h) if config.use_qk_norm else None
    self.key_norm = norm(h) if config.use_qk_norm and owns_kv else None
    self.value_norm = (norm(h, with_scale=False)
                       if config.use_v_norm and owns_kv else None)
    self.k_proj = (Dense((d,), (k, h), dtype=dtype)
                   if owns_kv and spec.k_eq_v else None)
    self.kv_proj = (Dense((d,), (2, k, h), dtype=dtype)
                    if owns_kv and not spec.k_eq_v else None)

  def rope_key(self) -> RopeKey:
    """What decides this layer's rotation angles besides the positions (layers that share it
    share one sin/cos table per call)."""
    return (self.spec.head_dim, self.spec.rope_base, self.spec.rope_scale,
            self.spec.rotary_fraction)

  def angles(self, positions: jax.Array,
             numerics: Numerics) -> tuple[jax.Array, jax.Array] | None:
    """(sin, cos) [B, T, H/2] of this layer's RoPE at positions [B, T] (None: no rotation)."""
    return rope.sin_cos(positions, self.spec.head_dim, base=self.spec.rope_base,
                        scale=self.spec.rope_scale, rotary_fraction=self.spec.rotary_fraction,
                        mode=self.config.rope_mode, numerics=numerics)

  def keys_values(self, x: jax.Array, angles: tuple[jax.Array, jax.Array] | None,
                  numerics: Numerics) -> tuple[jax.Array, jax.Array]:
    """The cache entries of new tokens: normed K (turned by `angles` unless the config caches
    keys before RoPE) and normed V, each [B, T, K, H]."""
    if self.k_proj is not None:
      k = v = self.k_proj(x, numerics)
    else:
      assert self.kv_proj is not None  # a layer that owns its KV has one of the two
      kv = self.kv_proj(x, numerics)  # [B, T, 2, K, H]
      k, v = kv[:, :, 0], kv[:, :, 1]
    if self.key_norm is not None:
      k = self.key_norm(k, numerics)
    if self.value_norm is not None:
      v = self.value_norm(v, numerics)
    return (k if self.config.kv_cache_pre_rope else rope.rotate_heads(k, angles, numerics)), v

  def __call__(self, x: jax.Array, cache: kvs.LayerKV,
               step: Step) -> tuple[jax.Array, kvs.LayerKV]:
    """x [B, T, D] -> ([B, T, D], the layer cache after this call's write), at the call's
    positions with this layer's RoPE angles (`step`). For a KV-shared layer `cache` is the source
    layer's, already updated, and is returned as is."""
    positions, numerics = step.positions, step.numerics
    angles = step.angles[self.rope_key()]
    q = self.q_proj(x, numerics)
    if self.query_norm is not None:
      q = self.query_norm(q, numerics)
    q = rope.rotate_heads(q, angles, numerics)
    if self.config.query_pre_attn_scalar is not None:
      q = numerics.mul(q, jnp.asarray(self.config.query_pre_attn_scalar ** -0.5, q.dtype))
    if self.owns_kv:
      k, v = self.keys_values(x, angles, numerics)
      cache = kvs.write(cache, k, v, positions, step.start)
    keys = cache.k
    if self.config.kv_cache_pre_rope:  # every slot rotated by its own position (empty: masked)
      keys = rope.rotate_heads(keys, self.angles(cache.positions, numerics), numerics)
    mode = rope.get_mode(self.config.rope_mode)
    scores = mode.scores(self.spec, numerics) if mode.scores else None
    encoded = step.attention_fn(q, keys, cache.v, positions, cache.positions,
                                window=self.spec.window, softcap=self.config.attn_logits_softcap,
                                scores=scores, numerics=numerics)
    mesh = numerics.call.mesh
    return sharding.whole(self.o_proj(sharding.whole(encoded, mesh), numerics), mesh), cache

