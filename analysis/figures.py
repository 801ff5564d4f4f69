"""Figures, drawn only from the JSON results in a results directory.

    python -m analysis.figures --results=results --output=figures

A result is recognised by its "schema" field (analysis/results.py), never by its file name.
Every figure reads those results and nothing else: a figure whose input is absent is skipped
with a logged warning (never drawn from made-up data), and each figure drawn logs one line.
`FIGURES` is the one list of figures: a new figure is one function and one entry there.
"""

from __future__ import annotations

import collections
import dataclasses
import math
import pathlib
import textwrap
from typing import Any, Callable, Iterable, Sequence

from absl import app
from absl import flags
from absl import logging
import matplotlib

matplotlib.use('Agg')  # files only, no display
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
import matplotlib.ticker  # pylint: disable=g-import-not-at-top
import numpy as np

from analysis import results as results_lib
from gemma_jax import files
from gemma_jax import rope

METHOD_ORDER = ('rerotate', 'pre_rope', 'recompute')  # graft/shift.py METHODS
ROPE_ORDER = tuple(rope.MODES)  # float first, then the controls
DPI = 120


# --------------------------------------------------------------------------------------------
# Reading results
# --------------------------------------------------------------------------------------------


Found = dict[str, list[tuple[pathlib.Path, dict]]]  # analysis.results.load


def position_sweep_rows(found: Found) -> list[dict[str, Any]]:
  """Rows of every position-sweep result, each completed with its file's config where it lacks
  model/weights/dtype/rope, and the file name under 'source'."""
  rows = []
  for path, data in found['position_sweep']:
    config = data.get('config') or {}
    for row in data['rows']:
      if not isinstance(row, dict) or 'method' not in row or 'offset' not in row:
        logging.warning('%s: skipping a row without method/offset', path)
        continue
      full = {key: config.get(key) for key in ('model', 'weights', 'dtype', 'rope')}
      full.update(row)
      full['source'] = path.name
      rows.append(full)
  return rows


def graft_exactness_results(found: Found) -> list[dict[str, Any]]:
  """Every graft-exactness result as {"config", "samples" (count), "equal" (count), "max_kl",
  "source"}."""
  out = []
  for path, data in found['graft_exactness']:
    summary = data['summary']
    if not summary.get('samples'):
      logging.warning('skipping %s: no samples', path)
      continue
    out.append({'config': data.get('config') or {}, 'samples': int(summary['samples']),
                'equal': int(summary['equal']), 'max_kl': summary.get('max_kl'),
                'source': path.name})
  return out


def rope_float_result(found: Found) -> dict[str, Any] | None:
  """The RoPE float analysis (the last file in name order when there are several)."""
  return found['rope_float'][-1][1] if found['rope_float'] else None


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
  files.write_atomic(str(path), lambda f: fig.savefig(f, format='png', dpi=DPI,
                                                      bbox_inches='tight'))
  plt.close(fig)
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
    logging.warning('position_exactness: no float-RoPE position-sweep results; skipped')
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
  """One row of panels per offset δ (those of `offsets` the rope_float result has), one panel per
  layer type, one line per rotation pair."""
  if rope_result is None:
    logging.warning('rope_composition_error: no rope_float result; skipped')
    return None
  config, layers = rope_result.get('config', {}), rope_result.get('layer_types', {})
  dtype = _rope_dtype(rope_result)
  available = [int(d) for d in config.get('offsets', [])]
  chosen = [d for d in offsets if d in available and d != 0]
  if not chosen:
    chosen = [d for d in available if d != 0][:1]
    if chosen:
      logging.warning('rope_composition_error: offsets %s not in the rope_float result; '
                      'using %d', list(offsets), chosen[0])
  if not chosen or not layers or dtype is None:
    logging.warning('rope_composition_error: the rope_float result has no nonzero offset; '
                    'skipped')
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
    logging.warning('rope_angle_error: no rope_float result; skipped')
    return None
  layers = rope_result.get('layer_types', {})
  if not layers:
    logging.warning('rope_angle_error: the rope_float result has no layer types; skipped')
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
    logging.warning('rope_composition_exactness: no rope_float result; skipped')
    return None
  layers = rope_result.get('layer_types', {})
  if not layers:
    logging.warning('rope_composition_exactness: the rope_float result has no layer types; '
                    'skipped')
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
    logging.warning('graft_exactness: no graft-exactness results; skipped')
    return None
  labels, totals, equals = [], [], []
  for r in results:
    c = r['config']
    parts = [c.get('model'), c.get('weights'), c.get('dtype'), c.get('engine'), c.get('attention'),
             'store' if c.get('source') == 'store' else None]
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


