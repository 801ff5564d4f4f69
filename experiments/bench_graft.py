"""Cost of pinning and benefit of grafting, measured side by side in one run.

  python -m experiments.bench_graft --output=results/bench_graft_gemma3_270m_float32.json

1. Throughput, pinned vs default engine: prefill tokens/s on a --prefill_tokens prompt (logits at
   the last position only) and decode tokens/s over --decode_tokens greedy steps.
2. Time to first token for a --library_tokens library plus a --query_tokens query: recompute
   (pinned engine prefills library + query) vs graft (restore the library's artifact from disk,
   verify it, graft it, prefill the query).
Each measurement is repeated --repeats times after a warm-up; medians and ratios are reported.
"""

from __future__ import annotations

import dataclasses
import os
import tempfile

from absl import app, flags, logging

from experiments import common, samples
from graft import artifact

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_integer('prefill_tokens', 2000, 'Prompt length for prefill throughput.')
  flags.DEFINE_integer('decode_tokens', 32, 'Greedy steps for decode throughput.')
  flags.DEFINE_integer('library_tokens', 2048, 'Library length for time to first token.')
  flags.DEFINE_integer('query_tokens', 64, 'Query length for time to first token.')
  flags.DEFINE_integer('repeats', 3, 'Timed repetitions (after one warm-up).')
  flags.DEFINE_string('output', None, 'Results JSON.', required=True)
  common.define_model_flags()
  common.define_engine_flags(cache_len=2560)


def throughput(engine, prompt: list[int], decode_tokens: int, repeats: int) -> dict:
  prefill = common.median_seconds(lambda: engine.prefill(prompt, logits='last'), repeats)
  seq, _ = engine.prefill(prompt, logits='last')
  decode = common.median_seconds(
      lambda: engine.generate(seq, decode_tokens + 1, stop_at_eos=False), repeats)
  return {'prefill_seconds': prefill, 'prefill_tokens_per_s': len(prompt) / prefill,
          'decode_seconds': decode, 'decode_tokens_per_s': decode_tokens / decode}


def time_to_first_token(engine, library: list[int], query: list[int], repeats: int) -> dict:
  recompute = common.median_seconds(lambda: engine.prefill(library + query, logits='last'),
                                    repeats)
  with tempfile.TemporaryDirectory() as scratch:
    path = os.path.join(scratch, 'library')
    seq, _ = engine.prefill(library, logits='none')
    artifact.save(path, engine, seq)

    def graft_then_query():
      restored = artifact.graft(engine, artifact.load(path, engine))
      return engine.extend(restored, query, logits='last')

    grafted = common.median_seconds(graft_then_query, repeats)
  return {'recompute_seconds': recompute, 'graft_seconds': grafted,
          'speedup': recompute / grafted}


def main(argv):
  del argv
  loaded = common.load_model()
  text = loaded.tokenizer.encode(samples.corpus_text())
  prompt = text[:FLAGS.prefill_tokens]
  library = text[:FLAGS.library_tokens]
  query = text[FLAGS.library_tokens:FLAGS.library_tokens + FLAGS.query_tokens]
  result = {'config': {**common.model_config_json(), 'prefill_tokens': FLAGS.prefill_tokens,
                       'decode_tokens': FLAGS.decode_tokens, 'library_tokens': FLAGS.library_tokens,
                       'query_tokens': FLAGS.query_tokens, 'repeats': FLAGS.repeats}}
  for kind in ('pinned', 'default'):
    engine = common.make_engine(loaded, engine=kind)
    result['config'][f'{kind}_engine'] = dataclasses.asdict(engine.pinned)
    result[kind] = throughput(engine, prompt, FLAGS.decode_tokens, FLAGS.repeats)
    logging.info('%s: %s', kind, result[kind])
  result['pinned_vs_default'] = {
      what: result['pinned'][f'{what}_tokens_per_s'] / result['default'][f'{what}_tokens_per_s']
      for what in ('prefill', 'decode')}
  pinned = common.make_engine(loaded, engine='pinned')
  result['time_to_first_token'] = time_to_first_token(pinned, library, query, FLAGS.repeats)
  result['environment'] = pinned.fingerprint['environment']
  common.write_json(FLAGS.output, result)
  for key in ('pinned', 'default'):
    print(f"{key:8s} prefill {result[key]['prefill_tokens_per_s']:7.1f} tok/s   "
          f"decode {result[key]['decode_tokens_per_s']:6.2f} tok/s")
  ratio = result['pinned_vs_default']
  print(f"pinned/default: prefill {ratio['prefill']:.3f}  decode {ratio['decode']:.3f}")
  ttft = result['time_to_first_token']
  print(f"time to first token: recompute {ttft['recompute_seconds']:.3f}s  "
        f"graft {ttft['graft_seconds']:.3f}s  speedup {ttft['speedup']:.1f}x")


if __name__ == '__main__':
  define_flags()
  app.run(main)
