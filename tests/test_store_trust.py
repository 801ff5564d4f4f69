"""A store you can share: a writer who is wrong, readers who choose whom to trust, and nothing
sound lost. tiny_gemma3, random weights, memory:// stores; exactness is SHA-256 equality.

The forgery every test uses is the one an audit found grafted: a block whose header, per-leaf
SHA-256 and index entry are all correct for its bytes, but one K value of a global layer is off
by 1e-3.
"""

import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest

from experiments.fault_campaign.damage import forge  # a self-consistent forgery
from gemma_jax import weights
from gemma_jax.compare import sha256_bytes
from gemma_jax.digest import canonical_json
from graft.engine import Engine, EngineConfig
from graft.store import Store, blocks, signing
from graft.store.kvstore import KvStore

REPO = pathlib.Path(__file__).resolve().parents[1]
B = 8


@pytest.fixture(scope='module')
def eng():
  return Engine(weights.load('tiny_gemma3', 'random:0', 'float32'),
                EngineConfig(rows_per_call=B, cache_len=512, attention_tile=8))


def tokens(n, seed):
  return [2] + [int(t) for t in np.random.default_rng(seed).integers(3, 512, n - 1)]


def answer(store, context, query):
  """SHA-256 of the query logits after what the store grafts, and the tokens grafted."""
  ctx, match = store.graft(context)
  _, logits = store.engine.extend(ctx, list(context[match.tokens:]) + list(query),
                                  logits=len(query))
  return sha256_bytes(logits), match.tokens


def fresh(eng, context, query):
  return sha256_bytes(eng.extend(eng.empty(), list(context) + list(query),
                                 logits=len(query))[1])


def test_a_self_consistent_forgery_is_found_by_recomputation_not_by_hashes(eng):
  store = Store('memory://', eng)
  library, query = tokens(40, 1), tokens(6, 2)[1:]
  store.put(library)
  forge(store, store.lookup(library).entries[2])
  reader = Store(store.backing, eng)
  assert reader.verify() == []  # every hash checks out: hashes cannot see it
  assert answer(reader, library, query)[0] != fresh(eng, library, query)  # and it is grafted
  (problem,) = Store(store.backing, eng).audit(1.0)
  assert problem.key == store.lookup(library).entries[2]['key'] and 'forged' in problem.reason


def test_an_honest_put_replaces_a_forgery_and_reports_the_conflict(eng):
  store = Store('memory://', eng)
  library, query = tokens(40, 3), tokens(6, 4)[1:]
  store.put(library)
  victim = store.lookup(library).entries[4]
  forge(store, victim)
  honest = Store(store.backing, eng)
  # An honest writer of a text that diverges inside block 4 recomputes block 4 itself.
  report = honest.put(library[:4 * B] + tokens(20, 5))
  assert report['conflicts'] == 0  # another block: no conflict there
  report = Store(store.backing, eng).put(library, recompute=True)  # every block computed
  assert report['conflicts'] == 1 and report['blocks_written'] == 1
  assert any('conflict' in json.loads(store.backing.read(n)).get('reason', '')
             for n in store.backing.list('quarantine/') if n.endswith('.json'))
  reader = Store(store.backing, eng)
  assert answer(reader, library, query) == (fresh(eng, library, query), len(library))
  assert reader.audit(1.0) == []


def test_blocks_built_on_a_forgery_are_found_and_never_grafted_after_it_is_replaced(eng):
  store = Store('memory://', eng)
  short, longer, query = tokens(24, 6), None, tokens(6, 7)[1:]
  longer = short + tokens(25, 8)[1:]
  store.put(short)
  forged = store.lookup(short).entries[1]
  forge(store, forged)
  Store(store.backing, eng).put(longer)  # grafts the forged prefix, builds on it
  problems = Store(store.backing, eng).audit(1.0)
  assert problems[0].key == forged['key'] and 'forged' in problems[0].reason
  descendants = [p for p in problems[1:] if 'built on a forged block' in p.reason]
  assert len(descendants) == len(blocks.chain_keys(store.namespace, longer, B)) - 2
  # An honest recomputation of the short text replaces the forgery and block 2, which the
  # longer put had recomputed on the forgery: two conflicts.
  assert Store(store.backing, eng).put(short, recompute=True)['conflicts'] == 2
  reader = Store(store.backing, eng)
  assert answer(reader, longer, query) == (fresh(eng, longer, query), len(short))
  assert any('another version of its parent' in p.reason for p in reader.problems)


