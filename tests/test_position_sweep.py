"""Shifted grafts (graft/shift.py, experiments/position_sweep.py) on tiny_gemma3, random weights.

The claims: an own-position graft (δ = 0) is byte-exact for both graft methods; the NoPE and
quarter-turn controls are exact at every δ, for every method; float RoPE is not exact at some
δ != 0 (found by searching, not hard-coded). Exactness is SHA-256 equality of raw bytes, never a
tolerance.

Why the quarter-turn control computes its scores from relative rotations
(gemma_jax.rope.quarter_turn_logits): its rotations compose exactly, but an odd shift turns
the pairs with multiplier 1 or 3 by a quarter, which moves the products q_i k_i and
q_{i+H/2} k_{i+H/2} into each other's dimension. A dot over H adds the same terms in another
order (other bits, measured below); a dot of the unrotated q with R(p_k - p_q) k does not move.
"""

import functools
import json
import os
import pathlib
import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from analysis import figures, results
from experiments import position_sweep as ps
from gemma_jax import compare, rope, weights
from gemma_jax import kv_state as kvs
from graft import shift
from graft.engine import Engine, EngineConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
LIBRARY, QUERY, BLOCK = 24, 6, 8  # the library crosses tiny_gemma3's 8-token window three times


@functools.lru_cache(maxsize=None)
def engines(rope_mode='float'):
  loaded = shift.with_config(weights.load('tiny_gemma3', 'random:0', 'float32'),
                             rope_mode=rope_mode)
  pinned = EngineConfig(mode='pinned', rows_per_call=BLOCK,
                        cache_len=ps.auto_cache_len(LIBRARY, QUERY, BLOCK))
  return ps.build_engines(loaded, pinned, shift.METHODS)


def tokens(n, seed=0):
  return [int(t) for t in np.random.default_rng(seed).integers(3, 512, n)]


@functools.lru_cache(maxsize=None)
def sweep_run(rope_mode='float'):
  return ps.Run(engines=engines(rope_mode), library=tokens(LIBRARY), query=tokens(QUERY, 1))


def row(rope_mode, method, offset):
  base = 0 if offset >= 0 else 16
  return ps.measure(sweep_run(rope_mode), method, offset, base)


@pytest.mark.parametrize('method', shift.GRAFT_METHODS)
def test_own_position_graft_is_byte_exact(method):
  r = row('float', method, 0)
  assert r['equal'] and r['reference_sha256'] == r['sha256'] and r['kv_equal']
  assert r['max_ulp'] == 0 and r['kl'] == 0 and r['first_differing_layer'] is None


@pytest.mark.parametrize('method', shift.METHODS)
@pytest.mark.parametrize('offset', [1, 3, 13, 256, -1])
def test_nope_control_is_exact_at_every_offset(method, offset):
  r = row('none', method, offset)
  assert r['equal'] and r['kv_equal'], (r['max_ulp'], r['first_differing_layer'])


@pytest.mark.parametrize('method', shift.METHODS)
@pytest.mark.parametrize("offset", [1, 2, 3, 13, 64, 1026, -1, -2])
def test_quarter_turn_control_is_exact_at_every_offset(method, offset):
  r = row('quarter_turn', method, offset)
  assert r['equal'] and r['kv_equal'], (r['max_ulp'], r['first_differing_layer'])


@pytest.mark.parametrize('method', shift.METHODS)
@pytest.mark.parametrize('offset', [1, 2, 3, 13, 64, 1026, 4096 - LIBRARY - QUERY, -1, -2])
def test_relative_rope_is_exact_at_every_offset(method, offset):
  # The trained model's encoding evaluated from offsets: every δ, every method, logits and KV.
  r = row('relative', method, offset)
  assert r['equal'] and r['kv_equal'], (r['max_ulp'], r['first_differing_layer'])
  assert r['reference_sha256'] == r['sha256']


