"""Figures, drawn only from the JSON results in a results directory.

    python -m analysis.figures --results=results --output=figures

A result is recognised by its "schema" field (analysis/results.py), never by its file name.
Every figure reads those results and nothing else: a figure whose input is absent is skipped
with a logged warning (never drawn from made-up data), and each figure drawn logs one line.
`FIGURES` is the one list of figures: a new figure is one function in the module of its family
and one entry there. Every figure fits a two-column page (`base.MAX_INCHES`): models are
overlaid as lines, and where a kind of result was made on several machines the newest run of
each is drawn.

Modules, one per family: base (reading results, helpers, saving), position (the position
sweep), rope (the RoPE float analysis), shift (the context shift), graft (graft exactness,
usable context), store (the fault campaign), flywheel, bench (the benchmark and the profile),
compose (documents composed against full recompute).
"""

from __future__ import annotations

import dataclasses
import pathlib
from typing import Any, Callable, Sequence

from absl import flags
from absl import logging

from analysis import results as results_lib
from analysis.figures import base
from analysis.figures.base import (DPI, MAX_INCHES, Found, graft_exactness_results,
                                       newest_per_machine, position_sweep_rows, rope_float_result)
from analysis.figures.compose import compose_fidelity, compose_ttft
from analysis.figures.bench import (GRAFT_PHASES, bench, bench_ceiling_tok_s, bench_systems,
                                        profile)
from analysis.figures.flywheel import decode_tokens_per_solved, flywheel, wilson
from analysis.figures.graft import graft_exactness, widen_context
from analysis.figures.position import layer_divergence, position_controls, position_exactness
from analysis.figures.rope import (rope_angle_error, rope_composition_error,
                                       rope_composition_exactness)
from analysis.figures.shift import context_shift
from analysis.figures.store import faults

__all__ = ['DPI', 'FIGURES', 'GRAFT_PHASES', 'MAX_INCHES', 'Figure', 'base', 'bench_ceiling_tok_s',
           'bench_systems', 'decode_tokens_per_solved', 'draw_figures', 'newest_per_machine',
           'position_sweep_rows', 'wilson']


@dataclasses.dataclass(frozen=True)
class Figure:
  """A figure: the result kinds it reads, how it picks its input from them, how it draws."""

  name: str
  kinds: tuple[str, ...]
  inputs: Callable[[Found, dict], Any]  # (results by kind, options) -> the draw function's input
  draw: Callable[..., pathlib.Path | None]  # (input, path) -> path, or None when skipped


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
    Figure('context_shift', ('context_shift',), lambda found, _: found['context_shift'],
           context_shift),
    Figure('compose_fidelity', ('compose',), lambda found, _: found['compose'], compose_fidelity),
    Figure('compose_ttft', ('compose',), lambda found, _: found['compose'], compose_ttft),
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
