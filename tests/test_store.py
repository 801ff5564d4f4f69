"""The knowledge store (graft/store/_store.py): content addressing, byte-exact grafts from it, and no
bad object ever grafted. Tiny models with random weights; exactness is SHA-256 equality.
"""

import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest

from gemma_jax import weights
from gemma_jax.compare import sha256_bytes
from graft.store import blocks
from graft.engine import Engine, EngineConfig
from graft.store.kvstore import StoreUrlError
from graft.store import Store, StoreError
from graft.store.publish import PAUSED

REPO = pathlib.Path(__file__).resolve().parents[1]
B = 8
CONFIG = EngineConfig(rows_per_call=B, cache_len=512)
# 8-slot attention tiles: the local ring is W + B - 1 = 15 slots rounded up to 16 (the default
# 256-slot tiles would hold these whole contexts in the ring).
SMALL_RING = EngineConfig(rows_per_call=B, cache_len=512, attention_tile=8)
TINY_FLAGS = ['--model=tiny_gemma3', '--weights=random:0', f'--rows_per_call={B}',
              '--cache_len=512']


def engine(name='tiny_gemma3', dtype='float32', config=CONFIG, seed=0):
  return _engine(name, dtype, config, seed)


_ENGINES = {}


def _engine(name, dtype, config, seed):
  key = (name, dtype, config, seed)
  if key not in _ENGINES:
    _ENGINES[key] = Engine(weights.load(name, f'random:{seed}', dtype), config)
  return _ENGINES[key]


def tokens(n, seed, vocab=512):
  return [2] + [int(t) for t in np.random.default_rng(seed).integers(3, vocab, n - 1)]


def fresh_logits(eng, context, query):
  return eng.extend(eng.empty(), list(context) + list(query), logits=len(query))[1]


def grafted_logits(store, context, query):
  ctx, match = store.graft(context)
  _, logits = store.engine.extend(ctx, list(context[match.tokens:]) + list(query),
                                  logits=len(query))
  return logits, match


def object_names(store):
  return store.backing.list('objects/')


# ----------------------------------------------------------------------------------------------
# Content addressing


def test_block_keys_are_a_sha256_chain_over_a_canonical_encoding():
  ns = '11' * 32
  first = blocks.block_key(ns, blocks.ROOT, [2, 5, 7])
  assert first == blocks.block_key(ns, blocks.ROOT, np.array([2, 5, 7], np.int64))  # any int type
  assert first != blocks.block_key(ns, blocks.ROOT, [2, 5, 8])
  assert first != blocks.block_key('22' * 32, blocks.ROOT, [2, 5, 7])  # another namespace
  second = blocks.block_key(ns, first, [9])
  assert second != blocks.block_key(ns, blocks.ROOT, [9])  # the parent is part of the key
  assert blocks.chain_keys(ns, [2, 5, 7, 9], 3) == [first, second]
  # A prefix-free encoding: a count separates [1] + [2, 3] from [1, 2] + [3].
  assert blocks.block_key(ns, blocks.ROOT, [1, 2]) != blocks.block_key(ns, blocks.ROOT, [1, 2, 0])


PINNED = EngineConfig(mode='pinned', rows_per_call=B, cache_len=512)


def test_namespace_binds_model_dtype_and_engine_not_the_cache_length():
  base = engine()
  others = [engine(seed=1), engine(config=EngineConfig(rows_per_call=16, cache_len=512)),
            engine(config=PINNED), engine(dtype='bfloat16', config=PINNED)]
  spaces = {blocks.namespace(e.model_fingerprint, e.fingerprint) for e in [base] + others}
  assert len(spaces) == 5
  # The spec engine's cache length decides no bit (tests/test_spec.py), so it is not bound.
  shorter = engine(config=EngineConfig(rows_per_call=B, cache_len=256))
  assert (blocks.namespace(shorter.model_fingerprint, shorter.fingerprint)
          == blocks.namespace(base.model_fingerprint, base.fingerprint))
  salted = blocks.namespace(base.model_fingerprint, base.fingerprint, 'tenant-a')
  assert salted not in spaces and salted != blocks.namespace(
      base.model_fingerprint, base.fingerprint, 'tenant-b')


