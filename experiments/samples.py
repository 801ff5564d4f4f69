"""Library/query samples for the graft experiments, drawn from real text by a seeded generator.

The text is the Python documentation's topic pages (`pydoc_data.topics`, shipped with every
CPython): tens of thousands of words of real English prose with code, present on any machine
without a download. Samples keep their token ids, so results and manifests do not depend on the
text source once drawn.
"""

from __future__ import annotations

import bisect
import dataclasses
import decimal
import glob
import os
import sysconfig
from pydoc_data import topics

import numpy as np

from gemma_jax.config import BOS_ID
from gemma_jax.files import read_jsonl as read_records


@dataclasses.dataclass(frozen=True)
class Sample:
  library: tuple[int, ...]  # starts with BOS
  query: tuple[int, ...]


def corpus_text() -> str:
  return '\n\n'.join(topics.topics[name] for name in sorted(topics.topics))


def tokens_for(loaded, count: int, seed: int) -> list[int]:
  """The start of the corpus text for a trained model (BOS first); seeded ids otherwise."""
  if loaded.weights.startswith('random'):
    vocab = loaded.config.vocab_size
    return [int(t) for t in np.random.default_rng(seed).integers(3, vocab, count)]
  ids = loaded.tokenizer.encode(corpus_text())
  if len(ids) < count:
    raise ValueError(f'the corpus holds {len(ids)} tokens, fewer than --tokens={count}')
  return ids[:count]


def long_corpus_texts():
  """Real text by the megabyte, present on any machine with CPython: the documentation topics,
  then every module of the standard library (sources with their docstrings), in path order."""
  yield corpus_text()
  root = sysconfig.get_paths()['stdlib']
  for path in sorted(glob.glob(os.path.join(root, '**', '*.py'), recursive=True)):
    relative = os.path.relpath(path, root)
    if relative.startswith(('site-packages', 'test', 'idlelib')) or '/test' in relative:
      continue
    with open(path, encoding='utf-8', errors='replace') as f:
      yield f.read()


def distinct_libraries(tokenizer, length: int, count: int | None = None):
  """Consecutive, non-overlapping libraries of `length` tokens (BOS + length - 1 of real text,
  long_corpus_texts; length >= 2), as many as asked (or as the text holds)."""
  if length < 2:
    raise ValueError(f'a library of {length} tokens holds no text after BOS')
  body, made = [], 0
  for text in long_corpus_texts():
    body.extend(tokenizer.encode(text, add_bos=False))
    while len(body) >= length - 1:
      yield (BOS_ID,) + tuple(body[:length - 1])
      body = body[length - 1:]
      made += 1
      if count is not None and made >= count:
        return


def library_lengths(count: int, window: int, rng: np.random.Generator) -> list[int]:
  """Lengths from 1 to 2,000+: fixed edge cases first (1, around the window, 2,048), then a mix
  of short, around-the-window and long libraries."""
  fixed = [1, window - 1, window, window + 1, 2048]
  draws = []
  for _ in range(max(0, count - len(fixed))):
    kind = rng.integers(4)
    low, high = [(2, 64), (64, max(65, window - 16)),
                 (max(2, window - 16), window + 48), (window + 48, 2100)][kind]
    draws.append(int(rng.integers(low, high)))
  return (fixed + draws)[:count]


def query_lengths(count: int, rng: np.random.Generator) -> list[int]:
  """1 to 128 tokens, log-uniform, with the edge cases 1 and 128 first: 128^U rounded to the
  nearest integer, U = rng.random() (a multiple of 2^-53), decided exactly (`_log_uniform`)."""
  fixed = [1, 128]
  draws = [_log_uniform(rng.random()) for _ in range(max(0, count - 2))]
  return (fixed + draws)[:count]


def _log_uniform(u: float) -> int:
  """round(128^u) for u in [0, 1): the k with log_128(k - 1/2) <= u < log_128(k + 1/2), u
  compared exactly with thresholds computed to 40 digits (the same integer on every machine;
  exp in binary64 is the C library's, whose last bit may follow the CPU)."""
  return 1 + bisect.bisect_right(_QUERY_THRESHOLDS, decimal.Decimal(u))


_CONTEXT = decimal.Context(prec=40)
# log_128(k + 1/2), k = 1 .. 127: where round(128^u) steps from k to k + 1.
_QUERY_THRESHOLDS = [_CONTEXT.divide(_CONTEXT.ln(decimal.Decimal(k) + decimal.Decimal('0.5')),
                                     _CONTEXT.ln(decimal.Decimal(128))) for k in range(1, 128)]


def draw(tokenizer, count: int, *, seed: int, window: int) -> list[Sample]:
  rng = np.random.default_rng(seed)
  text_ids = tokenizer.encode(corpus_text(), add_bos=False)
  libraries = library_lengths(count, window, rng)
  queries = query_lengths(count, rng)
  order = rng.permutation(count)  # pair edge-case libraries with varied queries
  samples = []
  for lib_len, query_len in zip(libraries, [queries[i] for i in order]):
    start = int(rng.integers(0, len(text_ids) - lib_len - query_len))
    body = text_ids[start:start + lib_len - 1 + query_len]
    samples.append(Sample(library=(BOS_ID,) + tuple(body[:lib_len - 1]),
                          query=tuple(body[lib_len - 1:])))
  return samples


def read_jsonl(path: str, tokenizer) -> list[Sample]:
  """One {"library": text, "query": text} per line; the library gets BOS, the query does not."""
  return [Sample(library=tuple(tokenizer.encode(r['library'])),
                 query=tuple(tokenizer.encode(r['query'], add_bos=False)))
          for r in read_records(path, ('library', 'query'))]


@dataclasses.dataclass(frozen=True)
class StoreSample:
  """A sample for a store-backed graft: `deposited` libraries are put into the store first; a
  library that `shares` a prefix with an earlier sample's starts with that library's first
  `shared_tokens` tokens (a count that ends mid-block), so the store either holds the shared
  blocks once (both deposited) or a query diverges from a stored library inside a block (this
  one not deposited)."""

  sample: Sample
  deposited: bool
  shares: int | None = None  # index of the sample whose library prefix it shares
  shared_tokens: int = 0


def with_shared_prefixes(pairs: list[Sample], block_size: int, *, seed: int) -> list[StoreSample]:
  """Every third sample (from the fourth on) shares a prefix with the sample before it,
  ending mid-block; of those, every other one is not deposited. The rest are deposited as
  drawn."""
  rng = np.random.default_rng(seed + 1)
  out = [StoreSample(pairs[0], deposited=True)]
  for i in range(1, len(pairs)):
    previous, sample = pairs[i - 1].library, pairs[i]
    if i % 3 or i < 3 or len(previous) < block_size + 2:
      out.append(StoreSample(sample, deposited=True))
      continue
    shared = int(rng.integers(1, len(previous) - 1))
    if shared % block_size == 0:
      shared += 1  # end inside a block
    # Real text after the shared prefix, no longer than the two libraries (the cache fits both).
    tail = sample.library[1:][:max(1, len(sample.library) - shared)]
    library = previous[:shared] + tail
    out.append(StoreSample(Sample(library=library, query=sample.query), deposited=i % 2 == 0,
                           shares=i - 1, shared_tokens=shared))
  return out
