"""Replays a committed manifest on this machine and checks every output hash.

  python -m experiments.replay --manifest=manifests/NAME.json
  python -m experiments.replay --manifest=manifests/ci_gemma3_270m_float32.json
  python -m experiments.replay --manifest=manifests/ci_gemma3_270m_float32.json --dot_library=pallas

A graft-exactness manifest (experiments.graft_exactness --manifest) holds the token ids of
every sample, the model and engine fingerprints, and the SHA-256 of the fresh and grafted query
logits and of the greedy continuation; a flywheel manifest (experiments.flywheel --manifest)
holds every answer's prompt token ids, decoding settings, tokens and logits SHA-256. Replay
rebuilds the model and the engine from the manifest's config, checks the model fingerprint,
recomputes every record (graft/replay.py) and exits with status 1, listing the differing ones,
if any hash differs.

A manifest of the spec engine replays on any machine whose spec self-check passes (its bits are
the written arithmetic's), on this machine's kernels whatever dots it was made on (the dot
library decides no bit): the native ones on a CPU, Eigen's where they cannot be built (a
machine without a C++ compiler, said in one line), or --dot_library where given. One of the
pinned or blocked engine replays only on a machine of the kind it was made on (its recorded
environment: their bits depend on the CPU model). A glob for --manifest picks a spec
manifest first, else one made on a machine like this one (`select`).
"""

from __future__ import annotations

import json
import os
import sys

from absl import flags

from experiments import common
from graft.engine.plans import DOT_LIBRARIES
from graft.replay import records, replay, select

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('manifest', None, 'A manifest to read and replay (JSON; a glob picks the '
                      'one made on a machine like this one).', required=True)
  flags.DEFINE_integer('limit', 0, 'Replay only the first N samples (0: all).', lower_bound=0)
  flags.DEFINE_enum('dot_library', None, list(DOT_LIBRARIES),
                    "What computes the spec engine's dots on replay (unset: this machine's "
                    "kernels for a spec manifest, the manifest's own for the others; 'pallas': "
                    'the spec dot kernel, how a GPU follows the spec).')
  common.define_output_flag('schema replay: the manifest, the records replayed, the differing '
                            'ones, and what the replay cost')


def main(argv):
  del argv
  path = select(FLAGS.manifest)
  with open(path) as f:
    manifest = json.load(f)
  failures = replay(manifest, FLAGS.limit, FLAGS.dot_library)
  count = len(records(manifest)[:FLAGS.limit or None])
  name = os.path.splitext(os.path.basename(path))[0]
  common.write_result(common.output_path('replay', name), 'replay', {  # always: the outcome
      'config': {'manifest': path, 'limit': FLAGS.limit, 'dot_library': FLAGS.dot_library,
                 'manifest_made_on': (manifest['engine_fingerprint'].get('made_on')
                                      or manifest['engine_fingerprint'].get('environment'))},
      'summary': {'records': count, 'reproduced': count - len(failures)},
      'failures': failures})
  if failures:
    print(f'{len(failures)} of {count} records differ from {path}:')
    print('\n'.join(failures))
    sys.exit(1)
  print(f'all {count} records reproduce {path} hash for hash')


if __name__ == '__main__':
  define_flags()
  common.run(main)
