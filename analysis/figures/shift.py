"""Context shift figure (experiments.context_shift): drift against the number of shifts, float
RoPE's K-shift against the relative mode's shift, which only moves positions."""

from __future__ import annotations

import pathlib
from typing import Sequence

from absl import logging
import matplotlib.pyplot as plt

from analysis.figures import base

# (measurement field, axis label) of each panel.
_PANELS = (('k_max_abs', 'max |ΔK| (layers, kept tokens)'),
           ('kl', 'next logits KL(reference || shifted)'))


def context_shift(found_results: Sequence[tuple[pathlib.Path, dict]],
                  path: pathlib.Path) -> pathlib.Path | None:
  """One line per model and RoPE mode (the newest run of each per machine): max |ΔK| and the
  next logits' KL against shifts (log x; zeros drawn on a symlog y), each float point labelled
  with the first greedy token that differs ('=' where none in the continuation)."""
  if not found_results:
    logging.warning('context_shift: no context_shift results; skipped')
    return None
  found_results = base.newest_per_machine(
      found_results, lambda data: (data['config'].get('model'), data['config'].get('rope')))
  fig, axes = plt.subplots(1, len(_PANELS), figsize=(base.WIDTH, 3.0), squeeze=False,
                           layout='constrained')
  for ax, (field, ylabel) in zip(axes[0], _PANELS):
    values = []
    for _, data in found_results:
      c, rows = data['config'], data['measurements']
      shifts = [m['shifts'] for m in rows]
      ys = [m[field] for m in rows]
      values += ys
      rope = c.get('rope', 'float')
      (line,) = ax.plot(shifts, ys, 'o-' if rope == 'float' else 's--',
                        label=f"{base.label(c.get('model'), c.get('weights'), c.get('dtype'))}, "
                              f"{rope} (window {c.get('window')}, drop {c.get('drop')})")
      if rope == 'float' and field == 'kl':
        for x, y, m in zip(shifts, ys, rows):
          first = m.get('first_differing_token')
          ax.annotate('=' if first is None else f'≠@{first}', (x, y), fontsize=5,
                      xytext=(2, 3), textcoords='offset points', color=line.get_color())
    ax.set_xscale('log')
    base.symlog_y(ax, values)
    ax.set_xlabel('shifts (log)')
    ax.set_ylabel(ylabel + ' (symlog)')
    ax.grid(alpha=0.3)
  base.small_legend(axes[0][0])
  fig.suptitle('Context shift: N shifts against the kept states placed directly (float: '
               'K-shift re-rotation; relative: positions only)', fontsize=8)
  return base.save(fig, path)
