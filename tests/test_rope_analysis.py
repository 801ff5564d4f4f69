"""RoPE golden values and the floating-point facts analysis/rope_float.py reports.

Tolerances are stated where closeness (not equality) is the claim; exactness claims compare raw
bytes. Everything runs apply_rope the way the model does (jitted) unless a test says otherwise.
"""

import json
import os
import pathlib
import subprocess
import sys

from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from analysis import rope_float as rf
from gemma_jax import compare
from gemma_jax import rope

REPO = pathlib.Path(__file__).resolve().parents[1]

LAYERS = {layer.name: layer for layer in rf.layer_types()}
LOCAL, GLOBAL = LAYERS['local'], LAYERS['global']
SCALE8, GEMMA4 = LAYERS['global_scale8'], LAYERS['gemma4_global']
GOLDEN_POSITIONS = np.array([0, 1, 2, 7, 100, 1000, 4096, 32_768, 100_000, 131_071], np.int32)


def _bytes_equal(a, b) -> bool:
  a, b = np.asarray(a), np.asarray(b)
  return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


# ---------------------------------------------------------------------------------------------
# Float helpers
# ---------------------------------------------------------------------------------------------


def test_ulp_of_is_the_dtype_spacing():
  assert rf.ulp_of(1.0, np.float32) == 2.0**-23
  assert rf.ulp_of(1.0, jnp.bfloat16) == 2.0**-7
  assert rf.ulp_of(0.0, np.float32) == np.float64(np.finfo(np.float32).smallest_subnormal)
  values = np.array([1e-30, 0.3, 7.0, 1e6, 3e30], np.float32)
  np.testing.assert_array_equal(rf.ulp_of(values.astype(np.float64), np.float32),
                                np.spacing(values).astype(np.float64))


def test_float32_angle_spacing_facts_of_the_reference():
  # docs/gemma.md: about 0.0039 rad at 32,768 and 0.0156 rad at 131,072.
  assert rf.ulp_of(32_768, np.float32) == 2.0**-8 == 0.00390625
  assert rf.ulp_of(131_072, np.float32) == 2.0**-6 == 0.015625


def test_ulp_distance_counts_floats_between():
  one = np.float32(1.0)
  assert compare.ulp_distance(one, np.nextafter(one, np.float32(2))) == 1
  tiny = np.float32(np.finfo(np.float32).smallest_subnormal)
  assert compare.ulp_distance(tiny, -tiny) == 2
  assert compare.ulp_distance(np.float32(0.0), np.float32(-0.0)) == 0
  assert not compare.bits_equal(np.float32(0.0), np.float32(-0.0))


# ---------------------------------------------------------------------------------------------
# Golden values
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', sorted(LAYERS))
def test_rotation_angles_within_two_float32_ulps_of_float64(name):
  layer = LAYERS[name]
  got = rf.float32_angles(GOLDEN_POSITIONS, layer).astype(np.float64)
  want = rf.reference_angles(GOLDEN_POSITIONS, layer)
  # Tolerance: 2 ulps of the angle (the timescale and the product/quotient each round once).
  assert np.all(np.abs(got - want) <= 2 * rf.ulp_of(want, np.float32))
  # Pair 0 has timescale exactly 1: its angle is the position divided by the scale, exactly.
  np.testing.assert_array_equal(got[:, 0], GOLDEN_POSITIONS / layer.scale)
  # Pairs that do not rotate have angle exactly 0.
  assert np.all(got[:, layer.rotated_pairs:] == 0)


@pytest.mark.parametrize('name', sorted(LAYERS))
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_apply_rope_within_stated_tolerance_of_float64_rotation(name, dtype):
  layer = LAYERS[name]
  x = rf.random_vectors(len(GOLDEN_POSITIONS), 2, layer.head_dim, dtype, seed=1)
  got = rf.apply(layer, x, GOLDEN_POSITIONS).astype(np.float64)
  want = rf.reference_rotation(x, GOLDEN_POSITIONS, layer)
  half = layer.num_pairs
  norm = np.hypot(want[..., :half], want[..., half:])  # [P, V, H/2]
  # Tolerance: the angle may be off by 2 float32 ulps of the largest angle (moving the point by
  # norm * angle error), plus 2 ulps of the norm in the result's dtype for the rotation's roundings.
  angle_ulp = rf.ulp_of(rf.reference_angles(GOLDEN_POSITIONS, layer), np.float32)[:, None, :]
  bound = norm * 2 * angle_ulp + 2 * rf.ulp_of(norm, dtype)
  err = np.maximum(np.abs(got - want)[..., :half], np.abs(got - want)[..., half:])
  assert np.all(err <= bound)


