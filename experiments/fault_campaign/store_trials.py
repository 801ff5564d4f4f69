"""The in-process trials: one function per fault kind (`TRIALS`), each run on a copy of the
golden store and answered by a reader that has cached nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from typing import Callable

from absl import logging

from experiments.fault_campaign import damage
from experiments.fault_campaign.world import (Composed, Outcome, World, answer,
                                              artifact_answer, classify, extended, finish,
                                              fresh_sha256, path_entries, put, tokens_of,
                                              trial_store, untouched_intact)
from graft import exactness
from graft.engine import Engine
from graft.store import Store, StoreError, artifact
from graft.store.kvstore import KvStore


@dataclasses.dataclass
class Trial:
  """One trial's state. A kind's function lands its fault and records what it `touched` and
  the `fault` it made; it may change what is answered (the context, the fresh SHA-256 `want`,
  the engine, the store and how a reader opens it) and what was refused on the way
  (`reasons`). It returns None for the common answer (`_answered`), or an Outcome when it
  answered itself."""

  kind: str
  world: World
  rng: object  # np.random.Generator
  others: dict[str, Engine]
  scratch: str
  engine: Engine
  kv: KvStore
  context: list[int]
  query: list[int]
  want: str
  reasons: list[str] = dataclasses.field(default_factory=list)
  open_store: Callable[[], Store] | None = None
  touched: set = dataclasses.field(default_factory=set)
  fault: str = ''
  golden: dict | None = None  # what must stay intact (None: the world's golden store)


def store_trial(kind: str, world: World, rng, others: dict, scratch: str) -> Outcome:
  """One trial of an in-process kind; a trial that raises is counted as crashed."""
  try:
    c = int(rng.integers(len(world.contexts)))
    t = Trial(kind, world, rng, others, scratch, world.engine, trial_store(world),
              world.contexts[c], world.queries[c], world.fresh[c])
    t.open_store = lambda: world.store(t.kv)
    return TRIALS[kind](t) or _answered(t)
  except Exception as e:  # noqa: BLE001 (a traceback is a finding, counted, never hidden)
    logging.exception('%s trial crashed', kind)
    return Outcome('crashed', [f'{type(e).__name__}: {e}'], False, 0, kind)


def _answered(t: Trial) -> Outcome:
  """A reader answers the context; then gc, and what the fault did not touch must be there."""
  sha, found, grafted = answer(t.engine, t.open_store, t.context, t.query)
  t.reasons += found
  golden = t.world.golden if t.golden is None else t.golden
  return finish(t.world, t.kv, t.touched, Outcome(
      classify(sha, t.want, t.reasons, grafted), t.reasons,
      not untouched_intact(t.kv, golden, t.touched), grafted, t.fault), golden)


def _object(t: Trial) -> None:
  t.touched, t.fault = damage.object_fault(
      t.kind, t.kv, damage.pick_place(t.world, t.kv, t.context, t.rng), t.rng)


def _index(t: Trial) -> None:
  t.touched, t.fault = damage.index_fault(
      t.kind, t.kv, damage.pick_place(t.world, t.kv, t.context, t.rng), t.rng)


def _huge_header(t: Trial) -> None:
  t.touched, t.fault = damage.huge_header(
      t.kv, damage.pick_place(t.world, t.kv, t.context, t.rng), t.rng)


def _failing_write(t: Trial) -> None:
  # A new context (a composition with a new document) put through a kvstore that fills up
  # part way; then a reader answers it.
  vocab = t.engine.model_config.vocab_size
  base = t.context
  if isinstance(base, Composed):
    t.context = extended(base, t.rng, vocab)
  else:
    t.context = base[:int(t.rng.integers(2, len(base)))] + [
        int(x) for x in t.rng.integers(3, vocab, int(t.rng.integers(8, 80)))]
  t.want = fresh_sha256(t.engine, t.context, t.query)
  failing = damage.FailingKvStore(t.kv, budget=int(t.rng.integers(0, 12)))
  try:
    put(Store(failing, t.engine), t.context)
    t.fault = 'the disk had room enough'
  except OSError as e:
    t.reasons.append(f'put failed: {e}')
    t.fault = f'write failed after {failing.budget} values'


def _foreign_store(t: Trial) -> None:
  variant = sorted(t.others)[int(t.rng.integers(len(t.others)))]
  engine = t.engine = t.others[variant]
  t.want = fresh_sha256(engine, t.context, t.query)
  t.open_store = lambda: Store(t.kv, engine)
  t.fault = f'opened under another {variant}'


def _shape_twin(t: Trial) -> Outcome | None:
  twin = t.others['model']
  t.want = fresh_sha256(twin, t.context, t.query)
  if t.rng.random() < 0.5:  # an artifact of the same shapes from another model
    path = os.path.join(t.scratch, f'artifact_{os.urandom(8).hex()}')
    tokens = tokens_of(t.context)  # an artifact holds a context, whatever the trials deposit
    library, _ = t.world.engine.prefill(tokens, logits='none')
    artifact.save(path, t.world.engine, library)
    want = exactness.fresh_sha256(twin, tokens, t.query)
    sha, reasons, grafted = artifact_answer(twin, path, tokens, t.query)
    shutil.rmtree(path, ignore_errors=True)
    return Outcome(classify(sha, want, reasons, grafted), reasons,
                   not untouched_intact(t.kv, t.world.golden, set()), grafted,
                   'artifact of the same shapes from another model')
  # this model's block objects and entries copied into a store of the twin
  twin_kv = KvStore('memory://')
  Store(twin_kv, twin)  # its own description
  twin_kv.write_many([(k, v) for k, v in t.world.golden.items() if k != 'store.json'])
  t.engine, t.kv = twin, twin_kv
  t.open_store = lambda: Store(twin_kv, twin)
  t.fault, t.golden = 'blocks of another model of the same shapes', {}
  return None


def _artifact_manifest(t: Trial) -> Outcome:
  """A field of an artifact's manifest changed, resealed (its hash recomputed) or not."""
  engine, rng = t.world.engine, t.rng
  path = os.path.join(t.scratch, f'artifact_{os.urandom(8).hex()}')
  tokens = tokens_of(t.context)  # an artifact holds a context, whatever the trials deposit
  want = exactness.fresh_sha256(engine, tokens, t.query)
  library, _ = engine.prefill(tokens, logits='none')
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
  sha, reasons, grafted = artifact_answer(engine, path, tokens, t.query)
  shutil.rmtree(path, ignore_errors=True)
  return Outcome(classify(sha, want, reasons, grafted), reasons, False, grafted,
                 f'manifest {field} changed{" and resealed" if resealed else ""}')


