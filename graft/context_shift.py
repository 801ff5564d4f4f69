"""Context shift: a window of W tokens that, when full, drops its oldest D tokens and keeps going
(llama.cpp's context shift), against the kept tokens placed directly where they end up.

A shift removes the oldest `drop` tokens and moves every kept token `drop` positions earlier
(`drop_oldest`; a token's slot is its sequence index, so the slots roll with the indices). What
the keys need then depends on the RoPE mode:

  relative  keys are cached unrotated and scored from offsets (gemma_jax.rope.RelativeScores):
            the shift only moves positions, and nothing is recomputed that could drift.
  float     keys are cached rotated at their positions; llama.cpp's K-shift turns every cached
            key by -Δ in place at each shift, so after n shifts a key is R(-Δ)^n R(p) k, rounded
            n + 1 times, where placing it directly gives R(p - nΔ) k, rounded once.

The reference after N shifts is the same kept token states placed directly at their final
positions: each token's raw key and its value as the stream wrote them (`Kept`), the key
rotated once at the final position by the engine's own RoPE (float) or left raw (relative), in
a fresh context made by Engine.graft. `run` streams tokens through the window and `measure`s
the shifted cache against the reference after the shift counts asked for.

What is exact, and how it is known:
- Raw keys under float. A float engine caches R(p) k and never k, so the stream runs the same
  model with keys cached before RoPE (kv_cache_pre_rope): its attention rotates each cached raw
  key by its slot position at every read, with the operations a rotated cache applies at write,
  so its logits are the float engine's and its cache holds the raw keys. `turn` (graft.store.compose) is that
  rotation, jitted with the engine's numerics and compiler options: R(p) of the stream's raw
  key is the float engine's cached key, bit for bit (tests/test_context_shift.py), and at every
  measurement the reference's next logits equal the stream's (`reference_equals_stream`).
- So the stream is the exact shift, and llama.cpp's cache is kept beside it: the same tokens,
  values and positions, its keys written as R(p) k and turned by -Δ at every shift. The drift
  measured is the K-shift's own, on states that do not otherwise differ (llama.cpp would also
  compute the tokens after a shift from drifted keys, which compounds it).
- R(-Δ) is the engine's sin and cos of the angle of Δ with sin negated (exact), as
  RelativeScores turns keys back.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import compare
from gemma_jax import kv_state as kvs
from gemma_jax.weights import LoadedModel
from graft.engine import Context, Engine, EngineConfig
from graft.store.compose import turn  # the engine's rotation of cached keys (one home)


# ----------------------------------------------------------------------------------------------
# The shift and the rotation
# ----------------------------------------------------------------------------------------------


@functools.partial(jax.jit, static_argnums=1)
def _drop(kv: kvs.KVState, drop: int, cut: jax.Array) -> kvs.KVState:
  """Every layer's slots rolled back by `drop` (sequence index i - drop in slot (i - drop) mod S),
  the tokens at positions below `cut` emptied (K and V zero, as a fresh state has them), the
  others moved `drop` positions earlier."""
  layers = []
  for layer in kv.layers:
    k, v, positions = (jnp.roll(x, -drop, axis=1) for x in (layer.k, layer.v, layer.positions))
    kept = positions >= cut
    layers.append(kvs.LayerKV(k=jnp.where(kept[..., None, None], k, 0),
                              v=jnp.where(kept[..., None, None], v, 0),
                              positions=jnp.where(kept, positions - drop, kvs.EMPTY)))
  return kvs.KVState(layers=tuple(layers), fill=kv.fill - drop)


def drop_oldest(ctx: Context, drop: int) -> Context:
  """The context without its oldest `drop` tokens, every kept token `drop` positions earlier,
  keys and values untouched (the shift of a cache of raw keys; a rotated cache's keys also need
  `turn`). Its last logits are left out: they were computed at the old positions."""
  if not 0 < drop < len(ctx.tokens):
    raise ValueError(f'a shift drops 1 to {len(ctx.tokens) - 1} of the context\'s '
                     f'{len(ctx.tokens)} tokens, not {drop}')
  first = ctx.next_position - len(ctx.tokens)
  kv = _drop(ctx.kv, drop, jnp.int32(first + drop))
  kv = jax.device_put(kv, jax.tree.map(lambda x: x.sharding, ctx.kv))  # placed as it was
  return Context(kv=kv, tokens=ctx.tokens[drop:], next_position=ctx.next_position - drop)


# ----------------------------------------------------------------------------------------------
# Engines and the kept states
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Engines:
  """model: the mode as trained (float: rotated keys cached; relative: raw keys); stream: the
  same model caching raw keys (float: kv_cache_pre_rope; relative: `model` itself)."""

  model: Engine
  stream: Engine

  @property
  def relative(self) -> bool:
    return self.model.model_config.rope_mode == 'relative'


def make_engines(loaded: LoadedModel, engine_config: EngineConfig) -> Engines:
  mode = loaded.config.rope_mode
  if mode not in ('float', 'relative'):
    raise ValueError(f"a context shift runs RoPE 'float' or 'relative', not {mode!r}")
  model = Engine(loaded, engine_config)
  if mode == 'relative':
    return Engines(model, model)
  raw = loaded.replace(config=loaded.config.replace(kv_cache_pre_rope=True))
  return Engines(model, Engine(raw, engine_config))


class Kept:
  """The kept tokens' states as the stream wrote them, on the host: per cache-owning layer their
  raw keys and values [n, K, H] (zeros for tokens a layer's ring had already dropped when they
  were read: no context can hold them again), their positions now, the shift count at which each
  was written and, under float, llama.cpp's cached keys (written R(p) k, turned by -Δ at every
  shift)."""

  def __init__(self, engine: Engine, llama: bool):
    self.engine, self.llama = engine, llama
    self.layers = engine.model_config.cache_layers
    empty = lambda: [np.zeros((0,) + l.k.shape[2:], l.k.dtype) for l in engine.empty_kv().layers]
    self.raw, self.v, self.cached = empty(), empty(), empty()
    self.positions = np.zeros(0, np.int32)
    self.written_at = np.zeros(0, np.int32)
    self.shifts = 0

  def __len__(self) -> int:
    return len(self.positions)

  def write(self, kv: kvs.KVState, start: int, stop: int, first_position: int) -> None:
    """Appends sequence indices [start, stop) of the stream's state (just written)."""
    positions = np.arange(first_position, first_position + stop - start, dtype=np.int32)
    smallest = min(layer.num_slots for layer in kv.layers)
    ks: list[np.ndarray] = []
    vs: list[np.ndarray] = []
    if stop - start <= smallest:  # every layer holds them: gather only these rows
      rows = kvs.take_rows(kv, start, stop)
      ks = [k for k in rows.k if k is not None]  # take_rows reads every layer
      vs = [v for v in rows.v if v is not None]
    else:  # a ring has dropped the oldest: read whole layers
      for layer in kv.layers:
        index = np.arange(start, stop)
        held = (index >= stop - layer.num_slots)[:, None, None]
        slots = index % layer.num_slots
        ks.append(np.where(held, np.asarray(layer.k[0])[slots], 0))
        vs.append(np.where(held, np.asarray(layer.v[0])[slots], 0))
    for i, (layer_index, k, v) in enumerate(zip(self.layers, ks, vs)):
      self.raw[i] = np.concatenate([self.raw[i], k])
      self.v[i] = np.concatenate([self.v[i], v])
      if self.llama:  # as a float engine caches them: rotated at their positions
        self.cached[i] = np.concatenate([self.cached[i],
                                         turn(self.engine, layer_index, k, positions)])
    self.positions = np.concatenate([self.positions, positions])
    self.written_at = np.concatenate([self.written_at,
                                      np.full(stop - start, self.shifts, np.int32)])

  def shift(self, drop: int) -> None:
    """Drops the oldest `drop` tokens and moves the others `drop` positions earlier; llama.cpp's
    cached keys are turned by -drop in place (its K-shift)."""
    keep = slice(drop, None)
    self.raw = [k[keep] for k in self.raw]
    self.v = [v[keep] for v in self.v]
    self.positions = self.positions[keep] - np.int32(drop)
    self.written_at = self.written_at[keep]
    if self.llama:
      by = np.full(len(self.positions), drop, np.int32)
      self.cached = [turn(self.engine, layer_index, k[keep], by, back=True)
                     for layer_index, k in zip(self.layers, self.cached)]
    self.shifts += 1

  def rows(self, keys: str) -> list[kvs.KVRows]:
    """The kept tokens as one block of rows at their positions now, their keys 'cached'
    (llama.cpp's) or 'placed' (the reference: raw keys rotated once at these positions under
    float, the raw keys themselves under relative)."""
    if keys == 'cached':
      k = self.cached
    elif keys == 'placed':
      k = ([turn(self.engine, layer_index, raw, self.positions)
            for layer_index, raw in zip(self.layers, self.raw)] if self.llama else self.raw)
    else:
      raise ValueError(f"keys must be 'cached' or 'placed', not {keys!r}")
    return [kvs.KVRows(0, tuple(k), tuple(self.v),
                       tuple(self.positions for _ in self.layers))]

  def most_turns(self) -> int:
    """The most shifts any kept token has been through."""
    return int(self.shifts - self.written_at.min()) if len(self) else 0


