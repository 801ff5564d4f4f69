"""Flags and helpers shared by the experiment entry points: the one runner, the shared flags,
where a run writes, and the result writer.

Convention: every entry point defines its flags in a `define_flags()` called only under
`if __name__ == '__main__'`, so every module imports as a library (the main job and the tests
import several), and runs `common.run(main)`:

- One meaning per flag name (`MEANINGS`: a name that two tools define means one thing, and
  its help text starts with that meaning). Model flags (--model, --weights, --dtype), --rope,
  engine flags (--engine, --attention, --rows_per_call, --cache_len, --mesh, --mesh_layout,
  --dot_library, ...), store flags and the runner's own (--verbose, --overwrite,
  --compilation_cache) come from here. A tool that sweeps a value takes the same flag repeated
  (`--mesh=model:2 --mesh=model:4`). A default that differs from the group's is declared, with
  its reason, in the tool's `OWN_DEFAULTS`.
- Old spellings that committed results and manifests record are read through `OLD_SPELLINGS`,
  each with the version that retires it, and only there.
- A run writes its one result to --output, or without it to a git-ignored run folder,
  runs/<tool>/<time>_<name>.json (`output_path`); a committed file is replaced only when named
  and only with --overwrite where the new content differs (gemma_jax.files.check_replace).
- Results are written by `write_result`: the JSON gets its schema tag (analysis/results.py), the
  code state it was made from (`provenance`), a command that names every flag deciding its bits
  (`recorded_command`), and is written atomically (gemma_jax.files).
"""

from __future__ import annotations

import contextlib
import datetime
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
from experiments.cli import (MEANINGS, NOT_BITS, OLD_SPELLINGS, CheckedList,  # noqa: F401
                             OldSpelling, define_list, modernize)
from gemma_jax import compilation_cache, files, resources, rope, sharding, weights
from gemma_jax.config import TransformerConfig, get_config
from gemma_jax.attention import IMPLEMENTATIONS
from graft.engine import PLANS, Engine, EngineConfig, fingerprint, resolve_engine_config
from graft.engine.plans import DOT_LIBRARIES
from gemma_jax.spec.interpreter import ROPE_MODES as SPEC_ROPE_MODES

