"""The faults: what each kind does to a trial's store. Each returns the keys it touched (and, for
the store kinds, a description)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os

import numpy as np

from experiments.fault_campaign.world import World, path_keys
from gemma_jax import kv_state as kvs
from gemma_jax.config import AttentionType
from gemma_jax.digest import canonical_json
from graft.store import Store, blocks
from graft.store.kvstore import KvStore


@dataclasses.dataclass(frozen=True)
class Place:
  """Where a fault lands: a block (its index entry and object) on the answered context's
  chain most of the time, anywhere in the store otherwise."""

  entry: str  # index/<parent>/<key>
  object: str  # objects/<key>.<writer>


def pick_place(world: World, kv: KvStore, context, rng) -> Place:
  """A block on the target's path (80%: a context's chain; a composition's prefix and
  documents) or of the whole store."""
  entries = {}
  for name in kv.list('index/'):
    entries[name.rsplit('/', 1)[1]] = name
  ns = json.loads(world.golden['store.json'])['namespace']
  on_path = [entries[k] for k in path_keys(ns, world.engine.engine_config.rows_per_call, context)
             if k in entries]
  pool = on_path if on_path and rng.random() < 0.8 else sorted(entries.values())
  entry = pool[int(rng.integers(len(pool)))]
  return Place(entry, 'objects/' + json.loads(kv.read(entry))['object'])


def _flip(data: bytes, lo: int, hi: int, rng) -> bytes:
  position = int(rng.integers(lo, max(lo + 1, hi)))
  out = bytearray(data)
  out[position] ^= 1 << int(rng.integers(0, 8))
  return bytes(out)


def object_fault(kind: str, kv: KvStore, place: Place, rng) -> tuple[set, str]:
  """Damages the place's object; the fault touches the block: its object and its entry (which
  a reader then removes with the object it refuses)."""
  name = place.object
  data = kv.read(name)
  offset, length = blocks.header_span(data)
  if kind == 'bitflip_data':
    kv.write(name, _flip(data, offset + length, len(data), rng))
  elif kind == 'bitflip_header':
    kv.write(name, _flip(data, 0, offset + length, rng))
  elif kind == 'truncate':
    kv.write(name, data[:int(rng.integers(0, len(data)))])
  elif kind == 'empty':
    kv.write(name, b'')
  elif kind == 'delete':
    kv.delete(name)
  elif kind == 'rename':
    renamed = f'{name.split(".")[0]}.{os.urandom(16).hex()}'
    kv.write(renamed, data)
    kv.delete(name)
    return {name, renamed, place.entry}, f'{name} renamed'
  elif kind == 'copy_other_key':
    names = [n for n in kv.list('objects/') if n != name]
    kv.write(name, kv.read(names[int(rng.integers(len(names)))]))
  return {name, place.entry}, f'{kind} {name}'


def index_fault(kind: str, kv: KvStore, place: Place, rng) -> tuple[set, str]:
  """Damages the place's index entry, or a listing beside it (hostile names)."""
  name = place.entry
  data = kv.read(name)
  if kind == 'bitflip_index':
    kv.write(name, _flip(data, 0, len(data), rng))
    return {name}, f'bit flipped in {name}'
  entry = json.loads(data)
  parent = name.split('/')[1]
  if kind == 'bad_index_types':
    choices = [
        [1, 2, 3], 'a string', None, 17.5,
        {**entry, 'tokens': [str(t) for t in entry['tokens']]},
        {**entry, 'start': str(entry['start'])}, {**entry, 'start': float(entry['start'])},
        {**entry, 'object_bytes': -1}, {**entry, 'object_bytes': [entry['object_bytes']]},
        {**entry, 'tokens': {'0': 1}}, {**entry, 'header_sha256': 12},
        {**entry, 'object': None}, {**entry, 'tokens': []},
        {**entry, 'tokens': [True] * len(entry['tokens'])}]
    value = choices[int(rng.integers(len(choices)))]
    kv.write(name, json.dumps(value).encode())
    return {name}, f'{name} holds {str(value)[:40]}'
  if kind == 'hostile_key':
    choice = int(rng.integers(4))
    if choice == 0:  # an entry whose object is a path
      target = ['../../etc/passwd', '/etc/passwd', 'objects/' + 'a' * 5000,
                '..', 'quarantine/x'][int(rng.integers(5))]
      kv.write(name, json.dumps({**entry, 'object': target}).encode())
      return {name}, f'{name} points to {target[:40]}'
    # a listing that holds names the store never makes (written around check_key)
    hostile = [f'index/{parent}/' + 'f' * 5000, f'index/{parent}/{"A" * 64}',
               f'index/{parent}/{entry["key"]}/nested', f'index/{parent}/.hidden'][
                   int(rng.integers(4))]
    kv._kv.write(hostile, data).result()
    return {hostile}, f'hostile name {hostile[:60]}'
  raise ValueError(kind)