# --------------------------------------------------------------------------------------------
# (f) usable context from the store
# --------------------------------------------------------------------------------------------


def widen_context(found_results: Sequence[tuple[pathlib.Path, dict]],
                  path: pathlib.Path) -> pathlib.Path | None:
  """Per widening run: tokens the store can graft against the device cache's, store throughput
  against the raw disk, and time to first token by tier."""
  if not found_results:
    logging.warning('widen_context: no widen_context results; skipped')
    return None
  fig, axes = plt.subplots(len(found_results), 3, figsize=(14, 3.8 * len(found_results)),
                           squeeze=False, layout='constrained')
  for row, (_, data) in zip(axes, found_results):
    c, s = data['config'], data['summary']
    label = f"{c.get('model')} ({c.get('weights')}) {c.get('dtype')}"
    ax = row[0]
    ax.bar(['device KV\n(cache length)', 'store\n(addressable)'],
           [s['device_kv_tokens'], s['addressable_tokens']], color=['tab:gray', 'tab:green'])
    ax.set_yscale('log')
    ax.set_ylabel('tokens (log)')
    ax.set_title(f'{label}: {s["ratio"]:.0f}x the device cache; device bytes '
                 f'{s["device_bytes_before"] / 1e6:.0f} MB -> {s["device_bytes_after"] / 1e6:.0f} MB',
                 fontsize=8)
    ax = row[1]
    names = ['put', 'disk write', 'get', 'disk read']
    values = [s['put_gbps'], s.get('disk_write_gbps') or 0, s.get('get_gbps') or 0,
              s.get('disk_read_gbps') or 0]
    ax.bar(names, values, color=['tab:blue', 'tab:gray', 'tab:orange', 'tab:gray'])
    ax.set_ylabel('GB/s')
    ax.set_title(f'{label}: store throughput against the raw disk', fontsize=8)
    ax = row[2]
    tiers = [('host hit', s.get('ttft_hit_host_s')), ('backing hit', s.get('ttft_hit_backing_s')),
             ('miss (recompute)', s.get('ttft_miss_s'))]
    ax.bar([t for t, v in tiers], [v or 0 for _, v in tiers],
           color=['tab:green', 'tab:olive', 'tab:red'])
    ax.set_yscale('log')
    ax.set_ylabel('time to first token (s, log)')
    ax.set_title(f'{label}: {s["sampled_equal"]}/{s["sampled"]} sampled grafts SHA-256 equal '
                 'to fresh', fontsize=8)
  fig.suptitle('Usable context from the knowledge store, at a fixed device cache')
  return _save(fig, path)


# --------------------------------------------------------------------------------------------
# (g) the fault campaign
# --------------------------------------------------------------------------------------------