FLAGS = flags.FLAGS

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Global-layer KV slots for the graft experiments: the longest sample (a 2,070-token library
# plus a 128-token query, experiments/samples.py) rounded up to a whole number of 512-slot
# Pallas tiles and 16-row blocks.
GRAFT_CACHE_LEN = 2560

# Paths whose changes do not change what the code computes: a run that rewrote results is
# still a run of the committed code.
_OUTPUT_PATHS = ('results/', 'manifests/', 'figures/', 'runs/')


def define_runner_flags() -> None:
  """The flags every entry point takes from the runner."""
  flags.DEFINE_bool('verbose', False, 'Show the traceback of an expected failure.')
  flags.DEFINE_bool('overwrite', False, 'Replace a committed file (tracked by git: results/, '
                    'manifests/, figures/) named by --output or --output_dir where this run\'s '
                    'content differs; without it such a run is refused.')
  flags.DEFINE_bool('compilation_cache', True, 'Load and keep compiled executables under '
                    '$GEMMA_JAX_CACHE/xla (gemma_jax/compilation_cache.py).')


def tool_name() -> str:
  """The entry point this process runs, as `python -m` names it."""
  main = sys.modules.get('__main__')
  spec = getattr(main, '__spec__', None)
  name = spec.name if spec and spec.name else os.path.basename(sys.argv[0])
  return name[:-len('.__main__')] if name.endswith('.__main__') else name


def run(main) -> None:
  """absl's app.run for an entry point, with the project's conventions: old flag spellings are
  read (`OLD_SPELLINGS`); an expected failure (bad input, a refused artifact or store, a
  committed file the run would replace, a machine that does not compute the spec or cannot
  build its kernels: ValueError and its kinds, a missing file, a usage error) prints one line
  `error: ...` and exits with status 2, as does a flag's impossible value (each numeric flag
  declares its bounds); --verbose shows the traceback instead. A traceback without --verbose is
  a bug."""
  if 'verbose' not in FLAGS:
    define_runner_flags()

  def one_line(e: BaseException) -> None:
    message = ' '.join(str(e).split()) or type(e).__name__
    print(f'error: {message}', file=sys.stderr)
    sys.exit(2)

  def guarded(argv):
    if FLAGS.compilation_cache:
      compilation_cache.use_default()
    else:
      compilation_cache.disable()
    try:
      return main(argv)
    except (ValueError, FileNotFoundError, app.UsageError, flags.Error) as e:
      if FLAGS.verbose:
        raise
      one_line(e)

  def parse(argv):  # a flag's bad value (a bound, an enum, a required flag) is a usage error
    argv, notes = modernize(tool_name(), argv)
    _GIVEN_ARGV[:] = argv[1:]
    for note in notes:
      print(f'note: {note}', file=sys.stderr)
    try:
      return FLAGS(argv)
    except flags.Error as e:
      one_line(e)

  app.run(guarded, flags_parser=parse)


def define_model_flags(model: str = 'gemma3_270m', weights_spec: str = 'embedded') -> None:
  provenance()  # the code state as the entry point starts
  flags.DEFINE_string('model', model, 'Model config name (gemma_jax.config).')
  flags.DEFINE_string('weights', weights_spec,
                      "'embedded', 'random:SEED', or a checkpoint path (GGUF file, Orbax "
                      'directory, safetensors).')
  flags.DEFINE_enum('dtype', 'float32', sorted(weights.DTYPES), 'Activation dtype, and the '
                    'parameters\'.')


def define_rope_flag() -> None:
  """--rope: the model's RoPE mode (gemma_jax.rope.MODES), applied by `load_model`."""
  flags.DEFINE_enum('rope', 'float', list(rope.MODES),
                    "RoPE mode (gemma_jax.rope.MODES): 'float' as trained; 'relative' the same "
                    'model scored from relative offsets (unrotated keys); controls \'none\' '
                    "(NoPE) and 'quarter_turn' (angles multiple of pi/2: rotations compose "
                    'exactly).')


def define_engine_flags(cache_len: int = 4096) -> None:
  """The engine flags. Every tool's engine defaults to spec; `cache_len` is the tool's default
  (0: sized by the tool for what it runs), declared in its OWN_DEFAULTS where not 4096."""
  flags.DEFINE_enum('engine', EngineConfig.mode, list(PLANS),
                    'The engine mode (graft.engine.plans): spec: the written arithmetic, '
                    'byte-exact on every machine whose self-check passes; pinned: fixed '
                    'reduction orders, byte-exact on one CPU model; blocked: the first pinned '
                    'design (fixed-shape blocks); `default`: XLA\'s plain fast path.')
  flags.DEFINE_enum('attention', None, list(IMPLEMENTATIONS),
                    "Attention implementation (unset: the engine mode's, tiled for spec and "
                    'pinned, xla for blocked and default).')
  flags.DEFINE_integer('rows_per_call', None,
                       'The most token rows per transformer call (spec, pinned; unset: 256), or '
                       'the rows of every call (blocked; unset: 16). Decides a spec engine\'s '
                       'bits (it sizes a local layer\'s ring).', lower_bound=1)
  flags.DEFINE_integer('cache_len', cache_len, 'KV slots: the most tokens a context holds'
                       + (' (0: as many as the run needs).' if cache_len == 0 else
                          '; raised to --rows_per_call where smaller.'),
                       lower_bound=0 if cache_len == 0 else 1)
  flags.DEFINE_integer('attention_tile', None, 'KV tile of the tiled or Pallas attention '
                       '(unset: the implementation\'s, 256 for tiled).', lower_bound=1)
  flags.DEFINE_string('mesh', '', "Devices to run on: '' (one), or a mesh of axis:size pairs "
                      'such as model:4 or model:2,data:2 (on a CPU host the device count is '
                      'set from it).')
  flags.DEFINE_enum('mesh_layout', 'gather', list(sharding.LAYOUTS),
                    'Mesh layout: gather (no contraction split) or split (Megatron).')
  flags.DEFINE_string('coordinator', None, 'host:port of the jax.distributed coordination '
                      'service (process 0 runs it): this process joins a run of several, and '
                      '--mesh spans every process\'s devices.')
  flags.DEFINE_integer('num_processes', 1, 'Processes of a jax.distributed run (--coordinator).',
                       lower_bound=1)
  flags.DEFINE_integer('process_id', 0, 'This process\'s index in a jax.distributed run.',
                       lower_bound=0)
  flags.DEFINE_enum('dot_library', None, list(DOT_LIBRARIES), DOT_LIBRARY_HELP)


DOT_LIBRARY_HELP = ("What computes the spec engine's dots: native (its own CPU kernels), eigen, "
                    'or pallas (the spec dot kernel, for accelerators; interpret mode on CPU); '
                    'for pinned and blocked also ynn (XLA\'s default). Decides no bit of a spec '
                    'engine. Unset: the engine\'s (spec: native where a C++ compiler is found, '
                    'else eigen; the others: eigen).')


def define_output_flag(what: str = 'Results JSON') -> None:
  """--output: the one result file a run writes; unset, a new file in the run folder."""
  flags.DEFINE_string('output', None, f'The one result file this run writes ({what}; unset: a '
                      'new file under runs/<tool>/, git-ignored). A committed file is replaced '
                      'only with --overwrite.')


def define_store_flags() -> None:
  """Flags of every tool that reads or writes a store: signing, trust, the tenant's salt."""
  flags.DEFINE_string('namespace_salt', '', 'A tenant\'s secret: stores written with another '
                      'salt are another namespace (unset: none).')
  flags.DEFINE_string('signing_key', None, 'Sign what this process writes to a store with this '
                      'Ed25519 key (python -m experiments.store keygen --signing_key=KEY writes '
                      'one).')
  flags.DEFINE_list('trusted_keys', None, 'Graft only store blocks signed by one of these public '
                    'keys (KEY.pub files); without it every verified block is trusted.')
  flags.register_validator('trusted_keys', lambda keys: keys is None or all(keys),
                           message='--trusted_keys: an empty key file name')


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
  if 'mesh' in FLAGS and isinstance(FLAGS.mesh, str) and FLAGS.mesh:  # (a sweep sets its own)
    sharding.set_host_devices(sharding.parse_mesh(FLAGS.mesh), processes)
  if processes > 1 or ('coordinator' in FLAGS and FLAGS.coordinator):
    sharding.initialize_distributed(FLAGS.coordinator, FLAGS.num_processes, FLAGS.process_id)
  check_rope_engine()
  config = model_config()
  logging.info('loading %s with weights=%s dtype=%s rope=%s', FLAGS.model, FLAGS.weights,
               FLAGS.dtype, config.rope_mode)
  return weights.load(config, FLAGS.weights, FLAGS.dtype)


def check_rope_engine() -> None:
  """A usage error naming both flags where --engine cannot compute --rope (the spec's written
  arithmetic covers RoPE modes float and relative; the controls run on pinned)."""
  mode = FLAGS.rope if 'rope' in FLAGS else 'float'
  if 'engine' in FLAGS and FLAGS.engine == 'spec' and mode not in SPEC_ROPE_MODES:
    raise app.UsageError(f'--rope={mode}: the spec engine (--engine=spec) computes RoPE modes '
                         f'{", ".join(SPEC_ROPE_MODES)} only; run it with --engine=pinned')


def engine_config(needed_cache: int | None = None, *, model: TransformerConfig | None = None,
                  **overrides: object) -> EngineConfig:
  """The EngineConfig the engine flags describe (with `overrides`), sized for the run and
  resolved for `model` (None: the --model in its --rope mode) by
  graft.engine.resolve_engine_config, the one place a default is decided, so a result records
  what it ran and its command names it:

  - cache_len: `overrides`' or --cache_len, or where that is 0 (sized by the tool)
    `needed_cache`; raised to the rows per call where smaller;
  - rows per call and the dot library: resolved (the mode's defaults); where --cache_len was
    given smaller than the default rows and --rows_per_call was not, the rows are that cache
    (fit='rows'): an engine is sized for what it was asked, never refused for it."""
  values = dict(mode=FLAGS.engine, attention=FLAGS.attention, rows_per_call=FLAGS.rows_per_call,
                attention_tile=FLAGS.attention_tile,
                cache_len=FLAGS.cache_len, mesh=FLAGS.mesh, mesh_layout=FLAGS.mesh_layout,
                dot_library=FLAGS.dot_library)
  values.update(overrides)
  if not values['cache_len']:
    if needed_cache is None:
      raise ValueError('--cache_len=0 (sized for the run) needs a tool that sizes its cache')
    values['cache_len'] = needed_cache
  if values['rows_per_call'] is not None:
    values['cache_len'] = max(values['cache_len'], values['rows_per_call'])
  asked = FLAGS['cache_len'].present and FLAGS.cache_len > 0  # the user's own small cache
  config = resolve_engine_config(model or model_config(), EngineConfig(**values),
                                 fit='rows' if asked else 'cache')
  _RESOLVED.update(engine=config.mode, rows_per_call=config.rows_per_call,
                   cache_len=config.cache_len, mesh=config.mesh, mesh_layout=config.mesh_layout)
  for name in ('attention', 'attention_tile'):
    if getattr(config, name) is not None:
      _RESOLVED[name] = getattr(config, name)
  if config.mode != 'spec':  # a spec engine's bits do not depend on its dot library
    _RESOLVED['dot_library'] = config.dot_library
  return config


# Engine flag values as the last engine built resolved them (what `recorded_command` names).
_RESOLVED: dict[str, object] = {}


def make_engine(loaded: weights.LoadedModel, needed_cache: int | None = None,
                **overrides: object) -> Engine:
  """An Engine of `engine_config(needed_cache, **overrides)` for `loaded`'s model."""
  return Engine(loaded, engine_config(needed_cache, model=loaded.config, **overrides))


def model_config_json() -> dict:
  return {'model': FLAGS.model, 'weights': FLAGS.weights, 'dtype': FLAGS.dtype,
          'rope': FLAGS.rope if 'rope' in FLAGS else 'float'}


@functools.lru_cache(maxsize=None)
def provenance() -> dict:
  """The code a result was made from, read once (when an entry point defines its flags, or at
  the first result written): `git_commit` is the commit only when the tracked and
  untracked source files equal it; otherwise it is None, `git_base_commit` names the commit
  the changes sit on and `git_modified_files` lists them (a dirty tree is never recorded as a
  commit). Changes under results/, manifests/, figures/ and runs/ do not count."""
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
          'git_modified_files': modified, 'made_on': fingerprint.host()}