def huge_header(kv: KvStore, place: Place, rng) -> tuple[set, str]:
  """An object whose header claims huge shapes (re-encoded, its entry's hash recomputed, as a
  tamperer who knows the format would) or a huge header length."""
  name = place.object
  data = kv.read(name)
  offset, length = blocks.header_span(data)
  if rng.random() < 0.3:
    bad = data[:len(blocks.MAGIC)] + (0xFFFFFFF0).to_bytes(4, 'little') + data[offset:]
    kv.write(name, bad)
    return {name, place.entry}, f'{name} header length 2^32 - 16'
  header = json.loads(data[offset:offset + length])
  leaf = header['leaves'][int(rng.integers(len(header['leaves'])))]
  leaf['shape'] = [int(10 ** rng.integers(6, 13)), 1 << 20, leaf['shape'][-1]]
  header_bytes = canonical_json(header)
  kv.write(name, blocks.MAGIC + len(header_bytes).to_bytes(4, 'little') + header_bytes
           + data[offset + length:])
  key = header['key']
  entry_name = f'index/{header["parent"]}/{key}'
  entry = json.loads(kv.read(entry_name))
  entry['header_sha256'] = hashlib.sha256(header_bytes).hexdigest()
  entry['object_bytes'] = len(header_bytes) + offset + len(data) - offset - length
  kv.write(entry_name, canonical_json(entry))
  return {name, entry_name}, f'{name} claims shape {leaf["shape"]}'


class FailingKvStore(KvStore):
  """A kvstore that fails after `budget` values written, as a full disk does: the failing
  write leaves a value cut short (where the driver would not), then raises."""

  def __init__(self, inner: KvStore, budget: int):
    self.__dict__.update(inner.__dict__)
    self.budget = budget

  def _spend(self, items):
    if self.budget >= len(items):
      self.budget -= len(items)
      return items, None
    ok, failing = items[:self.budget], items[self.budget]
    self.budget = 0
    return ok, failing

  def write_many(self, items) -> None:
    """Writes until the budget is spent; then writes half of the next value and raises."""
    ok, failing = self._spend(list(items))
    super().write_many(ok)
    if failing is not None:
      super().write_many([(failing[0], failing[1][:len(failing[1]) // 2])])
      raise OSError(28, 'No space left on device (injected)')

  def write_if_absent_many(self, items) -> list[bool]:
    """Writes until the budget is spent; then raises."""
    ok, failing = self._spend(list(items))
    written = super().write_if_absent_many(ok)
    if failing is not None:
      raise OSError(28, 'No space left on device (injected)')
    return written


def forge(store: Store, entry: dict, rng=None) -> set[str]:
  """Rewrites a published block self-consistently (header, per-leaf SHA-256 and index entry all
  correct for its bytes) with one K value of a global layer off by 1e-3: what no hash can see.
  Returns the keys it changed."""
  name = f'objects/{entry["object"]}'
  data = store.backing.read(name)
  offset, length = blocks.header_span(data)
  header = json.loads(data[offset:offset + length])
  leaves = blocks.decode_leaves(header, data[offset + length:], offset + length,
                                global_only=False, layout=store.block_layout)
  cfg = store.engine.model_config
  layer = next(i for i in cfg.cache_layers
               if cfg.layer_spec(i).attention_type is AttentionType.GLOBAL)
  leaves = {k: v.copy() for k, v in leaves.items()}
  row = 0 if rng is None else int(rng.integers(len(header['tokens'])))
  leaves[kvs.leaf_names(layer)[0]][row, 0, 0] += np.float32(1e-3)
  hashed = blocks.hash_leaves(leaves, len(header['tokens']), store.block_layout)
  _, forged, new_header = blocks.encode_block(
      store.namespace, header['parent'], header['parent_header_sha256'], header['start'],
      header['tokens'], hashed, store.block_layout)
  entry_name = f'index/{header["parent"]}/{header["key"]}'
  store.backing.write(name, forged)
  offset, length = blocks.header_span(forged)
  store.backing.write(entry_name, blocks.encode_entry(
      new_header, entry['object'], len(forged), forged[offset:offset + length]))
  return {name, entry_name}
