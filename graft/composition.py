"""What a composition keeps and what it loses, measured against the fresh computation.

A composition (graft/store/compose.py) places documents computed after a prefix in front of a
query. Two things can separate it from the fresh computation of prefix + documents + query in
the same RoPE mode:

  1. the rotary error of moving keys. Under float RoPE a placed key is turned by its shift Δ,
     R(Δ) R(p) k, where the fresh computation has R(p + Δ) k: not equal in floating point. Under
     the relative mode it is zero by construction, and `relocation` shows it: a document's rows
     placed at Δ are SHA-256 equal to the prefix and the document computed from position Δ.
  2. the attention across documents. A document computed after the prefix alone never saw the
     documents placed before it. No placement removes that; recomputing tokens reduces it, and
     recomputing all of them removes it (the fresh computation, bit for bit).

Under the relative mode only the second remains, so it is measured alone; float RoPE with
re-rotation beside it shows the first. `kv_deviation` measures the placed K and V against the
fresh ones per layer (local and global layers apart), `next_token` the query's logits (SHA-256,
KL, top-1) and greedy continuations.

Why in the library: experiments.compose, the replay of its manifests (graft.replay) and the
tests share these functions; a user checks a composition of their own with them.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from gemma_jax import compare
from gemma_jax import kv_state as kvs
from gemma_jax.config import AttentionType
from graft.engine import Context, Engine
from graft.store import Store
from graft.store import compose as composing


def fresh(engine: Engine, prefix: Sequence[int], documents: Sequence[Sequence[int]]) -> Context:
  """The reference: prefix + documents computed from position 0 by the engine."""
  tokens = [int(t) for t in prefix] + [int(t) for d in documents for t in d]
  ctx, _ = engine.prefill(tokens, logits='none')
  return ctx


def kv_digest(engine: Engine, ctx: Context) -> str:
  """SHA-256 of a context's KV state as to_leaves stores it (every layer's K, V, positions)."""
  leaves = kvs.to_leaves(ctx.kv, engine.model_config.cache_layers)
  return compare.sha256_bytes(np.concatenate(
      [np.ravel(leaves[name]).view(np.uint8) for name in sorted(leaves)]))


def kv_deviation(engine: Engine, ctx: Context, reference: Context, lo: int,
                 hi: int) -> list[dict]:
  """Per cache-owning layer, how far `ctx`'s K and V are from `reference`'s on the slots whose
  position lies in [lo, hi) (the documents), where both hold them (a ring holds the last S):
  SHA-256 equality, max |Δ| and the relative L2 distance ||Δ|| / ||reference|| (float64)."""
  out = []
  for layer_index, ours, theirs in zip(engine.model_config.cache_layers, ctx.kv.layers,
                                       reference.kv.layers):
    positions = np.asarray(theirs.positions[0])
    if not np.array_equal(positions, np.asarray(ours.positions[0])):
      raise ValueError(f'layer {layer_index}: the two contexts hold other positions')
    slots = np.flatnonzero((positions >= lo) & (positions < hi))
    row: dict[str, Any] = {'layer': int(layer_index),
           'attention_type': engine.model_config.layer_spec(layer_index).attention_type.value,
           'slots': int(len(slots))}
    for part in ('k', 'v'):
      a = np.asarray(getattr(ours, part)[0])[slots].astype(np.float64)
      b = np.asarray(getattr(theirs, part)[0])[slots].astype(np.float64)
      norm = float(np.linalg.norm(b))
      row[f'{part}_equal'] = compare.sha256_bytes(a) == compare.sha256_bytes(b)
      row[f'{part}_max_abs'] = float(np.abs(a - b).max()) if len(slots) else 0.0
      row[f'{part}_rel_l2'] = float(np.linalg.norm(a - b) / norm) if norm else 0.0
    out.append(row)
  return out


def by_attention_type(layers: list[dict]) -> dict:
  """The mean relative L2 of K and V over the local and the global layers apart."""
  out = {}
  for kind in (AttentionType.LOCAL.value, AttentionType.GLOBAL.value):
    rows = [row for row in layers if row['attention_type'] == kind]
    if rows:
      out[kind] = {f'{part}_rel_l2': float(np.mean([row[f'{part}_rel_l2'] for row in rows]))
                   for part in ('k', 'v')}
      out[kind]['layers'] = len(rows)
  return out


def next_token(reference_logits: np.ndarray, logits: np.ndarray) -> dict:
  """The query's last logits [V] against the reference's: SHA-256 equality, KL(reference ||
  composed) in float64, whether the top-1 token agrees."""
  return {'equal': compare.sha256_bytes(logits) == compare.sha256_bytes(reference_logits),
          'kl': float(compare.kl_per_position(reference_logits[None], logits[None])[0]),
          'top1_agrees': int(np.argmax(logits)) == int(np.argmax(reference_logits))}


def first_difference(a: Sequence[int], b: Sequence[int]) -> int | None:
  """The first index where two token lists differ (None: equal over the shorter)."""
  return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


def relocation(engine: Engine, store: Store, prefix: Sequence[int], document: Sequence[int],
               offsets: Sequence[int]) -> list[dict]:
  """A stored document's rows placed at each offset Δ (moved by Δ; under float re-rotated by
  Δ) against the prefix and the document computed from position Δ: per offset, whether every
  layer's K and V are SHA-256 equal, and the largest |ΔK| and |ΔV|."""
  rerotate = engine.model_config.rope_mode == 'float'
  prefix, document = [int(t) for t in prefix], [int(t) for t in document]
  rows = store.read_document(prefix, document)
  if rows is None:
    raise ValueError('relocation needs the document stored after the prefix (put_document)')
  p = len(prefix)
  out = []
  for delta in offsets:
    if not 0 <= delta <= engine.model_config.max_context - p - len(document):
      raise ValueError(f'offset {delta}: the document would not fit positions 0 .. '
                       f'{engine.model_config.max_context - 1}')
    moved = composing.placed(engine, rows, p + delta, rerotate)
    prefix_ctx, _ = engine.prefill(prefix, logits='none', start_position=delta)
    want = composing.compute_rows(engine, prefix_ctx, document)
    layers = range(len(moved.k))
    mk, mv = zip(*(moved.layer(j) for j in layers))  # (every layer computed and placed)
    wk, wv = zip(*(want.layer(j) for j in layers))
    pairs = list(zip(mk, wk)) + list(zip(mv, wv))
    out.append({'offset': int(delta),
                'equal': all(compare.sha256_bytes(a) == compare.sha256_bytes(b) for a, b in pairs),
                'k_max_abs': max(compare.max_abs(a, b) for a, b in zip(mk, wk)),
                'v_max_abs': max(compare.max_abs(a, b) for a, b in zip(mv, wv)),
                'rows_sha256': compare.sha256_bytes(np.concatenate(
                    [np.ravel(a).view(np.uint8) for a in mk + mv]))})
  return out
