"""Nothing silently wrong: a fault-injection campaign over the store and artifacts.

  python -m experiments.faults --trials=150 --output=results/faults_tiny_gemma3_float32.json
  python -m experiments.faults --kinds=bitflip_data,truncate --trials=20

Each trial deposits content (contexts with shared prefixes, some ending mid-block), injects one
fault of its kind at a random place, then answers: a reader that has cached nothing grafts the
longest stored prefix of one context (or restores an artifact) and computes the rest and a
query. Outcomes, per trial:

  exact      no fault reached stored data (the process kinds), and the answer is SHA-256 equal
             to a fresh computation;
  untouched  a graft was used, nothing was refused, and the answer is SHA-256 equal to fresh
             (the fault missed what the reader used);
  refused    a fault was detected with a reason (refused object, refused store, failed write)
             and the answer, computed around it, is still SHA-256 equal to fresh;
  silent_wrong  anything else (the claim is that this never happens);
  crashed    the trial raised (a traceback is a finding, counted, never hidden).

`lost` counts trials in which a committed object or entry that the fault did not touch is no
longer there, byte for byte, after the trial and a gc. The claim is silent_wrong = 0, crashed =
0 and lost = 0 for every kind.

Kinds (`--kinds`, default all; `PROCESS_KINDS` start processes and run --process_trials each):
  bitflip_data, bitflip_header, bitflip_index   one bit flipped in an object's data or header,
                                                or in an index entry
  truncate, empty, delete, rename, copy_other_key   an object cut short, emptied, deleted,
                                                moved to another name, or overwritten with
                                                another block's object
  failing_write     a kvstore that raises part way through a put (a full disk), after writing
                    a value cut short
  foreign_store     the store opened under another model, engine, dtype or tokenizer
  shape_twin        an artifact or block of another model whose shapes match
  hostile_key       keys shaped like paths ('../', absolute, very long) in listings and entries
  huge_header       a header claiming huge shapes or length (its entry's hash recomputed)
  bad_index_types   index entries of unexpected JSON types
  artifact_manifest a field of an artifact's manifest changed (with its hash recomputed or not)
  forgery           a self-consistent forgery (header, per-leaf hashes, entry all correct for
                    its bytes; one global K value off by 1e-3), before or after an honest put
  forgery_descendants   a forgery, a longer put built on it, then an honest put of its text
  stale_reader      a reader with a cached entry of a block another writer has rewritten
  rebuild_beside_put    rebuild_index run between a put's object writes and its publishing
  gc_beside_put     gc listing a put's objects unpublished and deleting after publication
  gc_inside_put     a whole gc run between a put's object writes and its publishing
  stray_names       names the store never makes under index/ and objects/, then verify and gc
  wrong_json_types  store.json fields of the wrong JSON type
  borrowed_signature    a forgery carrying a signature copied from another block
  kill_put          a process killed (SIGKILL) inside a put, at a step it reports (objects of
                    batch n written, read back or published), then this process
                    reads and writes the same store
  concurrent_put    2 to 8 processes putting the same and overlapping contexts at once

Output: schema faults (analysis/results.py).
"""


from __future__ import annotations

import collections
import dataclasses
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

from absl import logging
import numpy as np

from gemma_jax import compare, weights
from graft import exactness
from graft.engine import Engine
from gemma_jax.config import AttentionType
from graft.store import Store, StoreError, artifact, blocks, signing
from graft.store.publish import PAUSED
from graft.store.artifact import ArtifactError
from graft.store.kvstore import KvStore, StoreUrlError

# The repository root: trials that start processes run the store's entry point from it.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STORE_KINDS = ('bitflip_data', 'bitflip_header', 'bitflip_index', 'truncate', 'empty', 'delete',
               'rename', 'copy_other_key', 'failing_write', 'foreign_store', 'shape_twin',
               'hostile_key', 'huge_header', 'bad_index_types', 'artifact_manifest',
               # a writer who is wrong, and other processes at work
               'forgery', 'forgery_descendants', 'stale_reader', 'rebuild_beside_put',
               'gc_beside_put', 'gc_inside_put', 'stray_names', 'wrong_json_types',
               'borrowed_signature')
