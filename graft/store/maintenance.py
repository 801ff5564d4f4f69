"""Maintenance: verify (every entry and object checked, nothing changed), audit (blocks
recomputed with the reader's engine and compared), quarantine (a bad object moved aside with
its reason, its entry removed) and gc (objects no entry reaches, past their put's lease).
"""

from __future__ import annotations

import collections
import json
import time
import uuid

import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax import digest
from graft.store import blocks
from graft.store.blocks import BlockError
from graft.store.shared import HEX64, OBJECT_NAME, LEASE_SECONDS, Problem


class Maintenance:
  """The maintenance room of graft.store.Store (a mixin: the Store holds the state)."""

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

  def verify(self) -> list[Problem]:
    """Reads and checks every entry and object of the store (without changing it): every
    problem found, named. Unreachable entries and unpublished objects are listed too."""
    problems: list[Problem] = []
    names = self.backing.list('index/')
    reachable = {blocks.ROOT}
    by_parent = collections.defaultdict(list)
    for name in names:
      parts = name.split('/')
      if len(parts) != 3 or not all(HEX64.fullmatch(p) for p in parts[1:]):
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
      if not OBJECT_NAME.fullmatch(name):
        problems.append(Problem('', name[:200], 'stray: not a name this store makes (left '
                                'alone: never read, followed or deleted)'))
      elif name.split('/', 1)[1] not in published:
        problems.append(Problem(name.split('/', 1)[1][:64], name,
                                'not published (left by an interrupted or losing put)'))
    return problems

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