@pytest.mark.parametrize('name', sorted(LAYERS))
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
@pytest.mark.parametrize('execution', ['jit', 'eager'])
def test_position_zero_is_the_identity_bit_for_bit(name, dtype, execution):
  layer = LAYERS[name]
  x = rf.random_vectors(3, 2, layer.head_dim, dtype, seed=2)
  assert _bytes_equal(rf.apply(layer, x, np.zeros(3, np.int32), execution=execution), x)


def test_pair_zero_at_position_one_is_float32_cos_and_sin_of_one():
  x = np.zeros((1, 1, LOCAL.head_dim), np.float32)
  x[0, 0, 0] = 1.0  # pair 0 = (x_0, x_{H/2}) = (1, 0)
  out = rf.apply(LOCAL, x, np.array([1]))
  # Golden: cos(1) = 0.5403023..., sin(1) = 0.8414709...; within 1 float32 ulp.
  assert abs(out[0, 0, 0] - np.cos(1.0)) <= rf.ulp_of(np.cos(1.0), np.float32)
  assert abs(out[0, 0, LOCAL.num_pairs] - np.sin(1.0)) <= rf.ulp_of(np.sin(1.0), np.float32)
  assert abs(out[0, 0, 0] - 0.5403023) < 1e-7
  assert abs(out[0, 0, LOCAL.num_pairs] - 0.84147096) < 1e-7


def test_quarter_turn_golden_value_at_position_one():
  # Multipliers m_i = 1 + i mod 3 = (1, 2, 3, 1), quarter turns (1, 2, 3, 1) at position 1:
  # (f, s) -> (-s, f), (-f, -s), (s, -f), (-s, f).
  x = jnp.asarray([1, 2, 3, 4, 5, 6, 7, 8], jnp.float32).reshape(1, 1, 1, 8)
  out = rope.apply_rope(x, jnp.ones((1, 1), jnp.int32), base=10_000.0, mode='quarter_turn')
  assert _bytes_equal(out.reshape(-1), np.array([-5, -2, 7, -8, 1, -6, -3, 4], np.float32))


# ---------------------------------------------------------------------------------------------
# Composition
# ---------------------------------------------------------------------------------------------

_QT = rf.LayerRope('quarter_turn_test', 16, 10_000.0)
_TINY = float(np.finfo(np.float32).tiny)  # smallest normal float32
_magnitude = st.floats(_TINY, float(np.finfo(np.float32).max), width=32)
_normal_nonzero = st.tuples(st.booleans(), _magnitude).map(lambda t: -t[1] if t[0] else t[1])


@settings(max_examples=60, deadline=None)
@given(a=st.integers(0, 2**20), b=st.integers(0, 2**20),
       x=hnp.arrays(np.float32, (2, 1, 16), elements=_normal_nonzero))
def test_quarter_turn_composes_exactly_bit_for_bit(a, b, x):
  """R(b) R(a) x == R(a + b) x, bytes equal, for nonzero normal floats (the table's sin and cos
  are 0 and ±1, so every product is exact and every sum adds a zero)."""
  shifted, direct = rf.compose(_QT, x, np.array([a, a]), b, mode='quarter_turn')
  assert _bytes_equal(shifted, direct)


@settings(max_examples=40, deadline=None)
@given(a=st.integers(0, 2**20), b=st.integers(0, 2**20),
       x=hnp.arrays(np.float32, (2, 1, 16),
                    elements=st.floats(width=32, allow_nan=False, allow_infinity=False)))
def test_quarter_turn_composes_exactly_as_values_for_any_finite_float(a, b, x):
  """With zeros and subnormals the values still agree, but the sign of a zero can depend on the
  path (x * 0 takes x's sign; XLA:CPU also flushes subnormals), so only == holds, not bytes."""
  shifted, direct = rf.compose(_QT, x, np.array([a, a]), b, mode='quarter_turn')
  np.testing.assert_array_equal(shifted, direct)


