"""Documents: KV computed once after a shared prefix and stored apart from where it will be
placed (graft/store/compose.py places it).

A document D stored after a prefix P (say BOS and an instruction) is the KV of D's tokens
computed as the continuation of P: P at positions 0 .. p - 1, D at p .. p + |D| - 1. Its blocks
are the store's ordinary blocks (the same object and entry formats, verified, signed and
quarantined by the same code), in a chain of its own:

  - the chain hangs from the document root R = blocks.document_root(namespace, K_P), where K_P
    is the key of P's own last block; so a document's keys depend on the namespace, the
    prefix's tokens and the document's tokens, and never on where it will be placed;
  - block k holds the document's tokens kB .. kB + B - 1 (`start` counts from the document's
    first token), keyed by the chain formula under its parent (R for block 0);
  - block 0 records the header hash of P's last block as its parent header: a document
    computed on another version of its prefix is a miss, as any block computed on another
    version of its parent is (`Trust.on_parent`).

P is published under its own last key first (a prefix matched inside a longer stored block has
no key of its own otherwise). `verify`, `audit` and the index walk reach a document's chain from
every published key through its document root.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Sequence

from gemma_jax import kv_state as kvs
from graft.engine import Engine
from graft.store import blocks
from graft.store.compose import append_rows, concatenate
from graft.store.lookup import BadBlock, Lookup
from graft.store.publish import Block, Publication
from graft.store.shared import Codec, Match, StoreError

_WRITE_BATCH = 64  # blocks computed before they are written together (as a put)


class DocumentError(StoreError):
  """A document or prefix that cannot be stored or placed; the message says why."""


@dataclasses.dataclass(frozen=True)
class Document:
  """A stored document: its tokens, the key of its chain's last block and the key of the
  prefix's last block it was computed after (what `Store.compose` checks a prefix against)."""

  tokens: tuple[int, ...]
  key: str
  prefix_key: str
  prefix_tokens: int