@pytest.mark.parametrize('name', ['tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4'])
def test_a_rows_bits_do_not_depend_on_the_rows_after_it(name):
  # Why a query that diverges inside a block can reuse the block's first rows: under the pinned
  # engine the KV of rows 0..r-1 of a block, and their logits, are the same whatever tokens
  # fill the rest of the block (or whether it is filled at all).
  eng = engine(name)
  vocab = eng.model_config.vocab_size
  prefix = tokens(3 * B + 3, 1, vocab)  # ends 3 rows into block 3
  rest_a = tokens(B, 2, vocab)[1:]
  rest_b = tokens(B, 3, vocab)[1:]
  from gemma_jax import kv_state as kvs
  rows = []
  for context in (prefix, prefix + rest_a, prefix + rest_b):
    ctx, logits = eng.extend(eng.empty(), context, logits='all')
    block = kvs.take_rows(ctx.kv, 3 * B, 3 * B + 3)
    rows.append((b''.join(k.tobytes() + v.tobytes() for k, v in zip(block.k, block.v)),
                 sha256_bytes(logits[:len(prefix)])))
  assert rows[0] == rows[1] == rows[2]


# ----------------------------------------------------------------------------------------------
# Grafts from the store are byte-exact


@pytest.mark.parametrize('url_kind', ['memory', 'file'])
@pytest.mark.parametrize('name', ['tiny_gemma3', 'tiny_gemma4'])
def test_graft_from_the_store_equals_fresh(tmp_path, url_kind, name):
  eng = engine(name)
  url = 'memory://' if url_kind == 'memory' else f'file://{tmp_path}/store/'
  store = Store(url, eng)
  vocab = eng.model_config.vocab_size
  library = tokens(5 * B + 3, 4, vocab)  # a partial last block, crossing the window 5 times
  query = tokens(6, 5, vocab)[1:]
  report = store.put(library)
  assert report['blocks_written'] == 6 and report['reused_tokens'] == 0
  logits, match = grafted_logits(store, library, query)
  assert match.tokens == len(library) and match.rows == 3
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, library, query))
  again = store.put(library)
  assert again['blocks_written'] == 0 and again['reused_tokens'] == len(library)


def test_blocks_of_the_sha256_format_still_read_and_new_blocks_build_on_them(monkeypatch):
  # A store written before BLAKE3 (kv-graft-block/2: SHA-256 leaf hashes, the same keys) grafts
  # exactly, verifies clean, and a recompute finds its blocks equal to this engine's.
  eng = engine()
  store = Store('memory://', eng)
  library, longer, query = tokens(3 * B, 21), tokens(5 * B + 2, 21), tokens(5, 22)[1:]
  with monkeypatch.context() as old_writer:
    old_writer.setattr(blocks, 'BLOCK_FORMAT', 'kv-graft-block/2')
    store.put(library)
  old = {name: store.backing.read(name) for name in object_names(store)}
  assert all(b'"sha256":' in data and b'"blake3":' not in data for data in old.values())
  logits, match = grafted_logits(store, library, query)
  assert match.tokens == len(library)
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, library, query))
  report = store.put(longer)  # BLAKE3 blocks whose parents are SHA-256 ones
  assert report['reused_tokens'] == len(library) and report['blocks_written'] == 3
  logits, match = grafted_logits(store, longer, query)
  assert match.tokens == len(longer)
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, longer, query))
  assert store.verify() == []
  assert store.put(library, recompute=True)['conflicts'] == 0
  assert {name: store.backing.read(name) for name in old} == old  # kept, not replaced


