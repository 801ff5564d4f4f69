"""The object reads of a store: block objects read for their entries, in byte ranges (a graft
far behind the ring reads global-layer rows only), decoded with every hash re-checked against
the entry and the engine's layout, through the host tier (an LRU of verified blocks).
"""

from __future__ import annotations

import collections
import hashlib
import time
from typing import Any

import numpy as np

from graft.store import blocks
from graft.store.blocks import BlockError
from graft.store.kvstore import KvStore, ShortValueError
from graft.store.shared import HEADER_PROBE, POOL, Codec


class HostCache:
  """The host tier: an LRU of verified blocks, bounded in bytes. Entries are (object name,
  part) -> {leaf name: [T, K, H] array}; a whole block also serves a request for its global
  part."""

  def __init__(self, capacity_bytes: int):
    self.capacity = capacity_bytes
    self.bytes = 0
    self._items: collections.OrderedDict = collections.OrderedDict()

  def get(self, name: str, global_only: bool) -> dict[str, np.ndarray] | None:
    """The leaves of object `name` held here (all of them, or at least its global layers'; each
    'layer_<i>/k' and '/v' [T, K, H]), marked as the most recently used; None when it is not
    held."""
    for part in (('all', 'global') if global_only else ('all',)):
      if (name, part) in self._items:
        self._items.move_to_end((name, part))
        return self._items[(name, part)][0]
    return None

  def put(self, name: str, global_only: bool, leaves: dict[str, np.ndarray]) -> None:
    """Holds object `name`'s verified leaves ('layer_<i>/k', '/v' [T, K, H]; its global layers'
    only, or all), dropping the least recently used blocks past the capacity; a block larger
    than all of it is not held."""
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
    """Forgets object `name` (both parts)."""
    for part in ('all', 'global'):
      item = self._items.pop((name, part), None)
      if item:
        self.bytes -= item[1]

  def clear(self) -> None:
    """Forgets every block."""
    self._items.clear()
    self.bytes = 0


class Reads:
  """Block objects read for their entries: the host tier first, else the backing store (byte
  ranges where a graft needs the global layers only), every hash re-checked against the entry
  and the store's codec.

  Args:
    backing: the store's storage.
    codec: the formats bound to the store's namespace and the engine's layout.
    host: the host tier (`host` may be replaced: a cache of capacity 0 turns the tier off).
    counters: where reads are counted (host_hits, backing_reads, backing_bytes,
      backing_seconds).
  """

  def __init__(self, backing: KvStore, codec: Codec, host: HostCache,
               counters: collections.Counter[str]):
    self._backing, self._codec, self._counters = backing, codec, counters
    self.host = host

  def read_blocks(self, wanted: list[tuple[dict, bool]]) -> list:
    """Blocks' leaves, verified; those not in the host tier are read concurrently and hashed in
    parallel.

    Args:
      wanted: (entry, global_only) per block: its verified index entry, and whether only its
        global layers are wanted.

    Returns:
      Per block, {'layer_<i>/k' and 'layer_<i>/v': [T, K, H] array in the engine's dtype} for
      each cache-owning layer i read (T: the block's tokens), or the BlockError that refused
      it.
    """
    out: list[dict[str, np.ndarray] | BlockError | None] = [
        self.host.get(entry['object'], global_only) for entry, global_only in wanted]
    self._counters['host_hits'] += sum(leaves is not None for leaves in out)
    missing = [i for i, leaves in enumerate(out) if leaves is None]
    if not missing:
      return out
    start = time.perf_counter()
    probes = self._backing.read_many([self._request(*wanted[i]) for i in missing])

    def decode(i: int, probe: Any) -> dict[str, np.ndarray] | BlockError:
      entry, global_only = wanted[i]
      try:
        return self._decode_object(entry, global_only, probe)
      except BlockError as e:
        return e

    for i, leaves in zip(missing, POOL.map(decode, missing, probes)):
      out[i] = leaves
      if not isinstance(leaves, BlockError):
        self.host.put(wanted[i][0]['object'], wanted[i][1], leaves)
    seconds = time.perf_counter() - start
    self._counters['backing_seconds'] += seconds  # type: ignore[assignment]  # Counter's stub: ints

    self._counters['backing_reads'] += len(missing)
    return out

  def read_object(self, entry: dict, global_only: bool) -> dict[str, np.ndarray]:
    """The leaves of an entry's object read from the backing store, as `read_blocks` gives
    them ('layer_<i>/k', '/v' [T, K, H]; global layers only, or all), verified; raises
    BlockError if the object is bad."""
    (probe,) = self._backing.read_many([self._request(entry, global_only)])
    return self._decode_object(entry, global_only, probe)

  def header_of(self, entry: dict) -> dict:
    """The verified header of an entry's object (its preamble and header read)."""
    name = f'objects/{entry["object"]}'
    probe = self._read_range(name, 0, min(entry['object_bytes'], HEADER_PROBE))
    offset, length = blocks.header_span(probe)
    if offset + length > len(probe):
      probe = self._read_range(name, 0, offset + length)
    return self._codec.header(probe[offset:offset + length], entry['key'])

  def forget(self, object_name: str) -> None:
    """Drops an object (`<key>.<writer id>`) from the host tier (it was found bad)."""
    self.host.drop(object_name)

  def _request(self, entry: dict, global_only: bool) -> tuple[str, tuple[int, int] | None]:
    """What to read of an entry's object: all of it, or (global only) its first bytes, which
    hold the preamble, the header and the global layers' rows."""
    name = f'objects/{entry["object"]}'
    if not global_only:
      return name, None
    wanted = HEADER_PROBE + self._codec.layout.global_bytes(len(entry['tokens']))
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
    header = self._codec.header(header_bytes, entry['key'])
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
    self._counters['backing_bytes'] += len(data) + data_start
    return blocks.decode_leaves(header, data, data_start, global_only=global_only,
                                layout=self._codec.layout)

  def _read_range(self, name: str, start: int, stop: int) -> bytes:
    try:
      data = self._backing.read(name, (start, stop))
    except ShortValueError:
      raise BlockError('the object is shorter than its header says (truncated)') from None
    if data is None:
      raise BlockError('the object is missing')
    return data