PROCESS_KINDS = ('kill_put', 'concurrent_put')
KINDS = STORE_KINDS + PROCESS_KINDS


# ----------------------------------------------------------------------------------------------
# The content every trial starts from


@dataclasses.dataclass
class World:
  """The engine, the deposited contexts with their queries and fresh logits, and a golden
  store's bytes that each trial copies into its own store."""

  engine: Engine
  contexts: list[list[int]]
  queries: list[list[int]]
  fresh: list[str]  # SHA-256 of the fresh query logits, per context
  golden: dict[str, bytes]  # kvstore key -> value of a store holding every context
  model_args: list[str]
  # Signed campaigns: the honest writer's key, and what readers trust (None: every writer).
  signing_key: signing.SigningKey | None = None
  trusted: tuple | None = None

  def store(self, kv: KvStore, engine: Engine | None = None, *, writer: bool = False) -> Store:
    """A reader (or, `writer`, the honest writer) of a trial's store."""
    return Store(kv, engine or self.engine, trusted_keys=self.trusted,
                 signing_key=self.signing_key if writer else None)


def make_world(engine: Engine, rng: np.random.Generator, model_args: list[str],
               signed: bool = False) -> World:
  """Contexts (some sharing a prefix that ends mid-block), their queries and fresh answers, and
  a golden store holding them; `signed`: written by an honest writer whose key every reader
  trusts."""
  vocab = engine.config.vocab_size
  B = engine.engine_config.rows_per_call
  draw = lambda n: [int(t) for t in rng.integers(3, vocab, n)]
  contexts = []
  for _ in range(3):
    contexts.append([2] + draw(int(rng.integers(2 * B, 12 * B))))
  for base in list(contexts):  # contexts sharing a prefix that ends mid-block
    shared = int(rng.integers(B + 1, len(base)))
    shared += shared % B == 0
    contexts.append(base[:shared] + draw(int(rng.integers(3, 4 * B))))
  queries = [draw(int(rng.integers(1, 6))) for _ in contexts]
  fresh = [exactness.fresh_sha256(engine, c, q) for c, q in zip(contexts, queries)]
  key = signing.SigningKey(signing.ed25519.Ed25519PrivateKey.generate()) if signed else None
  kv = KvStore('memory://')
  store = Store(kv, engine, signing_key=key)
  for context in contexts:
    store.put(context)
  golden = {k: kv.read(k) for k in kv.list('')}
  return World(engine, contexts, queries, fresh, golden, model_args, key,
               (key.public,) if signed else None)


def trial_store(world: World) -> KvStore:
  kv = KvStore('memory://')
  kv.write_many(list(world.golden.items()))
  return kv


# ----------------------------------------------------------------------------------------------
# Answering and classifying


@dataclasses.dataclass
class Outcome:
  # 'untouched' (the fault missed what the reader used), 'exact' (no fault on stored data),
  # 'refused' (found, named, answered around), 'silent_wrong', or 'crashed' (a traceback)
  outcome: str
  reasons: list[str]
  lost: bool
  grafted: int
  fault: str


def answer(engine: Engine, open_store, context, query) -> tuple[str, list[str], int]:
  """(SHA-256 of the query logits, reasons anything was refused for, tokens grafted): a reader
  that has cached nothing grafts what the store gives and computes the rest; a store it cannot
  open gives nothing, and the engine computes everything."""
  reasons = []
  try:
    store = open_store()
    ctx, match = store.graft(context)
    reasons += [p.reason for p in store.problems]
    grafted = match.tokens
  except (StoreError, StoreUrlError) as e:
    reasons.append(str(e))
    ctx, grafted = engine.empty(), 0
  logits, _ = exactness.graft_logits(engine, ctx, context, query)
  return compare.sha256_bytes(logits), reasons, grafted


def classify(sha: str, want: str, reasons: list[str], grafted: int) -> str:
  if sha != want:
    return 'silent_wrong'
  if reasons:
    return 'refused'
  return 'untouched' if grafted else 'silent_wrong'  # nothing refused: a graft was used


