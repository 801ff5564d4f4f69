"""Composition figures (experiments.compose): fidelity against the recompute fraction per
strategy, float RoPE (re-rotated) beside relative; and time to first token against accuracy."""

from __future__ import annotations

import pathlib
from typing import Sequence

from absl import logging
import matplotlib.pyplot as plt
import numpy as np

from analysis.figures import base

STRATEGY_ORDER = ('cacheblend', 'epic', 'window')  # graft/store/compose.py STRATEGIES, past none
_STYLE = {'relative': '-', 'float': '--'}
_MARKER = {'cacheblend': 'o', 'epic': 's', 'window': '^', 'none': 'x'}


def _chosen(found_results) -> dict:
  """The result to draw: the one with the most questions (the committed 270M run over a
  tiny model's smoke run), the newest among equals."""
  newest = base.newest_per_machine(found_results, lambda data: (data['config'].get('model'),
                                                                data['config'].get('dtype')))
  return max(newest, key=lambda found: next(iter(found[1]['modes'].values()))['reference'][
      'questions'])[1]


def _positions(fractions) -> dict[float, int]:
  """Each fraction's place on an evenly spaced axis (0, 5, 15, 30, 100% apart alike)."""
  return {f: i for i, f in enumerate(sorted(set(fractions)))}


def _curves(result: dict, mode: str):
  """strategy -> (fractions, rows), every strategy starting from the none row at 0."""
  rows = result['modes'][mode]['rows']
  none = [r for r in rows if r['strategy'] == 'none']
  out = {}
  for strategy in STRATEGY_ORDER:
    mine = sorted((r for r in rows if r['strategy'] == strategy), key=lambda r: r['fraction'])
    if mine:
      line = none + mine
      out[strategy] = ([r['fraction'] for r in line], line)
  return out


def compose_fidelity(found_results: Sequence[tuple[pathlib.Path, dict]],
                     path: pathlib.Path) -> pathlib.Path | None:
  """Three panels against the fraction of document tokens recomputed (0 is none: placement
  alone; 1 is the fresh computation): the question's next-token KL, the task's accuracy (with
  its 95% interval, the full recompute's as a band) and the K deviation of the local and the
  global layers; one line per strategy, relative solid and float (re-rotated) dashed."""
  if not found_results:
    logging.warning('compose_fidelity: no compose results; skipped')
    return None
  data = _chosen(found_results)
  modes = [m for m in ('relative', 'float') if m in data['modes']]
  at = _positions([r['fraction'] for m in modes for r in data['modes'][m]['rows']])
  fig, axes = plt.subplots(2, 2, figsize=(base.WIDTH, 5.4), layout='constrained')
  kl_ax, acc_ax, local_ax, global_ax = axes.ravel()
  kl_values = []
  for mode in modes:
    for strategy, (fractions, rows) in _curves(data, mode).items():
      fractions = [at[f] for f in fractions]
      style = dict(linestyle=_STYLE[mode], marker=_MARKER[strategy], markersize=3,
                   color=f'C{STRATEGY_ORDER.index(strategy)}')
      label = f'{strategy}, {mode}' + (' (re-rotated)' if mode == 'float' else '')
      kl = [r['kl_mean'] for r in rows]
      kl_values += kl
      kl_ax.plot(fractions, kl, label=label, **style)
      acc = np.array([r['accuracy'] for r in rows])
      low = np.array([r['ci95'][0] for r in rows])
      high = np.array([r['ci95'][1] for r in rows])
      acc_ax.errorbar(fractions, acc, yerr=[acc - low, high - acc], capsize=2, elinewidth=0.6,
                      label=label, **style)
      for ax, kind in ((local_ax, 'local'), (global_ax, 'global')):
        ax.plot(fractions, [r['layers_by_type'].get(kind, {}).get('k_rel_l2', np.nan)
                            for r in rows], label=label, **style)
  for mode in modes:
    ref = data['modes'][mode]['reference']
    acc_ax.axhspan(ref['ci95'][0], ref['ci95'][1], alpha=0.12 if mode == 'relative' else 0.06,
                   color='gray', label=f'full recompute, {mode} ({ref["accuracy"]:.2f})')
  base.symlog_y(kl_ax, kl_values)
  kl_ax.set_ylabel('next-token KL(fresh || composed), mean (symlog)')
  acc_ax.set_ylabel('accuracy (95% interval)')
  local_ax.set_ylabel('K deviation, local layers (rel. L2)')
  global_ax.set_ylabel('K deviation, global layers (rel. L2)')
  for ax in axes.ravel():
    ax.set_xticks(list(at.values()), [f'{100 * f:g}%' for f in at])
    ax.set_xlabel('document tokens recomputed')
    ax.grid(alpha=0.3)
  base.small_legend(kl_ax)
  base.small_legend(acc_ax)
  c = data['config']
  fig.suptitle(f'Composed documents against full recompute: '
               f'{base.label(c.get("model"), c.get("weights"), c.get("dtype"))}, '
               f'{c.get("documents")} documents of up to {max(c.get("lengths", [0]))} tokens, '
               f'{data["modes"][modes[0]]["reference"]["questions"]} questions\n'
               '0%: placement alone (relative: no rotary error); 100%: the fresh computation, '
               'bit for bit', fontsize=7)
  return base.save(fig, path)