def test_a_put_never_builds_on_the_rows_of_a_block_it_does_not_name(eng):
  """A text ending inside a block is stored as a partial block; a longer text's block there holds
  the same first rows. Were the put to graft those rows from the partial block, a forgery of it
  would pass into the longer block, whose recorded parent is the block before: still grafted
  after the forgery is replaced (the campaign's forgery_descendants found it, 13 of 260)."""
  store = Store('memory://', eng)
  short, query = tokens(20, 12), tokens(6, 13)[1:]  # blocks of 8, 8 and 4 tokens
  longer = short + tokens(13, 14)[1:]
  store.put(short)
  forge(store, store.lookup(short).entries[2])
  Store(store.backing, eng).put(longer)
  Store(store.backing, eng).put(short, recompute=True)  # replaces the forgery
  assert answer(Store(store.backing, eng), longer, query)[0] == fresh(eng, longer, query)
  assert Store(store.backing, eng).audit(1.0) == []


def test_readers_graft_only_what_a_trusted_key_signed(eng, tmp_path):
  alice = signing.generate(str(tmp_path / 'alice'))
  bob = signing.generate(str(tmp_path / 'bob'))
  backing = KvStore('memory://')
  library, query = tokens(30, 9), tokens(6, 10)[1:]
  Store(backing, eng, signing_key=alice).put(library)
  want = fresh(eng, library, query)
  trusting_alice = Store(backing, eng, trusted_keys=(alice.public,))
  assert answer(trusting_alice, library, query) == (want, len(library))
  trusting_bob = Store(backing, eng, trusted_keys=(bob.public,))
  assert answer(trusting_bob, library, query) == (want, 0)  # a miss, recomputed
  assert trusting_bob.problems and 'not signed by a trusted key' in trusting_bob.problems[0].reason
  # Bob, trusting only himself, cannot graft Alice's blocks: he recomputes them, finds the same
  # objects and vouches for them too (one object, two signatures): a reader trusting Bob alone
  # now grafts the library's whole blocks (its last 6 tokens are a partial block of Alice's
  # text only: Bob's longer text has a whole block there).
  whole = len(library) // B * B
  Store(backing, eng, signing_key=bob, trusted_keys=(bob.public,)).put(
      library + tokens(9, 11)[1:])
  assert answer(Store(backing, eng, trusted_keys=(bob.public,)), library, query) == (want, whole)
  # A signature over another header does not count: with Bob's first signature replaced by one
  # over another header, the reader grafts nothing.
  entry = trusting_alice.lookup(library).entries[0]
  assert Store(backing, eng, trusted_keys=(bob.public,)).lookup(library).tokens == whole
  backing.write(f'signatures/{entry["key"]}/{bob.public.id}', bob.sign('00' * 32))
  reader = Store(backing, eng, trusted_keys=(bob.public,))
  assert reader.lookup(library).tokens == 0


def test_a_forgery_signed_by_nobody_trusted_is_never_grafted(eng, tmp_path):
  alice = signing.generate(str(tmp_path / 'alice'))
  backing = KvStore('memory://')
  library, query = tokens(30, 12), tokens(6, 13)[1:]
  store = Store(backing, eng, signing_key=alice)
  store.put(library)
  forge(store, store.lookup(library).entries[1])  # the forger cannot sign as alice
  reader = Store(backing, eng, trusted_keys=(alice.public,))
  assert answer(reader, library, query) == (fresh(eng, library, query), B)
  # Alice, trusting only herself, misses the forgery, computes the block and finds the conflict.
  report = Store(backing, eng, signing_key=alice, trusted_keys=(alice.public,)).put(library)
  assert report['conflicts'] == 1
  reader = Store(backing, eng, trusted_keys=(alice.public,))  # a reader that cached nothing
  assert answer(reader, library, query) == (fresh(eng, library, query), len(library))


def test_keys_are_never_overwritten_and_bad_key_files_are_refused(tmp_path):
  signing.generate(str(tmp_path / 'k'))
  with pytest.raises(signing.SigningKeyError, match='already exists'):
    signing.generate(str(tmp_path / 'k'))
  assert oct(os.stat(tmp_path / 'k').st_mode & 0o777) == '0o600'
  (tmp_path / 'bad.pub').write_text('zz')
  with pytest.raises(signing.SigningKeyError, match='not a hex Ed25519 public key'):
    signing.load_public(str(tmp_path / 'bad.pub'))


