"""Figures, drawn only from the JSON results in a results directory.

    python -m analysis.figures --results=results --output=figures

Every figure reads committed results files and nothing else: a figure whose input is absent is
skipped with a logged warning (never drawn from made-up data). Filenames are stable:

  position_exactness.png        (a) fraction of bit-equal results and KL against the offset δ,
                                    per method, from results/position_sweep_*_float.json
  layer_divergence.png          (b) per-layer K/V divergence (max abs, max ulp) of shifted grafts,
                                    one line per offset, from the same files
  rope_composition_error.png    (c) |R(δ)R(p)x - R(p+δ)x| against position, per frequency, from
                                    results/rope_float.json
  rope_angle_error.png              float32 angle error and spacing against position (rope_float)
  rope_composition_exactness.png    bit-exact fraction of re-rotation against δ (rope_float)
  position_controls.png         (d) float RoPE next to the controls (quarter_turn, none): max abs
                                    and KL against δ, from results/position_sweep_*.json
  graft_exactness.png           (e) equal samples out of all, per model/dtype/engine, from
                                    results/graft_exactness_*.json

The position-sweep and graft-exactness schemas are documented in the functions that read them.
"""

from __future__ import annotations

import collections
import json
import pathlib
from typing import Any, Callable, Iterable, Sequence

from absl import app
from absl import flags
from absl import logging
import matplotlib

matplotlib.use('Agg')  # files only, no display
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import matplotlib.ticker  # pylint: disable=g-import-not-at-top
import numpy as np

from analysis import rope_float

FIGURES = ('position_exactness', 'layer_divergence', 'rope_composition_error', 'rope_angle_error',
           'rope_composition_exactness', 'position_controls', 'graft_exactness')
METHOD_ORDER = ('rerotate', 'pre_rope', 'recompute')
ROPE_ORDER = ('float', 'quarter_turn', 'none')
ROPE_FLOAT_FILE = 'rope_float.json'
DPI = 120


# --------------------------------------------------------------------------------------------
# Reading results
# --------------------------------------------------------------------------------------------


def load_json(path: pathlib.Path) -> dict[str, Any] | None:
  """The parsed file, or None (with a warning) when it cannot be read as a JSON object."""
  try:
    data = json.loads(pathlib.Path(path).read_text())
  except (OSError, ValueError) as e:
    logging.warning('skipping %s: %s', path, e)
    return None
  if not isinstance(data, dict):
    logging.warning('skipping %s: not a JSON object', path)
    return None
  return data


def load_position_sweeps(results: pathlib.Path) -> list[dict[str, Any]]:
  """Rows of every results/position_sweep_<model>_<dtype>_<rope>.json, each row completed with
  the file's config where it lacks model/weights/dtype/rope. Schema (one row per method and
  offset, possibly several rows per pair when several samples were measured):
    {"config": {"model", "weights", "dtype", "rope", "methods", "offsets", ...},
     "rows": [{"model", "weights", "dtype", "rope", "method", "offset", "equal", "max_abs",
               "max_ulp", "kl", "argmax_agreement", "top5_overlap",
               "layers": [{"layer", "k_max_abs", "v_max_abs", "k_max_ulp", "v_max_ulp",
                           "k_equal", "v_equal"}]}]}"""
  rows = []
  for path in sorted(pathlib.Path(results).glob('position_sweep_*.json')):
    data = load_json(path)
    if data is None:
      continue
    config = data.get('config') or {}
    file_rows = data.get('rows')
    if not isinstance(file_rows, list):
      logging.warning('skipping %s: no "rows" list', path)
      continue
    for row in file_rows:
      if not isinstance(row, dict) or 'method' not in row or 'offset' not in row:
        logging.warning('%s: skipping a row without method/offset', path)
        continue
      full = {key: config.get(key) for key in ('model', 'weights', 'dtype', 'rope')}
      full.update(row)
      full['source'] = path.name
      rows.append(full)
  return rows


