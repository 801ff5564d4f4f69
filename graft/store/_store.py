"""The knowledge store: KV computed once, found again by its content, grafted byte-exactly.

    store = Store('file:///data/kv/', engine)          # a pinned engine; any kvstore URL
    store.put(tokens)                                  # deposits the blocks not stored yet
    ctx, match = store.graft(tokens)                   # the longest stored prefix, grafted
    ctx, logits = engine.extend(ctx, tokens[match.tokens:] + query, logits=...)

Content addressing (graft/blocks.py). The unit is the pinned engine's block: B tokens at
sequence indices kB .. kB + B - 1, keyed by a SHA-256 chain over the namespace (model, engine,
layout, machine), the parent block's key and the block's token ids. Contexts that share a
prefix share its blocks; a context's last block may be partial. Lookup returns the longest
stored prefix at token granularity: a query that diverges inside a block still reuses that
block's first rows, since under the pinned engine a row's bits do not depend on the rows after
it (tests/test_store.py proves it on every family).

Storage (graft/kvstore.py): TensorStore's kvstore, so the same store runs on local disk, in
memory or on object stores. Layout under the URL:

    store.json                   the namespace and the fingerprints behind it (written once)
    objects/<key>.<writer id>    block objects, immutable, under the writer's unique name
    index/<parent>/<key>         index entries: an object published under its parent
    quarantine/<id>.json|object  objects found bad, with the reason
    staging/<writer id>.json     a put's lease on the objects it has written and not yet
                                 published (gc leaves them alone while it is live)

A put writes each new object under its unique name, reads it back and checks its bytes, then
publishes it by writing its index entry only if none exists (first writer wins: a second
writer verifies the existing entry's object and removes its own copy). A reader therefore sees
a published, complete object or nothing; a process killed mid-put leaves at most unpublished
objects, which `gc` removes once their put's lease has gone or expired. The index can always
be rebuilt from the objects' headers (`rebuild_index`).

Tiers. Device: the engine's one fixed cache, never grown by the store (a graft fills the
engine's own buffers). Host: an LRU of verified blocks bounded by `host_cache_bytes`. Backing:
the kvstore. A graft reads only what it can attend to: every block's global-layer rows, and the
local-layer rows only of the blocks within the ring of the graft point.

Nothing is trusted. Every entry and object is re-hashed and checked against the engine's
layout on every read; a corrupt, truncated, missing or foreign object is reported with its key
and reason, quarantined (moved aside, its entry removed) and treated as a miss, so the engine
recomputes and the answer is still exact. `verify` checks a whole store; `gc` drops what no
index entry reaches.

The Store is one class in rooms, each a module of its own (mixins over the state the Store
holds): index.py (entries, their batch reads and rebuild), reads.py (object reads, decoding,
the host tier), publish.py (the publication protocol of put: write, read back, publish,
leases), trust.py (signatures: which verified blocks a graft may use), maintenance.py (verify,
audit, quarantine, gc); this module holds the namespace, lookup and graft; shared.py the
names, errors and results they share.
"""

from __future__ import annotations

import collections
import json

import numpy as np

from gemma_jax import kv_state as kvs
from graft.store import blocks, signing
from graft.engine.fingerprint import differences
from graft.store.blocks import BlockError
from graft.engine import Context, Engine, fingerprint
from graft.store.kvstore import KvStore
from graft.store.shared import DESCRIPTION, LEASE_SECONDS, BadBlock, Match, Problem, StoreError
from graft.store.index import Index
from graft.store.maintenance import Maintenance
from graft.store.publish import PAUSE_ENV, PAUSED, RESUME_ENV, Publication
from graft.store.reads import HostCache, Reads
from graft.store.trust import Trust

__all__ = ['LEASE_SECONDS', 'PAUSED', 'PAUSE_ENV', 'RESUME_ENV', 'HostCache', 'Match', 'Problem',
           'Store', 'StoreError']


