"""The store's index: entries under index/<parent>/<key>, read and verified in batches, and
rebuilt from the objects' own headers.
"""

from __future__ import annotations

import json

from graft.store import blocks
from graft.store.blocks import BlockError
from graft.store.shared import HEX64


class Index:
  """The index room of graft.store.Store (a mixin: the Store holds the state)."""

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
      if HEX64.fullmatch(key):
        keys.append(key)
      else:  # a name this store never makes: reported, never followed
        self._report(key[:64], name[:200], 'not an index entry name')
    return [e for e in self._entries_many([(parent, k, start) for k in keys]) if e is not None]

  def entries(self) -> list[dict]:
    """Every published entry reachable from the root, verified, in (start, key) order."""
    out, frontier = [], [(blocks.ROOT, 0)]
    while frontier:
      parent, start = frontier.pop()
      for entry in self._children(parent, start):
        out.append(entry)
        frontier.append((entry['key'], start + self.block_tokens))
    return sorted(out, key=lambda e: (e['start'], e['key']))

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

  def _object_named(self, entry_name: str) -> str | None:
    """The object an entry names, as written (not verified; None if it names none)."""
    try:
      entry = json.loads(self.backing.read(entry_name) or b'null')
    except ValueError:
      return None
    return entry.get('object') if isinstance(entry, dict) else None

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
