"""analysis.figures draws every figure from results JSON files, and skips (without crashing) a
figure whose input is missing.

The results files written here are TEST FIXTURES: small synthetic values in the documented
schemas, made up to exercise the drawing code. They are written to a pytest tmp dir only and are
not measurements.
"""

import json
import os
import pathlib
import subprocess
import sys

import matplotlib.text
import pytest

from analysis import figures
from analysis import results as results_lib
from analysis import rope_float
from gemma_jax import files

REPO = pathlib.Path(__file__).resolve().parents[1]

OFFSETS = [0, 1, 7, 64, 1024]
METHODS = ['rerotate', 'pre_rope', 'recompute']


def _fixture_sweep_rows(model, dtype, rope_mode, num_layers=3):
  """Synthetic position-sweep rows: exact at δ = 0 (and for the controls), made-up growing
  divergence elsewhere."""
  rows = []
  for method in METHODS:
    for offset in OFFSETS:
      exact = offset == 0 or method == 'recompute' or rope_mode != 'float'
      scale = 0.0 if exact else 1e-3 * (1 + offset) ** 0.5
      layers = [{'layer': l, 'k_max_abs': scale * 2**l, 'v_max_abs': scale * 3**l,
                 'k_max_ulp': 10 * scale * 2**l, 'v_max_ulp': 10 * scale * 3**l,
                 'k_equal': exact or l == 0, 'v_equal': exact or l == 0}
                for l in range(num_layers)]
      rows.append({'model': model, 'weights': 'random', 'dtype': dtype, 'rope': rope_mode,
                   'method': method, 'offset': offset, 'equal': exact, 'max_abs': 10 * scale,
                   'max_ulp': 1e4 * scale, 'kl': scale / 10, 'argmax_agreement': 1.0 - scale,
                   'top5_overlap': 1.0, 'layers': layers})
  return rows


def _write(path: pathlib.Path, data, kind=None) -> None:
  """A results file; with `kind`, tagged with its schema as experiments write them."""
  if kind:
    data = {'schema': results_lib.tag(kind), **data}
  path.write_text(json.dumps(data))


BENCH_SKIP_REASON = 'llama-cpp-python is not installed: pip install -e ".[bench]"'
# The fixture's machine: 100 GFLOP/s and 10 GB/s; prefill costs 1e7 FLOP and decode reads 1e8
# bytes per token, so the ceilings are 1e4 and 100 tokens/s.
BENCH_CEILINGS = {'matmul_gflops': 100.0, 'read_gbps': 10.0}
BENCH_PREFILL_CEILING, BENCH_DECODE_CEILING = 1e4, 100.0


def _bench_row(name, prefill, decode, recompute, graft, split=None):
  """A measured row as experiments/bench.py writes it, fractions of the ceilings included."""
  row = {'name': name, 'skipped': None, 'prefill_tok_s': prefill, 'decode_tok_s': decode,
         'ttft_recompute_s': recompute, 'ttft_graft_s': graft,
         'prefill_fraction_of_matmul_ceiling': prefill * 1e7 / 1e9 / 100.0,
         'decode_fraction_of_read_ceiling': decode * 1e8 / 1e9 / 10.0}
  if split:
    row.update(ttft_graft_split_s=split, artifact_bytes=24_000_000, restore_gbps=4.0)
  return row


def _bench_fixture(*, per_token_costs=True):
  """A synthetic bench result in experiments/bench.py's shape: two of ours with the graft split,
  a measured peer without one, a skipped peer and a measured peer that cannot graft."""
  split = {'restore_s': 0.004, 'verify_s': 0.002, 'load_s': 0.007, 'graft_s': 0.001,
           'query_s': 0.012, 'total_s': 0.020}
  systems = [_bench_row('ours_pinned', 1500.0, 40.0, 1.5, 0.020, split),
             _bench_row('ours_default', 1800.0, 45.0, 1.4, 0.020, split),
             {**_bench_row('hf_transformers', 900.0, 20.0, 2.5, 0.3),
              'ttft_graft_note': 'DynamicCache deep-copied'},
             {'name': 'llama_cpp_q4_k_m', 'skipped': BENCH_SKIP_REASON, 'prefill_tok_s': None,
              'decode_tok_s': None, 'ttft_recompute_s': None, 'ttft_graft_s': None},
             _bench_row('deepmind_gemma', 700.0, 15.0, 3.0, None)]
  config = {'model': 'tiny_gemma3', 'weights': 'random', 'dtype': 'float32', 'fixture': True,
            'systems': [s['name'] for s in systems], 'prompt_tokens': 2000, 'decode_tokens': 32,
            'library_tokens': 2048, 'query_tokens': 64, 'repeats': 3,
            'environment': {'backend': 'cpu', 'device_kind': 'cpu'}}
  if per_token_costs:
    config.update(prefill_flops_per_token=1e7, decode_bytes_per_token=1e8)
  return {'config': config, 'ceilings': dict(BENCH_CEILINGS), 'systems': systems,
          'ratios': {'pinned_vs_default_prefill_tok_s': 1500 / 1800}}


