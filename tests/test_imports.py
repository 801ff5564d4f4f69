"""Importing the library changes no global JAX setting: every module of gemma_jax and graft is
imported in a fresh process and `jax.config` is compared before and after. Entry points and
engines turn on what they need (the persistent compilation cache: gemma_jax/compilation_cache.py)
when they run."""

import json
import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

PROGRAM = '''
import importlib, json, pkgutil, sys
import jax
def settings():
  return {name: repr(value) for name, value in jax.config.values.items()}
before = settings()
names = []
for package in ('gemma_jax', 'graft'):
  module = importlib.import_module(package)
  names.append(package)
  for info in pkgutil.walk_packages(module.__path__, package + '.'):
    importlib.import_module(info.name)
    names.append(info.name)
after = settings()
print(json.dumps({'modules': names,
                  'changed': {k: [before.get(k), after.get(k)]
                              for k in sorted(set(before) | set(after))
                              if before.get(k) != after.get(k)}}))
'''


def test_importing_gemma_jax_and_graft_changes_no_jax_setting():
  env = {k: v for k, v in os.environ.items() if k != 'GEMMA_JAX_COMPILATION_CACHE'}
  done = subprocess.run([sys.executable, '-c', PROGRAM], cwd=REPO, capture_output=True,
                        text=True, timeout=300, env={**env, 'PYTHONPATH': str(REPO)})
  assert done.returncode == 0, done.stderr[-3000:]
  report = json.loads(done.stdout.strip().splitlines()[-1])
  assert {'gemma_jax', 'graft.engine', 'graft.store', 'gemma_jax.model'} <= set(report['modules'])
  assert report['changed'] == {}


def test_the_path_to_the_first_logits_imports_no_flax_or_pallas():
  """A warm start loads saved executables and builds no NNX module and no Pallas kernel, so its
  imports stop short of Flax (0.4 s) and Pallas (docs/performance.md, "The start"): generate's
  and the engine's modules import neither, and both are still there for whoever asks
  (gemma_jax.Transformer, the 'pallas' attention)."""
  program = ('import sys, experiments.generate, graft.engine, graft.store, gemma_jax\n'
             'heavy = lambda: sorted(m for m in sys.modules\n'
             '                       if m.split(".")[0] == "flax" or ".pallas" in m)\n'
             'before = heavy()\n'
             'gemma_jax.Transformer, gemma_jax.attention.build("pallas")\n'
             'print(before, "flax.nnx" in heavy(), "jax.experimental.pallas" in heavy())')
  done = subprocess.run([sys.executable, '-c', program], cwd=REPO, capture_output=True,
                        text=True, timeout=300, env={**os.environ, 'PYTHONPATH': str(REPO)})
  assert done.returncode == 0, done.stderr[-3000:]
  assert done.stdout.split() == ['[]', 'True', 'True']
