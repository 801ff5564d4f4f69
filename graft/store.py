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

A put writes each new object under its unique name, reads it back and checks its bytes, then
publishes it by writing its index entry only if none exists (first writer wins: a second
writer verifies the existing entry's object and removes its own copy). A reader therefore sees
a published, complete object or nothing; a process killed mid-put leaves at most unpublished
objects, which `gc` removes. The index can always be rebuilt from the objects' headers
(`rebuild_index`).

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
import dataclasses
import hashlib
import json
import time
import uuid

from absl import logging
import numpy as np

from gemma_jax import kv_state as kvs
from graft import blocks
from graft.artifact import differences
from graft.blocks import BlockError
from graft.engine import Context, Engine
from graft.kvstore import KvStore, ShortValueError

_DESCRIPTION = 'store.json'
# Bytes read for a header: enough for any block object's preamble and header (about 150 bytes
# per leaf), so a graft reads a block far behind its end (global layers only) in one read.
_HEADER_PROBE = 1 << 16


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

  def __init__(self, url: str, engine: Engine, *, host_cache_bytes: int = 1 << 30,
               create: bool = True):
    if engine.engine_config.mode != 'pinned':
      raise StoreError('a store holds KV of the pinned engine only (block-aligned, byte-exact); '
                       f'this engine is {engine.engine_config.mode!r}')
    self.kv = KvStore(url)
    self.url = self.kv.url
    self.engine = engine
    self.layout = blocks.Layout.of(engine)
    self.block_size = engine.engine_config.block_size
    self.namespace = blocks.namespace(engine.model_fingerprint, engine.fingerprint)
    self.host = HostCache(host_cache_bytes)
    self.problems: list[Problem] = []
    self.counters = collections.Counter()  # reads by tier, bytes, blocks written
    self._entries: dict[str, dict] = {}  # key -> verified entry (entries are immutable)
    self._open(create)

  # --------------------------------------------------------------------------------------------
  # The namespace

  def description(self) -> dict:
    return {'format': blocks.STORE_FORMAT, 'namespace': self.namespace,
            'block_size': self.block_size, 'model': self.engine.model_fingerprint,
            'engine': self.engine.fingerprint}

  def _open(self, create: bool) -> None:
    mine = self.description()
    data = self.kv.read(_DESCRIPTION)
    if data is None:
      if not create:
        raise StoreError(f'no store at {self.url} (no {_DESCRIPTION})')
      if self.kv.write_if_absent(_DESCRIPTION, blocks.canonical(mine)):
        return
      data = self.kv.read(_DESCRIPTION)  # another process created it first
    try:
      theirs = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError, TypeError) as e:
      raise StoreError(f'{self.url}{_DESCRIPTION} is damaged ({e})') from None
    if not isinstance(theirs, dict) or theirs.get('format') != blocks.STORE_FORMAT:
      raise StoreError(f'{self.url} is not a {blocks.STORE_FORMAT} store')
    if theirs.get('namespace') != mine['namespace']:
      diffs = [d.replace('the artifact has', 'the store has') for d in
               differences({k: mine[k] for k in ('model', 'engine')},
                           {k: theirs.get(k) for k in ('model', 'engine')})
               if not d.endswith('sha256') and '.sha256:' not in d]
      raise StoreError(f'{self.url} was made under another model or engine configuration '
                       f'(namespace {str(theirs.get("namespace"))[:16]}..): '
                       + ('; '.join(diffs[:8]) or 'the fingerprints differ'))
    if blocks.namespace(theirs.get('model', {}), theirs.get('engine', {})) != mine['namespace']:
      raise StoreError(f'{self.url}{_DESCRIPTION} does not hash to its namespace')

  # --------------------------------------------------------------------------------------------
  # Reading entries and objects (every read verified)

  def _report(self, key: str, name: str, reason: str) -> None:
    self.problems.append(Problem(key=key, name=name, reason=reason))
    logging.warning('store %s: refusing %s (block %s..): %s', self.url, name, key[:16], reason)

  def _entry(self, parent: str, key: str, start: int) -> dict | None:
    """The verified entry index/<parent>/<key> of the block at sequence index `start`, or None
    (missing, or bad: then quarantined)."""
    if key in self._entries:
      return self._entries[key]
    name = f'index/{parent}/{key}'
    data = self.kv.read(name)
    if data is None:
      return None
    try:
      entry = blocks.decode_entry(data, ns=self.namespace, parent=parent, key=key,
                                  expected_start=start, layout=self.layout,
                                  vocab_size=self.engine.config.vocab_size)
    except BlockError as e:
      self.quarantine(key, name, str(e), entry_name=name, data=data)
      return None
    self._entries[key] = entry
    return entry

  def _children(self, parent: str, start: int) -> list[dict]:
    out = []
    for name in self.kv.list(f'index/{parent}/'):
      entry = self._entry(parent, name.rsplit('/', 1)[1], start)
      if entry is not None:
        out.append(entry)
    return out

  def _read_object(self, entry: dict, global_only: bool) -> dict[str, np.ndarray]:
    """The entry's object's leaves (global layers only, or all), verified; BlockError if bad."""
    name = f'objects/{entry["object"]}'
    size = entry['object_bytes']
    wanted = _HEADER_PROBE + self.layout.global_bytes(len(entry['tokens']))
    try:
      probe = self.kv.read(name, (0, min(size, wanted)) if global_only else None)
    except ShortValueError:
      raise BlockError('the object is shorter than its entry says (truncated)') from None
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
                                  layout=self.layout, vocab_size=self.engine.config.vocab_size)
    if (header['parent'], header['start'], header['tokens']) != (
        entry['parent'], entry['start'], entry['tokens']):
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
                                layout=self.layout)

  def _read_range(self, name: str, start: int, stop: int) -> bytes:
    try:
      data = self.kv.read(name, (start, stop))
    except ShortValueError:
      raise BlockError('the object is shorter than its header says (truncated)') from None
    if data is None:
      raise BlockError('the object is missing')
    return data

  def read_block(self, entry: dict, global_only: bool) -> dict[str, np.ndarray]:
    """The block's verified leaves from the host tier, else from the backing store."""
    leaves = self.host.get(entry['object'], global_only)
    if leaves is not None:
      self.counters['host_hits'] += 1
      return leaves
    leaves = self._read_object(entry, global_only)
    self.counters['backing_reads'] += 1
    self.host.put(entry['object'], global_only, leaves)
    return leaves

  def quarantine_object(self, entry: dict, reason: str) -> None:
    """A published block whose object is bad: the object and its entry are moved aside."""
    self.quarantine(entry['key'], f'objects/{entry["object"]}', reason,
                    entry_name=f'index/{entry["parent"]}/{entry["key"]}')

  def quarantine(self, key: str, name: str, reason: str, *, entry_name: str | None = None,
                 data: bytes | None = None) -> None:
    """Reports a bad entry or object and moves it aside: a copy and the reason go under
    quarantine/, the entry is removed (so lookups miss and a later put rewrites the block), and
    the object is deleted."""
    self._report(key, name, reason)
    self._entries.pop(key, None)
    record = uuid.uuid4().hex
    self.kv.write(f'quarantine/{record}.json', blocks.canonical(
        {'key': key, 'name': name, 'reason': reason, 'time': time.time()}))
    if data is not None:
      self.kv.write(f'quarantine/{record}.object', data)
    if entry_name:
      self.kv.delete(entry_name)
    if name.startswith('objects/'):
      self.host.drop(name.split('/', 1)[1])
      self.kv.delete(name)

  # --------------------------------------------------------------------------------------------
  # Lookup and graft

  def lookup(self, tokens) -> Match:
    """The longest stored prefix of `tokens`, at token granularity."""
    tokens = [int(t) for t in tokens]
    parent, used, matched, rows = blocks.ROOT, [], 0, 0
    for start in range(0, len(tokens), self.block_size):
      chunk = tokens[start:start + self.block_size]
      entry = self._entry(parent, blocks.block_key(self.namespace, parent, chunk), start)
      if entry is None:  # the longest common prefix among the stored children
        best, common = None, 0
        for child in self._children(parent, start):
          length = _common_prefix(child['tokens'], chunk)
          if length > common:
            best, common = child, length
        if best is not None:
          used.append(best)
          matched, rows = matched + common, common
        break
      used.append(entry)
      matched, rows, parent = matched + len(chunk), len(chunk), entry['key']
      if len(chunk) < self.block_size:
        break
    return Match(tokens=matched, entries=tuple(used), rows=rows)

  def graft(self, tokens) -> tuple[Context, Match]:
    """A fresh context holding the longest stored prefix of `tokens` at its own positions. A
    block that fails verification is quarantined and the prefix ends before it (the caller's
    engine computes the rest)."""
    tokens = [int(t) for t in tokens]
    while True:
      match = self.lookup(tokens)
      if not match.tokens:
        return self.engine.empty(), match
      try:
        rows = self._rows(match)
      except _BadBlock as bad:  # each retry removes one bad block, so this ends
        self.quarantine_object(bad.entry, bad.reason)
        continue
      kv = kvs.assemble(self.engine.empty().kv, rows, match.tokens)
      return Context(kv=kv, tokens=tuple(tokens[:match.tokens]),
                     next_position=match.tokens), match

  def _rows(self, match: Match) -> list[kvs.KVRows]:
    """Each matched block's rows, read as far as the graft attends to them."""
    n = match.tokens
    layers = self.engine.empty().kv.layers
    ring = min(layer.num_slots for layer in layers)
    out = []
    for i, entry in enumerate(match.entries):
      used = match.rows if i == len(match.entries) - 1 else len(entry['tokens'])
      start = entry['start']
      global_only = start + used <= n - ring  # wholly behind every ring: global layers only
      try:
        leaves = self.read_block(entry, global_only)
      except BlockError as e:
        raise _BadBlock(entry, str(e)) from None
      k, v = [], []
      for index in self.engine.config.cache_layers:
        k.append(leaves.get(f'layer_{index}/k'))
        v.append(leaves.get(f'layer_{index}/v'))
      positions = np.arange(start, start + len(entry['tokens']), dtype=np.int32)
      rows = kvs.KVRows(start, tuple(k), tuple(v), tuple(positions for _ in k))
      out.append(rows.prefix(used))
    return out

  # --------------------------------------------------------------------------------------------
  # Put

  def put(self, tokens) -> dict:
    """Deposits `tokens` (a context from position 0): grafts the longest stored prefix,
    computes the rest block by block with the engine and writes every block not stored yet.
    Returns what it did: tokens, blocks reused and written, bytes, seconds computing and
    storing."""
    tokens = [int(t) for t in tokens]
    if not tokens:
      raise ValueError('nothing to put: the token list is empty')
    t0 = time.perf_counter()
    ctx, match = self.graft(tokens)
    keys = blocks.chain_keys(self.namespace, tokens, self.block_size)
    # The block holding token `match.tokens` is the first one to write. (When every token is
    # matched, even a partial last block is addressable already: it is a prefix of a stored one.)
    first_new = (len(keys) if match.tokens == len(tokens)
                 else match.tokens // self.block_size)
    report = {'tokens': len(tokens), 'reused_tokens': match.tokens, 'blocks_written': 0,
              'blocks_existing': 0, 'bytes_written': 0, 'compute_seconds': 0.0,
              'storage_seconds': 0.0}
    for k in range(first_new, len(keys)):
      start, stop = k * self.block_size, min((k + 1) * self.block_size, len(tokens))
      t1 = time.perf_counter()
      if stop > len(ctx.tokens):
        ctx, _ = self.engine.extend(ctx, tokens[len(ctx.tokens):stop], logits='none',
                                    consume=True)
      rows = kvs.take_rows(ctx.kv, start, stop)
      t2 = time.perf_counter()
      leaves = {}
      for index, k_rows, v_rows in zip(self.engine.config.cache_layers, rows.k, rows.v):
        leaves[f'layer_{index}/k'], leaves[f'layer_{index}/v'] = k_rows, v_rows
      parent = keys[k - 1] if k else blocks.ROOT
      written = self._write_block(parent, start, tokens[start:stop], leaves)
      report['blocks_written' if written else 'blocks_existing'] += 1
      report['bytes_written'] += written
      report['compute_seconds'] += t2 - t1
      report['storage_seconds'] += time.perf_counter() - t2
    report['seconds'] = time.perf_counter() - t0
    return report

  def _write_block(self, parent: str, start: int, tokens, leaves) -> int:
    """Writes, verifies and publishes one block; returns the bytes written (0 when another
    writer's verified copy was already published)."""
    key, data, header = blocks.encode_block(self.namespace, parent, start, tokens, leaves,
                                            self.layout)
    offset, length = blocks.header_span(data)
    object_name = f'{key}.{uuid.uuid4().hex}'
    self.kv.write(f'objects/{object_name}', data)
    if self.kv.read(f'objects/{object_name}') != data:  # what the storage layer kept
      self.kv.delete(f'objects/{object_name}')
      raise StoreError(f'{self.url}: object {object_name} did not read back as written')
    entry_bytes = blocks.encode_entry(header, object_name, len(data),
                                      data[offset:offset + length])
    entry_name = f'index/{parent}/{key}'
    for _ in range(3):  # a bad existing entry is quarantined and the publish tried again
      if self.kv.write_if_absent(entry_name, entry_bytes):
        self.counters['blocks_written'] += 1
        return len(data)
      existing = self._entry(parent, key, start)
      if existing is not None:
        try:
          self._read_object(existing, global_only=False)
          self.kv.delete(f'objects/{object_name}')  # first writer wins; ours was a copy
          return 0
        except BlockError as e:
          self.quarantine_object(existing, str(e))
    raise StoreError(f'{self.url}: could not publish block {key[:16]}..')

  # --------------------------------------------------------------------------------------------
  # Maintenance: listing, verification, garbage collection, statistics

  def entries(self) -> list[dict]:
    """Every published entry reachable from the root, verified, in (start, key) order."""
    out, frontier = [], [(blocks.ROOT, 0)]
    while frontier:
      parent, start = frontier.pop()
      for entry in self._children(parent, start):
        out.append(entry)
        frontier.append((entry['key'], start + self.block_size))
    return sorted(out, key=lambda e: (e['start'], e['key']))

  def verify(self) -> list[Problem]:
    """Reads and checks every entry and object of the store (without changing it): every
    problem found, named. Unreachable entries and unpublished objects are listed too."""
    problems: list[Problem] = []
    names = self.kv.list('index/')
    reachable = {blocks.ROOT}
    by_parent = collections.defaultdict(list)
    for name in names:
      parts = name.split('/')
      if len(parts) != 3:
        problems.append(Problem('', name, 'not an index entry name'))
        continue
      by_parent[parts[1]].append(parts[2])
    frontier = [(blocks.ROOT, 0)]
    published = set()
    while frontier:
      parent, start = frontier.pop()
      for key in by_parent.get(parent, []):
        name = f'index/{parent}/{key}'
        try:
          entry = blocks.decode_entry(self.kv.read(name) or b'', ns=self.namespace,
                                      parent=parent, key=key, expected_start=start,
                                      layout=self.layout,
                                      vocab_size=self.engine.config.vocab_size)
        except BlockError as e:
          problems.append(Problem(key, name, str(e)))
          continue
        published.add(entry['object'])
        reachable.add(key)  # its children are addressed by key whatever its object holds
        frontier.append((key, start + self.block_size))
        try:
          self._read_object(entry, global_only=False)
        except BlockError as e:
          problems.append(Problem(key, name, f'its object: {e}'))
    for parent, keys in by_parent.items():
      if parent not in reachable:
        problems += [Problem(k, f'index/{parent}/{k}', 'unreachable: its parent is not '
                     'published') for k in keys]
    for name in self.kv.list('objects/'):
      if name.split('/', 1)[1] not in published:
        problems.append(Problem(name.split('/', 1)[1][:64], name,
                                'not published (left by an interrupted or losing put)'))
    return problems

  def gc(self) -> dict:
    """Removes what no published entry reaches: unpublished objects, entries whose parent is
    not published, entries whose object is bad (quarantined). Run it when no put is running:
    a put's object is unpublished until its entry is written."""
    bad = self.verify()
    removed = {'objects': 0, 'entries': 0}
    for problem in bad:
      if problem.name.startswith('objects/'):
        self.kv.delete(problem.name)
        removed['objects'] += 1
      elif problem.name.startswith('index/'):
        if 'unreachable' not in problem.reason:
          self.quarantine(problem.key, problem.name, problem.reason, entry_name=problem.name)
        else:
          self.kv.delete(problem.name)
        self._entries.pop(problem.key, None)
        removed['entries'] += 1
    if removed['entries']:  # removing entries can orphan objects and descendants
      again = self.gc()
      removed = {k: removed[k] + again[k] for k in removed}
    return removed

  def stats(self) -> dict:
    entries = self.entries()
    objects = sum(e['object_bytes'] for e in entries)
    tokens = sum(len(e['tokens']) for e in entries)
    return {'url': self.url, 'namespace': self.namespace, 'objects': len(entries),
            'bytes': objects, 'tokens_addressable': tokens,
            'bytes_per_token': objects / tokens if tokens else None,
            'block_size': self.block_size}

  def rebuild_index(self) -> int:
    """Publishes an entry for every verified object that has none (an index lost or damaged
    can always be rebuilt from the objects' headers); returns how many it wrote."""
    written = 0
    for name in self.kv.list('objects/'):
      data = self.kv.read(name)
      if data is None:
        continue
      try:
        offset, length = blocks.header_span(data)
        header_bytes = data[offset:offset + length]
        key = name.split('/', 1)[1].split('.')[0]
        header = blocks.decode_header(header_bytes, ns=self.namespace, expected_key=key,
                                      layout=self.layout,
                                      vocab_size=self.engine.config.vocab_size)
        blocks.decode_leaves(header, data[offset + length:], offset + length,
                             global_only=False, layout=self.layout)
      except BlockError as e:
        self.quarantine(name.split('/', 1)[1][:64], name, str(e), data=data)
        continue
      entry = blocks.encode_entry(header, name.split('/', 1)[1], len(data), header_bytes)
      written += self.kv.write_if_absent(f'index/{header["parent"]}/{key}', entry)
    return written


def _common_prefix(a, b) -> int:
  n = 0
  for x, y in zip(a, b):
    if x != y:
      break
    n += 1
  return n
