"""Save a library's KV state as an artifact, graft it into a fresh context, check it byte for byte.

    python examples/graft_library.py   # the embedded Gemma 3 270M, the spec engine; about 20 s warm
"""
import hashlib
import sys
import tempfile

import numpy as np

import gemma_jax
from graft.engine import Engine, EngineConfig
from graft.store import artifact

loaded = gemma_jax.load('gemma3_270m')  # the embedded model: weights from its pip package
engine = Engine(loaded, EngineConfig(cache_len=1024))  # the spec engine: the written arithmetic
library = loaded.tokenizer.encode('A content-addressed store keeps key-value state so that a '
                                  'model reads a long document once and reuses it later.')
query = loaded.tokenizer.encode(' In short, the store', add_bos=False)

with tempfile.TemporaryDirectory() as scratch:
  ctx, _ = engine.prefill(library, logits='none')
  artifact.save(f'{scratch}/library', engine, ctx)  # an Orbax checkpoint, every leaf hashed
  grafted = artifact.graft(engine, artifact.load(f'{scratch}/library', engine))  # verified


def sha256(logits) -> str:
  return hashlib.sha256(np.asarray(logits, np.float32).tobytes()).hexdigest()


grafted, graft_logits = engine.extend(grafted, query, logits=len(query))
_, fresh_logits = engine.extend(engine.empty(), library + query, logits=len(query))
if sha256(graft_logits) != sha256(fresh_logits):
  sys.exit('the grafted logits differ from a fresh computation')
print(f'grafted logits SHA-256 {sha256(graft_logits)[:16]}... == a fresh computation\'s')
_, tokens = engine.generate(grafted, 12)
print('continued:', loaded.tokenizer.decode(tokens))
