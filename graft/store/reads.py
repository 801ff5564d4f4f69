"""Reading block objects: byte ranges (a graft far behind the ring reads global-layer rows only),
decoding with every hash re-checked against the entry and the engine's layout, and the host
tier (an LRU of verified blocks).
"""

from __future__ import annotations

import collections
import hashlib
import time

from absl import logging
import numpy as np

from graft.store import blocks
from graft.store.blocks import BlockError
from graft.store.kvstore import ShortValueError
from graft.store.shared import HEADER_PROBE, POOL, Problem

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

class Reads:
  """The reading room of graft.store.Store (a mixin: the Store holds the state)."""

  def _report(self, key: str, name: str, reason: str) -> None:
    self.problems.append(Problem(key=key, name=name, reason=reason))
    logging.warning('store %s: refusing %s (block %s..): %s', self.url, name, key[:16], reason)

  def _request(self, entry: dict, global_only: bool) -> tuple[str, tuple[int, int] | None]:
    """What to read of an entry's object: all of it, or (global only) its first bytes, which
    hold the preamble, the header and the global layers' rows."""
    name = f'objects/{entry["object"]}'
    if not global_only:
      return name, None
    wanted = HEADER_PROBE + self.block_layout.global_bytes(len(entry['tokens']))
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

    for i, leaves in zip(missing, POOL.map(decode, missing, probes)):
      out[i] = leaves
      if not isinstance(leaves, BlockError):
        self.host.put(wanted[i][0]['object'], wanted[i][1], leaves)
    self.counters['backing_seconds'] += time.perf_counter() - start
    self.counters['backing_reads'] += len(missing)
    return out

  def _header_of(self, entry: dict) -> dict:
    """The verified header of an entry's object (its preamble and header read)."""
    name = f'objects/{entry["object"]}'
    probe = self._read_range(name, 0, min(entry['object_bytes'], HEADER_PROBE))
    offset, length = blocks.header_span(probe)
    if offset + length > len(probe):
      probe = self._read_range(name, 0, offset + length)
    return blocks.decode_header(probe[offset:offset + length], ns=self.namespace,
                                expected_key=entry['key'], layout=self.block_layout,
                                vocab_size=self.engine.config.vocab_size)
