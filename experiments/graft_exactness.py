"""Graft exactness: are grafted logits byte-for-byte those of a fresh computation?

  python -m experiments.graft_exactness --samples=50 --manifest_output=manifests/NAME.json
  python -m experiments.graft_exactness --input=pairs.jsonl --engine=default --output=...
  python -m experiments.graft_exactness --source=store --store=file:///tmp/kv/
  python -m experiments.graft_exactness --rope=relative --offsets=1,7,64,1000,30000

Samples are drawn by a seeded generator from real text (experiments/samples.py) or read from
--input (one {"library": text, "query": text} per line). For each, the fresh side computes
library + query from scratch; the graft side has a separately constructed engine write the
library's artifact to disk, restores it (verified) and processes the query (graft/exactness.py).

With --source=store the libraries are deposited into the store at --store by a separate process
(`python -m experiments.store put`, its own engine), and each query grafts the longest stored
prefix of its library from it (graft/store/_store.py). The samples then include libraries that share a
prefix ending mid-block with another (their shared blocks stored once) and libraries that were
never deposited but diverge mid-block from one that was (the store gives the shared block's
first rows); see experiments/samples.py `with_shared_prefixes`. Rows add `grafted_tokens`,
`deposited` and `shares`.
With --offsets=δ,... each artifact, computed at [0, L), is grafted at [δ, δ + L) and compared
with a fresh computation of the same tokens at δ (graft/exactness.py `check_offset`); under
--rope=relative that is exact. For δ up to --preceded_up_to a second row grafts the library
after δ tokens of other text, against the fresh computation of that whole text: what stays
inexact (the library's own KV never attended to those tokens). Rows add `sample`, `offset`
and `preceding_tokens`; the summary counts own-text rows, and `preceded` the others.
With --mesh=model:4 (or model:2,data:2; --mesh_layout=gather|split) the engine runs on a device mesh
(gemma_jax/sharding.py); on a CPU host the device count is set from the mesh.
With --batch_slots=N the engine (spec or pinned) serves N samples per call, one per batch slot
(`Engine.extend_batch`): fresh and graft sides each run batched, so the rows also show batch
invariance (a sample's fresh_sha256 is the one it gets alone, in an unbatched run).
The output JSON (schema graft_exactness, analysis/results.py; --output, or the run folder
runs/graft_exactness/) holds the full config, one row per sample and a summary;
--manifest_output also writes the replayable evidence (token ids and output hashes) for
experiments.replay. The run exits with status 1 if any graft is not SHA-256 equal to fresh.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from absl import app, flags, logging

from experiments import common, samples
from gemma_jax import compare
from graft import exactness
from graft.store import Store

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_integer('samples', 50, 'Samples drawn from real text (ignored with --input).',
                       lower_bound=1)
  flags.DEFINE_integer('seed', 0, 'Seed of the sample generator.', lower_bound=0)
  flags.DEFINE_string('input', None, 'JSONL input: {"library": text, "query": text} pairs.')
  common.define_output_flag()
  flags.DEFINE_string('manifest_output', None, 'Also write a replayable manifest of this run here '
                      '(experiments.replay --manifest reads it).')
  flags.DEFINE_integer('batch_slots', 1, 'Batch slots: samples served together, one per batch '
                       'slot of every call (spec and pinned engines).', lower_bound=1)
  flags.DEFINE_integer('continuation_tokens', 32, 'Greedy tokens compared after the query.',
                       lower_bound=0)
  flags.DEFINE_string('artifact_dir', None, 'Where artifacts go (unset: a temporary directory).')
  flags.DEFINE_enum('source', 'artifact', ['artifact', 'store'],
                    'Where grafts come from: an artifact per sample, or the knowledge store.')
  flags.DEFINE_string('store', None, 'Store URL for --source=store (unset: a temporary '
                      'file:// store); another process deposits into it, so not memory://.')
  common.define_list('offsets', [], 'Offsets δ: graft each artifact at these positions instead '
                     'of its own (computed at [0, L), grafted at [δ, δ + L)) against a fresh '
                     'computation there: one row per sample and offset (artifacts only; exact '
                     'under --rope=relative).', lower_bound=0)
  flags.DEFINE_integer('preceded_up_to', 512, 'With --offsets, also graft the library after δ '
                       'other tokens (another sample\'s text) for every δ up to this: a change of '
                       'content, not of position (0: none).', lower_bound=0)
  common.define_model_flags()
  common.define_rope_flag()
  common.define_store_flags()
  common.define_engine_flags(cache_len=common.GRAFT_CACHE_LEN)


OWN_DEFAULTS = {
    'cache_len': "the longest sample (a 2,070-token library and a 128-token query), rounded up",
    'samples': 'the committed 50-sample run',
    'batch_slots': 'one sample a call, unless asked (a count here, not bench\'s sweep)',
}


def run_config(engine) -> dict:
  return {**common.model_config_json(), 'engine': FLAGS.engine,
          'attention': engine.engine_config.attention,
          'engine_config': dataclasses.asdict(engine.engine_config), 'samples': FLAGS.samples,
          'seed': FLAGS.seed, 'input': FLAGS.input, 'source': FLAGS.source,
          'batch_slots': FLAGS.batch_slots,
          'store': FLAGS.store if FLAGS.source == 'store' else None,
          'continuation_tokens': FLAGS.continuation_tokens,
          'offsets': [int(o) for o in FLAGS.offsets], 'preceded_up_to': FLAGS.preceded_up_to,
          'model_fingerprint': engine.model_fingerprint['sha256'],
          'engine_fingerprint': engine.fingerprint}


def run(engine, grafts, pairs: list[samples.Sample]) -> list[dict]:
  """One row per sample; grafts[i] is sample i's graft source. --batch_slots samples at once."""
  rows, n = [], FLAGS.batch_slots
  for first in range(0, len(pairs), n):
    if n > 1:
      rows.extend(exactness.check_batch(engine, grafts[first:first + n], pairs[first:first + n],
                                        continuation_tokens=FLAGS.continuation_tokens))
    else:
      rows.append(exactness.check_sample(engine, grafts[first], pairs[first].library,
                                         pairs[first].query,
                                         continuation_tokens=FLAGS.continuation_tokens))
    for i in range(first, len(rows)):
      row = rows[i]
      logging.info('sample %d/%d: library %d, query %d tokens: equal=%s kl=%.3g argmax=%.3f '
                   'continuation_equal=%s (%.1fs)', i + 1, len(pairs), row['library_tokens'],
                   row['query_tokens'], row['equal'], row['kl'], row['argmax_agreement'],
                   row['continuation_equal'], row['fresh_seconds'] + row['graft_seconds'])
  return rows


