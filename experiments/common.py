"""Flags and helpers shared by the experiment entry points.

Every experiment takes the model flags (--model, --weights, --dtype) and, where it runs an
engine, the engine flags (--engine, --attention, --block_size, --cache_len). Results are written
as JSON with the full config, atomically (a temporary file renamed into place).
"""

from __future__ import annotations

import json
import os
import tempfile

from absl import flags, logging

from gemma_jax import weights
from graft.engine import ATTENTIONS, ENGINES, Engine, PinnedConfig

FLAGS = flags.FLAGS


def define_model_flags() -> None:
  flags.DEFINE_string('model', 'gemma3_270m', 'Model config name (gemma_jax.config).')
  flags.DEFINE_string('weights', 'embedded',
                      "'embedded', 'random:SEED', or a checkpoint path (GGUF file, Orbax "
                      'directory, safetensors).')
  flags.DEFINE_enum('dtype', 'float32', sorted(weights.DTYPES), 'Parameter/activation dtype.')


def define_engine_flags(engine_default: str = 'pinned', cache_len: int = 4096) -> None:
  flags.DEFINE_enum('engine', engine_default, ENGINES,
                    'pinned: fixed-shape byte-exact engine; default: the plain fast path.')
  flags.DEFINE_enum('attention', 'xla', ATTENTIONS, 'Attention implementation.')
  flags.DEFINE_integer('block_size', PinnedConfig.block_size,
                       'Token rows per transformer call (pinned engine).')
  flags.DEFINE_integer('cache_len', cache_len, 'KV slots: the most tokens a context holds.')


def load_model() -> weights.LoadedModel:
  logging.info('loading %s with weights=%s dtype=%s', FLAGS.model, FLAGS.weights, FLAGS.dtype)
  return weights.load(FLAGS.model, FLAGS.weights, FLAGS.dtype)


def pinned_config(**overrides) -> PinnedConfig:
  values = dict(engine=FLAGS.engine, attention=FLAGS.attention, block_size=FLAGS.block_size,
                cache_len=FLAGS.cache_len, xla_flags=os.environ.get('XLA_FLAGS', ''))
  values.update(overrides)
  return PinnedConfig(**values)


def make_engine(loaded: weights.LoadedModel, **overrides) -> Engine:
  return Engine(loaded, pinned_config(**overrides))


def model_config_json() -> dict:
  return {'model': FLAGS.model, 'weights': FLAGS.weights, 'dtype': FLAGS.dtype}


def write_json(path: str, value) -> None:
  """Writes JSON atomically: readers see the old file or the new one, never half of one."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  fd, staging = tempfile.mkstemp(prefix='.' + os.path.basename(path), dir=directory)
  try:
    with os.fdopen(fd, 'w') as f:
      json.dump(value, f, indent=1)
      f.write('\n')
    os.replace(staging, path)
  except BaseException:
    os.unlink(staging)
    raise
  logging.info('wrote %s', path)