def test_contexts_that_share_a_prefix_share_its_blocks_and_a_divergence_mid_block_reuses_rows():
  eng = engine()
  store = Store('memory://', eng)
  shared = tokens(3 * B + 5, 6)
  first = shared + tokens(2 * B, 7)[1:]
  second = shared + tokens(B + 4, 8)[1:]
  store.put(first)
  report = store.put(second)
  # The 3 shared full blocks are reused; a put recomputes the 5 shared rows of block 3 (its block
  # 3 names block 2 as its parent, not first's block 3: tests/test_store_trust.py).
  assert report['reused_tokens'] == 3 * B
  assert report['blocks_written'] == len(blocks.chain_keys(store.namespace, second, B)) - 3
  third = shared + tokens(10, 9)[1:]  # never deposited: a reader uses the 5 rows of a block 3
  logits, match = grafted_logits(store, third, tokens(4, 10)[1:])
  assert match.tokens == len(shared) and match.rows == 5
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, third, tokens(4, 10)[1:]))


def test_a_query_shorter_than_a_stored_block_uses_its_first_rows():
  eng = engine()
  store = Store('memory://', eng)
  library = tokens(4 * B, 11)
  store.put(library)
  short = library[:2 * B + 3]
  match = store.lookup(short)
  assert match.tokens == len(short) and match.rows == 3
  assert store.put(short)['blocks_written'] == 0  # already addressable
  logits, _ = grafted_logits(store, short, [7, 8])
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, short, [7, 8]))


def test_a_graft_reads_only_global_rows_of_blocks_behind_the_ring(tmp_path):
  eng = engine(config=SMALL_RING)
  store = Store('memory://', eng)
  library = tokens(40 * B, 12)  # far past the local ring (16 slots)
  store.put(library)
  reads = []
  original = store.backing.read_many
  store.backing.read_many = lambda requests: reads.extend(requests) or original(requests)
  store.host = type(store.host)(0)  # no host tier: every block from the backing store
  logits, match = grafted_logits(store, library, [5])
  object_reads = [r for r in reads if r[0].startswith('objects/')]
  ranged = [r for r in object_reads if r[1] is not None]
  assert len(object_reads) == 40 and len(ranged) >= 37  # all but the blocks in the ring
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, library, [5]))


def test_the_device_cache_is_the_engines_and_the_host_tier_is_bounded():
  eng = engine()
  store = Store('memory://', eng, host_cache_bytes=10_000)
  library = tokens(20 * B, 13)
  store.put(library)
  ctx, _ = store.graft(library)
  empty = eng.empty()
  for ours, fixed in zip(ctx.kv.layers, empty.kv.layers):
    assert ours.k.shape == fixed.k.shape
  assert store.host.bytes <= 10_000
  store.graft(library)
  assert store.counters['backing_reads'] > 0


# ----------------------------------------------------------------------------------------------
# Bad input and faults: never grafted, reported, quarantined, still correct


def test_unknown_and_unreachable_urls_are_refused():
  eng = engine()
  with pytest.raises(StoreUrlError, match='expected a kvstore URL'):
    Store('/no/scheme', eng)
  with pytest.raises(StoreUrlError, match='unsupported URL scheme'):
    Store('nonsense://x/', eng)
  with pytest.raises(StoreUrlError, match='do not support authority'):
    Store('file://relative/path/', eng)
  with pytest.raises(StoreUrlError, match='is not JSON'):
    Store('{"driver": "s3", ', eng)
  with pytest.raises(StoreUrlError, match='cannot open store'):
    Store('{"driver": "nonsense"}', eng)


def test_a_store_of_another_model_engine_or_dtype_is_refused_with_the_reason(tmp_path):
  url = f'file://{tmp_path}/s/'
  Store(url, engine()).put(tokens(20, 14))
  with pytest.raises(StoreError, match='another model or engine.*params_sha256'):
    Store(url, engine(seed=1))
  with pytest.raises(StoreError, match="dtype: the store has 'float32', expected 'bfloat16'"):
    Store(url, engine(dtype='bfloat16', config=PINNED))
  with pytest.raises(StoreError, match='rows_per_call: the store has 8, expected 16'):
    Store(url, engine(config=EngineConfig(rows_per_call=16, cache_len=512)))
  with pytest.raises(StoreError, match='byte-exact engine only'):
    Store(url, engine(config=EngineConfig(mode='default', cache_len=512)))