def run_offsets(engine, writer, pairs: list[samples.Sample], offsets: list[int],
                directory: str) -> list[dict]:
  """One row per sample and offset (`exactness.check_offset`), and per sample and offset up to
  --preceded_up_to one more with that many tokens of the next sample's text before it."""
  rows = []
  for i, pair in enumerate(pairs):
    other = list(pairs[(i + 1) % len(pairs)].library) + list(pairs[(i + 1) % len(pairs)].query)
    for offset in offsets:
      for preceding in ([[]] + ([other[:offset]] if 0 < offset <= FLAGS.preceded_up_to
                                                     and offset <= len(other) else [])):
        path = os.path.join(directory, f'sample_{i:03d}_offset{offset}_after{len(preceding)}')
        row = exactness.check_offset(engine, writer, path,
                                     pair.library, pair.query, offset=offset, preceding=preceding,
                                     continuation_tokens=FLAGS.continuation_tokens)
        rows.append({'sample': i, **row})
        logging.info('sample %d/%d δ=%d after %d other tokens: equal=%s kl=%.3g max_ulp=%.3g',
                     i + 1, len(pairs), offset, len(preceding), row['equal'], row['kl'],
                     row['max_ulp'])
  return rows


def manifest(config: dict, engine, pairs, rows) -> dict:
  return {
      'kind': 'graft_exactness',
      'config': config,
      'model_fingerprint': engine.model_fingerprint,
      'engine_fingerprint': engine.fingerprint,
      'samples': [{'library': list(s.library), 'query': list(s.query),
                   'input_sha256': compare.token_ids_sha256(
                       list(s.library) + [-1] + list(s.query)),
                   'fresh_sha256': r['fresh_sha256'], 'graft_sha256': r['graft_sha256'],
                   'continuation_sha256': r['continuation_sha256']}
                  for s, r in zip(pairs, rows)],
  }