def _flywheel_fixture() -> dict:
  """A made-up flywheel result in experiments/flywheel.py's shape: 3 recurring tasks (one
  solved without the library, all with it) and 2 held-out problems."""
  tasks = [{'id': f't{i}', 'split': 'recurring', 'base_correct': i == 0,
            'base_decode_tokens': 40 if i else 12, 'deposited': True, 'source': 'solutions',
            'library_correct': True, 'library_decode_tokens': 10, 'grafted_tokens': 30,
            'graft_exact': True} for i in range(3)]
  tasks += [{'id': f'h{i}', 'split': 'heldout', 'base_correct': False, 'base_decode_tokens': 40,
             'deposited': False, 'source': None, 'library_correct': i == 0,
             'library_decode_tokens': 20, 'grafted_tokens': 90, 'graft_exact': None}
            for i in range(2)]
  summary = {'base_accuracy': 1 / 3, 'recurring_accuracy': 1.0, 'heldout_base_accuracy': 0.0,
             'heldout_library_accuracy': 0.5, 'never_solved': 2, 'never_solved_answered': 2,
             'never_solved_base_tokens': 80, 'never_solved_library_decode_tokens': 20,
             'token_factor': 4.0, 'flops_factor': 6.5, 'energy_factor': 3.0,
             'graft_exact': True, 'graft_exact_checked': 3, 'graft_exact_equal': 3}
  return {'config': {'model': 'tiny_gemma3', 'weights': 'random', 'dtype': 'float32',
                     'task_set': 'arithmetic', 'budget': 40, 'attempts': 1, 'fixture': True},
          'tasks': tasks, 'summary': summary}


def _profile_fixture() -> dict:
  """A made-up profile result in experiments/profile.py's shape."""
  def phase(wall, dots):
    return {'wall_s': wall, 'thunk_s': wall * 0.9, 'outside_thunks_s': wall * 0.1,
            'dot_s': dots, 'dot_share': dots / (wall * 0.9),
            'by_component': [{'component': 'FeedForward.__call__ > Dense.__call__', 's': dots,
                              'share': 0.6},
                             {'component': 'RMSNorm.__call__ [kLoop]', 's': 0.1, 'share': 0.1}]}
  return {'config': {'engine_config': {'mode': 'spec'}, 'fixture': True},
          'ceilings': {'matmul_gflops': 100.0, 'read_gbps': 10.0},
          'prefill': {**phase(2.0, 1.4), 'fraction_of_matmul_ceiling': 0.6},
          'decode': {**phase(1.5, 1.2), 'fraction_of_read_ceiling': 0.75}}


def _context_shift_fixture(rope: str) -> dict:
  """A made-up context_shift result in experiments/context_shift.py's shape: drift growing
  with the shifts under float, none under relative."""
  rows = [{'shifts': n, 'most_turns': n, 'kv_equal': rope != 'float',
           'logits_equal': rope != 'float', 'reference_equals_stream': True,
           'k_max_abs': 1e-6 * n ** 0.5 if rope == 'float' else 0.0,
           'kl': 1e-12 * n if rope == 'float' else 0.0,
           'first_differing_token': 3 if rope == 'float' and n > 10 else None, 'layers': []}
          for n in (1, 10, 100)]
  return {'config': {'model': 'tiny_gemma3', 'weights': 'random', 'dtype': 'float32',
                     'rope': rope, 'window': 40, 'drop': 3, 'fixture': True},
          'summary': {'rope': rope, 'exact': rope != 'float'}, 'measurements': rows}