def _corrupt(store, name, how):
  data = store.backing.read(name)
  if how in ('flip', 'flip_local'):
    offset, length = blocks.header_span(data)
    data = bytearray(data)
    # Global layers' rows come first: 'flip' hits rows every graft reads, 'flip_local' the
    # last local layer's, which a graft far past the block does not read.
    data[offset + length + 10 if how == 'flip' else len(data) - 10] ^= 0x04
    store.backing.write(name, bytes(data))
  elif how == 'truncate':
    store.backing.write(name, data[:len(data) - 100])
  elif how == 'delete':
    store.backing.delete(name)
  elif how == 'header':
    data = bytearray(data)
    data[20] ^= 0x01  # inside the JSON header
    store.backing.write(name, bytes(data))


@pytest.mark.parametrize('how', ['flip', 'truncate', 'delete', 'header'])
def test_a_bad_object_is_never_grafted_and_the_answer_is_still_exact(how):
  eng = engine()
  store = Store('memory://', eng)
  library = tokens(6 * B, 15)
  query = tokens(5, 16)[1:]
  store.put(library)
  victim = store.lookup(library).entries[3]  # block 3 of 6
  _corrupt(store, f'objects/{victim["object"]}', how)
  reader = Store(store.backing, eng)  # a reader that has cached nothing
  logits, match = grafted_logits(reader, library, query)
  assert match.tokens == 3 * B  # the prefix ends before the bad block
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, library, query))
  (problem,) = reader.problems
  assert problem.key == victim['key'] and problem.reason
  assert reader.backing.list('quarantine/')  # moved aside with its reason
  assert reader.lookup(library).tokens == 3 * B  # a miss from now on, until it is rewritten
  assert reader.put(library)['blocks_written'] == 1  # the same block, rewritten
  assert reader.lookup(library).tokens == len(library)


def test_an_object_copied_under_another_key_or_from_another_store_is_refused():
  eng = engine()
  store = Store('memory://', eng)
  a, b = tokens(2 * B, 17), tokens(2 * B, 18)
  store.put(a)
  store.put(b)
  entry_a = store.lookup(a).entries[1]
  entry_b = store.lookup(b).entries[1]
  store.backing.write(f'objects/{entry_a["object"]}', store.backing.read(f'objects/{entry_b["object"]}'))
  reader = Store(store.backing, eng)
  logits, match = grafted_logits(reader, a, [9])
  assert match.tokens == B and 'header' in reader.problems[0].reason
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, a, [9]))


def test_bytes_a_graft_does_not_read_cannot_harm_it_and_verify_still_finds_them():
  eng = engine(config=SMALL_RING)
  store = Store('memory://', eng)
  library = tokens(6 * B, 15)
  store.put(library)
  victim = store.lookup(library).entries[1]  # far behind the ring of the graft point
  _corrupt(store, f'objects/{victim["object"]}', 'flip_local')
  reader = Store(store.backing, eng)
  logits, match = grafted_logits(reader, library, [6])
  assert match.tokens == len(library) and not reader.problems  # every byte it used verified
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, library, [6]))
  (problem,) = reader.verify()
  assert problem.key == victim['key'] and 'altered' in problem.reason
  assert reader.lookup(library[:2 * B]).tokens == 2 * B
  reader.graft(library[:2 * B])  # now block 1 is in the ring: its local rows are read, refused
  assert reader.problems and reader.problems[0].key == victim['key']