# ----------------------------------------------------------------------------------------------
# Measuring and streaming
# ----------------------------------------------------------------------------------------------


def _greedy(engine: Engine, ctx: Context, count: int) -> list[int]:
  return engine.decode(ctx, count).tokens if count else []


def _first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def measure(engines: Engines, stream: Context, kept: Kept, next_token: int,
            stream_logits: np.ndarray, continuation: int) -> dict:
  """The shifted cache after `kept.shifts` shifts against the reference (the kept states placed
  directly at their positions), before `next_token` is fed: K and V (SHA-256, max |ΔK| per
  layer, and the largest |K| of the reference for scale), the logits after `next_token`
  (SHA-256, KL, max |Δ|) and greedy continuations of `continuation` tokens (the first index
  where they differ). `stream_logits`: the stream's own logits after `next_token`, which the
  reference's must equal."""
  model = engines.model
  first = stream.next_position - len(stream.tokens)
  reference = model.graft(kept.rows('placed'), stream.tokens, first)
  shifted = stream if engines.relative else model.graft(kept.rows('cached'), stream.tokens, first)
  ours = kvs.to_leaves(shifted.kv, model.model_config.cache_layers)
  theirs = kvs.to_leaves(reference.kv, model.model_config.cache_layers)
  layers = []
  same = lambda name: compare.sha256_bytes(ours[name]) == compare.sha256_bytes(theirs[name])
  for layer_index in model.model_config.cache_layers:
    k_name, v_name, p_name = kvs.leaf_names(layer_index)
    if not np.array_equal(ours[p_name], theirs[p_name]):
      raise ValueError(f'layer {layer_index}: the shifted and reference positions differ')
    layers.append({'layer': int(layer_index),
                   'attention_type': model.model_config.layer_spec(layer_index).attention_type.value,
                   'k_equal': same(k_name), 'v_equal': same(v_name),
                   'k_max_abs': compare.max_abs(ours[k_name], theirs[k_name]),
                   'k_max_ulp': compare.max_ulp(ours[k_name], theirs[k_name])})
  digest = lambda leaves: compare.sha256_bytes(np.concatenate(
      [np.ravel(leaves[name]).view(np.uint8) for name in sorted(leaves)]))
  ref_ctx, ref_logits = model.extend(reference, [next_token], logits='last')
  assert ref_logits is not None  # logits='last'
  if engines.relative:
    shift_ctx, shift_logits = model.extend(shifted, [next_token], logits='last')
  else:
    shift_ctx, shift_logits = model.extend(shifted, [next_token], logits='last', consume=True)
  assert shift_logits is not None  # logits='last'
  ref_tokens = _greedy(model, ref_ctx, continuation)
  shift_tokens = _greedy(model, shift_ctx, continuation)
  return {
      'shifts': kept.shifts,
      'most_turns': kept.most_turns(),
      'tokens_in_context': len(stream.tokens),
      'kv_sha256': digest(ours), 'reference_kv_sha256': digest(theirs),
      'kv_equal': digest(ours) == digest(theirs),
      'k_max_abs': max(l['k_max_abs'] for l in layers),
      'k_max_ulp': max(l['k_max_ulp'] for l in layers),
      'reference_k_max': max(float(np.abs(theirs[kvs.leaf_names(i)[0]]).max())
                             for i in model.model_config.cache_layers),
      'logits_sha256': compare.sha256_bytes(shift_logits),
      'reference_logits_sha256': compare.sha256_bytes(ref_logits),
      'logits_equal': compare.sha256_bytes(shift_logits) == compare.sha256_bytes(ref_logits),
      'reference_equals_stream': (compare.sha256_bytes(ref_logits)
                                  == compare.sha256_bytes(stream_logits)),
      'kl': float(compare.kl_per_position(ref_logits, shift_logits)[0]),
      'logits_max_abs': compare.max_abs(shift_logits, ref_logits),
      'continuation_tokens': continuation,
      'first_differing_token': _first_difference(shift_tokens, ref_tokens),
      'layers': layers,
  }