def load_graft_exactness(results: pathlib.Path) -> list[dict[str, Any]]:
  """Every results/graft_exactness_<model>_<dtype>[_<engine>][_<attention>].json:
    {"config": {"model", "weights", "dtype", "engine", "attention", ...},
     "samples": [{"library_tokens", "query_tokens", "fresh_sha256", "graft_sha256", "equal",
                  "kl", "argmax_agreement", "continuation_equal"}],
     "summary": {"samples", "equal", "max_kl", "argmax_agreement", "continuations_equal"}}
  returned as {"config", "samples" (count), "equal" (count), "max_kl", "source"}; counts come
  from the summary, or from the samples list when there is no summary."""
  found = []
  for path in sorted(pathlib.Path(results).glob('graft_exactness_*.json')):
    data = load_json(path)
    if data is None:
      continue
    summary = data.get('summary') or {}
    samples = data.get('samples') or []
    total = summary.get('samples', len(samples))
    equal = summary.get('equal', sum(bool(s.get('equal')) for s in samples))
    if not total:
      logging.warning('skipping %s: no samples', path)
      continue
    found.append({'config': data.get('config') or {}, 'samples': int(total), 'equal': int(equal),
                  'max_kl': summary.get('max_kl'), 'source': path.name})
  return found


def group_rows(rows: Iterable[dict[str, Any]], keys: Sequence[str]) -> dict[tuple, list[dict]]:
  groups: dict[tuple, list[dict]] = collections.OrderedDict()
  for row in sorted(rows, key=lambda r: tuple(str(r.get(k)) for k in keys)):
    groups.setdefault(tuple(row.get(k) for k in keys), []).append(row)
  return groups


def by_offset(rows: Sequence[dict[str, Any]], field: str,
              reduce: Callable) -> tuple[np.ndarray, np.ndarray]:
  """(offsets, reduce(values of `field`)) over the rows of each offset, offsets ascending;
  rows without the field (or with null) are left out."""
  values = collections.defaultdict(list)
  for row in rows:
    if row.get(field) is not None:
      values[int(row['offset'])].append(float(row[field]))
  offsets = np.array(sorted(values), np.int64)
  return offsets, np.array([reduce(values[o]) for o in offsets], np.float64)


def _methods(rows: Sequence[dict[str, Any]]) -> list[str]:
  present = {r['method'] for r in rows}
  return [m for m in METHOD_ORDER if m in present] + sorted(present - set(METHOD_ORDER))


def _label(model, weights, dtype) -> str:
  return f'{model} ({weights}) {dtype}' if weights else f'{model} {dtype}'


def _save(fig, path: pathlib.Path) -> pathlib.Path:
  path.parent.mkdir(parents=True, exist_ok=True)
  fig.savefig(path, dpi=DPI, bbox_inches='tight')
  plt.close(fig)
  logging.info('wrote %s', path)
  return path


def _symlog_offsets(ax) -> None:
  ax.set_xscale('symlog', linthresh=1)
  if not ax.dataLim.x0 < 0:  # no negative offsets drawn: no negative half
    ax.set_xlim(left=-0.3)
  ax.set_xlabel('offset δ (positions; symlog)')


def _symlog_y(ax, values: Iterable[float]) -> None:
  """symlog y whose linear region ends below the smallest positive value, so zeros (exact
  results) stay visible on the axis instead of vanishing from a log scale."""
  values = [v for v in values if np.isfinite(v)]
  positive = [v for v in values if v > 0]
  if not positive:  # everything exact: a linear axis around 0 says it plainly
    ax.set_ylim(-0.05, 1.0)
    ax.text(0.5, 0.5, 'all values 0 (exact)', transform=ax.transAxes, ha='center', color='gray')
    return
  ax.set_yscale('symlog', linthresh=min(positive) / 2)
  if all(v >= 0 for v in values):
    ax.set_ylim(bottom=0)


# --------------------------------------------------------------------------------------------
# (a) exactness and KL against the offset
# --------------------------------------------------------------------------------------------