def _on_path_entry(t: Trial) -> dict:
  """The index entry of a random block on the target's path."""
  entries = path_entries(Store(t.kv, t.world.engine), t.context)
  return entries[int(t.rng.integers(len(entries)))]


def _repair(t: Trial, context) -> None:
  """An honest writer puts the context again: recomputing every block when readers trust every
  writer; trusting only itself when the campaign is signed (an unsigned forgery is then a miss
  it computes). What it reported joins the trial's reasons."""
  writer = t.world.store(t.kv, writer=True)
  put(writer, context, recompute=t.world.trusted is None)
  t.reasons += [p.reason for p in writer.problems]


def _extended(t: Trial):
  return extended(t.context, t.rng, t.world.engine.model_config.vocab_size)


def _forgery(t: Trial) -> None:
  t.touched = damage.forge(Store(t.kv, t.engine), _on_path_entry(t), t.rng)
  repaired = t.world.trusted is None or t.rng.random() < 0.5  # signed: a reader distrusts it
  if repaired:
    _repair(t, t.context)
  t.fault = 'a self-consistent forgery' + (', then an honest put' if repaired else '')


def _forgery_descendants(t: Trial) -> None:
  t.touched = damage.forge(Store(t.kv, t.engine), _on_path_entry(t), t.rng)
  longer = _extended(t)
  put(t.world.store(t.kv, writer=True), longer)  # built on the forgery unless distrusted
  _repair(t, t.context)
  t.context, t.want = longer, fresh_sha256(t.engine, longer, t.query)
  t.fault = 'a forgery, a longer put built on it, then an honest put of its text'


def _stale_reader(t: Trial) -> Outcome:
  kv = t.kv
  stale = t.world.store(kv)
  path_entries(stale, t.context)  # caches every entry on the path
  entry = _on_path_entry(t)
  entry_name = f'index/{entry["parent"]}/{entry["key"]}'
  kv.delete(f'objects/{entry["object"]}')  # lost by another process...
  put(t.world.store(kv, writer=True), t.context)  # ...which writes the block again
  republished = kv.read(entry_name)
  touched = {f'objects/{entry["object"]}', entry_name}
  fault = 'a reader with a stale entry of a block another writer rewrote'
  sha, found, grafted = answer(t.engine, lambda: stale, t.context, t.query)  # it answers
  t.reasons += found
  lost = kv.read(entry_name) != republished
  return finish(t.world, kv, touched, Outcome(classify(sha, t.want, t.reasons, grafted),
                                              t.reasons, lost, grafted, fault))


