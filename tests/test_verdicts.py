"""Passed checks kept across processes (gemma_jax/verdicts.py): a change of anything that decides a
verdict (the code, the native build and its compiler, the CPU, jax, the devices, the threads, the
XLA flags, a steering variable) runs the check again, GEMMA_JAX_RECHECK runs it regardless, a
failure is never kept, and the suite keeps verdicts of its own (tests/conftest.py)."""

import os
import pathlib
import platform
import shutil
import stat
import subprocess
import sys
import tempfile
import types

import jax
import jaxlib
import pytest

from gemma_jax import host, sharding, verdicts
from gemma_jax.files import cache_root
from gemma_jax.kernels import native_build
from gemma_jax.spec import selfcheck

REPO = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv('GEMMA_JAX_CACHE', str(tmp_path / 'cache'))
  monkeypatch.setenv(verdicts.DIRECTORY_ENV, str(tmp_path / 'cache' / 'verdicts'))
  monkeypatch.delenv(verdicts.RECHECK_ENV, raising=False)
  return tmp_path / 'cache' / 'verdicts'


def test_a_pass_is_kept_for_the_same_process_configuration_only(cache, monkeypatch):
  assert not verdicts.passed('probe', 'k')
  verdicts.record('probe', 'k')
  assert verdicts.passed('probe', 'k') and len(list(cache.iterdir())) == 1
  assert not verdicts.passed('probe', 'another key')
  assert not verdicts.passed('another check', 'k')
  monkeypatch.setenv(verdicts.RECHECK_ENV, '1')
  assert not verdicts.passed('probe', 'k')


def _pin_build_key(monkeypatch):
  """The native build key as it is now, kept while another field changes (a field that also
  enters the build key, such as the architecture or the compiler, is then tested alone)."""
  key = native_build.build_key()
  monkeypatch.setattr(native_build, 'build_key', lambda: key)


def _cpu(**changed):
  return lambda monkeypatch: monkeypatch.setattr(
      host, 'cpuinfo', lambda original=host.cpuinfo(): {**original, **changed})


def _compiler_upgraded(monkeypatch):
  _pin_build_key(monkeypatch)
  monkeypatch.setattr(native_build, 'compiler_identity',
                      lambda cxx=None: 'g++ (Upgraded) 99.1.0\n')


def _machine(monkeypatch):
  _pin_build_key(monkeypatch)
  monkeypatch.setattr(platform, 'machine', lambda: 'riscv64')


def _xla_flags_env(monkeypatch):
  monkeypatch.setattr(sharding, 'xla_flags', lambda original=sharding.xla_flags(): original)
  monkeypatch.setenv('XLA_FLAGS', '--xla_cpu_max_isa=AVX2')


# Each field of verdicts.process() -> a change of what it reads (only that field changes).
CHANGES = {
    'code': lambda mp: mp.setattr(verdicts, 'code_digest', lambda: '0' * 64),
    'native_build': lambda mp: mp.setattr(native_build, 'build_key', lambda: 'f' * 64),
    'compiler': _compiler_upgraded,
    'jax': lambda mp: mp.setattr(jax, '__version__', '9.9.9'),
    'jaxlib': lambda mp: _pin_build_key(mp) or mp.setattr(jaxlib, '__version__', '9.9.9'),
    'backend': lambda mp: mp.setattr(jax, 'default_backend', lambda: 'gpu'),
    'device_kind': lambda mp: mp.setattr(
        jax, 'devices', lambda *a: [types.SimpleNamespace(device_kind='TPU v9')]),
    'devices': lambda mp: mp.setattr(jax, 'device_count',
                                     lambda *a, count=jax.device_count: count() + 3),
    'machine': _machine,
    'cpu vendor': _cpu(vendor_id='OtherVendor'),
    'cpu model': _cpu(model='250'),
    'cpu stepping': _cpu(stepping='9'),
    'cpu microcode': _cpu(microcode='0xdeadbeef'),
    'cpu flags': _cpu(flags='fpu sse2'),
    'intra_op_threads': lambda mp: mp.setattr(
        host, 'intra_op_threads', lambda count=host.intra_op_threads: count() + 5),
    'xla_flags': lambda mp: mp.setattr(sharding, 'xla_flags',
                                       lambda: '--xla_cpu_multi_thread_eigen=false'),
    'env XLA_FLAGS': _xla_flags_env,
    'env GEMMA_JAX_NATIVE_ISA': lambda mp: mp.setenv('GEMMA_JAX_NATIVE_ISA', 'portable'),
    'env GEMMA_JAX_SELFCHECK_EMULATED': lambda mp: mp.setenv('GEMMA_JAX_SELFCHECK_EMULATED',
                                                             '1'),
}


@pytest.mark.parametrize('field', CHANGES)
def test_a_change_of_what_decides_a_verdict_runs_the_check_again(cache, monkeypatch, field):
  monkeypatch.delenv('GEMMA_JAX_NATIVE_ISA', raising=False)
  monkeypatch.delenv('GEMMA_JAX_SELFCHECK_EMULATED', raising=False)
  runs = []

  def check():
    monkeypatch.setattr(selfcheck, '_RESULTS', {})  # a new process: nothing kept in memory
    return selfcheck._cached(('a probe',), lambda: runs.append(field) or [])

  before = verdicts.process()
  assert check() == [] and check() == [] and len(runs) == 1  # run once, then kept
  CHANGES[field](monkeypatch)
  changed = {k for k, v in verdicts.process().items() if before[k] != v}
  assert changed == {field.split()[0]}, changed  # the change moves the field it names
  assert check() == [] and len(runs) == 2, f'a change of {field} was answered by the old verdict'


