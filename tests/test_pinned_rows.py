"""The pinned engine's bits do not depend on how many rows a call has.

A token's logits must be the same whether it was prefilled in one call with the tokens around
it, in a call that continued a context at any split point, or decoded alone in a one-row call.
On the tiny configs this runs in the fast suite; on the embedded 270M (whose shapes take other
kernel paths on XLA:CPU) it is a slow test. Exactness is SHA-256 of the float32 logits.
"""

import functools

import numpy as np
import pytest

from gemma_jax.compare import sha256_bytes
from gemma_jax import weights
from graft.engine import Engine, EngineConfig


@functools.lru_cache(maxsize=None)
def engine(name, block_size, cache_len):
  source = 'embedded' if name == 'gemma3_270m' else 'random:0'
  # mode='pinned' named: the default engine is spec (whose row independence tests/test_spec.py
  # checks against its interpreter).
  return Engine(weights.load(name, source, 'float32'),
                EngineConfig(mode='pinned', rows_per_call=block_size, cache_len=cache_len))


def three_ways(eng, tokens, split):
  """Logits of tokens[split:] computed (a) in one prefill, (b) after a prefill of
  tokens[:split], (c) one token per call after it."""
  library, query = tokens[:split], tokens[split:]
  _, one_shot = eng.extend(eng.empty(), tokens, logits=len(query))
  lib, _ = eng.prefill(library, logits='none')
  _, continued = eng.extend(lib, query, logits='all')
  seq, steps = lib, []
  for t in query:
    seq, row = eng.extend(seq, [t], logits='last')
    steps.append(row[0])
  return sha256_bytes(one_shot), sha256_bytes(continued), sha256_bytes(np.stack(steps))


@pytest.mark.parametrize('name', ['tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4'])
def test_tiny_one_shot_continued_and_decoded_agree(name):
  eng = engine(name, 16, 512)
  tokens = [int(t) for t in np.random.default_rng(1).integers(3, 512, 80)]
  for split in (1, 7, 8, 17, 40, 70):  # around the window (8) and the row buckets (8, 16)
    hashes = three_ways(eng, tokens, split)
    assert len(set(hashes)) == 1, (split, hashes)


@pytest.mark.slow
def test_270m_one_shot_continued_and_decoded_agree():
  eng = engine('gemma3_270m', 256, 1024)
  text = eng.loaded.tokenizer.encode('Byte-exact grafting needs the same bits whatever the call '
                                     'shapes. ' * 80)
  for split in (17, 513):  # mid-bucket; past the 512-token window, a library over two calls
    hashes = three_ways(eng, text[:split + 12], split)
    assert len(set(hashes)) == 1, (split, hashes)
