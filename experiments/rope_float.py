"""The floating-point account of RoPE (analysis/rope_float.py), run and written as a result.

  python -m experiments.rope_float --output=results/rope_float.json

Measures, with the model's own jitted RoPE, float32 angle rounding against position, the
rotation's error against float64, and whether re-rotating a rotated key by δ equals rotating
it at p + δ (float RoPE and the quarter-turn control), for the four layer types of Gemma 2/3/4.
`--sweep_results` adds the layer-by-layer propagation summary of position-sweep results.
"""

from __future__ import annotations

import os

from absl import flags, logging

from analysis import rope_float
from experiments import common

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  common.define_output_flag()
  flags.DEFINE_integer('positions', 131_072, 'Largest position of the log grid (Gemma 3 4B+ '
                       'and Gemma 4 contexts reach 131,072).', lower_bound=1)
  common.define_list('dtypes', ['float32', 'bfloat16'], f'Activation dtypes: any of '
                     f'{", ".join(sorted(rope_float.DTYPES))}.', integers=False,
                     words=sorted(rope_float.DTYPES))
  common.define_list('head_dims', [256], 'Head dims of the local/global/global-scale-8 layer '
                     'types (Gemma 4 global always uses 512).', lower_bound=2)
  common.define_list('offsets', list(rope_float.DEFAULT_OFFSETS), 'Offsets δ of the shifts.',
                     lower_bound=0)
  flags.DEFINE_list('sweep_results', [], 'Optional position-sweep JSON files whose per-layer '
                    'K/V divergence to summarize (rope_float.summarize_layer_propagation).')
  flags.register_validator('sweep_results', lambda paths: all(os.path.isfile(p) for p in paths),
                           message='--sweep_results: every item must be an existing file')
  flags.DEFINE_integer('grid_points', 40, 'Points of the log position grid (powers of two '
                       'added).', lower_bound=1)
  flags.DEFINE_integer('vectors', 4, 'Random vectors per position.', lower_bound=1)
  flags.DEFINE_integer('seed', 0, 'Seed of the random vectors.', lower_bound=0)
  flags.DEFINE_enum('execution', 'jit', ['jit', 'eager'], 'Run apply_rope jitted (as the model '
                    'does) or eagerly (op by op).')


OWN_DEFAULTS = {'offsets': 'a sweep over small δ and powers of two up to 65,536'}


def main(argv):
  del argv
  result = rope_float.analyze(max_position=FLAGS.positions, dtypes=FLAGS.dtypes,
                              head_dims=[int(h) for h in FLAGS.head_dims],
                              offsets=[int(d) for d in FLAGS.offsets],
                              grid_points=FLAGS.grid_points, vectors=FLAGS.vectors,
                              seed=FLAGS.seed, execution=FLAGS.execution,
                              sweep_results=FLAGS.sweep_results)
  common.write_result(common.output_path('rope_float'), 'rope_float', result)
  for name, summary in result['summary'].items():
    logging.info('%s: angle error %s; float32 exact fraction %s', name,
                 summary['angle_max_abs_error_at'],
                 summary['composition_exact_fraction'].get('float32', {}).get('float'))


if __name__ == '__main__':
  define_flags()
  common.run(main)
