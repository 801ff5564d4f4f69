"""Shifted grafts: a library computed at positions [s, s + L) placed at [s + δ, s + δ + L).

An own-position graft (graft/artifact.py) restores a KV state where it was computed. A shifted
graft moves it by an offset δ; with float RoPE the keys then have to be rotated to their new
positions, and there are two ways to do it:

  rerotate   the cache holds rotated keys (as Gemma caches them); rotate every stored key once
             more by δ, with the rotation of its layer (base, scale, rotary fraction) and the
             config's RoPE mode, as llama.cpp's K-shift does. V is unchanged; slot positions
             and the next position move by δ. Exact only if R(δ) R(p) k == R(p + δ) k bit for
             bit, which float RoPE does not give (analysis/rope_float.py).
  pre_rope   the engine's model caches keys before RoPE and rotates every slot by its stored
             position at each read (TransformerConfig.kv_cache_pre_rope); a shift only moves
             the slot positions, and RoPE is then applied at the new positions directly.

Neither makes a shifted graft equal to a fresh computation at the new positions unless the
model is translation-invariant in floating point: the K/V of every layer past the first depend
on attention outputs, which depend on the rotated keys' absolute angles through rounding. The
third method of experiments/position_sweep.py, `recompute`, measures exactly that (fresh at δ
against fresh at 0; no graft), and `layer_divergence` here measures where the bits part
(gemma_jax.compare.first_differing_layer names the first layer that differs).

Slots never move: a token's slot is its ctxuence index (gemma_jax/kv_state.py), so a shifted
graft changes keys and positions in place and the query that follows lands in the same slots
as in a fresh computation at the new positions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import compare
from gemma_jax import kv_state as kvs
from gemma_jax import rope
from gemma_jax.config import TransformerConfig
from gemma_jax.weights import LoadedModel
from graft import artifact as artifact_lib
from graft.engine import Context, Engine

METHODS = ('rerotate', 'pre_rope', 'recompute')
GRAFT_METHODS = ('rerotate', 'pre_rope')  # the two that move a computed KV state


class ShiftError(ValueError):
  """A shift that cannot be made (wrong engine for the method, positions out of range)."""


# ----------------------------------------------------------------------------------------------
# Model variants
# ----------------------------------------------------------------------------------------------


def with_config(loaded: LoadedModel, **changes) -> LoadedModel:
  """The same parameters under a config with `changes` (e.g. rope_mode, kv_cache_pre_rope).
  Neither field changes the parameter shapes, so the arrays are shared, not copied."""
  return dataclasses.replace(loaded, config=loaded.config.replace(**changes))


def pre_rope_model(loaded: LoadedModel) -> LoadedModel:
  """The model with keys cached before RoPE (rotated by slot position at every read)."""
  return with_config(loaded, kv_cache_pre_rope=True)


# ----------------------------------------------------------------------------------------------
# Rotation
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnames=('base', 'scale', 'rotary_fraction', 'mode'))
def _rotate(k, positions, filled, *, base, scale, rotary_fraction, mode):
  """k [B, S, K, H] rotated by positions [B, S] (gemma_jax.rope.apply_rope, jitted like the
  model's own calls) where `filled` [B, S]; other slots are returned unchanged."""
  rotated = rope.apply_rope(k, jnp.where(filled, positions, 0), base=base, scale=scale,
                            rotary_fraction=rotary_fraction, mode=mode)
  return jnp.where(filled[:, :, None, None], rotated, k)


def rotate_layer(config: TransformerConfig, layer_index: int, k: jax.Array,
                 positions: jax.Array, filled: jax.Array) -> jax.Array:
  """Keys [B, S, K, H] of cache-owning layer `layer_index` rotated by positions [B, S] (any
  integers, negative ones included) with that layer's RoPE (base, scale, rotary fraction) and
  the config's mode, on the slots where `filled` [B, S]; the other slots as they are."""
  spec = config.layer_spec(layer_index)
  return _rotate(k, positions, filled, base=spec.rope_base, scale=spec.rope_scale,
                 rotary_fraction=spec.rotary_fraction, mode=config.rope_mode)


def attention_keys(config: TransformerConfig, ctx: Context) -> list[jax.Array]:
  """Per cache-owning layer, the keys as attention reads them: the cache itself, or the cache
  rotated by its slot positions when the config caches keys before RoPE."""
  keys = []
  for layer_index, layer in zip(config.cache_layers, ctx.kv.layers):
    keys.append(rotate_layer(config, layer_index, layer.k, layer.positions,
                             layer.positions != kvs.EMPTY)
                if config.kv_cache_pre_rope else layer.k)
  return keys


# ----------------------------------------------------------------------------------------------
# Shifts
# ----------------------------------------------------------------------------------------------


def _check_range(config: TransformerConfig, ctx: Context, delta: int) -> None:
  if not ctx.tokens:
    raise ShiftError('an empty context has nothing to shift')
  start = ctx.next_position - len(ctx.tokens)
  if start + delta < 0:
    raise ShiftError(f'a shift by {delta} moves the first token (position {start}) to '
                     f'{start + delta} < 0')
  if ctx.next_position + delta > config.max_context:
    raise ShiftError(f'a shift by {delta} moves the last token to position '
                     f'{ctx.next_position + delta - 1}, past {config.name}\'s context of '
                     f'{config.max_context}')


def rerotate(config: TransformerConfig, ctx: Context, delta: int) -> Context:
  """The context moved by `delta` positions, its rotated keys rotated once more by `delta`
  (K-shift). Needs a config that caches rotated keys."""
  if config.kv_cache_pre_rope:
    raise ShiftError('rerotate shifts rotated keys; this config caches keys before RoPE '
                     '(use pre_rope)')
  _check_range(config, ctx, delta)
  layers = []
  for layer_index, layer in zip(config.cache_layers, ctx.kv.layers):
    # A negative delta may equal EMPTY (-1), so the filled slots travel as a separate mask.
    filled = layer.positions != kvs.EMPTY
    by_delta = jnp.full_like(layer.positions, delta)
    layers.append(layer.replace(k=rotate_layer(config, layer_index, layer.k, by_delta, filled)))
  kv = kvs.shift_positions(ctx.kv.replace(layers=tuple(layers)), delta)
  return Context(kv=kv, tokens=ctx.tokens, next_position=ctx.next_position + delta)


def move_positions(config: TransformerConfig, ctx: Context, delta: int) -> Context:
  """The context moved by `delta` positions with its keys untouched: correct for a config that
  caches keys before RoPE (attention rotates them by the moved positions)."""
  if not config.kv_cache_pre_rope:
    raise ShiftError('moving positions alone leaves rotated keys at their old angles; '
                     'pre_rope needs a config with kv_cache_pre_rope=True')
  _check_range(config, ctx, delta)
  return Context(kv=kvs.shift_positions(ctx.kv, delta), tokens=ctx.tokens,
                 next_position=ctx.next_position + delta)


def shift(engine: Engine, ctx: Context, delta: int, method: str) -> Context:
  """`ctx` (computed by `engine`) moved by `delta` positions by `method` ('rerotate' or
  'pre_rope'; the engine's model must cache keys accordingly)."""
  if method == 'rerotate':
    return rerotate(engine.config, ctx, delta)
  if method == 'pre_rope':
    return move_positions(engine.config, ctx, delta)
  raise ShiftError(f'unknown shift method {method!r}; expected one of {GRAFT_METHODS}')


def graft_shifted(engine: Engine, art: artifact_lib.Artifact, delta: int,
                  method: str) -> Context:
  """A fresh context holding the artifact grafted at its own positions plus `delta`."""
  return shift(engine, artifact_lib.graft(engine, art), delta, method)


# ----------------------------------------------------------------------------------------------
# Comparing KV states
# ----------------------------------------------------------------------------------------------


def layer_divergence(config: TransformerConfig, ctx: Context, reference: Context, *,
                     slot_positions: tuple[int, int], keys: str = 'cache',
                     reference_config: TransformerConfig | None = None,
                     position_offset: int = 0) -> list[dict]:
  """Per cache-owning layer, how far `ctx`'s K/V are from `reference`'s on the slots whose
  reference position lies in [lo, hi) = `slot_positions` (the library's slots that the query
  has not overwritten).

  keys='cache' compares the cached keys as stored; 'attention' compares them as attention reads
  them (rotated by slot position where a config caches keys before RoPE). `reference_config`
  (default `config`) is the reference's own config, whose rotation applies to its keys.
  On the compared slots `ctx`'s positions must be the reference's plus `position_offset` (0 for
  a graft against its reference; δ for `recompute`, which compares the same tokens computed at
  two offsets)."""
  reference_config = reference_config or config
  lo, hi = slot_positions
  if keys == 'attention':
    ours, theirs = attention_keys(config, ctx), attention_keys(reference_config, reference)
  elif keys == 'cache':
    ours = [layer.k for layer in ctx.kv.layers]
    theirs = [layer.k for layer in reference.kv.layers]
  else:
    raise ValueError(f"keys must be 'cache' or 'attention', not {keys!r}")
  rows = []
  for i, layer_index in enumerate(config.cache_layers):
    ref_positions = np.asarray(reference.kv.layers[i].positions[0])
    our_positions = np.asarray(ctx.kv.layers[i].positions[0])
    slots = np.nonzero((ref_positions >= lo) & (ref_positions < hi))[0]
    if not np.array_equal(our_positions[slots], ref_positions[slots] + position_offset):
      raise ShiftError(f'layer {layer_index}: the slot positions of the two states do not '
                       f'differ by {position_offset}')
    k, k_ref = np.asarray(ours[i][0, slots]), np.asarray(theirs[i][0, slots])
    v = np.asarray(ctx.kv.layers[i].v[0, slots])
    v_ref = np.asarray(reference.kv.layers[i].v[0, slots])
    rows.append({
        'layer': int(layer_index),
        'attention_type': config.layer_spec(layer_index).attention_type.value,
        'slots': int(len(slots)),
        'k_equal': compare.sha256_bytes(k) == compare.sha256_bytes(k_ref),
        'v_equal': compare.sha256_bytes(v) == compare.sha256_bytes(v_ref),
        # Equal as numbers (-0.0 == +0.0): True with k_equal False means the bytes differ only
        # in the sign of zeros.
        'k_values_equal': bool(np.array_equal(k.astype(np.float32), k_ref.astype(np.float32))),
        'v_values_equal': bool(np.array_equal(v.astype(np.float32), v_ref.astype(np.float32))),
        'k_max_abs': compare.max_abs(k, k_ref),
        'v_max_abs': compare.max_abs(v, v_ref),
        'k_max_ulp': compare.max_ulp(k, k_ref),
        'v_max_ulp': compare.max_ulp(v, v_ref),
    })
  return rows