def _compose_fixture() -> dict:
  """A compose result of the shape experiments.compose writes (values made up, marked)."""
  def row(strategy, fraction):
    kl = 0.0 if fraction == 1.0 else 0.1 * (1 - fraction)
    return {'strategy': strategy, 'fraction': fraction, 'layer': 1, 'questions': 20,
            'correct': int(12 + 6 * fraction), 'accuracy': 0.6 + 0.3 * fraction,
            'ci95': [0.4 + 0.3 * fraction, 0.8 + 0.15 * fraction], 'kl_mean': kl,
            'kl_max': 2 * kl, 'top1_agreement': 1.0 - kl, 'logits_equal': 20 * (fraction == 1.0),
            'layers_by_type': {'local': {'k_rel_l2': kl, 'v_rel_l2': kl},
                               'global': {'k_rel_l2': 2 * kl, 'v_rel_l2': 2 * kl}}}
  modes = {}
  for mode in ('relative', 'float'):
    rows = [row('none', 0.0)] + [row(s, f) for s in ('cacheblend', 'epic', 'window')
                                 for f in (0.05, 0.3, 1.0)]
    modes[mode] = {'reference': {'questions': 20, 'accuracy': 0.9, 'ci95': [0.7, 0.97]},
                   'rows': rows, 'relocation': [],
                   'ttft': {'tokens': 600, 'document_lengths': [128] * 4, 'fresh_seconds': 2.0,
                            'rows': [{'strategy': r['strategy'], 'fraction': r['fraction'],
                                      'seconds': 0.2 + 1.8 * r['fraction']} for r in rows]}}
  return {'config': {'model': 'tiny_gemma3', 'weights': 'random', 'dtype': 'float32',
                     'documents': 4, 'lengths': [128], 'fixture': True},
          'modes': modes, 'summary': {'full_recompute_equal': True, 'relocation_exact': True}}


def _write_fixtures(results: pathlib.Path, *, sweeps=True, graft=True, rope=True,
                    store=True, bench=True, flywheel=True, profile=True, shift=True,
                    compose=True) -> None:
  results.mkdir(parents=True, exist_ok=True)
  if compose:
    _write(results / 'compose_tiny_gemma3_float32.json', _compose_fixture(), 'compose')
  for rope_mode in ('float', 'relative') if shift else ():
    _write(results / f'context_shift_tiny_gemma3_float32_{rope_mode}.json',
           _context_shift_fixture(rope_mode), 'context_shift')
  if sweeps:
    for rope_mode in ('float', 'relative', 'quarter_turn', 'none'):
      config = {'model': 'tiny_gemma3', 'weights': 'random', 'dtype': 'float32',
                'rope': rope_mode, 'methods': METHODS, 'offsets': OFFSETS, 'fixture': True}
      _write(results / f'position_sweep_tiny_gemma3_float32_{rope_mode}.json',
             {'config': config, 'rows': _fixture_sweep_rows('tiny_gemma3', 'float32', rope_mode)},
             'position_sweep')
  if graft:
    for engine, equal in (('pinned', 4), ('unpinned', 1)):
      samples = [{'library_tokens': 8, 'query_tokens': 4, 'fresh_sha256': 'a' * 64,
                  'graft_sha256': ('a' if i < equal else 'b') * 64, 'equal': i < equal,
                  'kl': 0.0 if i < equal else 1e-6, 'argmax_agreement': 1.0,
                  'continuation_equal': True} for i in range(4)]
      _write(results / f'graft_exactness_tiny_gemma3_float32_{engine}.json',
             {'config': {'model': 'tiny_gemma3', 'weights': 'random', 'dtype': 'float32',
                         'engine': engine, 'attention': 'xla', 'fixture': True},
              'samples': samples,
              'summary': {'samples': 4, 'equal': equal, 'max_kl': 1e-6,
                          'argmax_agreement': 1.0, 'continuations_equal': 4}},
             'graft_exactness')
  if store:
    summary = {'addressable_tokens': 51200, 'device_kv_tokens': 512, 'ratio': 100.0,
               'device_bytes_before': 2e6, 'device_bytes_after': 2e6, 'put_gbps': 0.5,
               'get_gbps': 0.8, 'disk_write_gbps': 1.0, 'disk_read_gbps': 1.1,
               'ttft_hit_host_s': 0.01, 'ttft_hit_backing_s': 0.02, 'ttft_miss_s': 0.2,
               'sampled': 4, 'sampled_equal': 4}
    _write(results / 'widen_context_tiny.json',
           {'config': {'model': 'tiny_gemma3', 'weights': 'random', 'dtype': 'float32',
                       'fixture': True}, 'summary': summary, 'queries': []}, 'widen_context')
    kinds = {k: {'trials': 10, 'exact': 3, 'refused': 7, 'reasons': {'x': 7}, 'silent_wrong': 0,
                 'lost': 0} for k in ('bitflip_data', 'truncate')}
    _write(results / 'faults_tiny.json',
           {'config': {'model': 'tiny_gemma3', 'weights': 'random', 'dtype': 'float32',
                       'fixture': True}, 'kinds': kinds,
            'summary': {'trials': 20, 'exact': 6, 'refused': 14, 'silent_wrong': 0,
                        'lost': 0}}, 'faults')
  if bench:
    _write(results / 'bench_tiny_gemma3_float32.json', _bench_fixture(), 'bench')
  if profile:
    _write(results / 'profile_tiny_gemma3_float32_spec.json', _profile_fixture(), 'profile')
  if flywheel:
    _write(results / 'flywheel_tiny_gemma3_float32_arithmetic.json', _flywheel_fixture(),
           'flywheel')
  if rope:  # a real (tiny) rope_float analysis, computed here, not made up
    result = rope_float.analyze(max_position=256, dtypes=['float32'], offsets=[0, 1, 64],
                                grid_points=8, vectors=1)
    files.write_json(str(results / 'rope_float.json'),
                     {'schema': results_lib.tag('rope_float'), **result})


