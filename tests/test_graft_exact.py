"""The pinned engine's claim: an own-position graft is byte-exact, for any split and chunking.

Exactness is asserted on raw bytes (SHA-256), never with a tolerance.
"""

import functools

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from gemma_jax.compare import sha256_bytes
from gemma_jax import weights
from graft.store import artifact
from graft.engine import Engine, EngineConfig


@functools.lru_cache(maxsize=None)
def loaded(name='tiny_gemma3', seed=0, dtype='float32'):
  return weights.load(name, f'random:{seed}', dtype)


def engine(block_size=8, name='tiny_gemma3', dtype='float32', kind='pinned'):
  return _engine(block_size, name, dtype, kind)  # one engine per configuration, however called


@functools.lru_cache(maxsize=8)  # an engine's executables go with it: a bounded number live
def _engine(block_size, name, dtype, kind):
  # Spec and pinned: 16-slot attention tiles, so that the local rings (W + B - 1 = 15..23 slots
  # rounded up to tiles) wrap many times in these contexts, as the 270M's 768-slot rings do.
  tile = 16 if kind in ('spec', 'pinned') else None
  return Engine(loaded(name, 0, dtype), EngineConfig(mode=kind, rows_per_call=block_size,
                                                     cache_len=512, attention_tile=tile))


def tokens(n, seed=0, vocab=512):
  return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n)]


def graft_in_memory(eng, ctx):
  """Round trip through the artifact's leaves (no disk) and graft at own positions."""
  return artifact.graft(eng, artifact.capture(eng, ctx))


def fresh_and_graft(eng, library, query):
  _, fresh = eng.extend(eng.empty(), library + query, logits=len(query))
  lib, _ = eng.prefill(library, logits='none')
  _, grafted = eng.extend(graft_in_memory(eng, lib), query, logits='all')
  return fresh, grafted


@pytest.mark.parametrize('name', ['tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4'])
@settings(max_examples=10, deadline=None)
@given(split=st.integers(1, 70), query_len=st.integers(1, 30),
       block_size=st.sampled_from([3, 8]), chunks=st.lists(st.integers(1, 20), max_size=3),
       seed=st.integers(0, 2**16))
def test_graft_equals_fresh_for_any_split_chunking_and_query(name, split, query_len, block_size,
                                                             chunks, seed):
  # Every family: Gemma 4's per-layer inputs make a token's bits depend on its row in the block,
  # so this is what catches a graft continuation that does not align blocks to the sequence.
  # The library is itself fed in arbitrary chunks before being saved; the window (8) is crossed
  # many times over.
  eng = engine(block_size, name)
  seq_tokens = tokens(split + query_len, seed, eng.model_config.vocab_size)
  library, query = seq_tokens[:split], seq_tokens[split:]
  _, fresh = eng.extend(eng.empty(), seq_tokens, logits=query_len)
  lib, start = eng.empty(), 0
  for size in chunks + [split]:
    if start < split:
      lib, _ = eng.extend(lib, library[start:start + size], logits='none')
      start += size
  _, grafted = eng.extend(graft_in_memory(eng, lib), query, logits='all')
  assert sha256_bytes(fresh) == sha256_bytes(grafted)


# Every engine mode on every family; bfloat16 where the mode defines it; blocked also at 16 rows
# (tiny_gemma4's bits depend on a token's row in the block).
CASES = ([(kind, 8, 'float32') for kind in ('spec', 'pinned', 'blocked')]
         + [(kind, 8, 'bfloat16') for kind in ('spec', 'pinned', 'blocked')]
         + [('blocked', 16, 'float32')])


@pytest.mark.parametrize('name', ['tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4'])
@pytest.mark.parametrize('kind, block_size, dtype', CASES)
def test_graft_is_byte_exact_on_every_family_and_dtype(name, dtype, block_size, kind):
  if kind == 'spec' and dtype == 'bfloat16':  # the written arithmetic (version 1) is float32
    with pytest.raises(ValueError, match='is float32; this model is bfloat16'):
      engine(block_size, name, dtype, kind)
    return
  eng = engine(block_size, name, dtype, kind)
  vocab = eng.model_config.vocab_size
  for library_len, query_len in [(1, 5), (7, 1), (8, 9), (9, 30), (100, 17)]:
    seq = tokens(library_len + query_len, library_len, vocab)
    fresh, grafted = fresh_and_graft(eng, seq[:library_len], seq[library_len:])
    assert sha256_bytes(fresh) == sha256_bytes(grafted), (library_len, query_len)


def test_chained_grafts_graft_extend_save_graft_again(tmp_path):
  eng = engine(8)
  seq = tokens(120, 7)
  _, fresh = eng.extend(eng.empty(), seq, logits=20)
  first, _ = eng.prefill(seq[:33], logits='none')
  artifact.save(str(tmp_path / 'a'), eng, first)
  grafted = artifact.graft(eng, artifact.load(str(tmp_path / 'a'), eng))
  extended, _ = eng.extend(grafted, seq[33:100], logits='none')
  artifact.save(str(tmp_path / 'b'), eng, extended)
  again = artifact.graft(eng, artifact.load(str(tmp_path / 'b'), eng))
  _, chained = eng.extend(again, seq[100:], logits='all')
  assert sha256_bytes(fresh) == sha256_bytes(chained)


