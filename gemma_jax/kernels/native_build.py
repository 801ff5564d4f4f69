"""Builds the native contraction kernels (gemma_jax/kernels/csrc) on first use, cached.

    path = native_build.library()             # compiled once per content key, then reused

Why on first use and not at `pip install`: the kernels need only a C++17 compiler and the XLA
FFI headers that jaxlib ships, so compiling them where they run keeps `pip install -e .` a pure
Python install (no build isolation that downloads jaxlib again, nothing to rebuild after an
editable change of a .py file), and a machine without a compiler still installs and runs the
Eigen path. The library is cached under $GEMMA_JAX_CACHE/native/<key>, the key a SHA-256 of
everything that goes into it: the sources, the compiler's identity (its --version), the flags,
the jaxlib version and the machine architecture. A changed source or compiler is a new key, so
a stale library is never loaded. The compiler's --version is run once per compiler install and
kept under $GEMMA_JAX_CACHE/native/compilers, named by the compiler's path, size and
modification time (`compiler_identity`), so a process whose library is built runs no compiler.
Concurrent first uses (test workers) each compile into a staging folder and the first rename
wins; a staging folder left by a killed build, or a key's folder without its library, is
rebuilt over.

One object per instruction-set path (isa.cc, with its flags), all linked into one library; the
kernel picks a path per call from the CPU (ffi.cc). Every object is compiled with
-ffp-contract=off and without fast-math: the only fused operations are the FMAs in the source.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile

import jax
import jaxlib

from gemma_jax import files
from gemma_jax.files import cache_root
from gemma_jax.spec import functions as fn

SOURCE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), 'csrc')
SOURCES = ('chains.h', 'attention.h', 'isa.cc', 'ffi.cc')
LIBRARY = 'libgemma_spec.so'
COMMON_FLAGS = ('-O3', '-std=c++17', '-fPIC', '-ffp-contract=off', '-fno-fast-math',
                '-Wall')
# The kernels' instruction-set paths, listed here once: the index is the `isa` code of every
# kernel call ('auto': the best this CPU has), as ffi.cc's enum Isa and kIsaNames number them
# and isa.cc compiles them (tests/test_architecture.py checks the C++ against this).
ISAS = ('auto', 'portable', 'avx2', 'avx512', 'neon')
# path name (of ISAS) -> its compiler flags, per machine architecture.
PATHS: dict[str, dict[str, tuple[str, ...]]] = {
    'x86_64': {'portable': (), 'avx2': ('-mavx2', '-mfma'), 'avx512': ('-mavx512f', '-mfma')},
    'aarch64': {'portable': (), 'neon': ()},
}


class BuildError(ValueError):
  """The native kernels cannot be built here; the message names what is missing (a ValueError:
  an entry point says it in one line, experiments/common.py)."""


def compiler() -> str:
  """The C++ compiler: $CXX, else g++, else c++ (BuildError where none is found)."""
  for name in filter(None, (os.environ.get('CXX'), 'g++', 'c++', 'clang++')):
    found = shutil.which(name)
    if found:
      return found
  raise BuildError('the native spec kernels need a C++17 compiler: none found ($CXX, g++, c++, '
                   'clang++); install g++ or use --dot_library=eigen')


def _architecture() -> str:
  machine = platform.machine().lower()
  arch = {'amd64': 'x86_64', 'arm64': 'aarch64'}.get(machine, machine)
  if arch not in PATHS:
    raise BuildError(f'the native spec kernels have no paths for a {machine} CPU '
                     f'(known: {", ".join(PATHS)}); use --dot_library=eigen')
  return arch


def _include_dir() -> str:
  return jax.ffi.include_dir()


def compiler_identity(cxx: str | None = None) -> str:
  """The compiler's `--version` output (`cxx`, default `compiler()`), run once per compiler
  install: kept in a file named by the compiler's path as found, its real path, size and
  modification time, so an upgrade (a new binary) runs it again."""
  cxx = cxx or compiler()
  real = os.path.realpath(cxx)
  stat = os.stat(real)
  name = hashlib.sha256(repr((cxx, real, stat.st_size, stat.st_mtime_ns)).encode()).hexdigest()
  path = os.path.join(cache_root(), 'native', 'compilers', name[:32])
  try:
    with open(path) as f:
      return f.read()
  except OSError:
    pass
  done = subprocess.run([cxx, '--version'], capture_output=True, text=True)
  if done.returncode or not done.stdout:
    raise BuildError(f'{cxx} --version failed (exit {done.returncode}): the native spec kernels '
                     'need a working C++17 compiler; use --dot_library=eigen')
  try:
    files.write_text(path, done.stdout)
  except OSError:  # a cache that cannot be written only costs the next process the run
    pass
  return done.stdout


def constants_header() -> str:
  """constants.h: the written arithmetic's constants the kernels use (exp's, tanh's, sin's and
  cos's), generated from gemma_jax/spec/functions.py, their one home. Each is written as the
  exact decimal of the binary64 that Python holds; the kernels round it to binary32 as NumPy
  does (attention.h `C`)."""
  values: dict[str, float | tuple[float, ...]] = {'kExpLo': fn.EXP_LO, 'kExpHi': fn.EXP_HI, 'kLog2e': fn.LOG2E, 'kLn2Hi': fn.LN2_HI,
            'kLn2Lo': fn.LN2_LO, 'kExpP': fn.EXP_P, 'kTanhSmall': fn.TANH_SMALL,
            'kTanhP': fn.TANH_P, 'kTwoOverPi': fn.TWO_OVER_PI, 'kPio2Parts': fn.PIO2_PARTS,
            'kSinP': fn.SIN_P, 'kCosP': fn.COS_P}
  lines = ['// Generated from gemma_jax/spec/functions.py by gemma_jax/kernels/native_build.py.',
           '#ifndef GEMMA_SPEC_CONSTANTS_H_', '#define GEMMA_SPEC_CONSTANTS_H_',
           'namespace gemma_spec {']
  for name, value in values.items():
    if isinstance(value, tuple):
      lines.append(f'constexpr double {name}[] = {{{", ".join(repr(float(v)) for v in value)}}};')
    else:
      lines.append(f'constexpr double {name} = {float(value)!r};')
  lines += ['}  // namespace gemma_spec', '#endif  // GEMMA_SPEC_CONSTANTS_H_', '']
  return '\n'.join(lines)


def build_key() -> str:
  """The SHA-256 of everything the library is made of (see the module doc)."""
  cxx = compiler()
  h = hashlib.sha256()
  for name in SOURCES:
    with open(os.path.join(SOURCE_DIR, name), 'rb') as f:
      h.update(name.encode() + b'\0' + f.read() + b'\0')
  h.update(b'constants.h\0' + constants_header().encode() + b'\0')
  version = compiler_identity(cxx)
  arch = _architecture()
  h.update(repr((version, COMMON_FLAGS, PATHS[arch], jaxlib.__version__, arch)).encode())
  return h.hexdigest()


def _run(command: list[str]) -> None:
  done = subprocess.run(command, capture_output=True, text=True)
  if done.returncode:
    last = (done.stderr.strip().splitlines() or ['(no output)'])[-1]
    raise BuildError(f'compiling the native spec kernels failed ({os.path.basename(command[0])}'
                     f' exit {done.returncode}): {last}')


def _compile(directory: str) -> None:
  cxx, include, arch = compiler(), _include_dir(), _architecture()
  with open(os.path.join(directory, 'constants.h'), 'w') as f:
    f.write(constants_header())
  common = [*COMMON_FLAGS, '-isystem', include, f'-I{SOURCE_DIR}', f'-I{directory}']
  objects = []
  for name, flags in PATHS[arch].items():
    obj = os.path.join(directory, f'isa_{name}.o')
    _run([cxx, *common, *flags, f'-DGEMMA_SPEC_ISA_{name}=1', '-c',
          os.path.join(SOURCE_DIR, 'isa.cc'), '-o', obj])
    objects.append(obj)
  obj = os.path.join(directory, 'ffi.o')
  _run([cxx, *common, '-c', os.path.join(SOURCE_DIR, 'ffi.cc'), '-o', obj])
  _run([cxx, '-shared', '-o', os.path.join(directory, LIBRARY), obj, *objects, '-lpthread'])


@functools.lru_cache(maxsize=1)
def library() -> str:
  """The path of the compiled library, building it on first use (BuildError, naming what is
  missing, where it cannot be built)."""
  key = build_key()
  target = os.path.join(cache_root(), 'native', key[:32])
  path = os.path.join(target, LIBRARY)
  if os.path.exists(path):
    return path
  os.makedirs(os.path.dirname(target), exist_ok=True)
  staging = tempfile.mkdtemp(prefix='.build-', dir=os.path.dirname(target))
  try:
    _compile(staging)
    for _ in range(2):
      try:
        os.rename(staging, target)
        break
      except OSError:
        if os.path.exists(path):  # another process's finished build
          break
        # The key's folder without its library (a build interrupted, a file removed): moved
        # aside, then replaced.
        stale = tempfile.mkdtemp(prefix='.stale-', dir=os.path.dirname(target))
        try:
          os.rename(target, os.path.join(stale, 'old'))
        except FileNotFoundError:
          pass
        shutil.rmtree(stale, ignore_errors=True)
    else:
      raise BuildError(f'the native spec kernels could not be put in place at {target}')
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return path
