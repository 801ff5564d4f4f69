"""The flywheel's figure (experiments.flywheel): every run side by side."""

from __future__ import annotations

import math
import pathlib
import textwrap
from typing import Sequence

from absl import logging
import matplotlib.pyplot as plt
import numpy as np

from analysis.figures import base


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


# The paper's recurring answers: 8 problems in 61 decode tokens (docs/ and the README cite it).
PAPER_TOKENS_PER_ANSWER = 61 / 8


def _run_name(data: dict) -> list[str]:
  """A run's name: its task family or file, and what sets it apart, one part per line."""
  c = data['config']
  name = [c.get('task_set') or pathlib.Path(str(c.get('tasks') or '?')).parent.name or '?']
  if c.get('solutions') == 'none':
    name.append('(own answers only)')
  if 'recall' not in c.get('templates', {}):  # made before recall from the entry's own trace
    name.append('(old recall)')
  return name


def _run_label(data: dict) -> str:
  held = sum(t['split'] == 'heldout' for t in data['tasks'])
  return '\n'.join(_run_name(data) + [f"{data['config'].get('budget')} tok, {held} held-out"])


def flywheel(found_results: Sequence[tuple[pathlib.Path, dict]],
             path: pathlib.Path) -> pathlib.Path | None:
  """Every flywheel run (a task family or task file) side by side: accuracy without and with
  the library on recurring and held-out problems (first round, 95% Wilson intervals), decode
  tokens per answer, and the cost factors on the never-solved problems."""
  if not found_results:
    logging.warning('flywheel: no flywheel results; skipped')
    return None
  runs = [data for _, data in found_results]
  fig, (ax_acc, ax_tok, ax_fac) = plt.subplots(3, 1, figsize=(base.WIDTH, 8.2),
                                               layout='constrained')
  x = np.arange(len(runs))
  bars = (('recurring, base', 'tab:gray', lambda s, r: (s['base_accuracy'], r['recurring'])),
          ('recurring, library', 'tab:green',
           lambda s, r: (s['recurring_accuracy'], r['recurring'])),
          ('held-out, base', 'silver', lambda s, r: (r['heldout_base'], r['heldout'])),
          ('held-out, library', 'tab:olive', lambda s, r: (r['heldout_library'], r['heldout'])))
  width = 0.8 / len(bars)
  for i, (name, color, pick) in enumerate(bars):
    values, errors = [], [[], []]
    for data in runs:
      s, tasks = data['summary'], data['tasks']
      first = (s.get('accuracy_by_round') or [{}])[0]
      counts = {'recurring': sum(t['split'] == 'recurring' for t in tasks),
                'heldout': first.get('n') or sum(t['split'] == 'heldout' for t in tasks),
                'heldout_base': first.get('base', s.get('heldout_base_accuracy')),
                'heldout_library': first.get('library', s.get('heldout_library_accuracy'))}
      p, n = pick(s, counts)
      p = p or 0.0
      low, high = wilson(p, n)
      values.append(100 * p)
      errors[0].append(max(0.0, 100 * (p - low)))
      errors[1].append(max(0.0, 100 * (high - p)))
    drawn = ax_acc.bar(x + (i - 1.5) * width, values, width, color=color, label=name,
                       yerr=errors, capsize=1.5, error_kw={'lw': 0.6})
    ax_acc.bar_label(drawn, labels=[f'{v:.0f}' for v in values], fontsize=5)
  ax_acc.set_ylim(0, 115)
  ax_acc.set_ylabel('accuracy (%), 95% Wilson')
  ax_acc.set_xticks(x, [_run_label(d) for d in runs], fontsize=6)
  ax_acc.legend(fontsize=6, ncol=4, loc='upper center')
  deltas = [d['summary'].get('heldout_delta_ci95') for d in runs]
  intervals = '; '.join(f"{' '.join(_run_name(d))} [{c[0]:+.2f}, {c[1]:+.2f}]"
                        for d, c in zip(runs, deltas) if c)
  ax_acc.set_title(textwrap.fill('accuracy; held-out change with its paired 95% interval: '
                                 + intervals, 150), fontsize=6)

  for i, phase in enumerate(('base', 'library')):
    means = [decode_tokens_per_solved(d['tasks'], phase)[0] for d in runs]
    drawn = ax_tok.bar(x + (i - 0.5) * 0.4, means, 0.4, color=('tab:gray', 'tab:green')[i],
                       label=('base, per solved problem', 'library grafted, per solved problem')[i])
    ax_tok.bar_label(drawn, labels=[f'{m:.1f}' for m in means], fontsize=6)
  recurring = [d['summary'].get('recurring_library_decode_tokens_per_answer') for d in runs]
  ax_tok.plot(x, [r if r is not None else np.nan for r in recurring], 'k_', ms=14,
              label='recurring answer, entry grafted')
  ax_tok.axhline(PAPER_TOKENS_PER_ANSWER, color='tab:red', ls='--', lw=0.8,
                 label=f'paper: 61 tokens / 8 problems = {PAPER_TOKENS_PER_ANSWER:.1f}')
  ax_tok.set_xticks(x, [_run_label(d) for d in runs], fontsize=6)
  ax_tok.set_ylabel('decode tokens')
  ax_tok.legend(fontsize=6)
  ax_tok.set_title('decode tokens per answer', fontsize=8)

  factor_names = ('token_factor', 'flops_factor', 'energy_factor')
  for i, (field, color) in enumerate(zip(factor_names, ('tab:purple', 'tab:blue', 'tab:orange'))):
    values = [d['summary'].get(field) for d in runs]
    drawn = ax_fac.bar(x + (i - 1) * 0.27, [v or 0 for v in values], 0.27, color=color,
                       label=field.replace('_factor', ''))
    ax_fac.bar_label(drawn, labels=['n/a' if v is None else f'{v:.3g}x' for v in values],
                     fontsize=5)
  ax_fac.axhline(1.0, color='black', lw=0.8, ls='--')
  ax_fac.set_xticks(x, [_run_label(d) for d in runs], fontsize=6)
  ax_fac.set_ylabel('base / library')
  ax_fac.legend(fontsize=6)
  ax_fac.set_title(textwrap.fill(
      'cost of the never-solved problems, base attempts over the grafted answer (energy: RAPL '
      'where present, else CPU seconds); grafts SHA-256 equal to fresh: ' + ', '.join(
          f"{d['summary'].get('graft_exact_equal')}/{d['summary'].get('graft_exact_checked')}"
          for d in runs), 150), fontsize=6)
  fig.suptitle('Verified-knowledge flywheel: verify once, deposit as KV, graft on recurrence',
               fontsize=9)
  return base.save(fig, path)
