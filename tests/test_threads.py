"""The thread-count question, settled by measurement. XLA:CPU gives Eigen max(CPUs in the
affinity mask, host devices) threads and Eigen blocks a contraction by that count, so a dot's bits
can follow it (on this project's Intel Xeon a 2x256x2048 dot changes between one core and two, a
16x160x640 one at four host devices). So:

- the spec engine checks itself in the process's configuration and is refused where it does not
  compute the spec; where it is built, its bits are the spec's whatever the core count (tested
  here on one core and all, and with Eigen single-threaded);
- the pinned engine checks its premise (a row's dot does not follow its call's row count) and is
  refused where it fails, as in a process of four host devices on a 2-core machine, which moved
  its grafts before (issue 23); its fingerprint binds the thread count.

Each configuration runs in its own process (thread pools are fixed at start-up) on the embedded
Gemma 3 270M, whose matmuls are large enough for XLA to split them across threads.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from gemma_jax.numerics import FixedOrder
from gemma_jax.spec import selfcheck

REPO = pathlib.Path(__file__).resolve().parents[1]

SCRIPT = '''
import os
from gemma_jax.compare import sha256_bytes
from gemma_jax import weights
from graft.engine import Engine, EngineConfig
loaded = weights.load('gemma3_270m', 'embedded')
engine = Engine(loaded, EngineConfig(cache_len=256))
ids = loaded.tokenizer.encode('Byte-exact grafting needs the same bits on one core or many.')
library, query = ids[:9], ids[9:]
_, fresh = engine.extend(engine.empty(), ids, logits=len(query))
print('CPUS', len(os.sched_getaffinity(0)))
print('HASH', sha256_bytes(fresh))
'''


def run(prefix=(), xla_flags=''):
  env = {**os.environ, 'PYTHONPATH': str(REPO), 'XLA_FLAGS': xla_flags}
  out = subprocess.run([*prefix, sys.executable, '-c', SCRIPT], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  lines = dict(line.split(' ', 1) for line in out.stdout.splitlines() if ' ' in line)
  return int(lines['CPUS']), lines['HASH']


@pytest.mark.slow
def test_the_engines_bits_do_not_depend_on_the_thread_count():
  cpus_all, hash_all = run()
  configurations = {'all cores': hash_all}
  assert shutil.which('taskset'), 'taskset (util-linux) is needed to run on one core'
  cpus_one, hash_one = run(('taskset', '-c', '0'))
  assert cpus_one == 1  # on a one-core machine the same as all cores, and still compared
  configurations['one core'] = hash_one
  _, hash_single_thread = run(xla_flags='--xla_cpu_multi_thread_eigen=false')
  configurations['eigen single-threaded'] = hash_single_thread
  assert len(set(configurations.values())) == 1, configurations


FOUR_DEVICES = '''
from gemma_jax.compare import sha256_bytes
from gemma_jax import weights
from gemma_jax.spec import selfcheck
from graft.engine import Engine, EngineConfig
loaded = weights.load('gemma3_270m', 'embedded')
try:
  engine = Engine(loaded, EngineConfig(mode='pinned', cache_len=256))
except selfcheck.RowDependenceError as e:
  print('REFUSED', e)
else:
  ids = loaded.tokenizer.encode('A graft is exact only if every row is computed alike. ' * 3)
  cut = 17
  _, fresh = engine.extend(engine.empty(), ids, logits=4)
  ctx, _ = engine.extend(engine.empty(), ids[:cut], logits=0)
  _, graft = engine.extend(ctx, ids[cut:], logits=4)
  print('FRESH', sha256_bytes(fresh))
  print('GRAFT', sha256_bytes(graft))
'''


@pytest.mark.slow
def test_a_pinned_engine_in_four_host_devices_is_refused_or_exact():
  """The case that moved a one-device graft in a 4-device process: never built and inexact."""
  out = subprocess.run([sys.executable, '-c', FOUR_DEVICES], cwd=REPO, capture_output=True,
                       text=True, timeout=600,
                       env={**os.environ, 'PYTHONPATH': str(REPO),
                            'XLA_FLAGS': '--xla_force_host_platform_device_count=4'})
  assert out.returncode == 0, out.stderr[-2000:]
  lines = dict(line.split(' ', 1) for line in out.stdout.splitlines() if ' ' in line)
  if 'REFUSED' in lines:
    assert "depends on its call's row count" in lines['REFUSED'] and '4 device(s)' in lines[
        'REFUSED']
  else:
    assert lines['FRESH'] == lines['GRAFT']


class _RowCountDependent(FixedOrder):
  """A planted bug: a dot whose rows follow the call's row count (as Eigen's blocking can)."""

  def matmul(self, x, w):
    out = super().matmul(x, w)
    return out if x.shape[0] == 1 else out * jnp.float32(1 + 2 ** -20)


def test_the_row_self_check_names_a_dot_that_follows_the_row_count():
  w = {'64x32': np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)}
  assert selfcheck.row_dependence_failures(FixedOrder(k_chunk=16), None, w, (1, 8, 16)) == []
  failures = selfcheck.row_dependence_failures(_RowCountDependent(k_chunk=16), None, w,
                                               (1, 8, 16))
  # Every row count is named: 1 (its row is not the 16-row call's), 8 and 16 (not one-row calls).
  assert [f.split(':')[0] for f in failures] == [f'matmul 64x32 [{m}, 64] x [64, 32]'
                                                 for m in (1, 8, 16)]
