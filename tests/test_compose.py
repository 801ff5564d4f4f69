"""Documents computed once after a prefix and composed anywhere (graft/store/documents.py,
graft/store/compose.py).

Relocation: under the relative RoPE mode a document's stored rows, placed at offset Δ in any
order among other documents, are SHA-256 equal to the prefix and the document computed from
position Δ, on every family and both dtypes, for offsets from 0 to past the local window (8 on
the tiny models) and to the model's context. Every recompute strategy at fraction 1.0 gives the
fresh computation's logits bit for bit; below it, the composition is not the fresh one. Bad
inputs are one-line errors that write nothing; the store's guarantees (verification on read,
quarantine, audit, trust) hold for document blocks.
"""

import functools

import numpy as np
import pytest

from gemma_jax import kv_state as kvs
from gemma_jax import weights
from gemma_jax.compare import sha256_bytes
from gemma_jax.config import get_config
from graft.engine import Engine, EngineConfig
from graft.store import (ComposeError, Document, DocumentError, Kind, Recompute, Store, blocks,
                         compose as composing)
from graft.store.kvstore import KvStore

FAMILIES = ('tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4')
CACHE = 512  # tiny_gemma2's whole context


@functools.lru_cache(maxsize=None)
def engine(name: str = 'tiny_gemma3', dtype: str = 'float32', rope: str = 'relative') -> Engine:
  loaded = weights.load(get_config(name).replace(rope_mode=rope), 'random:0', dtype)
  mode = 'spec' if dtype == 'float32' else 'pinned'  # the spec's arithmetic is float32
  return Engine(loaded, EngineConfig(mode=mode, rows_per_call=16, attention_tile=16,
                                     cache_len=CACHE))


def draw(n: int, seed: int) -> list[int]:
  return [int(t) for t in np.random.default_rng(seed).integers(3, 512, n)]


PREFIX = [2] + draw(12, 1)  # ends inside the first 16-row block
DOCUMENTS = [draw(n, 10 + n) for n in (21, 9, 40, 3)]
QUERY = draw(6, 99)


def stored(eng: Engine) -> Store:
  store = Store(KvStore('memory://'), eng)
  for doc in DOCUMENTS:
    store.put_document(PREFIX, doc)
  return store


def document_entries(store: Store, document) -> list[dict]:
  """The published entries of a document's chain after PREFIX, in order."""
  by_key = {e['key']: e for e in store.entries()}
  return [by_key[k] for k in blocks.document_keys(store.namespace, PREFIX, document, 16)]


def shifted(eng: Engine, store: Store, document, delta: int) -> kvs.KVRows:
  """The prefix and the document computed from position Δ: the document's rows."""
  prefix_ctx, _ = eng.prefill(PREFIX, logits='none', start_position=delta)
  return composing.compute_rows(eng, prefix_ctx, document)


def same(a: kvs.KVRows, b: kvs.KVRows) -> bool:
  return all(sha256_bytes(x) == sha256_bytes(y) for x, y in zip(a.k + a.v, b.k + b.v))


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
@pytest.mark.parametrize('name', FAMILIES)
def test_relocated_rows_are_sha256_equal_to_the_document_computed_shifted(name, dtype):
  eng = engine(name, dtype)
  store = stored(eng)
  p = len(PREFIX)
  # Composed in two orders: each document's rows in the composed context (the global layers
  # hold every row; a ring holds the last S) are the document computed from its offset.
  for order in ([0, 1, 2, 3], [3, 2, 0, 1]):
    docs = [DOCUMENTS[i] for i in order]
    ctx = store.compose(PREFIX, docs).context
    offset = p
    for doc in docs:
      want = shifted(eng, store, doc, offset - p)
      for layer, k_want, v_want in zip(ctx.kv.layers, want.k, want.v):
        positions = np.asarray(layer.positions[0])
        slots = [np.flatnonzero(positions == offset + i) for i in range(len(doc))]
        held = [i for i, s in enumerate(slots) if len(s)]
        assert layer.num_slots < CACHE or len(held) == len(doc)
        index = [slots[i][0] for i in held]
        assert sha256_bytes(np.asarray(layer.k[0])[index]) == sha256_bytes(k_want[held])
        assert sha256_bytes(np.asarray(layer.v[0])[index]) == sha256_bytes(v_want[held])
      offset += len(doc)
  # Offsets from 0 past the local window (8) and its ring (32) to the model's context.
  doc = DOCUMENTS[2]
  rows = store.read_document(PREFIX, doc)
  last = eng.model_config.max_context - p - len(doc)
  for delta in (0, 1, 7, 8, 9, 33, 300, last):
    assert same(composing.placed(eng, rows, p + delta, rerotate=False),
                shifted(eng, store, doc, delta)), delta


