"""Benchmark figures: the engines and the peers against the machine's ceilings
(experiments.bench), and where prefill and decode spend their time (experiments.profile)."""

from __future__ import annotations

import pathlib
import textwrap
from typing import Any, Iterable, Sequence

from absl import logging
import matplotlib.pyplot as plt
import numpy as np

from analysis.figures import base


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


def _fmt(value: float) -> str:
  return f'{value:,.0f}' if value >= 100 else f'{value:.3g}'


def _na(ax, x: float) -> None:
  ax.text(x, 0.03, 'n/a', transform=ax.get_xaxis_transform(), ha='center', va='bottom',
          fontsize=6, color='gray')


def _log_y(ax, values: Iterable[float | None]) -> None:
  values = [v for v in values if v]
  if values:
    ax.set_yscale('log')
    ax.set_ylim(min(values) / 4, max(values) * 4)


def _engine_of(data: dict) -> str:
  config = data['config'] if isinstance(data.get('config'), dict) else {}
  engine = config.get('engine_config') or {}
  return '/'.join(str(v) for v in (engine.get('mode', '?'), engine.get('dot_library')) if v)


# Hatches that tell machines apart in the bench panels (colours tell phases apart).
_HATCHES = ('', '//', '..', 'xx', '\\\\')


def _by_name(rows: Sequence[dict[str, Any]]) -> dict[str, dict]:
  """A run's rows by system name (the first row of a name)."""
  by_name = {}
  for row in rows:
    by_name.setdefault(row['name'], row)
  return by_name


def _slots(count: int, width: float) -> list[float]:
  """Offsets of `count` bars sharing a tick of total `width`."""
  return [(m - (count - 1) / 2) * width / count for m in range(count)]


def _system_ticks(ax, names: Sequence[str], runs) -> None:
  """One tick per system; under a system skipped in a run, why, small."""
  x = np.arange(len(names))
  ax.set_xticks(x, names, fontsize=6)
  ax.set_xlim(-0.6, len(names) - 0.4)
  noted = set()
  for xi, name in zip(x, names):
    for _, _, by_name in runs:
      row = by_name.get(name)
      if row and row.get('skipped') and name not in noted:
        noted.add(name)
        ax.annotate('skipped: ' + textwrap.fill(str(row['skipped']), 24), (xi, 0),
                    xycoords=('data', 'axes fraction'), xytext=(0, -14),
                    textcoords='offset points', ha='center', va='top', fontsize=4.5,
                    color='dimgray')
        ax.text(xi, 0.03, 'skipped', transform=ax.get_xaxis_transform(), rotation=90,
                ha='center', va='bottom', fontsize=6, color='gray')


def _bench_throughput(ax, runs, names, phase: str, color: str) -> None:
  field = f'{phase}_tok_s'
  fraction = {'prefill': 'prefill_fraction_of_matmul_ceiling',
              'decode': 'decode_fraction_of_read_ceiling'}[phase]
  width, slots = 0.6 / len(runs), _slots(len(runs), 0.6)
  values, unknown = [], []
  for (data, rows, by_name), slot, hatch in zip(runs, slots, _HATCHES):
    ceiling, how = bench_ceiling_tok_s(data, rows, phase)
    for xi, name in enumerate(names):
      row = by_name.get(name, {'skipped': 'not in this run'})
      value = _value(row, field)
      values.append(value)
      if value is None:
        if not row.get('skipped'):
          _na(ax, xi + slot)
        continue
      ax.bar(xi + slot, value, color=color, width=width, hatch=hatch)
      share = row.get(fraction) if row.get(fraction) is not None else (
          value / ceiling if ceiling else None)
      ax.text(xi + slot, value, _fmt(value) + (f'\n{100 * share:.2g}% of ceiling'
                                                if share and len(runs) == 1 else ''),
              ha='center', va='bottom', fontsize=5 if len(runs) == 1 else 4)
    ceiling_name = 'matmul' if phase == 'prefill' else 'read bandwidth'
    if ceiling:
      ax.axhline(ceiling, color='black', linestyle='--', linewidth=0.8,
                 label=f'{base.machine(data) or "this machine"}: {ceiling_name} ceiling '
                       f'{_fmt(ceiling)} tok/s ({how})')
      values.append(ceiling)
    else:
      unknown.append(how)
      logging.warning('bench: no %s ceiling in tokens/s (%s); drawn without it', phase, how)
  if ax.get_legend_handles_labels()[1]:
    ax.legend(fontsize=5, loc='upper right')
  _log_y(ax, values)
  _system_ticks(ax, names, runs)
  ax.set_ylabel(f'{phase} tok/s (log)', fontsize=7)
  ax.grid(alpha=0.3, axis='y')
  c = runs[0][0]['config'] if isinstance(runs[0][0]['config'], dict) else {}
  detail = (f"{c.get('prompt_tokens')}-token prompt" if phase == 'prefill' else
            f"{c.get('decode_tokens')} greedy steps, one token per call")
  ax.set_title(f'{phase}: {detail}' + (f' (ceiling unknown: {unknown[0]})' if unknown else ''),
               fontsize=7)


