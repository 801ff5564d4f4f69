"""Graft figures: own-position exactness per configuration (experiments.graft_exactness) and the
usable context the store adds at a fixed device cache (experiments.widen_context)."""

from __future__ import annotations

import pathlib
from typing import Any, Sequence

from absl import logging
import matplotlib.pyplot as plt
import numpy as np

from analysis.figures import base


def graft_exactness(results: Sequence[dict[str, Any]], path: pathlib.Path) -> pathlib.Path | None:
  """Graft exactness per result (own position, unless the label says other offsets): samples
  whose logits are SHA-256 equal to fresh, out of all, one bar per model, dtype, engine, source
  and RoPE mode."""
  if not results:
    logging.warning('graft_exactness: no graft-exactness results; skipped')
    return None
  labels, totals, equals = [], [], []
  for r in results:
    c = r['config']
    parts = [c.get('model'), c.get('weights'), c.get('dtype'), c.get('engine'), c.get('attention'),
             'store' if c.get('source') == 'store' else None,
             f"RoPE {c['rope']}" if c.get('rope', 'float') != 'float' else None,
             f"{c['batch_slots']} batch slots" if (c.get('batch_slots') or 1) > 1 else None,
             'grafted at other offsets' if c.get('offsets') else None]
    labels.append(', '.join(str(p) for p in parts if p))
    totals.append(r['samples'])
    equals.append(r['equal'])
  y = np.arange(len(labels))
  fig, ax = plt.subplots(figsize=(base.WIDTH, base.height(len(labels), 0.3)),
                         layout='constrained')
  ax.barh(y, totals, color='lightgray', label='samples')
  ax.barh(y, equals, color='tab:green', label='graft == fresh (SHA-256 of logits)')
  for yi, e, t in zip(y, equals, totals):
    ax.text(t, yi, f' {e}/{t}', va='center', fontsize=7)
  ax.set_yticks(y, labels, fontsize=6)
  ax.invert_yaxis()
  ax.set_xlabel('samples (green: the graft\'s logits SHA-256 equal to fresh; gray: not)')
  ax.set_xlim(0, max(totals) * 1.15)
  fig.suptitle('Graft exactness (own position unless labelled): samples SHA-256 equal to fresh',
               fontsize=8)
  return base.save(fig, path)


def widen_context(found_results: Sequence[tuple[pathlib.Path, dict]],
                  path: pathlib.Path) -> pathlib.Path | None:
  """Per model (its newest widening run per machine): tokens the store can graft against the
  device cache's, store throughput against the raw disk, and time to first token by tier."""
  if not found_results:
    logging.warning('widen_context: no widen_context results; skipped')
    return None
  found_results = base.newest_per_machine(
      found_results, lambda data: (data['config'].get('model'), data['config'].get('dtype')))
  fig, axes = plt.subplots(len(found_results), 3, figsize=(base.WIDTH,
                                                           base.height(len(found_results), 2.6)),
                           squeeze=False, layout='constrained')
  for row, (_, data) in zip(axes, found_results):
    c, s = data['config'], data['summary']
    label = f"{c.get('model')} ({c.get('weights')}) {c.get('dtype')}"
    ax = row[0]
    ax.bar(['device KV', 'store'],
           [s['device_kv_tokens'], s['addressable_tokens']], color=['tab:gray', 'tab:green'])
    ax.set_yscale('log')
    ax.set_ylabel('tokens (log)')
    base.title(ax, f'{label}: {s["ratio"]:.0f}x the device cache; device bytes '
               f'{s["device_bytes_before"] / 1e6:.0f} MB -> {s["device_bytes_after"] / 1e6:.0f} MB',
               3)
    ax = row[1]
    names = ['put', 'disk write', 'get', 'disk read']
    values = [s['put_gbps'], s.get('disk_write_gbps') or 0, s.get('get_gbps') or 0,
              s.get('disk_read_gbps') or 0]
    ax.bar(names, values, color=['tab:blue', 'tab:gray', 'tab:orange', 'tab:gray'])
    ax.tick_params(axis='x', labelsize=6, rotation=30)
    ax.set_ylabel('GB/s')
    base.title(ax, f'{label}: store throughput against the raw disk', 3)
    ax = row[2]
    tiers = [('host hit', s.get('ttft_hit_host_s')), ('backing hit', s.get('ttft_hit_backing_s')),
             ('miss (recompute)', s.get('ttft_miss_s'))]
    ax.bar([t for t, v in tiers], [v or 0 for _, v in tiers],
           color=['tab:green', 'tab:olive', 'tab:red'])
    ax.tick_params(axis='x', labelsize=6, rotation=30)
    ax.set_yscale('log')
    ax.set_ylabel('time to first token (s, log)')
    base.title(ax, f'{label}: {s["sampled_equal"]}/{s["sampled"]} sampled grafts SHA-256 equal '
               'to fresh', 3)
  fig.suptitle('Usable context from the knowledge store, at a fixed device cache', fontsize=9)
  return base.save(fig, path)
