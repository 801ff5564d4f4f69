"""The relative RoPE mode's two formulations, timed side by side in one run (XLA's numerics).

  python -m experiments.rope_formulation --output=results/rope_formulation.json

Scores of --rows query rows against --slots keys of head dimension --head_dim, the queries at
the last positions (every key visible to most rows), computed two ways that are equal in exact
arithmetic:
  turned  each row against its own copy of the keys turned back by the offset's angles
          (gemma_jax.rope.RelativeScores: a [rows, slots, H] tensor, then an ordinary dot);
  tables  per pair i, cos and sin of the offset's angle times the two products
          q_i k_i + q_{i+H/2} k_{i+H/2} and q_i k_{i+H/2} - q_{i+H/2} k_i, summed over i
          ([rows, slots, H/2] tensors that XLA fuses into one reduction).
Medians of --repeats calls after a warm-up, interleaved, and the largest difference of the two
(float32 rounding). The mode uses `turned` whatever this says about speed: its per-row score is
the ordinary dot, which the spec's native FMA-chain kernels and the interpreter already compute
bit for bit; `tables` would need a sum of its own written into the spec.
"""

from __future__ import annotations

import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from absl import flags

from experiments import common
from gemma_jax import rope

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_integer('rows', 256, 'Query rows (tokens x query heads per KV head).', lower_bound=1)
  flags.DEFINE_integer('slots', 512, 'Key slots.', lower_bound=1)
  flags.DEFINE_integer('head_dim', 256, 'Head dimension H.', lower_bound=2)
  flags.DEFINE_integer('repeats', 7, 'Timed repetitions: calls per formulation.', lower_bound=1)
  common.define_output_flag()


OWN_DEFAULTS = {
    'repeats': 'two formulations of one short call: medians of 7',
}


def formulations(rows: int, slots: int, head_dim: int):
  """(turned, tables): jitted functions (q [rows, H], k [slots, H]) -> scores [rows, slots]."""
  scores = rope.RelativeScores(head_dim, 10000.0, 1.0, 1.0)
  q_pos = slots - rows // 4 + jnp.arange(rows) // 4  # four query heads per token, last tokens
  offsets = q_pos[:, None] - jnp.arange(slots)[None]
  visible = offsets >= 0

  @jax.jit
  def turned(q, k):
    return jnp.einsum('rh,rsh->rs', q, scores.turned_keys(k, offsets, visible, slots))

  @jax.jit
  def tables(q, k):
    sin, cos = scores.table(slots)
    index = jnp.where(visible, offsets, 0)
    q1, q2 = jnp.split(q[:, None], 2, -1)
    k1, k2 = jnp.split(k[None], 2, -1)
    return jnp.sum(cos[index] * (q1 * k1 + q2 * k2) + sin[index] * (q1 * k2 - q2 * k1), -1)

  return turned, tables


def main(argv):
  del argv
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.standard_normal((FLAGS.rows, FLAGS.head_dim)), jnp.float32)
  k = jnp.asarray(rng.standard_normal((FLAGS.slots, FLAGS.head_dim)), jnp.float32)
  functions = dict(zip(('turned', 'tables'), formulations(FLAGS.rows, FLAGS.slots,
                                                          FLAGS.head_dim)))
  for fn in functions.values():
    fn(q, k).block_until_ready()
  seconds = {name: [] for name in functions}
  for _ in range(FLAGS.repeats):
    for name, fn in functions.items():
      start = time.perf_counter()
      fn(q, k).block_until_ready()
      seconds[name].append(time.perf_counter() - start)
  medians = {name: statistics.median(v) for name, v in seconds.items()}
  difference = float(jnp.max(jnp.abs(functions['turned'](q, k) - functions['tables'](q, k))))
  summary = {'median_s': medians, 'tables_vs_turned_speed': medians['turned'] / medians['tables'],
             'max_abs_difference': difference}
  config = {'rows': FLAGS.rows, 'slots': FLAGS.slots, 'head_dim': FLAGS.head_dim,
            'repeats': FLAGS.repeats, 'numerics': 'xla', 'jax': jax.__version__}
  common.write_result(common.output_path('rope_formulation'),
                      'rope_formulation', {'config': config, 'summary': summary})
  print(f"turned {medians['turned'] * 1e3:.1f} ms, tables {medians['tables'] * 1e3:.1f} ms "
        f"(tables {summary['tables_vs_turned_speed']:.2f}x turned's speed); max |difference| "
        f'{difference:.3g}')


if __name__ == '__main__':
  define_flags()
  common.run(main)
