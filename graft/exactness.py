"""The graft exactness check: fresh computation against an own-position graft, sample by sample.

For a (library, query) pair:
  fresh  the engine computes library + query from scratch; we keep the query's logits (every
         query position) and a greedy continuation;
  graft  a graft source gives a context holding the library, or a prefix of it, computed
         elsewhere: an artifact a separately constructed engine wrote to disk (`artifact_graft`),
         or the longest prefix a store holds (graft/store/_store.py); the engine verifies and
         grafts it at its own positions, computes the rest of the library and the query, and
         continues.
Equal means the SHA-256 of the two float32 query-logit arrays is the same. Every experiment that
compares a graft with a fresh computation does it here (`fresh_logits`, `graft_logits`,
`check_sample`).

Why in the library: it is the project's claim as a function. graft.replay checks committed
manifests with it, a user checks a graft of their own with `check_sample`, and the tests call it
directly; the entry points only add flags and output.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from gemma_jax import compare
from graft import shift
from graft.store import artifact
from graft.engine import Context, Engine


def fresh_logits(engine: Engine, prefix: Sequence[int], query: Sequence[int],
                 rows: int | None = None) -> tuple[np.ndarray | None, Context]:
  """The fresh side: float32 logits of the query's last `rows` tokens (None: all of them) when
  the engine computes prefix + query from scratch; and the context after them."""
  ctx, logits = engine.extend(engine.empty(), list(prefix) + list(query),
                              logits=len(query) if rows is None else rows)
  return logits, ctx


def fresh_sha256(engine: Engine, prefix: Sequence[int], query: Sequence[int],
                 rows: int | None = None) -> str:
  logits, _ = fresh_logits(engine, prefix, query, rows)
  if logits is None:
    raise ValueError('no logits asked for: rows must be at least 1')
  return compare.sha256_bytes(logits)


def graft_logits(engine: Engine, grafted: Context, prefix: Sequence[int], query: Sequence[int],
                 rows: int | None = None, *,
                 consume: bool = False) -> tuple[np.ndarray | None, Context]:
  """The graft side: `grafted` holds a prefix of `prefix` (all of it from an artifact; the
  longest stored prefix from a store); the engine computes the rest and the query. Returns the
  logits of the query's last `rows` tokens (None: all) and the context after them."""
  rest = list(prefix[len(grafted.tokens):]) + list(query)
  ctx, logits = engine.extend(grafted, rest, logits=len(query) if rows is None else rows,
                              consume=consume)
  return logits, ctx


def fresh_run(engine: Engine, library: Sequence[int], query: Sequence[int],
              continuation_tokens: int) -> tuple[np.ndarray | None, list[int]]:
  logits, ctx = fresh_logits(engine, library, query)
  _, continuation = engine.generate(ctx, continuation_tokens, stop_at_eos=False)
  return logits, continuation


def artifact_graft(writer: Engine, engine: Engine, artifact_path: str) -> Callable:
  """A graft source: `writer` computes the library and saves its artifact at `artifact_path`;
  `engine` restores it (verifying every hash) at its own positions."""
  def graft(library: Sequence[int]) -> Context:
    library_ctx, _ = writer.prefill(list(library), logits='none')
    artifact.save(artifact_path, writer, library_ctx)
    return artifact.graft(engine, artifact.load(artifact_path, engine))
  return graft


def graft_run(engine: Engine, graft: Callable, library: Sequence[int], query: Sequence[int],
              continuation_tokens: int) -> tuple[np.ndarray | None, list[int], int]:
  """The graft side: `graft(library)` gives a context holding a prefix of the library (all of
  it from an artifact; the longest stored prefix from a store); the engine computes the rest of
  the library and the query, then continues greedily."""
  grafted = graft(library)
  logits, ctx = graft_logits(engine, grafted, library, query)
  _, continuation = engine.generate(ctx, continuation_tokens, stop_at_eos=False)
  return logits, continuation, len(grafted.tokens)


def check_sample(engine: Engine, graft: Callable, library: Sequence[int], query: Sequence[int], *,
                 continuation_tokens: int = 32) -> dict:
  """One sample's row of the results (see experiments/graft_exactness.py for the schema)."""
  t0 = time.perf_counter()
  fresh_logits, fresh_continuation = fresh_run(engine, library, query, continuation_tokens)
  t1 = time.perf_counter()
  graft_logits, graft_continuation, grafted = graft_run(engine, graft, library, query,
                                                        continuation_tokens)
  t2 = time.perf_counter()
  return _row(library, query, grafted, fresh_logits, graft_logits, fresh_continuation,
              graft_continuation, t1 - t0, t2 - t1)