def test_verify_names_every_bad_object_and_gc_loses_nothing_sound(tmp_path):
  url = f'file://{tmp_path}/s/'
  eng = engine()
  store = Store(url, eng)
  library = tokens(4 * B, 19)
  store.put(library)
  assert store.verify() == []
  victim = store.lookup(library).entries[1]
  _corrupt(store, f'objects/{victim["object"]}', 'flip')
  store.backing.write(f'objects/{"ab" * 32}.{"cd" * 16}', b'an unpublished leftover')
  out = subprocess.run([sys.executable, '-m', 'experiments.store', 'verify', f'--store={url}',
                        *TINY_FLAGS], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, 'PYTHONPATH': str(REPO)}, timeout=600)
  assert out.returncode == 1
  assert f'index/{victim["parent"]}/{victim["key"]}' in out.stdout and 'altered' in out.stdout
  assert 'not published' in out.stdout
  removed = store.gc()
  assert removed['objects'] >= 1 and removed['entries'] >= 1
  # Blocks 2 and 3 wait for their parent (sound, unreachable, kept): nothing sound is lost.
  assert {p.reason.split(':')[0] for p in store.verify()} == {'unreachable'}
  assert store.lookup(library).tokens == B
  assert store.put(library)['blocks_written'] == 1  # block 1 again; 2 and 3 reachable again
  assert store.verify() == [] and store.lookup(library).tokens == len(library)


def test_the_index_can_be_rebuilt_from_the_objects_alone():
  eng = engine()
  store = Store('memory://', eng)
  library = tokens(5 * B + 2, 20)
  store.put(library)
  for name in store.backing.list('index/'):
    store.backing.delete(name)
  fresh_reader = Store(store.backing, eng)
  assert fresh_reader.lookup(library).tokens == 0
  assert fresh_reader.rebuild_index() == 6
  logits, match = grafted_logits(fresh_reader, library, [4, 5])
  assert match.tokens == len(library)
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, library, [4, 5]))


def test_hostile_entries_are_refused_not_followed():
  eng = engine()
  store = Store('memory://', eng)
  library = tokens(2 * B, 21)
  store.put(library)
  entry = store.lookup(library).entries[0]
  name = f'index/{entry["parent"]}/{entry["key"]}'
  original = store.backing.read(name)
  for hostile in ({**entry, 'object': '../../etc/passwd'}, {**entry, 'tokens': 'abc'},
                  {**entry, 'object_bytes': 1 << 60}, [1, 2, 3], {**entry, 'start': -8}):
    store.backing.write(name, json.dumps(hostile).encode())
    reader = Store(store.backing, eng)
    match = reader.lookup(library)
    assert reader.problems and reader.problems[0].name == name  # refused, named
    # Never followed: the entry is rebuilt from the block's sound object, and matches again.
    assert store.backing.read(name) == original and match.tokens == len(library)


# ----------------------------------------------------------------------------------------------
# Several processes


def _put_process(url, path, pause=None, resume=None):
  """`experiments.store put` in another process; pause: its --pause_at ('STEP:N'); resume: its
  --resume_file (a file whose creation lets it go on)."""
  return subprocess.Popen([sys.executable, '-m', 'experiments.store', 'put', f'--store={url}',
                           f'--input={path}', *TINY_FLAGS,
                           *([f'--pause_at={pause}'] if pause else []),
                           *([f'--resume_file={resume}'] if resume else [])], cwd=REPO,
                          env={**os.environ, 'PYTHONPATH': str(REPO)},
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for_pause(proc) -> list[str]:
  """The object names a writer paused with, after reading its stderr up to PAUSED."""
  for line in proc.stderr:
    if line.startswith(PAUSED):
      return json.loads(line.split(' ', 6)[-1])
  raise AssertionError(f'the writer ended (status {proc.wait()}) before it paused')


def put_from_two_processes(url, tmp_path) -> list[list[int]]:
  """Two writer processes put the same three texts, made to overlap: each pauses once its first
  objects are written (before it publishes any), and both go on only when both have (each
  wrote, so the second to publish meets the first's copies). Returns the texts."""
  contexts = [tokens(6 * B + i, 30 + i) for i in range(3)]
  path = tmp_path / 'in.jsonl'
  path.write_text(''.join(json.dumps({'tokens': c}) + '\n' for c in contexts))
  resume = tmp_path / 'resume'
  procs = [_put_process(url, path, 'written:1', resume) for _ in range(2)]
  written = [_wait_for_pause(proc) for proc in procs]
  assert all(written), written  # both wrote objects before either published
  resume.touch()
  for proc in procs:
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-2000:]
  return contexts