@pytest.mark.parametrize('strategy', composing.STRATEGIES[1:])
def test_every_strategy_at_fraction_one_is_the_fresh_computation(strategy):
  eng = engine()
  store = stored(eng)
  for docs in (DOCUMENTS, DOCUMENTS[::-1]):
    _, fresh = eng.extend(eng.empty(), PREFIX + sum(docs, []) + QUERY, logits=len(QUERY))
    full = store.compose(PREFIX, docs, QUERY, recompute=Recompute(strategy, 1.0))
    assert full.record['recompute']['tokens'] == sum(len(d) for d in docs)
    assert sha256_bytes(full.logits) == sha256_bytes(fresh)
    part = store.compose(PREFIX, docs, QUERY, recompute=Recompute(strategy, 0.3))
    assert sha256_bytes(part.logits) != sha256_bytes(fresh)  # cross-document attention missing


def test_a_float_engine_composes_only_with_re_rotation_asked_and_then_not_exactly():
  eng = engine(rope='float')
  store = stored(eng)
  with pytest.raises(ComposeError, match='float-RoPE engine caches keys rotated'):
    store.compose(PREFIX, DOCUMENTS, QUERY)
  turned = store.compose(PREFIX, DOCUMENTS, recompute=Recompute('window', 0.3), rerotate=True)
  assert turned.record['rerotate'] and turned.record['rope'] == 'float'
  doc, p = DOCUMENTS[2], len(PREFIX)
  rows = store.read_document(PREFIX, doc)
  moved = composing.placed(eng, rows, p + 30, rerotate=True)
  want = shifted(eng, store, doc, 30)
  assert sha256_bytes(moved.v[0]) == sha256_bytes(want.v[0])  # layer 0's V sees no position
  assert not same(moved, want)  # R(Δ) R(p) k is not R(p + Δ) k, and later layers differ
  assert max(np.abs(a - b).max() for a, b in zip(moved.k, want.k)) < 1.0
  _, fresh = eng.extend(eng.empty(), PREFIX + sum(DOCUMENTS, []) + QUERY, logits=len(QUERY))
  full = store.compose(PREFIX, DOCUMENTS, QUERY, recompute=Recompute('epic', 1.0), rerotate=True)
  assert sha256_bytes(full.logits) == sha256_bytes(fresh)  # nothing placed: nothing turned


def test_each_strategy_selects_its_tokens():
  eng = engine()
  store = stored(eng)
  lengths = [len(d) for d in DOCUMENTS]
  total = sum(lengths)
  rows = composing.concatenate([
      composing.placed(eng, store.read_document(PREFIX, d), int(o), False)
      for d, o in zip(DOCUMENTS, np.cumsum([len(PREFIX)] + lengths[:-1]))])
  tokens = PREFIX + sum(DOCUMENTS, [])
  select = lambda strategy, f: composing.select(eng, Recompute(strategy, f), tokens, rows,
                                                lengths)
  assert not select('none', 0.0).any()
  epic = select('epic', 0.25)
  assert [int(m.sum()) for m in np.split(epic, np.cumsum(lengths)[:-1])] == [5, 2, 10, 1]
  assert all(m[:k].all() for m, k in zip(np.split(epic, np.cumsum(lengths)[:-1]), [5, 2, 10, 1]))
  window = select('window', 0.25)
  assert window[-18:].all() and not window[:-18].any()
  # CacheBlend: the first document follows the prefix as it was computed, so its K and V at
  # layer 1 deviate by nothing; the largest deviations elsewhere are chosen.
  scores = composing.deviation(eng, tokens, rows, 1)
  assert not scores[:lengths[0]].any() and scores[lengths[0]:].max() > 0
  blend = select('cacheblend', 0.25)
  assert blend.sum() == 18 and not blend[:lengths[0]].any()
  assert scores[blend].min() >= scores[~blend].max()


