"""Shifted grafts: a library computed at positions [s, s + L) placed at [s + δ, s + δ + L).

An own-position graft (graft/store/artifact.py) restores a KV state where it was computed. A shifted
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

Slots never move: a token's slot is its sequence index (gemma_jax/kv_state.py), so a shifted
graft changes keys and positions in place and the query that follows lands in the same slots
as in a fresh computation at the new positions. A shift maps rows to rows (`KVRows`);
`Engine.graft` puts them in a context, as for every other graft.

Why in the library: a shifted graft is a graft a user can make (a library reused at other
positions, knowing what it costs in exactness); the position experiments, the benchmark, the
RoPE fidelity check and graft.exactness all call `graft_shifted` and `layer_divergence`.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import compare
from gemma_jax import kv_state as kvs
from gemma_jax import rope
from gemma_jax.config import TransformerConfig
from gemma_jax.weights import LoadedModel
from graft.store import artifact as artifact_lib
from graft.engine import Context, Engine

METHODS = ('rerotate', 'pre_rope', 'recompute')
GRAFT_METHODS = ('rerotate', 'pre_rope')  # the two that move a computed KV state


class ShiftError(ValueError):
  """A shift that cannot be made (wrong engine for the method, positions out of range)."""


# ----------------------------------------------------------------------------------------------
# Model variants
# ----------------------------------------------------------------------------------------------


def with_config(loaded: LoadedModel, **changes: Any) -> LoadedModel:
  """The same parameters under a config with `changes` (e.g. rope_mode, kv_cache_pre_rope).
  Neither field changes the parameter shapes, so the arrays are shared, not copied."""
  return loaded.replace(config=loaded.config.replace(**changes))


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
# Shifts: rows in, rows out (`Engine.graft` puts them in a context)
# ----------------------------------------------------------------------------------------------


def _check_range(config: TransformerConfig, rows: list[kvs.KVRows], delta: int) -> None:
  if not rows or not rows[0].num_tokens:
    raise ShiftError('an empty context has nothing to shift')
  start = kvs.first_position(rows)
  end = start + rows[-1].start + rows[-1].num_tokens
  if start + delta < 0:
    raise ShiftError(f'a shift by {delta} moves the first token (position {start}) to '
                     f'{start + delta} < 0')
  if end + delta > config.max_context:
    raise ShiftError(f'a shift by {delta} moves the last token to position '
                     f'{end + delta - 1}, past {config.name}\'s context of '
                     f'{config.max_context}')


def _moved(block: kvs.KVRows, delta: int, k=None) -> kvs.KVRows:
  return kvs.KVRows(block.start, block.k if k is None else k, block.v,
                    tuple((p + np.int32(delta)).astype(np.int32) for p in block.positions))


def rerotate(config: TransformerConfig, rows: list[kvs.KVRows], delta: int) -> list[kvs.KVRows]:
  """The rows moved by `delta` positions, their rotated keys rotated once more by `delta`
  (K-shift). Needs a config that caches rotated keys. Under a mode that caches keys unrotated
  ('relative', 'none') the rotation is the identity: the keys stay as they are and only the
  positions move, which is all a shift is there."""
  if config.kv_cache_pre_rope:
    raise ShiftError('rerotate shifts rotated keys; this config caches keys before RoPE '
                     '(use pre_rope)')
  _check_range(config, rows, delta)
  out = []
  for block in rows:
    keys: list[np.ndarray | None] = []
    for layer_index, k in zip(config.cache_layers, block.k):
      if k is None:
        keys.append(None)
        continue
      by_delta = jnp.full((1, k.shape[0]), delta, jnp.int32)
      filled = jnp.ones((1, k.shape[0]), bool)
      keys.append(np.asarray(rotate_layer(config, layer_index, jnp.asarray(k)[None], by_delta,
                                          filled)[0]))
    out.append(_moved(block, delta, tuple(keys)))
  return out


def move_positions(config: TransformerConfig, rows: list[kvs.KVRows],
                   delta: int) -> list[kvs.KVRows]:
  """The rows moved by `delta` positions with their keys untouched: correct for a config that
  caches keys before RoPE (attention rotates them by the moved positions)."""
  if not config.kv_cache_pre_rope:
    raise ShiftError('moving positions alone leaves rotated keys at their old angles; '
                     'pre_rope needs a config with kv_cache_pre_rope=True')
  _check_range(config, rows, delta)
  return [_moved(block, delta) for block in rows]


def shift(config: TransformerConfig, rows: list[kvs.KVRows], delta: int,
          method: str) -> list[kvs.KVRows]:
  """`rows` (computed under `config`) moved by `delta` positions by `method` ('rerotate' or
  'pre_rope'; the config must cache keys accordingly)."""
  if method == 'rerotate':
    return rerotate(config, rows, delta)
  if method == 'pre_rope':
    return move_positions(config, rows, delta)
  raise ShiftError(f'unknown shift method {method!r}; expected one of {GRAFT_METHODS}')


def graft_shifted(engine: Engine, art: artifact_lib.Artifact, delta: int,
                  method: str, preceding: Context | None = None) -> Context:
  """A fresh context holding the artifact grafted at its own positions plus `delta`.
  `preceding`: a context of exactly `delta` tokens from position 0 (the artifact computed at 0):
  the artifact's rows then follow that context's rows, the library after other tokens (a change
  of content as well as of position: its own KV never saw them)."""
  rows = shift(engine.model_config, artifact_lib.rows(engine, art), delta, method)
  if preceding is None:
    return engine.graft(rows, art.tokens, art.start_position + delta)
  if art.start_position != 0 or len(preceding.tokens) != delta:
    raise ShiftError(f'a library after {len(preceding.tokens)} other tokens is grafted at '
                     f'δ = {len(preceding.tokens)} from position 0, not δ = {delta} from '
                     f'{art.start_position}')
  head = kvs.take_rows(preceding.kv, 0, delta)
  rows = [kvs.KVRows(r.start + delta, r.k, r.v, r.positions) for r in rows]
  return engine.graft([head] + rows, tuple(preceding.tokens) + tuple(art.tokens), 0)


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