def faults(found_results: Sequence[tuple[pathlib.Path, dict]],
           path: pathlib.Path) -> pathlib.Path | None:
  """Per fault kind, the trials' outcomes stacked: exact, untouched (the fault missed what the
  reader used), refused and recomputed, silent-wrong, crashed (and the lost count in the
  label); one row per campaign, signed ones named."""
  if not found_results:
    logging.warning('faults: no faults results; skipped')
    return None
  fig, axes = plt.subplots(len(found_results), 1, squeeze=False, layout='constrained',
                           figsize=(12, 4.2 * len(found_results)))
  for (ax,), (_, data) in zip(axes, found_results):
    kinds = list(data['kinds'])
    outcomes = (('exact', 'tab:green'), ('untouched', 'tab:gray'), ('refused', 'tab:blue'),
                ('silent_wrong', 'tab:red'), ('crashed', 'black'))
    values = {o: np.array([data['kinds'][k].get(o, 0) for k in kinds]) for o, _ in outcomes}
    x = np.arange(len(kinds))
    bottom = np.zeros(len(kinds))
    for outcome, color in outcomes:
      ax.bar(x, values[outcome], bottom=bottom, color=color,
             label={'refused': 'refused and recomputed'}.get(outcome, outcome.replace('_', '-')))
      bottom += values[outcome]
    labels = [f"{k}\nlost {data['kinds'][k]['lost']}" for k in kinds]
    ax.set_xticks(x, labels, rotation=60, ha='right', fontsize=7)
    ax.set_ylabel('trials')
    s, c = data['summary'], data['config']
    ax.set_title(f"{c.get('model')} ({c.get('weights')}) {c.get('dtype')}"
                 f"{', signed writer, readers trusting only it' if c.get('signed') else ''}: "
                 f"{s['trials']} trials, {s['silent_wrong']} silent-wrong, "
                 f"{s.get('crashed', 0)} crashed, {s['lost']} lost", fontsize=9)
    ax.legend(fontsize=8)
  fig.suptitle('Fault campaign: every trial\'s answer against a fresh computation (SHA-256)')
  return _save(fig, path)


def wilson(p: float, n: int, z: float = 1.96) -> tuple[float, float]:
  """The Wilson score interval of a proportion p observed over n trials ((0, 0) for n = 0)."""
  if n == 0:
    return 0.0, 0.0
  center = (p + z * z / (2 * n)) / (1 + z * z / n)
  half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
  return center - half, center + half


def decode_tokens_per_solved(tasks: list[dict], phase: str) -> tuple[float, int]:
  """(mean decode tokens, count) over the flywheel rows `phase` ('base' or 'library') solved."""
  solved = [t[f'{phase}_decode_tokens'] for t in tasks
            if t.get(f'{phase}_correct') and t.get(f'{phase}_decode_tokens') is not None]
  return (sum(solved) / len(solved), len(solved)) if solved else (0.0, 0)


