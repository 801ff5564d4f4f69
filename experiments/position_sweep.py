"""Position sweep: is an own-position graft the only exact one? Shifted grafts against fresh.

A library of L tokens of real text (experiments/samples.py) is computed by the engine (--engine;
spec by default, whose written arithmetic covers RoPE modes float and relative: the controls
none and quarter_turn run on --engine=pinned) at positions [b, b + L), then grafted at [b + δ, b + δ + L) and followed by a query of Q tokens.
For every offset δ and method (graft/shift.py):

  rerotate   stored (rotated) keys rotated once more by δ (K-shift); reference: the same engine
             computing library + query from scratch at b + δ;
  pre_rope   an engine whose model caches keys before RoPE keeps the library's keys and moves
             only the slot positions; reference: that engine's own fresh computation at b + δ
             (the row also records whether it equals the standard engine's fresh at b + δ);
  recompute  no graft: the standard engine's fresh computation at b + δ against its fresh
             computation at b (is the model translation-invariant in floating point?).

Each row compares the query's logits at every query position (SHA-256 equality, max abs, max
ULP, max KL over positions, argmax agreement, top-5 overlap) and, per cache-owning layer, the
grafted library's K/V (before the query) with the library computed alone at b + δ, over every
slot holding a library token (k/v_max_abs, k/v_max_ulp, k/v_equal, k/v_values_equal).
rerotate compares the cache as stored (rotated keys); pre_rope compares keys as attention sees
them (rotated by slot position); recompute compares the pre-RoPE engine's libraries at b + δ
and b (keys before RoPE, and V: the position-free part, since rotated keys differ by
construction).

Base position. Positions must stay >= 0, so offsets δ >= 0 use b = 0 (the library at [0, L), as
a library is computed in practice) and negative offsets use b = --negative_base (default 64):
the library at [64, 64 + L) grafted at [64 + δ, ...). Each row records its base_position. An
offset whose positions would leave [0, max_context) is skipped with a logged warning (and listed
under config.skipped). Offsets may be written `max` or `max-N`: the largest δ whose last query
token still sits inside the context (max_context - L - Q), minus N.

Output: schema position_sweep (analysis/results.py), in --output or the run folder
(runs/position_sweep/); each file's config.command names every flag that decides its bits
(docs/claims.md, claim 5, lists the committed runs). Then
`python -m analysis.figures --only=position_exactness`.

rerotate's K bytes can differ from fresh even where the logits are equal (δ = 0, and the
controls): a rotation by 0 computes x cos 0 - y sin 0, which turns a key element -0.0 into +0.0
when its partner is negative (the embedded 270M has whole key dimensions of zeros); each layer
entry's k_values_equal (-0.0 == +0.0) tells these apart from real differences.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import time

import numpy as np
from absl import app, flags, logging

from experiments import common, samples
from gemma_jax import compare
from gemma_jax import weights
from gemma_jax.config import BOS_ID, get_config
from gemma_jax.digest import canonical_json
from graft.store import artifact
from graft import shift
from graft.engine import Engine, EngineConfig, resolve_engine_config

# Offsets δ measured by default: every small δ where a rounding coincidence could make a shift
# exact (0..3, a few primes), every power of two up to 2^16 (the 270M's 32,768-token context and
# beyond for longer models), the negative neighbours, and the largest δ the context allows.
POWERS_OF_TWO = [str(2**e) for e in range(2, 17)]
DEFAULT_OFFSETS = ['0', '1', '2', '3', '5', '7', '11', '13'] + POWERS_OF_TWO + [
    '-1', '-2', 'max-1', 'max']

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  common.define_list('offsets', DEFAULT_OFFSETS,
                     'Offsets δ (integers, or max / max-N / max+N: the largest δ that keeps '
                     'library + query inside the context, minus or plus N). Negative offsets '
                     'graft a library computed at --negative_base.', match=_max_offset)
  common.define_list('methods', list(shift.METHODS), f'Any of {", ".join(shift.METHODS)}.',
                     integers=False, words=shift.METHODS)
  common.define_rope_flag()
  flags.DEFINE_integer('library_tokens', 600, 'Library length in tokens, L (600 crosses the '
                       '512-token window of Gemma 3).', lower_bound=1)
  flags.DEFINE_integer('query_tokens', 32, 'Query length in tokens, Q.', lower_bound=1)
  flags.DEFINE_integer('seed', 0, 'Seed choosing where in the text the library starts.',
                       lower_bound=0)
  flags.DEFINE_integer('negative_base', 64, 'Base position of the library for negative offsets.',
                       lower_bound=0)
  flags.DEFINE_list('overrides', [], 'TransformerConfig fields to replace, name=value (e.g. '
                    'num_layers=10,num_kv_shared_layers=5): a custom model built from --model.')
  flags.register_validator('overrides', lambda items: all('=' in i for i in items),
                           message='--overrides: expected name=value items')
  flags.DEFINE_string('model_label', None, 'Name of the model in rows and in the output\'s '
                      'name (unset: --model, with the overrides appended).')
  common.define_output_flag()
  common.define_model_flags()
  common.define_engine_flags(cache_len=0)


OWN_DEFAULTS = {
    'cache_len': 'sized for the library and the query',
    'library_tokens': "600 crosses the 512-token window of Gemma 3",
    'query_tokens': 'a query of 32 tokens after the grafted library',
    'offsets': 'a sweep: small δ, powers of two, negatives and the largest',
}


def _max_offset(item: str) -> bool:
  """max, max-N or max+N."""
  return item == 'max' or (item[:4] in ('max-', 'max+') and item[4:].isdigit())


# ----------------------------------------------------------------------------------------------
# Setup
# ----------------------------------------------------------------------------------------------


def parse_overrides(items) -> dict:
  out = {}
  for item in items:
    name, sep, value = item.partition('=')
    if not sep:
      raise ValueError(f'--overrides: expected name=value, got {item!r}')
    try:
      out[name.strip()] = ast.literal_eval(value.strip())
    except (ValueError, SyntaxError):
      out[name.strip()] = value.strip()
  return out


def model_label(model: str, overrides: dict, label: str | None) -> str:
  if label:
    return label
  return '_'.join([model] + [f'{k}{v}' for k, v in sorted(overrides.items())])


def max_offset(max_context: int, base: int, library: int, query: int) -> int:
  """The largest δ whose positions base + δ .. base + δ + L + Q - 1 stay < max_context."""
  return max_context - base - library - query


def resolve_offsets(specs, *, max_context: int, library: int, query: int,
                    negative_base: int) -> tuple[list[tuple[int, int]], list[dict]]:
  """([(offset, base position)] ascending, [skipped {spec, offset, reason}])."""
  runs, skipped, seen = [], [], set()
  for spec in specs:
    spec = str(spec).strip()
    if spec.startswith('max'):
      rest = spec[3:] or '+0'
      if rest[:1] not in '+-' or not rest[1:].isdigit():
        raise ValueError(f'offset {spec!r}: expected an integer, max, max-N or max+N')
      offset = max_offset(max_context, 0, library, query) + int(rest)
    else:
      try:
        offset = int(spec)
      except ValueError:
        raise ValueError(f'offset {spec!r}: expected an integer, max, max-N or max+N') from None
    base = 0 if offset >= 0 else negative_base
    first, last = base + offset, base + offset + library + query - 1
    reason = None
    if first < 0:
      reason = (f'positions would start at {first} < 0 (negative offsets graft a library '
                f'computed at --negative_base={negative_base})')
    elif last >= max_context:
      reason = f'the last query position {last} would be >= max_context {max_context}'
    if reason:
      logging.warning('skipping offset %s (δ=%d): %s', spec, offset, reason)
      skipped.append({'spec': spec, 'offset': offset, 'reason': reason})
    elif offset not in seen:
      seen.add(offset)
      runs.append((offset, base))
  return sorted(runs), skipped


def text_tokens(tokenizer, library: int, query: int, seed: int) -> tuple[list[int], list[int]]:
  """A library (BOS + L - 1 tokens) and the Q tokens that follow it in real text."""
  ids = tokenizer.encode(samples.corpus_text(), add_bos=False)
  rng = np.random.default_rng(seed)
  start = int(rng.integers(0, len(ids) - library - query))
  body = ids[start:start + library - 1 + query]
  return [BOS_ID] + list(body[:library - 1]), list(body[library - 1:])


def auto_cache_len(library: int, query: int, block_size: int) -> int:
  """Enough slots for a fresh library + query (one padded call sequence) and for a graft plus a
  padded query."""
  blocks = lambda n: -(-n // block_size) * block_size
  return max(blocks(library + query), library + blocks(query))


# ----------------------------------------------------------------------------------------------
# The sweep
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Run:
  """Fresh computations, memoized by (engine name, start position)."""

  engines: dict[str, Engine]
  library: list[int]
  query: list[int]
  _fresh: dict = dataclasses.field(default_factory=dict)
  _libraries: dict = dataclasses.field(default_factory=dict)

  def fresh(self, name: str, start: int, *, again: bool = False):
    """(context, query logits [Q, V]) of library + query computed from scratch at `start`, in
    one extend; `again` computes it once more instead of returning the memoized result."""
    key = (name, start)
    if key not in self._fresh or again:
      engine = self.engines[name]
      result = engine.extend(engine.empty(start), self.library + self.query,
                             logits=len(self.query))
      if again:
        return result
      self._fresh[key] = result
    return self._fresh[key]

  def library_state(self, name: str, start: int, *, again: bool = False):
    """The context holding the library alone, computed from scratch at `start`."""
    key = (name, start)
    if key not in self._libraries or again:
      engine = self.engines[name]
      seq, _ = engine.prefill(self.library, logits='none', start_position=start)
      if again:
        return seq
      self._libraries[key] = seq
    return self._libraries[key]

  def library_artifact(self, name: str, base: int) -> artifact.Artifact:
    """The library computed alone at `base`, as an in-memory artifact (its canonical leaves)."""
    return artifact.capture(self.engines[name], self.library_state(name, base))

  def forget(self, keep_starts) -> None:
    """Drops memoized computations at starts not in `keep_starts` (memory)."""
    self._fresh = {k: v for k, v in self._fresh.items() if k[1] in keep_starts}
    self._libraries = {k: v for k, v in self._libraries.items() if k[1] in keep_starts}


def _row(method, offset, base, reference_logits, logits, layers, seconds, **extra) -> dict:
  comparison = compare.compare_logits(reference_logits, logits)
  kl = compare.kl_per_position(reference_logits, logits)
  return {
      'method': method, 'offset': int(offset), 'base_position': int(base),
      'start_position': int(base + offset),
      **comparison,
      'kl_mean': float(np.mean(kl)),
      'reference_sha256': compare.sha256_bytes(reference_logits),
      'sha256': compare.sha256_bytes(logits),
      'kv_equal': all(l['k_equal'] and l['v_equal'] for l in layers),
      'first_differing_layer': compare.first_differing_layer(layers),
      **extra,
      'seconds': round(seconds, 2),
      'layers': layers,
  }


def measure(run: Run, method: str, offset: int, base: int) -> dict:
  """One row: `method` at offset δ = `offset` for a library computed at `base`.

  Logits: the query's, continuing the grafted library, against the one-shot fresh computation
  of library + query at base + δ. Layers: the grafted library's K/V, before the query, against
  the library computed alone at base + δ (every slot that holds a library token; the query
  would evict the oldest ones from the local rings)."""
  t0 = time.perf_counter()
  library_span = len(run.library)
  start = base + offset
  if method in shift.GRAFT_METHODS:
    name = 'standard' if method == 'rerotate' else 'pre_rope'
    engine = run.engines[name]
    grafted = shift.graft_shifted(engine, run.library_artifact(name, base), offset, method)
    layers = shift.layer_divergence(
        engine.model_config, grafted, run.library_state(name, start),
        slot_positions=(start, start + library_span),
        keys='attention' if method == 'pre_rope' else 'cache')
    _, logits = engine.extend(grafted, run.query, logits='all')
    _, reference_logits = run.fresh(name, start)
    extra = {}
    if method == 'pre_rope':
      _, standard_logits = run.fresh('standard', start)
      extra['reference_equals_standard_fresh'] = (
          compare.sha256_bytes(standard_logits) == compare.sha256_bytes(reference_logits))
    return _row(method, offset, base, reference_logits, logits, layers,
                time.perf_counter() - t0, **extra)
  if method == 'recompute':
    # At δ = 0 the two sides are separate computations (a run-to-run determinism check), not
    # one result compared with itself.
    _, reference_logits = run.fresh('standard', base)
    _, logits = run.fresh('standard', start, again=offset == 0)
    # Layers: the pre-RoPE engine's library (keys before RoPE, and V: the position-free part).
    pre = run.engines['pre_rope']
    layers = shift.layer_divergence(
        pre.model_config, run.library_state('pre_rope', start, again=offset == 0),
        run.library_state('pre_rope', base), slot_positions=(base, base + library_span),
        keys='cache', position_offset=offset)
    return _row(method, offset, base, reference_logits, logits, layers,
                time.perf_counter() - t0, layers_engine='pre_rope (keys before RoPE)')
  raise ValueError(f'unknown method {method!r}; expected one of {shift.METHODS}')


def sweep(engines: dict[str, Engine], library, query, offsets: list[tuple[int, int]],
          methods, *, label: str, weights_spec: str, dtype: str, rope: str) -> list[dict]:
  """Every (offset, method) row, logged as it is measured."""
  run = Run(engines=engines, library=list(library), query=list(query))
  rows = []
  total = len(offsets) * len(methods)
  for offset, base in offsets:
    for method in methods:
      row = {'model': label, 'weights': weights_spec, 'dtype': dtype, 'rope': rope,
             **measure(run, method, offset, base)}
      rows.append(row)
      logging.info('[%d/%d] %s %s rope=%s %-9s δ=%-6d (base %d): equal=%s max_ulp=%.3g '
                   'kl=%.3g argmax=%.3f kv_equal=%s first differing layer=%s (%.1fs)',
                   len(rows), total, label, dtype, rope, method, offset, base, row['equal'],
                   row['max_ulp'], row['kl'], row['argmax_agreement'], row['kv_equal'],
                   row['first_differing_layer'], row['seconds'])
    run.forget({base for _, base in offsets})
  return rows


# ----------------------------------------------------------------------------------------------
# Entry point
# ----------------------------------------------------------------------------------------------


def build_engines(loaded: weights.LoadedModel, engine_config: EngineConfig,
                  methods) -> dict[str, Engine]:
  engines = {'standard': Engine(loaded, engine_config)}
  if 'pre_rope' in methods or 'recompute' in methods:
    engines['pre_rope'] = Engine(shift.pre_rope_model(loaded), engine_config)
  return engines


def main(argv):
  del argv
  t_start = time.perf_counter()
  methods = list(FLAGS.methods)
  if not methods:
    raise app.UsageError(f'--methods: give some of {shift.METHODS}')
  overrides = parse_overrides(FLAGS.overrides)
  label = model_label(FLAGS.model, overrides, FLAGS.model_label)
  config = get_config(FLAGS.model).replace(rope_mode=FLAGS.rope, **overrides)
  output = common.output_path('position_sweep', label, FLAGS.dtype, FLAGS.rope)
  library_len, query_len = FLAGS.library_tokens, FLAGS.query_tokens
  offsets, skipped = resolve_offsets(FLAGS.offsets, max_context=config.max_context,
                                     library=library_len, query=query_len,
                                     negative_base=FLAGS.negative_base)
  if not offsets:
    raise app.UsageError('no offset fits the context; nothing to measure')

  logging.info('loading %s (%s) weights=%s dtype=%s rope=%s', label, FLAGS.model, FLAGS.weights,
               FLAGS.dtype, FLAGS.rope)
  loaded = weights.load(config, FLAGS.weights, FLAGS.dtype)
  common.check_rope_engine()
  block_size = resolve_engine_config(config, EngineConfig(
      mode=FLAGS.engine, rows_per_call=FLAGS.rows_per_call)).rows_per_call
  engine_config = common.engine_config(
      needed_cache=auto_cache_len(library_len, query_len, block_size), model=config)
  cache_len = engine_config.cache_len
  engines = build_engines(loaded, engine_config, methods)
  library, query = text_tokens(loaded.tokenizer, library_len, query_len, FLAGS.seed)
  logging.info('library %d tokens, query %d tokens; %d offsets x %d methods; skipped %s',
               len(library), len(query), len(offsets), len(methods),
               [s['offset'] for s in skipped])

  rows = sweep(engines, library, query, offsets, methods, label=label,
               weights_spec=FLAGS.weights, dtype=FLAGS.dtype, rope=FLAGS.rope)
  standard = engines['standard']
  run_config = {
      **common.model_config_json(), 'model': label, 'base_model': FLAGS.model,
      'overrides': overrides, 'rope': FLAGS.rope, 'methods': methods,
      'offsets': [o for o, _ in offsets], 'offset_specs': list(FLAGS.offsets),
      'skipped': skipped, 'negative_base': FLAGS.negative_base,
      'library_tokens': len(library), 'query_tokens': len(query), 'seed': FLAGS.seed,
      'text': 'pydoc_data.topics (experiments/samples.py corpus_text)',
      'library_sha256': compare.sha256_bytes(np.asarray(library, np.int32)),
      'query_sha256': compare.sha256_bytes(np.asarray(query, np.int32)),
      'engine': FLAGS.engine, 'attention': standard.engine_config.attention,
      'block_size': block_size, 'cache_len': cache_len,
      'engine_config': dataclasses.asdict(standard.engine_config),
      'max_context': config.max_context,
      'transformer_config': json.loads(canonical_json(config)),
      'model_fingerprint': standard.model_fingerprint['sha256'],
      'pre_rope_model_fingerprint': (engines['pre_rope'].model_fingerprint['sha256']
                                     if 'pre_rope' in engines else None),
      'engine_fingerprint': standard.fingerprint,
      'wall_seconds': round(time.perf_counter() - t_start, 1),
  }
  common.write_result(output, 'position_sweep', {'config': run_config, 'rows': rows})
  for method in methods:
    method_rows = [r for r in rows if r['method'] == method]
    exact = [r['offset'] for r in method_rows if r['equal']]
    inexact = [r for r in method_rows if not r['equal']]
    kv_equal = sum(1 for r in method_rows if r['equal'] and r.get('kv_equal'))
    print(f'{label} {FLAGS.dtype} rope={FLAGS.rope} {method}: exact at δ in {exact} '
          f'(KV equal too at {kv_equal} of them); {len(inexact)} inexact' + (
              f' (KL {min(r["kl"] for r in inexact):.3g}..{max(r["kl"] for r in inexact):.3g}, '
              f'max_ulp {min(r["max_ulp"] for r in inexact):.3g}..'
              f'{max(r["max_ulp"] for r in inexact):.3g})' if inexact else ''))


if __name__ == '__main__':
  define_flags()
  common.run(main)
