"""The fault campaign's figure (experiments.faults): every trial's outcome per fault kind."""

from __future__ import annotations

import pathlib
from typing import Sequence

from absl import logging
import matplotlib.pyplot as plt
import numpy as np

from analysis.figures import base


def faults(found_results: Sequence[tuple[pathlib.Path, dict]],
           path: pathlib.Path) -> pathlib.Path | None:
  """Per fault kind, the trials' outcomes stacked: exact, untouched (the fault missed what the
  reader used), refused and recomputed, silent-wrong, crashed (and the lost count in the
  label); one row per kind of campaign (its newest per machine), signed ones named."""
  if not found_results:
    logging.warning('faults: no faults results; skipped')
    return None
  found_results = base.newest_per_machine(found_results,
                                          lambda data: bool(data['config'].get('signed')))
  fig, axes = plt.subplots(len(found_results), 1, squeeze=False, layout='constrained',
                           figsize=(base.WIDTH, base.height(len(found_results), 3.4)))
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
    labels = [f"{k}, lost {data['kinds'][k]['lost']}" for k in kinds]
    ax.set_xticks(x, labels, rotation=90, ha='center', fontsize=5)
    ax.set_ylabel('trials')
    s, c = data['summary'], data['config']
    ax.set_title(f"{c.get('model')} ({c.get('weights')}) {c.get('dtype')}"
                 f"{', signed writer, readers trusting only it' if c.get('signed') else ''}: "
                 f"{s['trials']} trials, {s['silent_wrong']} silent-wrong, "
                 f"{s.get('crashed', 0)} crashed, {s['lost']} lost", fontsize=7)
    ax.set_ylim(0, bottom.max() * 1.3)  # room above the bars for the legend
    ax.legend(fontsize=6, loc='upper center', ncol=5)
  fig.suptitle('Fault campaign: every trial\'s answer against a fresh computation (SHA-256)',
               fontsize=9)
  return base.save(fig, path)