def flywheel(found_results: Sequence[tuple[pathlib.Path, dict]],
             path: pathlib.Path) -> pathlib.Path | None:
  """One row per flywheel run (a task family): accuracy without and with the library (recurring
  tasks, held-out problems, the second round's), decode tokens per solved problem, and the
  cost factors on the never-solved problems (token, FLOP, energy)."""
  if not found_results:
    logging.warning('flywheel: no flywheel results; skipped')
    return None
  fig, axes = plt.subplots(len(found_results), 3, squeeze=False, layout='constrained',
                           figsize=(14, 3.8 * len(found_results)))
  for row, (_, data) in zip(axes, found_results):
    s, c, tasks = data['summary'], data['config'], data['tasks']
    n_recurring = sum(t['split'] == 'recurring' for t in tasks)
    groups = [('recurring', s['base_accuracy'], s['recurring_accuracy'], None, n_recurring)]
    rounds = s.get('accuracy_by_round') or [
        {'round': r, 'base': s.get(f'heldout{p}_base_accuracy'),
         'library': s.get(f'heldout{p}_library_accuracy'), 'text': None,
         'n': sum(t['split'] == 'heldout' and t.get('round', 1) == r for t in tasks)}
        for r, p in ((1, ''), (2, '_round2')) if s.get(f'heldout{p}_base_accuracy') is not None]
    groups += [(f"held-out, round {r['round']}", r['base'], r['library'], r.get('text'), r['n'])
               for r in rounds]
    x = np.arange(len(groups))
    for offset, index, label, color in ((-0.27, 1, 'base', 'tab:gray'),
                                        (0, 2, 'library grafted', 'tab:green'),
                                        (0.27, 3, 'library as text', 'tab:olive')):
      values = np.array([100 * (g[index] or 0) for g in groups])
      low_high = np.array([wilson(g[index], g[4]) if g[index] is not None else (0, 0)
                           for g in groups]).T * 100
      bars = row[0].bar(x + offset, values, 0.27, color=color, label=label,
                        yerr=[np.maximum(0, values - low_high[0]),
                              np.maximum(0, low_high[1] - values)], capsize=2)
      row[0].bar_label(bars, labels=['' if g[index] is None else f'{100 * g[index]:.0f}%'
                                     for g in groups], fontsize=6)
    row[0].set_xticks(x, [g[0] for g in groups], fontsize=7)
    row[0].set_ylim(0, 110)
    row[0].set_ylabel('accuracy (%), 95% Wilson interval')
    row[0].legend(fontsize=7)
    per_attempt = (f"{c['attempt_tokens']} per attempt" if 'attempt_tokens' in c
                   else f"{c.get('attempts')} attempt(s)")
    ci = s.get('heldout_delta_ci95')
    row[0].set_title(f"{c.get('task_set') or c.get('tasks')}: {c.get('model')}, budget "
                     f"{c.get('budget')} tokens ({per_attempt})"
                     + (f"; held-out delta {s['heldout_delta']:+.2f} [{ci[0]:+.2f}, {ci[1]:+.2f}]"
                        f", McNemar p {s['heldout_mcnemar_p']:.2g}" if ci else ''), fontsize=8)

    for i, phase in enumerate(('base', 'library')):
      mean, count = decode_tokens_per_solved(tasks, phase)
      bars = row[1].bar([i], [mean], color=('tab:gray', 'tab:green')[i])
      row[1].bar_label(bars, labels=[f'{mean:.1f}\n({count} solved)'], fontsize=7)
    row[1].set_xticks([0, 1], ['base', 'library grafted'])
    row[1].set_ylabel('decode tokens per solved problem')
    row[1].set_ylim(bottom=0)
    energy = ('energy (RAPL)' if s.get('energy_method', '').startswith('RAPL') else
              'energy (CPU s)' if s.get('energy_method', '').startswith('CPU') else
              'energy (wall time)')
    factors = [('tokens', s.get('token_factor')), ('FLOPs', s.get('flops_factor')),
               (energy, s.get('energy_factor'))]
    bars = row[2].bar(range(3), [f or 0 for _, f in factors], color='tab:purple')
    row[2].bar_label(bars, labels=['n/a' if f is None else f'{f:.3g}x' for _, f in factors],
                     fontsize=7)
    row[2].set_xticks(range(3), [n for n, _ in factors])
    row[2].axhline(1.0, color='black', lw=0.8, ls='--')
    row[2].set_ylabel('base / library, never-solved problems')
    row[2].set_title(f"{s['never_solved_answered']}/{s['never_solved']} never solved answered; "
                     f"grafts exact {s.get('graft_exact_equal')}/{s.get('graft_exact_checked')}",
                     fontsize=9)
  fig.suptitle('Verified-knowledge flywheel: verify once, deposit as KV, graft on recurrence')
  return _save(fig, path)


# --------------------------------------------------------------------------------------------
# (h) the benchmark: our engines and the peers, against the machine's ceilings
# --------------------------------------------------------------------------------------------


# The graft's time to first token in experiments/bench.py's `ttft_graft_split_s`: restore (read)
# and verify (hash) are inside load_s; what else load_s holds is drawn as 'load, other'.
GRAFT_PHASES = (('restore_s', 'restore (read)', 'tab:blue'),
                ('verify_s', 'verify (hash)', 'tab:cyan'),
                ('load_other_s', 'load, other', 'tab:gray'),
                ('graft_s', 'graft (into the cache)', 'tab:olive'),
                ('query_s', 'query compute', 'tab:orange'))


def bench_systems(path: pathlib.Path, data: dict) -> list[dict[str, Any]]:
  """The system rows of one bench result that can be drawn (a row without a name is left out
  with a logged warning; a measured row's missing numbers are drawn as 'n/a')."""
  if not isinstance(data['systems'], list):
    logging.warning('%s: "systems" is not a list of rows; left out', path)
    return []
  rows = []
  for row in data['systems']:
    if not isinstance(row, dict) or not row.get('name'):
      logging.warning('%s: skipping a bench system row without a name', path)
      continue
    rows.append(row)
  return rows