def recorded_command() -> str:
  """The command that remakes this run's bits after any default moves: the command as given
  (old spellings read as today's), then every other flag of the tool that may decide them (all
  but `NOT_BITS`) with its value; an engine flag as the engine resolved it, and flags left
  unset left out."""
  def spelled(flag, value) -> list[str]:
    if isinstance(value, bool):
      return [f'--{flag.name}' if value else f'--no{flag.name}']
    if isinstance(flag, flags.MultiFlag):
      return [f'--{flag.name}={v}' for v in value]
    if isinstance(value, (list, tuple)):
      return [f'--{flag.name}={",".join(str(v) for v in value)}']
    return [f'--{flag.name}={value}']

  given = _GIVEN_ARGV or sys.argv[1:]
  parts, named = ['python -m', tool_name()], set()
  for arg in given:
    name = arg[2:].split('=', 1)[0] if arg.startswith('--') else None
    if name and name.startswith('no') and name[2:] in FLAGS and name not in FLAGS:
      name = name[2:]
    if name in FLAGS and name in _RESOLVED and name not in named:
      parts += spelled(FLAGS[name], _RESOLVED[name])
    elif name not in named or name is None or isinstance(FLAGS[name], flags.MultiFlag):
      if name not in NOT_BITS:
        parts.append(arg)
    if name:
      named.add(name)
  for module, defined in FLAGS.flags_by_module_dict().items():
    if not _project_module(module):  # absl's, or a library's (orbax defines some on import)
      continue
    for flag in defined:
      if flag.name in named or flag.name in NOT_BITS or flag.name.startswith('help'):
        continue
      named.add(flag.name)
      value = _RESOLVED.get(flag.name, flag.value)
      if value is not None:
        parts += spelled(flag, value)
  return ' '.join(parts)