def position_exactness(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> pathlib.Path | None:
  rows = [r for r in rows if r.get('rope') == 'float']
  if not rows:
    logging.warning('position_exactness: no position_sweep_*_float.json results; skipped')
    return None
  groups = group_rows(rows, ('model', 'weights', 'dtype'))
  fig, axes = plt.subplots(len(groups), 2, figsize=(11, 3.8 * len(groups)), squeeze=False,
                           layout='constrained')
  for (model, weights, dtype), group in zip(groups, groups.values()):
    ax_eq, ax_kl = axes[list(groups).index((model, weights, dtype))]
    kl_values = []
    for method in _methods(group):
      method_rows = [r for r in group if r['method'] == method]
      offsets, equal = by_offset(method_rows, 'equal', np.mean)
      ax_eq.plot(offsets, equal, 'o-', label=method)
      offsets, kl = by_offset(method_rows, 'kl', np.mean)
      ax_kl.plot(offsets, kl, 'o-', label=method)
      kl_values += list(kl)
    label = _label(model, weights, dtype)
    ax_eq.set_title(f'{label}, float RoPE: logits bit-equal to fresh', fontsize=9)
    ax_eq.set_ylabel('fraction equal (SHA-256)')
    ax_eq.set_ylim(-0.05, 1.05)
    ax_kl.set_title(f'{label}, float RoPE: KL(fresh || graft)', fontsize=9)
    ax_kl.set_ylabel('mean KL (nats; symlog)')
    _symlog_y(ax_kl, kl_values)
    for ax in (ax_eq, ax_kl):
      _symlog_offsets(ax)
      ax.grid(alpha=0.3)
      ax.legend(title='method')
  fig.suptitle('Shifted graft exactness against the offset δ (δ = 0 is own position)')
  return _save(fig, path)


# --------------------------------------------------------------------------------------------
# (b) per-layer K/V divergence
# --------------------------------------------------------------------------------------------


def _layer_curves(rows: Sequence[dict[str, Any]]) -> dict[int, dict[str, np.ndarray]]:
  """offset -> {'layer', 'k_max_abs', ...}: per-layer maxima over the rows of each offset."""
  per_offset: dict[int, dict[int, dict[str, float]]] = collections.defaultdict(dict)
  for row in rows:
    for entry in row.get('layers') or []:
      slot = per_offset[int(row['offset'])].setdefault(int(entry['layer']),
                                                       collections.defaultdict(float))
      for field in ('k_max_abs', 'v_max_abs', 'k_max_ulp', 'v_max_ulp'):
        slot[field] = max(slot[field], float(entry.get(field) or 0.0))
  curves = {}
  for offset in sorted(per_offset):
    layers = sorted(per_offset[offset])
    curves[offset] = {'layer': np.array(layers)}
    for field in ('k_max_abs', 'v_max_abs', 'k_max_ulp', 'v_max_ulp'):
      curves[offset][field] = np.array([per_offset[offset][l][field] for l in layers])
  return curves


def layer_divergence(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> pathlib.Path | None:
  rows = [r for r in rows if r.get('rope') == 'float' and r.get('layers')]
  if not rows:
    logging.warning('layer_divergence: no float-RoPE position-sweep rows with per-layer data; '
                    'skipped')
    return None
  panels = [(key + (method,), [r for r in group if r['method'] == method])
            for key, group in group_rows(rows, ('model', 'weights', 'dtype')).items()
            for method in _methods(group)]
  fig, axes = plt.subplots(len(panels), 2, figsize=(12, 3.8 * len(panels)), squeeze=False,
                           layout='constrained')
  for (model, weights, dtype, method), method_rows in panels:
    ax_abs, ax_ulp = axes[[p[0] for p in panels].index((model, weights, dtype, method))]
    curves = _layer_curves(method_rows)
    colors = plt.cm.viridis(np.linspace(0, 0.9, max(len(curves), 1)))
    for color, (offset, c) in zip(colors, curves.items()):
      for ax, unit in ((ax_abs, 'max_abs'), (ax_ulp, 'max_ulp')):
        ax.plot(c['layer'], c[f'k_{unit}'], '-', color=color, label=f'δ={offset} K')
        ax.plot(c['layer'], c[f'v_{unit}'], '--', color=color, label=f'δ={offset} V')
    for ax, unit, name in ((ax_abs, 'max_abs', 'max |graft - fresh|'),
                           (ax_ulp, 'max_ulp', 'max ulp distance')):
      _symlog_y(ax, [v for c in curves.values() for f in ('k_', 'v_') for v in c[f + unit]])
      ax.set_title(f'{_label(model, weights, dtype)}, {method}: {name}', fontsize=9)
      ax.set_xlabel('layer')
      ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
      ax.set_ylabel(f'{name} (symlog)')
      ax.grid(alpha=0.3)
    ax_ulp.legend(fontsize=6, ncol=2, title='solid K, dashed V', title_fontsize=7)
  fig.suptitle('Per-layer K/V divergence of shifted grafts from fresh computation')
  return _save(fig, path)


# --------------------------------------------------------------------------------------------
# (c) RoPE float analysis
# --------------------------------------------------------------------------------------------


def _rope_dtype(rope_result: dict[str, Any]) -> str | None:
  dtypes = rope_result.get('config', {}).get('dtypes') or []
  return 'float32' if 'float32' in dtypes else (dtypes[0] if dtypes else None)


def rope_composition_error(rope_result: dict[str, Any] | None, path: pathlib.Path,
                           offsets: Sequence[int] = (1, 1024)) -> pathlib.Path | None:
  """One row of panels per offset δ (those of `offsets` that rope_float.json has), one panel per
  layer type, one line per rotation pair."""
  if rope_result is None:
    logging.warning('rope_composition_error: no %s; skipped', ROPE_FLOAT_FILE)
    return None
  config, layers = rope_result.get('config', {}), rope_result.get('layer_types', {})
  dtype = _rope_dtype(rope_result)
  available = [int(d) for d in config.get('offsets', [])]
  chosen = [d for d in offsets if d in available and d != 0]
  if not chosen:
    chosen = [d for d in available if d != 0][:1]
    if chosen:
      logging.warning('rope_composition_error: offsets %s not in %s; using %d', list(offsets),
                      ROPE_FLOAT_FILE, chosen[0])
  if not chosen or not layers or dtype is None:
    logging.warning('rope_composition_error: %s has no nonzero offset; skipped', ROPE_FLOAT_FILE)
    return None
  positions = np.array(config['composition_positions'], np.float64)
  fig, axes = plt.subplots(len(chosen), len(layers), figsize=(4.2 * len(layers), 3.6 * len(chosen)),
                           squeeze=False, layout='constrained')
  for row, offset in zip(axes, chosen):
    for ax, (name, entry) in zip(row, layers.items()):
      stats = entry['composition'][dtype]['float'][str(offset)]
      values = []
      for i, curve in stats.get('curves', {}).items():
        ax.plot(positions, curve['max_abs'], '.-', label=f'pair {i}')
        values += curve['max_abs']
      spec = entry['spec']
      ax.set_xscale('log')
      _symlog_y(ax, values)
      ax.set_title(f'δ={offset}, {name} (θ={spec["base"]:g}, H={spec["head_dim"]}, '
                   f'scale={spec["scale"]:g}, rotary={spec["rotary_fraction"]:g})', fontsize=8)
      ax.set_xlabel('position p (log)')
      ax.grid(alpha=0.3)
      ax.legend(fontsize=6)
    row[0].set_ylabel('max |R(δ)R(p)x − R(p+δ)x| (symlog)')
  fig.suptitle(f'RoPE re-rotation error against position, {dtype} apply_rope '
               f'({config.get("execution", "jit")}), {config.get("vectors")} N(0,1) vectors')
  return _save(fig, path)


def rope_angle_error(rope_result: dict[str, Any] | None, path: pathlib.Path) -> pathlib.Path | None:
  if rope_result is None:
    logging.warning('rope_angle_error: no %s; skipped', ROPE_FLOAT_FILE)
    return None
  layers = rope_result.get('layer_types', {})
  if not layers:
    logging.warning('rope_angle_error: %s has no layer types; skipped', ROPE_FLOAT_FILE)
    return None
  fig, ax = plt.subplots(figsize=(8, 5), layout='constrained')
  values = []
  for name, entry in layers.items():
    angles = entry['angles']
    positions = np.array(angles['positions'], np.float64)
    (line,) = ax.plot(positions, angles['per_position']['max_abs_error'], '.-',
                      label=f'{name}: max |angle_f32 − angle_f64|')
    ax.plot(positions, angles['per_position']['float32_spacing_at_max_angle'], ':',
            color=line.get_color(), label=f'{name}: float32 spacing at the largest angle')
    values += angles['per_position']['max_abs_error']
  ax.set_xscale('symlog', linthresh=1)
  _symlog_y(ax, values)
  ax.set_xlabel('position p (symlog)')
  ax.set_ylabel('radians (symlog)')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=6)
  ax.set_title('float32 RoPE angle rounding against position (max over pairs)')
  return _save(fig, path)


def rope_composition_exactness(rope_result: dict[str, Any] | None,
                               path: pathlib.Path) -> pathlib.Path | None:
  if rope_result is None:
    logging.warning('rope_composition_exactness: no %s; skipped', ROPE_FLOAT_FILE)
    return None
  layers = rope_result.get('layer_types', {})
  if not layers:
    logging.warning('rope_composition_exactness: %s has no layer types; skipped', ROPE_FLOAT_FILE)
    return None
  fig, axes = plt.subplots(1, len(layers), figsize=(4.2 * len(layers), 3.8), squeeze=False,
                           sharey=True, layout='constrained')
  for ax, (name, entry) in zip(axes[0], layers.items()):
    for dtype, by_mode in entry['composition'].items():
      for mode, by_delta in by_mode.items():
        offsets = sorted(int(d) for d in by_delta)
        ax.plot(offsets, [by_delta[str(d)]['exact_fraction'] for d in offsets],
                'o-' if mode == 'float' else 's--', label=f'{dtype}, {mode}')
    _symlog_offsets(ax)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(name, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel('fraction of (p, pair) bit-exact')
  fig.suptitle('Re-rotation R(δ)R(p)x == R(p+δ)x bit for bit: fraction of positions and pairs')
  return _save(fig, path)


# --------------------------------------------------------------------------------------------
# (d) controls next to float RoPE
# --------------------------------------------------------------------------------------------


def position_controls(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> pathlib.Path | None:
  groups = {key: group for key, group in group_rows(rows, ('model', 'weights', 'dtype')).items()
            if len({r.get('rope') for r in group}) > 1}
  if not groups:
    logging.warning('position_controls: no model/dtype has position-sweep results for float RoPE '
                    'and a control (quarter_turn, none); skipped')
    return None
  ropes = [r for r in ROPE_ORDER if any(row.get('rope') == r for g in groups.values() for row in g)]
  ropes += sorted({row.get('rope') for g in groups.values() for row in g} - set(ropes), key=str)
  fig, axes = plt.subplots(2 * len(groups), len(ropes), squeeze=False, layout='constrained',
                           figsize=(4.4 * len(ropes), 3.4 * 2 * len(groups)))
  for g, ((model, weights, dtype), group) in enumerate(groups.items()):
    for row_index, (field, name, reduce) in enumerate((('max_abs', 'max |logit diff|', np.max),
                                                       ('kl', 'mean KL (nats)', np.mean))):
      row_axes = axes[2 * g + row_index]
      values = []
      for ax, rope_mode in zip(row_axes, ropes):
        rope_rows = [r for r in group if r.get('rope') == rope_mode]
        if not rope_rows:
          ax.set_title(f'{_label(model, weights, dtype)}, rope={rope_mode}: no results', fontsize=8)
          ax.axis('off')
          continue
        for method in _methods(rope_rows):
          offsets, v = by_offset([r for r in rope_rows if r['method'] == method], field, reduce)
          ax.plot(offsets, v, 'o-', label=method)
          values += list(v)
        ax.set_title(f'{_label(model, weights, dtype)}, rope={rope_mode}', fontsize=8)
        ax.set_ylabel(f'{name} (symlog)')
        _symlog_offsets(ax)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, title='method')
      for ax in row_axes:  # one y scale per row, so the panels compare
        if ax.axison:
          _symlog_y(ax, values)
          if values and max(values) > 0:
            ax.set_ylim(0, max(values) * 2)
  fig.suptitle('Shifted graft: float RoPE against the controls (quarter-turn table, no RoPE)')
  return _save(fig, path)


# --------------------------------------------------------------------------------------------
# (e) graft exactness summary
# --------------------------------------------------------------------------------------------


def graft_exactness(results: Sequence[dict[str, Any]], path: pathlib.Path) -> pathlib.Path | None:
  if not results:
    logging.warning('graft_exactness: no results/graft_exactness_*.json; skipped')
    return None
  labels, totals, equals = [], [], []
  for r in results:
    c = r['config']
    parts = [c.get('model'), c.get('weights'), c.get('dtype'), c.get('engine'), c.get('attention')]
    labels.append('\n'.join(str(p) for p in parts if p))
    totals.append(r['samples'])
    equals.append(r['equal'])
  x = np.arange(len(labels))
  fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(labels)), 4.5), layout='constrained')
  ax.bar(x, totals, color='lightgray', label='samples')
  ax.bar(x, equals, color='tab:green', label='graft == fresh (SHA-256 of logits)')
  for xi, e, t in zip(x, equals, totals):
    ax.text(xi, t, f'{e}/{t}', ha='center', va='bottom')
  ax.set_xticks(x, labels, fontsize=7)
  ax.set_ylabel('samples')
  ax.set_ylim(0, max(totals) * 1.15)
  ax.legend(loc='upper left', bbox_to_anchor=(1.0, 1.0), fontsize=8)
  ax.set_title('Own-position graft exactness: equal samples out of total, per model/dtype/engine')
  return _save(fig, path)


