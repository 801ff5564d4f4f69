"""Replaying committed manifests: recompute every recorded sample or answer and compare hashes.

A graft-exactness manifest (experiments.graft_exactness --manifest) holds the token ids of
every sample, the model and engine fingerprints, and the SHA-256 of the fresh and grafted query
logits and of the greedy continuation; a flywheel manifest (experiments.flywheel --manifest)
holds every answer's prompt token ids, decoding settings, tokens and logits SHA-256; a compose
manifest (experiments.compose --manifest_output) every composition's prefix, documents, order,
strategy and query, and the SHA-256 of its KV, logits and continuation. `replay`
rebuilds the model and the engine from the manifest's config, checks the model fingerprint,
recomputes every record and returns a line per differing one. experiments/replay.py is the
entry point.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import tempfile

from absl import logging

from gemma_jax import compare, sampling, sharding, weights
from gemma_jax.config import get_config
from graft import composition, exactness
from graft.engine import Engine, EngineConfig, fingerprint
from graft.knowledge.flywheel import Asker  # the decoding a flywheel run used
from graft.engine.fingerprint import differences
from graft.store import Recompute, Store
from graft.store.kvstore import KvStore


HASHES = ('fresh_sha256', 'graft_sha256', 'continuation_sha256')
# A difference between a manifest and this machine reads 'x: the manifest has 1, this machine 2'.
_LABELS = ('the manifest has', 'this machine')
# What of the environment decides the bits of a CPU run besides the engine config.
_MACHINE_FIELDS = ('backend', 'machine', 'cpu_features', 'cpu_model', 'jax', 'jaxlib')


def machine_independent(manifest: dict) -> bool:
  """Whether the manifest was made by the spec engine, whose bits any machine that passes the
  spec self-check reproduces (its fingerprint binds no machine)."""
  return manifest['engine_fingerprint'].get('mode') == 'spec'


def made_on_this_kind_of_machine(manifest: dict) -> bool:
  """Whether this machine can reproduce the manifest: any machine for a spec manifest; else the
  one whose recorded environment is this machine's (fields a manifest predates, such as
  cpu_model, are not compared)."""
  if machine_independent(manifest):
    return True
  recorded = manifest['engine_fingerprint'].get('environment', {})
  here = fingerprint.environment()
  return all(recorded[k] == here[k] for k in _MACHINE_FIELDS if k in recorded)


def select(pattern: str) -> str:
  """The manifest matching `pattern` (a path or a glob) that this machine can reproduce (a spec
  manifest first); raises FileNotFoundError, listing the candidates' environments, when there
  is none."""
  paths = sorted(glob.glob(pattern))
  if not paths:
    raise FileNotFoundError(f'no manifest matches {pattern}')
  if len(paths) == 1 and not glob.has_magic(pattern):
    return paths[0]
  manifests = {}
  for path in paths:
    with open(path) as f:
      manifests[path] = json.load(f)
  for path in sorted(paths, key=lambda p: not machine_independent(manifests[p])):
    if made_on_this_kind_of_machine(manifests[path]):
      return path
  here = {k: fingerprint.environment()[k] for k in ('cpu_model', 'cpu_features')}
  raise FileNotFoundError(
      f'none of {paths} was made on a machine like this one ({here}); make one here with '
      'python -m experiments.graft_exactness --samples=4 --continuation_tokens=8 '
      '--manifest=manifests/<name>.json')


def _engine(manifest: dict, dot_library: str | None = None,
            rope: str | None = None) -> tuple[Engine, Engine]:
  """Two separately constructed engines of the manifest's model (in its RoPE mode, or `rope`)
  and configuration, after checking that this machine loads the same model. A spec manifest's
  engine runs under this process's XLA_FLAGS and on this machine's kernels (the spec engine's
  default dot library), or on `dot_library` where one is asked for: neither decides a bit there
  (the self-check says whether this machine
  computes the spec under them), so the dots it was made on do not matter."""
  config = manifest['config']
  loaded = weights.load(get_config(config['model']).replace(rope_mode=rope or config.get('rope')
                                                            or 'float'),
                        config['weights'], config['dtype'])
  # Manifests made before the config was named EngineConfig hold it under 'pinned'.
  engine_config = EngineConfig.from_dict(config.get('engine_config') or config['pinned'])
  if machine_independent(manifest):
    # This process's flags, and the dot library asked for or else this machine's default (the
    # spec's own kernels where they build: resolve_engine_config decides it, as for any engine).
    engine_config = dataclasses.replace(engine_config, xla_flags=sharding.xla_flags(),
                                        dot_library=dot_library)
  elif dot_library:
    raise ValueError(f'dot library {dot_library!r}: only a spec manifest replays with another '
                     'dot library (the others\' bits follow it)')
  engine = Engine(loaded, engine_config)
  writer = Engine(loaded, engine_config)
  manifest = {**manifest,  # a compose manifest records both per RoPE mode
              'engine_fingerprint': manifest.get('engine_fingerprints', {}).get(
                  rope, manifest['engine_fingerprint']),
              'model_fingerprint': manifest.get('model_fingerprints', {}).get(
                  rope, manifest['model_fingerprint'])}
  if engine.model_fingerprint['sha256'] != manifest['model_fingerprint']['sha256']:
    raise ValueError('this machine loads a different model than the manifest was made with: '
                     + '; '.join(differences(engine.model_fingerprint,
                                              manifest['model_fingerprint'], labels=_LABELS)))
  if machine_independent(manifest):
    made_on = manifest['engine_fingerprint'].get('made_on', {})
    logging.info('a spec manifest made on %s %s; this machine passed the spec self-check',
                 made_on.get('cpu_model'), made_on.get('device_kind'))
    # What decides the bits, a field the manifest predates read as the value it stood for
    # (fingerprint.engine_differences): quiet unless something differs.
    differing = fingerprint.engine_differences(engine.fingerprint,
                                               manifest['engine_fingerprint'], labels=_LABELS)
    if differing:
      logging.warning('the engine fingerprint differs from the manifest: %s',
                      '; '.join(differing))
    return engine, writer
  environment = differences(engine.fingerprint['environment'],
                            manifest['engine_fingerprint'].get('environment'), labels=_LABELS)
  if environment:
    logging.warning('engine environment differs from the manifest: %s', '; '.join(environment))
  return engine, writer


def records(manifest: dict) -> list[dict]:
  """What a manifest records one hash set each for: samples, answers or compositions."""
  return manifest[{'flywheel': 'answers', 'compose': 'compositions'}.get(
      str(manifest.get('kind')), 'samples')]


def replay(manifest: dict, limit: int = 0, dot_library: str | None = None) -> list[str]:
  """Recomputes the manifest's records; returns a line per differing one (empty: all equal).
  dot_library: another one for a spec manifest's engine (EngineConfig.dot_library)."""
  if manifest.get('kind') == 'flywheel':
    return replay_answers(manifest, limit, dot_library)
  if manifest.get('kind') == 'compose':
    return replay_compositions(manifest, limit, dot_library)
  config = manifest['config']
  engine, writer = _engine(manifest, dot_library)
  chosen = manifest['samples'][:limit or None]
  failures = []
  with tempfile.TemporaryDirectory() as scratch:
    for i, record in enumerate(chosen):
      graft = exactness.artifact_graft(writer, engine, f'{scratch}/sample_{i:03d}')
      row = exactness.check_sample(engine, graft, record['library'], record['query'],
                                   continuation_tokens=config['continuation_tokens'])
      differing = [h for h in HASHES if row[h] != record[h]]
      status = 'ok' if not differing else 'DIFFERS: ' + ', '.join(differing)
      logging.info('sample %d/%d (library %d, query %d tokens): %s', i + 1, len(chosen),
                   len(record['library']), len(record['query']), status)
      if differing:
        failures.append(f'sample {i}: ' + ', '.join(
            f'{h} {row[h][:16]}.. != recorded {record[h][:16]}..' for h in differing))
  return failures


