"""Prints a prompt and its continuation: greedy, or sampled reproducibly with --temperature/--seed.

  python -m experiments.generate --prompt="The capital of France is" --max_new_tokens=24
"""

from __future__ import annotations

import time

from absl import flags

from experiments import common
from gemma_jax import files
from experiments.texts import continue_text

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('prompt', 'The capital of France is', 'Text to continue (BOS is prepended).')
  flags.DEFINE_integer('max_new_tokens', 24, 'Tokens to generate.', lower_bound=1)
  flags.DEFINE_float('temperature', 0.0, 'Sampling temperature (0: greedy; otherwise softmax '
                     'sampling at this temperature).', lower_bound=0.0)
  flags.DEFINE_integer('seed', 0, 'Seed of the sampler (used when --temperature > 0).',
                       lower_bound=0)
  flags.DEFINE_string('phases', None, 'Also write the wall-clock time (time.time()) at which each '
                      'phase ended, as JSON: imported, loaded, engine, first_logits, done '
                      '(experiments.bench times a fresh process with it).')
  common.define_model_flags()
  common.define_engine_flags()


OWN_DEFAULTS = {'temperature': 'greedy: the same continuation on every run'}


def main(argv):
  del argv
  stamps = {'imported': time.time()}
  loaded = common.load_model()
  stamps['loaded'] = time.time()
  engine = common.make_engine(loaded)
  stamps['engine'] = time.time()
  text = continue_text(engine, FLAGS.prompt, FLAGS.max_new_tokens, FLAGS.temperature, FLAGS.seed,
                       on_first_logits=lambda: stamps.setdefault('first_logits', time.time()))
  stamps['done'] = time.time()
  print(FLAGS.prompt + text)
  if FLAGS.phases:
    files.write_json(FLAGS.phases, stamps)


if __name__ == '__main__':
  define_flags()
  common.run(main)
