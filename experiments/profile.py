"""Where prefill and decode spend their time, op by op (analysis/profile.py).

  python -m experiments.profile --engine=spec --output=results/profile_gemma3_270m_float32_spec.json

Runs one prefill of --prompt_tokens and --decode_tokens greedy steps under jax.profiler, after an
untimed warm-up that compiles them (with the optimized HLO dumped to a temporary folder; the
compilation cache is off, so every executable is compiled here and dumped). Each XLA:CPU thunk's
seconds are joined to its instruction: dots (their FLOP rate against the matmul ceiling measured
in the same run), fusions, copies, by the model code that made them; and the wall time outside
thunks (dispatch, host work). Bits are not changed by profiling: the dump and the trace only
observe.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile
import time

from absl import flags, logging
import jax

from analysis import profile
from experiments import ceilings, common, samples
from gemma_jax import compilation_cache, cost

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_integer('prompt_tokens', 2000, 'Prompt length in tokens of the profiled prefill.',
                       lower_bound=1)
  flags.DEFINE_integer('decode_tokens', 32, 'Greedy decode steps of the profiled decode.',
                       lower_bound=1)
  flags.DEFINE_integer('repeats', 3, 'Timed repetitions of each ceiling measurement.',
                       lower_bound=1)
  common.define_output_flag()
  common.define_model_flags()
  common.define_engine_flags(cache_len=common.GRAFT_CACHE_LEN)


OWN_DEFAULTS = {'cache_len': 'a 2,000-token prompt and its decode, as experiments.bench'}


def traced(fn, directory: str) -> float:
  """Wall seconds of one call of fn under jax.profiler, its trace written to `directory`."""
  jax.profiler.start_trace(directory)
  start = time.perf_counter()
  try:
    fn()
  finally:
    seconds = time.perf_counter() - start
    jax.profiler.stop_trace()
  return seconds


def main(argv):
  del argv
  with tempfile.TemporaryDirectory(prefix='gemma_jax_profile_') as scratch:
    profile_in(scratch)


def profile_in(scratch: str) -> None:
  """Compiles with the HLO dumped under `scratch`, traces there, writes the result."""
  dump = os.path.join(scratch, 'hlo')
  # Read when XLA's CPU client starts, which is after this (nothing has run on a device yet).
  os.environ['XLA_FLAGS'] = ' '.join(
      [os.environ.get('XLA_FLAGS', ''), f'--xla_dump_to={dump}', '--xla_dump_hlo_as_text']).strip()
  compilation_cache.disable()
  loaded = common.load_model()
  engine = common.make_engine(loaded)
  text = loaded.tokenizer.encode(samples.corpus_text())
  prompt = text[:FLAGS.prompt_tokens]
  ctx, _ = engine.prefill(text[:32], logits='last')
  run_prefill = lambda: engine.prefill(prompt, logits='last')
  run_decode = lambda: engine.generate(ctx, FLAGS.decode_tokens + 1, stop_at_eos=False)
  logging.info('compiling (a warm-up prefill and decode)')
  run_prefill()
  run_decode()
  logging.info('measuring the ceilings')
  limits = ceilings.measure(repeats=FLAGS.repeats)
  walls = {}
  for name, fn in (('prefill', run_prefill), ('decode', run_decode)):
    logging.info('tracing %s', name)
    walls[name] = traced(fn, os.path.join(scratch, name))
  modules = profile.read_dump(dump)  # every executable both phases ran was compiled by now
  phases = {name: profile.summarize(profile.read_trace(os.path.join(scratch, name)), modules,
                                     wall, limits['matmul_gflops'])
            for name, wall in walls.items()}
  prefill, decode = phases['prefill'], phases['decode']
  prefill['tokens'] = len(prompt)
  prefill['model_flops'] = cost.prefill_flops(loaded.config, len(prompt))
  prefill['fraction_of_matmul_ceiling'] = (
      prefill['model_flops'] / prefill['wall_s'] / 1e9 / limits['matmul_gflops'])
  decode['tokens'] = FLAGS.decode_tokens
  decode['weight_bytes_per_token'] = cost.weight_bytes(loaded.config, 4)
  # The time a token would take reading every weight once at the streaming-read ceiling.
  decode['read_ceiling_s_per_token'] = (decode['weight_bytes_per_token']
                                        / (limits['read_gbps'] * 1e9))
  # generate(n + 1) makes n decode steps: the first token comes from the prompt's logits.
  decode['s_per_token'] = decode['wall_s'] / FLAGS.decode_tokens
  decode['dot_s_per_token'] = decode['dot_s'] / FLAGS.decode_tokens
  decode['fraction_of_read_ceiling'] = (decode['read_ceiling_s_per_token']
                                        / decode['s_per_token'])
  for name, phase in phases.items():
    print(f"{name}: {phase['wall_s']:.3f} s wall, {phase['thunk_s']:.3f} s in "
          f"{phase['thunks']} thunks; dots {phase['dot_share']:.0%} of thunk time at "
          f"{phase['dot_gflops']:.1f} GFLOP/s")
    for row in phase['by_component'][:8]:
      print(f"  {row['share']:6.1%}  {row['s']:.3f} s  {row['component']}")
  config = {**common.model_config_json(), 'engine_config': dataclasses.asdict(engine.engine_config),
            'prompt_tokens': len(prompt), 'decode_tokens': FLAGS.decode_tokens,
            'repeats': FLAGS.repeats}
  output = common.output_path(
      'profile', FLAGS.model, FLAGS.dtype, engine.engine_config.mode)
  common.write_result(output, 'profile', {'config': config, 'ceilings': limits,
                                          'prefill': prefill, 'decode': decode})


if __name__ == '__main__':
  define_flags()
  common.run(main)
