"""Flags and helpers shared by the experiment entry points.

Convention: every entry point defines its flags in a `define_flags()` called only under
`if __name__ == '__main__'`, so every module imports as a library (the main job and the tests
import several). Model flags (--model, --weights, --dtype) and engine flags (--engine,
--attention, --rows_per_call, --cache_len, --mesh, --mesh_layout; --block_size and --layout
are their older names) come from here. Defining the model flags also snapshots the code state
the process runs (`provenance`), so an entry point records the commit it started from; a
library import runs no git.

Results are written by `write_result`: the JSON gets its schema tag (analysis/results.py), the
code state it was made from (`provenance`) and is written atomically (gemma_jax.files). An
entry point whose --output is not given writes results/<kind>_<config parts>.json
(`default_output`).
"""

from __future__ import annotations

import contextlib
import functools
import os
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable

from absl import app, flags, logging

from analysis import results as results_schema
from gemma_jax import compilation_cache, files, resources, rope, sharding, weights
from gemma_jax.config import TransformerConfig, get_config
from gemma_jax.attention import IMPLEMENTATIONS
from graft.engine import PLANS, Engine, EngineConfig, fingerprint, resolve_engine_config
from graft.engine.plans import DOT_LIBRARIES

FLAGS = flags.FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Global-layer KV slots for the graft experiments: the longest sample (a 2,070-token library
# plus a 128-token query, experiments/samples.py) rounded up to a whole number of 512-slot
# Pallas tiles and 16-row blocks.
GRAFT_CACHE_LEN = 2560

# Paths whose changes do not change what the code computes: a run that rewrote results is
# still a run of the committed code.
_OUTPUT_PATHS = ('results/', 'manifests/', 'figures/')


def run(main) -> None:
  """absl's app.run for an entry point, with the project's error convention: an expected
  failure (bad input, a refused artifact or store, a machine that does not compute the spec or
  cannot build its kernels: ValueError and its kinds, a missing file) prints one line
  `error: ...` and exits with status 2, as does a flag's impossible value (each integer flag
  declares its bounds); --verbose shows the traceback instead. A traceback without --verbose is a
  bug."""
  if 'verbose' not in FLAGS:
    flags.DEFINE_bool('verbose', False, 'Show the traceback of an expected failure.')
  if 'compilation_cache' not in FLAGS:
    flags.DEFINE_bool('compilation_cache', True, 'Load and keep compiled executables under '
                      '$GEMMA_JAX_CACHE/xla (gemma_jax/compilation_cache.py).')

  def guarded(argv):
    if FLAGS.compilation_cache:
      compilation_cache.use_default()
    else:
      compilation_cache.disable()
    try:
      return main(argv)
    except (ValueError, FileNotFoundError) as e:
      if FLAGS.verbose:
        raise
      message = ' '.join(str(e).split()) or type(e).__name__
      print(f'error: {message}', file=sys.stderr)
      sys.exit(2)

  def parse(argv):  # a flag's bad value (a bound, an enum, a required flag) is a usage error
    try:
      return FLAGS(argv)
    except flags.Error as e:
      print(f'error: {" ".join(str(e).split())}', file=sys.stderr)
      sys.exit(2)

  app.run(guarded, flags_parser=parse)


def define_model_flags(model: str = 'gemma3_270m', weights_spec: str = 'embedded') -> None:
  provenance()  # the code state as the entry point starts
  flags.DEFINE_string('model', model, 'Model config name (gemma_jax.config).')
  flags.DEFINE_string('weights', weights_spec,
                      "'embedded', 'random:SEED', or a checkpoint path (GGUF file, Orbax "
                      'directory, safetensors).')
  flags.DEFINE_enum('dtype', 'float32', sorted(weights.DTYPES), 'Parameter/activation dtype.')


def define_rope_flag() -> None:
  """--rope: the model's RoPE mode (gemma_jax.rope.MODES), applied by `load_model`."""
  flags.DEFINE_enum('rope', 'float', list(rope.MODES),
                    "RoPE mode (gemma_jax.rope.MODES): 'float' as trained; 'relative' the same "
                    'model scored from relative offsets (unrotated keys); controls \'none\' '
                    "(NoPE) and 'quarter_turn' (angles multiple of pi/2: rotations compose "
                    'exactly).')


def define_engine_flags(engine_default: str | None = None, cache_len: int = 4096) -> None:
  flags.DEFINE_enum('engine', engine_default or EngineConfig.mode, list(PLANS),
                    'The engine mode (graft.engine.plans): pinned: fixed reduction orders, '
                    'byte-exact; blocked: the first pinned design (fixed-shape blocks); '
                    'default: the plain fast path.')
  flags.DEFINE_enum('attention', None, list(IMPLEMENTATIONS),
                    "Attention implementation (default: the engine mode's, tiled for pinned).")
  flags.DEFINE_integer('rows_per_call', None,
                       'pinned: the most token rows per transformer call (default 256); '
                       'blocked: the rows of every call (default 16).', lower_bound=1)
  flags.DEFINE_alias('block_size', 'rows_per_call')  # the old name: retire in 0.2.0
  flags.DEFINE_integer('cache_len', cache_len, 'KV slots: the most tokens a context holds'
                       + (' (0: as many as the run needs).' if cache_len == 0 else '.'),
                       lower_bound=0 if cache_len == 0 else 1)
  flags.DEFINE_integer('attention_tile', None, 'KV tile of the tiled or Pallas attention '
                       '(default: the implementation\'s, 256 for tiled).', lower_bound=1)
  flags.DEFINE_string('mesh', '', "Devices to run on: '' (one), or a mesh such as model:4 or "
                      'model:2,data:2 (on a CPU host the device count is set from it).')
  flags.DEFINE_enum('mesh_layout', 'gather', list(sharding.LAYOUTS),
                    'Mesh layout: gather (no contraction split) or split (Megatron).')
  flags.DEFINE_alias('layout', 'mesh_layout')  # the old name: retire in 0.2.0
  flags.DEFINE_string('coordinator', None, 'host:port of the jax.distributed coordination '
                      'service (process 0 runs it): this process joins a run of several, and '
                      '--mesh spans every process\'s devices.')
  flags.DEFINE_integer('num_processes', 1, 'Processes of a jax.distributed run (--coordinator).',
                       lower_bound=1)
  flags.DEFINE_integer('process_id', 0, 'This process\'s index in a jax.distributed run.',
                       lower_bound=0)
  flags.DEFINE_enum('dot_library', None, list(DOT_LIBRARIES),
                    "What computes the fixed-order engines' dots: eigen, ynn (XLA's default) or, "
                    "for the spec engine, native (its own CPU kernels) or pallas (the spec dot "
                    "kernel, for accelerators; interpret mode on CPU). Default: the engine's "
                    '(spec: native where a C++ compiler is found, else eigen; the others: eigen).')


def define_store_flags() -> None:
  """Flags of every tool that reads or writes a store: signing, trust, the tenant's salt."""
  flags.DEFINE_string('namespace_salt', '', 'A tenant\'s secret: stores written with another '
                      'salt are another namespace (unset: none).')
  flags.DEFINE_string('signing_key', None, 'Sign what this process writes to a store with this '
                      'Ed25519 key (python -m experiments.store keygen --output=KEY).')
  flags.DEFINE_list('trusted_keys', None, 'Graft only store blocks signed by one of these public '
                    'keys (KEY.pub files); without it every verified block is trusted.')


def store_args(writer: bool = True) -> dict:
  """Store(...) keyword arguments from the store flags (a reader that writes nothing signs
  nothing)."""
  # Only the store's tools call this: the store's modules (0.1 s to import) stay out of every
  # other entry point's start (experiments.bench --start_only).
  from graft.store import signing
  return {'namespace_salt': FLAGS.namespace_salt,
          'signing_key': (signing.load_private(FLAGS.signing_key)
                          if FLAGS.signing_key and writer else None),
          'trusted_keys': (signing.load_trusted(FLAGS.trusted_keys)
                           if FLAGS.trusted_keys is not None else None)}


def store_flag_args() -> list[str]:
  """The store flags as given, for a subprocess that writes the same store."""
  args = [f'--namespace_salt={FLAGS.namespace_salt}'] if FLAGS.namespace_salt else []
  return args + ([f'--signing_key={FLAGS.signing_key}'] if FLAGS.signing_key else [])


def engine_flag_args() -> list[str]:
  """The engine flags as given, for a subprocess that must build the same engine."""
  args = [f'--engine={FLAGS.engine}', f'--cache_len={FLAGS.cache_len}']
  if FLAGS.attention is not None:
    args.append(f'--attention={FLAGS.attention}')
  if FLAGS.rows_per_call is not None:
    args.append(f'--rows_per_call={FLAGS.rows_per_call}')
  if FLAGS.attention_tile is not None:
    args.append(f'--attention_tile={FLAGS.attention_tile}')
  if FLAGS.dot_library is not None:
    args.append(f'--dot_library={FLAGS.dot_library}')
  if FLAGS.mesh:
    args += [f'--mesh={FLAGS.mesh}', f'--mesh_layout={FLAGS.mesh_layout}']
  return args


def model_config() -> TransformerConfig:
  """The --model config, in the --rope mode (where the tool has the flag)."""
  return get_config(FLAGS.model).replace(rope_mode=FLAGS.rope if 'rope' in FLAGS else 'float')


def load_model() -> weights.LoadedModel:
  """The --model / --weights / --dtype model. With --mesh (engine tools), first asks XLA for
  this process's share of the mesh's host devices, and with --coordinator joins the
  jax.distributed run: both before jax starts its backend."""
  processes = FLAGS.num_processes if 'coordinator' in FLAGS and FLAGS.coordinator else 1
  if 'mesh' in FLAGS and FLAGS.mesh:
    sharding.set_host_devices(sharding.parse_mesh(FLAGS.mesh), processes)
  if processes > 1 or ('coordinator' in FLAGS and FLAGS.coordinator):
    sharding.initialize_distributed(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
  config = model_config()
  logging.info('loading %s with weights=%s dtype=%s rope=%s', FLAGS.model, FLAGS.weights,
               FLAGS.dtype, config.rope_mode)
  return weights.load(config, FLAGS.weights, FLAGS.dtype)


def engine_config(model: TransformerConfig | None = None, **overrides) -> EngineConfig:
  """The EngineConfig the engine flags ask for (with `overrides`), resolved for `model` (None:
  the --model in its --rope mode) by graft.engine.resolve_engine_config, so that a result
  records every value the engine ran with (the dot library included)."""
  values = dict(mode=FLAGS.engine, attention=FLAGS.attention, rows_per_call=FLAGS.rows_per_call,
                attention_tile=FLAGS.attention_tile,
                cache_len=FLAGS.cache_len, mesh=FLAGS.mesh, mesh_layout=FLAGS.mesh_layout,
                dot_library=FLAGS.dot_library)
  values.update(overrides)
  return resolve_engine_config(model or model_config(), EngineConfig(**values))


def make_engine(loaded: weights.LoadedModel, **overrides) -> Engine:
  """The engine the flags ask for (with `overrides`) over `loaded`."""
  return Engine(loaded, engine_config(loaded.config, **overrides))


def model_config_json() -> dict:
  return {'model': FLAGS.model, 'weights': FLAGS.weights, 'dtype': FLAGS.dtype,
          'rope': FLAGS.rope if 'rope' in FLAGS else 'float'}


@functools.lru_cache(maxsize=None)
def provenance() -> dict:
  """The code a result was made from, read once (when an entry point defines its flags, or at
  the first result written): `git_commit` is the commit only when the tracked and
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
          'git_modified_files': modified, 'made_on': fingerprint.host(),
          'command': ' '.join(['python -m', _entry_point()] + sys.argv[1:])}


def _entry_point() -> str:
  main = sys.modules.get('__main__')
  spec = getattr(main, '__spec__', None)
  return spec.name if spec and spec.name else os.path.basename(sys.argv[0])


def default_output(kind: str, *parts) -> str:
  """results/<kind>_<part>_<part>....json, leaving out empty parts."""
  name = '_'.join([kind] + [str(p) for p in parts if p not in (None, '')])
  return os.path.join('results', name + '.json')


def write_result(path: str, kind: str, result: dict) -> dict:
  """Writes a result of `kind` atomically, with its schema tag and its provenance in
  result['config']; returns what was written."""
  tagged = {'schema': results_schema.tag(kind), **result}
  tagged['config'] = {**result.get('config', {}), **provenance()}
  tagged['resources'] = resources.snapshot()  # what this process cost, up to this write
  files.write_json(path, tagged)
  logging.info('wrote %s', path)
  return tagged


def run_step(command: list[str], timeout: int = 600, env: dict | None = None) -> dict:
  """Runs one step of a check (a command, from the repository root, with it on PYTHONPATH);
  returns {"command", "status" (exit status, or "timeout"), "seconds", "tail" (the last 4,000
  characters it printed)}. A step that fails is recorded, not raised: the checks run the rest."""
  start = time.perf_counter()
  try:
    proc = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**os.environ, 'PYTHONPATH': REPO, **(env or {})})
    status, out = proc.returncode, proc.stdout + proc.stderr
  except subprocess.TimeoutExpired as e:
    status = 'timeout'
    out = e.stdout.decode(errors='replace') if isinstance(e.stdout, bytes) else str(e.stdout or '')
  return {'command': ' '.join(command), 'status': status, 'seconds': time.perf_counter() - start,
          'tail': out[-4000:]}


@contextlib.contextmanager
def heartbeat(doing: Callable[[], str], every: float = 10.0):
  """While the block runs, prints what it is doing (`doing()`) and the seconds since it began
  every `every` seconds: long work shows progress even where it prints nothing for minutes."""
  stop, start = threading.Event(), time.monotonic()

  def beat():
    while not stop.wait(every):
      print(f'  [{time.monotonic() - start:4.0f} s] {doing()}', flush=True)

  thread = threading.Thread(target=beat, daemon=True)
  thread.start()
  try:
    yield
  finally:
    stop.set()
    thread.join()


def median_seconds(fn, repeats: int) -> float:
  """Median wall time of `repeats` calls of fn, after one untimed warm-up (compilation)."""
  fn()
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  return statistics.median(times)