def test_a_compiler_upgrade_changes_the_build_key_and_the_verdicts(cache, tmp_path, monkeypatch):
  """The compiler's --version runs once per compiler install (a process whose library is built
  runs no compiler); a new install is a new build key and a new verdict key."""
  compiler, log = tmp_path / 'bin' / 'g++', tmp_path / 'runs.log'
  compiler.parent.mkdir()

  def install(version, mtime_ns):
    compiler.write_text(f'#!/bin/sh\necho run >> {log}\necho "g++ (Fake) {version}"\n')
    compiler.chmod(compiler.stat().st_mode | stat.S_IXUSR)
    os.utime(compiler, ns=(mtime_ns, mtime_ns))

  install('12.2.0', 10 ** 18)
  monkeypatch.setenv('CXX', str(compiler))
  key = native_build.build_key()
  verdicts.record('probe', 'k')
  assert native_build.build_key() == key and verdicts.passed('probe', 'k')
  assert native_build.compiler_identity() == 'g++ (Fake) 12.2.0\n'
  assert log.read_text().count('run') == 1  # asked once, then read from the cache
  install('13.1.0', 10 ** 18 + 1)  # an upgrade in place: another binary, of the same size
  assert native_build.build_key() != key and not verdicts.passed('probe', 'k')
  assert log.read_text().count('run') == 2


def test_an_edit_of_the_code_is_never_served_an_old_verdict(cache, tmp_path, monkeypatch):
  tree = tmp_path / 'tree'
  for top in verdicts._CODE:
    source = verdicts._ROOT + '/' + top
    (shutil.copy if top.endswith('.py') else shutil.copytree)(
        source, tree / top, **({} if top.endswith('.py') else
                               {'ignore': shutil.ignore_patterns('__pycache__')}))
  monkeypatch.setattr(verdicts, '_ROOT', str(tree))
  verdicts.code_digest.cache_clear()
  try:
    verdicts.record('probe', 'k')
    assert verdicts.passed('probe', 'k')
    functions = tree / 'gemma_jax' / 'spec' / 'functions.py'
    functions.write_text(functions.read_text().replace('EXP_LO, EXP_HI = -87.0, 88.0',
                                                       'EXP_LO, EXP_HI = -87.0, 88.5'))
    verdicts.code_digest.cache_clear()
    assert not verdicts.passed('probe', 'k')
  finally:
    verdicts.code_digest.cache_clear()


def test_a_failure_is_never_kept(cache, monkeypatch):
  monkeypatch.setattr(selfcheck, '_RESULTS', {})
  assert selfcheck._cached(('a probe',), lambda: ['exp: 3% differ']) == ['exp: 3% differ']
  assert not cache.exists() or not list(cache.iterdir())
  monkeypatch.setattr(selfcheck, '_RESULTS', {})
  assert selfcheck._cached(('a probe',), lambda: []) == []
  monkeypatch.setattr(selfcheck, '_RESULTS', {})
  # The kept pass answers without running the probe again.
  assert selfcheck._cached(('a probe',), lambda: pytest.fail('ran again')) == []


def test_the_suite_keeps_verdicts_of_its_own(tmp_path, monkeypatch):
  """tests/conftest.py: this session's verdicts are kept in a folder of its own, which the
  subprocesses its tests start use too, so a pass another process recorded in the shared cache
  answers no check here."""
  folder = os.environ.get(verdicts.DIRECTORY_ENV)
  assert folder and os.path.isdir(folder), 'the suite sets no verdict folder of its own'
  assert os.path.basename(folder).startswith('gemma-jax-verdicts-')
  assert os.path.dirname(folder) == tempfile.gettempdir()
  assert verdicts.directory() == folder
  shared = os.path.join(cache_root(), '')
  assert not os.path.join(folder, '').startswith(shared)
  child = subprocess.run([sys.executable, '-c', 'from gemma_jax import verdicts\n'
                          'print(verdicts.directory())'], cwd=REPO, capture_output=True,
                         env={**os.environ, 'PYTHONPATH': str(REPO)}, text=True, timeout=120)
  assert child.stdout.strip() == folder, child.stderr[-2000:]
  # A pass recorded in a cache's own folder (as any process outside the suite keeps them) ...
  monkeypatch.delenv(verdicts.RECHECK_ENV, raising=False)
  monkeypatch.setenv('GEMMA_JAX_CACHE', str(tmp_path))
  monkeypatch.delenv(verdicts.DIRECTORY_ENV)
  verdicts.record('probe', 'stale')
  assert verdicts.passed('probe', 'stale')
  # ... answers nothing in the suite.
  monkeypatch.setenv(verdicts.DIRECTORY_ENV, folder)
  assert not verdicts.passed('probe', 'stale')
