"""JAX's persistent compilation cache (gemma_jax/compilation_cache.py): an executable a fresh
process loads from the cache computes the bits that a fresh compile computes."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

PROGRAM = '''
import hashlib, sys
from gemma_jax import compilation_cache, weights
from graft.engine import Engine, EngineConfig
compilation_cache.enable(sys.argv[1])
engine = Engine(weights.load('tiny_gemma4', 'random:0', 'float32'),
                EngineConfig(rows_per_call=16, cache_len=256))
ctx, logits = engine.prefill(list(range(3, 40)), logits='all')
decoded = engine.decode(ctx, 6)
print(hashlib.sha256(logits.tobytes()).hexdigest(), decoded.logits_sha256)
'''


def _run(cache: str) -> str:
  result = subprocess.run([sys.executable, '-c', PROGRAM, cache], cwd=REPO, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, 'PYTHONPATH': str(REPO)})
  assert result.returncode == 0, result.stderr[-2000:]
  return result.stdout.strip().splitlines()[-1]


def test_an_executable_loaded_from_the_cache_gives_the_bits_of_a_fresh_compile(tmp_path):
  cache = tmp_path / 'xla'
  written = _run(str(cache))  # the cache is empty: every executable is compiled afresh
  entries = sorted(os.listdir(cache))
  loaded = _run(str(cache))
  assert entries and sorted(os.listdir(cache)) == entries  # the second process compiled nothing
  assert written == loaded
