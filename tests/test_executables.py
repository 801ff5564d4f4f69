"""Executables saved ahead of time (gemma_jax/executables.py): a second process loads what the
first compiled and computes the same bits; an edit of the source is never served an executable
of the code before it; a damaged entry is compiled again. Each process is a fresh Python on a
copy of the repository, its own $GEMMA_JAX_CACHE, and reports what it compiled and loaded from
JAX's monitoring events (gemma_jax.resources)."""

import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from gemma_jax import weights
from graft.engine import Engine, EngineConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = '''
import collections, hashlib, json
import numpy as np
from jax import monitoring
from gemma_jax import executables, resources, weights
loads = collections.Counter()
monitoring.register_event_listener(
    lambda event, **kw: event == executables.LOADED_EVENT and loads.update([kw['name']]))
from graft.engine import Engine, EngineConfig
loaded = weights.load('tiny_gemma3', 'random:0', 'float32')
engine = Engine(loaded, EngineConfig(mode='spec', rows_per_call=16, attention_tile=16,
                                     cache_len=64))
ctx, logits = engine.prefill(list(range(3, 23)), logits='all')
decoded = engine.decode(ctx, 3)
digest = hashlib.sha256(np.ascontiguousarray(logits).tobytes()).hexdigest()
print(json.dumps({'logits': digest, 'decode': decoded.logits_sha256, 'loads': loads,
                  **resources.snapshot()}))
'''


@pytest.fixture(scope='module')
def tree(tmp_path_factory):
  """A copy of the code (what a process traces), so that a test can edit it."""
  root = tmp_path_factory.mktemp('repo')
  for name in ('gemma_jax', 'graft', 'analysis', 'experiments'):
    shutil.copytree(os.path.join(REPO, name), root / name,
                    ignore=shutil.ignore_patterns('__pycache__'))
  return root


def run(tree, cache) -> dict:
  # JAX's compilation cache is the suite's: the checks' probes load from it (the engine's
  # functions never do: gemma_jax.executables compiles them afresh to save them). So is the
  # native library (keyed by its sources, which the copy shares; built once for the suite, not
  # again in each fresh cache: 22 s).
  from gemma_jax import compilation_cache
  from gemma_jax.kernels import native_build
  built = os.path.dirname(native_build.library())
  if not (cache / 'native' / os.path.basename(built)).exists():
    shutil.copytree(built, cache / 'native' / os.path.basename(built))
  env = {**os.environ, 'PYTHONPATH': str(tree), 'GEMMA_JAX_CACHE': str(cache),
         compilation_cache.ENV: compilation_cache.directory()}
  done = subprocess.run([sys.executable, '-c', SCRIPT], cwd=tree, capture_output=True, text=True,
                        env=env, timeout=600)
  assert done.returncode == 0, done.stderr[-3000:]
  return json.loads(done.stdout.strip().splitlines()[-1])


def compiles(report: dict) -> int:
  """The engine functions' executables a process compiled (its own engine's and, where its
  checks ran, the canary's)."""
  return sum(report['executables_by_function'].get(name, 0) for name in ('step', 'head'))


def loads(report: dict) -> int:
  return sum(report['loads'].values())


def test_saved_executables_are_loaded_and_an_edit_is_compiled_again(tree, tmp_path):
  cache = tmp_path / 'cache'
  first = run(tree, cache)
  saved = set(os.listdir(cache / 'executables'))
  # A block, a decode step and a logits call (and the canary's, the checks running here; one
  # that JAX's own cache served is compiled again, fresh, to be saved: gemma_jax.executables).
  assert compiles(first) >= 3 and loads(first) == 0 and len(saved) >= 3

  again = run(tree, cache)
  assert compiles(again) == 0 and loads(again) == 3  # the checks' verdicts are kept
  assert (again['logits'], again['decode']) == (first['logits'], first['decode'])

  # An edit anywhere in the traced code (a comment here: the key is its bytes) is a new key.
  model = tree / 'gemma_jax' / 'model.py'
  model.write_text(model.read_text() + '\n# an edit\n')
  edited = run(tree, cache)
  assert loads(edited) == 0 and compiles(edited) >= 3  # never an old executable
  assert not saved & (set(os.listdir(cache / 'executables')) - saved)
  assert (edited['logits'], edited['decode']) == (first['logits'], first['decode'])

  # A damaged entry is compiled again (and replaced), never a failure.
  for name in set(os.listdir(cache / 'executables')) - saved:
    path = cache / 'executables' / name
    path.write_bytes(path.read_bytes()[:100])
  damaged = run(tree, cache)
  assert loads(damaged) == 0 and compiles(damaged) >= 3
  assert (damaged['logits'], damaged['decode']) == (first['logits'], first['decode'])


def test_a_spec_engine_obtains_at_most_four_executables_whatever_the_lengths():
  """By length (the native kernels), every request is cut into calls of a few fixed shapes: a
  block, a one-row decode step with its logits, a logits call of gathered rows, and one decode
  step per batch-slot count. Prefills, extensions and logits of many lengths, decoding, and
  batches of one slot count must not obtain another executable (loaded or compiled)."""
  engine = Engine(weights.load('tiny_gemma3', 'random:0', 'float32'),
                  EngineConfig(mode='spec', rows_per_call=16, attention_tile=16, cache_len=256))
  assert engine.by_length
  rng = np.random.default_rng(0)
  ids = lambda n: [int(t) for t in rng.integers(3, 512, n)]
  contexts = []
  for length, logits in ((1, 'last'), (5, 'all'), (16, 'last'), (17, 'all'), (40, 'none'),
                         (100, 'last')):
    ctx, _ = engine.prefill(ids(length), logits=logits)
    ctx, _ = engine.extend(ctx, ids(length % 7 + 1), logits='all')
    contexts.append(engine.decode(ctx, 3).context)
  engine.generate_batch(contexts[:3], 4)
  engine.generate_batch(contexts[3:], 2)
  functions = {**{f'step{key}': f for key, f in engine._steps.items()},
               'head': engine.head_function()}
  obtained = {name: len(f._compiled) for name, f in functions.items()}
  assert sum(obtained.values()) <= 4, obtained
