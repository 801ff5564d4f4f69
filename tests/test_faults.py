"""The fault campaign at CI size: hundreds of random faults, none silently wrong, nothing lost.
And the campaign itself can fail: with the per-leaf hash check planted out of the reader, it
counts the silent-wrong answers that result."""

import hashlib

import numpy as np
import pytest

from graft import faults
from gemma_jax import weights
from graft.store import blocks
from graft.engine import Engine, EngineConfig

# Kinds that must be refused at least once in a CI-sized run (the others may find nothing to
# refuse when the fault lands away from what the trial reads, and are then exact).
ALWAYS_REFUSED = ('bitflip_header', 'truncate', 'empty', 'delete', 'rename', 'copy_other_key',
                  'foreign_store', 'shape_twin', 'huge_header', 'bad_index_types',
                  'artifact_manifest')


@pytest.fixture(scope='module')
def setup(tmp_path_factory):
  loaded = weights.load('tiny_gemma3', 'random:0', 'float32')
  engine = Engine(loaded, EngineConfig(rows_per_call=8, cache_len=512))
  model_args = ['--model=tiny_gemma3', '--weights=random:0', '--block_size=8',
                '--cache_len=512']
  world = faults.make_world(engine, np.random.default_rng(1), model_args)
  return world, faults.other_engines(loaded, engine), str(tmp_path_factory.mktemp('faults'))


@pytest.mark.slow
def test_a_ci_sized_campaign_has_no_silent_wrong_answer_and_loses_nothing(setup):
  world, others, scratch = setup
  kinds = faults.campaign(world, faults.KINDS, trials=15, process_trials=1, seed=3,
                          others=others, scratch=scratch)
  assert sum(k['trials'] for k in kinds.values()) == 15 * len(faults.STORE_KINDS) + 2
  for name, kind in kinds.items():
    assert kind['silent_wrong'] == 0 and kind['lost'] == 0, (name, kind['examples'])
    assert kind['exact'] + kind['refused'] == kind['trials']
  for name in ALWAYS_REFUSED:
    assert kinds[name]['refused'] > 0 and kinds[name]['reasons'], name


def test_the_campaign_catches_a_reader_that_skips_the_leaf_hashes(setup, monkeypatch):
  world, others, scratch = setup
  real = blocks.decode_leaves

  # A planted bug: the reader recomputes the expected hashes from what it read (trusts it).
  def planted(header, data, data_offset, *, global_only, layout):
    dtype_size = np.dtype(blocks._numpy_dtype(layout.dtype)).itemsize
    patched = []
    for leaf in header['leaves']:
      size = int(np.prod(leaf['shape'])) * dtype_size
      chunk = data[leaf['offset']:leaf['offset'] + size]
      patched.append({**leaf, 'sha256': hashlib.sha256(chunk).hexdigest()})
    return real({**header, 'leaves': patched}, data, data_offset, global_only=global_only,
                layout=layout)

  monkeypatch.setattr(blocks, 'decode_leaves', planted)
  kinds = faults.campaign(world, ['bitflip_data'], trials=30, process_trials=0, seed=5,
                          others=others, scratch=scratch)
  assert kinds['bitflip_data']['silent_wrong'] > 0