def _run_main(results: pathlib.Path, output: pathlib.Path) -> str:
  """Runs `python -m analysis.figures` as a researcher does; returns its log (stderr)."""
  out = subprocess.run([sys.executable, '-m', 'analysis.figures', f'--results_dir={results}',
                        f'--output_dir={output}'], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, 'PYTHONPATH': str(REPO)}, timeout=600)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stderr


def test_main_writes_every_figure_as_a_nonempty_png(tmp_path):
  _write_fixtures(tmp_path / 'results')
  log = _run_main(tmp_path / 'results', tmp_path / 'figures')
  for figure in figures.FIGURES:
    png = tmp_path / 'figures' / f'{figure.name}.png'
    assert png.exists(), figure.name
    assert png.stat().st_size > 1000, figure.name
    assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n', figure.name
  # One line per figure, not one per result row.
  drawn_lines = [line for line in log.splitlines() if ': drawn from ' in line]
  assert len(drawn_lines) == len(figures.FIGURES)
  assert len(log.splitlines()) < 3 * len(figures.FIGURES)
  assert not [p for p in (tmp_path / 'figures').iterdir() if p.name.startswith('.')]


def test_missing_inputs_skip_their_figures_without_crashing(tmp_path, caplog):
  _write_fixtures(tmp_path / 'results', graft=False, rope=False)
  drawn = figures.draw_figures(tmp_path / 'results', tmp_path / 'figures')
  assert drawn['graft_exactness'] is None
  for name in ('rope_composition_error', 'rope_angle_error', 'rope_composition_exactness'):
    assert drawn[name] is None
    assert not (tmp_path / 'figures' / f'{name}.png').exists()
  assert drawn['position_exactness'].stat().st_size > 0
  assert 'graft_exactness: no graft-exactness results; skipped' in caplog.text


def test_empty_results_directory_draws_nothing(tmp_path):
  drawn = figures.draw_figures(tmp_path / 'absent', tmp_path / 'figures')
  assert set(drawn) == {figure.name for figure in figures.FIGURES}
  assert all(path is None for path in drawn.values())


def test_controls_figure_needs_another_mode_next_to_float(tmp_path):
  results = tmp_path / 'results'
  _write_fixtures(results, graft=False, rope=False)
  for control in ('relative', 'quarter_turn', 'none'):
    (results / f'position_sweep_tiny_gemma3_float32_{control}.json').unlink()
  drawn = figures.draw_figures(results, tmp_path / 'figures')
  assert drawn['position_controls'] is None
  assert drawn['layer_divergence'] is not None


