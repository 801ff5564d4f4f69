"""Random weights by integer arithmetic (gemma_jax.seeded): the same bits on every machine.

The committed digests below must hold on every machine that runs the suite: random:SEED weights
are SplitMix64 words turned into floats by an exact integer sum, an exact conversion and one
binary32 multiply and add (docs/determinism.md, "Inputs"). A machine where they differ computes
other weights than the committed results were made with.
"""

import decimal
import hashlib

import numpy as np
import pytest

from gemma_jax import model, seeded, weights
from gemma_jax.checkpoints import tree
from gemma_jax.config import get_config

# params_sha256 (the model fingerprint's) of random:0, float32, made by this generator.
RANDOM_0 = {
    'tiny_gemma2': '06711e4c8f738b7d9fe834a75547567c0906ed479c375a3f68402fd6e4798200',
    'tiny_gemma3': 'b2c7eb9b2c7b261ae871b9ed7d1e142a2bbd7a37f06fa94d9ef888c18b430b64',
    'tiny_gemma4': '635a184b046379c05d5f925d5e2256766849ab275df4ce5c437aeab4e3dd318c',
    'tiny_gemma3_wide': '933dbd9118604fb9f63a2db785fd35db2f5344d812674d546eaea9e8302f9b6f',
}


@pytest.mark.parametrize('name', sorted(RANDOM_0))
def test_the_random_weights_of_the_tiny_models_hash_to_their_committed_value(name):
  assert weights.load(name, 'random:0', 'float32').params_sha256 == RANDOM_0[name]


def test_the_words_are_splitmix64s():
  # The reference implementation's first outputs for the seed 1234567 (Vigna, splitmix64.c).
  reference = [6457827717110365317, 3203168211198807973, 9817491932198370423,
               4593380528125082431, 16408922859458223821]
  assert [seeded.word(1234567, i) for i in range(5)] == reference
  assert seeded.words(1234567, np.arange(5, dtype=np.uint64)).tolist() == reference
  index = np.array([0, 7, 1 << 40, (1 << 64) - 2], np.uint64)
  assert seeded.words(99, index).tolist() == [seeded.word(99, int(i)) for i in index]


def test_a_parameter_is_made_whole_or_in_any_part_with_the_same_bits():
  """A row block, any elements (a packed panel's columns), and the whole made in threaded
  chunks: each the same bits (what lets a parameter be made straight into another layout)."""
  shape, mean, std = (1100, 1024), 0.0, 1 / np.sqrt(1100)
  whole = seeded.normal(3, 'layers/0/mlp/down_proj/w', shape, mean, std)
  assert whole.shape == shape and whole.dtype == np.float32
  rows = seeded.normal(3, 'layers/0/mlp/down_proj/w', shape, mean, std, 7 * 1024, 700 * 1024)
  assert rows.tobytes() == whole[7:700].tobytes()
  stream = seeded.parameter_key(3, 'layers/0/mlp/down_proj/w')
  columns = np.arange(1100, dtype=np.uint64)[:, None] * 1024 + np.arange(256, 512)
  assert seeded.normal_at(stream, columns, mean, std).tobytes() == whole[:, 256:512].tobytes()
  other = seeded.normal(4, 'layers/0/mlp/down_proj/w', shape, mean, std)
  assert (other != whole).mean() > 0.99  # another seed, another stream


def test_a_parameter_has_its_mean_and_scale_and_is_bounded():
  """1,048,576 draws: the sample mean within 0.01 std of the mean and the sample standard
  deviation within 1% of std (their sampling errors are 0.001 std and 0.07%); every value
  within sqrt(12) std, the sum of four uniforms' bound."""
  for mean, std in ((0.0, 0.05), (1.0, 0.1)):
    x = seeded.normal(0, 'a', (1024, 1024), mean, std).astype(np.float64)
    assert abs(x.mean() - mean) < 0.01 * std
    assert abs(x.std() / std - 1) < 0.01
    assert np.abs(x - mean).max() <= np.sqrt(12) * std * (1 + 1e-6)


def test_the_scale_is_the_nearest_binary32():
  for std in (0.1, 1 / np.sqrt(640), 1 / np.sqrt(3)):
    s = seeded.scale(std)
    exact = decimal.Decimal(std) / seeded.SUM_VARIANCE.sqrt(decimal.Context(prec=40))
    error = lambda v: abs(decimal.Decimal(float(v)) - exact)
    for neighbour in (np.nextafter(s, np.float32(0)), np.nextafter(s, np.float32(1))):
      assert error(s) < error(neighbour)


def test_every_parameter_states_its_distribution_and_is_drawn_by_its_name():
  config = get_config('tiny_gemma4')
  distributions = model.parameter_distributions(config)
  params = model.init_params(config, 5)
  flat = tree.flatten(params)
  assert set(flat) == set(distributions)
  name = 'layers/1/mlp/gate_up_proj/w'
  shape, mean, std = distributions[name]
  assert (mean, std) == (0.0, 1 / np.sqrt(config.embed_dim))
  assert np.asarray(flat[name]).tobytes() == seeded.normal(5, name, shape, mean, std).tobytes()
  scale = distributions['final_norm/scale']
  assert scale[1:] == (1.0 - config.norm_scale_offset, 0.1)
  digest = hashlib.sha256(seeded.normal(7, 'layers/0/mlp/down_proj/w', (64,), 0.0, 0.125)
                          .tobytes()).hexdigest()
  assert digest == 'baa10d4a4f3d9023a9f62a3af79a4c6d81674c3b559d85e98e2521d30aab11d0'
