"""Flags and helpers shared by the experiment entry points.

Convention: every entry point defines its flags in a `define_flags()` called only under
`if __name__ == '__main__'`, so every module imports as a library (the main job and the tests
import several). Model flags (--model, --weights, --dtype) and engine flags (--engine,
--attention, --block_size, --cache_len, --mesh, --layout) come from here.

Results are written by `write_result`: the JSON gets its schema tag (analysis/results.py), the
code state it was made from (`provenance`) and is written atomically (gemma_jax.files). An
entry point whose --output is not given writes results/<kind>_<config parts>.json
(`default_output`).
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import subprocess
import sys
import time

from absl import flags, logging

from analysis import results as results_schema
from gemma_jax import files, sharding, weights
from gemma_jax.attention import IMPLEMENTATIONS
from graft.engine import MODES, Engine, EngineConfig

FLAGS = flags.FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Global-layer KV slots for the graft experiments: the longest sample (a 2,070-token library
# plus a 128-token query, experiments/samples.py) rounded up to a whole number of 512-slot
# Pallas tiles and 16-row blocks.
GRAFT_CACHE_LEN = 2560

# Paths whose changes do not change what the code computes: a run that rewrote results is
# still a run of the committed code.
_OUTPUT_PATHS = ('results/', 'manifests/', 'figures/')


def define_model_flags(model: str = 'gemma3_270m', weights_spec: str = 'embedded') -> None:
  flags.DEFINE_string('model', model, 'Model config name (gemma_jax.config).')
  flags.DEFINE_string('weights', weights_spec,
                      "'embedded', 'random:SEED', or a checkpoint path (GGUF file, Orbax "
                      'directory, safetensors).')
  flags.DEFINE_enum('dtype', 'float32', sorted(weights.DTYPES), 'Parameter/activation dtype.')


def define_engine_flags(engine_default: str = 'pinned', cache_len: int = 4096) -> None:
  flags.DEFINE_enum('engine', engine_default, MODES,
                    'pinned: fixed reduction orders, byte-exact; blocked: the first pinned '
                    'design (fixed-shape blocks); default: the plain fast path.')
  flags.DEFINE_enum('attention', None, list(IMPLEMENTATIONS),
                    "Attention implementation (default: the engine mode's, tiled for pinned).")
  flags.DEFINE_integer('block_size', None,
                       'pinned: the most token rows per transformer call (default 256); '
                       'blocked: the rows of every call (default 16).')
  flags.DEFINE_integer('cache_len', cache_len, 'KV slots: the most tokens a context holds.')
  flags.DEFINE_string('mesh', '', "Devices to run on: '' (one), or a mesh such as model:4 or "
                      'model:2,data:2 (on a CPU host the device count is set from it).')
  flags.DEFINE_enum('layout', 'gather', list(sharding.LAYOUTS),
                    'Mesh layout: gather (no contraction split) or split (Megatron).')


def engine_flag_args() -> list[str]:
  """The engine flags as given, for a subprocess that must build the same engine."""
  args = [f'--engine={FLAGS.engine}', f'--cache_len={FLAGS.cache_len}']
  if FLAGS.attention is not None:
    args.append(f'--attention={FLAGS.attention}')
  if FLAGS.block_size is not None:
    args.append(f'--block_size={FLAGS.block_size}')
  if FLAGS.mesh:
    args += [f'--mesh={FLAGS.mesh}', f'--layout={FLAGS.layout}']
  return args


def load_model() -> weights.LoadedModel:
  """The --model / --weights / --dtype model. With --mesh (engine tools), first asks XLA for
  the mesh's host device count, which must happen before jax starts its backend."""
  if 'mesh' in FLAGS and FLAGS.mesh:
    sharding.set_host_devices(sharding.parse_mesh(FLAGS.mesh))
  logging.info('loading %s with weights=%s dtype=%s', FLAGS.model, FLAGS.weights, FLAGS.dtype)
  return weights.load(FLAGS.model, FLAGS.weights, FLAGS.dtype)


