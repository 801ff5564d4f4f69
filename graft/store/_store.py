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
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import json
import os
import re
import sys
import time
import uuid

from absl import logging
import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax import digest
from graft.store import blocks, signing
from graft.store.artifact import differences
from graft.store.blocks import BlockError
from graft.engine import Context, Engine, fingerprint
from graft.store.kvstore import KvStore, ShortValueError

_DESCRIPTION = 'store.json'
# Hashing runs in threads: hashlib and blake3 release the GIL on large buffers.
_POOL = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
_HEX64 = re.compile('[0-9a-f]{64}')
_OBJECT_NAME = re.compile('objects/[0-9a-f]{64}\\.[0-9a-f]{32}')
_WRITE_BATCH = 64  # blocks computed before they are written together (bounds host memory)
# A test hook for killing a writer process at a known point of a put: with PAUSE_ENV='STEP:N' in
# its environment ('written', 'verified' or 'published'; N-th time, default 1), the process
# prints PAUSED, the step and the batch's object names (JSON) on stderr and then waits to be
# killed (tests/test_store.py, graft/faults.py's kill_put), or, with RESUME_ENV naming a file,
# until that file exists (a barrier that makes two writers overlap: tests/test_store.py).
PAUSE_ENV = 'GEMMA_JAX_STORE_PAUSE'
RESUME_ENV = 'GEMMA_JAX_STORE_RESUME'
PAUSED = 'store put paused after step'
_steps_reached = collections.Counter()
# Bytes read for a header: enough for any block object's preamble and header (about 150 bytes
# per leaf), so a graft reads a block far behind its end (global layers only) in one read.
_HEADER_PROBE = 1 << 16
# How long a put's lease keeps its unpublished objects from gc (a put publishes a batch within
# seconds; a lease this old is a writer that was killed). Like git's prune expiry.
LEASE_SECONDS = 3600.0


class StoreError(ValueError):
  """A store that cannot be used with this engine; the message says why."""


class _BadBlock(Exception):
  """A published block whose object failed verification during a graft."""

  def __init__(self, entry: dict, reason: str):
    super().__init__(reason)
    self.entry, self.reason = entry, reason


@dataclasses.dataclass(frozen=True)
class Match:
  """The longest stored prefix of a token sequence: `tokens` tokens, covered by `entries` (the
  last one possibly used for its first rows only: `rows` of it)."""

  tokens: int
  entries: tuple[dict, ...]
  rows: int  # rows used of the last entry


@dataclasses.dataclass
class Problem:
  """A bad entry or object: what was found and why it was refused."""

  key: str
  name: str  # the kvstore key that was read
  reason: str


class HostCache:
  """An LRU of verified blocks, bounded in bytes. Entries are (object name, part) ->
  {leaf name: array}; a whole block also serves a request for its global part."""

  def __init__(self, capacity_bytes: int):
    self.capacity = capacity_bytes
    self.bytes = 0
    self._items: collections.OrderedDict = collections.OrderedDict()

  def get(self, name: str, global_only: bool):
    for part in (('all', 'global') if global_only else ('all',)):
      if (name, part) in self._items:
        self._items.move_to_end((name, part))
        return self._items[(name, part)][0]
    return None

  def put(self, name: str, global_only: bool, leaves: dict) -> None:
    size = sum(a.nbytes for a in leaves.values())
    if size > self.capacity:
      return
    key = (name, 'global' if global_only else 'all')
    if key in self._items:
      return
    self._items[key] = (leaves, size)
    self.bytes += size
    while self.bytes > self.capacity:
      _, (_, dropped) = self._items.popitem(last=False)
      self.bytes -= dropped

  def drop(self, name: str) -> None:
    for part in ('all', 'global'):
      item = self._items.pop((name, part), None)
      if item:
        self.bytes -= item[1]


