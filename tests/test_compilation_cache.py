"""JAX's persistent compilation cache (gemma_jax/compilation_cache.py): an executable a fresh
process loads from the cache computes the bits that a fresh compile computes. The processes name
their cache by $GEMMA_JAX_COMPILATION_CACHE, as experiments.bench does to time a cold start."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

PROGRAM = '''
import hashlib, sys
from gemma_jax import weights
from graft.engine import Engine, EngineConfig
engine = Engine(weights.load('tiny_gemma4', 'random:0', 'float32'),
                EngineConfig(rows_per_call=16, cache_len=256))
ctx, logits = engine.prefill(list(range(3, 40)), logits='all')
decoded = engine.decode(ctx, 6)
print(hashlib.sha256(logits.tobytes()).hexdigest(), decoded.logits_sha256)
'''


def _run(cache: str) -> str:
  result = subprocess.run([sys.executable, '-c', PROGRAM], cwd=REPO, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, 'PYTHONPATH': str(REPO),
                               'GEMMA_JAX_COMPILATION_CACHE': cache})
  assert result.returncode == 0, result.stderr[-2000:]
  return result.stdout.strip().splitlines()[-1]


def test_an_executable_loaded_from_the_cache_gives_the_bits_of_a_fresh_compile(tmp_path):
  cache = tmp_path / 'xla'
  written = _run(str(cache))  # the cache is empty: every executable is compiled afresh
  entries = sorted(os.listdir(cache))
  loaded = _run(str(cache))
  assert entries and sorted(os.listdir(cache)) == entries  # the second process compiled nothing
  assert written == loaded
