"""Executables saved ahead of time: a jitted function compiled once per argument shape, its
executable serialized under $GEMMA_JAX_CACHE/executables and loaded by later processes.

    step = executables.Saved('step', jax.jit(fn), key={...}, fixed=2)
    out = step(params, table, tokens, positions, kv)   # compiled, or loaded, once per shape

JAX's persistent compilation cache (gemma_jax/compilation_cache.py) still makes a process trace
and lower every function before it can look an executable up: seconds of Python for a model's
step. A saved executable is found by a key computed without tracing, and loaded with XLA's own
executable serialization (jax.experimental.serialize_executable). The key is a SHA-256 of:
  - everything that decides the process's code generation and the traced program
    (gemma_jax.verdicts.process(): the bytes of every source file of gemma_jax and graft/engine,
    the native kernels' sources among them, the native library's build key where it has one,
    jax and jaxlib, the backend, device kind and count, the CPU's model and feature flags, the
    XLA flags, the thread count);
  - the caller's `key` (what the function closes over: an engine's config, model, numerics);
  - the function's name and every argument's shape, dtype and sharding, and their structure.
An edited file, another compiler, CPU or flag is another key, so an old executable is never
served to new code (tests/test_executables.py). Entries are written atomically (a reader sees
a whole file or none); one that cannot be read or loaded is compiled again and replaced.
Loading runs no compiler, so a saved executable is trusted like the native library: it is code
from this user's cache (docs/security.md).

Each executable obtained is reported as a JAX monitoring event: '/jax/core/compile/...'
events for what JAX compiles (and its persistent cache hits), LOADED_EVENT for what is loaded
here, so that `gemma_jax.resources` counts both from events.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import pickle
import threading
import uuid
from typing import Any

import jax
from jax import monitoring
from jax.experimental import serialize_executable

from gemma_jax import files, verdicts
from gemma_jax.files import cache_root

# '0': never save or load (compile in every process); a directory: keep them there (bench's
# cold starts use an empty one); unset or '1': $GEMMA_JAX_CACHE/executables.
ENV = 'GEMMA_JAX_SAVED_EXECUTABLES'
LOADED_EVENT = '/gemma_jax/executables/loaded'


def directory() -> str:
  """Where saved executables live: $GEMMA_JAX_SAVED_EXECUTABLES where it names a folder, else
  $GEMMA_JAX_CACHE/executables."""
  value = os.environ.get(ENV, '1')
  return value if value not in ('', '0', '1') else os.path.join(cache_root(), 'executables')


def enabled() -> bool:
  """Whether executables are saved and loaded ($GEMMA_JAX_SAVED_EXECUTABLES is not '0')."""
  return os.environ.get(ENV, '1') != '0'


def _abstract(args) -> str:
  """Every argument leaf's shape and dtype, and the arguments' structure (concrete arrays and
  their jax.ShapeDtypeStruct give the same; a saved function runs on one device, whose count is
  in the process key)."""
  leaves, treedef = jax.tree.flatten(args)
  return repr((str(treedef), [(tuple(getattr(x, 'shape', ())), str(getattr(x, 'dtype', type(x))))
                              for x in leaves]))


def _shapes(args) -> tuple:
  return tuple((tuple(getattr(x, 'shape', ())), str(getattr(x, 'dtype', type(x))))
               for x in jax.tree.leaves(args))


# Loads saved executables in the background (`Saved.preload`): XLA deserializes them in C++,
# two at a time on two cores.
_LOADER = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix='load-executable')


# Per thread: how many executables JAX's persistent compilation cache served it (its hits event
# fires in the compiling thread).
_served = threading.local()


def _on_event(event: str, **kwargs) -> None:
  del kwargs
  if event == '/jax/compilation_cache/cache_hits':
    _served.hits = getattr(_served, 'hits', 0) + 1


monitoring.register_event_listener(_on_event)


def _compile(jitted, args):
  """jitted compiled for args, as a fresh compile: where JAX's persistent compilation cache
  served it, compiled again with an option that moves nothing but the cache key (an executable
  that cache loads cannot be serialized again: XLA:CPU's deserialized executable does not keep
  the compiled functions a second serialization needs, and loading that fails with 'Function
  ... not found')."""
  lowered = jitted.lower(*args)
  before = getattr(_served, 'hits', 0)
  compiled = lowered.compile()
  if getattr(_served, 'hits', 0) != before:
    compiled = lowered.compile(compiler_options={
        'xla_cpu_collective_call_warn_stuck_seconds': 1 + uuid.uuid4().int % (1 << 30)})
  return compiled


class Saved:
  """`jitted` (a jax.jit function) compiled once per argument shape, the executable saved and
  loaded across processes. key: JSON-able, what the function closes over that decides its
  trace. fixed: the leading arguments whose shapes never change between calls (an engine's
  weights), left out of the per-call shape lookup."""

  def __init__(self, name: str, jitted: Any, key: Any, fixed: int = 0):
    self.name, self.jitted, self.fixed = name, jitted, fixed
    self._key = json.dumps(key, sort_keys=True, default=repr)
    self._compiled: dict = {}
    self._loading: dict = {}  # shapes -> a future of the saved executable (None: not saved)

  def lower(self, *args: Any) -> Any:
    """The jitted function's lowering (graft/engine/lowering.py reads it for other platforms)."""
    return self.jitted.lower(*args)

  def preload(self, *args: Any, compile: bool = False) -> None:
    """Starts loading the executable saved for arguments of these shapes (concrete, or
    jax.ShapeDtypeStruct), if one is, in the background: a process loads what it will run
    while it does other work; a call of these shapes waits for it instead of compiling. With
    `compile`, one that is not saved is compiled (and saved) there too."""
    shapes = _shapes(args[self.fixed:])
    if enabled() and shapes not in self._compiled and shapes not in self._loading:
      self._loading[shapes] = _LOADER.submit(self._obtain if compile else self._load, args)

  def __call__(self, *args: Any) -> Any:
    shapes = _shapes(args[self.fixed:])
    compiled = self._compiled.get(shapes)
    if compiled is None:
      loading = self._loading.pop(shapes, None)
      compiled = (loading.result() if loading is not None else None) or self._obtain(args)
      self._compiled[shapes] = compiled
    return compiled(*args)

  def _load(self, args):
    """The saved executable for these arguments, or None where none is (or it cannot load)."""
    try:
      with open(self._path(args), 'rb') as f:
        serialized, in_tree, out_tree = pickle.load(f)
      # (onto the one device a saved function runs on, this process's first: it may have more,
      # and other processes theirs)
      compiled = serialize_executable.deserialize_and_load(
          serialized, in_tree, out_tree, execution_devices=jax.local_devices()[:1])
    except Exception:  # none saved, or a damaged or foreign entry: compiled again and replaced
      return None
    monitoring.record_event(LOADED_EVENT, name=self.name)
    return compiled

  def _path(self, args) -> str:
    process = json.dumps(verdicts.process(), sort_keys=True, default=repr)
    digest = hashlib.sha256('\0'.join((process, self._key, self.name, _abstract(args)))
                            .encode()).hexdigest()
    return os.path.join(directory(), f'{self.name}-{digest}.bin')

  def _obtain(self, args):
    """The executable for these arguments' shapes: loaded where saved, else compiled (and
    saved)."""
    if not enabled():
      return self.jitted.lower(*args).compile()
    compiled = self._load(args)
    if compiled is not None:
      return compiled
    path = self._path(args)
    compiled = _compile(self.jitted, args)
    try:
      data = pickle.dumps(serialize_executable.serialize(compiled))
    except (ValueError, NotImplementedError, TypeError, pickle.PicklingError):
      return compiled  # not serializable (a Python callback, e.g. on a mesh): compiled only
    try:
      files.write_bytes(path, data)
    except OSError:  # a cache that cannot be written only costs the next process a compile
      pass
    return compiled