@pytest.mark.parametrize('name', FAMILIES)
def test_the_first_layers_of_a_model_compute_what_the_whole_model_does(name):
  eng = engine(name)
  early = composing.first_layers_engine(eng, 2)
  seq = draw(50, 5)
  whole, _ = eng.prefill(seq, logits='none')
  cut, _ = early.prefill(seq, logits='none')
  for j in range(len(early.model_config.cache_layers)):
    for part in ('k', 'v'):
      a, b = getattr(whole.kv.layers[j], part), getattr(cut.kv.layers[j], part)
      assert sha256_bytes(np.asarray(a)) == sha256_bytes(np.asarray(b)), (j, part)


def test_bad_inputs_are_one_line_errors_and_write_nothing():
  eng = engine()
  kv = KvStore('memory://')
  store = Store(kv, eng)
  before = {k: kv.read(k) for k in kv.list('')}
  cases = [
      (lambda: store.put_document(PREFIX, []), 'the document is empty'),
      (lambda: store.put_document([], DOCUMENTS[0]), 'the prefix is empty'),
      (lambda: store.put_document(PREFIX, draw(CACHE, 3)), 'does not fit the cache of 512'),
      (lambda: store.put_document(PREFIX, [1, 2, 10**6]), 'outside the vocabulary'),
      (lambda: store.compose(PREFIX, [DOCUMENTS[0], []]), 'document 1 is empty'),
      (lambda: store.compose(PREFIX, [draw(300, 4), draw(300, 5)]), 'do not fit the cache'),
      (lambda: store.compose(PREFIX, DOCUMENTS, rerotate=True), 're-rotation is for float'),
      (lambda: store.compose(PREFIX, DOCUMENTS, recompute=Recompute('none', 0.5)), None),
  ]
  for call, message in cases:
    with pytest.raises((DocumentError, ComposeError), match=message) as raised:
      call()
    assert '\n' not in str(raised.value)
    assert {k: kv.read(k) for k in kv.list('')} == before
  handle = store.put_document(PREFIX, DOCUMENTS[0])['document']
  assert isinstance(handle, Document) and handle.prefix_tokens == len(PREFIX)
  before = {k: kv.read(k) for k in kv.list('')}
  with pytest.raises(DocumentError, match='document 0 was stored after another prefix'):
    store.compose(PREFIX + [5], [handle], QUERY)
  assert {k: kv.read(k) for k in kv.list('')} == before
  with pytest.raises(ComposeError, match="RoPE 'relative'"):
    Store(KvStore('memory://'), engine(rope='float')).compose(PREFIX, DOCUMENTS)


def test_document_keys_depend_on_prefix_and_tokens_not_on_placement():
  eng = engine()
  store = stored(eng)
  keys_of = lambda prefix, doc: blocks.document_keys(store.namespace, prefix, doc, 16)
  keys = keys_of(PREFIX, DOCUMENTS[0])
  assert keys == keys_of(list(PREFIX), tuple(DOCUMENTS[0]))
  assert keys != keys_of(PREFIX + [7], DOCUMENTS[0])
  chain = {e['key'] for e in store.entries()}
  assert set(keys) <= chain  # published, reachable through the prefix's document root
  for order in (DOCUMENTS, DOCUMENTS[::-1]):
    record = store.compose(PREFIX, order).record
    assert all(d['source'] == 'store' for d in record['documents'])
    assert {d['key'] for d in record['documents']} == {
        keys_of(PREFIX, d)[-1] for d in DOCUMENTS}
  assert store.verify() == [] and store.audit() == []


