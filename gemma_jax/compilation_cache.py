"""JAX's persistent compilation cache under $GEMMA_JAX_CACHE/xla, turned on by whoever compiles.

Compiled executables are kept on disk and loaded by later processes, so a fresh process reaches
its first logits in seconds instead of compiling some forty executables
(tests/test_compilation_cache.py checks that an executable loaded from the cache gives the bits of
a fresh compile). Importing gemma_jax changes no JAX setting: the entry points
(experiments.common.run), an `Engine` when it is built and the test suite call `use_default()`.
Set GEMMA_JAX_COMPILATION_CACHE=0, or pass --nocompilation_cache to an entry point, to compile
everything afresh; set it to a directory to keep the executables there (experiments.bench starts
processes on an empty one to time a cold start).
"""

from __future__ import annotations

import os

import jax
from jax.experimental import compilation_cache as cc

from gemma_jax.files import cache_root

ENV = 'GEMMA_JAX_COMPILATION_CACHE'

# Whether this process has chosen (enable or disable): a later `use_default` keeps the choice.
_chosen = False


def directory() -> str:
  """Where the cache lives by default: $GEMMA_JAX_CACHE/xla."""
  return os.path.join(cache_root(), 'xla')


def enable(path: str | None = None) -> None:
  """Caches every compilation (however short) under `path` (default: `directory()`)."""
  global _chosen
  _chosen = True
  jax.config.update('jax_compilation_cache_dir', path or directory())
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0)
  jax.config.update('jax_persistent_cache_min_entry_size_bytes', 0)


def disable() -> None:
  """Turns the persistent cache off for the rest of the process."""
  global _chosen
  _chosen = True
  jax.config.update('jax_compilation_cache_dir', None)
  cc.compilation_cache.reset_cache()


def use_default() -> None:
  """What an entry point or an engine does before it compiles: unless the process has chosen
  already (`enable`, `disable`), enable() unless $GEMMA_JAX_COMPILATION_CACHE is 0, under its
  value when that is a directory."""
  if _chosen:
    return
  value = os.environ.get(ENV, '1')
  if value != '0':
    enable(None if value == '1' else value)
