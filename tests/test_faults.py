"""The fault campaign at CI size: hundreds of random faults, none silently wrong, nothing lost
(after gc), with and without signed writers. And the campaign itself can fail: with a defense
planted out of the reader or the writer (the per-leaf hashes, the byte comparison of a taken
key, the parent-header check, the trust list, the conditional delete, gc's respect of a put's
lease), it counts what results."""


import numpy as np
import pytest

from experiments import fault_campaign as faults
from gemma_jax import weights
from gemma_jax import digest
from graft.store import blocks, signing
from graft.store.index import Index
from graft.store.maintenance import Maintenance
from graft.store.publish import Publication
from graft.store.trust import Trust
from gemma_jax.config import get_config
from graft.engine import Engine, EngineConfig

# Kinds that must be refused at least once in a CI-sized run (the others may find nothing to
# refuse when the fault lands away from what the trial reads, and are then exact).
ALWAYS_REFUSED = ('bitflip_header', 'truncate', 'empty', 'delete', 'rename', 'copy_other_key',
                  'foreign_store', 'shape_twin', 'huge_header', 'bad_index_types',
                  'artifact_manifest', 'forgery', 'forgery_descendants', 'wrong_json_types',
                  'borrowed_signature')


def _setup(tmp_path_factory, signed, block_kind='context'):
  rope = 'relative' if block_kind == 'document' else 'float'
  loaded = weights.load(get_config('tiny_gemma3').replace(rope_mode=rope), 'random:0', 'float32')
  engine = Engine(loaded, EngineConfig(rows_per_call=8, cache_len=512, attention_tile=8))
  model_args = ['--model=tiny_gemma3', '--weights=random:0', '--rows_per_call=8',
                '--cache_len=512', '--attention_tile=8', f'--rope={rope}']
  world = faults.make_world(engine, np.random.default_rng(1), model_args, signed=signed,
                            block_kind=block_kind)
  return world, faults.other_engines(loaded, engine), str(tmp_path_factory.mktemp('faults'))


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  return _setup(tmp_path_factory, signed=False)


@pytest.fixture(scope='module')
def signed(tmp_path_factory):
  return _setup(tmp_path_factory, signed=True)


@pytest.fixture(scope='module')
def documents(tmp_path_factory):
  return _setup(tmp_path_factory, signed=False, block_kind='document')


def _check(kinds):
  for name, kind in kinds.items():
    assert kind['silent_wrong'] == 0 and kind['crashed'] == 0 and kind['lost'] == 0, (
        name, kind['examples'])
    assert kind['exact'] + kind['untouched'] + kind['refused'] == kind['trials']
  assert set(ALWAYS_REFUSED) <= set(faults.KINDS), set(ALWAYS_REFUSED) - set(faults.KINDS)
  for name in ALWAYS_REFUSED:
    if name in kinds:  # a campaign of some kinds only
      assert kinds[name]['refused'] > 0 and kinds[name]['reasons'], name


@pytest.mark.slow
def test_a_ci_sized_campaign_has_no_silent_wrong_answer_and_loses_nothing(setup):
  world, others, scratch = setup
  kinds = faults.campaign(world, faults.KINDS, trials=5, process_trials=1, seed=3,
                          others=others, scratch=scratch)
  assert sum(k['trials'] for k in kinds.values()) == 5 * len(faults.STORE_KINDS) + 2
  _check(kinds)


def test_a_signed_campaign_never_grafts_a_forgery(signed):
  world, others, scratch = signed
  kinds = faults.campaign(world, ['forgery', 'forgery_descendants', 'borrowed_signature',
                                  'stale_reader', 'bitflip_data'], trials=8, process_trials=0,
                          seed=4,
                          others=others, scratch=scratch)
  _check(kinds)


def test_the_campaign_catches_a_reader_that_skips_the_leaf_hashes(setup, monkeypatch):
  world, others, scratch = setup
  real = blocks.decode_leaves

  # A planted bug: the reader recomputes the expected hashes from what it read (trusts it).
  def planted(header, data, data_offset, *, global_only, layout):
    dtype_size = blocks.numpy_dtype(layout.dtype).itemsize
    patched = []
    for leaf in header['leaves']:
      size = int(np.prod(leaf['shape'])) * dtype_size
      chunk = data[leaf['offset']:leaf['offset'] + size]
      patched.append({**leaf, 'blake3': digest.hexdigest('blake3', chunk)})
    return real({**header, 'leaves': patched}, data, data_offset, global_only=global_only,
                layout=layout)

  monkeypatch.setattr(blocks, 'decode_leaves', planted)
  kinds = faults.campaign(world, ['bitflip_data'], trials=30, process_trials=0, seed=5,
                          others=others, scratch=scratch)
  assert kinds['bitflip_data']['silent_wrong'] > 0