def bench_ceiling_tok_s(data: dict, rows: Sequence[dict[str, Any]],
                        phase: str) -> tuple[float | None, str]:
  """The machine's ceiling for `phase` ('prefill' or 'decode') in tokens/s, and how it follows
  from what experiments/bench.py records: prefill at the matmul ceiling's FLOP/s over the
  prompt's FLOPs per token, decode at the read ceiling's bytes/s over the weight bytes each token
  reads. Where the per-token cost is not in the config, it comes from a row's fraction of the
  ceiling (tok/s over fraction); (None, why) when neither is there."""
  limit, per_token, fraction, unit = {
      'prefill': ('matmul_gflops', 'prefill_flops_per_token',
                  'prefill_fraction_of_matmul_ceiling', 'GFLOP/s'),
      'decode': ('read_gbps', 'decode_bytes_per_token', 'decode_fraction_of_read_ceiling',
                 'GB/s')}[phase]
  ceilings, config = data.get('ceilings'), data.get('config')
  ceiling = ceilings.get(limit) if isinstance(ceilings, dict) else None
  if not ceiling:
    return None, f'no {limit} ceiling recorded'
  cost = config.get(per_token) if isinstance(config, dict) else None
  if cost:
    what = 'FLOP' if phase == 'prefill' else 'B'
    return ceiling * 1e9 / cost, f'{ceiling:.3g} {unit} / {cost:.3g} {what} per token'
  for row in rows:
    if not row.get('skipped') and row.get(fraction) and row.get(f'{phase}_tok_s'):
      return row[f'{phase}_tok_s'] / row[fraction], f'{ceiling:.3g} {unit}, from {row["name"]}'
  return None, f'no {per_token} recorded'


def _value(row: dict[str, Any], field: str) -> float | None:
  """A measured row's positive number in `field` (None: skipped, absent, null or not a number)."""
  value = None if row.get('skipped') else row.get(field)
  if not isinstance(value, (int, float)) or isinstance(value, bool):
    return None
  return float(value) if np.isfinite(value) and value > 0 else None


def _system_ticks(ax, rows: Sequence[dict[str, Any]]) -> None:
  """One tick per system; under a skipped system's name, why it was skipped, small."""
  x = np.arange(len(rows))
  ax.set_xticks(x, [r['name'] for r in rows], fontsize=8)
  ax.set_xlim(-0.6, len(rows) - 0.4)
  for xi, row in zip(x, rows):
    if row.get('skipped'):
      ax.annotate('skipped: ' + textwrap.fill(str(row['skipped']), 28), (xi, 0),
                  xycoords=('data', 'axes fraction'), xytext=(0, -16), textcoords='offset points',
                  ha='center', va='top', fontsize=5.5, color='dimgray')
      ax.text(xi, 0.03, 'skipped', transform=ax.get_xaxis_transform(), rotation=90,
              ha='center', va='bottom', fontsize=7, color='gray')


def _fmt(value: float) -> str:
  return f'{value:,.0f}' if value >= 100 else f'{value:.3g}'


def _na(ax, x: float) -> None:
  ax.text(x, 0.03, 'n/a', transform=ax.get_xaxis_transform(), ha='center', va='bottom',
          fontsize=7, color='gray')


def _log_y(ax, values: Iterable[float | None]) -> None:
  values = [v for v in values if v]
  if values:
    ax.set_yscale('log')
    ax.set_ylim(min(values) / 4, max(values) * 4)