@pytest.mark.slow
def test_two_processes_putting_the_same_texts_leave_one_copy(tmp_path):
  url = f'file://{tmp_path}/s/'
  contexts = put_from_two_processes(url, tmp_path)
  store = Store(url, engine())
  assert store.verify() == []  # no second copy left unpublished, nothing bad
  expected = {k for c in contexts for k in blocks.chain_keys(store.namespace, c, B)}
  assert {e['key'] for e in store.entries()} == expected
  assert len(object_names(store)) == len(expected)


@pytest.mark.slow
@pytest.mark.parametrize('step', ['written', 'verified', 'published'])
def test_a_writer_killed_inside_a_put_leaves_no_half_object_and_loses_nothing(tmp_path, step):
  """The writer reports that it is inside a put (after the second batch's objects were written,
  read back, or published) and is killed there: the kill must land (SIGKILL, the batch's
  objects left behind), and nothing stored before is lost or wrong."""
  url = f'file://{tmp_path}/s/'
  eng = engine()
  store = Store(url, eng)
  earlier = tokens(3 * B, 40)
  store.put(earlier)
  before = {name: store.backing.read(name) for name in store.backing.list('')}
  killed = [tokens(12 * B, 41 + i) for i in range(3)]  # one write batch each
  path = tmp_path / 'in.jsonl'
  path.write_text(''.join(json.dumps({'tokens': c}) + '\n' for c in killed))
  proc = _put_process(url, path, pause=f'{step}:2')
  names = None
  for line in proc.stderr:
    if line.startswith(PAUSED):
      reached, listed = line[len(PAUSED):].split(maxsplit=1)
      assert reached == step
      names = json.loads(listed)
      break
  assert names, 'the writer never reported the step (it ended or crashed before it)'
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  assert proc.returncode == -signal.SIGKILL
  assert set(names) <= set(store.backing.list(''))  # the batch's objects: killed inside the put
  keys = {name.split('/')[1].split('.')[0] for name in names}
  published = {e['key'] for e in Store(url, eng).entries()} & keys
  assert published == (keys if step == 'published' else set())
  for name, data in before.items():  # every earlier object and entry is intact
    assert store.backing.read(name) == data
  reader = Store(url, eng)
  problems = reader.verify()
  # Objects written but not published (killed before publication); the kill may also leave
  # sound entries whose parent's entry was not written yet (kept by gc: the next put of the
  # text makes them reachable).
  allowed = ('not published', 'unreachable')
  assert all(p.reason.startswith(allowed) for p in problems), problems
  assert (step != 'published') == any(p.reason.startswith('not published') for p in problems)
  # A second process reads and writes the same store: the earlier text and the killed one
  # graft exactly.
  logits, match = grafted_logits(reader, earlier, [3, 4])
  assert match.tokens == len(earlier)
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, earlier, [3, 4]))
  reader.put(killed[1])
  logits, match = grafted_logits(Store(url, eng), killed[1], [5])
  assert match.tokens == len(killed[1])
  assert sha256_bytes(logits) == sha256_bytes(fresh_logits(eng, killed[1], [5]))
  # The killed writer's lease keeps its objects from gc until it expires.
  leftovers = {p.name for p in reader.verify() if p.reason.startswith('not published')}
  reader.gc()
  assert leftovers <= set(store.backing.list('objects/'))
  assert store.backing.list('staging/') != []
  reader.gc(lease_seconds=0)
  assert store.backing.list('staging/') == []
  assert all(p.reason.startswith('unreachable') for p in reader.verify())