def test_malformed_results_file_is_skipped(tmp_path):
  results = tmp_path / 'results'
  results.mkdir()
  (results / 'position_sweep_bad_float32_float.json').write_text('{not json')
  (results / 'graft_exactness_bad_float32.json').write_text('[1, 2]')
  drawn = figures.draw_figures(results, tmp_path / 'figures')
  assert all(path is None for path in drawn.values())


def test_sweep_rows_take_missing_fields_from_the_file_config(tmp_path):
  results = tmp_path / 'results'
  results.mkdir()
  rows = [{'method': 'rerotate', 'offset': 1, 'equal': False, 'kl': 0.5}]
  _write(results / 'position_sweep_m_float32_float.json',
         {'config': {'model': 'm', 'weights': 'w', 'dtype': 'float32', 'rope': 'float'},
          'rows': rows}, 'position_sweep')
  (row,) = figures.position_sweep_rows(results_lib.load(results))
  assert (row['model'], row['dtype'], row['rope'], row['kl']) == ('m', 'float32', 'float', 0.5)


def test_results_are_recognised_by_their_schema_not_their_file_name(tmp_path):
  results = tmp_path / 'results'
  results.mkdir()
  sweep = {'config': {'model': 'm', 'weights': 'w', 'dtype': 'float32', 'rope': 'float'},
           'rows': [{'method': 'rerotate', 'offset': 1, 'equal': False, 'kl': 0.5}]}
  _write(results / 'float.json', sweep, 'position_sweep')  # any name
  _write(results / 'position_sweep_untagged_float32_float.json', sweep)  # no schema: skipped
  _write(results / 'future.json', {**sweep, 'schema': 'position_sweep/99'})  # unknown version
  found = results_lib.load(results)
  assert [path.name for path, _ in found['position_sweep']] == ['float.json']
  drawn = figures.draw_figures(results, tmp_path / 'figures')
  assert drawn['position_exactness'] is not None


def _draw_bench_only(results: pathlib.Path, output: pathlib.Path, monkeypatch):
  """draw_figures over `results`; returns (drawn, the bench figure's matplotlib Figure or None)."""
  saved = {}
  save = figures.base.save

  def keep(fig, path):
    saved[path.name] = fig
    return save(fig, path)

  monkeypatch.setattr(figures.base, 'save', keep)
  drawn = figures.draw_figures(results, output)
  return drawn, saved.get('bench.png')


def _texts(fig) -> list[str]:
  """Every text of the figure (titles, labels, annotations, legend entries), whitespace folded."""
  return [' '.join(t.get_text().split()) for t in fig.findobj(matplotlib.text.Text)]


def _ceiling_lines(ax) -> list[float]:
  return [float(line.get_ydata()[0]) for line in ax.get_lines()
          if len(set(line.get_ydata())) == 1 and line.get_linestyle() == '--']


def test_bench_figure_draws_skipped_systems_ceilings_and_ttft(tmp_path, monkeypatch):
  results = tmp_path / 'results'
  _write_fixtures(results, sweeps=False, graft=False, rope=False, store=False, flywheel=False,
                  profile=False, shift=False, compose=False)
  drawn, fig = _draw_bench_only(results, tmp_path / 'figures', monkeypatch)
  png = tmp_path / 'figures' / 'bench.png'
  assert drawn['bench'] == png
  assert png.stat().st_size > 1000
  assert png.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert [name for name, path in drawn.items() if path] == ['bench']
  prefill, decode, ttft, split = fig.axes[:4]
  # Every system keeps its tick; the skipped one has no bar and its reason under its name.
  names = ['ours_pinned', 'ours_default', 'hf_transformers', 'llama_cpp_q4_k_m', 'deepmind_gemma']
  for ax in (prefill, decode, ttft):
    assert [t.get_text() for t in ax.get_xticklabels()] == names
  assert sorted(round(p.get_x() + p.get_width() / 2) for p in prefill.patches) == [0, 1, 2, 4]
  assert sorted(p.get_height() for p in prefill.patches) == [700.0, 900.0, 1500.0, 1800.0]
  assert sorted(p.get_height() for p in decode.patches) == [15.0, 20.0, 40.0, 45.0]
  assert 'skipped: ' + BENCH_SKIP_REASON in _texts(fig)
  # The ceilings in tokens/s, as experiments/bench.py's fractions imply: FLOP/s over FLOP/token,
  # bytes/s over bytes/token.
  assert _ceiling_lines(prefill) == pytest.approx([BENCH_PREFILL_CEILING])
  assert _ceiling_lines(decode) == pytest.approx([BENCH_DECODE_CEILING])
  # ours_pinned: 1500 of 1e4 tokens/s.
  assert '1,500 15% of ceiling' in [' '.join(t.get_text().split()) for t in prefill.texts]
  # TTFT: recompute and graft side by side (no graft bar for the peer that cannot graft), and
  # ours' graft split into phases summing to its total.
  assert sorted(p.get_height() for p in ttft.patches) == pytest.approx(
      [0.02, 0.02, 0.3, 1.4, 1.5, 2.5, 3.0])
  assert 'n/a' in [t.get_text() for t in ttft.texts]
  assert '75x' in [t.get_text() for t in ttft.texts]
  pinned = [p for p in split.patches if round(p.get_y() + p.get_height() / 2) == 0]
  assert len(pinned) == len(figures.GRAFT_PHASES)
  assert sum(p.get_width() for p in pinned) == pytest.approx(0.020)


