"""The knowledge store: KV computed once, found again by its content, grafted byte-exactly.

    store = Store('file:///data/kv/', engine)          # a byte-exact engine; any kvstore URL
    store.put(tokens)                                  # deposits the blocks not stored yet
    ctx, match = store.graft(tokens)                   # the longest stored prefix, grafted
    ctx, logits = engine.extend(ctx, tokens[match.tokens:] + query, logits=...)

Content addressing (blocks.py). The unit is the engine's block (its rows_per_call): B tokens at
sequence indices kB .. kB + B - 1, keyed by a SHA-256 chain over the namespace (model, engine,
layout, machine), the parent block's key and the block's token ids. Contexts that share a
prefix share its blocks; a context's last block may be partial. Lookup returns the longest
stored prefix at token granularity: a query that diverges inside a block still reuses that
block's first rows, since under a byte-exact engine (spec, pinned, blocked) a row's bits do not
depend on the rows after it (tests/test_store.py proves it on every family).

Storage (kvstore.py): TensorStore's kvstore, so the same store runs on local disk, in
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

The Store is the one place of the public API. It composes parts, each an object of one job that
receives what it depends on in its constructor (graph: each needs only those before it):

    shared.py       names, Codec (the block formats bound to the namespace), Problems (what
                    was refused, logged), Kind (what a Problem is), Match, StoreError
    reads.py        Reads(backing, codec, host, counters): object reads, decoding, host tier
    trust.py        Trust(backing, problems, signing_key, trusted_keys): signatures, parents
    index.py        Index(backing, codec, problems, reads): entries, rebuild, quarantine
    lookup.py       Lookup(engine, codec, index, reads, trust): the longest prefix, graft
    publish.py      Publication(backing, codec, engine, counters, lookup, index, reads, trust,
                    after_step): put, read top to bottom (write, read back, publish, leases)
    maintenance.py  Maintenance(backing, codec, engine, index, reads): verify, audit, gc
"""

from __future__ import annotations

import collections
import dataclasses
import json
from typing import Any, Callable, Sequence

import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax.digest import canonical_json
from graft.engine import Context, Engine, fingerprint
from graft.engine.fingerprint import differences
from graft.store import blocks, signing
from graft.store import compose as composing
from graft.store.compose import ComposeError, Recompute
from graft.store.documents import Document, DocumentError, Documents
from graft.store.index import Index
from graft.store.kvstore import KvStore
from graft.store.lookup import Lookup
from graft.store.maintenance import Maintenance
from graft.store.publish import Publication
from graft.store.reads import HostCache, Reads
from graft.store.shared import (DESCRIPTION, LEASE_SECONDS, Codec, Kind, Match, Problem,
                                Problems, StoreError)
from graft.store.trust import Trust

__all__ = ['LEASE_SECONDS', 'Composition', 'Document', 'HostCache', 'Kind', 'Match', 'Problem',
           'Recompute', 'Store', 'StoreError']


@dataclasses.dataclass(frozen=True)
class Composition:
  """What `Store.compose` made: the composed context, the query's logits [Q, V] float32 (None
  without a query) and the record of the composition (graft/store/compose.py)."""

  context: Context
  logits: np.ndarray | None
  record: dict