def compose_ttft(found_results: Sequence[tuple[pathlib.Path, dict]],
                 path: pathlib.Path) -> pathlib.Path | None:
  """Time to first token (documents stored, host tier warm) against the task's accuracy, one
  point per strategy and fraction, relative filled and float open; the fresh prefill's time
  and accuracy as a cross."""
  found_results = [(p, d) for p, d in found_results
                   if any((m.get('ttft') or {}).get('rows') for m in d['modes'].values())]
  if not found_results:
    logging.warning('compose_ttft: no compose results with a time to first token; skipped')
    return None
  data = _chosen(found_results)
  fig, ax = plt.subplots(figsize=(base.WIDTH, 3.4), layout='constrained')
  for mode, result in data['modes'].items():
    ttft = result.get('ttft')
    if not ttft:
      continue
    accuracy = {(r['strategy'], r['fraction']): r['accuracy'] for r in result['rows']}
    by_strategy = {}
    for row in ttft['rows']:
      if (row['strategy'], row['fraction']) in accuracy:
        by_strategy.setdefault(row['strategy'], []).append(row)
    for strategy, rows in by_strategy.items():
      rows = sorted(rows, key=lambda r: r['fraction'])
      color = 'k' if strategy == 'none' else f'C{STRATEGY_ORDER.index(strategy)}'
      xs = [r['seconds'] for r in rows]
      ys = [accuracy[(strategy, r['fraction'])] for r in rows]
      ax.plot(xs, ys, _STYLE[mode], color=color, linewidth=0.8)
      ax.scatter(xs, ys, s=[12 + 60 * r['fraction'] for r in rows], marker=_MARKER[strategy],
                 color=color, facecolors=color if mode == 'relative' else 'none', zorder=3)
    ax.scatter([ttft['fresh_seconds']], [result['reference']['accuracy']], s=70, marker='P',
               color='gray', facecolors='gray' if mode == 'relative' else 'none', zorder=3)
  for strategy in ('none',) + STRATEGY_ORDER:
    ax.scatter([], [], marker=_MARKER[strategy], color='k' if strategy == 'none' else
               f'C{STRATEGY_ORDER.index(strategy)}', label=strategy)
  ax.scatter([], [], marker='P', color='gray', label='fresh prefill')
  ax.plot([], [], '-', color='k', label='relative (filled)')
  ax.plot([], [], '--', color='k', label='float, re-rotated (open)')
  ax.set_xscale('log')
  ax.set_xlabel('time to first token, s (median; log): composed from the store vs fresh')
  ax.set_ylabel('accuracy')
  ax.grid(alpha=0.3)
  base.small_legend(ax)
  t = next(m['ttft'] for m in data['modes'].values() if m.get('ttft'))
  ax.set_title(f'{t["tokens"]} tokens: {len(t["document_lengths"])} documents of up to '
               f'{max(t["document_lengths"])} tokens; marker size: the fraction recomputed '
               '(0 to 100%)', fontsize=7)
  return base.save(fig, path)