def test_bench_ceiling_in_tokens_per_second(tmp_path):
  data = _bench_fixture()
  path = tmp_path / 'bench.json'
  rows = figures.bench_systems(path, data)
  assert figures.bench_ceiling_tok_s(data, rows, 'prefill')[0] == pytest.approx(1e4)
  assert figures.bench_ceiling_tok_s(data, rows, 'decode')[0] == pytest.approx(100.0)
  # Without the per-token costs in the config: from a measured row's fraction of the ceiling.
  data = _bench_fixture(per_token_costs=False)
  assert figures.bench_ceiling_tok_s(data, rows, 'prefill')[0] == pytest.approx(1e4)
  assert figures.bench_ceiling_tok_s(data, rows, 'decode')[0] == pytest.approx(100.0)
  # Without either, no ceiling, and why.
  for row in data['systems']:
    row.pop('prefill_fraction_of_matmul_ceiling', None)
  ceiling, why = figures.bench_ceiling_tok_s(data, figures.bench_systems(path, data), 'prefill')
  assert ceiling is None and 'prefill_flops_per_token' in why


def test_bench_figure_without_ceilings_still_draws(tmp_path, monkeypatch):
  results = tmp_path / 'results'
  results.mkdir()
  data = _bench_fixture(per_token_costs=False)
  for row in data['systems']:
    row.pop('prefill_fraction_of_matmul_ceiling', None)
    row.pop('decode_fraction_of_read_ceiling', None)
  _write(results / 'bench.json', data, 'bench')
  drawn, fig = _draw_bench_only(results, tmp_path / 'figures', monkeypatch)
  assert drawn['bench'].stat().st_size > 1000
  assert _ceiling_lines(fig.axes[0]) == [] and _ceiling_lines(fig.axes[1]) == []
  assert any('ceiling unknown' in t for t in _texts(fig))


def test_malformed_bench_results_are_skipped_with_a_reason(tmp_path, caplog):
  results = tmp_path / 'results'
  results.mkdir()
  good = _bench_fixture()
  (results / 'bench_not_json.json').write_text('{"schema": "bench/1", ')
  _write(results / 'bench_no_systems.json', {k: v for k, v in good.items() if k != 'systems'},
         'bench')  # lacks a field of the schema: not a bench result
  _write(results / 'bench_systems_not_a_list.json', {**good, 'systems': 'ours_pinned'}, 'bench')
  _write(results / 'bench_rows_without_names.json',
         {**good, 'systems': [{'prefill_tok_s': 1.0}, 'ours_pinned']}, 'bench')
  found = results_lib.load(results)
  assert [p.name for p, _ in found['bench']] == ['bench_rows_without_names.json',
                                                 'bench_systems_not_a_list.json']
  drawn = figures.draw_figures(results, tmp_path / 'figures')
  assert drawn['bench'] is None
  assert not (tmp_path / 'figures' / 'bench.png').exists()
  assert 'bench_systems_not_a_list.json: "systems" is not a list of rows' in caplog.text
  assert 'bench_rows_without_names.json: skipping a bench system row without a name' in caplog.text
  assert 'bench: no bench results with system rows; skipped' in caplog.text
  # A named row that lacks its numbers is drawn as 'n/a', not a crash.
  _write(results / 'bench_sparse.json', {**good, 'systems': [{'name': 'ours_pinned'}]}, 'bench')
  drawn = figures.draw_figures(results, tmp_path / 'figures')
  assert drawn['bench'].stat().st_size > 1000