def test_a_damaged_document_block_is_quarantined_and_the_composition_stays_exact():
  eng = engine()
  store = stored(eng)
  clean = store.compose(PREFIX, DOCUMENTS, QUERY, recompute=Recompute('window', 0.2))
  victim = document_entries(store, DOCUMENTS[2])[1]
  name = f'objects/{victim["object"]}'
  data = bytearray(store.backing.read(name))
  data[-3] ^= 4  # a bit of the last leaf
  store.backing.write(name, bytes(data))
  reader = Store(store.backing, eng)
  again = reader.compose(PREFIX, DOCUMENTS, QUERY, recompute=Recompute('window', 0.2))
  assert sha256_bytes(again.logits) == sha256_bytes(clean.logits)
  assert [d['source'] for d in again.record['documents']] == ['store', 'store', 'computed', 'store']
  assert [p.kind for p in reader.problems] == [Kind.BAD_OBJECT]
  # A forgery (self-consistent) of a document block: audit finds it, and only it.
  from experiments.fault_campaign import damage
  store.put_document(PREFIX, DOCUMENTS[2])  # the honest writer repairs the block
  forged = document_entries(store, DOCUMENTS[0])[0]
  damage.forge(store, forged)
  found = Store(store.backing, eng).audit()
  assert [(p.kind, p.key) for p in found][:1] == [(Kind.FORGED, forged['key'])]
  assert {p.kind for p in found} <= {Kind.FORGED, Kind.BUILT_ON_FORGERY}


def test_a_document_stored_after_another_prefix_is_never_placed():
  # Its keys hang from the other prefix's document root, and its first block records the other
  # prefix's last header: either alone keeps it apart.
  eng = engine()
  store = stored(eng)
  other = PREFIX[:-1] + [PREFIX[-1] + 1]
  store.put_document(other, DOCUMENTS[3])  # the other prefix is stored too
  composed = store.compose(other, DOCUMENTS[:2], QUERY)
  assert [d['source'] for d in composed.record['documents']] == ['computed', 'computed']
  prefix_ctx, _ = eng.prefill(other, logits='none')
  rows = [composing.compute_rows(eng, prefix_ctx, d) for d in DOCUMENTS[:2]]
  ctx, _ = composing.compose(eng, prefix_ctx, DOCUMENTS[:2], rows)
  _, want = eng.extend(ctx, QUERY, logits='all')
  assert sha256_bytes(composed.logits) == sha256_bytes(want)


def test_the_experiment_checks_itself_and_its_manifest_replays_hash_for_hash(tmp_path):
  import json
  import os
  import pathlib
  import subprocess
  import sys
  repo = pathlib.Path(__file__).resolve().parents[1]

  def run(module, *args):
    return subprocess.run([sys.executable, '-m', f'experiments.{module}', *args], cwd=repo,
                          env={**os.environ, 'PYTHONPATH': str(repo)}, capture_output=True,
                          text=True, timeout=900)

  output, manifest = tmp_path / 'r.json', tmp_path / 'm.json'
  done = run('compose', '--model=tiny_gemma3', '--weights=random:0', '--documents=4',
             '--lengths=24,40', '--contexts=1', '--questions=3', '--strategies=none,epic',
             '--fractions=0,0.3,1', '--offsets=0,9,max', '--nottft', '--continuation_tokens=4',
             '--modes=relative',
             f'--output={output}', f'--manifest_output={manifest}')
  assert done.returncode == 0, done.stderr[-2000:]
  result = json.loads(output.read_text())
  assert result['summary'] == {'full_recompute_equal': True, 'relocation_exact': True,
                               'failures': []}
  relative = result['modes']['relative']
  full = next(r for r in relative['rows'] if r['strategy'] == 'epic' and r['fraction'] == 1.0)
  assert full['logits_equal'] == full['questions'] == 3 and full['kl_max'] == 0.0
  # The manifest replays hash for hash, and a changed hash is named.
  assert 'reproduce' in run('replay', f'--manifest={manifest}').stdout
  tampered = json.loads(manifest.read_text())
  tampered['compositions'][1]['logits_sha256'] = '0' * 64
  manifest.write_text(json.dumps(tampered))
  failed = run('replay', f'--manifest={manifest}')
  assert failed.returncode == 1
  assert 'composition 1 (relative epic 0.3): logits_sha256' in failed.stdout