def test_relative_rope_caches_unrotated_keys_so_rerotate_moves_positions_only():
  std = engines('relative')['standard']
  seq, _ = std.prefill(tokens(LIBRARY), logits='none')
  rows = kvs.take_rows(seq.kv, 0, LIBRARY)
  (moved,) = shift.rerotate(std.model_config, [rows], 7)
  for a, b in zip(rows.k, moved.k):
    assert compare.sha256_bytes(a) == compare.sha256_bytes(b)
  assert all(np.array_equal(p + 7, m) for p, m in zip(rows.positions, moved.positions))
  # Layer 0's keys are the float model's before RoPE (the pre-RoPE float engine caches the same
  # bytes); later layers read attention outputs, which the two modes round differently.
  pre, _ = engines('float')['pre_rope'].prefill(tokens(LIBRARY), logits='none')
  float_keys = kvs.take_rows(pre.kv, 0, LIBRARY).k
  assert compare.sha256_bytes(rows.k[0]) == compare.sha256_bytes(float_keys[0])
  assert compare.sha256_bytes(rows.k[-1]) != compare.sha256_bytes(float_keys[-1])


@pytest.mark.parametrize('offset', [1, 7, 300])
def test_an_artifact_grafted_at_another_position_is_exact_under_relative_rope(tmp_path, offset):
  from graft import exactness
  config = EngineConfig(mode='pinned', rows_per_call=BLOCK, cache_len=64)
  def check(mode, name, **kwargs):
    loaded = engines(mode)['standard'].loaded
    return exactness.check_offset(Engine(loaded, config), Engine(loaded, config),
                                  str(tmp_path / name), tokens(LIBRARY), tokens(QUERY, 1),
                                  continuation_tokens=4, **kwargs)
  r = check('relative', 'a', offset=offset)
  assert r['equal'] and r['continuation_equal'] and r['offset'] == offset, r
  # The library after other tokens is another computation (its KV never saw them).
  after = check('relative', 'b', offset=16, preceding=tokens(16, 2))
  assert not after['equal'] and after['preceding_tokens'] == 16
  # Under float RoPE the same graft, keys re-rotated by the offset, is not exact.
  assert not check('float', 'c', offset=offset)['equal']


def test_relative_rope_is_the_float_model_up_to_rounding():
  # Same weights, same tokens: only the order of the angle arithmetic differs (one rotation by
  # the offset's angle instead of two by the positions'), so logits agree to float32 rounding
  # grown through the layers; 1e-3 absolute on logits of order 10 is that, not another model.
  toks = tokens(LIBRARY)
  outs = {}
  for mode in ('float', 'relative'):
    _, logits = engines(mode)['standard'].prefill(toks, logits='all')
    outs[mode] = np.asarray(logits, np.float32)
  assert not np.array_equal(outs['float'], outs['relative'])
  np.testing.assert_allclose(outs['relative'], outs['float'], rtol=0, atol=1e-3)
  assert np.array_equal(outs['float'].argmax(-1), outs['relative'].argmax(-1))


def test_relative_rope_is_refused_where_attention_cannot_score_from_offsets():
  with pytest.raises(ValueError, match=r"'relative' RoPE mode needs attention in \('xla', "
                                       r"'tiled'\), not 'pallas'"):
    Engine(engines('relative')['standard'].loaded, EngineConfig(mode='pinned', attention='pallas'))


def test_an_artifact_of_one_rope_mode_is_refused_by_the_other(tmp_path):
  from graft.store import artifact
  std = engines('float')['standard']
  seq, _ = std.prefill(tokens(LIBRARY), logits='none')
  artifact.save(str(tmp_path / 'float'), std, seq)
  with pytest.raises(artifact.ArtifactError, match='rope_mode'):
    artifact.load(str(tmp_path / 'float'), engines('relative')['standard'])