def _bench_throughput(ax, data: dict, rows: Sequence[dict[str, Any]], phase: str,
                      color: str) -> None:
  field = f'{phase}_tok_s'
  fraction = {'prefill': 'prefill_fraction_of_matmul_ceiling',
              'decode': 'decode_fraction_of_read_ceiling'}[phase]
  ceiling, how = bench_ceiling_tok_s(data, rows, phase)
  values = [_value(r, field) for r in rows]
  for xi, (row, value) in enumerate(zip(rows, values)):
    if value is None:
      if not row.get('skipped'):
        _na(ax, xi)
      continue
    ax.bar(xi, value, color=color, width=0.6)
    share = row.get(fraction) if row.get(fraction) is not None else (
        value / ceiling if ceiling else None)
    ax.text(xi, value, _fmt(value) + (f'\n{100 * share:.2g}% of ceiling' if share else ''),
            ha='center', va='bottom', fontsize=7)
  ceiling_name = 'matmul' if phase == 'prefill' else 'read bandwidth'
  if ceiling:
    ax.axhline(ceiling, color='black', linestyle='--', linewidth=1,
               label=f'{ceiling_name} ceiling {_fmt(ceiling)} tok/s ({how})')
    ax.legend(fontsize=7, loc='upper right')
  else:
    logging.warning('bench: no %s ceiling in tokens/s (%s); drawn without it', phase, how)
  _log_y(ax, values + [ceiling])
  _system_ticks(ax, rows)
  ax.set_ylabel(f'{phase} tokens/s (log)')
  ax.grid(alpha=0.3, axis='y')
  c = data['config'] if isinstance(data['config'], dict) else {}
  detail = (f"{c.get('prompt_tokens')}-token prompt" if phase == 'prefill' else
            f"{c.get('decode_tokens')} greedy steps, one token per call")
  ax.set_title(f'{phase}: {detail}' + ('' if ceiling else f' (ceiling unknown: {how})'),
               fontsize=9)


def _bench_ttft(ax, data: dict, rows: Sequence[dict[str, Any]]) -> None:
  width = 0.38
  values = []
  for xi, row in enumerate(rows):
    for shift, field, color, name in ((-width / 2, 'ttft_recompute_s', 'tab:red', 'recompute'),
                                      (width / 2, 'ttft_graft_s', 'tab:green', 'graft')):
      value = _value(row, field)
      values.append(value)
      if value is None:
        if not row.get('skipped'):
          _na(ax, xi + shift)
        continue
      ax.bar(xi + shift, value, width=width, color=color,
             label=name if name not in ax.get_legend_handles_labels()[1] else None)
      ax.text(xi + shift, value, f'{value:.3g} s', ha='center', va='bottom', fontsize=7)
    recompute, graft = _value(row, 'ttft_recompute_s'), _value(row, 'ttft_graft_s')
    if recompute and graft:
      ax.text(xi, 0.97, f'{recompute / graft:.3g}x', transform=ax.get_xaxis_transform(),
              ha='center', va='top', fontsize=8, fontweight='bold')
  _log_y(ax, values)
  _system_ticks(ax, rows)
  ax.set_ylabel('time to first token (s, log)')
  ax.grid(alpha=0.3, axis='y')
  if ax.get_legend_handles_labels()[1]:
    ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.0, 1.0))
  c = data['config'] if isinstance(data['config'], dict) else {}
  ax.set_title(f"time to first token: {c.get('library_tokens')}-token library + "
               f"{c.get('query_tokens')}-token query, recomputed vs grafted from its saved KV "
               '(speedup on top)', fontsize=9)


