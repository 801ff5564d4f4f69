"""Lookup and graft: the longest stored, trusted prefix of a token sequence, found by content
(at token granularity), and its rows read as far as the graft attends to them and grafted into
a fresh context of the engine.
"""

from __future__ import annotations

from gemma_jax import kv_state as kvs
from graft.engine import Context, Engine
from graft.store import blocks
from graft.store.blocks import BlockError
from graft.store.index import Index
from graft.store.reads import Reads
from graft.store.shared import Codec, Match
from graft.store.trust import Trust
from typing import Sequence


class BadBlock(Exception):
  """A published block whose object failed verification while its rows were read."""

  def __init__(self, entry: dict, reason: str):
    super().__init__(reason)
    self.entry, self.reason = entry, reason


class Lookup:
  """Finds stored prefixes and grafts them.

  Args:
    engine: the byte-exact engine, whose fresh context a graft fills.
    codec: the formats bound to the store's namespace (its chain keys, its block tokens).
    index: the published entries (and the quarantine of a block that fails a graft).
    reads: the object reads.
    trust: which blocks may be used (signatures, the parent each was computed on).
  """

  def __init__(self, engine: Engine, codec: Codec, index: Index, reads: Reads, trust: Trust):
    self._engine, self._codec = engine, codec
    self._index, self._reads, self._trust = index, reads, trust

  def match(self, tokens: Sequence[int], *, root: str = blocks.ROOT,
            root_header: str = blocks.ROOT) -> Match:
    """The longest stored prefix of `tokens` (token ids, from position 0), at token
    granularity, cut before its first block that may not be used. root, root_header: where the
    chain hangs and the header hash its first block must record (a document's chain: its
    document root and the prefix's last block header, graft/store/documents.py)."""
    tokens = [int(t) for t in tokens]
    ns, block_tokens = self._codec.namespace, self._codec.block_tokens
    keys = blocks.chain_keys(ns, tokens, block_tokens, root)
    self._index.entries_many([(keys[i - 1] if i else root, key, i * block_tokens)
                              for i, key in enumerate(keys)])  # every entry, concurrently
    parent, parent_header, used, matched, rows = root, root_header, [], 0, 0
    for start in range(0, len(tokens), block_tokens):
      chunk = tokens[start:start + block_tokens]
      entry = self._index.entry(parent, blocks.block_key(ns, parent, chunk), start)
      if entry is not None and not self._trust.on_parent(entry, parent_header):
        entry = None
      if entry is None:  # the longest common prefix among the stored children
        best, common = None, 0
        for child in self._index.children(parent, start):
          length = _common_prefix(child['tokens'], chunk)
          if length > common and child['parent_header_sha256'] == parent_header:
            best, common = child, length
        if best is not None:
          used.append(best)
          matched, rows = matched + common, common
        break
      used.append(entry)
      matched, rows, parent = matched + len(chunk), len(chunk), entry['key']
      parent_header = entry['header_sha256']
      if len(chunk) < block_tokens:
        break
    return self._trust.trusted_prefix(Match(tokens=matched, entries=tuple(used), rows=rows))

  def graft(self, tokens: Sequence[int], *,
            whole_blocks: bool = False) -> tuple[Context, Match]:
    """A fresh context holding the longest stored prefix of `tokens` at its own positions. A
    block that fails verification is quarantined and the prefix ends before it (the caller's
    engine computes the rest). whole_blocks: a prefix that ends inside a block and is followed
    by more tokens ends at that block's start instead (what a put builds on: the rows of a
    partly matching block belong to another block, which a block computed after them would not
    name as its parent, so a forgery there would pass into it unrecorded)."""
    tokens = [int(t) for t in tokens]
    block_tokens = self._codec.block_tokens
    while True:
      match = self.match(tokens)
      if whole_blocks and match.tokens % block_tokens and match.tokens < len(tokens):
        entries = match.entries[:-1]
        match = Match(tokens=match.tokens - match.rows, entries=entries,
                      rows=len(entries[-1]['tokens']) if entries else 0)
      if not match.tokens:
        return self._engine.empty(), match
      try:
        rows = self._rows(match)
      except BadBlock as bad:  # each retry removes one bad block, so this ends
        self._index.quarantine_object(bad.entry, bad.reason)
        continue
      return self._engine.graft(rows, tokens[:match.tokens]), match

  def rows(self, match: Match, *, first: int = 0, every_layer: bool = False) -> list[kvs.KVRows]:
    """Each matched block's rows, verified, at sequence indices and positions `first` +
    the block's start (a document's blocks count from the document's first token); a block
    that fails verification is quarantined and raises BadBlock. every_layer: every layer's
    rows (a document placed anywhere); else as far as a graft at the match's end attends to
    them (a block wholly behind every ring: its global layers only)."""
    try:
      return self._rows(match, first, every_layer)
    except BadBlock as bad:
      self._index.quarantine_object(bad.entry, bad.reason)
      raise

  def _rows(self, match: Match, first: int = 0, every_layer: bool = False) -> list[kvs.KVRows]:
    """Each matched block's rows, read as far as the graft attends to them."""
    n = match.tokens
    ring = self._engine.local_slots
    used = [len(e['tokens']) for e in match.entries[:-1]] + [match.rows]
    # A block wholly behind every ring is read for its global layers only.
    wanted = [(entry, not every_layer and entry['start'] + rows <= n - ring)
              for entry, rows in zip(match.entries, used)]
    layers = self._engine.model_config.cache_layers
    out = []
    for (entry, _), rows, leaves in zip(wanted, used, self._reads.read_blocks(wanted)):
      if isinstance(leaves, BlockError):
        raise BadBlock(entry, str(leaves))
      out.append(kvs.block_rows(leaves, layers, first + entry['start'], len(entry['tokens']))
                 .prefix(rows))
    return out


def _common_prefix(a, b) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n