def untouched_intact(kv: KvStore, golden: dict[str, bytes], touched: set[str]) -> bool:
  """Every committed block the fault did not touch is still published with its content, and
  every other committed key (the description, signatures) still holds its bytes. A block counts
  by content: its entry may now name another object of the same header (a writer that replaced
  it with an identical recomputation), not a missing or different one."""
  keys = [k for k in golden if k not in touched and not k.startswith(('quarantine/', 'objects/'))]
  now = dict(zip(keys, kv.read_many([(k, None) for k in keys])))
  for key in keys:
    if not key.startswith('index/'):
      if now[key] != golden[key]:
        return False
      continue
    try:
      was, is_ = json.loads(golden[key]), json.loads(now[key] or b'null')
    except ValueError:
      return False
    if not isinstance(is_, dict) or is_.get('header_sha256') != was.get('header_sha256'):
      return False
    if is_['object'] != was['object'] and kv.read(f'objects/{is_["object"]}') is None:
      return False
    if is_['object'] == was['object'] and f'objects/{was["object"]}' not in touched and (
        kv.read(f'objects/{was["object"]}') != golden.get(f'objects/{was["object"]}')):
      return False
  return True


def reason_class(reason: str) -> str:
  """A reason without the paths, hex digests, numbers and quoted values that make every message
  unique, so that reasons can be counted."""
  reason = re.sub(r'(?:(?<=\s)|^)(?:file://)?/[\w.\-/]+', '<path>', reason)
  reason = re.sub(r'[0-9a-f]{16,}(?:\.\.)?', '<key>', reason)
  reason = re.sub(r'(?<![\w-])\d+(?!\w)', 'N', reason)
  reason = re.sub(r"(?<![A-Za-z])'[^']*'", "'...'", reason)
  return reason[:120]


# ----------------------------------------------------------------------------------------------
# Faults on a trial's store: each returns (the keys it touched, a description)


@dataclasses.dataclass(frozen=True)
class Place:
  """Where a fault lands: a block (its index entry and object) on the answered context's
  chain most of the time, anywhere in the store otherwise."""

  entry: str  # index/<parent>/<key>
  object: str  # objects/<key>.<writer>


def pick_place(world: World, kv: KvStore, context, rng) -> Place:
  entries = {}
  for name in kv.list('index/'):
    entries[name.rsplit('/', 1)[1]] = name
  ns = json.loads(world.golden['store.json'])['namespace']
  on_path = [entries[k] for k in blocks.chain_keys(ns, context,
                                                   world.engine.engine_config.rows_per_call) if k in entries]
  pool = on_path if on_path and rng.random() < 0.8 else sorted(entries.values())
  entry = pool[int(rng.integers(len(pool)))]
  return Place(entry, 'objects/' + json.loads(kv.read(entry))['object'])


def _flip(data: bytes, lo: int, hi: int, rng) -> bytes:
  position = int(rng.integers(lo, max(lo + 1, hi)))
  out = bytearray(data)
  out[position] ^= 1 << int(rng.integers(0, 8))
  return bytes(out)


def _object_fault(kind: str, kv: KvStore, place: Place, rng) -> tuple[set, str]:
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


def _index_fault(kind: str, kv: KvStore, place: Place, rng) -> tuple[set, str]:
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