def _bench_graft_split(ax, data: dict, rows: Sequence[dict[str, Any]]) -> bool:
  """The graft's time to first token split into its phases, for the systems that record it
  (horizontal stacked bars, linear seconds); False when none does."""
  split_rows = [r for r in rows if not r.get('skipped') and isinstance(r.get('ttft_graft_split_s'),
                                                                       dict)]
  if not split_rows:
    ax.axis('off')
    return False
  for y, row in enumerate(split_rows):
    split = row['ttft_graft_split_s']
    phases = dict(split)
    phases['load_other_s'] = max(0.0, (split.get('load_s') or 0.0) - (split.get('restore_s') or 0.0)
                                 - (split.get('verify_s') or 0.0))
    left = 0.0
    for key, name, color in GRAFT_PHASES:
      seconds = float(phases.get(key) or 0.0)
      ax.barh(y, seconds, left=left, color=color, height=0.6, label=name if y == 0 else None)
      left += seconds
    extra = f", restore {row['restore_gbps']:.3g} GB/s" if row.get('restore_gbps') else ''
    ax.text(left, y, f' {left * 1e3:.3g} ms{extra}', va='center', fontsize=7)
  ax.set_yticks(range(len(split_rows)), [r['name'] for r in split_rows], fontsize=8)
  ax.invert_yaxis()
  ax.margins(x=0.25)
  ax.set_xlabel('seconds')
  ax.grid(alpha=0.3, axis='x')
  ax.legend(fontsize=7, loc='upper left', bbox_to_anchor=(1.0, 1.0))
  ax.set_title('graft time to first token, by phase (medians of each phase)', fontsize=9)
  return True


def bench(found_results: Sequence[tuple[pathlib.Path, dict]],
          path: pathlib.Path) -> pathlib.Path | None:
  """Per bench result: prefill and decode tokens/s per system with the machine's ceiling in
  tokens/s as a line, time to first token recomputed vs grafted, and the graft's phases. A
  skipped system keeps its place, with no bar and its reason under its name."""
  drawable = []
  for source, data in found_results:
    rows = bench_systems(source, data)
    if rows:
      drawable.append((source, data, rows))
    else:
      logging.warning('%s: no bench system rows; left out', source)
  if not drawable:
    logging.warning('bench: no bench results with system rows; skipped')
    return None
  panels = 4
  width = max(9.0, 1.6 * max(len(rows) for _, _, rows in drawable))
  fig, axes = plt.subplots(panels * len(drawable), 1, squeeze=False, layout='constrained',
                           figsize=(width, 3.6 * panels * len(drawable)))
  for i, (_, data, rows) in enumerate(drawable):
    ax_prefill, ax_decode, ax_ttft, ax_split = axes[panels * i:panels * (i + 1), 0]
    c = data['config'] if isinstance(data['config'], dict) else {}
    limits = data['ceilings'] if isinstance(data['ceilings'], dict) else {}
    environment = c.get('environment') or {}
    _bench_throughput(ax_prefill, data, rows, 'prefill', 'tab:blue')
    _bench_throughput(ax_decode, data, rows, 'decode', 'tab:purple')
    _bench_ttft(ax_ttft, data, rows)
    _bench_graft_split(ax_split, data, rows)
    machine = ', '.join(dict.fromkeys(str(v) for v in (environment.get('backend'),
                                                       environment.get('device_kind')) if v))
    ax_prefill.set_title(
        f"{_label(c.get('model'), c.get('weights'), c.get('dtype'))}"
        f"{' on ' + machine if machine else ''}, medians of {c.get('repeats')} runs; "
        f"ceilings {limits.get('matmul_gflops', float('nan')):.3g} GFLOP/s matmul, "
        f"{limits.get('read_gbps', float('nan')):.3g} GB/s read\n" + ax_prefill.get_title(),
        fontsize=9)
  fig.suptitle('Benchmark: this project\'s engines and the peers on the same weights, against '
               'the machine\'s ceilings')
  return _save(fig, path)


@dataclasses.dataclass(frozen=True)
class Figure:
  """A figure: the result kinds it reads, how it picks its input from them, how it draws."""

  name: str
  kinds: tuple[str, ...]
  inputs: Callable[[Found, dict], Any]  # (results by kind, options) -> the draw function's input
  draw: Callable[..., pathlib.Path | None]  # (input, path) -> path, or None when skipped