@pytest.mark.parametrize('name', sorted(LAYERS))
@pytest.mark.parametrize('dtype', [jnp.float32, jnp.bfloat16])
def test_float_rope_composition_is_exact_at_offset_zero(name, dtype):
  stats = rf.composition_error(rf.position_grid(131_072)[1:], LAYERS[name], 0, dtype)
  assert stats['exact_fraction'] == 1.0 and stats['max_abs'] == 0.0


@pytest.mark.parametrize('delta', [1, 1024])
def test_bfloat16_quarter_turn_composes_exactly(delta):
  stats = rf.composition_error(rf.position_grid(131_072)[1:], GLOBAL, delta, jnp.bfloat16,
                               mode='quarter_turn')
  assert stats['exact_fraction'] == 1.0 and stats['max_abs'] == 0.0


@pytest.mark.parametrize('delta', [1, 2, 7, 1024, 2**16])
@pytest.mark.parametrize('name', ['local', 'global', 'global_scale8'])
def test_float32_re_rotation_is_not_exact_witness(name, delta):
  """A concrete (position, pair, vector) found by the analysis where R(δ)R(p)x != R(p+δ)x in
  bits, replayed on its own through apply_rope."""
  layer = LAYERS[name]
  witness = rf.find_composition_witness(layer, delta)
  assert witness is not None
  x = np.zeros((1, 1, 1, layer.head_dim), np.float32)
  x[..., witness['pair']] = witness['x'][0]
  x[..., witness['pair'] + layer.num_pairs] = witness['x'][1]
  fn = jax.jit(lambda v, p: rope.apply_rope(v, p, base=layer.base, scale=layer.scale,
                                            rotary_fraction=layer.rotary_fraction))
  position = jnp.full((1, 1), witness['position'], jnp.int32)
  shifted = fn(fn(jnp.asarray(x), position), jnp.full((1, 1), delta, jnp.int32))
  direct = fn(jnp.asarray(x), position + delta)
  assert not _bytes_equal(shifted, direct)
  assert witness['ulp_distance'] >= 1


@pytest.mark.parametrize('name', sorted(LAYERS))
def test_quarter_turn_has_no_witness(name):
  assert rf.find_composition_witness(LAYERS[name], 7, mode='quarter_turn') is None


@pytest.mark.parametrize('delta', [1, 3, 5, 64, 1024, 2**16])
@pytest.mark.parametrize('name', ['local', 'global'])
def test_float32_re_rotation_is_inexact_for_most_positions_and_pairs(name, delta):
  stats = rf.composition_error(rf.position_grid(131_072)[1:], LAYERS[name], delta, jnp.float32,
                               vectors=2)
  assert stats['exact_fraction'] < 0.5
  assert stats['max_abs'] > 0


def test_re_rotation_error_grows_with_position():
  positions = rf.position_grid(131_072)[1:]
  stats = rf.composition_error(positions, GLOBAL, 1, jnp.float32)
  err = np.array(stats['per_position']['max_abs'])
  assert err[positions >= 2**15].max() > 100 * err[positions <= 8].max()


# ---------------------------------------------------------------------------------------------
# Angle rounding against position
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize('name', sorted(LAYERS))
def test_angle_error_grows_with_position_within_the_float32_spacing(name):
  layer = LAYERS[name]
  positions = rf.position_grid(131_072)
  stats = rf.angle_error(positions, layer)
  err = np.array(stats['per_position']['max_abs_error'])
  # The bound: never more than the float32 spacing at the position's largest angle (itself
  # nondecreasing in the position), and at most 2 ulps of any single angle.
  spacing = np.array(stats['per_position']['float32_spacing_at_max_angle'])
  assert np.all(err <= spacing)
  assert np.all(np.diff(spacing) >= 0)
  assert stats['max_ulp_error'] <= 2.0
  # Monotone-ish: the largest error per octave of positions never drops by more than 4x from
  # one octave to the next and grows by orders of magnitude overall.
  octave_max = [err[(positions >= 2**k) & (positions < 2**(k + 1))].max() for k in range(17)]
  assert all(b >= a / 4 for a, b in zip(octave_max, octave_max[1:]))
  assert octave_max[-1] > 1000 * octave_max[0]
  assert 0.9 < stats['loglog_slope_vs_position'] < 1.1


