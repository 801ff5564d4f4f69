"""RoPE float analysis figures (experiments.rope_float): re-rotation error against position,
angle rounding against position, and where re-rotation is bit-exact."""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

from absl import logging
import matplotlib.pyplot as plt
import numpy as np

from analysis.figures import base


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
  fig, axes = plt.subplots(len(chosen), len(layers),
                           figsize=(base.WIDTH, base.height(len(chosen), 2.6)),
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
      base.symlog_y(ax, values)
      base.title(ax, f'δ={offset}, {name}\nθ={spec["base"]:g}, H={spec["head_dim"]}, '
                 f'scale {spec["scale"]:g}, rotary {spec["rotary_fraction"]:g}', len(row), 5.5)
      ax.set_xlabel('position p (log)')
      ax.grid(alpha=0.3)
      ax.legend(fontsize=5)
    row[0].set_ylabel('max |R(δ)R(p)x − R(p+δ)x| (symlog)')
  fig.suptitle(f'RoPE re-rotation error against position, {dtype} apply_rope '
               f'({config.get("execution", "jit")}), {config.get("vectors")} N(0,1) vectors',
               fontsize=9)
  return base.save(fig, path)


def rope_angle_error(rope_result: dict[str, Any] | None, path: pathlib.Path) -> pathlib.Path | None:
  if rope_result is None:
    logging.warning('rope_angle_error: no rope_float result; skipped')
    return None
  layers = rope_result.get('layer_types', {})
  if not layers:
    logging.warning('rope_angle_error: the rope_float result has no layer types; skipped')
    return None
  fig, ax = plt.subplots(figsize=(base.WIDTH, 4.0), layout='constrained')
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
  base.symlog_y(ax, values)
  ax.set_xlabel('position p (symlog)')
  ax.set_ylabel('radians (symlog)')
  ax.grid(alpha=0.3)
  ax.legend(fontsize=5)
  ax.set_title('float32 RoPE angle rounding against position (max over pairs)')
  return base.save(fig, path)


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
  fig, axes = plt.subplots(1, len(layers), figsize=(base.WIDTH, 3.0), squeeze=False,
                           sharey=True, layout='constrained')
  for ax, (name, entry) in zip(axes[0], layers.items()):
    for dtype, by_mode in entry['composition'].items():
      for mode, by_delta in by_mode.items():
        offsets = sorted(int(d) for d in by_delta)
        ax.plot(offsets, [by_delta[str(d)]['exact_fraction'] for d in offsets],
                'o-' if mode == 'float' else 's--', label=f'{dtype}, {mode}')
    base.symlog_offsets(ax)
    ax.set_ylim(-0.05, 1.05)
    ax.set_title(name, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
  axes[0][0].set_ylabel('fraction of (p, pair) bit-exact')
  fig.suptitle('Re-rotation R(δ)R(p)x == R(p+δ)x bit for bit: fraction of positions and pairs',
               fontsize=9)
  return base.save(fig, path)