class Store:
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

  # --------------------------------------------------------------------------------------------
  # The namespace

  def description(self) -> dict:
    return {'format': blocks.STORE_FORMAT, 'namespace': self.namespace,
            'block_tokens': self.block_tokens, 'model': self.engine.model_fingerprint,
            'engine': self.engine.fingerprint}

  def _open(self, create: bool) -> None:
    mine = self.description()
    data = self.backing.read(_DESCRIPTION)
    if data is None:
      if not create:
        raise StoreError(f'no store at {self.url} (no {_DESCRIPTION})')
      if self.backing.write_if_absent(_DESCRIPTION, blocks.canonical(mine)):
        return
      data = self.backing.read(_DESCRIPTION)  # another process created it first
    try:
      theirs = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
      raise StoreError(f'{self.url}{_DESCRIPTION} is damaged ({e})') from None
    if not isinstance(theirs, dict) or theirs.get('format') != blocks.STORE_FORMAT:
      raise StoreError(f'{self.url} is not a {blocks.STORE_FORMAT} store')
    for part in ('model', 'engine'):
      if not fingerprint.hashes_to_its_fields(theirs.get(part)):
        raise StoreError(f'{self.url}{_DESCRIPTION}: its {part} fingerprint does not hash to the '
                         'fields recorded beside it (altered?)')
    if theirs.get('namespace') != mine['namespace']:
      diffs = [d for d in differences({k: mine[k] for k in ('model', 'engine')},
                                      {k: theirs.get(k) for k in ('model', 'engine')},
                                      labels=('the store has', 'expected'))
               if not d.endswith('sha256') and '.sha256:' not in d]
      raise StoreError(f'{self.url} was made under another model or engine configuration '
                       f'(namespace {str(theirs.get("namespace"))[:16]}..): '
                       + ('; '.join(diffs[:8]) or 'the fingerprints differ'))
    if blocks.namespace(theirs['model'], theirs['engine'], self.salt) != mine['namespace']:
      raise StoreError(f'{self.url}{_DESCRIPTION} does not hash to its namespace')

  # --------------------------------------------------------------------------------------------
  # Reading entries and objects (every read verified)

  def _report(self, key: str, name: str, reason: str) -> None:
    self.problems.append(Problem(key=key, name=name, reason=reason))
    logging.warning('store %s: refusing %s (block %s..): %s', self.url, name, key[:16], reason)

  def _entries_many(self, wanted: list[tuple[str, str, int]]) -> list[dict | None]:
    """The verified entries index/<parent>/<key> of blocks at sequence index `start`, for each
    (parent, key, start), read concurrently: None where missing, or bad (then quarantined)."""
    todo = [w for w in wanted if w[1] not in self._entries]
    names = [f'index/{parent}/{key}' for parent, key, _ in todo]
    for (parent, key, start), name, data in zip(todo, names,
                                                self.backing.read_many([(n, None) for n in names])):
      if data is None:
        continue
      try:
        if isinstance(data, Exception):
          raise BlockError(str(data))
        self._entries[key] = blocks.decode_entry(
            data, ns=self.namespace, parent=parent, key=key, expected_start=start,
            layout=self.block_layout, vocab_size=self.engine.config.vocab_size)
      except BlockError as e:
        self.quarantine(key, name, str(e), entry_name=name, data=data, judged=data)
        self._rebuild_entry(parent, key)
        if self.backing.read(name) is not None:  # rebuilt: read it as any entry
          self._entries_many([(parent, key, start)])
    return [self._entries.get(key) for _, key, _ in wanted]

  def _rebuild_entry(self, parent: str, key: str) -> None:
    """Publishes the entry of the block's sound object, if one is stored (an entry that was
    damaged costs no sound object)."""
    for name in self.backing.list(f'objects/{key}.'):
      entry = self._sound_object(name, key)
      if entry is not None and json.loads(entry)['parent'] == parent:
        self.backing.write_if_absent(f'index/{parent}/{key}', entry)
        return

  def _entry(self, parent: str, key: str, start: int) -> dict | None:
    return self._entries_many([(parent, key, start)])[0]

  def _children(self, parent: str, start: int) -> list[dict]:
    keys = []
    for name in self.backing.list(f'index/{parent}/'):
      key = name[len(f'index/{parent}/'):]
      if _HEX64.fullmatch(key):
        keys.append(key)
      else:  # a name this store never makes: reported, never followed
        self._report(key[:64], name[:200], 'not an index entry name')
    return [e for e in self._entries_many([(parent, k, start) for k in keys]) if e is not None]

  def _request(self, entry: dict, global_only: bool) -> tuple[str, tuple[int, int] | None]:
    """What to read of an entry's object: all of it, or (global only) its first bytes, which
    hold the preamble, the header and the global layers' rows."""
    name = f'objects/{entry["object"]}'
    if not global_only:
      return name, None
    wanted = _HEADER_PROBE + self.block_layout.global_bytes(len(entry['tokens']))
    return name, (0, min(entry['object_bytes'], wanted))

  def _decode_object(self, entry: dict, global_only: bool, probe) -> dict[str, np.ndarray]:
    """The leaves of an entry's object from the bytes read by its `_request`, verified
    (BlockError if anything is wrong); reads the rest only when the header ran longer."""
    name = f'objects/{entry["object"]}'
    size = entry['object_bytes']
    if isinstance(probe, ShortValueError):
      raise BlockError('the object is shorter than its entry says (truncated)')
    if probe is None:
      raise BlockError('the object is missing')
    if not global_only and len(probe) != size:
      raise BlockError(f'the object has {len(probe)} bytes, its entry says {size} (truncated or '
                       'extended)')
    offset, length = blocks.header_span(probe)
    if offset + length > len(probe):
      probe = self._read_range(name, 0, offset + length)
    header_bytes = probe[offset:offset + length]
    if len(header_bytes) != length:
      raise BlockError('the object is truncated inside its header')
    if hashlib.sha256(header_bytes).hexdigest() != entry['header_sha256']:
      raise BlockError('the object\'s header does not match its index entry')
    header = blocks.decode_header(header_bytes, ns=self.namespace, expected_key=entry['key'],
                                  layout=self.block_layout, vocab_size=self.engine.config.vocab_size)
    if (header['parent'], header['parent_header_sha256'], header['start'], header['tokens']) != (
        entry['parent'], entry['parent_header_sha256'], entry['start'], entry['tokens']):
      raise BlockError('the object\'s header and its index entry disagree')
    data_start = offset + length
    if global_only:
      stop = data_start + header['global_bytes']
      data = (probe[data_start:stop] if stop <= len(probe)
              else self._read_range(name, data_start, stop))
    else:
      if data_start + header['data_bytes'] != size:
        raise BlockError('the object\'s size does not match its header')
      data = probe[data_start:]
    self.counters['backing_bytes'] += len(data) + data_start
    return blocks.decode_leaves(header, data, data_start, global_only=global_only,
                                layout=self.block_layout)

  def _read_object(self, entry: dict, global_only: bool) -> dict[str, np.ndarray]:
    """The entry's object's leaves (global layers only, or all), verified; BlockError if bad."""
    (probe,) = self.backing.read_many([self._request(entry, global_only)])
    return self._decode_object(entry, global_only, probe)

  def _read_range(self, name: str, start: int, stop: int) -> bytes:
    try:
      data = self.backing.read(name, (start, stop))
    except ShortValueError:
      raise BlockError('the object is shorter than its header says (truncated)') from None
    if data is None:
      raise BlockError('the object is missing')
    return data

  def read_blocks(self, wanted: list[tuple[dict, bool]]) -> list:
    """For each (entry, global_only): the block's verified leaves from the host tier, else from
    the backing store (all of those read concurrently, hashed in parallel), or the BlockError
    that refused it."""
    out = [self.host.get(entry['object'], global_only) for entry, global_only in wanted]
    self.counters['host_hits'] += sum(leaves is not None for leaves in out)
    missing = [i for i, leaves in enumerate(out) if leaves is None]
    if not missing:
      return out
    start = time.perf_counter()
    probes = self.backing.read_many([self._request(*wanted[i]) for i in missing])

    def decode(i, probe):
      try:
        return self._decode_object(*wanted[i], probe)
      except BlockError as e:
        return e

    for i, leaves in zip(missing, _POOL.map(decode, missing, probes)):
      out[i] = leaves
      if not isinstance(leaves, BlockError):
        self.host.put(wanted[i][0]['object'], wanted[i][1], leaves)
    self.counters['backing_seconds'] += time.perf_counter() - start
    self.counters['backing_reads'] += len(missing)
    return out

  def quarantine_object(self, entry: dict, reason: str, judged=None) -> None:
    """A published block that failed verification. The object is checked on its own (its
    header, key chain and every leaf, not against the entry): if it is sound, the entry was the
    damaged one, and only the entry is moved aside and rebuilt from the object; otherwise the
    object and its entry are moved aside. judged: what the entry was judged as (default
    `entry`): it is removed only if it still holds that."""
    judged = entry if judged is None else judged
    name = f'objects/{entry["object"]}'
    entry_name = f'index/{entry["parent"]}/{entry["key"]}'
    sound = self._sound_object(name, entry['key'])
    if sound is None:
      self.quarantine(entry['key'], name, reason, entry_name=entry_name, judged=judged)
      self._rebuild_entry(entry['parent'], entry['key'])  # from another sound copy, if any
      return
    self.quarantine(entry['key'], entry_name, f'{reason}; the object is sound: the entry was '
                    'damaged and is rebuilt from it', entry_name=entry_name,
                    data=self.backing.read(entry_name), judged=judged)
    self.backing.write_if_absent(entry_name, sound)

  def _sound_object(self, name: str, key: str) -> bytes | None:
    """The index entry an object publishes, when the object verifies on its own (None
    otherwise)."""
    data = self.backing.read(name)
    if not data:
      return None
    try:
      offset, length = blocks.header_span(data)
      header_bytes = data[offset:offset + length]
      header = blocks.decode_header(header_bytes, ns=self.namespace, expected_key=key,
                                    layout=self.block_layout, vocab_size=self.engine.config.vocab_size)
      if offset + length + header['data_bytes'] != len(data):
        return None
      blocks.decode_leaves(header, data[offset + length:], offset + length, global_only=False,
                           layout=self.block_layout)
    except BlockError:
      return None
    return blocks.encode_entry(header, name.split('/', 1)[1], len(data), header_bytes)

  def quarantine(self, key: str, name: str, reason: str, *, entry_name: str | None = None,
                 data: bytes | None = None, judged=None) -> None:
    """Reports a bad entry or object and moves it aside: a copy and the reason go under
    quarantine/, the entry is removed if it still holds what was judged (`judged`: its bytes or
    decoded entry; so lookups miss and a later put rewrites the block), and the object is
    deleted if it still holds the bytes copied (conditionally on their generation; `data`: the
    bytes judged, if the caller read them)."""
    self._report(key, name, reason)
    self._entries.pop(key, None)
    generation = None
    if name.startswith('objects/'):
      current, generation = self.backing.read_versioned(name)
      if data is not None and current != data:
        generation = None  # rewritten since it was judged: not what was judged, kept
      data = current if data is None else data  # the bad bytes are kept, not lost
    record = uuid.uuid4().hex
    self.backing.write(f'quarantine/{record}.json', blocks.canonical(
        {'key': key, 'name': name, 'reason': reason, 'time': time.time()}))
    if data is not None:
      self.backing.write(f'quarantine/{record}.object', data)
    if entry_name:
      self._delete_entry_if(entry_name, judged)
    if name.startswith('objects/'):
      self.host.drop(name.split('/', 1)[1])
      if generation is not None:
        self.backing.delete_if(name, generation)

  def _delete_entry_if(self, entry_name: str, judged) -> bool:
    """Deletes an index entry only if it still holds what was judged bad (bytes, or the decoded
    entry; None: whatever it holds), conditionally on the generation read: another writer that
    has just re-published the key keeps its entry. True when this call deleted it."""
    current, generation = self.backing.read_versioned(entry_name)
    if current is None:
      return False
    if judged is not None and current != judged:
      try:
        if json.loads(current) != judged:
          return False
      except (ValueError, TypeError):
        return False
    return self.backing.delete_if(entry_name, generation)

  # --------------------------------------------------------------------------------------------
  # Lookup and graft

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

  def _trusted_prefix(self, match: Match) -> Match:
    """The match cut before its first block no trusted key signed (all of it without a trust
    list)."""
    if self.trusted_keys is None or not match.entries:
      return match
    wanted = [(e, f'signatures/{e["key"]}/{k.id}') for e in match.entries
              if e['header_sha256'] not in self._trusted for k in self.trusted_keys]
    for (entry, _), record in zip(wanted, self.backing.read_many([(n, None) for _, n in wanted])):
      digest = entry['header_sha256']
      self._trusted[digest] = self._trusted.get(digest, False) or signing.signed_by(
          None if isinstance(record, Exception) else record, digest, self.trusted_keys)
    for i, entry in enumerate(match.entries):
      if not self._trusted[entry['header_sha256']]:
        self._report(entry['key'], f'objects/{entry["object"]}',
                     'not signed by a trusted key (a miss: recomputed)')
        if i == 0:
          return Match(tokens=0, entries=(), rows=0)
        return Match(tokens=sum(len(e['tokens']) for e in match.entries[:i]),
                     entries=match.entries[:i], rows=len(match.entries[i - 1]['tokens']))
    return match

  def _sign(self, key: str, header_sha256: str) -> None:
    """Records this writer's signature of a block it computed (and found identical)."""
    if self.signing_key is not None:
      self.backing.write(f'signatures/{key}/{self.signing_key.public.id}',
                         self.signing_key.sign(header_sha256))

  def _on_parent(self, entry: dict, parent_header: str) -> bool:
    """Whether the block was computed on the parent stored now (its recorded parent header is
    that parent's). One computed on another version (a forgery since replaced, say) is as wrong
    as its parent was: it is a miss, reported, and the next put of its text replaces it (a
    conflict). It is not deleted here: the parent's own entry may be the damaged one."""
    if entry['parent_header_sha256'] == parent_header:
      return True
    self._report(entry['key'], f'objects/{entry["object"]}',
                 'computed on another version of its parent (its recorded parent header is not '
                 'the stored parent\'s): a miss')
    return False

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
      except _BadBlock as bad:  # each retry removes one bad block, so this ends
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
        raise _BadBlock(entry, str(leaves))
      start = entry['start']
      k = tuple(leaves.get(f'layer_{i}/k') for i in self.engine.config.cache_layers)
      v = tuple(leaves.get(f'layer_{i}/v') for i in self.engine.config.cache_layers)
      positions = np.arange(start, start + len(entry['tokens']), dtype=np.int32)
      out.append(kvs.KVRows(start, k, v, (positions,) * len(k)).prefix(rows))
    return out

  # --------------------------------------------------------------------------------------------
  # Put

  def put(self, tokens, *, recompute: bool = False) -> dict:
    """Deposits `tokens` (a context from position 0): grafts the longest stored prefix of whole
    blocks (the trusted one, with a trust list), computes the rest block by block with the
    engine and writes every block not stored yet; `recompute` computes every block and compares
    it with what is stored (a stored block that differs is a conflict: replaced, quarantined,
    reported). Returns what it did: tokens, blocks reused and written, conflicts, bytes,
    seconds computing and storing."""
    tokens = [int(t) for t in tokens]
    if not tokens:
      raise ValueError('nothing to put: the token list is empty')
    t0 = time.perf_counter()
    ctx, match = ((self.engine.empty(), Match(0, (), 0)) if recompute
                  else self.graft(tokens, whole_blocks=True))
    keys = blocks.chain_keys(self.namespace, tokens, self.block_tokens)
    # The block holding token `match.tokens` is the first one to write. (When every token is
    # matched, even a partial last block is addressable already: it is a prefix of a stored one.)
    first_new = (len(keys) if match.tokens == len(tokens)
                 else match.tokens // self.block_tokens)
    report = {'tokens': len(tokens), 'reused_tokens': match.tokens, 'blocks_written': 0,
              'blocks_existing': 0, 'bytes_written': 0, 'conflicts': 0, 'compute_seconds': 0.0,
              'storage_seconds': 0.0}
    # The header hash of the parent of the first block written: the stored block it was
    # grafted from (what this put computes on), else the root.
    parent_header = (match.entries[first_new - 1]['header_sha256'] if first_new else blocks.ROOT)
    batch = []  # (parent, start, tokens, leaves) computed and not yet stored
    for k in range(first_new, len(keys)):
      start, stop = k * self.block_tokens, min((k + 1) * self.block_tokens, len(tokens))
      t1 = time.perf_counter()
      if stop > len(ctx.tokens):
        ctx, _ = self.engine.extend(ctx, tokens[len(ctx.tokens):stop], logits='none',
                                    consume=True)
      rows = kvs.take_rows(ctx.kv, start, stop)
      leaves = {}
      for index, k_rows, v_rows in zip(self.engine.config.cache_layers, rows.k, rows.v):
        leaves[f'layer_{index}/k'], leaves[f'layer_{index}/v'] = k_rows, v_rows
      batch.append((keys[k - 1] if k else blocks.ROOT, start, tokens[start:stop], leaves))
      report['compute_seconds'] += time.perf_counter() - t1
      if len(batch) == _WRITE_BATCH or k == len(keys) - 1:
        t2 = time.perf_counter()
        written_bytes, parent_header, conflicts = self._write_blocks(batch, parent_header)
        report['conflicts'] += conflicts
        for written in written_bytes:
          report['blocks_written' if written else 'blocks_existing'] += 1
          report['bytes_written'] += written
        report['storage_seconds'] += time.perf_counter() - t2
        batch = []
    report['seconds'] = time.perf_counter() - t0
    return report

  def _write_blocks(self, batch, parent_header: str) -> tuple[list[int], str, int]:
    """Writes, verifies and publishes blocks [(parent, start, tokens, leaves)] of one chain,
    each step for the whole batch at once; `parent_header` is the header hash of the first
    one's parent. Returns the bytes written per block (0 where another writer's identical copy
    was published first), the header hash of the last block's copy that stands published and
    the conflicts found."""
    hashed = list(_POOL.map(lambda b: blocks.hash_leaves(b[3], len(b[2]), self.block_layout),
                            batch))
    first_parent_header = parent_header
    encoded = []
    for (parent, start, tokens, _), leaves in zip(batch, hashed):
      encoded.append(blocks.encode_block(self.namespace, parent, parent_header, start, tokens,
                                         leaves, self.block_layout))
      parent_header = blocks.header_sha256(encoded[-1][1])
    names = [f'objects/{key}.{uuid.uuid4().hex}' for key, _, _ in encoded]
    # The lease goes first and stays until the batch is published: gc reads leases before it
    # checks for publication, so it sees an object of this put either leased or published.
    lease = f'staging/{uuid.uuid4().hex}.json'
    self.backing.write(lease, blocks.canonical({'objects': names, 'time': time.time()}))
    try:
      out, standing, conflicts = self._publish_batch(batch, encoded, names, first_parent_header)
    finally:
      self.backing.delete(lease)
    return out, standing, conflicts

  def _publish_batch(self, batch, encoded, names,
                     first_parent_header: str) -> tuple[list[int], str, int]:
    """Writes, verifies and publishes the encoded blocks of `_write_blocks` under `names`.
    Returns the bytes written per block, the header hash of the last block's copy that stands
    published (another writer's equal copy may stand instead of ours, under another header
    when it is of an older format) and the conflicts found."""
    self.backing.write_many([(name, data) for name, (_, data, _) in zip(names, encoded)])
    self._step('written', names)
    for name, (_, data, _), kept in zip(names, encoded,
                                        self.backing.read_many([(n, None) for n in names])):
      if kept != data:  # what the storage layer kept
        self.backing.delete(name)
        raise StoreError(f'{self.url}: object {name} did not read back as written')
    self._step('verified', names)
    entries = []
    for (parent, _, _, _), name, (key, data, header) in zip(batch, names, encoded):
      offset, length = blocks.header_span(data)
      entries.append((f'index/{parent}/{key}', blocks.encode_entry(
          header, name.split('/', 1)[1], len(data), data[offset:offset + length])))
    published = self.backing.write_if_absent_many(entries)
    self._step('published', names)
    out, conflicts = [], 0
    standing = {batch[0][0]: first_parent_header}  # key -> header hash of its published copy
    for (parent, start, _, _), name, (key, data, header), (entry_name, entry_bytes), won in zip(
        batch, names, encoded, entries, published):
      standing[key] = blocks.header_sha256(data)
      if not won:
        won, conflict, theirs = self._publish_over(parent, start, key, name, header, entry_name,
                                                   entry_bytes, standing.get(parent))
        conflicts += conflict
        standing[key] = standing[key] if won else theirs
      self._sign(key, standing[key])
      self.counters['blocks_written'] += won
      out.append(len(data) if won else 0)
    return out, standing[encoded[-1][0]], conflicts

  def _step(self, step: str, names: list[str]) -> None:
    """Called after each step of a put ('written', 'verified', 'published') with the objects'
    names: tests pause or interleave other processes' operations at a step (in process by
    replacing this method; in another process through PAUSE_ENV)."""
    pause = os.environ.get(PAUSE_ENV)
    if not pause:
      return
    at, _, count = pause.partition(':')
    _steps_reached[step] += 1
    if at == step and _steps_reached[step] == int(count or 1):
      sys.stderr.write(f'{PAUSED} {step} {json.dumps(names)}\n')
      sys.stderr.flush()
      resume = os.environ.get(RESUME_ENV)
      while not (resume and os.path.exists(resume)):  # until resumed, or killed
        time.sleep(0.05 if resume else 3600)

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
      existing = self._entry(parent, key, start)
      if existing is not None and f'objects/{existing["object"]}' == name:
        return True, conflict, None  # ours, published by a rebuild_index beside this put
      if existing is not None:
        try:
          stored = self._read_object(existing, global_only=False)
          theirs = self._header_of(existing)
          # Their verified leaves hashed as ours are (an object of an older format carries
          # another hash).
          hash_name = blocks.content_hash(header)
          same = (all(digest.hexdigest(hash_name, stored[leaf['name']]) == leaf[hash_name]
                      for leaf in header['leaves'])
                  and theirs['parent_header_sha256'] in (header['parent_header_sha256'],
                                                         parent_standing))
          if same:
            self.backing.delete(name)  # first writer wins; ours was a copy
            return False, conflict, existing['header_sha256']
          conflict = True
          self.counters['conflicts'] += 1
          self.quarantine(existing['key'], f'objects/{existing["object"]}',
                          'conflict: its bytes differ from this writer\'s computation of the '
                          'same block (or it was computed on another version of its parent)',
                          entry_name=entry_name, judged=existing)
        except BlockError as e:
          self.quarantine_object(existing, str(e))
      if self.backing.write_if_absent(entry_name, entry_bytes):
        return True, conflict, None
    raise StoreError(f'{self.url}: could not publish block {key[:16]}..')

  def _header_of(self, entry: dict) -> dict:
    """The verified header of an entry's object (its preamble and header read)."""
    name = f'objects/{entry["object"]}'
    probe = self._read_range(name, 0, min(entry['object_bytes'], _HEADER_PROBE))
    offset, length = blocks.header_span(probe)
    if offset + length > len(probe):
      probe = self._read_range(name, 0, offset + length)
    return blocks.decode_header(probe[offset:offset + length], ns=self.namespace,
                                expected_key=entry['key'], layout=self.block_layout,
                                vocab_size=self.engine.config.vocab_size)

  # --------------------------------------------------------------------------------------------
  # Maintenance: listing, verification, garbage collection, statistics

  def entries(self) -> list[dict]:
    """Every published entry reachable from the root, verified, in (start, key) order."""
    out, frontier = [], [(blocks.ROOT, 0)]
    while frontier:
      parent, start = frontier.pop()
      for entry in self._children(parent, start):
        out.append(entry)
        frontier.append((entry['key'], start + self.block_tokens))
    return sorted(out, key=lambda e: (e['start'], e['key']))

  def verify(self) -> list[Problem]:
    """Reads and checks every entry and object of the store (without changing it): every
    problem found, named. Unreachable entries and unpublished objects are listed too."""
    problems: list[Problem] = []
    names = self.backing.list('index/')
    reachable = {blocks.ROOT}
    by_parent = collections.defaultdict(list)
    for name in names:
      parts = name.split('/')
      if len(parts) != 3 or not all(_HEX64.fullmatch(p) for p in parts[1:]):
        problems.append(Problem('', name[:200], 'stray: not a name this store makes (left '
                                'alone: never read, followed or deleted)'))
        continue
      by_parent[parts[1]].append(parts[2])
    frontier = [(blocks.ROOT, 0)]
    published = set()
    while frontier:
      parent, start = frontier.pop()
      for key in by_parent.get(parent, []):
        name = f'index/{parent}/{key}'
        try:
          entry = blocks.decode_entry(self.backing.read(name) or b'', ns=self.namespace,
                                      parent=parent, key=key, expected_start=start,
                                      layout=self.block_layout,
                                      vocab_size=self.engine.config.vocab_size)
        except BlockError as e:
          problems.append(Problem(key, name, str(e)))
          continue
        published.add(entry['object'])
        reachable.add(key)  # its children are addressed by key whatever its object holds
        frontier.append((key, start + self.block_tokens))
        try:
          self._read_object(entry, global_only=False)
        except BlockError as e:
          problems.append(Problem(key, name, f'its object: {e}'))
    for parent, keys in by_parent.items():
      if parent not in reachable:
        problems += [Problem(k, f'index/{parent}/{k}', 'unreachable: its parent is not '
                     'published') for k in keys]
        published.update(self._object_named(f'index/{parent}/{k}') for k in keys)
    for name in self.backing.list('objects/'):
      if not _OBJECT_NAME.fullmatch(name):
        problems.append(Problem('', name[:200], 'stray: not a name this store makes (left '
                                'alone: never read, followed or deleted)'))
      elif name.split('/', 1)[1] not in published:
        problems.append(Problem(name.split('/', 1)[1][:64], name,
                                'not published (left by an interrupted or losing put)'))
    return problems

  def _object_named(self, entry_name: str) -> str | None:
    """The object an entry names, as written (not verified; None if it names none)."""
    try:
      entry = json.loads(self.backing.read(entry_name) or b'null')
    except ValueError:
      return None
    return entry.get('object') if isinstance(entry, dict) else None

  def audit(self, fraction: float = 1.0, *, seed: int = 0) -> list[Problem]:
    """Recomputes the store's blocks in chain order with this store's engine and compares the
    bytes of a `fraction` of them (chosen with `seed`; 1.0: every block) with what is stored:
    a block whose bytes differ is a forgery (or a writer's fault), and every block whose
    recorded parent header leads to it was built on it. Nothing is changed; returns a Problem
    for each, in chain order."""
    if not 0 < fraction <= 1:
      raise ValueError(f'the audited fraction must lie in (0, 1], not {fraction}')
    rng = np.random.default_rng(seed)
    problems, frontier = [], [(blocks.ROOT, 0, self.engine.empty(), None)]
    while frontier:
      parent, start, ctx, forged_header = frontier.pop()
      for entry in sorted(self._children(parent, start), key=lambda e: e['key']):
        child_ctx, _ = self.engine.extend(ctx, entry['tokens'], logits='none')
        bad = forged_header
        if forged_header is not None and entry['parent_header_sha256'] == forged_header:
          problems.append(Problem(entry['key'], f'objects/{entry["object"]}',
                                  'built on a forged block (its parent header is the forgery\'s)'))
          bad = entry['header_sha256']
        elif rng.random() < fraction:
          header = self._header_of(entry)
          rows = kvs.take_rows(child_ctx.kv, start, start + len(entry['tokens']))
          hash_name = blocks.content_hash(header)
          mine = {f'layer_{i}/{part}': digest.hexdigest(hash_name, np.asarray(a))
                  for i, k, v in zip(self.engine.config.cache_layers, rows.k, rows.v)
                  for part, a in (('k', k), ('v', v))}
          if any(mine[leaf['name']] != leaf[hash_name] for leaf in header['leaves']):
            problems.append(Problem(entry['key'], f'objects/{entry["object"]}',
                                    'forged: its bytes differ from a recomputation by this '
                                    'engine'))
            bad = entry['header_sha256']
        frontier.append((entry['key'], start + self.block_tokens, child_ctx, bad))
    return problems

  def gc(self, *, lease_seconds: float = LEASE_SECONDS) -> dict:
    """Removes what cannot be used and is not sound: unpublished objects left by an
    interrupted or losing put (once no live lease holds them: a running put leases its objects
    until they are published; a lease older than `lease_seconds` is a dead writer's and goes
    too) and entries whose object fails verification (quarantined, with a copy). An entry whose
    parent is not published is kept while its object is sound: the parent is addressed by its
    tokens, so a later put of them makes it reachable again. Safe beside puts: the leases are
    read after verify has listed the objects and before each is checked for publication, and a
    put publishes before it drops its lease, so every object of a running put is seen leased
    or published."""
    removed = {'objects': 0, 'entries': 0}
    problems = self.verify()
    leased, expired = self._leases(lease_seconds)
    for problem in problems:
      if problem.reason.startswith('stray'):
        continue
      if problem.name.startswith('objects/'):
        key = problem.name.split('/', 1)[1].split('.')[0]
        if problem.name in leased or any(e.get('object') == problem.name.split('/', 1)[1]
                                         for e in self._published_entries(key)):
          continue  # a running put's, or published since verify listed it
        self.backing.delete(problem.name)
        removed['objects'] += 1
      elif problem.name.startswith('index/') and 'unreachable' not in problem.reason:
        data = self.backing.read(problem.name)
        try:
          entry = json.loads(data)
          if not isinstance(entry, dict) or not isinstance(entry.get('object'), str):
            raise ValueError('not an entry')
          self.quarantine_object({**entry, 'key': problem.key,
                                  'parent': problem.name.split('/')[1]}, problem.reason,
                                 judged=entry)
        except (ValueError, TypeError):
          self.quarantine(problem.key, problem.name, problem.reason, entry_name=problem.name,
                          judged=data)
          self._rebuild_entry(problem.name.split('/')[1], problem.key)
        removed['entries'] += 1
    for name in expired:
      self.backing.delete(name)
    return removed

  def _leases(self, lease_seconds: float) -> tuple[set[str], list[str]]:
    """(the objects held by live put leases, the names of leases older than `lease_seconds`).
    A lease that does not decode holds nothing and is left alone, like any stray name."""
    live, expired, now = set(), [], time.time()
    for name in self.backing.list('staging/'):
      try:
        lease = json.loads(self.backing.read(name) or b'null')
        objects, written = lease['objects'], float(lease['time'])
        if not isinstance(objects, list):
          raise TypeError('objects is not a list')
      except (ValueError, TypeError, KeyError):
        continue
      if now - written < lease_seconds:
        live.update(o for o in objects if isinstance(o, str))
      else:
        expired.append(name)
    return live, expired

  def _published_entries(self, key: str) -> list[dict]:
    """The decoded entries stored under any parent for `key` (as written; not verified)."""
    out = []
    for name in self.backing.list('index/'):
      if name.endswith('/' + key):
        try:
          value = json.loads(self.backing.read(name) or b'null')
          out.append(value if isinstance(value, dict) else {})
        except ValueError:
          pass
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

  def rebuild_index(self) -> int:
    """Publishes an entry for every verified object that has none (an index lost or damaged
    can always be rebuilt from the objects' headers); returns how many it wrote."""
    written = 0
    for name in self.backing.list('objects/'):
      key = name.split('/', 1)[1].split('.')[0]
      entry = self._sound_object(name, key)
      if entry is None:
        self.quarantine(key, name, 'the object does not verify on its own',
                        data=self.backing.read(name))
        continue
      parent = json.loads(entry)['parent']
      written += self.backing.write_if_absent(f'index/{parent}/{key}', entry)
    return written


def _common_prefix(a, b) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n
