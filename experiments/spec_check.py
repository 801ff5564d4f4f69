"""The spec engine against the NumPy interpreter of the written arithmetic, bit for bit.

  python -m experiments.spec_check --model=tiny_gemma3 --weights=random:0 --tokens=300
  python -m experiments.spec_check --tokens=640 --splits=512   # the embedded 270M
  python -m experiments.spec_check --model=tiny_gemma4 --weights=random:0 --rope=relative

Computes --tokens tokens with the spec engine (one-shot, and cut at --splits) and with the
interpreter (graft/engine/spec_check.py), and writes {"config", "summary": {"tokens", "kv_equal",
"logits_equal", "first_difference"}}; exits with status 1 when anything differs. A run that
passes on two machines has shown that their bits are equal. Tokens: the start of the project's
corpus text for a trained model, seeded random ids for random weights.
"""

from __future__ import annotations

import dataclasses
import sys

from absl import app, flags, logging

from experiments import common, samples
from graft.engine import spec_check

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_integer('tokens', 64, 'Tokens computed, one-shot and in pieces.', lower_bound=2)
  common.define_list('splits', None, 'Where the split run cuts the tokens, each below --tokens '
                     "(unset: a third, two thirds and the model's sliding window, where they lie "
                     'inside).', lower_bound=1)
  flags.DEFINE_integer('seed', 0, 'Seed of the token ids for random weights.', lower_bound=0)
  common.define_output_flag()
  common.define_model_flags()
  common.define_rope_flag()
  common.define_engine_flags(cache_len=0)


OWN_DEFAULTS = {'cache_len': 'sized for --tokens (at least 4,096 slots)',
                'tokens': 'past a tiny model\'s window in seconds'}


def default_splits(count: int, window: int) -> list[int]:
  return sorted(s for s in {count // 3, 2 * count // 3, window} if 0 < s < count)


def main(argv):
  del argv
  if FLAGS.engine != 'spec':
    raise app.UsageError(f'--engine={FLAGS.engine}: spec_check checks the spec engine against '
                         'its interpreter; only --engine=spec has one')
  if FLAGS.splits and max(FLAGS.splits) >= FLAGS.tokens:
    raise app.UsageError(f'--splits={",".join(map(str, FLAGS.splits))}: every cut must lie '
                         f'inside --tokens={FLAGS.tokens}')
  if FLAGS.cache_len and FLAGS.cache_len < FLAGS.tokens:
    raise app.UsageError(f'--cache_len={FLAGS.cache_len} holds fewer than --tokens='
                         f'{FLAGS.tokens}')
  loaded = common.load_model()
  engine = common.make_engine(loaded, needed_cache=max(4096, FLAGS.tokens))
  tokens = samples.tokens_for(loaded, FLAGS.tokens, FLAGS.seed)
  splits = (sorted(set(FLAGS.splits)) if FLAGS.splits
            else default_splits(len(tokens), loaded.config.sliding_window))
  result = spec_check.run(engine, tokens, splits, progress=logging.info)
  config = {**common.model_config_json(), 'tokens': FLAGS.tokens, 'splits': splits,
            'seed': FLAGS.seed, 'engine_config': dataclasses.asdict(engine.engine_config),
            'engine_fingerprint': engine.fingerprint}
  output = common.output_path(
      'spec_check', FLAGS.model, FLAGS.dtype, *([FLAGS.rope] if FLAGS.rope != 'float' else []))
  common.write_result(output, 'spec_check', {'config': config, **result})
  summary = result['summary']
  print(f"{summary['tokens']} tokens: KV equal {summary['kv_equal']}, logits equal "
        f"{summary['logits_equal']}, first difference {summary['first_difference']}")
  if not (summary['kv_equal'] and summary['logits_equal']):
    sys.exit(1)


if __name__ == '__main__':
  define_flags()
  common.run(main)
