"""JAX's persistent compilation cache (gemma_jax/compilation_cache.py): an executable a fresh
process loads from the cache computes the bits that a fresh compile computes. The processes name
their cache by $GEMMA_JAX_COMPILATION_CACHE, as experiments.bench does to time a cold start."""

import os
import pathlib
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parents[1]

PROGRAM = '''
import collections, hashlib, sys
from jax import monitoring
events = collections.Counter()
monitoring.register_event_listener(lambda event, **_: events.update([event]))
from gemma_jax import weights
from graft.engine import Engine, EngineConfig
engine = Engine(weights.load('tiny_gemma4', 'random:0', 'float32'),
                EngineConfig(rows_per_call=16, cache_len=256))
ctx, logits = engine.prefill(list(range(3, 40)), logits='all')
decoded = engine.decode(ctx, 6)
print(events['/jax/compilation_cache/cache_hits'], events['/jax/compilation_cache/cache_misses'])
print(hashlib.sha256(logits.tobytes()).hexdigest(), decoded.logits_sha256)
'''


def _run(cache: str) -> tuple[int, int, str]:
  """(JAX's persistent-cache hits, its misses, the digests) of one process on `cache`."""
  result = subprocess.run([sys.executable, '-c', PROGRAM], cwd=REPO, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, 'PYTHONPATH': str(REPO),
                               'GEMMA_JAX_COMPILATION_CACHE': cache})
  assert result.returncode == 0, result.stderr[-2000:]
  counts, digests = result.stdout.strip().splitlines()[-2:]
  hits, misses = (int(n) for n in counts.split())
  return hits, misses, digests


def test_an_executable_loaded_from_the_cache_gives_the_bits_of_a_fresh_compile(tmp_path):
  cache = tmp_path / 'xla'
  hits, misses, written = _run(str(cache))  # an empty cache: every executable compiled afresh
  assert hits == 0 and misses > 0
  hits, misses, loaded = _run(str(cache))
  assert misses == 0 and hits > 0  # the second process compiled nothing: it loaded every one
  assert written == loaded