# The packages whose flags a recorded command names; a tool run as a script names its flags by
# its path.
_PROJECT_PACKAGES = ('experiments', 'gemma_jax', 'graft', 'analysis', 'tests')


def _project_module(module: str) -> bool:
  return module.split('.')[0] in _PROJECT_PACKAGES or module.endswith('.py')


_GIVEN_ARGV: list[str] = []  # the arguments as given, old spellings read as today's (`run`)


RUNS = 'runs'  # run folders: git-ignored (.gitignore)


def run_path(name: str, suffix: str = '.json') -> str:
  """runs/<tool>/<UTC time>_<name><suffix>: where a run writes what no flag names."""
  stamp = datetime.datetime.now(datetime.timezone.utc).strftime('%Y%m%d-%H%M%S')
  tool = tool_name().rpartition('.')[2] or 'run'
  return os.path.join(RUNS, tool, f'{stamp}_{name}{suffix}')


def output_path(kind: str, *parts, suffix: str = '.json') -> str:
  """--output where given, else a new file in the run folder named after the result:
  runs/<tool>/<time>_<kind>_<part>_....json, leaving out empty parts. A committed file is
  reached only when --output names it (`write_result` then guards it)."""
  if 'output' in FLAGS and FLAGS.output:
    return FLAGS.output
  return run_path('_'.join([kind] + [str(p) for p in parts if p not in (None, '')]), suffix)