def _bench_ttft(ax, runs, names) -> None:
  pair = 0.76 / len(runs)
  values = []
  for (data, rows, by_name), slot, hatch in zip(runs, _slots(len(runs), 0.76), _HATCHES):
    for xi, name in enumerate(names):
      row = by_name.get(name, {'skipped': 'not in this run'})
      for shift, field, color, what in ((-pair / 4, 'ttft_recompute_s', 'tab:red', 'recompute'),
                                        (pair / 4, 'ttft_graft_s', 'tab:green', 'graft')):
        value = _value(row, field)
        values.append(value)
        if value is None:
          if not row.get('skipped'):
            _na(ax, xi + slot + shift)
          continue
        ax.bar(xi + slot + shift, value, width=pair / 2, color=color, hatch=hatch,
               label=what if what not in ax.get_legend_handles_labels()[1] else None)
        ax.text(xi + slot + shift, value, f'{value:.3g} s' if len(runs) == 1 else f'{value:.2g}',
                ha='center', va='bottom',
                fontsize=5 if len(runs) == 1 else 3.5)
      recompute, graft = _value(row, 'ttft_recompute_s'), _value(row, 'ttft_graft_s')
      if recompute and graft:
        ax.text(xi + slot, 0.97, f'{recompute / graft:.3g}x', transform=ax.get_xaxis_transform(),
                ha='center', va='top', fontsize=6 if len(runs) == 1 else 4, fontweight='bold')
  _log_y(ax, values)
  _system_ticks(ax, names, runs)
  ax.set_ylabel('TTFT (s, log)', fontsize=7)
  ax.grid(alpha=0.3, axis='y')
  if ax.get_legend_handles_labels()[1]:
    ax.legend(fontsize=5, loc='upper left', bbox_to_anchor=(1.0, 1.0))
  c = runs[0][0]['config'] if isinstance(runs[0][0]['config'], dict) else {}
  ax.set_title(f"time to first token: {c.get('library_tokens')}-token library + "
               f"{c.get('query_tokens')}-token query, recomputed vs grafted (speedup on top)",
               fontsize=7)


def _bench_graft_split(ax, runs) -> bool:
  """The graft's time to first token split into its phases, for the systems that record it
  (horizontal stacked bars, linear seconds); False when none does."""
  split_rows = [(data, row) for data, rows, _ in runs for row in rows
                if not row.get('skipped') and isinstance(row.get('ttft_graft_split_s'), dict)]
  if not split_rows:
    ax.axis('off')
    return False
  for y, (data, row) in enumerate(split_rows):
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
    ax.text(left, y, f' {left * 1e3:.3g} ms{extra}', va='center', fontsize=5)
  several = len(runs) > 1
  ax.set_yticks(range(len(split_rows)),
                [(f'{base.machine(d)}: ' if several else '') + r['name'] for d, r in split_rows],
                fontsize=6)
  ax.invert_yaxis()
  ax.margins(x=0.25)
  ax.set_xlabel('seconds', fontsize=7)
  ax.grid(alpha=0.3, axis='x')
  ax.legend(fontsize=5, loc='upper left', bbox_to_anchor=(1.0, 1.0))
  ax.set_title('graft time to first token, by phase (medians of each phase)', fontsize=7)
  return True


def bench_drawable(data: dict) -> bool:
  """Whether the bench figure draws a bench result: one of throughput (not --start_only) of the
  float engines (the relative RoPE mode's cost is a comparison of its own: docs/claims.md), and
  not one against an earlier commit (--baseline: our code against its own past, not what
  exactness costs beside the peers)."""
  config = data.get('config') if isinstance(data.get('config'), dict) else {}
  return not config.get('start_only') and not config.get('baseline') and not any(
      str(name).endswith('_relative') for name in config.get('systems') or ())