def test_decode_after_graft_equals_decode_after_fresh_prefill():
  eng = engine(8)
  prompt = tokens(45, 3)
  fresh_seq, _ = eng.prefill(prompt, logits='last')
  lib, _ = eng.prefill(prompt[:20], logits='none')
  graft_seq, _ = eng.extend(graft_in_memory(eng, lib), prompt[20:], logits='last')
  fresh_end, fresh_tokens = eng.generate(fresh_seq, 64, stop_at_eos=False)
  graft_end, graft_tokens = eng.generate(graft_seq, 64, stop_at_eos=False)
  assert fresh_tokens == graft_tokens
  assert sha256_bytes(fresh_end.last_logits) == sha256_bytes(graft_end.last_logits)
  # Decoding is one-token calls; prefilling the same tokens gives the same bits (one shape).
  _, refill = eng.prefill(prompt + fresh_tokens[:-1], logits='last')
  assert sha256_bytes(refill[-1]) == sha256_bytes(fresh_end.last_logits)


def test_graft_at_own_position_after_a_start_offset():
  eng = engine(8)
  seq = tokens(50, 4)
  _, fresh = eng.extend(eng.empty(start_position=300), seq, logits=10)
  lib, _ = eng.extend(eng.empty(start_position=300), seq[:40], logits='none')
  _, grafted = eng.extend(graft_in_memory(eng, lib), seq[40:], logits='all')
  assert sha256_bytes(fresh) == sha256_bytes(grafted)


def test_sampling_is_reproducible_with_a_seed():
  eng = engine(8)
  seq, _ = eng.prefill(tokens(10, 5), logits='last')
  a = eng.generate(seq, 12, temperature=1.0, seed=3, stop_at_eos=False)[1]
  b = eng.generate(seq, 12, temperature=1.0, seed=3, stop_at_eos=False)[1]
  c = eng.generate(seq, 12, temperature=1.0, seed=4, stop_at_eos=False)[1]
  assert a == b and a != c


def test_default_engine_is_close_but_its_result_depends_on_the_call_shapes():
  # The unpinned engine is the comparison point: results stay close but are not a function of
  # the tokens alone (its calls have as many rows as the request, so XLA picks other kernels
  # for a graft continuation than for a one-shot prefill). Closeness tolerance: 1e-4 of the
  # largest logit (float32 roundings through 7 layers).
  eng = engine(8, kind='default')
  differing = 0
  for split, total, seed in [(50, 70, 6), (33, 100, 7), (17, 90, 8), (64, 130, 9)]:
    seq = tokens(total, seed)
    fresh, grafted = fresh_and_graft(eng, seq[:split], seq[split:])
    assert np.max(np.abs(fresh - grafted)) <= 1e-4 * np.max(np.abs(fresh))
    differing += sha256_bytes(fresh) != sha256_bytes(grafted)
  assert differing > 0  # the bytes differ: what the pinned engine exists to prevent


@pytest.mark.parametrize('bad, message', [
    ([], 'empty'),
    ([5, 512], 'outside the vocabulary'),
    ([-1], 'outside the vocabulary'),
    ([7] * 600, 'does not fit the cache'),
])
def test_bad_token_input_is_refused_with_the_reason(bad, message):
  with pytest.raises(ValueError, match=message):
    engine(8).prefill(bad)


def test_positions_past_the_model_context_are_refused():
  eng = engine(8)
  with pytest.raises(ValueError, match='exceed'):
    eng.extend(eng.empty(start_position=eng.model_config.max_context - 2), [5, 6, 7])


@functools.lru_cache(maxsize=None)
def _long_rows():
  """The rows of a 600-token context, computed where they fit (a 1,024-slot cache)."""
  big = Engine(loaded(), EngineConfig(mode='pinned', rows_per_call=8, cache_len=1024,
                                      attention_tile=16))
  seq = tokens(600, 3)
  ctx, _ = big.prefill(seq, logits='none')
  return artifact.rows(big, artifact.capture(big, ctx)), seq


@pytest.mark.parametrize('case, message', [
    ('past cache_len', 'a context of 0 \\+ 600 tokens does not fit the cache of 512 slots; '
                       'raise cache_len'),
    ('outside the vocabulary', 'token id 512 at index 1 is outside the vocabulary \\[0, 512\\)'),
    ('past max_context', 'positions up to 4096 exceed tiny_gemma3\'s context of 4096'),
])
def test_a_graft_that_does_not_fit_is_refused_when_it_is_made(case, message):
  # With the words `extend` refuses the same tokens in, not at the graft's next call.
  eng = engine(8)
  rows, seq = _long_rows()
  if case == 'past cache_len':
    args = (rows, seq)
  else:
    short = [r.prefix(min(r.num_tokens, 5)) for r in rows[:1]]
    args = (short, [7, 512, 9, 10, 11] if case == 'outside the vocabulary' else seq[:5])
  start = eng.model_config.max_context - 5 + 1 if case == 'past max_context' else 0
  with pytest.raises(ValueError, match=message):
    eng.graft(*args, start_position=start)
  with pytest.raises(ValueError, match=message):  # extend's words for the same tokens
    eng.extend(eng.empty(start_position=start), args[1])