def replay_answers(manifest: dict, limit: int = 0, dot_library: str | None = None) -> list[str]:
  """A flywheel manifest: every answer decoded again from a fresh computation of its whole
  prompt (a grafted answer is byte-equal to that, so the recorded hashes must reproduce), its
  sampled tokens drawn as the manifest records (one recording none was drawn with
  sampling.LEGACY)."""
  engine, _ = _engine(manifest, dot_library)
  sampler = manifest.get('sampler', sampling.LEGACY)
  asker = Asker(engine)
  chosen = manifest['answers'][:limit or None]
  failures = []
  for i, record in enumerate(chosen):
    ctx, _ = engine.prefill(record['prompt'], logits='last')
    decoded = engine.decode(ctx, record.get('max_tokens', manifest['budget']),
                            temperature=record['temperature'],
                            seed=record['seed'], stop=asker.stopper(record.get('cue', '')),
                            sampler=sampler)
    differing = [name for name, ok in (('tokens', decoded.tokens == record['tokens']),
                                       ('logits_sha256',
                                        decoded.logits_sha256 == record['logits_sha256']))
                 if not ok]
    logging.info('answer %d/%d (%s %s %s): %s', i + 1, len(chosen), record['id'],
                 record['split'], record['phase'],
                 'ok' if not differing else 'DIFFERS: ' + ', '.join(differing))
    if differing:
      failures.append(f'answer {i} ({record["id"]} {record["phase"]}): ' + ', '.join(differing))
  return failures


def replay_compositions(manifest: dict, limit: int = 0,
                        dot_library: str | None = None) -> list[str]:
  """A compose manifest (experiments.compose --manifest): each composition made again from
  scratch, its documents computed after the prefix and stored in a new memory store, composed
  in the recorded order with the recorded strategy (and re-rotation), then the query and a
  greedy continuation; the SHA-256 of the composed KV, the query's logits and the
  continuation's logits must be the recorded ones."""
  chosen = manifest['compositions'][:limit or None]
  engines, failures = {}, []
  for i, record in enumerate(chosen):
    rope = record['rope']
    if rope not in engines:
      engines[rope] = _engine(manifest, dot_library, rope)[0]
    engine = engines[rope]
    store = Store(KvStore('memory://'), engine)
    for document in record['documents']:
      store.put_document(record['prefix'], document)
    composed = store.compose(record['prefix'], record['documents'],
                             recompute=Recompute(**record['recompute']),
                             rerotate=record['rerotate'])
    kv = composition.kv_digest(engine, composed.context)
    ctx, logits = engine.extend(composed.context, record['query'], logits='all', consume=True)
    assert logits is not None  # logits='all' of a query
    decoded = engine.decode(ctx, len(record['continuation']))
    got = {'kv_sha256': kv, 'logits_sha256': compare.sha256_bytes(logits),
           'continuation_sha256': decoded.logits_sha256}
    differing = [name for name, value in got.items() if value != record[name]]
    if decoded.tokens != record['continuation']:
      differing.append('continuation')
    logging.info('composition %d/%d (%s, %s at %g, %d documents): %s', i + 1, len(chosen), rope,
                 record['recompute']['strategy'], record['recompute']['fraction'],
                 len(record['documents']), 'ok' if not differing else 'DIFFERS: '
                 + ', '.join(differing))
    if differing:
      failures.append(f'composition {i} ({rope} {record["recompute"]["strategy"]} '
                      f'{record["recompute"]["fraction"]}): ' + ', '.join(differing))
  return failures
