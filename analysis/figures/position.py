"""Position-sweep figures (experiments.position_sweep): shifted-graft exactness against the
offset, per-layer K/V divergence, and float RoPE next to the controls. Models and dtypes are
overlaid as lines, one panel per quantity."""

from __future__ import annotations

import collections
import pathlib
from typing import Any, Sequence

from absl import logging
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from analysis.figures import base

_STYLES = {'rerotate': '-', 'pre_rope': '--', 'recompute': ':'}


def _colors(keys) -> dict:
  keys = list(keys)
  return dict(zip(keys, plt.cm.tab10(np.arange(len(keys)) % 10)))


def position_exactness(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> pathlib.Path | None:
  """Left: the fraction of shifted grafts whose logits are bit-equal to fresh, per method, over
  every model and dtype (their curves coincide: own position only), and the same under the
  relative mode where it was swept (grey: every offset); right: KL(fresh || graft) per model
  and dtype (solid rerotate, dashed pre-RoPE)."""
  relative = [r for r in rows if r.get('rope') == 'relative']
  rows = [r for r in rows if r.get('rope') == 'float']
  if not rows:
    logging.warning('position_exactness: no float-RoPE position-sweep results; skipped')
    return None
  groups = base.group_rows(rows, ('model', 'weights', 'dtype'))
  fig, (ax_eq, ax_kl) = plt.subplots(1, 2, figsize=(base.WIDTH, 3.3), layout='constrained')
  for method in base.methods(rows):
    offsets, equal = base.by_offset([r for r in rows if r['method'] == method], 'equal', np.mean)
    ax_eq.plot(offsets, equal, 'o' + _STYLES.get(method, '-'), ms=3, label=method)
  for method in base.methods(relative):
    offsets, equal = base.by_offset([r for r in relative if r['method'] == method], 'equal',
                                    np.mean)
    ax_eq.plot(offsets, equal, 's' + _STYLES.get(method, '-'), ms=2, color='0.55', lw=0.8,
               label=f'{method}, relative mode')
  ax_eq.set_ylim(-0.05, 1.05)
  ax_eq.set_ylabel('fraction bit-equal to fresh (SHA-256)')
  ax_eq.set_title(f'logits bit-equal, {len(groups)} models/dtypes pooled', fontsize=8)
  base.small_legend(ax_eq, title='method')
  colors, kl_values = _colors(groups), []
  for key, group in groups.items():
    for method in base.methods(group):
      if method == 'recompute':
        continue
      offsets, kl = base.by_offset([r for r in group if r['method'] == method], 'kl', np.mean)
      ax_kl.plot(offsets, kl, _STYLES.get(method, '-'), color=colors[key], lw=1,
                 label=base.label(*key) if method == 'rerotate' else None)
      kl_values += list(kl)
  base.symlog_y(ax_kl, kl_values)
  ax_kl.set_ylabel('mean KL (nats; symlog)')
  ax_kl.set_title('KL(fresh || graft): solid rerotate, dashed pre-RoPE', fontsize=8)
  base.small_legend(ax_kl)
  for ax in (ax_eq, ax_kl):
    base.symlog_offsets(ax)
    ax.grid(alpha=0.3)
  fig.suptitle('Float RoPE: a shifted graft is exact at its own position (δ = 0) only'
               + ('; relative evaluation: at every δ' if relative else ''), fontsize=9)
  return base.save(fig, path)


def _layer_maxima(rows: Sequence[dict[str, Any]]) -> dict[str, np.ndarray]:
  """{'layer', 'k_max_ulp', 'v_max_ulp', ...}: per layer, the maxima over every shifted row."""
  per_layer = collections.defaultdict(lambda: collections.defaultdict(float))
  for row in rows:
    if int(row['offset']) == 0:
      continue
    for entry in row.get('layers') or []:
      slot = per_layer[int(entry['layer'])]
      for field in ('k_max_abs', 'v_max_abs', 'k_max_ulp', 'v_max_ulp'):
        slot[field] = max(slot[field], float(entry.get(field) or 0.0))
  layers = sorted(per_layer)
  out = {'layer': np.array(layers)}
  for field in ('k_max_abs', 'v_max_abs', 'k_max_ulp', 'v_max_ulp'):
    out[field] = np.array([per_layer[l][field] for l in layers])
  return out


def layer_divergence(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> pathlib.Path | None:
  """Per layer, the largest ulp distance of a shifted graft's K (left) and V (right) from fresh,
  over every offset: one colour per model and dtype, one line style per method."""
  rows = [r for r in rows if r.get('rope') == 'float' and r.get('layers')]
  if not rows:
    logging.warning('layer_divergence: no float-RoPE position-sweep rows with per-layer data; '
                    'skipped')
    return None
  groups = base.group_rows(rows, ('model', 'weights', 'dtype'))
  colors = _colors(groups)
  fig, axes = plt.subplots(1, 2, figsize=(base.WIDTH, 3.3), sharey=True, layout='constrained')
  values = []
  for key, group in groups.items():
    for method in base.methods(group):
      maxima = _layer_maxima([r for r in group if r['method'] == method])
      for ax, part in zip(axes, ('k', 'v')):
        ax.plot(maxima['layer'], maxima[f'{part}_max_ulp'], _STYLES.get(method, '-'),
                color=colors[key], lw=1,
                label=base.label(*key) if method == 'rerotate' and part == 'k' else None)
        values += list(maxima[f'{part}_max_ulp'])
  for ax, part in zip(axes, ('K', 'V')):
    base.symlog_y(ax, values)
    ax.set_title(f'{part}: max ulp from fresh over every offset δ ≠ 0', fontsize=8)
    ax.set_xlabel('layer')
    ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
  axes[0].set_ylabel('max ulp distance (symlog)')
  base.small_legend(axes[0], title='solid rerotate, dashed pre-RoPE, dotted recompute')
  fig.suptitle('Per-layer K/V divergence of shifted grafts (float RoPE)', fontsize=9)
  return base.save(fig, path)


def position_controls(rows: Sequence[dict[str, Any]], path: pathlib.Path) -> pathlib.Path | None:
  """One panel per RoPE mode (float, then the controls): the largest |logit difference| of a
  shifted graft against the offset, per model and dtype (solid rerotate, dashed pre-RoPE), on
  one y scale."""
  groups = {key: group
            for key, group in base.group_rows(rows, ('model', 'weights', 'dtype')).items()
            if len({r.get('rope') for r in group}) > 1}
  if not groups:
    logging.warning('position_controls: no model/dtype has position-sweep results for float RoPE '
                    'and a control (quarter_turn, none); skipped')
    return None
  present = {row.get('rope') for g in groups.values() for row in g}
  ropes = [r for r in base.ROPE_ORDER if r in present] + sorted(present - set(base.ROPE_ORDER),
                                                               key=str)
  colors = _colors(groups)
  fig, axes = plt.subplots(1, len(ropes), figsize=(base.WIDTH, 3.0), squeeze=False,
                           sharey=True, layout='constrained')
  values = []
  for ax, rope_mode in zip(axes[0], ropes):
    for key, group in groups.items():
      rope_rows = [r for r in group if r.get('rope') == rope_mode]
      for method in base.methods(rope_rows):
        if method == 'recompute':
          continue
        offsets, v = base.by_offset([r for r in rope_rows if r['method'] == method], 'max_abs',
                                    np.max)
        ax.plot(offsets, v, _STYLES.get(method, '-'), color=colors[key], lw=1,
                label=base.label(*key) if method == 'rerotate' else None)
        values += list(v)
    ax.set_title(f'RoPE {rope_mode}', fontsize=8)
    base.symlog_offsets(ax)
    ax.grid(alpha=0.3)
  for ax in axes[0]:
    base.symlog_y(ax, values)
  axes[0][0].set_ylabel('max |logit diff| (symlog)')
  base.small_legend(axes[0][0], title='solid rerotate, dashed pre-RoPE')
  fig.suptitle('Shifted graft: float RoPE, the same model scored from offsets (relative), and '
               'the controls', fontsize=9)
  return base.save(fig, path)
