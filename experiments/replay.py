"""Replays a committed manifest on this machine and checks every output hash.

  python -m experiments.replay --manifest=manifests/NAME.json

The manifest (written by experiments.graft_exactness --manifest) holds the token ids of every
sample, the model and engine fingerprints, and the SHA-256 of the fresh and grafted query logits
and of the greedy continuation. Replay rebuilds the model and the pinned engine from the
manifest's config, checks the model fingerprint, recomputes every sample and exits with status 1,
listing the differing samples, if any hash differs. A different engine environment (another CPU,
jax version, ...) is reported; the hashes then say whether it mattered.
"""

from __future__ import annotations

import json
import sys
import tempfile

from absl import app, flags, logging

from gemma_jax import weights
from graft import exactness
from graft.artifact import differences
from graft.engine import Engine, PinnedConfig

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('manifest', None, 'Manifest JSON to replay.', required=True)
  flags.DEFINE_integer('limit', 0, 'Replay only the first N samples (0: all).')


HASHES = ('fresh_sha256', 'graft_sha256', 'continuation_sha256')


def replay(manifest: dict, limit: int = 0) -> list[str]:
  """Recomputes the manifest's samples; returns a line per differing sample (empty: all equal)."""
  config = manifest['config']
  loaded = weights.load(config['model'], config['weights'], config['dtype'])
  pinned = PinnedConfig(**config['pinned'])
  engine, writer = Engine(loaded, pinned), Engine(loaded, pinned)
  if engine.model_fingerprint['sha256'] != manifest['model_fingerprint']['sha256']:
    raise ValueError('this machine loads a different model than the manifest was made with: '
                     + '; '.join(differences(manifest['model_fingerprint'],
                                              engine.model_fingerprint)))
  environment = differences(manifest['engine_fingerprint'], engine.fingerprint)
  environment = [d for d in environment if not d.startswith('sha256')]
  if environment:
    logging.warning('engine environment differs from the manifest: %s', '; '.join(environment))
  records = manifest['samples'][:limit or None]
  failures = []
  with tempfile.TemporaryDirectory() as scratch:
    for i, record in enumerate(records):
      row = exactness.check_sample(
          engine, writer, record['library'], record['query'],
          artifact_path=f'{scratch}/sample_{i:03d}',
          continuation_tokens=config['continuation_tokens'])
      differing = [h for h in HASHES if row[h] != record[h]]
      status = 'ok' if not differing else 'DIFFERS: ' + ', '.join(differing)
      logging.info('sample %d/%d (library %d, query %d tokens): %s', i + 1, len(records),
                   len(record['library']), len(record['query']), status)
      if differing:
        failures.append(f'sample {i}: ' + ', '.join(
            f'{h} {row[h][:16]}.. != recorded {record[h][:16]}..' for h in differing))
  return failures


def main(argv):
  del argv
  with open(FLAGS.manifest) as f:
    manifest = json.load(f)
  failures = replay(manifest, FLAGS.limit)
  count = len(manifest['samples'][:FLAGS.limit or None])
  if failures:
    print(f'{len(failures)} of {count} samples differ from {FLAGS.manifest}:')
    print('\n'.join(failures))
    sys.exit(1)
  print(f'all {count} samples reproduce {FLAGS.manifest} hash for hash')


if __name__ == '__main__':
  define_flags()
  app.run(main)
