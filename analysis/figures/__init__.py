"""Figures, drawn only from the JSON results in a results directory.

    python -m analysis.figures                       # every figure, into runs/figures/<time>/
    python -m analysis.figures --only=bench          # one figure
    python -m analysis.figures --output_dir=figures --overwrite   # redraw the committed ones

A result is recognised by its "schema" field (analysis/results.py), never by its file name.
Every figure reads those results and nothing else: a figure whose input is absent is skipped
with a logged warning (never drawn from made-up data), and each figure drawn logs one line.
`FIGURES` is the one list of figures, each backing one claim of the README (docs/figures.md):
a new figure is one function in the module of its family and one entry there. Every figure
fits a two-column page (`base.MAX_INCHES`), no two of its labels overlap, and each is drawn
from the results of one machine (`choose`): by default the machine with the most of its
results (`rule='most'`) or of its newest one (`rule='newest'`, for timings), or the one
--machine names; results that record no machine count as one machine, "not recorded". The
figure's caption names the machine and the result files.

Modules, one per family: base (reading results, helpers, saving), position (the position
sweep), rope (the RoPE float analysis), shift (the context shift), graft (graft exactness,
usable context), store (the fault campaign), flywheel, bench (the benchmark and the profile),
compose (documents composed against full recompute).
"""

from __future__ import annotations

import collections
import dataclasses
import pathlib
from typing import Any, Callable, Sequence

from absl import logging

from analysis import results as results_lib
from analysis.figures import base
from analysis.figures.base import (DPI, MAX_INCHES, Found, graft_exactness_results,
                                       newest_per_machine, position_sweep_rows, rope_float_result)
from analysis.figures.bench import (GRAFT_PHASES, bench, bench_ceiling_tok_s, bench_drawable,
                                    bench_systems, profile)
from analysis.figures.compose import compose_fidelity, compose_ttft
from analysis.figures.flywheel import decode_tokens_per_solved, flywheel, wilson
from analysis.figures.graft import graft_exactness, widen_context
from analysis.figures.position import layer_divergence, position_controls, position_exactness
from analysis.figures.rope import (rope_angle_error, rope_composition_error,
                                       rope_composition_exactness)
from analysis.figures.shift import context_shift
from analysis.figures.store import faults

__all__ = ['DPI', 'FIGURES', 'GRAFT_PHASES', 'MAX_INCHES', 'NAMES', 'NOT_RECORDED', 'Figure',
           'base', 'bench_ceiling_tok_s', 'bench_systems', 'choose', 'decode_tokens_per_solved',
           'draw_figures', 'newest_per_machine', 'position_sweep_rows', 'wilson']


@dataclasses.dataclass(frozen=True)
class Figure:
  """A figure: the claim it backs (the README's number), the result kinds it reads (those that
  `select` keeps), how its machine is chosen, how it picks its input and how it draws."""

  name: str
  claim: int
  kinds: tuple[str, ...]
  inputs: Callable[[Found, dict], Any]  # (results by kind, options) -> the draw function's input
  draw: Callable[..., pathlib.Path | None]  # (input, path) -> path, or None when skipped
  select: Callable[[dict], bool] = lambda data: True  # which results of its kinds it may draw
  rule: str = 'most'  # the machine: with the 'most' results, or of the 'newest' one


def _rope_of(*modes: str) -> Callable[[dict], bool]:
  return lambda data: (data.get('config') or {}).get('rope', 'float') in modes