# --------------------------------------------------------------------------------------------
# Entry point
# --------------------------------------------------------------------------------------------


def draw_figures(results: str | pathlib.Path, output: str | pathlib.Path, *,
                 composition_offsets: Sequence[int] = (1, 1024)) -> dict[str, pathlib.Path | None]:
  """Draws every figure whose inputs exist in `results` into `output`; returns name -> path
  (None for a skipped figure)."""
  results, output = pathlib.Path(results), pathlib.Path(output)
  if not results.is_dir():
    logging.warning('results directory %s does not exist; no figures drawn', results)
  sweeps = load_position_sweeps(results)
  rope_path = results / ROPE_FLOAT_FILE
  rope_result = load_json(rope_path) if rope_path.exists() else None
  out = lambda name: output / f'{name}.png'
  drawn = {
      'position_exactness': position_exactness(sweeps, out('position_exactness')),
      'layer_divergence': layer_divergence(sweeps, out('layer_divergence')),
      'rope_composition_error': rope_composition_error(rope_result, out('rope_composition_error'),
                                                       composition_offsets),
      'rope_angle_error': rope_angle_error(rope_result, out('rope_angle_error')),
      'rope_composition_exactness': rope_composition_exactness(
          rope_result, out('rope_composition_exactness')),
      'position_controls': position_controls(sweeps, out('position_controls')),
      'graft_exactness': graft_exactness(load_graft_exactness(results), out('graft_exactness')),
  }
  if sweeps:  # the layer-by-layer account, next to figure (b)
    for s in rope_float.summarize_layer_propagation({'rows': sweeps}):
      if s['first_differing_layer'] is not None:
        logging.info('%s %s %s %s δ=%s: first differing layer %s, mean growth per layer %s',
                     s['model'], s['dtype'], s['rope'], s['method'], s['offset'],
                     s['first_differing_layer'], s['mean_growth_factor'])
  return drawn


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Defines the entry point's flags (from __main__ and tests; see rope_float.define_flags)."""
  def define(kind, name, default, help_text):
    if name not in FLAGS:
      getattr(flags, f'DEFINE_{kind}')(name, default, help=help_text)

  define('string', 'results', 'results', 'Directory holding the results JSON files.')
  define('string', 'output', 'figures', 'Directory to write the PNG figures into.')
  define('list', 'composition_offsets', ['1', '1024'], 'Offsets δ of the RoPE composition '
         'figure (one row each).')


def main(argv: Sequence[str]) -> None:
  del argv
  drawn = draw_figures(FLAGS.results, FLAGS.output,
                       composition_offsets=[int(d) for d in FLAGS.composition_offsets])
  for name, path in drawn.items():
    print(f'{name}: {path if path else "skipped (input missing)"}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
