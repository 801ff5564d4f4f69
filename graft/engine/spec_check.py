"""The spec check: the spec engine's KV state and logits against the NumPy interpreter, bit for bit.

    result = spec_check.run(engine, tokens, splits=[256, 512])

The engine computes the tokens twice: one-shot, and cut at `splits` (each piece a call of its
own, logits at each piece's last token); the interpreter (gemma_jax.spec.interpreter) computes
them once. Compared, by their raw bits: every K and V row each cache layer of the engine still
holds (a global layer all n, a local ring its last S), and the logits at the last token of every
piece. A run
that passes on two machines has shown that their bits are equal (each equals the interpreter's).
"""

from __future__ import annotations

import hashlib
import time
from typing import TYPE_CHECKING, Callable, Iterable, Sequence

import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax.spec.interpreter import Interpreter, Output

if TYPE_CHECKING:  # the engine's canary runs these while an Engine is built: a name, no import
  from graft.engine import Context, Engine


def logit_rows(num_tokens: int, splits: Iterable[int]) -> list[int]:
  """The rows whose logits are compared: the last token of every piece."""
  return sorted({s - 1 for s in splits} | {num_tokens - 1})


def _bits(x) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.int32)


def compared_rows(engine: Engine, num_tokens: int) -> dict[int, tuple[int, int]]:
  """Cache layer -> the sequence indices [lo, n) its K and V are compared over: every token on a
  global layer, the last ring-length on a local one (the rest were overwritten)."""
  local = max(0, num_tokens - engine.local_slots)
  return {layer: (0 if engine.model_config.layer_spec(layer).window is None else local, num_tokens)
          for layer in engine.model_config.cache_layers}


def engine_rows(engine: Engine, ctx: Context) -> list[tuple[np.ndarray, np.ndarray]]:
  """Per cache layer, the K and V rows [n - lo, K, H] of `compared_rows` the context holds, in
  sequence order."""
  n = len(ctx.tokens)
  spans = compared_rows(engine, n)
  recent = kvs.take_rows(ctx.kv, max(lo for lo, _ in spans.values()), n)
  out = []
  for j, layer in enumerate(engine.model_config.cache_layers):
    lo, _ = spans[layer]
    if lo == recent.start:
      out.append((np.asarray(recent.k[j]), np.asarray(recent.v[j])))
    else:  # a global layer: token i sits in slot i
      layer_kv = ctx.kv.layers[j]
      out.append((np.asarray(layer_kv.k[0, lo:n]), np.asarray(layer_kv.v[0, lo:n])))
  return out


def reference_rows(engine: Engine, reference: Output,
                   n: int) -> list[tuple[np.ndarray, np.ndarray]]:
  """The interpreter's K and V rows of `compared_rows`, as `engine_rows` gives the engine's:
  per cache layer (k, v) [n - lo, K, H]."""
  spans = compared_rows(engine, n)
  return [(reference.k[j][spans[layer][0]:n], reference.v[j][spans[layer][0]:n])
          for j, layer in enumerate(engine.model_config.cache_layers)]


def rows_digest(kv_rows: list[tuple[np.ndarray, np.ndarray]], logits: dict,
                rows: Iterable[int]) -> str:
  """SHA-256 of K and V rows (as `engine_rows` or `reference_rows` give them: per cache layer
  k, v [T, K, H]) and the logits [V] of `rows`: equal for the engine and the interpreter
  exactly when their bits are."""
  h = hashlib.sha256()
  for k, v in kv_rows:
    h.update(_bits(k).tobytes())
    h.update(_bits(v).tobytes())
  for r in rows:
    h.update(_bits(logits[r]).tobytes())
  return h.hexdigest()


def _first_kv_difference(engine: Engine, ctx, reference, run: str) -> dict | None:
  """The first (layer, then position) K or V row the engine's context and the reference
  disagree on, among the rows each layer still holds (`compared_rows`)."""
  n = len(ctx.tokens)
  spans = compared_rows(engine, n)
  for j, ((k, v), (want_k, want_v)) in enumerate(zip(engine_rows(engine, ctx),
                                                     reference_rows(engine, reference, n))):
    lo = spans[engine.model_config.cache_layers[j]][0]
    for op, got, want in (('k', k, want_k), ('v', v, want_v)):
      differs = np.any(_bits(got) != _bits(want), axis=tuple(range(1, np.ndim(got))))
      if differs.any():
        return {'run': run, 'layer': int(engine.model_config.cache_layers[j]), 'op': op,
                'position': int(lo + differs.argmax())}
  return None