def run(engines: Engines, text: Sequence[int], *, window: int, drop: int,
        measure_at: Sequence[int], continuation: int = 0,
        log: Callable[[str], None] = lambda message: None) -> dict:
  """Streams tokens through a window of `window` tokens: the first min(len(text), window) of
  `text` in one call, then one token per call (the rest of `text`, then greedy), shifting by
  `drop` each time the window is full, until max(measure_at) shifts; after each shift count in
  `measure_at`, `measure`. Returns {"measurements", "stream_tokens", "seconds"}."""
  if not 0 < drop < window:
    raise ValueError(f'--drop must be in [1, {window - 1}] for a window of {window}, not {drop}')
  if not text:
    raise ValueError('the stream needs at least one token of text')
  targets = sorted(set(int(n) for n in measure_at))
  if not targets or targets[0] < 1:
    raise ValueError(f'shift counts to measure at must be >= 1, not {list(measure_at)}')
  stream_engine = engines.stream
  kept = Kept(engines.model, llama=not engines.relative)
  prompt = list(text[:window])
  ctx, logits = stream_engine.prefill(prompt)
  assert logits is not None  # logits='last' (prefill's default)
  kept.write(ctx.kv, 0, len(prompt), 0)
  fed = len(prompt)
  measurements, start = [], time.perf_counter()
  while kept.shifts < targets[-1]:
    token = text[fed] if fed < len(text) else int(np.argmax(logits[-1]))
    measuring = False
    if len(ctx.tokens) == window:
      ctx = drop_oldest(ctx, drop)
      kept.shift(drop)
      measuring = kept.shifts in targets
    n = len(ctx.tokens)
    new, logits = stream_engine.extend(ctx, [token], logits='last', consume=not measuring)
    assert logits is not None  # logits='last'
    if measuring:
      measurements.append(measure(engines, ctx, kept, token, logits[-1], continuation))
      m = measurements[-1]
      log(f'{kept.shifts} shifts ({time.perf_counter() - start:.0f} s): kv_equal={m["kv_equal"]} '
          f'max |ΔK|={m["k_max_abs"]:.3g} logits_equal={m["logits_equal"]} kl={m["kl"]:.3g} '
          f'first differing token={m["first_differing_token"]}')
    kept.write(new.kv, n, n + 1, new.next_position - 1)
    ctx, fed = new, fed + 1
  return {'measurements': measurements, 'stream_tokens': fed,
          'seconds': round(time.perf_counter() - start, 1)}