def profile(found_results: Sequence[tuple[pathlib.Path, dict]],
            path: pathlib.Path) -> pathlib.Path | None:
  """Where prefill and decode spend their time (experiments.profile): per engine and phase, the
  seconds of the largest parts (dots by the model code or weight they serve, other thunks by
  code and kind) and of the wall time outside thunks."""
  if not found_results:
    logging.warning('profile: no profile results; skipped')
    return None
  phases = ('prefill', 'decode')
  fig, axes = plt.subplots(len(found_results), len(phases), squeeze=False, layout='constrained',
                           figsize=(14, 3.6 * len(found_results)))
  for row, (_, data) in zip(axes, found_results):
    engine = data['config'].get('engine_config', {}).get('mode', '?')
    for ax, phase in zip(row, phases):
      summary = data[phase]
      parts = [(r['component'], r['s']) for r in summary['by_component'][:8]]
      parts.append(('outside thunks (dispatch, host)', summary['outside_thunks_s']))
      labels, seconds = zip(*reversed(parts))
      colors = ['tab:gray' if label.startswith('outside') else
                'tab:orange' if label.endswith(']') else 'tab:blue' for label in labels]
      ax.barh(np.arange(len(labels)), seconds, color=colors)
      ax.set_yticks(np.arange(len(labels)), labels, fontsize=7)
      ax.set_xlabel('seconds')
      ceiling = summary.get('fraction_of_matmul_ceiling', summary.get('fraction_of_read_ceiling'))
      ax.set_title(f"{engine}, {phase}: {summary['wall_s']:.2f} s wall, dots "
                   f"{summary['dot_share']:.0%} of thunk time"
                   + (f', {ceiling:.0%} of the ceiling' if ceiling else ''), fontsize=9)
  fig.suptitle('Where the time goes (blue: dots, orange: other thunks [kind], gray: outside '
               'thunks)')
  return _save(fig, path)


FIGURES: tuple[Figure, ...] = (
    Figure('position_exactness', ('position_sweep',),
           lambda found, _: position_sweep_rows(found), position_exactness),
    Figure('layer_divergence', ('position_sweep',),
           lambda found, _: position_sweep_rows(found), layer_divergence),
    Figure('rope_composition_error', ('rope_float',),
           lambda found, options: (rope_float_result(found), options['composition_offsets']),
           lambda inputs, path: rope_composition_error(inputs[0], path, inputs[1])),
    Figure('rope_angle_error', ('rope_float',),
           lambda found, _: rope_float_result(found), rope_angle_error),
    Figure('rope_composition_exactness', ('rope_float',),
           lambda found, _: rope_float_result(found), rope_composition_exactness),
    Figure('position_controls', ('position_sweep',),
           lambda found, _: position_sweep_rows(found), position_controls),
    Figure('graft_exactness', ('graft_exactness',),
           lambda found, _: graft_exactness_results(found), graft_exactness),
    Figure('widen_context', ('widen_context',), lambda found, _: found['widen_context'],
           widen_context),
    Figure('faults', ('faults',), lambda found, _: found['faults'], faults),
    Figure('bench', ('bench',), lambda found, _: found['bench'], bench),
    Figure('flywheel', ('flywheel',), lambda found, _: found['flywheel'], flywheel),
    Figure('profile', ('profile',), lambda found, _: found['profile'], profile),
)


def draw_figures(results: str | pathlib.Path, output: str | pathlib.Path, *,
                 composition_offsets: Sequence[int] = (1, 1024)) -> dict[str, pathlib.Path | None]:
  """Draws every figure whose inputs exist in `results` into `output`; returns name -> path
  (None for a skipped figure). Logs one line per figure."""
  found = results_lib.load(results)
  options = {'composition_offsets': tuple(composition_offsets)}
  drawn = {}
  for figure in FIGURES:
    path = pathlib.Path(output) / f'{figure.name}.png'
    drawn[figure.name] = figure.draw(figure.inputs(found, options), path)
    sources = ', '.join(f'{len(found[kind])} {kind}' for kind in figure.kinds)
    if drawn[figure.name]:
      logging.info('%s: drawn from %s results -> %s', figure.name, sources, path)
  return drawn


FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('results', 'results', 'Directory holding the results JSON files.')
  flags.DEFINE_string('output', 'figures', 'Directory to write the PNG figures into.')
  flags.DEFINE_list('composition_offsets', ['1', '1024'], 'Offsets δ of the RoPE composition '
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