def _beside_put(t: Trial) -> Outcome:
  """rebuild_index, a verify then gc, or a whole gc run by another reader while a put is
  between its object writes and its publishing (its `after_step` hook)."""
  kind, kv, engine, world = t.kind, t.kv, t.engine, t.world
  context = _extended(t)
  want = fresh_sha256(engine, context, t.query)
  other, seen = world.store(kv), {}
  at = str(t.rng.choice(['written', 'verified']))  # the step the rebuild or whole gc runs at

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
    put(Store(kv, engine, trusted_keys=world.trusted, signing_key=world.signing_key,
              after_step=beside), context)
  except StoreError as e:  # the put found its own object gone or changed, and said so
    t.reasons.append(f'put failed: {e}')
  # What the put published must still be there: an entry naming a removed object is lost.
  lost = any(kv.read(f'objects/{e["object"]}') is None
             for e in path_entries(Store(kv, engine), context))
  sha, found, grafted = answer(engine, lambda: world.store(kv), context, t.query)
  t.reasons += found
  return finish(world, kv, set(), Outcome(classify(sha, want, t.reasons, grafted), t.reasons,
                                          lost, grafted, kind.replace('_', ' ')))


def _stray_names(t: Trial) -> None:
  strays = ['index/README', f'index/{"ab" * 32}/notes.txt', 'objects/x', 'objects/..hidden']
  for name in strays:
    t.kv._kv.write(name, b'put there by hand').result()  # past the store's own key check
  t.world.store(t.kv).verify()
  t.world.store(t.kv).gc()
  t.touched, t.fault = set(strays), 'names the store never makes, then verify and gc'


def _borrowed_signature(t: Trial) -> None:
  # A forgery that carries a trusted signature: one copied from another block, or one made
  # over another header (what a forger who cannot sign can do with signatures it has seen).
  kv = t.kv
  entries = path_entries(Store(kv, t.engine), t.context)
  victim = entries[int(t.rng.integers(len(entries)))]
  t.touched = damage.forge(Store(kv, t.engine), victim, t.rng)
  donors = [n for n in kv.list('signatures/') if not n.startswith(f'signatures/{victim["key"]}')]
  if donors:
    record = kv.read(donors[int(t.rng.integers(len(donors)))])
    name = f'signatures/{victim["key"]}/{donors[0].rsplit("/", 1)[1]}'
    kv.write(name, record)
    t.touched.add(name)
  if t.world.trusted is None:  # readers trust every writer: only an honest put finds it
    _repair(t, t.context)
  t.fault = 'a forgery with a signature borrowed from another block'


def _wrong_json_types(t: Trial) -> None:
  description = json.loads(t.kv.read('store.json'))
  field = ['model', 'engine', 'namespace', 'format'][int(t.rng.integers(4))]
  description[field] = [None, 7, 'text', {'sha256': 3}][int(t.rng.integers(4))]
  t.kv.write('store.json', json.dumps(description).encode())
  t.touched, t.fault = {'store.json'}, f'store.json {field} of another JSON type'


# kind -> its trial, in the order of the module docstring's list.
TRIALS: dict[str, Callable[[Trial], Outcome | None]] = {
    **{k: _object for k in ('bitflip_data', 'bitflip_header', 'truncate', 'empty', 'delete',
                            'rename', 'copy_other_key')},
    **{k: _index for k in ('bitflip_index', 'bad_index_types', 'hostile_key')},
    'huge_header': _huge_header, 'failing_write': _failing_write,
    'foreign_store': _foreign_store, 'shape_twin': _shape_twin,
    'artifact_manifest': _artifact_manifest, 'forgery': _forgery,
    'forgery_descendants': _forgery_descendants, 'stale_reader': _stale_reader,
    **{k: _beside_put for k in ('rebuild_beside_put', 'gc_beside_put', 'gc_inside_put')},
    'stray_names': _stray_names, 'borrowed_signature': _borrowed_signature,
    'wrong_json_types': _wrong_json_types,
}
