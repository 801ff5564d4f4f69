"""Flags and helpers shared by the experiment entry points.

Every experiment takes the model flags (--model, --weights, --dtype) and, where it runs an
engine, the engine flags (--engine, --attention, --block_size, --cache_len). Results are written
as JSON with the full config, atomically (a temporary file renamed into place).
"""

from __future__ import annotations

import json
import os
import statistics
import time
import uuid

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


def staging_path(path: str, suffix: str = '') -> str:
  """A fresh hidden name next to `path`, to write to and then rename into place (created with
  the umask's permissions, unlike mkstemp's owner-only files)."""
  directory, name = os.path.split(os.path.abspath(path))
  return os.path.join(directory, f'.{name}.{uuid.uuid4().hex}{suffix}')


def write_json(path: str, value) -> None:
  """Writes JSON atomically: readers see the old file or the new one, never half of one."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  staging = staging_path(path)
  try:
    with open(staging, 'x') as f:
      json.dump(value, f, indent=1)
      f.write('\n')
    os.replace(staging, path)
  except BaseException:
    if os.path.exists(staging):
      os.unlink(staging)
    raise
  logging.info('wrote %s', path)


def median_seconds(fn, repeats: int) -> float:
  """Median wall time of `repeats` calls of fn, after one untimed warm-up (compilation)."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def read_jsonl(path: str, fields: tuple[str, ...]) -> list[dict]:
  """Records of a JSONL file, each required to hold non-empty strings under `fields`; errors
  name the file and line."""
  records = []
  with open(path) as f:
    for number, line in enumerate(f, 1):
      if not line.strip():
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError as e:
        raise ValueError(f'{path}:{number}: not valid JSON ({e})') from None
      if not isinstance(record, dict) or not all(
          isinstance(record.get(k), str) and record[k] for k in fields):
        names = ', '.join(f'"{k}"' for k in fields)
        raise ValueError(f'{path}:{number}: expected an object with non-empty string fields '
                         f'{names}')
      records.append(record)
  if not records:
    raise ValueError(f'{path} holds no records')
  return records