def engine_config(**overrides) -> EngineConfig:
  """The EngineConfig the engine flags describe (with `overrides`)."""
  values = dict(mode=FLAGS.engine, attention=FLAGS.attention, block_size=FLAGS.block_size,
                cache_len=FLAGS.cache_len, mesh=FLAGS.mesh, layout=FLAGS.layout,
                xla_flags=os.environ.get('XLA_FLAGS', ''))
  values.update(overrides)
  return EngineConfig(**values)


def make_engine(loaded: weights.LoadedModel, **overrides) -> Engine:
  return Engine(loaded, engine_config(**overrides))


def model_config_json() -> dict:
  return {'model': FLAGS.model, 'weights': FLAGS.weights, 'dtype': FLAGS.dtype}


@functools.lru_cache(maxsize=None)
def provenance() -> dict:
  """The code a result was made from, read once when this module is imported (the process
  runs the code as it was then): `git_commit` is the commit only when the tracked and
  untracked source files equal it; otherwise it is None, `git_base_commit` names the commit
  the changes sit on and `git_modified_files` lists them (a dirty tree is never recorded as a
  commit). Changes under results/, manifests/ and figures/ do not count."""
  def git(*args):
    try:
      return subprocess.run(['git', *args], capture_output=True, text=True, timeout=30,
                            cwd=REPO).stdout
    except (OSError, subprocess.SubprocessError):
      return ''
  head = git('rev-parse', 'HEAD').strip() or None
  status = git('status', '--porcelain', '--untracked-files=all')
  modified = sorted(line[3:] for line in status.splitlines()
                    if line and not line[3:].startswith(_OUTPUT_PATHS))
  return {'git_commit': None if modified else head, 'git_base_commit': head,
          'git_modified_files': modified,
          'command': ' '.join(['python -m', _entry_point()] + sys.argv[1:])}


def _entry_point() -> str:
  main = sys.modules.get('__main__')
  spec = getattr(main, '__spec__', None)
  return spec.name if spec and spec.name else os.path.basename(sys.argv[0])


provenance()  # snapshot the code state as the process starts


def default_output(kind: str, *parts) -> str:
  """results/<kind>_<part>_<part>....json, leaving out empty parts."""
  name = '_'.join([kind] + [str(p) for p in parts if p not in (None, '')])
  return os.path.join('results', name + '.json')


def write_result(path: str, kind: str, result: dict) -> dict:
  """Writes a result of `kind` atomically, with its schema tag and its provenance in
  result['config']; returns what was written."""
  tagged = {'schema': results_schema.tag(kind), **result}
  tagged['config'] = {**result.get('config', {}), **provenance()}
  files.write_json(path, tagged)
  logging.info('wrote %s', path)
  return tagged


def median_seconds(fn, repeats: int) -> float:
  """Median wall time of `repeats` calls of fn, after one untimed warm-up (compilation)."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)


def jsonl_records(path: str) -> list[tuple[int, dict]]:
  """(line number, object) of every non-empty line of a JSONL file; a line that is not a JSON
  object, an unreadable or empty file raise ValueError naming the file and line."""
  try:
    with open(path) as f:
      lines = f.readlines()
  except OSError as e:
    raise ValueError(f'{path}: cannot be read ({e})') from None
  records = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}:{number}: not valid JSON ({e})') from None
    if not isinstance(record, dict):
      raise ValueError(f'{path}:{number}: expected a JSON object')
    records.append((number, record))
  if not records:
    raise ValueError(f'{path} holds no records')
  return records


def read_jsonl(path: str, fields: tuple[str, ...]) -> list[dict]:
  """Records of a JSONL file, each required to hold non-empty strings under `fields`."""
  out = []
  for number, record in jsonl_records(path):
    if not all(isinstance(record.get(k), str) and record[k] for k in fields):
      names = ', '.join(f'"{k}"' for k in fields)
      raise ValueError(f'{path}:{number}: expected an object with non-empty string fields '
                       f'{names}')
    out.append(record)
  return out
