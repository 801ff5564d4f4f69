"""python -m analysis.figures: every figure, or --only=NAME, drawn from results/ (the one runner of
experiments/common.py: one-line errors, --verbose, --overwrite)."""

from typing import Sequence

from absl import flags

from analysis import figures
from experiments import common

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('results_dir', 'results', 'Directory of the results JSON files the '
                      'figures are drawn from.')
  flags.DEFINE_string('output_dir', None, 'The directory this run writes its PNG figures to '
                      '(unset: a new one under runs/figures/; the committed ones: figures, '
                      'with --overwrite where they change).')
  common.define_list('only', [], f'Draw only these figures: any of {", ".join(figures.NAMES)}.',
                     integers=False, words=figures.NAMES)
  flags.DEFINE_string('machine', None, 'Draw each figure from the results of this machine (a '
                      f'cpu_model such as AuthenticAMD/25/17, or "{figures.NOT_RECORDED}"; '
                      "unset: by each figure's rule, docs/figures.md).")
  common.define_list('composition_offsets', [1, 1024], 'Offsets δ of the RoPE composition '
                     'figure (one row each).', lower_bound=0)


def main(argv: Sequence[str]) -> None:
  del argv
  output = FLAGS.output_dir or common.run_path('figures', suffix='')
  drawn = figures.draw_figures(FLAGS.results_dir, output,
                               composition_offsets=FLAGS.composition_offsets,
                               only=FLAGS.only, machine=FLAGS.machine, overwrite=FLAGS.overwrite)
  for name, path in drawn.items():
    print(f'{name}: {path if path else "skipped (input missing)"}')


if __name__ == '__main__':
  define_flags()
  common.run(main)