if __name__ == '__main__':
  pytest.main([__file__])


def test_flywheel_figure_draws_accuracy_tokens_per_solved_and_factors(tmp_path):
  _write(tmp_path / 'flywheel.json', _flywheel_fixture(), 'flywheel')
  fig_path = figures.flywheel([(tmp_path / 'flywheel.json', _flywheel_fixture())],
                              tmp_path / 'flywheel.png')
  assert fig_path.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  assert figures.flywheel([], tmp_path / 'none.png') is None
  # Today's shape: rounds with the text baseline, and the paired interval in the title.
  current = _flywheel_fixture()
  current['config'].update(attempt_tokens=16)
  current['summary'].update(
      heldout_delta=0.5, heldout_delta_ci95=[0.0, 1.0], heldout_mcnemar_p=1.0,
      energy_method='CPU seconds of this process',
      accuracy_by_round=[{'round': 1, 'n': 2, 'base': 0.0, 'library': 0.5, 'text': 0.5},
                         {'round': 2, 'n': 2, 'base': 0.5, 'library': 1.0, 'text': 1.0}])
  assert figures.flywheel([(tmp_path / 'flywheel.json', current)],
                          tmp_path / 'rounds.png').read_bytes()[:4] == b'\x89PNG'
  assert figures.wilson(0.5, 0) == (0.0, 0.0)
  assert figures.wilson(0.5, 100) == pytest.approx((0.404, 0.596), abs=1e-3)
  tasks = _flywheel_fixture()['tasks']
  assert figures.decode_tokens_per_solved(tasks, 'base') == (12.0, 1)  # t0 only
  assert figures.decode_tokens_per_solved(tasks, 'library') == (12.5, 4)  # 3 x 10 and 20


# A two-column page's text block, width x height in inches: the limit is the page's, held here
# (not read from analysis.figures, which the test checks).
PAGE_INCHES = (7.0, 9.0)


def _png_size(path: pathlib.Path) -> tuple[int, int, int]:
  """(width, height) in pixels and the dots per inch the PNG records (its pHYs chunk)."""
  data = path.read_bytes()
  assert data[:8] == b'\x89PNG\r\n\x1a\n' and data[12:16] == b'IHDR', path
  width, height = int.from_bytes(data[16:20], 'big'), int.from_bytes(data[20:24], 'big')
  at = 8
  while at < len(data):
    length, kind = int.from_bytes(data[at:at + 4], 'big'), data[at + 4:at + 8]
    if kind == b'pHYs':
      per_metre, unit = int.from_bytes(data[at + 8:at + 12], 'big'), data[at + 16]
      assert unit == 1, (path, 'pHYs not in pixels per metre')
      return width, height, round(per_metre * 0.0254)
    if kind == b'IDAT':
      break
    at += 12 + length
  raise AssertionError(f'{path} records no resolution (pHYs), so no size in inches')


def test_every_figure_fits_a_two_column_page(tmp_path):
  # The committed figures, and the same drawn again from the committed results: at most
  # 7 x 9 inches at the resolution each PNG records; and analysis.figures refuses to draw one
  # larger, in either direction, while a figure of the whole page is drawn.
  committed = sorted((REPO / 'figures').glob('*.png'))
  drawn = [p for p in figures.draw_figures(REPO / 'results', tmp_path).values() if p]
  assert {p.name for p in committed} == {p.name for p in drawn}
  for png in committed + drawn:
    width, height, dpi = _png_size(png)
    assert width <= PAGE_INCHES[0] * dpi and height <= PAGE_INCHES[1] * dpi, (
        png, f'{width / dpi:.2f} x {height / dpi:.2f} in', PAGE_INCHES)
  page_width, page_height = PAGE_INCHES
  for size in ((page_width + 0.01, 3), (3, page_height + 0.01)):
    with pytest.raises(ValueError, match='larger than a two-column page'):
      figures.base.save(figures.base.plt.figure(figsize=size), tmp_path / 'too_large.png')
    figures.base.plt.close('all')
  whole = figures.base.save(figures.base.plt.figure(figsize=PAGE_INCHES), tmp_path / 'page.png')
  width, height, dpi = _png_size(whole)
  assert (width, height) == (round(page_width * dpi), round(page_height * dpi))


