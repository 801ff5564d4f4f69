"""The spec check: the spec engine's KV state and logits against the NumPy interpreter, bit for bit.

    result = spec_check.run(engine, tokens, splits=[256, 512])

The engine computes the tokens twice: one-shot, and cut at `splits` (each piece a call of its
own, logits at each piece's last token); the interpreter (gemma_jax.spec.interpreter) computes
them once. Compared, by their raw bits: every K and V row each cache layer of the engine still
holds (a local ring holds its last S), and the logits at the last token of every piece. A run
that passes on two machines has shown that their bits are equal (each equals the interpreter's).
"""

from __future__ import annotations

import time

import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax.spec.interpreter import Interpreter
from graft.engine import Engine


def logit_rows(num_tokens: int, splits) -> list[int]:
  """The rows whose logits are compared: the last token of every piece."""
  return sorted({s - 1 for s in splits} | {num_tokens - 1})


def _bits(x) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.int32)


def _first_kv_difference(engine: Engine, ctx, reference, run: str) -> dict | None:
  """The first (layer, then position) K or V row the engine's context and the reference
  disagree on, among the rows every layer still holds."""
  n = len(ctx.tokens)
  lo = max(0, n - engine.local_slots)
  rows = kvs.take_rows(ctx.kv, lo, n)
  for j, layer in enumerate(engine.config.cache_layers):
    for op, got, want in (('k', rows.k[j], reference.k[j][lo:]),
                          ('v', rows.v[j], reference.v[j][lo:])):
      differs = np.any(_bits(got) != _bits(want), axis=tuple(range(1, np.ndim(got))))
      if differs.any():
        return {'run': run, 'layer': int(layer), 'op': op, 'position': int(lo + differs.argmax())}
  return None


def run(engine: Engine, tokens, splits=(), *, progress=None) -> dict:
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
  interpreter = Interpreter(engine.config, engine.loaded.params,
                            k_chunk=engine.engine_config.k_chunk, small=engine.numerics.small,
                            tile=engine.attention_tile, rows_per_call=engine.max_rows,
                            progress=lambda m: log(f'reference: {m}'))
  reference = interpreter.run(tokens, logit_rows=rows)
  reference_seconds = time.perf_counter() - start

  start = time.perf_counter()
  one_shot, logits = engine.extend(engine.empty(), tokens, logits=n - rows[0])
  engine_logits = {'one-shot': {r: logits[r - rows[0]] for r in rows}}
  log('engine: one-shot')
  ctx, pieces = engine.empty(), {}
  for lo, hi in zip([0] + splits, splits + [n]):
    ctx, piece = engine.extend(ctx, tokens[lo:hi], logits='last')
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
                  'first_difference': first},
      'splits': splits, 'logit_rows': rows,
      'reference_seconds': round(reference_seconds, 1),
      'engine_seconds': round(engine_seconds, 1),
  }