def test_the_command_line_signs_audits_and_names_what_it_refuses(tmp_path):
  env = {**os.environ, 'PYTHONPATH': str(REPO)}
  common = ['--model=tiny_gemma3', '--weights=random:0', f'--rows_per_call={B}',
            '--cache_len=512']
  url = f'file://{tmp_path}/store/'

  def store(*args):
    return subprocess.run([sys.executable, '-m', 'experiments.store', *args, *common],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)

  assert store('keygen', f'--signing_key={tmp_path}/key').returncode == 0
  (tmp_path / 'in.jsonl').write_text(json.dumps({'tokens': tokens(30, 14)}) + '\n')
  assert store('put', f'--store={url}', f'--input={tmp_path}/in.jsonl',
               f'--signing_key={tmp_path}/key').returncode == 0
  audited = store('verify', f'--store={url}', '--recompute=1.0')
  assert audited.returncode == 0 and '0 problems' in audited.stdout
  missing = store('verify', f'--store=file://{tmp_path}/no-such-store/')
  last = missing.stderr.strip().splitlines()[-1]  # (after absl's log lines)
  assert missing.returncode == 2 and last.startswith('error: ') and 'no store at' in last
  assert 'Traceback' not in missing.stderr
  assert not (tmp_path / 'no-such-store').exists()  # a read-only command created nothing


# ----------------------------------------------------------------------------------------------
# Nothing sound is lost, with other processes at work


def test_an_entry_that_no_longer_decodes_is_rebuilt_from_its_sound_object(eng):
  store = Store('memory://', eng)
  library = tokens(30, 15)
  store.put(library)
  entry = store.lookup(library).entries[1]
  name = f'index/{entry["parent"]}/{entry["key"]}'
  store.backing.write(name, b'{"format": "not json')
  reader = Store(store.backing, eng)
  assert reader.lookup(library).tokens == len(library)  # rebuilt from the object, re-read
  assert json.loads(store.backing.read(name))['object'] == entry['object']
  assert any(n.endswith('.object') for n in store.backing.list('quarantine/'))  # kept aside


def test_a_stale_reader_never_deletes_an_entry_another_writer_republished(eng):
  store = Store('memory://', eng)
  library = tokens(30, 16)
  store.put(library)
  entry = store.lookup(library).entries[1]
  stale = Store(store.backing, eng)
  stale.lookup(library)  # caches every entry
  # Another process finds block 1's object damaged and replaces it with a sound copy.
  other = Store(store.backing, eng)
  store.backing.write(f'objects/{entry["object"]}', b'KVGRAFT1 damaged')
  other.put(library, recompute=True)
  republished = store.backing.read(f'index/{entry["parent"]}/{entry["key"]}')
  # The stale reader judges its cached entry bad (its object is gone) and would delete it.
  stale.quarantine_object(entry, 'the object is missing')
  assert store.backing.read(f'index/{entry["parent"]}/{entry["key"]}') == republished
  assert Store(store.backing, eng).audit(1.0) == []


def test_a_rebuild_beside_a_put_costs_the_put_nothing(eng):
  library = tokens(30, 17)

  def rebuild_now(step, names):  # another process rebuilds the index mid-put
    if step == 'verified':
      Store(store.backing, eng).rebuild_index()

  store = Store('memory://', eng, after_step=rebuild_now)
  report = store.put(library)
  assert report['blocks_written'] == len(blocks.chain_keys(store.namespace, library, B))
  reader = Store(store.backing, eng)
  assert reader.verify() == [] and reader.lookup(library).tokens == len(library)


def test_gc_beside_a_put_keeps_what_the_put_publishes(eng, monkeypatch):
  library = tokens(30, 18)
  seen = {}

  def step(step, names):
    if step == 'verified':  # gc lists the put's objects while they are unpublished...
      seen['problems'] = collector.verify()
    elif step == 'published':  # ...and deletes after the put has published them
      monkeypatch.setattr(collector, 'verify', lambda: seen['problems'])
      collector.gc()

  store = Store('memory://', eng, after_step=step)
  collector = Store(store.backing, eng)
  store.put(library)
  monkeypatch.undo()
  assert any('not published' in p.reason for p in seen['problems'])
  reader = Store(store.backing, eng)
  assert reader.verify() == [] and reader.lookup(library).tokens == len(library)


def test_gc_inside_a_put_keeps_what_the_put_has_leased_and_not_yet_published(eng):
  library = tokens(30, 20)
  seen = {}

  def step(step, names):
    if step == 'verified':  # gc runs whole between the put's object writes and its publishing
      seen['leases'] = store.backing.list('staging/')
      seen['removed'] = collector.gc()
      seen['kept'] = all(store.backing.read(name) is not None for name in names)

  store = Store('memory://', eng, after_step=step)
  collector = Store(store.backing, eng)
  store.put(library)
  assert len(seen['leases']) == 1 and seen['removed']['objects'] == 0 and seen['kept']
  assert store.backing.list('staging/') == []  # the put drops its lease once published
  reader = Store(store.backing, eng)
  assert reader.verify() == [] and reader.lookup(library).tokens == len(library)