def deposit(url: str, libraries: list, scratch: str) -> None:
  """Puts the libraries into the store at `url` from a separate process (its own engine)."""
  path = os.path.join(scratch, 'libraries.jsonl')
  with open(path, 'w') as f:
    for library in libraries:
      f.write(json.dumps({'tokens': [int(t) for t in library]}) + '\n')
  command = [sys.executable, '-m', 'experiments.store', 'put', f'--store={url}',
             f'--input={path}', f'--model={FLAGS.model}', f'--weights={FLAGS.weights}',
             f'--dtype={FLAGS.dtype}', *common.engine_flag_args(), *common.store_flag_args()]
  logging.info('depositing %d libraries: %s', len(libraries), ' '.join(command))
  subprocess.run(command, check=True, cwd=common.REPO,
                 env={**os.environ, 'PYTHONPATH': common.REPO})


def main(argv):
  del argv
  offsets = list(FLAGS.offsets)
  if offsets and (FLAGS.source != 'artifact' or FLAGS.batch_slots > 1 or FLAGS.manifest_output):
    raise app.UsageError('--offsets grafts artifacts one sample at a time, without a manifest')
  loaded = common.load_model()
  engine = common.make_engine(loaded)
  if FLAGS.input:
    pairs = samples.read_jsonl(FLAGS.input, loaded.tokenizer)
  else:
    pairs = samples.draw(loaded.tokenizer, FLAGS.samples, seed=FLAGS.seed,
                         window=loaded.config.sliding_window)
  config = run_config(engine)
  with tempfile.TemporaryDirectory() as scratch:
    if offsets:
      rows = run_offsets(engine, common.make_engine(loaded), pairs, offsets,
                         FLAGS.artifact_dir or scratch)
    elif FLAGS.source == 'store':
      if (FLAGS.store or '').startswith('memory://'):
        raise app.UsageError('--source=store deposits from another process: use a store it can '
                             'reach (file:///abs/path/, gs://...), not memory://')
      url = FLAGS.store or f'file://{scratch}/store/'
      planned = samples.with_shared_prefixes(pairs, engine.engine_config.rows_per_call,
                                             seed=FLAGS.seed)
      pairs = [p.sample for p in planned]
      deposit(url, [p.sample.library for p in planned if p.deposited], scratch)
      store = Store(url, engine, create=False, **common.store_args(writer=False))
      grafts = [lambda library, store=store: store.graft(library)[0]] * len(pairs)
    else:
      writer = common.make_engine(loaded)  # separately constructed: it writes the artifacts
      directory = FLAGS.artifact_dir or scratch
      grafts = [exactness.artifact_graft(writer, engine,
                                         os.path.join(directory, f'sample_{i:03d}'))
                for i in range(len(pairs))]
    if not offsets:
      rows = run(engine, grafts, pairs)
  if FLAGS.source == 'store':
    for row, plan in zip(rows, planned):
      row.update(deposited=plan.deposited, shares=plan.shares, shared_tokens=plan.shared_tokens)
  summary = exactness.summarize([r for r in rows if not r.get('preceding_tokens')])
  if offsets:
    preceded = [r for r in rows if r['preceding_tokens']]
    summary.update(offsets=offsets, preceded=exactness.summarize(preceded) if preceded else None)
  output = common.output_path(
      'graft_exactness', FLAGS.model, FLAGS.dtype, FLAGS.rope if FLAGS.rope != 'float' else '',
      'offsets' if offsets else '',
      FLAGS.engine if FLAGS.engine != 'pinned' else '',
      FLAGS.attention or '',
      'store' if FLAGS.source == 'store' else '',
      f'batch{FLAGS.batch_slots}' if FLAGS.batch_slots > 1 else '',
      FLAGS.mesh.replace(':', '').replace(',', '_') + f'_{FLAGS.mesh_layout}' if FLAGS.mesh else '')
  written = common.write_result(output, 'graft_exactness',
                                {'config': config, 'samples': rows, 'summary': summary})
  if FLAGS.manifest_output:
    common.write_json(FLAGS.manifest_output, manifest(written['config'], engine, pairs, rows))
  if offsets and summary['preceded']:
    print(f"after other tokens: {summary['preceded']['equal']}/{summary['preceded']['samples']} "
          'SHA-256 equal (a change of content)')
  print(f"{summary['equal']}/{summary['samples']} SHA-256 equal, max KL {summary['max_kl']:.3g}, "
        f"argmax agreement {summary['argmax_agreement']:.4f}, "
        f"{summary['continuations_equal']}/{summary['samples']} continuations equal")
  if summary['equal'] != summary['samples']:
    print(f"{summary['samples'] - summary['equal']} of {summary['samples']} grafts are not "
          'SHA-256 equal to fresh', file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  define_flags()
  common.run(main)