class Store:
  """A store at `url` bound to one namespace: the byte-exact `engine`'s model and configuration.

  Args:
    url: a kvstore URL, or an open KvStore (another view of the same storage: a memory://
      store is private to the KvStore that opened it; a wrapper that injects faults).
    engine: the byte-exact engine (spec, pinned or blocked) whose KV the store holds.
    host_cache_bytes: the bound of the host tier (an LRU of verified blocks).
    create: whether a missing store is created (else StoreError).
    signing_key: this writer's key; every block it publishes or finds identical is signed.
    trusted_keys: when given, only blocks signed by one of them are grafted (the rest are
      misses, reported); when None, every verified block is (the writers are trusted).
    namespace_salt: a tenant's secret; stores of another salt are another namespace.
    after_step: called after each step of a put ('written', 'verified', 'published') with the
      batch's object names: tests pause a writer or run other operations there
      (graft/store/publish.py's `pause_at`); None in use.
  """

  def __init__(self, url: str | KvStore, engine: Engine, *, host_cache_bytes: int = 1 << 30,
               create: bool = True, signing_key: signing.SigningKey | None = None,
               trusted_keys: tuple[signing.PublicKey, ...] | None = None,
               namespace_salt: str = '',
               after_step: Callable[[str, list[str]], None] | None = None):
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
                                      namespace_salt)  # this engine's; the store's may be older
    self.namespace = _open(self.backing, self.description(), namespace_salt, create)
    self.signing_key, self.trusted_keys = signing_key, trusted_keys
    self.problems = Problems(self.url)  # every entry or object refused, in order
    # reads by tier, bytes, blocks written, conflicts
    self.counters: collections.Counter[str] = collections.Counter()
    codec = Codec(self.namespace, self.block_layout, engine.model_config.vocab_size,
                  self.block_layout.block_tokens)
    self._reads = Reads(self.backing, codec, HostCache(host_cache_bytes), self.counters)
    self._trust = Trust(self.backing, self.problems, signing_key, trusted_keys)
    self._index = Index(self.backing, codec, self.problems, self._reads)
    self._lookup = Lookup(engine, codec, self._index, self._reads, self._trust)
    self._publication = Publication(self.backing, codec, engine, self.counters, self._lookup,
                                    self._index, self._reads, self._trust, after_step)
    self._maintenance = Maintenance(self.backing, codec, engine, self._index, self._reads)
    self._documents = Documents(engine, codec, self._lookup, self._publication)

  @property
  def host(self) -> HostCache:
    """The host tier: an LRU of verified blocks (assignable: a cache of capacity 0 turns the
    tier off)."""
    return self._reads.host

  @host.setter
  def host(self, cache: HostCache) -> None:
    self._reads.host = cache

  def description(self) -> dict:
    """What store.json records: the format, namespace, block tokens and both fingerprints."""
    return {'format': blocks.STORE_FORMAT, 'namespace': self.namespace,
            'block_tokens': self.block_tokens, 'model': self.engine.model_fingerprint,
            'engine': self.engine.fingerprint}

  # Reads ---------------------------------------------------------------------------------------

  def lookup(self, tokens: Sequence[int]) -> Match:
    """The longest stored prefix of `tokens` (token ids from position 0), at token
    granularity: a block that fails verification, is not signed by a trusted key or was
    computed on another version of its parent ends it (reported in `problems`)."""
    return self._lookup.match(tokens)

  def graft(self, tokens: Sequence[int], *,
            whole_blocks: bool = False) -> tuple[Context, Match]:
    """The longest stored prefix of `tokens`, grafted. A block that fails verification is
    quarantined and the prefix ends before it (the caller's engine computes the rest).

    Args:
      tokens: T token ids from position 0.
      whole_blocks: a prefix that ends inside a block and is followed by more tokens ends at
        that block's start instead (what a put builds on).

    Returns:
      A fresh context of the engine holding the match's rows at their own positions (its KV:
      the engine's one fixed cache, [B=1, S, K, H] per layer), and the match.
    """
    return self._lookup.graft(tokens, whole_blocks=whole_blocks)

  def read_blocks(self, wanted: list[tuple[dict, bool]]) -> list:
    """Blocks' verified leaves, per (entry, global_only): {'layer_<i>/k', 'layer_<i>/v':
    [T, K, H] array} (T: the block's tokens), or the BlockError that refused the block."""
    return self._reads.read_blocks(wanted)

  def entries(self) -> list[dict]:
    """Every published entry reachable from the root, verified, in (start, key) order."""
    return self._index.entries()

  def stats(self) -> dict:
    """The store's URL, namespace, objects, bytes and tokens addressable."""
    entries = self.entries()
    objects = sum(e['object_bytes'] for e in entries)
    tokens = sum(len(e['tokens']) for e in entries)
    return {'url': self.url, 'namespace': self.namespace, 'objects': len(entries),
            'bytes': objects, 'tokens_addressable': tokens,
            'bytes_per_token': objects / tokens if tokens else None,
            'block_tokens': self.block_tokens}

  # Writes --------------------------------------------------------------------------------------

  def put(self, tokens: Sequence[int], *, recompute: bool = False) -> dict:
    """Deposits `tokens` (a context from position 0): every block not stored yet is computed
    and published (graft/store/publish.py); `recompute` computes every block and compares it
    with what is stored (a stored block that differs is a conflict: replaced, quarantined,
    reported). Returns what it did: tokens, blocks reused and written, conflicts, bytes,
    seconds computing and storing."""
    return self._publication.put(tokens, recompute=recompute)

  def rebuild_index(self) -> int:
    """Publishes an entry for every verified object that has none (an index lost or damaged
    can always be rebuilt from the objects' headers); returns how many it wrote."""
    return self._index.rebuild_index()

  def quarantine(self, key: str, name: str, reason: str, *, kind: Kind | None = None,
                 entry_name: str | None = None, data: bytes | None = None,
                 judged: Any = None) -> None:
    """Reports a bad entry or object `name` of block `key` (as `kind`; default: a bad object
    or entry, as `name` is one) and moves it aside: a copy and the reason go under quarantine/,
    the entry `entry_name` is removed if it still holds `judged` (its bytes or decoded entry),
    and an object is deleted only if it still holds the bytes judged (`data`, when the caller
    read them)."""
    self._index.quarantine(key, name, reason, kind=kind, entry_name=entry_name, data=data,
                           judged=judged)

  def quarantine_object(self, entry: dict, reason: str, judged: Any = None) -> None:
    """A published block that failed verification: its object, if not sound on its own, and
    its entry are moved aside; a sound object's entry is rebuilt from it
    (`Index.quarantine_object`)."""
    self._index.quarantine_object(entry, reason, judged)

  # Documents -----------------------------------------------------------------------------------

  def put_document(self, prefix: Sequence[int], document: Sequence[int], *, recompute: bool = False) -> dict:
    """Deposits `document` (token ids) computed after `prefix` (token ids from position 0, e.g.
    BOS and an instruction): the prefix's blocks, then the document's own chain, keyed by the
    namespace, the prefix and the document's tokens and not by where it will be placed
    (graft/store/documents.py). `recompute` as for `put`. Returns what it did, as `put` does,
    with the stored `document` (a Document). DocumentError (nothing written) for an empty
    prefix or document, a token outside the vocabulary, or a prefix + document longer than the
    cache."""
    return self._documents.put(prefix, document, recompute=recompute)

  def read_document(self, prefix: Sequence[int], document: Sequence[int]) -> kvs.KVRows | None:
    """A stored document's rows, verified: every layer's K and V [L, K, H] at sequence indices
    and positions p .. p + L - 1 after the prefix (p = len(prefix)); None when it is not stored
    whole and usable (a block refused on the way is quarantined and reported in `problems`)."""
    prefix, document = self._documents.check(prefix, document)
    found = self._documents.read(prefix, document)
    return None if found is None else found[0]

  def compose(self, prefix: Sequence[int],
              documents: Sequence[Document | Sequence[int]], query: Sequence[int] = (), *, recompute: Recompute = Recompute(),
              rerotate: bool = False) -> 'Composition':
    """The prefix followed by `documents` in the order given, each placed from its stored rows
    wherever it falls, then `query` (graft/store/compose.py).

    Args:
      prefix: token ids from position 0, the prefix the documents were stored after.
      documents: each a sequence of token ids or a Document (`put_document`'s); a document not
        stored whole is computed by the engine after the prefix (and not stored: a reader
        writes nothing).
      query: token ids after the documents (may be empty: the context is then ready for
        queries).
      recompute: which document tokens are computed again (Recompute: none, cacheblend, epic,
        window, at a fraction); at fraction 1.0 every token is, and the result is the fresh
        computation bit for bit.
      rerotate: a float-RoPE engine's keys turned by each document's shift (CacheBlend's
        re-rotation: not exact, recorded); refused under RoPE 'relative', required under
        'float'.

    Returns:
      A Composition: the context (prefix, documents, query; its KV the engine's fixed cache),
      the query's float32 logits [Q, V] (None without a query) and a record of what was placed
      where (each document's key, length, offset, shift, source), the strategy and what it
      recomputed.

    Raises:
      DocumentError / ComposeError (nothing computed or written): an empty document, a
      document or context longer than the cache, a Document stored after another prefix, a
      float engine without rerotate (or a relative one with it).
    """
    checked: list[Sequence[int]] = []
    for i, doc in enumerate(documents):
      tokens = doc.tokens if isinstance(doc, Document) else doc
      prefix, tokens = self._documents.check(prefix, tokens, f'document {i}')
      if isinstance(doc, Document):
        if doc.prefix_key != self._documents.prefix_key(prefix):
          raise DocumentError(f'document {i} was stored after another prefix (of '
                              f'{doc.prefix_tokens} tokens, key {doc.prefix_key[:16]}..), not '
                              f'this one ({len(prefix)} tokens, key '
                              f'{self._documents.prefix_key(prefix)[:16]}..)')
      checked.append(tokens)
    if not checked:
      raise DocumentError('a composition needs at least one document')
    prefix = [int(t) for t in prefix]
    query = [int(t) for t in query]
    total = len(prefix) + sum(len(d) for d in checked) + len(query)
    if total > self.engine.engine_config.cache_len:
      raise DocumentError(f'the prefix, documents and query ({total} tokens) do not fit the '
                          f'cache of {self.engine.engine_config.cache_len} slots')
    composing.check_mode(self.engine, rerotate)
    prefix_ctx, match = self._lookup.graft(prefix)
    if match.tokens < len(prefix):
      prefix_ctx, _ = self.engine.extend(prefix_ctx, prefix[match.tokens:], logits='none',
                                         consume=True)
    rows, sources = [], []
    for tokens in checked:
      found = self._documents.read(prefix, tokens)
      if found is None:
        rows.append(composing.compute_rows(self.engine, prefix_ctx, tokens))
        sources.append({'source': 'computed', 'key': self._documents.keys(prefix, tokens)[-1]})
      else:
        rows.append(found[0])
        sources.append({'source': 'store', 'key': found[1].entries[-1]['key']})
    ctx, record = composing.compose(self.engine, prefix_ctx, checked, rows, recompute=recompute,
                                    rerotate=rerotate)
    record['prefix_key'] = self._documents.prefix_key(prefix)
    record['prefix_grafted'] = match.tokens
    for entry, source in zip(record['documents'], sources):
      entry.update(source)
    logits = None
    if query:
      ctx, logits = self.engine.extend(ctx, query, logits='all', consume=True)
    return Composition(context=ctx, logits=logits, record=record)

  # Maintenance ---------------------------------------------------------------------------------

  def verify(self) -> list[Problem]:
    """Reads and checks every entry and object of the store (without changing it): every
    problem found, named and of a Kind. Unreachable entries, unpublished objects and stray
    names are listed too."""
    return self._maintenance.verify()

  def audit(self, fraction: float = 1.0, *, seed: int = 0) -> list[Problem]:
    """Recomputes a `fraction` of the store's blocks (chosen with `seed`) with this store's
    engine and compares their bytes: forgeries, and the blocks built on them. Nothing is
    changed; returns a Problem for each, in chain order."""
    return self._maintenance.audit(fraction, seed=seed)

  def gc(self, *, lease_seconds: float = LEASE_SECONDS) -> dict:
    """Removes unpublished objects no live lease holds (a lease older than `lease_seconds` is
    a dead writer's) and quarantines entries that fail verification, as `verify` finds them
    (`Maintenance.gc`, which reads the leases after this listing). Returns how many objects
    and entries it removed."""
    return self._maintenance.gc(self.verify(), lease_seconds=lease_seconds)

  def destroy(self) -> None:
    """Deletes the whole store (every object, entry and its description)."""
    self.backing.delete_all()
    self._index.clear()
    self.host.clear()