def test_gc_removes_a_dead_writers_objects_once_its_lease_expires(eng):
  store = Store('memory://', eng)
  library = tokens(20, 21)
  store.put(library)
  leftover = f'objects/{"ab" * 32}.{"cd" * 16}'
  store.backing.write(leftover, b'written by a put that was killed')
  store.backing.write(f'staging/{"ef" * 16}.json', canonical_json(
      {'objects': [leftover], 'time': 1000.0}))  # long ago
  live = f'objects/{"12" * 32}.{"34" * 16}'
  store.backing.write(live, b'written by a put still running')
  store.backing.write(f'staging/{"56" * 16}.json', canonical_json(
      {'objects': [live], 'time': time.time()}))
  assert store.gc() == {'objects': 1, 'entries': 0}
  assert store.backing.read(leftover) is None and store.backing.read(live) is not None
  assert store.backing.list('staging/') == [f'staging/{"56" * 16}.json']
  assert store.gc(lease_seconds=0) == {'objects': 1, 'entries': 0}
  assert store.backing.list('staging/') == []
  assert Store(store.backing, eng).lookup(library).tokens == len(library)


def test_a_quarantine_deletes_only_the_bytes_it_judged_and_kept(eng):
  store = Store('memory://', eng)
  library = tokens(20, 22)
  store.put(library)
  entry = store.lookup(library).entries[0]
  name = f'objects/{entry["object"]}'
  sound = store.backing.read(name)
  # Judged on other bytes than the object now holds (rewritten since): kept, and so is its copy.
  store.quarantine(entry['key'], name, 'judged on other bytes', data=b'what was judged')
  assert store.backing.read(name) == sound
  # Judged on its own bytes: the copy under quarantine/ is exactly what is deleted.
  store.quarantine(entry['key'], name, 'judged on these bytes', data=sound)
  assert store.backing.read(name) is None
  assert sound in [store.backing.read(n) for n in store.backing.list('quarantine/')
                   if n.endswith('.object')]


def test_verify_and_gc_leave_stray_names_alone(eng, tmp_path):
  store = Store(f'file://{tmp_path}/s/', eng)
  library = tokens(20, 19)
  store.put(library)
  for stray in ('index/README', f'index/{"ab" * 32}/notes.txt', 'objects/..hidden', 'objects/x'):
    path = tmp_path / 's' / stray
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b'put there by hand')
  problems = store.verify()
  assert sorted(p.name for p in problems) == sorted(
      ['index/README', f'index/{"ab" * 32}/notes.txt', 'objects/..hidden', 'objects/x'])
  assert all(p.reason.startswith('stray') for p in problems)
  assert store.gc() == {'objects': 0, 'entries': 0}
  assert (tmp_path / 's' / 'objects' / 'x').exists()
  assert Store(store.backing, eng).lookup(library).tokens == len(library)


def test_manifest_fields_of_the_wrong_json_type_are_refused_in_one_line(eng, tmp_path):
  from graft.store import ArtifactError, StoreError, artifact
  library, _ = eng.prefill(tokens(12, 20), logits='none')
  artifact.save(str(tmp_path / 'a'), eng, library)
  manifest = json.loads((tmp_path / 'a' / 'manifest.json').read_text())
  for field, value in (('leaves', ['not', 'a', 'dict']), ('num_tokens', '12'),
                       ('next_position', None)):
    changed = {**manifest, field: value}
    changed['manifest_sha256'] = artifact.manifest_digest(changed)  # resealed
    (tmp_path / 'a' / 'manifest.json').write_text(json.dumps(changed))
    with pytest.raises(ArtifactError, match=field) as refused:
      artifact.load(str(tmp_path / 'a'), eng)
    assert '\n' not in str(refused.value)
  store = Store(f'file://{tmp_path}/s/', eng)
  description = json.loads(store.backing.read('store.json'))
  for field, value in (('model', ['x']), ('engine', 7), ('namespace', {})):
    store.backing.write('store.json', json.dumps({**description, field: value}).encode())
    with pytest.raises(StoreError, match=field) as refused:
      Store(store.backing, eng)
    assert '\n' not in str(refused.value)


def test_a_resealed_manifest_claiming_another_model_is_refused(eng, tmp_path):
  from graft.store import ArtifactError, artifact
  library, _ = eng.prefill(tokens(12, 21), logits='none')
  artifact.save(str(tmp_path / 'a'), eng, library)
  manifest = json.loads((tmp_path / 'a' / 'manifest.json').read_text())
  manifest['model'] = {**manifest['model'], 'params_sha256': '0' * 64}
  manifest['manifest_sha256'] = artifact.manifest_digest(manifest)
  (tmp_path / 'a' / 'manifest.json').write_text(json.dumps(manifest))
  with pytest.raises(ArtifactError, match='does not hash to the fields recorded beside it'):
    artifact.load(str(tmp_path / 'a'), eng)