def test_quarter_turn_scores_need_relative_rotations():
  # Same q, k at the same positions, shifted by one: the QK terms are the same numbers in other
  # dimensions. A dot over H adds them in another order (other bits); the control's scores,
  # a dot of the unrotated q with keys turned by the query's position, are bit-identical.
  # A half turn keeps every term in place for both.
  x = np.random.default_rng(0).standard_normal((2, 1, 64, 1, 256)).astype(np.float32)
  def scores(p):
    positions = jnp.full((1, 64), p, jnp.int32) + jnp.arange(64)
    q, k = (rope.apply_rope(jnp.asarray(v), positions, base=1e4, mode='quarter_turn') for v in x)
    products = np.asarray(q * k)[0, :, 0]  # [64, H]
    dot = np.asarray(jnp.einsum('bth,bth->bt', q[:, :, 0], k[:, :, 0]))[0]
    relative = rope.quarter_turn_logits(q[:, :, :, None], k, positions, positions)
    return dot, np.diagonal(np.asarray(relative)[0, :, 0, 0]), products
  (d0, s0, p0), (d1, s1, p1), (d2, s2, _) = scores(0), scores(1), scores(2)
  np.testing.assert_array_equal(np.sort(p0, axis=-1), np.sort(p1, axis=-1))  # same terms
  assert not np.array_equal(d0, d1)  # a dot: another order, other bits
  assert compare.sha256_bytes(s0) == compare.sha256_bytes(s1) == compare.sha256_bytes(s2)
  assert np.array_equal(d0, d2)
  np.testing.assert_allclose(s0, d0, rtol=1e-5, atol=1e-4)  # the same scores, rounded otherwise
  with pytest.raises(ValueError, match="'quarter_turn' RoPE mode needs attention in"):
    Engine(engines('quarter_turn')['standard'].loaded,
           EngineConfig(mode='pinned', attention='pallas'))


def test_float_rope_is_inexact_at_some_nonzero_offset():
  inexact = {}
  for offset in (1, 2, 3, 5, 7, 64, 1000):
    for method in shift.METHODS:
      r = row('float', method, offset)
      if not r['equal']:
        inexact.setdefault(method, []).append(offset)
    if set(inexact) == set(shift.METHODS):
      break
  assert set(inexact) == set(shift.METHODS), inexact


def test_float_rerotate_diverges_at_layer0_keys_and_pre_rope_after_layer0():
  r = row('float', 'rerotate', 5)
  assert not r['layers'][0]['k_equal'] and r['layers'][0]['v_equal']
  p = row('float', 'pre_rope', 5)
  assert p['layers'][0]['k_equal'] and p['layers'][0]['v_equal']
  assert p['first_differing_layer'] == 1
  # Rotating cached pre-RoPE keys at every read is the same function of the same numbers as
  # rotating new keys before the write: the pre-RoPE engine's fresh computation is the standard
  # engine's, bit for bit (so pre_rope's reference is the model's own fresh result).
  assert p['reference_equals_standard_fresh'] is True


def test_negative_offsets_graft_a_library_computed_past_zero():
  r = row('float', 'rerotate', -3)
  assert r['base_position'] == 16 and r['start_position'] == 13
  runs, skipped = ps.resolve_offsets(['-1', '-64', '-65', '0'], max_context=4096, library=10,
                                     query=2, negative_base=64)
  assert runs == [(-64, 64), (-1, 64), (0, 0)]
  assert [s['offset'] for s in skipped] == [-65] and '< 0' in skipped[0]['reason']


def test_offsets_past_the_context_are_skipped():
  runs, skipped = ps.resolve_offsets(['max', 'max-1', 'max+1', '5000', '7'], max_context=4096,
                                     library=10, query=2, negative_base=64)
  assert runs == [(7, 0), (4083, 0), (4084, 0)]  # max = 4096 - 10 - 2: last position 4095
  assert sorted(s['offset'] for s in skipped) == [4085, 5000]
  assert all('max_context' in s['reason'] for s in skipped)