def test_the_campaign_catches_a_writer_that_keeps_a_forgery(setup, monkeypatch):
  world, others, scratch = setup
  # A planted bug: the writer keeps what is stored under a taken key without comparing bytes.
  monkeypatch.setattr(Publication, '_publish_over',
                      lambda self, *a, **k: (self._backing.delete(a[3]), (
                          False, False, self._index.entry(a[0], a[2], a[1])['header_sha256']))[1])
  kinds = faults.campaign(world, ['forgery'], trials=6, process_trials=0, seed=6, others=others,
                          scratch=scratch)
  assert kinds['forgery']['silent_wrong'] > 0


def test_the_campaign_catches_a_reader_that_ignores_the_parent_header(setup, monkeypatch):
  world, others, scratch = setup
  monkeypatch.setattr(Trust, 'on_parent', lambda self, entry, parent_header: True)
  monkeypatch.setattr(Index, 'children', lambda self, parent, start: [])
  kinds = faults.campaign(world, ['forgery_descendants'], trials=6, process_trials=0, seed=7,
                          others=others, scratch=scratch)
  assert kinds['forgery_descendants']['silent_wrong'] > 0


def test_the_campaign_catches_a_reader_that_trusts_every_signature(signed, monkeypatch):
  world, others, scratch = signed
  monkeypatch.setattr(signing, 'signed_by', lambda record, digest, trusted: True)
  kinds = faults.campaign(world, ['forgery'], trials=8, process_trials=0, seed=8, others=others,
                          scratch=scratch)
  assert kinds['forgery']['silent_wrong'] > 0


def test_the_campaign_catches_an_unconditional_delete(setup, monkeypatch):
  world, others, scratch = setup
  # A planted bug: an entry judged bad is deleted whatever it holds by then (and not rebuilt from
  # the sound object, which would heal the loss within the same reader).
  monkeypatch.setattr(Index, '_delete_entry_if',
                      lambda self, name, judged: self._backing.delete(name) or True)
  monkeypatch.setattr(Index, 'rebuild_entry', lambda self, parent, key: None)
  kinds = faults.campaign(world, ['stale_reader'], trials=6, process_trials=0, seed=9,
                          others=others, scratch=scratch)
  assert kinds['stale_reader']['lost'] > 0


def test_the_campaign_catches_a_gc_that_ignores_leases(setup, monkeypatch):
  world, others, scratch = setup
  # A planted bug: gc sees no put's lease, so it removes a running put's unpublished objects.
  monkeypatch.setattr(Maintenance, '_leases', lambda self, lease_seconds: (set(), []))
  kinds = faults.campaign(world, ['gc_inside_put'], trials=6, process_trials=0, seed=10,
                          others=others, scratch=scratch)
  assert kinds['gc_inside_put']['lost'] > 0


@pytest.mark.slow
def test_a_document_campaign_has_no_silent_wrong_answer_and_loses_nothing(documents):
  # Every kind, its faults landing on documents stored after a prefix (and on the prefix), each
  # trial composing stored documents in an order and with a recompute strategy of its own.
  world, others, scratch = documents
  assert all(isinstance(c, faults.world.Composed) for c in world.contexts)
  kinds = faults.campaign(world, faults.KINDS, trials=4, process_trials=1, seed=11,
                          others=others, scratch=scratch)
  assert sum(k['trials'] for k in kinds.values()) == 4 * len(faults.STORE_KINDS) + 2
  _check(kinds)


def test_the_document_campaign_catches_a_repair_that_leaves_the_prefix(documents, monkeypatch):
  world, others, scratch = documents
  # A planted bug (the first put_document had it): a recompute put of documents does not
  # recompute their prefix, so a forged prefix block survives the honest writer's repair.
  real = Publication.put
  monkeypatch.setattr(Publication, 'put', lambda self, tokens, recompute=False,
                      own_last_block=False: real(self, tokens, own_last_block=own_last_block,
                                                 recompute=recompute and not own_last_block))
  kinds = faults.campaign(world, ['forgery'], trials=12, process_trials=0, seed=12,
                          others=others, scratch=scratch)
  assert kinds['forgery']['silent_wrong'] > 0