def test_scale_eight_divides_the_angles_and_their_error_by_eight_exactly():
  positions = rf.position_grid(131_072)
  np.testing.assert_array_equal(rf.float32_angles(positions, SCALE8) * 8,
                                rf.float32_angles(positions, GLOBAL))


# ---------------------------------------------------------------------------------------------
# Partial rotary (Gemma 4 global)
# ---------------------------------------------------------------------------------------------


def test_partial_rotary_leaves_75_percent_of_pairs_bit_identical():
  positions = np.array([1, 5, 999, 32_768, 131_071], np.int32)
  x = rf.random_vectors(len(positions), 2, GEMMA4.head_dim, jnp.float32, seed=3)
  out = rf.apply(GEMMA4, x, positions)
  same = (out.view(np.uint32) == x.view(np.uint32))
  same_pairs = same[..., :GEMMA4.num_pairs] & same[..., GEMMA4.num_pairs:]
  assert GEMMA4.rotated_pairs == 64 and GEMMA4.num_pairs == 256
  assert same_pairs[..., 64:].all()  # the 192 unrotated pairs, bit for bit
  assert not same_pairs[..., :64].any()  # the 64 rotated ones all move at these positions
  assert same_pairs.mean() == 0.75


def test_partial_rotary_composition_is_exact_on_unrotated_pairs():
  stats = rf.composition_error(rf.position_grid(131_072)[1:], GEMMA4, 7, jnp.float32)
  assert stats['unrotated_pairs_exact']
  assert 0.75 <= stats['exact_fraction'] < 0.8
  assert stats['exact_fraction_rotated_pairs'] < 0.2


# ---------------------------------------------------------------------------------------------
# Layer propagation summary and the whole analysis
# ---------------------------------------------------------------------------------------------


def test_summarize_layer_propagation_finds_first_layer_and_growth():
  def layer(i, value):
    return {'layer': i, 'k_max_abs': value, 'v_max_abs': value / 2, 'k_max_ulp': value * 1e6,
            'v_max_ulp': 0.0, 'k_equal': value == 0, 'v_equal': value == 0}
  sweep = {'config': {}, 'rows': [
      {'model': 'm', 'dtype': 'float32', 'rope': 'float', 'method': 'rerotate', 'offset': 3,
       'equal': False, 'layers': [layer(0, 0.0), layer(1, 1e-3), layer(2, 2e-3), layer(3, 4e-3)]},
      {'model': 'm', 'dtype': 'float32', 'rope': 'float', 'method': 'rerotate', 'offset': 0,
       'equal': True, 'layers': [layer(i, 0.0) for i in range(4)]},
  ]}
  shifted, own = rf.summarize_layer_propagation(sweep)
  assert shifted['first_differing_layer'] == 1 and shifted['layers_differing'] == 3
  assert shifted['growth_factors'] == [2.0, 2.0] and shifted['mean_growth_factor'] == 2.0
  assert shifted['first_layer_max_abs'] == 1e-3 and shifted['last_layer_max_abs'] == 4e-3
  assert own['first_differing_layer'] is None and own['mean_growth_factor'] is None


def test_entry_point_writes_json_with_its_config(tmp_path):
  output = tmp_path / 'rope_float.json'
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.rope_float', f'--output={output}', '--positions=512',
       '--dtypes=float32', '--offsets=0,1,7', '--grid_points=6', '--vectors=1'],
      cwd=REPO, env={**os.environ, 'PYTHONPATH': str(REPO)}, capture_output=True, text=True,
      timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(output.read_text())
  assert result['schema'] == 'rope_float/1'
  assert result['config']['command'].startswith('python -m experiments.rope_float')
  assert result['config']['max_position'] == 512 and result['config']['offsets'] == [0, 1, 7]
  assert set(result['layer_types']) == set(LAYERS)
  for entry in result['layer_types'].values():
    for dtype in ('float32',):
      assert entry['composition'][dtype]['float']['0']['exact_fraction'] == 1.0
      assert all(v['exact_fraction'] == 1.0
                 for v in entry['composition'][dtype]['quarter_turn'].values())
      assert entry['composition'][dtype]['float']['1']['witness'] is not None
  assert result['facts']['float32_spacing_at_position']['32768'] == 0.00390625
