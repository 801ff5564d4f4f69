"""Times the Pallas attention kernel against the reference XLA `attend`; hashes its outputs.

    python -m experiments.kernel_bench --cache_sizes=4096,32768 --output=results/kernel_bench.json
    python -m experiments.kernel_bench --sha256_only          # just the kernel output hashes

For each context S: a full cache of S slots (token j at slot j, position j), and two calls:
decode (T = 1, the query at position S - 1) and a prefill block (T = --prefill_rows, positions
S - T .. S - 1) whose last row has the decode query. Reported per call: the median wall time over
--repeats runs after a compile-and-warm-up run, for the kernel and for the reference; the
kernel's error against the reference; the SHA-256 of the kernel output (first and last run, so a
nondeterministic kernel shows up); and whether the decode row's bits equal the prefill block's
last row (the kernel's row invariance on this backend).

On CPU the kernel runs in interpret mode (slow): the default context there is 1024. On GPU/TPU
this is the timing part of the device check; compare hashes across runs and machines.
"""

from __future__ import annotations

import json
import statistics
import time

from absl import flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from gemma_jax.attention import attend
from gemma_jax.compare import sha256_bytes
from gemma_jax.kernels.pallas_attention import make_pallas_attention

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  common.define_list('cache_sizes', None, 'Cache sizes S (unset: 1024 on CPU, 4096,32768 '
                     'elsewhere).', lower_bound=1)
  flags.DEFINE_integer('head_dim', 256, 'Head dimension H.', lower_bound=1)
  flags.DEFINE_integer('num_heads', 8, 'N, query heads.', lower_bound=1)
  flags.DEFINE_integer('num_kv_heads', 4, 'K, KV heads (N % K == 0).', lower_bound=1)
  flags.DEFINE_integer('batch', 1, 'B.', lower_bound=1)
  flags.DEFINE_enum('dtype', 'bfloat16', ['bfloat16', 'float32'], 'Activation dtype of q, k and '
                    'v.')
  flags.DEFINE_integer('prefill_rows', 128, 'T of the prefill block.', lower_bound=1)
  flags.DEFINE_integer('sliding_window', None, 'Sliding window of the attention (unset: global '
                       'attention).', lower_bound=1)
  flags.DEFINE_float('softcap', None, 'Attention logit softcap (unset: off).', lower_bound=0.0)
  flags.DEFINE_integer('tile_size', None, 'KV tile (unset: the backend\'s).', lower_bound=1)
  flags.DEFINE_integer('block_q', None, 'Query rows per block (unset: the kernel\'s).',
                       lower_bound=1)
  flags.DEFINE_integer('repeats', 5, 'Timed repetitions per measurement (median reported).',
                       lower_bound=1)
  flags.DEFINE_integer('seed', 0, 'Seed of the random q, k, v.', lower_bound=0)
  flags.DEFINE_bool('sha256_only', False,
                    'Only compute and print the kernel output hashes (no timing).')
  common.define_output_flag('the JSON report')


OWN_DEFAULTS = {
    'dtype': 'the kernel is timed on bfloat16 inputs, as accelerators run it',
    'repeats': 'a kernel call is short: medians of 5',
}


_MAX_ROWS = 1024  # queries are the last rows of one fixed draw, so decode's row is prefill's last


def make_inputs(context: int, rows: int, *, batch: int, num_heads: int, num_kv_heads: int,
                head_dim: int, dtype, seed: int):
  """q [B, rows, N, H] (scaled), k, v [B, S, K, H] and positions of a full cache of S slots.
  The last query row is the same whatever `rows` is (it is the decode query)."""
  if not 1 <= rows <= _MAX_ROWS:
    raise ValueError(f'rows must be in 1..{_MAX_ROWS}, got {rows}')
  key_q, key_k, key_v = jax.random.split(jax.random.key(seed), 3)
  q_all = jax.random.normal(key_q, (batch, _MAX_ROWS, num_heads, head_dim), jnp.float32)
  q = (q_all[:, -rows:] * head_dim ** -0.5).astype(dtype)
  k = jax.random.normal(key_k, (batch, context, num_kv_heads, head_dim), dtype)
  v = jax.random.normal(key_v, (batch, context, num_kv_heads, head_dim), dtype)
  k_pos = jnp.broadcast_to(jnp.arange(context, dtype=jnp.int32), (batch, context))
  q_pos = jnp.broadcast_to(jnp.arange(context - rows, context, dtype=jnp.int32), (batch, rows))
  return q, k, v, q_pos, k_pos


def _timed(fn, args, repeats: int):
  out = jax.block_until_ready(fn(*args))  # compile + warm-up
  first = out
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    out = jax.block_until_ready(fn(*args))
    times.append(time.perf_counter() - start)
  return first, out, times


