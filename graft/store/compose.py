"""Composition: documents computed once after a shared prefix, placed in any order at any
position in front of a query, with a chosen share of their tokens recomputed.

The composed context is the prefix (its own rows, at positions 0 .. p - 1), then each document
at the next free sequence index o_i = p + (the lengths of the documents before it), then the
query. Placing a document computed at positions p .. p + L - 1 at o_i moves it by Δ_i = o_i - p:

  relative  keys are stored unrotated and every score is computed from the offset between a
            query and a key (gemma_jax.rope.RelativeScores), so a document's rows are the same
            bytes wherever they sit: placing them moves their positions and nothing else. Its
            rows at o_i are SHA-256 equal to the prefix and the document computed from position
            Δ_i (tests/test_compose.py, experiments.compose --relocation).
  float     keys are cached rotated at their positions. Placing them needs every key turned by
            Δ_i (CacheBlend's re-rotation: `turn`, with the engine's own sin and cos), which is
            not exact in floating point; it is done only when asked (rerotate=True) and
            recorded. Without it, a float engine refuses (`check_mode`).

What placement cannot give is the attention across documents: a document computed after the
prefix alone never saw the documents placed before it. A recompute strategy (`Recompute`)
chooses which document tokens the engine computes again, in sequence order, on top of what is
placed; every other token keeps its stored rows:

  none        no token: the placed rows as they are (fraction 0 only).
  cacheblend  CacheBlend's selection: the tokens whose K and V at an early layer (`layer`,
              default 1, the first whose K and V depend on attention) deviate most from a
              computation of the whole composed context through that layer (`deviation`).
  epic        EPIC's: the first tokens of each document (its attention sinks), the fraction of
              each document's length.
  window      ours, from Gemma's layer structure: the last tokens before the query. Five of
              every six Gemma 3 layers are local and see only the last W tokens (W = 512 on the
              270M), so a query reads, on those layers, only what this window holds; recomputing
              it gives the query's local layers K and V computed with attention across the
              documents, at the cost of one contiguous run (EPIC's cost, CacheBlend's aim).

Recomputing token j in sequence order means running the model on it over a cache that holds
the placed rows of the tokens not recomputed and the recomputed rows of those before it:
exactly CacheBlend's layer-by-layer recompute (each layer of a recomputed token attends to the
placed K and V of the others at that layer), since attention is causal. So at fraction 1.0
every token is computed by the engine in order, and the composed context is the fresh
computation of prefix + documents, bit for bit (the spec engine's rows do not depend on how a
sequence is cut into calls): the composed query logits are SHA-256 equal to fresh.

Why in the library: `Store.compose` is the user's call; the experiment (experiments.compose),
the replay of its manifests and the tests call the same functions.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import weakref
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax import rope
from gemma_jax.checkpoints import tree
from gemma_jax.weights import LoadedModel
from graft.engine import Context, Engine

STRATEGIES = ('none', 'cacheblend', 'epic', 'window')
MODES = ('relative', 'float')  # the RoPE modes a composition runs


class ComposeError(ValueError):
  """A composition that cannot be made as asked; the message says why."""


@dataclasses.dataclass(frozen=True)
class Recompute:
  """Which document tokens a composition computes again: `strategy` (STRATEGIES) at
  `fraction` of the documents' tokens (0 .. 1); `layer`: CacheBlend's selection layer."""

  strategy: str = 'none'
  fraction: float = 0.0
  layer: int = 1

  def __post_init__(self):
    if self.strategy not in STRATEGIES:
      raise ComposeError(f'unknown recompute strategy {self.strategy!r}; expected one of '
                         f'{STRATEGIES}')
    if not 0.0 <= self.fraction <= 1.0:
      raise ComposeError(f'a recompute fraction lies in [0, 1], not {self.fraction}')
    if self.strategy == 'none' and self.fraction:
      raise ComposeError(f'strategy none recomputes nothing; fraction {self.fraction} needs '
                         f'one of {STRATEGIES[1:]}')
    if self.layer < 1:
      raise ComposeError(f'CacheBlend\'s selection layer must be >= 1 (layer 0\'s K and V see '
                         f'no attention), not {self.layer}')

  def as_dict(self) -> dict:
    """The strategy as a result records it."""
    return dataclasses.asdict(self)


# ----------------------------------------------------------------------------------------------
# Rows: joined, turned, placed, written into a context
# ----------------------------------------------------------------------------------------------


def concatenate(parts: Sequence[kvs.KVRows]) -> kvs.KVRows:
  """Consecutive rows as one KVRows (each layer's K, V [T, K, H] and positions [T] joined)."""
  if len(parts) == 1:
    return parts[0]
  join = lambda arrays: tuple(np.concatenate(a) for a in zip(*arrays))
  return kvs.KVRows(parts[0].start, join([p.k for p in parts]), join([p.v for p in parts]),
                    join([p.positions for p in parts]))


def take(rows: kvs.KVRows, lo: int, hi: int) -> kvs.KVRows:
  """Rows lo .. hi - 1 of `rows` (counted from its first)."""
  cut = lambda arrays: tuple(a[lo:hi] for a in arrays)
  return kvs.KVRows(rows.start + lo, cut(rows.k), cut(rows.v), cut(rows.positions))


# engine -> its jitted rotation (the engine's numerics and compiler options).
_TURNS: 'weakref.WeakKeyDictionary[Engine, Callable]' = weakref.WeakKeyDictionary()


def _turner(engine: Engine) -> Callable:
  if engine not in _TURNS:
    numerics = engine.numerics

    def turn_keys(k, positions, *, head_dim, base, scale, fraction, back):
      # The run-time zero of the numerics' barriers, as the model makes it: positions are
      # never below EMPTY, which the compiler cannot know.
      with_zero = numerics.with_zero((positions[0] < kvs.EMPTY).astype(jnp.uint32))
      sin, cos = rope.float_sin_cos(positions[None], head_dim, with_zero, base=base, scale=scale,
                                    rotary_fraction=fraction)
      return rope.rotate_heads(k[None], (-sin if back else sin, cos), with_zero)[0]

    _TURNS[engine] = jax.jit(turn_keys, static_argnames=('head_dim', 'base', 'scale',
                                                         'fraction', 'back'),
                             compiler_options=engine.plan.compiler_options)
  return _TURNS[engine]


def turn(engine: Engine, layer_index: int, k: np.ndarray, positions: np.ndarray, *,
         back: bool = False) -> np.ndarray:
  """Keys [n, K, H] of cache-owning layer `layer_index` turned by the float RoPE of that layer
  at integer `positions` [n] >= 0, computed as `engine`'s model rotates keys (its numerics);
  back=True turns them by minus those positions."""
  spec = engine.model_config.layer_spec(layer_index)
  out = _turner(engine)(jnp.asarray(k), jnp.asarray(positions, jnp.int32),
                        head_dim=spec.head_dim, base=spec.rope_base, scale=spec.rope_scale,
                        fraction=spec.rotary_fraction, back=back)
  return np.asarray(out)


def compute_rows(engine: Engine, prefix_ctx: Context, document: Sequence[int]) -> kvs.KVRows:
  """A document's rows computed by the engine after a context holding the prefix (left as it
  is), in calls of the engine's rows per call: every layer's K and V [L, K, H] and positions,
  at the sequence indices after the prefix's (what a stored document's blocks hold)."""
  ctx, parts, step = prefix_ctx, [], engine.max_rows
  for lo in range(0, len(document), step):
    n = len(ctx.tokens)
    ctx, _ = engine.extend(ctx, document[lo:lo + step], logits='none', consume=lo > 0)
    parts.append(kvs.take_rows(ctx.kv, n, len(ctx.tokens)))
  return concatenate(parts)


def check_mode(engine: Engine, rerotate: bool) -> str:
  """The engine's RoPE mode when it can place documents elsewhere than where they were
  computed: 'relative' (position-free rows), or 'float' with rerotate=True (keys turned by Δ,
  not exact, recorded). ComposeError otherwise."""
  config = engine.model_config
  mode = config.rope_mode
  if mode not in MODES or config.kv_cache_pre_rope:
    raise ComposeError(f'composing documents needs RoPE {MODES[0]!r} (position-free rows) or '
                       f'{MODES[1]!r} with re-rotation; this model runs {mode!r}'
                       + (' with keys cached before RoPE' if config.kv_cache_pre_rope else ''))
  if mode == 'float' and not rerotate:
    raise ComposeError('a float-RoPE engine caches keys rotated at their positions: its '
                       'document blocks are not position-free (use RoPE \'relative\'), or ask '
                       'for re-rotation by the shift explicitly (rerotate=True, --rerotate: '
                       'CacheBlend\'s, not exact, recorded)')
  if mode == 'relative' and rerotate:
    raise ComposeError('re-rotation is for float-RoPE engines; under RoPE \'relative\' keys '
                       'are unrotated and placing them moves positions only')
  return mode


def placed(engine: Engine, rows: kvs.KVRows, start: int, rerotate: bool) -> kvs.KVRows:
  """A document's rows (as computed after its prefix, at positions rows.start ..) placed at
  sequence index and position `start`: positions moved; under float with `rerotate`, each
  key turned by Δ = start - rows.start with its layer's RoPE (`turn`)."""
  delta = start - rows.start
  positions = tuple(np.arange(start, start + rows.num_tokens, dtype=np.int32)
                    for _ in rows.positions)
  keys = rows.k
  if rerotate and delta:
    by = np.full(rows.num_tokens, delta, np.int32)
    keys = tuple(turn(engine, layer, rows.layer(j)[0], by)
                 for j, layer in enumerate(engine.model_config.cache_layers))
  return kvs.KVRows(start, keys, rows.v, positions)


@functools.partial(jax.jit, donate_argnums=(0,))
def _append(kv: kvs.KVState, k: tuple, v: tuple, positions: jax.Array) -> kvs.KVState:
  """kv with one call's rows written at sequence indices kv.fill ..: per layer k, v
  [1, T, K, H], positions [1, T] (EMPTY rows write nothing), as a model call writes them."""
  layers = tuple(kvs.write(layer, k_rows, v_rows, positions, kv.fill)
                 for layer, k_rows, v_rows in zip(kv.layers, k, v))
  return kvs.KVState(layers=layers,
                     fill=kv.fill + jnp.sum(positions != kvs.EMPTY, axis=1, dtype=jnp.int32))


def append_rows(engine: Engine, ctx: Context, rows: kvs.KVRows, tokens: Sequence[int]) -> Context:
  """The context (consumed: its buffers are updated in place) with `rows` written after its
  last token, as the engine writes a call's rows (slot = sequence index mod S, the oldest
  dropped from a ring), in calls of the engine's rows per call. The rows must sit at the
  context's next sequence index and position, and cover `tokens`."""
  tokens = tuple(int(t) for t in tokens)
  n = rows.num_tokens
  if n != len(tokens) or rows.start != len(ctx.tokens) or (
      n and kvs.first_position([rows]) + rows.start != ctx.next_position):
    raise ComposeError(f'rows of {n} tokens at sequence index {rows.start} do not follow a '
                       f'context of {len(ctx.tokens)} tokens ({len(tokens)} tokens given)')
  if len(ctx.tokens) + n > engine.engine_config.cache_len:
    raise ComposeError(f'a context of {len(ctx.tokens)} + {n} tokens does not fit the cache of '
                       f'{engine.engine_config.cache_len} slots')
  chunk = engine.max_rows
  kv = ctx.kv
  for lo in range(0, n, chunk):
    hi = min(n, lo + chunk)
    k, v = [], []
    for j, layer in enumerate(kv.layers):
      k_rows, v_rows = rows.layer(j)
      shape = (1, chunk) + layer.k.shape[2:]
      k.append(np.zeros(shape, layer.k.dtype))
      v.append(np.zeros(shape, layer.v.dtype))
      k[-1][0, :hi - lo], v[-1][0, :hi - lo] = k_rows[lo:hi], v_rows[lo:hi]
    positions = np.full((1, chunk), kvs.EMPTY, np.int32)
    positions[0, :hi - lo] = rows.positions[0][lo:hi]
    kv = _append(kv, tuple(k), tuple(v), positions)
  return Context(kv=kv, tokens=ctx.tokens + tokens, next_position=ctx.next_position + n)


# ----------------------------------------------------------------------------------------------
# Selection
# ----------------------------------------------------------------------------------------------


def first_layers(loaded: LoadedModel, count: int) -> LoadedModel:
  """The model cut after its first `count` layers, sharing their parameters (no copy): what
  CacheBlend's selection runs to see the K and V of an early layer for every token. Layer i < count
  computes what it computes in the whole model, bit for bit (tests/test_compose.py)."""
  config = loaded.config
  if not 1 <= count <= config.num_layers:
    raise ComposeError(f'{config.name} has {config.num_layers} layers, not {count}')
  shared = max(0, config.num_kv_shared_layers - (config.num_layers - count))
  cut = config.replace(num_layers=count, num_kv_shared_layers=shared)

  def keep(flat: dict) -> dict:
    out = {}
    for name, leaf in flat.items():
      parts = name.split('/')
      if parts[0] == 'layers' and int(parts[1]) >= count:
        continue
      if name in ('embedder/per_layer_embeddings', 'embedder/per_layer_model_projection/w'):
        leaf = leaf[:, :count]  # [V or D, L, E]: the first layers' per-layer inputs
      out[name] = leaf
    return out

  if loaded.stored is not None:  # the mapped cache entry: its first layers' arrays, as stored
    entry = loaded.stored
    stored = keep(entry.stored)
    layout = {**entry.layout, 'packed': {k: v for k, v in entry.layout.get('packed', {}).items()
                                         if k in stored}} if entry.layout else {}
    digest = hashlib.sha256(f'first {count} layers of {entry.params_sha256}'.encode()).hexdigest()
    entry = dataclasses.replace(entry, stored=stored, layout=layout, params_sha256=digest,
                                _verified=entry._verified, _failure=entry._failure)
    return loaded.replace(config=cut, stored=entry)
  return loaded.replace(config=cut, params=tree.unflatten(keep(tree.flatten(loaded.params))))


# engine -> {layers: the engine of its model's first layers}
_FIRST: 'weakref.WeakKeyDictionary[Engine, dict]' = weakref.WeakKeyDictionary()


def first_layers_engine(engine: Engine, count: int) -> Engine:
  """An engine of the same configuration over the model's first `count` layers (built once
  per engine and count)."""
  held = _FIRST.setdefault(engine, {})
  if count not in held:
    held[count] = Engine(first_layers(engine.loaded, count), engine.engine_config)
  return held[count]


def deviation(engine: Engine, tokens: Sequence[int], rows: kvs.KVRows, layer: int) -> np.ndarray:
  """CacheBlend's deviation: for each placed row (sequence indices rows.start .. of `tokens`,
  the whole composed context), the squared distance between its K and V at `layer` and those
  of the composed context computed through that layer (the model's first layer + 1 layers),
  summed over heads and dimensions in float64. -> [rows.num_tokens] float64."""
  if layer not in engine.model_config.cache_layers:
    raise ComposeError(f'CacheBlend\'s selection layer {layer} is not a layer that owns a KV '
                       f'cache in {engine.model_config.name}')
  early = first_layers_engine(engine, layer + 1)
  j, mine = early.model_config.cache_layers.index(layer), engine.model_config.cache_layers.index(layer)
  first, stop = rows.start, rows.start + rows.num_tokens
  out = np.zeros(rows.num_tokens, np.float64)
  ctx = early.empty()
  step = early.max_rows
  for lo in range(0, stop, step):
    hi = min(stop, lo + step)
    ctx, _ = early.extend(ctx, tokens[lo:hi], logits='none', consume=lo > 0)
    if hi <= first:
      continue
    a = max(lo, first)
    fresh = kvs.take_rows(ctx.kv, a, hi)
    old_k, old_v = rows.layer(mine)
    for new, old in ((fresh.k[j], old_k[a - first:hi - first]),
                     (fresh.v[j], old_v[a - first:hi - first])):
      diff = np.asarray(new, np.float64) - np.asarray(old, np.float64)
      out[a - first:hi - first] += np.sum(diff * diff, axis=(1, 2))
  return out


def select(engine: Engine, recompute: Recompute, tokens: Sequence[int], rows: kvs.KVRows,
           lengths: Sequence[int]) -> np.ndarray:
  """Which placed document tokens to compute again: bool [sum(lengths)] over the documents'
  tokens in composed order (`rows`, at sequence indices rows.start .. of `tokens`)."""
  total = int(sum(lengths))
  count = int(round(recompute.fraction * total))
  mask = np.zeros(total, bool)
  if recompute.strategy == 'none' or not count:
    return mask
  if recompute.strategy == 'epic':
    start = 0
    for length in lengths:
      mask[start:start + int(round(recompute.fraction * length))] = True
      start += length
  elif recompute.strategy == 'window':
    mask[total - count:] = True
  else:  # cacheblend: the largest deviations, the earliest first among equals
    scores = deviation(engine, tokens, rows, recompute.layer)
    mask[np.argsort(-scores, kind='stable')[:count]] = True
  return mask


def runs(mask: np.ndarray) -> list[tuple[int, int, bool]]:
  """The maximal runs (lo, hi, value) of a bool mask [T] (T: the documents' tokens)."""
  out, lo = [], 0
  for i in range(1, len(mask) + 1):
    if i == len(mask) or mask[i] != mask[lo]:
      out.append((lo, i, bool(mask[lo])))
      lo = i
  return out


# ----------------------------------------------------------------------------------------------
# Composing
# ----------------------------------------------------------------------------------------------


def compose(engine: Engine, prefix_ctx: Context, documents: Sequence[Sequence[int]],
            rows: Sequence[kvs.KVRows], *, recompute: Recompute = Recompute(),
            rerotate: bool = False) -> tuple[Context, dict]:
  """The prefix context (left as it is) followed by the documents in the order given, each
  placed from its rows (as computed after the prefix, `rows[i]`: every layer's K and V at
  positions p .. p + L_i - 1), with the tokens `recompute` selects computed again in sequence
  order.

  Returns:
    (the composed context: prefix + documents, at positions 0 .., ready for a query; its
    record: the RoPE mode, re-rotation, each document's length, offset and shift Δ, the
    strategy, the tokens recomputed and the runs they formed).
  """
  mode = check_mode(engine, rerotate)
  p = len(prefix_ctx.tokens)
  if prefix_ctx.next_position != p:
    raise ComposeError(f'the prefix context must start at position 0 (its next position is '
                       f'{prefix_ctx.next_position} after {p} tokens)')
  documents = [tuple(int(t) for t in d) for d in documents]
  if len(rows) != len(documents):
    raise ComposeError(f'{len(documents)} documents and {len(rows)} row sets')
  lengths = [len(d) for d in documents]
  if not documents or not all(lengths):
    raise ComposeError('a composition needs at least one document, none of them empty')
  total = p + sum(lengths)
  if total > engine.engine_config.cache_len:
    raise ComposeError(f'the prefix ({p} tokens) and documents ({sum(lengths)} tokens) do not '
                       f'fit the cache of {engine.engine_config.cache_len} slots')
  offsets = list(np.cumsum([p] + lengths[:-1]))
  parts = []
  for i, (doc_rows, length, offset) in enumerate(zip(rows, lengths, offsets)):
    if doc_rows.num_tokens != length or doc_rows.start != p:
      raise ComposeError(f'document {i}: its rows hold {doc_rows.num_tokens} tokens from '
                         f'sequence index {doc_rows.start}, not {length} after the prefix of {p}')
    parts.append(placed(engine, doc_rows, int(offset), rerotate))
  laid = concatenate(parts)
  tokens = list(prefix_ctx.tokens) + [t for d in documents for t in d]
  mask = select(engine, recompute, tokens, laid, lengths)
  ctx = Context(kv=jax.tree.map(jnp.copy, prefix_ctx.kv), tokens=prefix_ctx.tokens,
                next_position=p)
  spans = runs(mask)
  for lo, hi, again in spans:
    if again:
      ctx, _ = engine.extend(ctx, tokens[p + lo:p + hi], logits='none', consume=True)
    else:
      ctx = append_rows(engine, ctx, take(laid, lo, hi), tokens[p + lo:p + hi])
  record = {
      'rope': mode, 'rerotate': rerotate, 'prefix_tokens': p,
      'documents': [{'tokens': length, 'offset': int(offset), 'delta': int(offset) - p,
                     'recomputed': int(mask[o - p:o - p + length].sum())}
                    for length, o in zip(lengths, offsets)],
      'recompute': {**recompute.as_dict(), 'tokens': int(mask.sum()),
                    'runs': sum(1 for _, _, again in spans if again)},
      'document_tokens': int(sum(lengths)),
  }
  return ctx, record