def bench(found_results: Sequence[tuple[pathlib.Path, dict]],
          path: pathlib.Path) -> pathlib.Path | None:
  """The newest bench run of each machine given (draw_figures gives one machine's; leaving out
  runs of the relative RoPE mode's systems), overlaid (hatches tell machines apart): prefill and
  decode tokens/s per system with each machine's ceiling in tokens/s as a line, time to first
  token recomputed vs grafted, and the graft's phases. A skipped system keeps its place, with
  no bar and its reason under its name."""
  drawable = []
  for source, data in found_results:
    if not bench_drawable(data):
      continue
    rows = bench_systems(source, data)
    if rows:
      drawable.append((source, data))
    else:
      logging.warning('%s: no bench system rows; left out', source)
  if not drawable:
    logging.warning('bench: no bench results with system rows; skipped')
    return None
  runs = []
  for source, data in base.newest_per_machine(drawable):
    rows = bench_systems(source, data)
    runs.append((data, rows, _by_name(rows)))
  names = list(dict.fromkeys(row['name'] for _, rows, _ in runs for row in rows))
  fig, axes = plt.subplots(4, 1, layout='constrained', figsize=(base.WIDTH, 8.6))
  _bench_throughput(axes[0], runs, names, 'prefill', 'tab:blue')
  _bench_throughput(axes[1], runs, names, 'decode', 'tab:purple')
  _bench_ttft(axes[2], runs, names)
  _bench_graft_split(axes[3], runs)
  described = []
  for (data, _, _), hatch in zip(runs, _HATCHES):
    c = data['config'] if isinstance(data['config'], dict) else {}
    limits = data['ceilings'] if isinstance(data['ceilings'], dict) else {}
    described.append(
        f"{'[' + (hatch or 'solid') + '] ' if len(runs) > 1 else ''}"
        f"{base.machine(data) or 'this machine'}: "
        f"{base.label(c.get('model'), c.get('weights'), c.get('dtype'))}, "
        f"medians of {c.get('repeats')}, ceilings "
        f"{limits.get('matmul_gflops', float('nan')):.3g} GFLOP/s, "
        f"{limits.get('read_gbps', float('nan')):.3g} GB/s")
  fig.suptitle('Benchmark: this project\'s engines and the peers on the same weights, against '
               'the machine\'s ceilings (newest run per machine)\n' + '\n'.join(described),
               fontsize=7)
  return base.save(fig, path)


def profile(found_results: Sequence[tuple[pathlib.Path, dict]],
            path: pathlib.Path) -> pathlib.Path | None:
  """Where prefill and decode spend their time (experiments.profile): per engine and phase, the
  seconds of the largest parts (dots by the model code or weight they serve, other thunks by
  code and kind) and of the wall time outside thunks; the newest run per engine and machine."""
  if not found_results:
    logging.warning('profile: no profile results; skipped')
    return None
  found_results = base.newest_per_machine(found_results, _engine_of)
  phases = ('prefill', 'decode')
  fig, axes = plt.subplots(len(found_results), len(phases), squeeze=False, layout='constrained',
                           figsize=(base.WIDTH, base.height(len(found_results), 2.5)))
  for row, (_, data) in zip(axes, found_results):
    engine = _engine_of(data)
    for ax, phase in zip(row, phases):
      summary = data[phase]
      parts = [(r['component'], r['s']) for r in summary['by_component'][:8]]
      parts.append(('outside thunks (dispatch, host)', summary['outside_thunks_s']))
      labels, seconds = zip(*reversed(parts))
      colors = ['tab:gray' if label.startswith('outside') else
                'tab:orange' if label.endswith(']') else 'tab:blue' for label in labels]
      ax.barh(np.arange(len(labels)), seconds, color=colors)
      ax.set_yticks(np.arange(len(labels)), [textwrap.shorten(l, 38) for l in labels], fontsize=5)
      ax.set_xlabel('seconds')
      ceiling = summary.get('fraction_of_matmul_ceiling', summary.get('fraction_of_read_ceiling'))
      base.title(ax, f"{engine}, {phase}: {summary['wall_s']:.2f} s wall, dots "
                 f"{summary['dot_share']:.0%} of thunk time"
                 + (f', {ceiling:.0%} of the ceiling' if ceiling else ''), 2)
  fig.suptitle('Where the time goes (blue: dots, orange: other thunks [kind], gray: outside '
               'thunks)', fontsize=9)
  return base.save(fig, path)