def test_rerotate_by_zero_changes_at_most_the_sign_of_zeros():
  # x cos 0 - y sin 0 = -0.0 - (-0.0) = +0.0: a key element that is -0.0 (the embedded 270M
  # has whole key dimensions of zeros) can come back +0.0; every other element is unchanged.
  std = engines()['standard']
  seq, _ = std.prefill(tokens(LIBRARY), logits='none')
  rows = kvs.take_rows(seq.kv, 0, LIBRARY)
  k0 = rows.k[0].copy()
  k0[0, 0, :2], k0[0, 0, 8] = -0.0, -1.0  # pair 0: (-0, -1)
  rows = kvs.KVRows(rows.start, (k0,) + rows.k[1:], rows.v, rows.positions)
  (moved,) = shift.rerotate(std.model_config, [rows], 0)
  before, after = rows.k[0], moved.k[0]
  assert np.array_equal(before, after)  # as numbers
  flipped = np.signbit(before) != np.signbit(after)
  assert flipped[0, 0, 0] and np.all(before[flipped] == 0)
  for a, b, va, vb in zip(rows.k[1:], moved.k[1:], rows.v, moved.v):
    assert np.array_equal(a, b) and compare.sha256_bytes(va) == compare.sha256_bytes(vb)


def test_shifts_refuse_the_wrong_engine_and_out_of_range_positions():
  std, pre = engines()['standard'].model_config, engines()['pre_rope'].model_config
  seq, _ = engines()['standard'].prefill(tokens(LIBRARY), logits='none')
  rows = [kvs.take_rows(seq.kv, 0, LIBRARY)]
  with pytest.raises(shift.ShiftError, match='before RoPE'):
    shift.shift(pre, rows, 1, 'rerotate')
  with pytest.raises(shift.ShiftError, match='kv_cache_pre_rope'):
    shift.shift(std, rows, 1, 'pre_rope')
  with pytest.raises(shift.ShiftError, match='< 0'):
    shift.shift(std, rows, -1, 'rerotate')
  with pytest.raises(shift.ShiftError, match='context'):
    shift.shift(std, rows, 4096 - LIBRARY + 1, 'rerotate')


def test_entry_point_writes_the_documented_schema(tmp_path):
  output = tmp_path / 'sweep.json'
  result = subprocess.run(
      [sys.executable, '-m', 'experiments.position_sweep', '--model=tiny_gemma3',
       '--weights=random:0', '--library_tokens=12', '--query_tokens=3', '--rows_per_call=4',
       '--offsets=0,1,-1,max,max+1', '--rope=float', f'--output={output}'],
      cwd=REPO, env={**os.environ, 'PYTHONPATH': str(REPO)}, capture_output=True, text=True,
      timeout=900)
  assert result.returncode == 0, result.stderr[-3000:]
  assert 'skipping offset max+1' in result.stderr
  data = json.loads(output.read_text())
  config = data['config']
  for key in ('model', 'weights', 'dtype', 'rope', 'methods', 'offsets', 'skipped',
              'library_tokens', 'query_tokens', 'seed', 'block_size', 'cache_len',
              'engine_config', 'transformer_config', 'model_fingerprint', 'engine_fingerprint',
              'command', 'git_commit', 'git_base_commit', 'git_modified_files', 'made_on'):
    assert key in config, key
  assert data['schema'] == 'position_sweep/1'
  assert config['command'].startswith('python -m experiments.position_sweep --model=tiny_gemma3')
  assert config['offsets'] == [-1, 0, 1, 4096 - 15] and config['skipped'][0]['offset'] == 4082
  assert config['transformer_config']['rope_mode'] == 'float'
  rows = data['rows']
  assert len(rows) == 4 * len(shift.METHODS)
  for r in rows:
    for key in ('model', 'weights', 'dtype', 'rope', 'method', 'offset', 'equal', 'max_abs',
                'max_ulp', 'kl', 'argmax_agreement', 'top5_overlap', 'layers'):
      assert key in r, key
    assert len(r['layers']) == 7
    for layer in r['layers']:
      assert set(layer) >= {'layer', 'k_max_abs', 'v_max_abs', 'k_max_ulp', 'v_max_ulp',
                            'k_equal', 'v_equal'}
  own = [r for r in rows if r['offset'] == 0]
  assert all(r['equal'] for r in own)
  # The figures read it by its content, whatever the file is called.
  (tmp_path / 'results').mkdir()
  (tmp_path / 'results' / 'float.json').write_text(output.read_text())
  assert len(figures.position_sweep_rows(results.load(tmp_path / 'results'))) == len(rows)
