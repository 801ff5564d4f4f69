"""Random weights drawn straight into an engine's form (gemma_jax/drawn.py): the same values
as the tree gemma_jax.model.init_params draws, element for element, whether drawn whole, as a
region (a device's shard), transposed (the output table) or packed; and the engine built on
them, holding no canonical tree, computes the bits of the engine built on the tree.
"""

import numpy as np
import pytest

from gemma_jax import model, weights
from gemma_jax.checkpoints import tree
from gemma_jax.config import get_config
from gemma_jax import drawn
from graft.engine import Engine, EngineConfig, placement


def bits(x):
  return np.ascontiguousarray(np.asarray(x)).view(np.uint8)


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_a_region_is_the_same_elements_of_the_whole(dtype):
  config = get_config('tiny_gemma3')
  whole = tree.flatten(model.init_params(config, 5, weights.DTYPES[dtype]))
  for name, (shape, mean, std) in model.parameter_distributions(config).items():
    assert np.array_equal(bits(drawn.leaf(5, config, name, weights.DTYPES[dtype])),
                          bits(whole[name])), name
  shape, mean, std = model.parameter_distributions(config)[drawn.TABLE]
  table = np.asarray(whole[drawn.TABLE])
  # A column shard of the table's transpose (a device's vocabulary share) and a block of rows.
  share = drawn.region(5, drawn.TABLE, shape, mean, std, weights.DTYPES[dtype],
                       (slice(None), slice(256, 512)), transposed=True)
  assert np.array_equal(bits(share), bits(table.T[:, 256:512]))
  name = 'layers/1/attn/o_proj/w'
  shape, mean, std = model.parameter_distributions(config)[name]
  block = drawn.region(5, name, shape, mean, std, weights.DTYPES[dtype],
                       (slice(1, 3), slice(None), slice(8, 24)))
  assert np.array_equal(bits(block), bits(np.asarray(whole[name])[1:3, :, 8:24]))


def test_the_digest_drawn_a_parameter_at_a_time_is_the_trees():
  config = get_config('tiny_gemma4')
  assert drawn.params_sha256(3, config, np.float32) == tree.params_digest(
      model.init_params(config, 3))


@pytest.mark.parametrize('mode, dtype', [('spec', 'float32'), ('pinned', 'bfloat16')])
def test_an_engine_on_drawn_weights_holds_the_trees_form(mode, dtype):
  """An engine's placement drawn straight (the spec engine's packed projections and output
  table's panels; the pinned engine's bfloat16 weights, its table among them), against the
  tree placed: every array equal, bit for bit."""
  loaded = weights.load('tiny_gemma3_wide', 'random:0', dtype)
  config = EngineConfig(mode=mode, rows_per_call=16, attention_tile=16, cache_len=128)
  engine = Engine(loaded, config)
  made = drawn.place(0, loaded.config, dtype, engine.layout, None, 'gather')
  from_tree = placement.place_weights(loaded.replace(params=loaded.params), loaded.config,
                                      engine.layout, None, 'gather')
  flat, want = tree.flatten(made), tree.flatten(from_tree)
  assert flat.keys() == want.keys()
  for name in want:
    assert np.array_equal(bits(flat[name]), bits(want[name])), name
