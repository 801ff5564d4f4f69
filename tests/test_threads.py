"""The thread-count question, settled by measurement: the pinned engine's bits do not depend on how
many cores the process may use, nor on whether XLA:CPU runs its Eigen kernels multi-threaded.

Each configuration runs in its own process (thread pools are fixed at start-up) on the embedded
Gemma 3 270M, whose matmuls are large enough for XLA to split them across threads. The engine
fingerprint therefore leaves the thread count out, and artifacts move between machines with
different core counts.
"""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

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
  if shutil.which('taskset') and cpus_all > 1:
    cpus_one, hash_one = run(('taskset', '-c', '0'))
    assert cpus_one == 1
    configurations['one core'] = hash_one
  _, hash_single_thread = run(xla_flags='--xla_cpu_multi_thread_eigen=false')
  configurations['eigen single-threaded'] = hash_single_thread
  assert len(set(configurations.values())) == 1, configurations
