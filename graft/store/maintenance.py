"""Maintenance of a store: verify (every entry and object checked, nothing changed), audit
(blocks recomputed with the reader's engine and compared) and gc (objects no entry reaches,
past their put's lease, and entries whose object fails verification, quarantined), which acts
on verify's findings by their kind.
"""

from __future__ import annotations

import collections
import json
import time

import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax import digest
from graft.engine import Engine
from graft.store import blocks
from graft.store.blocks import BlockError
from graft.store.index import Index
from graft.store.kvstore import KvStore
from graft.store.reads import Reads
from graft.store.shared import HEX64, OBJECT_NAME, LEASE_SECONDS, Codec, Kind, Problem

_STRAY = 'stray: not a name this store makes (left alone: never read, followed or deleted)'


class Maintenance:
  """Checks of a whole store, and its collection.

  Args:
    backing: the store's storage.
    codec: the formats bound to the store's namespace and the engine's layout.
    engine: the reader's engine, which recomputes audited blocks.
    index: the published entries (and the quarantine of what gc removes).
    reads: the object reads.
  """

  def __init__(self, backing: KvStore, codec: Codec, engine: Engine, index: Index,
               reads: Reads):
    self._backing, self._codec, self._engine = backing, codec, engine
    self._index, self._reads = index, reads

  def verify(self) -> list[Problem]:
    """Reads and checks every entry and object of the store (without changing it): every
    problem found, named. Unreachable entries and unpublished objects are listed too."""
    problems: list[Problem] = []
    names = self._backing.list('index/')
    reachable = {blocks.ROOT}
    by_parent = collections.defaultdict(list)
    for name in names:
      parts = name.split('/')
      if len(parts) != 3 or not all(HEX64.fullmatch(p) for p in parts[1:]):
        problems.append(Problem(Kind.STRAY, '', name[:200], _STRAY))
        continue
      by_parent[parts[1]].append(parts[2])
    frontier = [(blocks.ROOT, 0, True)]  # (parent, start, of a context's chain)
    published = set()
    while frontier:
      parent, start, context = frontier.pop()
      for key in by_parent.get(parent, []):
        name = f'index/{parent}/{key}'
        try:
          entry = self._codec.entry(self._backing.read(name) or b'', parent=parent, key=key,
                                    start=start)
        except BlockError as e:
          problems.append(Problem(Kind.BAD_ENTRY, key, name, str(e)))
          continue
        published.add(entry['object'])
        reachable.add(key)  # its children are addressed by key whatever its object holds
        frontier.append((key, start + self._codec.block_tokens, context))
        if context:  # the documents stored after the prefix this block ends
          root = blocks.document_root(self._codec.namespace, key)
          reachable.add(root)
          frontier.append((root, 0, False))
        try:
          self._reads.read_object(entry, global_only=False)
        except BlockError as e:
          problems.append(Problem(Kind.BAD_OBJECT, key, name, f'its object: {e}'))
    for parent, keys in by_parent.items():
      if parent not in reachable:
        problems += [Problem(Kind.UNREACHABLE, k, f'index/{parent}/{k}',
                             'unreachable: its parent is not published') for k in keys]
        published.update(self._object_named(f'index/{parent}/{k}') for k in keys)
    for name in self._backing.list('objects/'):
      if not OBJECT_NAME.fullmatch(name):
        problems.append(Problem(Kind.STRAY, '', name[:200], _STRAY))
      elif name.split('/', 1)[1] not in published:
        problems.append(Problem(Kind.UNPUBLISHED, name.split('/', 1)[1][:64], name,
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
    # (parent, start, the context it extends, the forged header it descends from, the sequence
    # index of the chain's first token: 0 for a context, the prefix's length for a document)
    problems, frontier = [], [(blocks.ROOT, 0, self._engine.empty(), None, 0)]
    while frontier:
      parent, start, ctx, forged_header, base = frontier.pop()
      for entry in sorted(self._index.children(parent, start), key=lambda e: e['key']):
        child_ctx, _ = self._engine.extend(ctx, entry['tokens'], logits='none')
        bad = forged_header
        if forged_header is not None and entry['parent_header_sha256'] == forged_header:
          problems.append(Problem(Kind.BUILT_ON_FORGERY, entry['key'],
                                  f'objects/{entry["object"]}', 'built on a forged block (its '
                                  'parent header is the forgery\'s)'))
          bad = entry['header_sha256']
        elif rng.random() < fraction:
          header = self._reads.header_of(entry)
          rows = kvs.take_rows(child_ctx.kv, base + start, base + start + len(entry['tokens']))
          hash_name = blocks.content_hash(header)
          mine = {name: digest.hexdigest(hash_name, np.asarray(a)) for name, a in
                  kvs.block_leaves(rows, self._engine.model_config.cache_layers).items()}
          if any(mine[leaf['name']] != leaf[hash_name] for leaf in header['leaves']):
            problems.append(Problem(Kind.FORGED, entry['key'], f'objects/{entry["object"]}',
                                    'forged: its bytes differ from a recomputation by this '
                                    'engine'))
            bad = entry['header_sha256']
        frontier.append((entry['key'], start + self._codec.block_tokens, child_ctx, bad, base))
        if not base:  # the documents stored after the prefix this block ends
          frontier.append((blocks.document_root(self._codec.namespace, entry['key']), 0,
                           child_ctx, bad, len(child_ctx.tokens)))
    return problems

  def gc(self, findings: list[Problem], *, lease_seconds: float = LEASE_SECONDS) -> dict:
    """Removes what cannot be used and is not sound, as `findings` (verify's, listed before
    this call) name it by kind: unpublished objects left by an interrupted or losing put (once
    no live lease holds them: a running put leases its objects until they are published; a
    lease older than `lease_seconds` is a dead writer's and goes too) and bad entries and
    entries whose object fails verification (quarantined, with a copy). Stray names are left
    alone, and an entry whose parent is not published is kept while its object is sound: the
    parent is addressed by its tokens, so a later put of them makes it reachable again. Safe
    beside puts: the leases are read after verify has listed the objects and before each is
    checked for publication, and a put publishes before it drops its lease, so every object of
    a running put is seen leased or published. Returns how many objects and entries it
    removed."""
    removed = {'objects': 0, 'entries': 0}
    leased, expired = self._leases(lease_seconds)
    for problem in findings:
      if problem.kind is Kind.UNPUBLISHED:
        key = problem.name.split('/', 1)[1].split('.')[0]
        if problem.name in leased or any(e.get('object') == problem.name.split('/', 1)[1]
                                         for e in self._published_entries(key)):
          continue  # a running put's, or published since verify listed it
        self._backing.delete(problem.name)
        removed['objects'] += 1
      elif problem.kind in (Kind.BAD_ENTRY, Kind.BAD_OBJECT):
        data = self._backing.read(problem.name)
        try:
          entry = json.loads(data) if data is not None else None  # gone: not an entry
          if not isinstance(entry, dict) or not isinstance(entry.get('object'), str):
            raise ValueError('not an entry')
          self._index.quarantine_object({**entry, 'key': problem.key,
                                         'parent': problem.name.split('/')[1]}, problem.reason,
                                        judged=entry)
        except (ValueError, TypeError):
          self._index.quarantine(problem.key, problem.name, problem.reason,
                                 entry_name=problem.name, judged=data)
          self._index.rebuild_entry(problem.name.split('/')[1], problem.key)
        removed['entries'] += 1
    for name in expired:
      self._backing.delete(name)
    return removed

  def _leases(self, lease_seconds: float) -> tuple[set[str], list[str]]:
    """(the objects held by live put leases, the names of leases older than `lease_seconds`).
    A lease that does not decode holds nothing and is left alone, like any stray name."""
    live: set[str] = set()
    expired: list[str] = []
    now = time.time()
    for name in self._backing.list('staging/'):
      try:
        lease = json.loads(self._backing.read(name) or b'null')
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
    for name in self._backing.list('index/'):
      if name.endswith('/' + key):
        try:
          value = json.loads(self._backing.read(name) or b'null')
          out.append(value if isinstance(value, dict) else {})
        except ValueError:
          pass
    return out

  def _object_named(self, entry_name: str) -> str | None:
    """The object an entry names, as written (not verified; None if it names none)."""
    try:
      entry = json.loads(self._backing.read(entry_name) or b'null')
    except ValueError:
      return None
    return entry.get('object') if isinstance(entry, dict) else None