def _digest(ctx, logits: dict, rows: list[int]) -> str:
  """SHA-256 of a context's whole KV state (every layer's K, V and positions) and the logits of
  `rows`."""
  h = hashlib.sha256()
  for layer in ctx.kv.layers:
    for a in (layer.k, layer.v, layer.positions):
      h.update(np.ascontiguousarray(np.asarray(a)).tobytes())
  for r in rows:
    h.update(_bits(logits[r]).tobytes())
  return h.hexdigest()


def interpreter(engine: Engine, progress: Callable[[str], None] | None = None) -> Interpreter:
  """The NumPy interpreter of the spec engine's model and geometry."""
  tile = engine.attention_tile
  if tile is None:
    raise ValueError('the spec engine attends in tiles; this engine has none')
  return Interpreter(engine.model_config, engine.loaded.params,
                     k_chunk=engine.engine_config.k_chunk, small=engine.layout.small, tile=tile,
                     rows_per_call=engine.max_rows, progress=progress)


def run(engine: Engine, tokens: Sequence[int], splits: Sequence[int] = (), *,
        progress: Callable[[str], None] | None = None) -> dict:
  """{'summary': {tokens, kv_equal, logits_equal, first_difference}, 'runs': per run, the
  logits rows compared, 'reference_seconds', 'engine_seconds'}."""
  if engine.engine_config.mode != 'spec':
    raise ValueError(f'the spec check runs the spec engine, not {engine.engine_config.mode!r}')
  tokens = [int(t) for t in tokens]
  n = len(tokens)
  splits = sorted({int(s) for s in splits})
  if any(not 0 < s < n for s in splits):
    raise ValueError(f'split points must lie inside the {n} tokens: {splits}')
  rows = logit_rows(n, splits)
  log = progress or (lambda message: None)

  start = time.perf_counter()
  reference = interpreter(engine, progress=lambda m: log(f'reference: {m}')).run(
      tokens, logit_rows=rows)
  reference_seconds = time.perf_counter() - start

  start = time.perf_counter()
  one_shot, logits = engine.extend(engine.empty(), tokens, logits=n - rows[0])
  assert logits is not None  # n - rows[0] >= 1 rows asked for
  engine_logits = {'one-shot': {r: logits[r - rows[0]] for r in rows}}
  log('engine: one-shot')
  ctx, pieces = engine.empty(), {}
  for lo, hi in zip([0] + splits, splits + [n]):
    ctx, piece = engine.extend(ctx, tokens[lo:hi], logits='last')
    assert piece is not None  # logits='last'
    pieces[hi - 1] = piece[0]
  engine_logits['split'] = pieces
  log(f'engine: split at {splits}')
  engine_seconds = time.perf_counter() - start

  first = None
  for run_name, ctx_run in (('one-shot', one_shot), ('split', ctx)):
    first = first or _first_kv_difference(engine, ctx_run, reference, run_name)
  kv_equal = first is None
  logits_equal = True
  for run_name, by_row in engine_logits.items():
    for r in rows:
      if not np.array_equal(_bits(by_row[r]), _bits(reference.logits[r])):
        logits_equal = False
        first = first or {'run': run_name, 'layer': None, 'op': 'logits', 'position': r}
  return {
      'summary': {'tokens': n, 'kv_equal': kv_equal, 'logits_equal': logits_equal,
                  'first_difference': first,
                  # What this machine computed (the one-shot run's compared K, V rows and logits):
                  # equal digests are equal bits, across machines and emulators.
                  'sha256': _digest(one_shot, engine_logits['one-shot'], rows)},
      'splits': splits, 'logit_rows': rows,
      'reference_seconds': round(reference_seconds, 1),
      'engine_seconds': round(engine_seconds, 1),
  }
