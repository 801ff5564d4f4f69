"""What a process has cost so far: its peak resident memory, the XLA executables it compiled and
those it loaded, and its wall time. Every result records it (`snapshot()`, the top-level
`resources` object that experiments.common.write_result adds).

Executables are counted from JAX's own monitoring events, registered when gemma_jax is
imported: every executable a jitted function obtains fires '/jax/core/compile/
backend_compile_duration' (named by the function), the ones JAX's persistent compilation cache
served also '/jax/compilation_cache/cache_hits', and the ones loaded from saved executables
(gemma_jax.executables) fire its LOADED_EVENT. So executables_compiled = obtained - served
from the cache, executables_loaded = served from the cache + loaded from saved ones. One-op
eager dispatches (an eager `jnp.copy`, a slice: JAX compiles each primitive it runs outside a
jit once per shape) are left out of both and counted apart (`eager_ops_obtained`); the
persistent cache's hits among them cannot be told apart from a function's, so a cache hit is
counted against the functions' first (eager ops are cheap, and what a function was served is
what a warm process loads).
"""

from __future__ import annotations

import collections
import os
import resource
import sys
import threading
import time

from jax import monitoring

_COMPILE = '/jax/core/compile/backend_compile_duration'
_CACHE_HIT = '/jax/compilation_cache/cache_hits'
_LOADED = '/gemma_jax/executables/loaded'  # gemma_jax.executables.LOADED_EVENT

_lock = threading.Lock()
_counts: collections.Counter = collections.Counter()
_by_name: collections.Counter = collections.Counter()
_IMPORTED = time.time()


def _primitive_names() -> frozenset[str]:
  """Every JAX primitive's name: jax.extend's list and the primitives JAX's own modules define
  beside it (e.g. lax's `stage`, which an eager device transfer runs)."""
  # deferred to the first compile: jax.extend imports Pallas (0.03 s), which a warm start skips
  import jax.extend.core.primitives as primitives
  from jax.extend.core import Primitive
  # Copies, not views: another thread may import while this reads (sys.modules' documentation:
  # iterating it can raise when its size changes; dict.copy() does not).
  modules = [primitives] + [m for name, m in sys.modules.copy().items()
                            if name.startswith('jax.') and m is not None]
  return frozenset(p.name for m in modules for p in vars(m).copy().values()
                   if isinstance(p, Primitive))


_PRIMITIVES: frozenset[str] | None = None


def _on_duration(event: str, duration_secs: float, **kwargs: str | int) -> None:
  del duration_secs
  if event != _COMPILE:
    return
  global _PRIMITIVES
  if _PRIMITIVES is None:
    _PRIMITIVES = _primitive_names()
  name = str(kwargs.get('fun_name', ''))
  bare = name[4:-1] if name.startswith('jit(') and name.endswith(')') else name
  with _lock:
    _counts['eager' if bare in _PRIMITIVES else 'obtained'] += 1
    _by_name[bare] += 1


def _on_event(event: str, **kwargs: str | int) -> None:
  del kwargs
  if event in (_CACHE_HIT, _LOADED):
    with _lock:
      _counts[event] += 1


monitoring.register_event_duration_secs_listener(_on_duration)
monitoring.register_event_listener(_on_event)


def _process_start() -> float:
  """When this process started (Linux: /proc), else when gemma_jax was imported."""
  try:
    with open('/proc/self/stat') as f:
      ticks = int(f.read().rsplit(')', 1)[1].split()[19])
    with open('/proc/uptime') as f:
      uptime = float(f.read().split()[0])
    return time.time() - uptime + ticks / os.sysconf('SC_CLK_TCK')
  except (OSError, ValueError, IndexError):
    return _IMPORTED


def peak_rss_bytes() -> int:
  """The process's peak resident memory (ru_maxrss, which Linux gives in kB)."""
  return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def snapshot() -> dict:
  """{'peak_rss_bytes', 'executables_compiled', 'executables_loaded', 'eager_ops_obtained',
  'executables_by_function', 'wall_s'} of this process so far."""
  with _lock:
    hits = _counts[_CACHE_HIT]
    obtained = _counts['obtained']
    served = min(hits, obtained)
    return {'peak_rss_bytes': peak_rss_bytes(),
            'executables_compiled': obtained - served,
            'executables_loaded': served + _counts[_LOADED],
            'eager_ops_obtained': _counts['eager'],
            'executables_by_function': {n: c for n, c in sorted(_by_name.items())
                                        if n not in (_PRIMITIVES or ())},
            'wall_s': round(time.time() - _process_start(), 3)}
