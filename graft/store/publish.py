"""The publication protocol of a put, read top to bottom: the longest stored prefix of whole
blocks grafted, the rest computed block by block, and each batch of new block objects written
under their writer's unique names, read back and checked, then published by writing their
index entries only if none exists (the first writer wins; a later one verifies the published
copy and removes its own), under a lease in staging/ that keeps gc away from objects written
and not yet published.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
import uuid
from typing import Callable, Sequence

import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax import digest
from gemma_jax.digest import canonical_json
from graft.engine import Engine
from graft.store import blocks
from graft.store.blocks import BlockError
from graft.store.index import Index
from graft.store.kvstore import KvStore
from graft.store.lookup import Lookup
from graft.store.reads import Reads
from graft.store.shared import POOL, Codec, Kind, Match, StoreError
from graft.store.trust import Trust

_WRITE_BATCH = 64  # blocks computed before they are written together (bounds host memory)
# The steps of a put, in order; `after_step` is called after each with the batch's object names.
STEPS = ('written', 'verified', 'published')
# A block computed and not yet stored: its parent's key, its first token's index, its tokens and
# its leaves (kv_state.block_leaves' names).
Block = tuple[str, int, Sequence[int], dict[str, np.ndarray]]
PAUSED = 'store put paused after step'


class Publication:
  """Puts: blocks computed and published.

  Args:
    backing: the store's storage.
    codec: the formats bound to the store's namespace and the engine's layout.
    engine: the byte-exact engine that computes the blocks.
    counters: where blocks written and conflicts found are counted.
    lookup: the stored prefix a put builds on.
    index: the published entries (and the quarantine of a block found bad or in conflict).
    reads: the object reads (another writer's copy, verified).
    trust: signs each block this writer publishes or finds identical.
    after_step: called after each step of a put (STEPS) with the batch's object names, or
      None: tests pause a writer or interleave other operations there (`pause_at`).
  """

  def __init__(self, backing: KvStore, codec: Codec, engine: Engine,
               counters: collections.Counter, lookup: Lookup, index: Index, reads: Reads,
               trust: Trust, after_step: Callable[[str, list[str]], None] | None = None):
    self._backing, self._codec, self._engine, self._counters = backing, codec, engine, counters
    self._lookup, self._index, self._reads, self._trust = lookup, index, reads, trust
    self._after_step = after_step or (lambda step, names: None)

  def put(self, tokens: Sequence[int], *, recompute: bool = False,
          own_last_block: bool = False) -> dict:
    """Deposits `tokens` (a context from position 0): grafts the longest stored prefix of whole
    blocks (the trusted one, with a trust list), computes the rest block by block with the
    engine and writes every block not stored yet; `recompute` computes every block and compares
    it with what is stored (a stored block that differs is a conflict: replaced, quarantined,
    reported). own_last_block: the context's last block is published under its own key even
    where it is the first rows of a longer stored block (a prefix that documents hang after,
    graft/store/documents.py). Returns what it did: tokens, blocks reused and written,
    conflicts, bytes, seconds computing and storing."""
    tokens = [int(t) for t in tokens]
    if not tokens:
      raise ValueError('nothing to put: the token list is empty')
    t0 = time.perf_counter()
    block_tokens = self._codec.block_tokens
    keys = blocks.chain_keys(self._codec.namespace, tokens, block_tokens)
    ctx, match = ((self._engine.empty(), Match(0, (), 0)) if recompute
                  else self._lookup.graft(tokens, whole_blocks=True))
    if (own_last_block and match.tokens == len(tokens)
        and match.entries[-1]['key'] != keys[-1]):  # matched inside a longer block
      ctx, match = self._lookup.graft(tokens[:(len(keys) - 1) * block_tokens], whole_blocks=True)
    # The block holding token `match.tokens` is the first one to write. (When every token is
    # matched, even a partial last block is addressable already: it is a prefix of a stored one.)
    first_new = len(keys) if match.tokens == len(tokens) else match.tokens // block_tokens
    report = {'tokens': len(tokens), 'reused_tokens': match.tokens, 'blocks_written': 0,
              'blocks_existing': 0, 'bytes_written': 0, 'conflicts': 0, 'compute_seconds': 0.0,
              'storage_seconds': 0.0}
    # The header hash of the parent of the first block written: the stored block it was
    # grafted from (what this put computes on), else the root.
    parent_header = (match.entries[first_new - 1]['header_sha256'] if first_new else blocks.ROOT)
    batch: list[Block] = []  # computed and not yet stored
    for k in range(first_new, len(keys)):
      start, stop = k * block_tokens, min((k + 1) * block_tokens, len(tokens))
      t1 = time.perf_counter()
      if stop > len(ctx.tokens):
        ctx, _ = self._engine.extend(ctx, tokens[len(ctx.tokens):stop], logits='none',
                                     consume=True)
      leaves = kvs.block_leaves(kvs.take_rows(ctx.kv, start, stop),
                                self._engine.model_config.cache_layers)
      batch.append((keys[k - 1] if k else blocks.ROOT, start, tokens[start:stop], leaves))
      report['compute_seconds'] += time.perf_counter() - t1
      if len(batch) == _WRITE_BATCH or k == len(keys) - 1:
        t2 = time.perf_counter()
        written_bytes, parent_header, conflicts = self.write_blocks(batch, parent_header)
        report['conflicts'] += conflicts
        for written in written_bytes:
          report['blocks_written' if written else 'blocks_existing'] += 1
          report['bytes_written'] += written
        report['storage_seconds'] += time.perf_counter() - t2
        batch = []
    report['seconds'] = time.perf_counter() - t0
    return report

  def write_blocks(self, batch: Sequence[Block], parent_header: str) -> tuple[list[int], str, int]:
    """Writes, verifies and publishes blocks [(parent, start, tokens, leaves)] of one chain
    (a context's, or a document's), each step for the whole batch at once; `parent_header` is
    the header hash of the first one's parent (ROOT for a context's first block, the prefix's
    last block for a document's). Returns the bytes written per block (0 where another
    writer's identical copy was published first), the header hash of the last block's copy
    that stands published and the conflicts found."""
    layout = self._codec.layout
    hashed = list(POOL.map(lambda b: blocks.hash_leaves(b[3], len(b[2]), layout), batch))
    first_parent_header = parent_header
    encoded = []
    for (parent, start, tokens, _), leaves in zip(batch, hashed):
      encoded.append(blocks.encode_block(self._codec.namespace, parent, parent_header, start,
                                         tokens, leaves, layout))
      parent_header = blocks.header_sha256(encoded[-1][1])
    names = [f'objects/{key}.{uuid.uuid4().hex}' for key, _, _ in encoded]
    # The lease goes first and stays until the batch is published: gc reads leases before it
    # checks for publication, so it sees an object of this put either leased or published.
    lease = f'staging/{uuid.uuid4().hex}.json'
    self._backing.write(lease, canonical_json({'objects': names, 'time': time.time()}))
    try:
      out, standing, conflicts = self._publish_batch(batch, encoded, names, first_parent_header)
    finally:
      self._backing.delete(lease)
    return out, standing, conflicts

  def _publish_batch(self, batch, encoded, names,
                     first_parent_header: str) -> tuple[list[int], str, int]:
    """Writes, verifies and publishes the encoded blocks of `write_blocks` under `names`.
    Returns the bytes written per block, the header hash of the last block's copy that stands
    published (another writer's equal copy may stand instead of ours, under another header
    when it is of an older format) and the conflicts found."""
    self._backing.write_many([(name, data) for name, (_, data, _) in zip(names, encoded)])
    self._after_step('written', names)
    for name, (_, data, _), kept in zip(names, encoded,
                                        self._backing.read_many([(n, None) for n in names])):
      if kept != data:  # what the storage layer kept
        self._backing.delete(name)
        raise StoreError(f'{self._backing.url}: object {name} did not read back as written')
    self._after_step('verified', names)
    entries = []
    for (parent, _, _, _), name, (key, data, header) in zip(batch, names, encoded):
      offset, length = blocks.header_span(data)
      entries.append((f'index/{parent}/{key}', blocks.encode_entry(
          header, name.split('/', 1)[1], len(data), data[offset:offset + length])))
    published = self._backing.write_if_absent_many(entries)
    self._after_step('published', names)
    out, conflicts = [], 0
    standing = {batch[0][0]: first_parent_header}  # key -> header hash of its published copy
    for (parent, start, _, _), name, (key, data, header), (entry_name, entry_bytes), won in zip(
        batch, names, encoded, entries, published):
      standing[key] = blocks.header_sha256(data)
      if not won:
        won, conflict, theirs = self._publish_over(parent, start, key, name, header, entry_name,
                                                   entry_bytes, standing.get(parent))
        conflicts += conflict
        if not won and theirs is not None:  # (a copy not ours stands: its header's hash)
          standing[key] = theirs
      self._trust.sign(key, standing[key])
      self._counters['blocks_written'] += won
      out.append(len(data) if won else 0)
    return out, standing[encoded[-1][0]], conflicts

  def _publish_over(self, parent, start, key, name, header, entry_name, entry_bytes,
                    parent_standing: str | None) -> tuple[bool, bool, str | None]:
    """Another writer published this block first. Its copy is kept only if it verifies and is
    the same block: the same bytes, computed on the same parent, ours or the parent's copy that
    stands published (`parent_standing`, which this put wrote or found equal to its own)
    (under a byte-exact engine two honest writers write identical blocks, so a difference
    means one of them is wrong, and this writer's engine has just computed the block).
    Otherwise it is quarantined with the reason and ours is published. Returns (ours
    published, a conflict was found, the header hash of their copy when it was kept)."""
    conflict = False
    for _ in range(3):
      existing = self._index.entry(parent, key, start)
      if existing is not None and f'objects/{existing["object"]}' == name:
        return True, conflict, None  # ours, published by a rebuild_index beside this put
      if existing is not None:
        try:
          stored = self._reads.read_object(existing, global_only=False)
          theirs = self._reads.header_of(existing)
          # Their verified leaves hashed as ours are (an object of an older format carries
          # another hash).
          hash_name = blocks.content_hash(header)
          same = (all(digest.hexdigest(hash_name, stored[leaf['name']]) == leaf[hash_name]
                      for leaf in header['leaves'])
                  and theirs['parent_header_sha256'] in (header['parent_header_sha256'],
                                                         parent_standing))
          if same:
            self._backing.delete(name)  # first writer wins; ours was a copy
            return False, conflict, existing['header_sha256']
          conflict = True
          self._counters['conflicts'] += 1
          self._index.quarantine(existing['key'], f'objects/{existing["object"]}',
                                 'conflict: its bytes differ from this writer\'s computation of '
                                 'the same block (or it was computed on another version of its '
                                 'parent)', kind=Kind.CONFLICT, entry_name=entry_name,
                                 judged=existing)
        except BlockError as e:
          self._index.quarantine_object(existing, str(e))
      if self._backing.write_if_absent(entry_name, entry_bytes):
        return True, conflict, None
    raise StoreError(f'{self._backing.url}: could not publish block {key[:16]}..')


def pause_at(at: str, resume: str | None = None) -> Callable[[str, list[str]], None]:
  """An `after_step` hook for tests that kill a writer process at a known point of a put
  (tests/test_store.py, experiments/fault_campaign's kill_put) or make two writers overlap
  (tests/test_store.py).

  Args:
    at: 'STEP:N': the N-th time (default 1) the put reaches STEP (one of STEPS).
    resume: a file whose creation lets the writer go on; None: it waits to be killed.

  Returns:
    The hook: at that step it prints PAUSED, the step and the batch's object names (JSON) on
    stderr, then waits.
  """
  step_at, _, count = at.partition(':')
  if step_at not in STEPS or not (count or '1').isdigit():
    raise ValueError(f'pause at {at!r}: expected STEP:N with STEP one of {", ".join(STEPS)}')
  reached: collections.Counter[str] = collections.Counter()

  def pause(step: str, names: list[str]) -> None:
    reached[step] += 1
    if step == step_at and reached[step] == int(count or 1):
      sys.stderr.write(f'{PAUSED} {step} {json.dumps(names)}\n')
      sys.stderr.flush()
      while not (resume and os.path.exists(resume)):  # until resumed, or killed
        time.sleep(0.05 if resume else 3600)

  return pause