def write_checked(path: str, data: bytes) -> None:
  """Writes `data` to `path` atomically, refusing (files.CommittedFileError, a one-line error)
  to replace a committed file with other bytes unless --overwrite."""
  overwrite = 'overwrite' in FLAGS and FLAGS.overwrite
  files.check_replace(path, data, overwrite=overwrite)
  files.write_bytes(path, data)


def write_json(path: str, value) -> None:
  """JSON (files.to_json's layout) at `path`, through `write_checked`."""
  write_checked(path, (files.to_json(value) + '\n').encode())


def write_result(path: str, kind: str, result: dict) -> dict:
  """Writes a result of `kind` atomically, with its schema tag, its provenance and the command
  that remakes it in result['config'] and what the process cost; returns what was written. A
  committed file whose content would change is left as it is unless --overwrite: the result
  then goes to the run folder and the run ends with a one-line error naming both."""
  tagged = {'schema': results_schema.tag(kind), **result}
  argv = ' '.join(['python -m', tool_name()] + sys.argv[1:])
  tagged['config'] = {**result.get('config', {}), **provenance(),
                      'command': recorded_command(), 'argv': argv}
  tagged['resources'] = resources.snapshot()  # what this process cost, up to this write
  try:
    write_json(path, tagged)
  except files.CommittedFileError as e:
    kept = run_path(os.path.splitext(os.path.basename(path))[0])
    files.write_json(kept, tagged)
    raise files.CommittedFileError(f'{e} (this run\'s result is in {kept})') from None
  print(f'wrote {path}', flush=True)
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
