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


def _write_fixtures(results: pathlib.Path, *, sweeps=True, graft=True, rope=True,
                    store=True) -> None:
  results.mkdir(parents=True, exist_ok=True)
  if sweeps:
    for rope_mode in ('float', 'quarter_turn', 'none'):
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
  if rope:  # a real (tiny) rope_float analysis, computed here, not made up
    result = rope_float.analyze(max_position=256, dtypes=['float32'], offsets=[0, 1, 64],
                                grid_points=8, vectors=1)
    files.write_json(str(results / 'rope_float.json'),
                     {'schema': results_lib.tag('rope_float'), **result})


def _run_main(results: pathlib.Path, output: pathlib.Path) -> str:
  """Runs `python -m analysis.figures` as a researcher does; returns its log (stderr)."""
  out = subprocess.run([sys.executable, '-m', 'analysis.figures', f'--results={results}',
                        f'--output={output}'], cwd=REPO, capture_output=True, text=True,
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


def test_controls_figure_needs_a_control_next_to_float(tmp_path):
  results = tmp_path / 'results'
  _write_fixtures(results, graft=False, rope=False)
  for control in ('quarter_turn', 'none'):
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


if __name__ == '__main__':
  pytest.main([__file__])