def _huge_header(kv: KvStore, place: Place, rng) -> tuple[set, str]:
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
  header_bytes = blocks.canonical(header)
  kv.write(name, blocks.MAGIC + len(header_bytes).to_bytes(4, 'little') + header_bytes
           + data[offset + length:])
  key = header['key']
  entry_name = f'index/{header["parent"]}/{key}'
  entry = json.loads(kv.read(entry_name))
  entry['header_sha256'] = hashlib.sha256(header_bytes).hexdigest()
  entry['object_bytes'] = len(header_bytes) + offset + len(data) - offset - length
  kv.write(entry_name, blocks.canonical(entry))
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
    ok, failing = self._spend(list(items))
    super().write_many(ok)
    if failing is not None:
      super().write_many([(failing[0], failing[1][:len(failing[1]) // 2])])
      raise OSError(28, 'No space left on device (injected)')

  def write_if_absent_many(self, items) -> list[bool]:
    ok, failing = self._spend(list(items))
    written = super().write_if_absent_many(ok)
    if failing is not None:
      raise OSError(28, 'No space left on device (injected)')
    return written


# ----------------------------------------------------------------------------------------------
# Trials


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
  cfg = store.engine.config
  layer = next(i for i in cfg.cache_layers
               if cfg.layer_spec(i).attention_type is AttentionType.GLOBAL)
  leaves = {k: v.copy() for k, v in leaves.items()}
  row = 0 if rng is None else int(rng.integers(len(header['tokens'])))
  leaves[f'layer_{layer}/k'][row, 0, 0] += np.float32(1e-3)
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


def _on_path_entry(world: World, kv: KvStore, context, rng) -> dict:
  """The index entry of a random block of the context's chain."""
  store = Store(kv, world.engine)
  entries = store.lookup(context).entries
  return entries[int(rng.integers(len(entries)))]


def _repair(world: World, kv: KvStore, context) -> list[str]:
  """An honest writer puts the context again: recomputing every block when readers trust every
  writer; trusting only itself when the campaign is signed (an unsigned forgery is then a miss
  it computes). Returns what it reported."""
  writer = world.store(kv, writer=True)
  writer.put(context, recompute=world.trusted is None)
  return [p.reason for p in writer.problems]


def _extended(world: World, context, rng) -> list[int]:
  vocab = world.engine.config.vocab_size
  return list(context) + [int(t) for t in rng.integers(3, vocab, int(rng.integers(8, 40)))]


def store_trial(kind: str, world: World, rng, others: dict, scratch: str) -> Outcome:
  try:
    return _store_trial(kind, world, rng, others, scratch)
  except Exception as e:  # noqa: BLE001 (a traceback is a finding, counted, never hidden)
    logging.exception('%s trial crashed', kind)
    return Outcome('crashed', [f'{type(e).__name__}: {e}'], False, 0, kind)


def _store_trial(kind: str, world: World, rng, others: dict, scratch: str) -> Outcome:
  engine = world.engine
  c = int(rng.integers(len(world.contexts)))
  context, query, want = world.contexts[c], world.queries[c], world.fresh[c]
  kv = trial_store(world)
  reasons: list[str] = []
  open_store = lambda: world.store(kv)
  if kind in ('bitflip_data', 'bitflip_header', 'truncate', 'empty', 'delete', 'rename',
              'copy_other_key'):
    touched, fault = _object_fault(kind, kv, pick_place(world, kv, context, rng), rng)
  elif kind in ('bitflip_index', 'bad_index_types', 'hostile_key'):
    touched, fault = _index_fault(kind, kv, pick_place(world, kv, context, rng), rng)
  elif kind == 'huge_header':
    touched, fault = _huge_header(kv, pick_place(world, kv, context, rng), rng)
  elif kind == 'failing_write':
    # A new context put through a kvstore that fills up part way; then a reader answers it.
    vocab = engine.config.vocab_size
    context = world.contexts[c][:int(rng.integers(2, len(world.contexts[c])))] + [
        int(t) for t in rng.integers(3, vocab, int(rng.integers(8, 80)))]
    want = exactness.fresh_sha256(engine, context, query)
    failing = FailingKvStore(kv, budget=int(rng.integers(0, 12)))
    try:
      Store(failing, engine).put(context)
      fault = 'the disk had room enough'
    except OSError as e:
      reasons.append(f'put failed: {e}')
      fault = f'write failed after {failing.budget} values'
    touched = set()
  elif kind == 'foreign_store':
    variant = sorted(others)[int(rng.integers(len(others)))]
    engine = others[variant]
    want = exactness.fresh_sha256(engine, context, query)
    open_store = lambda: Store(kv, engine)
    touched, fault = set(), f'opened under another {variant}'
  elif kind == 'shape_twin':
    twin = others['model']
    want = exactness.fresh_sha256(twin, context, query)
    if rng.random() < 0.5:  # an artifact of the same shapes from another model
      path = os.path.join(scratch, f'artifact_{os.urandom(8).hex()}')
      library, _ = world.engine.prefill(context, logits='none')
      artifact.save(path, world.engine, library)
      sha, reasons, grafted = artifact_answer(twin, path, context, query)
      shutil.rmtree(path, ignore_errors=True)
      return Outcome(classify(sha, want, reasons, grafted), reasons,
                     not untouched_intact(kv, world.golden, set()), grafted,
                     'artifact of the same shapes from another model')
    # this model's block objects and entries copied into a store of the twin
    twin_kv = KvStore('memory://')
    Store(twin_kv, twin)  # its own description
    twin_kv.write_many([(k, v) for k, v in world.golden.items() if k != 'store.json'])
    engine, kv = twin, twin_kv
    open_store = lambda: Store(twin_kv, twin)
    touched, fault = set(), 'blocks of another model of the same shapes'
  elif kind == 'artifact_manifest':
    return artifact_manifest_trial(world, rng, context, query, want, scratch)
  elif kind == 'forgery':
    touched = forge(Store(kv, engine), _on_path_entry(world, kv, context, rng), rng)
    repaired = world.trusted is None or rng.random() < 0.5  # signed: a reader distrusts it
    if repaired:
      reasons += _repair(world, kv, context)
    fault = 'a self-consistent forgery' + (', then an honest put' if repaired else '')
  elif kind == 'forgery_descendants':
    touched = forge(Store(kv, engine), _on_path_entry(world, kv, context, rng), rng)
    longer = _extended(world, context, rng)
    world.store(kv, writer=True).put(longer)  # built on the forgery unless it is distrusted
    reasons += _repair(world, kv, context)
    context, want = longer, exactness.fresh_sha256(engine, longer, query)
    fault = 'a forgery, a longer put built on it, then an honest put of its text'
  elif kind == 'stale_reader':
    stale = world.store(kv)
    stale.lookup(context)  # caches every entry of the chain
    entry = _on_path_entry(world, kv, context, rng)
    entry_name = f'index/{entry["parent"]}/{entry["key"]}'
    kv.delete(f'objects/{entry["object"]}')  # lost by another process...
    world.store(kv, writer=True).put(context)  # ...which writes the block again
    republished = kv.read(entry_name)
    touched = {f'objects/{entry["object"]}', entry_name}
    open_store = lambda: stale  # the reader holding the stale entry answers
    fault = 'a reader with a stale entry of a block another writer rewrote'
    sha, found, grafted = answer(engine, open_store, context, query)
    reasons += found
    lost = kv.read(entry_name) != republished
    return _finish(world, kv, touched, Outcome(classify(sha, want, reasons, grafted), reasons,
                                               lost, grafted, fault))
  elif kind in ('rebuild_beside_put', 'gc_beside_put', 'gc_inside_put'):
    context = _extended(world, context, rng)
    want = exactness.fresh_sha256(engine, context, query)
    other, seen = world.store(kv), {}
    at = str(rng.choice(['written', 'verified']))  # the step the rebuild or whole gc runs at

    def beside(step, names):  # the put's after_step
      if kind == 'rebuild_beside_put' and step == at:
        other.rebuild_index()
      elif kind == 'gc_inside_put' and step == at:
        other.gc()  # the whole gc between the put's object writes and its publishing
      elif kind == 'gc_beside_put' and step == 'verified':
        seen['problems'] = other.verify()  # the put's objects, unpublished
      elif kind == 'gc_beside_put' and step == 'published':
        other.verify = lambda: seen['problems']  # ...removed after they are published
        other.gc()

    try:
      Store(kv, engine, trusted_keys=world.trusted, signing_key=world.signing_key,
            after_step=beside).put(context)
    except StoreError as e:  # the put found its own object gone or changed, and said so
      reasons.append(f'put failed: {e}')
    touched, fault = set(), kind.replace('_', ' ')
    # What the put published must still be there: an entry naming a removed object is lost.
    lost = any(kv.read(f'objects/{e["object"]}') is None
               for e in Store(kv, engine).lookup(context).entries)
    sha, found, grafted = answer(engine, lambda: world.store(kv), context, query)
    reasons += found
    return _finish(world, kv, touched, Outcome(classify(sha, want, reasons, grafted), reasons,
                                               lost, grafted, fault))
  elif kind == 'stray_names':
    strays = ['index/README', f'index/{"ab" * 32}/notes.txt', 'objects/x', 'objects/..hidden']
    for name in strays:
      kv._kv.write(name, b'put there by hand').result()  # past the store's own key check
    world.store(kv).verify()
    world.store(kv).gc()
    touched, fault = set(strays), 'names the store never makes, then verify and gc'
  elif kind == 'borrowed_signature':
    # A forgery that carries a trusted signature: one copied from another block, or one made
    # over another header (what a forger who cannot sign can do with signatures it has seen).
    entries = Store(kv, engine).lookup(context).entries
    victim = entries[int(rng.integers(len(entries)))]
    touched = forge(Store(kv, engine), victim, rng)
    donors = [n for n in kv.list('signatures/') if not n.startswith(f'signatures/{victim["key"]}')]
    if donors:
      record = kv.read(donors[int(rng.integers(len(donors)))])
      name = f'signatures/{victim["key"]}/{donors[0].rsplit("/", 1)[1]}'
      kv.write(name, record)
      touched.add(name)
    if world.trusted is None:  # readers trust every writer: only an honest put finds it
      reasons += _repair(world, kv, context)
    fault = 'a forgery with a signature borrowed from another block'
  elif kind == 'wrong_json_types':
    description = json.loads(kv.read('store.json'))
    field = ['model', 'engine', 'namespace', 'format'][int(rng.integers(4))]
    description[field] = [None, 7, 'text', {'sha256': 3}][int(rng.integers(4))]
    kv.write('store.json', json.dumps(description).encode())
    touched, fault = {'store.json'}, f'store.json {field} of another JSON type'
  else:
    raise ValueError(kind)
  sha, found, grafted = answer(engine, open_store, context, query)
  reasons += found
  golden = world.golden if kind != 'shape_twin' else {}
  return _finish(world, kv, touched, Outcome(
      classify(sha, want, reasons, grafted), reasons, not untouched_intact(kv, golden, touched),
      grafted, fault), golden)


def _finish(world: World, kv: KvStore, touched: set, outcome: Outcome,
            golden: dict | None = None) -> Outcome:
  """gc after the trial: what it removes of what the fault did not touch is lost too."""
  golden = world.golden if golden is None else golden
  try:
    world.store(kv).gc()
  except StoreError:
    pass  # a store that cannot be opened is not collected
  outcome.lost = outcome.lost or not untouched_intact(kv, golden, touched)
  return outcome


def artifact_answer(engine: Engine, path: str, context, query) -> tuple[str, list[str], int]:
  try:
    ctx = artifact.graft(engine, artifact.load(path, engine))
    reasons, grafted = [], len(ctx.tokens)
  except ArtifactError as e:
    ctx, reasons, grafted = engine.empty(), [str(e)], 0
  logits, _ = exactness.graft_logits(engine, ctx, context, query)
  return compare.sha256_bytes(logits), reasons, grafted


def artifact_manifest_trial(world: World, rng, context, query, want, scratch) -> Outcome:
  engine = world.engine
  path = os.path.join(scratch, f'artifact_{os.urandom(8).hex()}')
  library, _ = engine.prefill(context, logits='none')
  artifact.save(path, engine, library)
  manifest_path = os.path.join(path, artifact.MANIFEST)
  manifest = json.load(open(manifest_path))
  field = ['next_position', 'start_position', 'num_tokens', 'tokens_sha256', 'leaves', 'files',
           'format', 'engine', 'model'][int(rng.integers(9))]
  value = manifest[field]
  if isinstance(value, int):
    manifest[field] = value + int(rng.choice([-3, -1, 1, 7, 1000]))
  elif isinstance(value, str):
    manifest[field] = value[::-1]
  else:  # a dict: drop or alter one entry
    sub = sorted(value)[int(rng.integers(len(value)))]
    hashes = [h for h in ('blake3', 'sha256') if isinstance(value[sub], dict) and h in value[sub]]
    if hashes:
      value[sub] = {**value[sub], hashes[0]: '0' * 64}
    else:
      value[sub] = 'tampered'
  resealed = rng.random() < 0.5
  if resealed:  # as a tamperer who knows the format would
    manifest['manifest_sha256'] = artifact.manifest_digest(manifest)
  with open(manifest_path, 'w') as f:
    json.dump(manifest, f)
  sha, reasons, grafted = artifact_answer(engine, path, context, query)
  shutil.rmtree(path, ignore_errors=True)
  return Outcome(classify(sha, want, reasons, grafted), reasons, False, grafted,
                 f'manifest {field} changed{" and resealed" if resealed else ""}')


def _put_process(url: str, path: str, model_args: list[str],
                 pause: str | None = None) -> subprocess.Popen:
  """`experiments.store put` in another process; pause: its --pause_at ('STEP:N')."""
  return subprocess.Popen([sys.executable, '-m', 'experiments.store', 'put', f'--store={url}',
                           f'--input={path}', *model_args,
                           *([f'--pause_at={pause}'] if pause else [])], cwd=REPO,
                          env={**os.environ, 'PYTHONPATH': REPO},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill_when_paused(proc: subprocess.Popen) -> str | None:
  """Waits for the writer to report that it paused inside a put, kills it (SIGKILL) and returns
  the step; None (the writer killed all the same) when it ended without reporting it or the
  kill did not land."""
  step = None
  for line in proc.stderr:
    if line.startswith(PAUSED):
      step = line[len(PAUSED):].split()[0]
      break
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  return step if proc.returncode == -signal.SIGKILL else None


def _file_store(world: World, directory: str) -> tuple[str, KvStore]:
  url = f'file://{directory}/'
  kv = KvStore(url)
  kv.write_many(list(world.golden.items()))
  return url, kv


def process_trial(kind: str, world: World, rng, scratch: str) -> Outcome:
  engine = world.engine
  vocab = engine.config.vocab_size
  directory = tempfile.mkdtemp(dir=scratch)
  url, kv = _file_store(world, directory)
  draw = lambda n: [int(t) for t in rng.integers(3, vocab, n)]
  reasons: list[str] = []
  if kind == 'kill_put':
    new = [world.contexts[int(rng.integers(len(world.contexts)))][:int(rng.integers(2, 30))]
           + draw(int(rng.integers(100, 400))) for _ in range(3)]
    path = os.path.join(directory, '..', os.path.basename(directory) + '.jsonl')
    with open(path, 'w') as f:
      f.writelines(json.dumps({'tokens': c}) + '\n' for c in new)
    # Killed inside the put, at a step the writer reports: after batch n's objects were
    # written, read back or published (each context is one write batch).
    step, n = str(rng.choice(['written', 'verified', 'published'])), int(rng.integers(1, 4))
    reached = _kill_when_paused(_put_process(url, path, world.model_args, f'{step}:{n}'))
    fault = f'put killed after batch {n} was {step}'
    if reached != step:
      shutil.rmtree(directory, ignore_errors=True)
      return Outcome('crashed', [f'the writer was not killed where asked ({step}:{n})'], False, 0,
                     fault)
    context, query = new[int(rng.integers(len(new)))], draw(3)
    want = exactness.fresh_sha256(engine, context, query)
    # A second process (this one) reads, then writes the same store, then reads again.
    sha, found, grafted = answer(engine, lambda: Store(kv, engine), context, query)
    writer = Store(kv, engine)
    writer.put(context)
    sha2, found2, grafted2 = answer(engine, lambda: Store(kv, engine), context, query)
    reasons += found + found2
    ok = sha == want and sha2 == want and grafted2 == len(context)
    outcome = ('silent_wrong' if not ok else 'refused' if reasons else 'exact')
  else:  # concurrent_put
    writers = int(rng.integers(2, 9))
    shared = [world.contexts[0][:int(rng.integers(2, 40))] + draw(int(rng.integers(20, 120)))
              for _ in range(3)]
    paths = []
    for w in range(writers):  # each writer: the shared contexts plus one of its own, in its order
      own = shared[int(rng.integers(3))][:int(rng.integers(2, 30))] + draw(40)
      mine = [shared[i] for i in rng.permutation(3)] + [own]
      paths.append(os.path.join(scratch, f'{os.path.basename(directory)}_{w}.jsonl'))
      with open(paths[-1], 'w') as f:
        f.writelines(json.dumps({'tokens': c}) + '\n' for c in mine)
    procs = [_put_process(url, p, world.model_args) for p in paths]
    failures = []
    for proc in procs:
      _, err = proc.communicate(timeout=900)
      if proc.returncode:
        failures.append(err[-300:])
    fault = f'{writers} writers at once'
    reasons += [f'a writer failed: {f}' for f in failures]
    store = Store(kv, engine)
    problems = store.verify()
    entries = store.entries()
    one_copy = len(kv.list('objects/')) == len(entries)
    outcome = 'exact'
    for context in shared:
      query = draw(3)
      sha, found, grafted = answer(engine, lambda: Store(kv, engine), context, query)
      if sha != exactness.fresh_sha256(engine, context, query) or grafted != len(context):
        outcome = 'silent_wrong'
      reasons += found
    if problems or not one_copy or failures:
      outcome = 'silent_wrong'  # a writer must neither fail nor leave a bad or second copy
      reasons += [p.reason for p in problems] + ([] if one_copy else ['a second copy was left'])
    elif reasons and outcome == 'exact':
      outcome = 'refused'
  lost = not untouched_intact(kv, world.golden, set())
  shutil.rmtree(directory, ignore_errors=True)
  return Outcome(outcome, reasons, lost, 0, fault)


def campaign(world: World, kinds, trials: int, process_trials: int, seed: int, others: dict,
             scratch: str) -> dict:
  results = {}
  for k, kind in enumerate(kinds):
    rng = np.random.default_rng([seed, k])
    count = process_trials if kind in PROCESS_KINDS else trials
    tally = {'trials': 0, 'exact': 0, 'untouched': 0, 'refused': 0,
             'reasons': collections.Counter(), 'silent_wrong': 0, 'crashed': 0, 'lost': 0,
             'examples': []}
    start = time.perf_counter()
    for i in range(count):
      if kind in PROCESS_KINDS:
        outcome = process_trial(kind, world, rng, scratch)
      else:
        outcome = store_trial(kind, world, rng, others, scratch)
      tally['trials'] += 1
      tally[outcome.outcome] += 1
      tally['lost'] += outcome.lost
      if outcome.outcome == 'refused':
        tally['reasons'][reason_class(outcome.reasons[0])] += 1
      if outcome.outcome in ('silent_wrong', 'crashed') or outcome.lost:
        tally['examples'].append({'fault': outcome.fault, 'reasons': outcome.reasons[:3],
                                  'grafted': outcome.grafted})
        logging.error('%s trial %d: %s, lost=%s (%s)', kind, i, outcome.outcome, outcome.lost,
                      outcome.fault)
    tally['reasons'] = dict(tally['reasons'].most_common())
    tally['seconds'] = round(time.perf_counter() - start, 1)
    results[kind] = tally
    logging.info('%s: %d trials, %d exact, %d untouched, %d refused, %d silent-wrong, %d '
                 'crashed, %d lost (%.0f s)', kind, tally['trials'], tally['exact'],
                 tally['untouched'], tally['refused'], tally['silent_wrong'], tally['crashed'],
                 tally['lost'], tally['seconds'])
  return results


def other_engines(loaded, engine: Engine) -> dict[str, Engine]:
  """What another reader could be: another model of the same shapes, another dtype, another
  engine configuration, another tokenizer."""
  from sentencepiece import sentencepiece_model_pb2
  from gemma_jax.tokenizer import Tokenizer
  config = engine.engine_config
  proto = sentencepiece_model_pb2.ModelProto.FromString(loaded.tokenizer.model_proto)
  proto.pieces[-1].score -= 1.0  # one piece scored otherwise: another tokenizer
  seed = int(loaded.weights.split(':')[1]) + 1 if loaded.weights.startswith('random:') else 1
  twin = weights.load(loaded.config, f'random:{seed}', loaded.dtype)
  return {
      'model': Engine(twin, config),
      'dtype': Engine(weights.load(loaded.config, loaded.weights,
                                   'bfloat16' if loaded.dtype == 'float32' else 'float32'),
                      dataclasses.replace(config, mode='pinned', dot_library=None)),  # the spec is float32
      'engine': Engine(loaded, dataclasses.replace(config, rows_per_call=2 * config.rows_per_call)),
      'tokenizer': Engine(dataclasses.replace(
          loaded, tokenizer=Tokenizer.from_model_proto(proto.SerializeToString())), config),
  }