class Documents:
  """Documents stored after a prefix: put, found, read.

  Args:
    engine: the pinned engine that computes them.
    codec: the formats bound to the store's namespace and the engine's layout.
    lookup: the stored chains (the prefix's, and each document's from its root).
    publication: the put protocol (the prefix's put, and the writing of a document's blocks).
  """

  def __init__(self, engine: Engine, codec: Codec, lookup: Lookup, publication: Publication):
    self._engine, self._codec, self._lookup, self._publication = engine, codec, lookup, publication

  # Keys -----------------------------------------------------------------------------------------

  def prefix_key(self, prefix: Sequence[int]) -> str:
    """The key of the prefix's own last block."""
    return blocks.chain_keys(self._codec.namespace, prefix, self._codec.block_tokens)[-1]

  def keys(self, prefix: Sequence[int], document: Sequence[int]) -> list[str]:
    """The keys of a document's blocks after `prefix`."""
    return blocks.document_keys(self._codec.namespace, prefix, document, self._codec.block_tokens)

  def check(self, prefix: Sequence[int], document: Sequence[int],
            what: str = 'the document') -> tuple[list[int], list[int]]:
    """(prefix, document) as int lists; DocumentError when the prefix or the document is empty,
    holds an id outside the vocabulary, or prefix + document does not fit the engine's cache."""
    prefix, document = _ids(prefix, 'the prefix'), _ids(document, what)
    vocab = self._engine.model_config.vocab_size
    for name, ids in (('the prefix', prefix), (what, document)):
      if not ids:
        raise DocumentError(f'{name} is empty')
      bad = next((t for t in ids if not 0 <= t < vocab), None)
      if bad is not None:
        raise DocumentError(f'{name} holds token id {bad}, outside the vocabulary [0, {vocab})')
    cache = self._engine.engine_config.cache_len
    if len(prefix) + len(document) > cache:
      raise DocumentError(f'{what} of {len(document)} tokens after a prefix of {len(prefix)} '
                          f'does not fit the cache of {cache} slots')
    return prefix, document

  # Finding and reading --------------------------------------------------------------------------

  def prefix_match(self, prefix: Sequence[int]) -> Match | None:
    """The prefix's stored chain ending with its own last block (usable: verified and
    trusted), or None."""
    match = self._lookup.match(prefix)
    if (match.tokens != len(prefix) or not match.entries
        or match.entries[-1]['key'] != self.prefix_key(prefix)):
      return None
    return match

  def match(self, prefix: Sequence[int], document: Sequence[int]) -> Match:
    """The longest stored prefix of a document's chain after `prefix` (Match(0) when the prefix
    itself is not stored under its own key)."""
    prefix_match = self.prefix_match(prefix)
    if prefix_match is None:
      return Match(0, (), 0)
    last = prefix_match.entries[-1]
    root = blocks.document_root(self._codec.namespace, last['key'])
    return self._lookup.match(document, root=root, root_header=last['header_sha256'])

  def read(self, prefix: Sequence[int], document: Sequence[int]) -> tuple[kvs.KVRows, Match] | None:
    """A stored document's rows: every layer's K and V [|D|, K, H] at sequence indices and
    positions p .. p + |D| - 1 (p = len(prefix)), as computed after the prefix; None when it
    is not stored whole (a block that fails verification is quarantined on the way)."""
    while True:
      match = self.match(prefix, document)
      if match.tokens < len(document):
        return None
      try:
        parts = self._lookup.rows(match, first=len(prefix), every_layer=True)
      except BadBlock:  # quarantined; each retry removes one bad block, so this ends
        continue
      return concatenate(parts), match

  # Writing --------------------------------------------------------------------------------------

  def put(self, prefix: Sequence[int], document: Sequence[int], *, recompute: bool = False) -> dict:
    """Deposits a document after a prefix (the prefix's blocks first, under its own last key):
    every block of the document's chain not stored yet is computed and published; `recompute`
    computes every block and compares it with what is stored (a stored block that differs is
    a conflict: replaced, quarantined, reported). Returns what it did, as a put does, with the
    `document` (a Document)."""
    prefix, document = self.check(prefix, document)
    t0 = time.perf_counter()
    prefix_report = self._publication.put(prefix, recompute=recompute, own_last_block=True)
    prefix_match = self.prefix_match(prefix)
    if prefix_match is None:
      raise DocumentError('the prefix could not be stored under its own key (a block of it is '
                          'refused: see the store\'s problems)')
    last = prefix_match.entries[-1]
    ns, block_tokens = self._codec.namespace, self._codec.block_tokens
    root = blocks.document_root(ns, last['key'])
    keys = blocks.chain_keys(ns, document, block_tokens, root)
    while True:  # each retry quarantines one bad block, so this ends
      match = Match(0, (), 0) if recompute else self._lookup.match(
          document, root=root, root_header=last['header_sha256'])
      # Whole blocks are built on; a match ending inside a block rewrites that block (unless
      # the document ends there too: then its rows are addressable already).
      done = match.tokens == len(document)
      first_new = len(keys) if done else match.tokens // block_tokens
      used = match if done else Match(first_new * block_tokens, match.entries[:first_new],
                                      len(match.entries[first_new - 1]['tokens'])
                                      if first_new else 0)
      try:  # what is built on is read and verified, as a put grafts it
        stored = self._lookup.rows(used, first=len(prefix), every_layer=True) if used.tokens else []
      except BadBlock:
        continue
      break
    report = {'tokens': len(document), 'prefix_tokens': len(prefix),
              'reused_tokens': used.tokens, 'blocks_written': 0, 'blocks_existing': 0,
              'bytes_written': 0, 'conflicts': 0,
              'prefix_blocks_written': prefix_report['blocks_written']}
    if first_new < len(keys):
      ctx, prefix_match = self._lookup.graft(prefix)
      if prefix_match.tokens < len(prefix):
        ctx, _ = self._engine.extend(ctx, prefix[prefix_match.tokens:], logits='none',
                                     consume=True)
      if stored:
        ctx = append_rows(self._engine, ctx, concatenate(stored), document[:used.tokens])
      parent_header = (match.entries[first_new - 1]['header_sha256'] if first_new
                       else last['header_sha256'])
      batch: list[Block] = []
      for k in range(first_new, len(keys)):
        start, stop = k * block_tokens, min((k + 1) * block_tokens, len(document))
        n = len(ctx.tokens)
        ctx, _ = self._engine.extend(ctx, document[start:stop], logits='none', consume=True)
        leaves = kvs.block_leaves(kvs.take_rows(ctx.kv, n, len(ctx.tokens)),
                                  self._engine.model_config.cache_layers)
        batch.append((keys[k - 1] if k else root, start, document[start:stop], leaves))
        if len(batch) == _WRITE_BATCH or k == len(keys) - 1:
          written, parent_header, conflicts = self._publication.write_blocks(batch, parent_header)
          report['conflicts'] += conflicts
          for size in written:
            report['blocks_written' if size else 'blocks_existing'] += 1
            report['bytes_written'] += size
          batch = []
    report['seconds'] = time.perf_counter() - t0
    report['document'] = Document(tuple(document), keys[-1], last['key'], len(prefix))
    return report

def _ids(tokens, what: str) -> list[int]:
  try:
    return [int(t) for t in tokens]
  except (TypeError, ValueError):
    raise DocumentError(f'{what} is not a sequence of token ids') from None
