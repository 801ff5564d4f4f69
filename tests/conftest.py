"""Suite-wide fixtures and the suite's time report.

XLA:CPU maps memory for every executable it compiles, and the pinned engine compiles one per
(row bucket, attention tiles) it meets, so a whole-suite process accumulates tens of thousands of
mappings; past the kernel's vm.max_map_count (65,530 by default) the next mapping fails and XLA
crashes inside compilation (seen as a segfault in tests/test_graft_exact.py after the modules
before it). Each module's compiled executables are released when it ends; a worker of a parallel
run goes through many modules.

The suite keeps its own verdicts (gemma_jax/verdicts.py): $GEMMA_JAX_VERDICTS names a fresh folder
for the session (shared by its xdist workers and every subprocess a test starts, and removed at
its end), so a check a test expects to run or to refuse is never answered by a pass another
process recorded before the session. The parameter cache, the native library and the compilation
cache stay shared under $GEMMA_JAX_CACHE: they are expensive, and keyed by what they hold.

The report at the end of a run gives each module's test time, how much of it was XLA
compiling in the test's own process (subprocesses count in the time only) and how far it raised
its process's peak resident memory: most of this suite's time on a CPU is compiling, which the
persistent compilation cache (gemma_jax/compilation_cache.py) keeps for the next run, and a worker
that runs out of memory is killed and fails the run.
"""

import collections
import gc
import os
import resource
import shutil
import tempfile

import jax
import pytest
from jax import monitoring

from gemma_jax import compilation_cache, verdicts

_COMPILE = {'seconds': 0.0}
_START = pytest.StashKey[float]()
_VERDICTS = pytest.StashKey[str]()


def _on_duration(event: str, seconds: float, **_) -> None:
  if event == '/jax/core/compile/backend_compile_duration':
    _COMPILE['seconds'] += seconds


monitoring.register_event_duration_secs_listener(_on_duration)


def pytest_configure(config):
  """JAX's persistent compilation cache on in every process of the session (importing
  gemma_jax does not turn it on), and the session's own verdict folder: made by the controlling
  process (an xdist worker inherits its environment, and with it the folder)."""
  compilation_cache.use_default()
  if os.environ.get('PYTEST_XDIST_WORKER'):
    return
  config.stash[_VERDICTS] = os.environ[verdicts.DIRECTORY_ENV] = tempfile.mkdtemp(
      prefix='gemma-jax-verdicts-')


def pytest_unconfigure(config):
  folder = config.stash.get(_VERDICTS, None)
  if folder:
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture(autouse=True, scope='module')
def release_compiled_executables(request):
  """At a module's end: its memoized engines (module-level lru_caches) and JAX's caches are
  dropped, and with them the executables they hold."""
  yield
  for value in vars(request.module).values():
    if callable(getattr(value, 'cache_clear', None)):
      value.cache_clear()
  jax.clear_caches()
  gc.collect()


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
  item.stash[_START] = _COMPILE['seconds']


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_makereport(item, call):
  """Each report carries the seconds compiled in this process since the test's setup began and
  the process's peak resident memory so far."""
  spent = round(_COMPILE['seconds'] - item.stash.get(_START, _COMPILE['seconds']), 2)
  item.user_properties[:] = [p for p in item.user_properties
                             if p[0] not in ('compile_s', 'peak_mb')]
  item.user_properties.append(('compile_s', spent))
  # ru_maxrss is in kB on Linux.
  peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  item.user_properties.append(('peak_mb', peak_kb / 1024))


_TIMES: dict = collections.defaultdict(lambda: [0.0, 0.0])
_PEAK_MB: dict = {}  # process (worker id) -> its peak so far
_RAISED_MB: dict = collections.defaultdict(float)  # module -> how far it raised its process's peak


def pytest_runtest_logreport(report):
  properties = dict(report.user_properties)
  _TIMES[report.nodeid][0] += report.duration
  if report.when != 'teardown' or not isinstance(properties.get('compile_s'), (int, float)):
    return
  _TIMES[report.nodeid][1] = properties['compile_s']
  worker = getattr(getattr(report, 'node', None), 'gateway', None)
  worker = getattr(worker, 'id', 'main')
  before = _PEAK_MB.get(worker, 0.0)
  _PEAK_MB[worker] = max(before, properties['peak_mb'])
  _RAISED_MB[report.nodeid.split('::')[0]] += _PEAK_MB[worker] - before


def pytest_terminal_summary(terminalreporter):
  if not _TIMES:
    return
  total = sum(t for t, _ in _TIMES.values())
  compiled = sum(c for _, c in _TIMES.values())
  terminalreporter.section('where the time went')
  terminalreporter.write_line(f'{total:.0f} s in tests (summed over workers), {compiled:.0f} s of '
                              'it XLA compiling in-process; peak resident memory per process: '
                              + ', '.join(f'{w} {mb / 1024:.1f} GiB' for w, mb in _PEAK_MB.items()))
  by_module = collections.defaultdict(lambda: [0.0, 0.0])
  for nodeid, (seconds, compile_s) in _TIMES.items():
    by_module[nodeid.split('::')[0]][0] += seconds
    by_module[nodeid.split('::')[0]][1] += compile_s
  for module, (seconds, compile_s) in sorted(by_module.items(), key=lambda kv: -kv[1][0]):
    terminalreporter.write_line(f'{seconds:8.1f} s {compile_s:8.1f} s compiling '
                                f'{_RAISED_MB[module] / 1024:5.1f} GiB peak raised  {module}')
