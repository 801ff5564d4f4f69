"""Context shift (graft/context_shift.py): a window that drops its oldest tokens when full.

Under relative RoPE the shifted cache and its next logits are SHA-256 equal to the kept states
placed directly at their final positions, after any number of shifts; under float RoPE
llama.cpp's K-shift (re-rotating cached keys in place) drifts from that placement, and the
placement itself is what the exact stream computes, bit for bit. On tiny_gemma3 (random:0) with
a window past its local layers' ring, so that the rings wrap while the window shifts.
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

from gemma_jax import kv_state as kvs
from gemma_jax import weights
from gemma_jax.compare import sha256_bytes
from gemma_jax.config import get_config
from graft import context_shift
from graft.engine import spec_check
from graft.engine import Context, EngineConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
WINDOW, DROP = 40, 3  # tiny_gemma3's local ring: 32 slots (window 8 + 16 rows - 1, in tiles)
CONFIG = EngineConfig(rows_per_call=16, attention_tile=16, cache_len=64)


@functools.lru_cache(maxsize=None)
def engines(rope: str) -> context_shift.Engines:
  loaded = weights.load(get_config('tiny_gemma3').replace(rope_mode=rope), 'random:0', 'float32')
  return context_shift.make_engines(loaded, CONFIG)


def tokens(n, seed=0):
  return [int(t) for t in np.random.default_rng(seed).integers(3, 512, n)]


@functools.lru_cache(maxsize=None)
def stream(rope: str, shifts: tuple[int, ...] = (1, 4, 19)):
  return context_shift.run(engines(rope), tokens(WINDOW + 5), window=WINDOW, drop=DROP,
                           measure_at=shifts, continuation=8)


def test_the_raw_key_stream_is_the_float_engine_and_the_interpreter():
  # The float stream caches keys before RoPE: its KV and logits are the written arithmetic's
  # (the interpreter's, with keys cached raw), its logits the float engine's, and its raw keys
  # turned by `turn` at their positions are the float engine's cached keys, bit for bit.
  pair = engines('float')
  assert pair.stream.model_config.kv_cache_pre_rope and not pair.model.model_config.kv_cache_pre_rope
  text = tokens(50, seed=1)
  summary = spec_check.run(pair.stream, text, [17])['summary']
  assert summary['kv_equal'] and summary['logits_equal'], summary
  raw, raw_logits = pair.stream.prefill(text, logits='all')
  rotated, logits = pair.model.prefill(text, logits='all')
  assert sha256_bytes(raw_logits) == sha256_bytes(logits)
  for layer_index, a, b in zip(pair.model.model_config.cache_layers, raw.kv.layers, rotated.kv.layers):
    held = np.asarray(a.positions[0]) != kvs.EMPTY
    positions = np.asarray(a.positions[0])[held]
    turned = context_shift.turn(pair.model, layer_index, np.asarray(a.k[0])[held], positions)
    assert sha256_bytes(turned) == sha256_bytes(np.asarray(b.k[0])[held]), layer_index
    assert not np.array_equal(np.asarray(a.k[0])[held], turned)  # raw keys are not rotated
  # Turning back by the same angles nearly undoes the turn, and not exactly: float drift.
  k = np.asarray(rotated.kv.layers[0].k[0])
  by = np.full(len(k), 5, np.int32)
  first = pair.model.model_config.cache_layers[0]
  back = context_shift.turn(pair.model, first, context_shift.turn(pair.model, first, k, by), by,
                            back=True)
  assert np.abs(back - k).max() < 1e-5 and not np.array_equal(back, k)


def test_relative_shifts_are_sha256_equal_to_placing_the_kept_states_directly():
  result = stream('relative')
  assert [m['shifts'] for m in result['measurements']] == [1, 4, 19]
  for m in result['measurements']:
    assert m['kv_equal'] and m['logits_equal'] and m['reference_equals_stream'], m
    assert m['kv_sha256'] == m['reference_kv_sha256']
    assert m['k_max_abs'] == 0.0 and m['kl'] == 0.0 and m['first_differing_token'] is None
    assert all(l['k_equal'] and l['v_equal'] for l in m['layers'])
  # After 19 shifts of 3 the 37 kept tokens were written over the last ceil(37 / 3) = 13 shifts.
  assert result['measurements'][-1]['most_turns'] == -(-(WINDOW - DROP) // DROP)


def test_float_k_shift_drifts_where_relative_stays_equal():
  # The same procedure, token for token: float's re-rotated keys leave the reference after the
  # first shift (its values, positions and the stream's logits stay the reference's), relative's
  # never do. A shift that forgot to re-rotate would be far off (max |ΔK| of order 1), not 1e-6.
  float_run, relative_run = stream('float'), stream('relative')
  for f, r in zip(float_run['measurements'], relative_run['measurements']):
    assert f['reference_equals_stream'], f
    assert not f['kv_equal'] and not f['logits_equal'], f
    assert 0 < f['k_max_abs'] < 1e-4 and 0 < f['kl'] < 1e-6, f
    assert all(l['v_equal'] for l in f['layers'])
    assert r['kv_equal'] and r['logits_equal']
  turns = [m['most_turns'] for m in float_run['measurements']]
  assert turns == [1, 4, 13]


def test_a_flipped_bit_in_the_shifted_cache_is_seen():
  # The relative comparison can fail: one key bit flipped after a shift breaks K and logits.
  pair = engines('relative')
  ctx, _ = pair.stream.prefill(tokens(WINDOW, seed=2))
  kept = context_shift.Kept(pair.model, llama=False)
  kept.write(ctx.kv, 0, WINDOW, 0)
  shifted = context_shift.drop_oldest(ctx, DROP)
  kept.shift(DROP)
  cache_layers = pair.model.model_config.cache_layers
  g = next(i for i, l in enumerate(cache_layers) if pair.model.model_config.layer_spec(l).window is None)
  layers = list(shifted.kv.layers)
  bits = np.asarray(layers[g].k).view(np.uint32).copy()
  # A global layer holds every kept token. The top fraction bit: the lowest one can vanish in the
  # score's rounding (it did under the seeded random:SEED weights), and then no logit moves.
  bits[0, 5, 0, 3] ^= 1 << 22
  layers[g] = layers[g].replace(k=jnp.asarray(bits.view(np.float32)))
  bad = Context(kv=shifted.kv.replace(layers=tuple(layers)), tokens=shifted.tokens,
                next_position=shifted.next_position)
  _, logits = pair.stream.extend(shifted, [7], logits='last')
  good = context_shift.measure(pair, shifted, kept, 7, logits[-1], 0)
  assert good['kv_equal'] and good['logits_equal']
  m = context_shift.measure(pair, bad, kept, 7, logits[-1], 0)
  assert not m['kv_equal'] and not m['layers'][g]['k_equal'] and m['layers'][0]['k_equal']
  assert not m['logits_equal']


def test_drop_oldest_and_run_refuse_bad_input():
  pair = engines('relative')
  ctx, _ = pair.stream.prefill(tokens(10))
  for drop in (0, 10, -1):
    with pytest.raises(ValueError, match='a shift drops'):
      context_shift.drop_oldest(ctx, drop)
  with pytest.raises(ValueError, match='--drop must be'):
    context_shift.run(pair, tokens(10), window=8, drop=8, measure_at=[1])
  with pytest.raises(ValueError, match='>= 1'):
    context_shift.run(pair, tokens(10), window=8, drop=2, measure_at=[0])
  loaded = weights.load(get_config('tiny_gemma3').replace(rope_mode='none'), 'random:0',
                        'float32')
  with pytest.raises(ValueError, match="'float' or 'relative'"):
    context_shift.make_engines(loaded, CONFIG)


def _experiment(tmp_path, *flags):
  return subprocess.run(
      [sys.executable, '-m', 'experiments.context_shift', '--model=tiny_gemma3',
       '--weights=random:0', '--rows_per_call=16', '--attention_tile=16', *flags],
      cwd=REPO, env={**os.environ, 'PYTHONPATH': str(REPO)}, capture_output=True, text=True,
      timeout=600)


def test_the_experiment_writes_its_result_and_refuses_bad_flags_in_one_line(tmp_path):
  output = tmp_path / 'shift.json'
  out = _experiment(tmp_path, '--rope=relative', '--window=20', '--drop=2', '--shifts=1,3',
                    '--continuation_tokens=2', f'--output={output}')
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(output.read_text())
  assert result['schema'] == 'context_shift/1' and result['summary']['exact']
  assert result['config']['window'] == 20 and result['config']['rope'] == 'relative'
  assert 'git_base_commit' in result['config']
  for flags, message in ((['--window=20', '--drop=20'], 'error: --drop=20 must be below'),
                         (['--shifts=1,x'], "error: flag --shifts=1,x: 'x' is not an integer")):
    out = _experiment(tmp_path, *flags, f'--output={tmp_path / "bad.json"}')
    errors = [line for line in out.stderr.splitlines() if line.startswith('error:')]
    assert out.returncode == 2 and len(errors) == 1 and errors[0].startswith(message), out.stderr