class Store(Index, Reads, Trust, Publication, Maintenance):
  """A store at `url` bound to one namespace: the pinned `engine`'s model and configuration."""

  def __init__(self, url: str | KvStore, engine: Engine, *, host_cache_bytes: int = 1 << 30,
               create: bool = True, signing_key: signing.SigningKey | None = None,
               trusted_keys: tuple[signing.PublicKey, ...] | None = None,
               namespace_salt: str = ''):
    """`url` is a kvstore URL, or an open KvStore (another view of the same storage: a memory://
    store is private to the KvStore that opened it; a wrapper that injects faults).
    signing_key: this writer's key; every block it publishes or finds identical is signed.
    trusted_keys: when given, only blocks signed by one of them are grafted (the rest are
    misses, reported); when None, every verified block is (the writers are trusted).
    namespace_salt: a tenant's secret; stores of another salt are another namespace."""
    if not engine.plan.byte_exact:
      raise StoreError('a store holds KV of a byte-exact engine only; this engine is '
                       f'{engine.engine_config.mode!r}')
    self.backing = url if isinstance(url, KvStore) else KvStore(url)
    self.url = self.backing.url
    self.engine = engine
    self.block_layout = blocks.BlockLayout.of(engine)
    self.block_tokens = engine.engine_config.rows_per_call
    self.salt = namespace_salt
    self.namespace = blocks.namespace(engine.model_fingerprint, engine.fingerprint,
                                      namespace_salt)
    self.host = HostCache(host_cache_bytes)
    self.signing_key, self.trusted_keys = signing_key, trusted_keys
    self._trusted: dict[str, bool] = {}  # header SHA-256 -> signed by a trusted key
    self.problems: list[Problem] = []
    self.counters = collections.Counter()  # reads by tier, bytes, blocks written
    self._entries: dict[str, dict] = {}  # key -> verified entry (entries are immutable)
    self._open(create)

  def description(self) -> dict:
    return {'format': blocks.STORE_FORMAT, 'namespace': self.namespace,
            'block_tokens': self.block_tokens, 'model': self.engine.model_fingerprint,
            'engine': self.engine.fingerprint}

  def _open(self, create: bool) -> None:
    mine = self.description()
    data = self.backing.read(DESCRIPTION)
    if data is None:
      if not create:
        raise StoreError(f'no store at {self.url} (no {DESCRIPTION})')
      if self.backing.write_if_absent(DESCRIPTION, blocks.canonical(mine)):
        return
      data = self.backing.read(DESCRIPTION)  # another process created it first
    try:
      theirs = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
      raise StoreError(f'{self.url}{DESCRIPTION} is damaged ({e})') from None
    if not isinstance(theirs, dict) or theirs.get('format') != blocks.STORE_FORMAT:
      raise StoreError(f'{self.url} is not a {blocks.STORE_FORMAT} store')
    for part in ('model', 'engine'):
      if not fingerprint.hashes_to_its_fields(theirs.get(part)):
        raise StoreError(f'{self.url}{DESCRIPTION}: its {part} fingerprint does not hash to the '
                         'fields recorded beside it (altered?)')
    if blocks.namespace(theirs['model'], theirs['engine'], self.salt) != theirs.get('namespace'):
      raise StoreError(f'{self.url}{DESCRIPTION} does not hash to its namespace under this '
                       'salt (another tenant\'s store, or altered)')
    if theirs['namespace'] == mine['namespace']:
      return
    diffs = fingerprint.engine_differences(mine['engine'], theirs['engine'],
                                           labels=('the store has', 'expected'))
    if theirs['model']['sha256'] != mine['model']['sha256']:
      diffs = [d for d in differences(mine['model'], theirs['model'],
                                      labels=('the store has', 'expected'))
               if not d.startswith('sha256')] + diffs
    if diffs:
      raise StoreError(f'{self.url} was made under another model or engine configuration '
                       f'(namespace {str(theirs.get("namespace"))[:16]}..): '
                       + '; '.join(diffs[:8]))
    # The same model and bits under an older fingerprint (a spec store of an earlier release):
    # its blocks are this engine's blocks, under the namespace they were written in.
    self.namespace = theirs['namespace']

  def lookup(self, tokens) -> Match:
    """The longest stored prefix of `tokens`, at token granularity."""
    tokens = [int(t) for t in tokens]
    keys = blocks.chain_keys(self.namespace, tokens, self.block_tokens)
    self._entries_many([(keys[i - 1] if i else blocks.ROOT, key, i * self.block_tokens)
                        for i, key in enumerate(keys)])  # every block's entry, concurrently
    parent, parent_header, used, matched, rows = blocks.ROOT, blocks.ROOT, [], 0, 0
    for start in range(0, len(tokens), self.block_tokens):
      chunk = tokens[start:start + self.block_tokens]
      entry = self._entry(parent, blocks.block_key(self.namespace, parent, chunk), start)
      if entry is not None and not self._on_parent(entry, parent_header):
        entry = None
      if entry is None:  # the longest common prefix among the stored children
        best, common = None, 0
        for child in self._children(parent, start):
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
      if len(chunk) < self.block_tokens:
        break
    return self._trusted_prefix(Match(tokens=matched, entries=tuple(used), rows=rows))

  def graft(self, tokens, *, whole_blocks: bool = False) -> tuple[Context, Match]:
    """A fresh context holding the longest stored prefix of `tokens` at its own positions. A
    block that fails verification is quarantined and the prefix ends before it (the caller's
    engine computes the rest). whole_blocks: a prefix that ends inside a block and is followed
    by more tokens ends at that block's start instead (what a put builds on: the rows of a
    partly matching block belong to another block, which a block computed after them would not
    name as its parent, so a forgery there would pass into it unrecorded)."""
    tokens = [int(t) for t in tokens]
    while True:
      match = self.lookup(tokens)
      if whole_blocks and match.tokens % self.block_tokens and match.tokens < len(tokens):
        entries = match.entries[:-1]
        match = Match(tokens=match.tokens - match.rows, entries=entries,
                      rows=len(entries[-1]['tokens']) if entries else 0)
      if not match.tokens:
        return self.engine.empty(), match
      try:
        rows = self._rows(match)
      except BadBlock as bad:  # each retry removes one bad block, so this ends
        self.quarantine_object(bad.entry, bad.reason)
        continue
      return self.engine.graft(rows, tokens[:match.tokens]), match

  def _rows(self, match: Match) -> list[kvs.KVRows]:
    """Each matched block's rows, read as far as the graft attends to them."""
    n = match.tokens
    ring = self.engine.local_slots
    used = [len(e['tokens']) for e in match.entries[:-1]] + [match.rows]
    # A block wholly behind every ring is read for its global layers only.
    wanted = [(entry, entry['start'] + rows <= n - ring)
              for entry, rows in zip(match.entries, used)]
    out = []
    for (entry, _), rows, leaves in zip(wanted, used, self.read_blocks(wanted)):
      if isinstance(leaves, BlockError):
        raise BadBlock(entry, str(leaves))
      start = entry['start']
      k = tuple(leaves.get(f'layer_{i}/k') for i in self.engine.config.cache_layers)
      v = tuple(leaves.get(f'layer_{i}/v') for i in self.engine.config.cache_layers)
      positions = np.arange(start, start + len(entry['tokens']), dtype=np.int32)
      out.append(kvs.KVRows(start, k, v, (positions,) * len(k)).prefix(rows))
    return out

  def stats(self) -> dict:
    entries = self.entries()
    objects = sum(e['object_bytes'] for e in entries)
    tokens = sum(len(e['tokens']) for e in entries)
    return {'url': self.url, 'namespace': self.namespace, 'objects': len(entries),
            'bytes': objects, 'tokens_addressable': tokens,
            'bytes_per_token': objects / tokens if tokens else None,
            'block_tokens': self.block_tokens}

  def destroy(self) -> None:
    """Deletes the whole store (every object, entry and its description)."""
    self.backing.delete_all()
    self._entries.clear()
    self.host = HostCache(self.host.capacity)


def _common_prefix(a, b) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n