def _open(backing: KvStore, mine: dict, salt: str, create: bool) -> str:
  """The namespace the store at `backing` holds blocks under: `mine` (this engine's
  description) is written when there is no store and `create`; a store made under the same
  model and bits keeps its own namespace (an older fingerprint). StoreError names the URL and
  why otherwise."""
  url = backing.url
  data = backing.read(DESCRIPTION)
  if data is None:
    if not create:
      raise StoreError(f'no store at {url} (no {DESCRIPTION})')
    if backing.write_if_absent(DESCRIPTION, canonical_json(mine)):
      return mine['namespace']
    data = backing.read(DESCRIPTION)  # another process created it first
  try:
    if data is None:
      raise TypeError('it is gone')
    theirs = json.loads(data)
  except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
    raise StoreError(f'{url}{DESCRIPTION} is damaged ({e})') from None
  if not isinstance(theirs, dict) or theirs.get('format') != blocks.STORE_FORMAT:
    raise StoreError(f'{url} is not a {blocks.STORE_FORMAT} store')
  for part in ('model', 'engine'):
    if not fingerprint.hashes_to_its_fields(theirs.get(part)):
      raise StoreError(f'{url}{DESCRIPTION}: its {part} fingerprint does not hash to the '
                       'fields recorded beside it (altered?)')
  if blocks.namespace(theirs['model'], theirs['engine'], salt) != theirs.get('namespace'):
    raise StoreError(f'{url}{DESCRIPTION} does not hash to its namespace under this '
                     'salt (another tenant\'s store, or altered)')
  if theirs['namespace'] == mine['namespace']:
    return mine['namespace']
  diffs = fingerprint.engine_differences(mine['engine'], theirs['engine'],
                                         labels=('the store has', 'expected'))
  if theirs['model']['sha256'] != mine['model']['sha256']:
    diffs = [d for d in differences(mine['model'], theirs['model'],
                                    labels=('the store has', 'expected'))
             if not d.startswith('sha256')] + diffs
  if diffs:
    raise StoreError(f'{url} was made under another model or engine configuration '
                     f'(namespace {str(theirs.get("namespace"))[:16]}..): ' + '; '.join(diffs[:8]))
  # The same model and bits under an older fingerprint (a spec store of an earlier release):
  # its blocks are this engine's blocks, under the namespace they were written in.
  return theirs['namespace']