FIGURES: tuple[Figure, ...] = (
    Figure('graft_exactness', 3, ('graft_exactness',),
           lambda found, _: graft_exactness_results(found), graft_exactness, rule='newest'),
    Figure('position_exactness', 5, ('position_sweep',),
           lambda found, _: position_sweep_rows(found), position_exactness,
           select=_rope_of('float')),
    Figure('layer_divergence', 5, ('position_sweep',),
           lambda found, _: position_sweep_rows(found), layer_divergence,
           select=_rope_of('float')),
    Figure('position_controls', 5, ('position_sweep',),
           lambda found, _: position_sweep_rows(found), position_controls,
           select=_rope_of('float', 'none', 'quarter_turn')),
    Figure('rope_composition_error', 5, ('rope_float',),
           lambda found, options: (rope_float_result(found), options['composition_offsets']),
           lambda inputs, path: rope_composition_error(inputs[0], path, inputs[1])),
    Figure('rope_angle_error', 5, ('rope_float',),
           lambda found, _: rope_float_result(found), rope_angle_error),
    Figure('rope_composition_exactness', 5, ('rope_float',),
           lambda found, _: rope_float_result(found), rope_composition_exactness),
    Figure('context_shift', 7, ('context_shift',), lambda found, _: found['context_shift'],
           context_shift),
    Figure('widen_context', 8, ('widen_context',), lambda found, _: found['widen_context'],
           widen_context, rule='newest'),
    Figure('flywheel', 9, ('flywheel',), lambda found, _: found['flywheel'], flywheel),
    Figure('faults', 10, ('faults',), lambda found, _: found['faults'], faults),
    Figure('bench', 12, ('bench',), lambda found, _: found['bench'], bench,
           select=bench_drawable, rule='newest'),
    Figure('profile', 12, ('profile',), lambda found, _: found['profile'], profile,
           rule='newest'),
    Figure('compose_fidelity', 13, ('compose',), lambda found, _: found['compose'],
           compose_fidelity),
    Figure('compose_ttft', 13, ('compose',), lambda found, _: found['compose'], compose_ttft,
           rule='newest'),
)

NOT_RECORDED = 'not recorded'


def choose(found: Found, figure: Figure, machine: str | None = None
           ) -> tuple[Found, str | None, str]:
  """The results `figure` draws: those of its kinds it selects, made on one machine (`machine`,
  else by the figure's rule); with that machine ('' where none is left) and its caption."""
  candidates = [(kind, path, data) for kind in figure.kinds for path, data in found[kind]
                if figure.select(data)]
  groups = collections.defaultdict(list)
  for kind, path, data in candidates:
    groups[base.machine(data) or NOT_RECORDED].append((kind, path, data))
  newest = lambda group: max((base.commit_time(d), p.name) for _, p, d in group)
  if machine:
    chosen = machine
  elif not groups:
    chosen = None
  elif figure.rule == 'newest':
    chosen = max(groups, key=lambda m: newest(groups[m]))
  else:
    chosen = max(groups, key=lambda m: (len(groups[m]), newest(groups[m])))
  picked = groups.get(chosen, [])
  out: Found = collections.defaultdict(list)
  for kind, path, data in picked:
    out[kind].append((path, data))
  others = len(candidates) - len(picked)
  names = ', '.join(p.name for _, p, _ in picked)
  where = ('results whose machine is not recorded' if chosen == NOT_RECORDED
           else f'results made on {chosen}')
  caption = (f'Drawn from {where} ({names})'
             + (f'; {others} of other machines left out (--machine picks one)' if others else '')
             + '.') if picked else ''
  return out, chosen if picked else None, caption


def draw_figures(results: str | pathlib.Path, output: str | pathlib.Path, *,
                 composition_offsets: Sequence[int] = (1, 1024), only: Sequence[str] = (),
                 machine: str | None = None, overwrite: bool = False
                 ) -> dict[str, pathlib.Path | None]:
  """Draws every figure (or those named in `only`) whose inputs exist in `results` into
  `output`, each from one machine's results (`choose`); returns name -> path (None for a
  skipped figure). Logs one line per figure. A committed PNG whose bytes would change is
  refused unless `overwrite`."""
  found = results_lib.load(results)
  options = {'composition_offsets': tuple(composition_offsets)}
  unknown = sorted(set(only) - {f.name for f in FIGURES})
  if unknown:
    raise ValueError(f'no figure named {", ".join(unknown)}; figures: '
                     f'{", ".join(f.name for f in FIGURES)}')
  drawn = {}
  for figure in FIGURES:
    if only and figure.name not in only:
      continue
    path = pathlib.Path(output) / f'{figure.name}.png'
    chosen, where, caption = choose(found, figure, machine)
    with base.drawing(caption, overwrite):
      drawn[figure.name] = figure.draw(figure.inputs(chosen, options), path)
    if drawn[figure.name]:
      logging.info('%s: drawn from %d results made on %s -> %s', figure.name,
                   sum(len(v) for v in chosen.values()), where, path)
  return drawn


NAMES = tuple(f.name for f in FIGURES)
