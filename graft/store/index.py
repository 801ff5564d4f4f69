"""The index of a store: entries under index/<parent>/<key>, read and verified in batches and
cached; rebuilt from the objects' own headers; and quarantine, which moves a bad entry or
object aside with its reason (how the index heals: the entry of a bad block is removed, so a
lookup misses it and a later put rewrites it).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from gemma_jax.digest import canonical_json
from graft.store import blocks
from graft.store.blocks import BlockError
from graft.store.kvstore import KvStore
from graft.store.reads import Reads
from graft.store.shared import HEX64, Codec, Kind, Problems


class Index:
  """Published entries, verified on every read, and their repair.

  Args:
    backing: the store's storage.
    codec: the formats bound to the store's namespace and the engine's layout.
    problems: where an entry or object refused is reported.
    reads: the object reads, whose host tier forgets a quarantined object.
  """

  def __init__(self, backing: KvStore, codec: Codec, problems: Problems, reads: Reads):
    self._backing, self._codec, self._problems, self._reads = backing, codec, problems, reads
    self._entries: dict[str, dict] = {}  # key -> verified entry (entries are immutable)

  def entries_many(self, wanted: list[tuple[str, str, int]]) -> list[dict | None]:
    """The verified entries index/<parent>/<key> of blocks at sequence index `start`, for each
    (parent, key, start), read concurrently: None where missing, or bad (then quarantined)."""
    todo = [w for w in wanted if w[1] not in self._entries]
    names = [f'index/{parent}/{key}' for parent, key, _ in todo]
    for (parent, key, start), name, data in zip(
        todo, names, self._backing.read_many([(n, None) for n in names])):
      if data is None:
        continue
      try:
        if isinstance(data, Exception):
          raise BlockError(str(data))
        self._entries[key] = self._codec.entry(data, parent=parent, key=key, start=start)
      except BlockError as e:
        self.quarantine(key, name, str(e), entry_name=name,
                        data=None if isinstance(data, Exception) else data, judged=data)
        self.rebuild_entry(parent, key)
        if self._backing.read(name) is not None:  # rebuilt: read it as any entry
          self.entries_many([(parent, key, start)])
    return [self._entries.get(key) for _, key, _ in wanted]

  def entry(self, parent: str, key: str, start: int) -> dict | None:
    """The verified entry index/<parent>/<key> of a block at `start` (None: missing or bad)."""
    return self.entries_many([(parent, key, start)])[0]

  def children(self, parent: str, start: int) -> list[dict]:
    """The verified entries published under `parent`, of blocks at `start`."""
    keys = []
    for name in self._backing.list(f'index/{parent}/'):
      key = name[len(f'index/{parent}/'):]
      if HEX64.fullmatch(key):
        keys.append(key)
      else:  # a name this store never makes: reported, never followed
        self._problems.report(Kind.STRAY, key[:64], name[:200], 'not an index entry name')
    return [e for e in self.entries_many([(parent, k, start) for k in keys]) if e is not None]

  def entries(self) -> list[dict]:
    """Every published entry reachable from the root, verified, in (start, key) order: the
    contexts' chains, and the documents' chains after each of their blocks (a document's
    starts count from its first token)."""
    out, frontier = [], [(blocks.ROOT, 0, True)]
    while frontier:
      parent, start, context = frontier.pop()
      for entry in self.children(parent, start):
        out.append(entry)
        frontier.append((entry['key'], start + self._codec.block_tokens, context))
        if context:  # documents stored after the prefix this block ends
          frontier.append((blocks.document_root(self._codec.namespace, entry['key']), 0, False))
    return sorted(out, key=lambda e: (e['start'], e['key']))

  def rebuild_index(self) -> int:
    """Publishes an entry for every verified object that has none (an index lost or damaged
    can always be rebuilt from the objects' headers); returns how many it wrote."""
    written = 0
    for name in self._backing.list('objects/'):
      key = name.split('/', 1)[1].split('.')[0]
      entry = self._sound_object(name, key)
      if entry is None:
        self.quarantine(key, name, 'the object does not verify on its own',
                        data=self._backing.read(name))
        continue
      parent = json.loads(entry)['parent']
      written += self._backing.write_if_absent(f'index/{parent}/{key}', entry)
    return written

  def rebuild_entry(self, parent: str, key: str) -> None:
    """Publishes the entry of the block's sound object, if one is stored (an entry that was
    damaged costs no sound object)."""
    for name in self._backing.list(f'objects/{key}.'):
      entry = self._sound_object(name, key)
      if entry is not None and json.loads(entry)['parent'] == parent:
        self._backing.write_if_absent(f'index/{parent}/{key}', entry)
        return

  def quarantine_object(self, entry: dict, reason: str, judged: Any = None) -> None:
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
      self.rebuild_entry(entry['parent'], entry['key'])  # from another sound copy, if any
      return
    self.quarantine(entry['key'], entry_name, f'{reason}; the object is sound: the entry was '
                    'damaged and is rebuilt from it', entry_name=entry_name,
                    data=self._backing.read(entry_name), judged=judged)
    self._backing.write_if_absent(entry_name, sound)

  def quarantine(self, key: str, name: str, reason: str, *, kind: Kind | None = None,
                 entry_name: str | None = None, data: bytes | None = None,
                 judged: Any = None) -> None:
    """Reports a bad entry or object and moves it aside: a copy and the reason go under
    quarantine/, the entry is removed if it still holds what was judged (`judged`: its bytes or
    decoded entry; so lookups miss and a later put rewrites the block), and the object is
    deleted if it still holds the bytes copied (conditionally on their generation; `data`: the
    bytes judged, if the caller read them). kind: what was found (default: a bad object or a
    bad entry, as `name` is one)."""
    if kind is None:
      kind = Kind.BAD_OBJECT if name.startswith('objects/') else Kind.BAD_ENTRY
    self._problems.report(kind, key, name, reason)
    self._entries.pop(key, None)
    generation = None
    if name.startswith('objects/'):
      current, generation = self._backing.read_versioned(name)
      if data is not None and current != data:
        generation = None  # rewritten since it was judged: not what was judged, kept
      data = current if data is None else data  # the bad bytes are kept, not lost
    record = uuid.uuid4().hex
    self._backing.write(f'quarantine/{record}.json', canonical_json(
        {'key': key, 'name': name, 'reason': reason, 'time': time.time()}))
    if data is not None:
      self._backing.write(f'quarantine/{record}.object', data)
    if entry_name:
      self._delete_entry_if(entry_name, judged)
    if name.startswith('objects/'):
      self._reads.forget(name.split('/', 1)[1])
      if generation is not None:
        self._backing.delete_if(name, generation)

  def clear(self) -> None:
    """Forgets every cached entry (the store was deleted)."""
    self._entries.clear()

  def _sound_object(self, name: str, key: str) -> bytes | None:
    """The index entry an object publishes, when the object verifies on its own: its header,
    key chain and every leaf (None otherwise)."""
    data = self._backing.read(name)
    if not data:
      return None
    try:
      offset, length = blocks.header_span(data)
      header_bytes = data[offset:offset + length]
      header = self._codec.header(header_bytes, key)
      if offset + length + header['data_bytes'] != len(data):
        return None
      blocks.decode_leaves(header, data[offset + length:], offset + length, global_only=False,
                           layout=self._codec.layout)
    except BlockError:
      return None
    return blocks.encode_entry(header, name.split('/', 1)[1], len(data), header_bytes)

  def _delete_entry_if(self, entry_name: str, judged) -> bool:
    """Deletes an index entry only if it still holds what was judged bad (bytes, or the decoded
    entry; None: whatever it holds), conditionally on the generation read: another writer that
    has just re-published the key keeps its entry. True when this call deleted it."""
    current, generation = self._backing.read_versioned(entry_name)
    if current is None:
      return False
    if judged is not None and current != judged:
      try:
        if json.loads(current) != judged:
          return False
      except (ValueError, TypeError):
        return False
    return self._backing.delete_if(entry_name, generation)