def test_no_two_labels_of_any_figure_overlap_or_run_off_the_page(tmp_path):
  """analysis.figures renders each figure and refuses one whose text labels (titles, ticks,
  annotations, legends, caption) overlap or cross its edge (every figure of the committed
  results is drawn so in test_every_figure_fits_a_two_column_page); a planted pair of
  overlapping labels and a label past the edge are refused."""
  plt = figures.base.plt
  fig, ax = plt.subplots(figsize=(3, 2), layout='constrained')
  ax.set_xlim(0, 1)
  ax.set_xticks([0.4, 0.5], ['llama_cpp_q4_k_m', 'llama_cpp_f32'])  # a tenth of 3 in apart
  with pytest.raises(ValueError, match='pairs of text labels overlap, e.g. "llama_cpp_q4_k_m" '
                     'and "llama_cpp_f32"'):
    figures.base.save(fig, tmp_path / 'overlap.png')
  fig, ax = plt.subplots(figsize=(3, 2), layout='constrained')
  fig.text(0.9, 0.5, 'a label that runs past the right edge of the figure', fontsize=7)
  with pytest.raises(ValueError, match="run past the figure's edge"):
    figures.base.save(fig, tmp_path / 'clipped.png')
  assert not (tmp_path / 'overlap.png').exists() and not (tmp_path / 'clipped.png').exists()


def _made_on(data: dict, cpu: str, commit: str | None = None) -> dict:
  return {**data, 'config': {**data['config'], 'made_on': {'cpu_model': cpu},
                             'git_commit': commit}}


def test_each_figure_is_drawn_from_one_machine_that_its_caption_names(tmp_path, monkeypatch):
  results = tmp_path / 'results'
  results.mkdir()
  sweep = lambda model: {'config': {'model': model, 'weights': 'w', 'dtype': 'float32',
                                    'rope': 'float'},
                         'rows': _fixture_sweep_rows(model, 'float32', 'float')}
  _write(results / 'a.json', _made_on(sweep('m1'), 'CPU/A'), 'position_sweep')
  _write(results / 'b.json', _made_on(sweep('m2'), 'CPU/A'), 'position_sweep')
  _write(results / 'c.json', _made_on(sweep('m3'), 'CPU/B'), 'position_sweep')
  found = results_lib.load(results)
  figure = next(f for f in figures.FIGURES if f.name == 'position_exactness')
  chosen, machine, caption = figures.choose(found, figure)
  assert machine == 'CPU/A' and [p.name for p, _ in chosen['position_sweep']] == ['a.json',
                                                                                  'b.json']
  assert caption == ('Drawn from results made on CPU/A (a.json, b.json); 1 of other machines '
                     'left out (--machine picks one).')
  chosen, machine, caption = figures.choose(found, figure, 'CPU/B')
  assert machine == 'CPU/B' and [p.name for p, _ in chosen['position_sweep']] == ['c.json']
  # The caption is on the figure: the one drawn, at the bottom.
  texts = []
  save = figures.base.save
  def keep(fig, path):
    written = save(fig, path)  # captions, checks and writes the figure
    texts.extend(t.get_text() for t in fig.findobj(matplotlib.text.Text))
    return written

  monkeypatch.setattr(figures.base, 'save', keep)
  drawn = figures.draw_figures(results, tmp_path / 'figures', only=['position_exactness'])
  assert list(drawn) == ['position_exactness'] and drawn['position_exactness'].exists()
  assert any('Drawn from results made on CPU/A (a.json, b.json)' in ' '.join(t.split())
             for t in texts)
  with pytest.raises(ValueError, match='no figure named nope'):
    figures.draw_figures(results, tmp_path / 'figures', only=['nope'])


def test_docs_figures_md_maps_every_figure_to_its_claim_and_results():
  from tests import figures_reference
  assert (REPO / 'docs' / 'figures.md').read_text() == figures_reference.render(), (
      'docs/figures.md is stale: python -m tests.figures_reference > docs/figures.md')
  claims = figures_reference.claims()
  assert all(figure.claim in claims for figure in figures.FIGURES)