def kernel_hashes(contexts, rows_list, *, attention_fn, window, softcap, **shape) -> dict:
  """{f'{S}x{T}': SHA-256 of the kernel output} without timing: the quick cross-run check."""
  kernel = jax.jit(lambda q, k, v, qp, kp: attention_fn(q, k, v, qp, kp, window=window,
                                                         softcap=softcap))
  return {f'{s}x{t}': sha256_bytes(kernel(*make_inputs(s, t, **shape)))
          for s in contexts for t in rows_list}


def run_benchmark(contexts, *, attention_fn, prefill_rows: int, window, softcap, repeats: int,
                  **shape) -> list[dict]:
  kernel = jax.jit(lambda q, k, v, qp, kp: attention_fn(q, k, v, qp, kp, window=window,
                                                         softcap=softcap))
  reference = jax.jit(lambda q, k, v, qp, kp: attend(q, k, v, qp, kp, window=window,
                                                     softcap=softcap))
  results = []
  for context in contexts:
    last_rows = {}
    for mode, rows in (('decode', 1), ('prefill', prefill_rows)):
      args = make_inputs(context, rows, **shape)
      first, out, kernel_times = _timed(kernel, args, repeats)
      ref, _, ref_times = _timed(reference, args, repeats)
      diff = np.abs(np.asarray(out, np.float64) - np.asarray(ref, np.float64))
      last_rows[mode] = np.asarray(out[:, -1])
      results.append(dict(
          context=context, mode=mode, rows=rows,
          kernel_ms_median=1e3 * statistics.median(kernel_times),
          reference_ms_median=1e3 * statistics.median(ref_times),
          kernel_ms=[1e3 * t for t in kernel_times],
          reference_ms=[1e3 * t for t in ref_times],
          speedup_vs_reference=statistics.median(ref_times) / statistics.median(kernel_times),
          max_abs_err=float(diff.max()),
          normwise_rel_err=float(diff.max() / np.abs(np.asarray(ref, np.float64)).max()),
          kernel_sha256=sha256_bytes(out),
          kernel_sha256_stable_across_runs=sha256_bytes(first) == sha256_bytes(out),
      ))
      print(json.dumps({k: v for k, v in results[-1].items()
                        if k not in ('kernel_ms', 'reference_ms')}), flush=True)
    results[-1]['decode_row_equals_prefill_last_row'] = (
        last_rows['decode'].tobytes() == last_rows['prefill'].tobytes())
  return results


def main(argv):
  del argv
  backend = jax.default_backend()
  contexts = [int(c) for c in (FLAGS.cache_sizes or (['1024'] if backend == 'cpu'
                                                   else ['4096', '32768']))]
  dtype = jnp.dtype(FLAGS.dtype)
  attention_fn = make_pallas_attention(tile_size=FLAGS.tile_size, block_q=FLAGS.block_q)
  shape = dict(batch=FLAGS.batch, num_heads=FLAGS.num_heads, num_kv_heads=FLAGS.num_kv_heads,
               head_dim=FLAGS.head_dim, dtype=dtype, seed=FLAGS.seed)
  report = dict(
      experiment='kernel_bench',
      config=dict(contexts=contexts, prefill_rows=FLAGS.prefill_rows, window=FLAGS.sliding_window,
                  softcap=FLAGS.softcap, repeats=FLAGS.repeats, dtype=dtype.name,
                  **{k: v for k, v in shape.items() if k != 'dtype'}),
      kernel=dict(platform=attention_fn.platform, interpret=attention_fn.interpret,
                  blocks=attention_fn.block_config(FLAGS.head_dim, dtype).__dict__),
      backend=backend,
      device_kind=jax.devices()[0].device_kind,
      jax_version=jax.__version__,
  )
  kw = dict(attention_fn=attention_fn, window=FLAGS.sliding_window, softcap=FLAGS.softcap, **shape)
  if FLAGS.sha256_only:
    report['kernel_sha256'] = kernel_hashes(contexts, (1, FLAGS.prefill_rows), **kw)
    for name, digest in report['kernel_sha256'].items():
      print(f'{name} {digest}')
  else:
    report['results'] = run_benchmark(contexts, prefill_rows=FLAGS.prefill_rows,
                                      repeats=FLAGS.repeats, **kw)
  output = common.output_path('kernel_bench')
  common.write_json(output, {**report, 'config': {**report['config'], **common.provenance(),
                                                  'command': common.recorded_command()}})
  print(f'wrote {output}')


if __name__ == '__main__':
  define_flags()
  common.run(main)
