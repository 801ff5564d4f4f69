"""Context shift: a window that drops its oldest tokens when full, against placing them directly.

  python -m experiments.context_shift --rope=float --window=1024 --drop=1 --shifts=1,10,100,1000
  python -m experiments.context_shift --rope=relative --window=1024 --drop=1 --shifts=1,10,100,1000
  python -m experiments.context_shift --model=tiny_gemma3 --weights=random:0 --window=40 --drop=3

Streams the start of the corpus text (seeded ids for random weights) through a window of
--window tokens: the first --text_tokens tokens (default: the window), then greedy generation.
Each time the window is full it drops the oldest --drop tokens and moves the rest --drop
positions earlier, as llama.cpp's context shift does (graft/context_shift.py says what is exact
and how). After each shift count in --shifts it measures the shifted cache against the reference
(the kept token states placed directly at their final positions): K and V (SHA-256, max |ΔK|),
the logits after the next token (SHA-256, KL, max |Δ|) and --continuation greedy tokens from
each (the first that differs).

  --rope=float     the cached keys are turned by -Δ in place at each shift (llama.cpp's K-shift);
                   the measurements are its drift. Exits 1 if the reference is not what the
                   exact stream computes.
  --rope=relative  the shift only moves positions; exits 1 unless K, V and the next logits are
                   SHA-256 equal to the reference after every shift count measured.

Output: schema context_shift (analysis/results.py), in --output or the run folder
(runs/context_shift/); figure context_shift (`python -m analysis.figures --only=context_shift`).
"""

from __future__ import annotations

import dataclasses
import sys
import time

from absl import app, flags, logging

from experiments import common, samples
from gemma_jax import compare
from graft import context_shift

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_integer('window', 256, 'Tokens the context holds before it shifts.', lower_bound=2)
  flags.DEFINE_integer('drop', 8, 'Oldest tokens dropped at each shift (the shift Δ).',
                       lower_bound=1)
  common.define_list('shifts', [1, 10, 100, 1000], 'Shift counts after which to measure.',
                     lower_bound=1)
  flags.DEFINE_integer('text_tokens', None, 'Tokens of text fed before greedy generation takes '
                       'over (unset: --window).', lower_bound=1)
  flags.DEFINE_integer('continuation_tokens', 32, 'Greedy tokens compared: decoded from the '
                       'shifted and the reference context at each measurement.', lower_bound=0)
  flags.DEFINE_integer('seed', 0, 'Seed of the token ids for random weights.', lower_bound=0)
  common.define_output_flag()
  common.define_model_flags()
  common.define_rope_flag()
  common.define_engine_flags(cache_len=0)


OWN_DEFAULTS = {'cache_len': 'sized for the window, the next token and the continuation'}


def summarize(measurements: list[dict], rope: str) -> dict:
  """Whether every measurement was exact (relative's claim), whether every reference was the
  exact stream's, and the drift at each shift count."""
  return {
      'rope': rope,
      'shifts': [m['shifts'] for m in measurements],
      'exact': all(m['kv_equal'] and m['logits_equal'] for m in measurements),
      'references_equal_stream': all(m['reference_equals_stream'] for m in measurements),
      'k_max_abs': [m['k_max_abs'] for m in measurements],
      'kl': [m['kl'] for m in measurements],
      'first_differing_token': [m['first_differing_token'] for m in measurements],
  }


def main(argv):
  del argv
  t_start = time.perf_counter()
  counts = sorted(set(FLAGS.shifts))
  if not counts:
    raise app.UsageError('--shifts: give at least one shift count')
  if FLAGS.drop >= FLAGS.window:
    raise ValueError(f'--drop={FLAGS.drop} must be below --window={FLAGS.window}')
  loaded = common.load_model()
  text_tokens = FLAGS.text_tokens or FLAGS.window
  text = samples.tokens_for(loaded, text_tokens, FLAGS.seed)
  engine_config = common.engine_config(
      needed_cache=FLAGS.window + 1 + FLAGS.continuation_tokens)
  cache_len = engine_config.cache_len
  engines = context_shift.make_engines(loaded, engine_config)
  output = common.output_path('context_shift', FLAGS.model, FLAGS.dtype,
                                                 FLAGS.rope)
  logging.info('streaming %d tokens of text through a window of %d, dropping %d per shift, '
               'measuring after %s shifts', len(text), FLAGS.window, FLAGS.drop, counts)
  with common.heartbeat(lambda: 'streaming', every=60):
    result = context_shift.run(engines, text, window=FLAGS.window, drop=FLAGS.drop,
                               measure_at=counts, continuation=FLAGS.continuation_tokens,
                               log=lambda message: print(message, flush=True))
  model = engines.model
  config = {
      **common.model_config_json(), 'window': FLAGS.window, 'drop': FLAGS.drop,
      'shifts': counts, 'text_tokens': len(text), 'continuation': FLAGS.continuation_tokens,
      'seed': FLAGS.seed, 'text': 'pydoc_data.topics (experiments/samples.py corpus_text)'
      if not loaded.weights.startswith('random') else f'random ids (seed {FLAGS.seed})',
      'text_sha256': compare.token_ids_sha256(text),
      'stream_tokens': result['stream_tokens'],
      'engine': FLAGS.engine, 'cache_len': cache_len,
      'engine_config': dataclasses.asdict(model.engine_config),
      'model_fingerprint': model.model_fingerprint['sha256'],
      'stream_model_fingerprint': engines.stream.model_fingerprint['sha256'],
      'engine_fingerprint': model.fingerprint,
      'stream_seconds': result['seconds'],
      'wall_seconds': round(time.perf_counter() - t_start, 1),
  }
  summary = summarize(result['measurements'], FLAGS.rope)
  common.write_result(output, 'context_shift', {'config': config, 'summary': summary,
                                                'measurements': result['measurements']})
  for m in result['measurements']:
    print(f'rope={FLAGS.rope} after {m["shifts"]} shifts (a key turned up to {m["most_turns"]} '
          f'times): K and V equal={m["kv_equal"]} max |ΔK|={m["k_max_abs"]:.3g} next logits '
          f'equal={m["logits_equal"]} KL={m["kl"]:.3g} first differing greedy token='
          f'{m["first_differing_token"]}')
  if not summary['references_equal_stream']:
    print('error: the reference placement is not what the exact stream computes', file=sys.stderr)
    sys.exit(1)
  if FLAGS.rope == 'relative' and not summary['exact']:
    print('error: under relative RoPE the shifted cache or its next logits differ from the '
          'reference', file=sys.stderr)
    sys.exit(1)


if __name__ == '__main__':
  define_flags()
  common.run(main)