def check_offset(engine: Engine, writer: Engine, artifact_path: str, library: Sequence[int],
                 query: Sequence[int], *, offset: int, preceding: Sequence[int] = (),
                 continuation_tokens: int = 32) -> dict:
  """A graft at another position: `writer` computes the library at [0, L) and saves its
  artifact; `engine` grafts it at [δ, δ + L) (graft/shift.py: keys re-rotated by δ, which
  under the relative RoPE mode moves positions only) and computes the query; the fresh side
  computes library + query from scratch at δ. With `preceding` (δ other tokens), both sides
  start with them at 0 instead: the fresh library then attends to them, the grafted one never
  did (a change of content, not of position). The row adds `offset` and `preceding_tokens`."""
  head = [int(t) for t in preceding]
  if head and len(head) != offset:
    raise ValueError(f'{len(head)} preceding tokens for an offset of {offset}')
  t0 = time.perf_counter()
  fresh_ctx, fresh = engine.extend(engine.empty(0 if head else offset),
                                   head + list(library) + list(query), logits=len(query))
  _, fresh_continuation = engine.generate(fresh_ctx, continuation_tokens, stop_at_eos=False)
  t1 = time.perf_counter()
  library_ctx, _ = writer.prefill(list(library), logits='none')
  artifact.save(artifact_path, writer, library_ctx)
  before = engine.prefill(head, logits='none')[0] if head else None
  grafted = shift.graft_shifted(engine, artifact.load(artifact_path, engine), offset, 'rerotate',
                                preceding=before)
  logits, ctx = graft_logits(engine, grafted, head + list(library), query)
  _, continuation = engine.generate(ctx, continuation_tokens, stop_at_eos=False)
  t2 = time.perf_counter()
  return {**_row(library, query, len(library), fresh, logits, fresh_continuation, continuation,
                 t1 - t0, t2 - t1), 'offset': offset, 'preceding_tokens': len(head)}


def _row(library, query, grafted, fresh_logits, graft_logits, fresh_continuation,
         graft_continuation, fresh_seconds, graft_seconds) -> dict:
  comparison = compare.compare_logits(fresh_logits, graft_logits)
  return {
      'library_tokens': len(library),
      'query_tokens': len(query),
      'grafted_tokens': grafted,
      'fresh_sha256': compare.sha256_bytes(fresh_logits),
      'graft_sha256': compare.sha256_bytes(graft_logits),
      'equal': comparison['equal'],
      'kl': comparison['kl'],
      'argmax_agreement': comparison['argmax_agreement'],
      'continuation_equal': fresh_continuation == graft_continuation,
      'max_abs': comparison['max_abs'],
      'max_ulp': comparison['max_ulp'],
      'top5_overlap': comparison['top5_overlap'],
      'continuation_tokens': len(fresh_continuation),
      'continuation_sha256': compare.token_ids_sha256(fresh_continuation),
      'fresh_seconds': round(fresh_seconds, 3),
      'graft_seconds': round(graft_seconds, 3),
  }


def check_batch(engine: Engine, grafts: list[Callable], pairs: Sequence[Any], *,
                continuation_tokens: int = 32) -> list[dict]:
  """`check_sample` for N samples at once, one per batch slot of every call
  (`Engine.extend_batch`): fresh and graft sides each run batched, continuations decoded
  together. The rows have check_sample's fields; the timings are the batch's, per sample."""
  n = len(pairs)
  t0 = time.perf_counter()
  fresh_ctxs, fresh_logits = engine.extend_batch(
      [engine.empty()] * n, [list(s.library) + list(s.query) for s in pairs],
      logits=[len(s.query) for s in pairs])
  fresh_continuations = engine.generate_batch(fresh_ctxs, continuation_tokens)
  t1 = time.perf_counter()
  grafted = [graft(s.library) for graft, s in zip(grafts, pairs)]
  graft_ctxs, graft_logits = engine.extend_batch(
      grafted, [list(s.library[len(g.tokens):]) + list(s.query) for g, s in zip(grafted, pairs)],
      logits=[len(s.query) for s in pairs])
  graft_continuations = engine.generate_batch(graft_ctxs, continuation_tokens)
  t2 = time.perf_counter()
  return [_row(s.library, s.query, len(g.tokens), fresh, grafted_logits, fresh_continuation,
               graft_continuation, (t1 - t0) / n, (t2 - t1) / n)
          for s, g, fresh, grafted_logits, fresh_continuation, graft_continuation
          in zip(pairs, grafted, fresh_logits, graft_logits, fresh_continuations,
                 graft_continuations)]


def summarize(rows: list[dict]) -> dict:
  positions = sum(r['query_tokens'] for r in rows)
  agreeing = sum(r['argmax_agreement'] * r['query_tokens'] for r in rows)
  return {
      'samples': len(rows),
      'equal': sum(r['equal'] for r in rows),
      'max_kl': max((r['kl'] for r in rows), default=0.0),
      'argmax_agreement': agreeing / positions if positions else 1.0,
      'continuations_equal': sum(r['continuation_equal'] for r in rows),
  }

