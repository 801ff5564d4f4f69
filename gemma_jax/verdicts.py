"""Passed checks kept across processes, for the exact process configuration they checked.

The spec engine's self-check and canary (gemma_jax.spec.selfcheck, graft.engine.canary) take seconds
of every process's start, and their verdict is a function of what they ran on: the code, the native
kernel library (its build key) and the compiler that builds it, the CPU and its flags, jax and
jaxlib, the XLA flags, the device and thread counts, and the environment variables that steer the
kernels. A pass is recorded under $GEMMA_JAX_CACHE/verdicts/<SHA-256 of all of that and the check's
own key> ($GEMMA_JAX_VERDICTS instead where set: the test suite keeps its own, tests/conftest.py),
and a later process whose every one of them is the same skips the check. A failure is never recorded
(it is run again, and refuses again). Any edit of a file of gemma_jax, graft/engine or the kernels'
C++ changes the key, so an edit is never vouched for by an old verdict; GEMMA_JAX_RECHECK=1 runs
every check regardless. docs/security.md says what this trusts.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform

import jax
import jaxlib

from gemma_jax import files, host, sharding
from gemma_jax.kernels import native_build
from gemma_jax.digest import canonical_json
from gemma_jax.files import cache_root

RECHECK_ENV = 'GEMMA_JAX_RECHECK'
DIRECTORY_ENV = 'GEMMA_JAX_VERDICTS'  # where verdicts are kept, instead of the cache's
# Environment variables that steer what a check runs (the kernels' instruction set, the
# emulator's flush rule, how XLA's multiplies flush).
_STEERING = ('GEMMA_JAX_NATIVE_ISA', 'GEMMA_JAX_SELFCHECK_EMULATED', 'GEMMA_JAX_SPEC_FLUSH',
             'XLA_FLAGS')
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# What decides a check's verdict in the source tree: every file of these folders.
_CODE = ('gemma_jax', os.path.join('graft', 'engine'))


def directory() -> str:
  """Where verdicts are kept: $GEMMA_JAX_VERDICTS, else $GEMMA_JAX_CACHE/verdicts."""
  return os.environ.get(DIRECTORY_ENV) or os.path.join(cache_root(), 'verdicts')


@functools.lru_cache(maxsize=1)
def code_digest() -> str:
  """SHA-256 of the bytes of every Python and C++ source file that can decide a check."""
  h = hashlib.sha256()
  for top in _CODE:
    path = os.path.join(_ROOT, top)
    found = [path] if os.path.isfile(path) else sorted(
        os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs
        if f.endswith(('.py', '.cc', '.h')))
    for name in sorted(found):
      with open(name, 'rb') as f:
        h.update(os.path.relpath(name, _ROOT).encode() + b'\0' + f.read() + b'\0')
  return h.hexdigest()


def process() -> dict:
  """This process's configuration, as far as a check's verdict can follow it."""
  cpuinfo = host.cpuinfo()
  device = jax.devices()[0]
  return {'code': code_digest(), 'jax': jax.__version__, 'jaxlib': jaxlib.__version__,
          'backend': jax.default_backend(), 'device_kind': device.device_kind,
          'devices': jax.device_count(), 'machine': platform.machine(),
          'cpu': {k: cpuinfo.get(k) for k in ('vendor_id', 'cpu family', 'model', 'stepping',
                                              'microcode', 'flags', 'Features', 'CPU part')},
          'xla_flags': sharding.xla_flags(), 'intra_op_threads': host.intra_op_threads(),
          'env': {k: os.environ.get(k) for k in _STEERING}, **native()}


def native() -> dict:
  """The native kernel library this process builds or loads (its build key: sources, flags,
  compiler version, jaxlib, architecture) and the compiler's identity (its real path and
  --version, run once per compiler install: gemma_jax.kernels.native_build); None for both
  where none can be built."""
  try:
    cxx = native_build.compiler()
    return {'compiler': [os.path.realpath(cxx), native_build.compiler_identity(cxx)],
            'native_build': native_build.build_key()}
  except native_build.BuildError:
    return {'compiler': None, 'native_build': None}


def _path(kind: str, key: str) -> str:
  digest = hashlib.sha256(canonical_json({'kind': kind, 'key': key, 'process': process()})
                          ).hexdigest()
  return os.path.join(directory(), f'{kind}-{digest}.json')


def passed(kind: str, key: str) -> bool:
  """Whether a pass of check `kind` with `key` (a string naming everything the check was given)
  is recorded for this process's configuration."""
  if os.environ.get(RECHECK_ENV, '') not in ('', '0'):
    return False
  return os.path.exists(_path(kind, key))


def record(kind: str, key: str) -> None:
  """Records a pass (best effort: a cache that cannot be written only costs the next process
  the check)."""
  try:
    files.write_json(_path(kind, key), {'kind': kind, 'key': key, 'passed': True})
  except OSError:
    pass
