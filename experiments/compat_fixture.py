r"""Writes a compatibility fixture: a small artifact and a small store of the spec engine on tiny
Gemma 3, with what a fresh computation gave when they were made.

    python -m experiments.compat_fixture --output_dir=tests/data/compat/<release>

A release commits the fixture its predecessor made (tests/test_compat.py grafts it with the
current code: SHA-256 equal to fresh, until the spec's version changes, after which it must be
refused with the version named). The fixture holds:

    artifact/       graft.store.artifact.save of the context `tokens`
    store/          a file:// store holding `tokens` (graft.store.Store.put)
    weights.safetensors  the model's parameters (a later release may draw random:0 otherwise)
    fixture.json    the engine config, tokens, query, the SHA-256 of the fresh logits of
                    tokens + query, the fingerprints and the commit that made it
"""

from __future__ import annotations

import json
import os

from absl import app, flags
import numpy as np

from experiments import common
from gemma_jax import weights
from gemma_jax.checkpoints import safetensors_io
from gemma_jax.compare import sha256_bytes
from graft.engine import Engine, EngineConfig
from graft.store import Store, artifact

FLAGS = flags.FLAGS

MODEL, WEIGHTS = 'tiny_gemma3', 'random:0'
# Small enough to commit (a few hundred KB), long enough to cross the local window (8) and a
# store block (8 tokens) several times.
ENGINE = {'mode': 'spec', 'rows_per_call': 8, 'cache_len': 64, 'attention_tile': 8}
CONTEXT_TOKENS, QUERY_TOKENS = 29, 4


def tokens(n: int, seed: int, vocab: int) -> list[int]:
  return [2] + [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n - 1)]


def fixture_engine():
  return Engine(weights.load(MODEL, WEIGHTS, 'float32'), EngineConfig(**ENGINE))


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('output_dir', None, 'The directory this run writes (must not exist; '
                      'unset: a new one under runs/compat_fixture/).')


def main(argv):
  if len(argv) > 1:
    raise app.UsageError(f'unexpected arguments: {argv[1:]}')
  out = FLAGS.output_dir or common.run_path('compat_fixture', suffix='')
  if os.path.exists(out):
    raise ValueError(f'{out} already exists; a fixture is written once')

  engine = fixture_engine()
  vocab = engine.model_config.vocab_size
  context, query = tokens(CONTEXT_TOKENS, 35, vocab), tokens(QUERY_TOKENS + 1, 36, vocab)[1:]
  fresh = engine.extend(engine.empty(), context + query, logits=len(query))[1]
  ctx, _ = engine.extend(engine.empty(), context, logits=0)
  staging = out + '.partial'
  os.makedirs(staging)
  artifact.save(os.path.join(staging, 'artifact'), engine, ctx)
  Store(f'file://{os.path.abspath(staging)}/store/', engine).put(context)
  safetensors_io.save_safetensors(engine.loaded.params, engine.model_config,
                                  os.path.join(staging, 'weights.safetensors'))
  record = {'model': MODEL, 'weights': WEIGHTS, 'engine_config': ENGINE, 'tokens': context,
            'query': query, 'fresh_logits_sha256': sha256_bytes(fresh),
            'model_fingerprint': engine.model_fingerprint['sha256'],
            'engine_fingerprint': engine.fingerprint, **common.provenance(),
            'command': common.recorded_command()}
  with open(os.path.join(staging, 'fixture.json'), 'w') as f:
    json.dump(record, f, indent=1, sort_keys=True)
  os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
  os.rename(staging, out)
  print(f'compat fixture written to {out} (fresh logits {record["fresh_logits_sha256"][:16]}..)')


if __name__ == '__main__':
  define_flags()
  common.run(main)
