"""Nothing silently wrong: a fault-injection campaign over the store and artifacts.

  python -m experiments.faults --trials=150 --output=results/faults_tiny_gemma3_float32.json
  python -m experiments.faults --kinds=bitflip_data,truncate --trials=20
  python -m experiments.faults --block_kind=document --trials=20   # documents, composed

Each trial deposits content (contexts with shared prefixes, some ending mid-block), injects one
fault of its kind at a random place, then answers: a reader that has cached nothing grafts the
longest stored prefix of one context (or restores an artifact) and computes the rest and a
query. Outcomes, per trial:
  exact, untouched, refused, silent_wrong, crashed, and `lost`: as experiments/fault_campaign
  defines them (the claim: silent_wrong = crashed = lost = 0 for every kind).

Kinds (`--kinds`, default all; the process kinds start processes and run --process_trials
each): the 25 of experiments/fault_campaign's docstring, from bit flips, truncation and
foreign stores to self-consistent forgeries (with descendants, with a borrowed signature), stale readers, gc and
rebuilds beside a put, writers killed inside a put and concurrent writers.

Output: schema faults (analysis/results.py).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile

from absl import app, flags
import numpy as np

from experiments import common
from gemma_jax import weights
from graft.engine import Engine, EngineConfig
from experiments.fault_campaign import BLOCK_KINDS, KINDS, campaign, make_world, other_engines
from gemma_jax.config import get_config
from graft.store.kvstore import local_directory

FLAGS = flags.FLAGS

def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('store', None, 'Store URL where trial stores go (a file:// URL of a '
                      'directory; unset: a temporary directory). In-process kinds use memory:// '
                      'stores.')
  flags.DEFINE_integer('trials', 100, 'Trials per in-process kind.', lower_bound=1)
  flags.DEFINE_integer('process_trials', 8, 'Trials per kind that starts processes.', lower_bound=1)
  flags.DEFINE_bool('signed', False, 'The golden store is written by an honest writer\'s key '
                    'and every reader trusts only it (forgeries are then misses).')
  flags.DEFINE_integer('seed', 0, 'Seed of the contexts and of every fault\'s place.',
                       lower_bound=0)
  common.define_list('kinds', list(KINDS), f'Fault kinds: any of {", ".join(KINDS)}.',
                     integers=False, words=KINDS)
  flags.DEFINE_enum('block_kind', 'context', list(BLOCK_KINDS),
                    'What the trials deposit, damage and answer: contexts (chains from '
                    'position 0, grafted) or documents (stored after a prefix, composed in any '
                    'order under RoPE relative: graft/store/documents.py).')
  common.define_output_flag()
  common.define_model_flags('tiny_gemma3', 'random:0')  # tiny: thousands of trials in minutes
  flags.DEFINE_integer('rows_per_call', 8, 'The most token rows per call of the campaign\'s spec '
                       'engine.',
                       lower_bound=1)
  flags.DEFINE_integer('cache_len', 512, 'KV slots of the campaign\'s spec engine.',
                       lower_bound=1)


OWN_DEFAULTS = {
    'model': 'tiny: thousands of trials in minutes',
    'weights': 'the tiny model has random weights only',
    'rows_per_call': "small calls and blocks, so a trial's contexts cross many of them",
    'cache_len': "the campaign's contexts are short",
}


def main(argv):
  del argv
  unknown = sorted(set(FLAGS.kinds) - set(KINDS))
  if unknown:
    raise app.UsageError(f'--kinds: unknown {unknown}; expected some of {KINDS}')
  # Documents are placed anywhere only under the relative RoPE mode (position-free rows).
  rope = 'relative' if FLAGS.block_kind == 'document' else 'float'
  loaded = weights.load(get_config(FLAGS.model).replace(rope_mode=rope), FLAGS.weights,
                        FLAGS.dtype)
  # 8-slot attention tiles: a local ring of 16 slots, so the contexts run past it and the
  # reader's global-layer-only (ranged) reads are exercised.
  engine = Engine(loaded, EngineConfig(rows_per_call=FLAGS.rows_per_call,
                                        cache_len=FLAGS.cache_len, attention_tile=8))
  model_args = [f'--model={FLAGS.model}', f'--weights={FLAGS.weights}', f'--dtype={FLAGS.dtype}',
                f'--rows_per_call={FLAGS.rows_per_call}', f'--cache_len={FLAGS.cache_len}',
                '--attention_tile=8', f'--rope={rope}']
  world = make_world(engine, np.random.default_rng(FLAGS.seed), model_args, signed=FLAGS.signed,
                     block_kind=FLAGS.block_kind)
  others = other_engines(loaded, engine)
  scratch_root = None
  if FLAGS.store:
    scratch = local_directory(FLAGS.store)
    if not scratch:
      raise app.UsageError('--store must be a file:// URL of a directory (processes share it)')
    os.makedirs(scratch, exist_ok=True)
  else:
    scratch = scratch_root = tempfile.mkdtemp(prefix='faults.')
  try:
    kinds = campaign(world, FLAGS.kinds, FLAGS.trials, FLAGS.process_trials, FLAGS.seed, others,
                     scratch)
  finally:
    if scratch_root:
      shutil.rmtree(scratch_root, ignore_errors=True)
  summary = {field: sum(k[field] for k in kinds.values())
             for field in ('trials', 'exact', 'untouched', 'refused', 'silent_wrong', 'crashed',
                           'lost')}
  config = {'model': FLAGS.model, 'weights': FLAGS.weights, 'dtype': FLAGS.dtype,
            'rows_per_call': FLAGS.rows_per_call, 'cache_len': FLAGS.cache_len,
            'trials_per_kind': FLAGS.trials, 'process_trials_per_kind': FLAGS.process_trials,
            'seed': FLAGS.seed, 'kinds': list(FLAGS.kinds), 'signed': FLAGS.signed,
            'block_kind': FLAGS.block_kind, 'rope': rope,
            'contexts': [len(c) for c in world.contexts],
            'engine_fingerprint': engine.fingerprint}
  output = common.output_path('faults', FLAGS.model, FLAGS.dtype,
                              'document' if FLAGS.block_kind == 'document' else '',
                              'signed' if FLAGS.signed else '')
  common.write_result(output, 'faults', {'config': config, 'kinds': kinds, 'summary': summary})
  for kind, t in kinds.items():
    print(f"{kind:20s} {t['trials']:5d} trials  exact {t['exact']:5d}  untouched "
          f"{t['untouched']:5d}  refused {t['refused']:5d}  silent-wrong {t['silent_wrong']}  "
          f"crashed {t['crashed']}  lost {t['lost']}")
  print(json.dumps(summary))
  if summary['silent_wrong'] or summary['crashed'] or summary['lost']:
    sys.exit(1)


if __name__ == '__main__':
  define_flags()
  common.run(main)
