"""Fidelity of the relative RoPE mode to the model as trained: 'relative' against 'float'.

  python -m experiments.rope_fidelity                      # the embedded 270M
  python -m experiments.rope_fidelity --model=tiny_gemma4 --weights=random:0 --samples=2

The same weights run under both modes (gemma_jax.rope.MODES) in one engine mode (--engine; the
committed result at 9a6ccc7 ran --engine=default). In exact
arithmetic the two compute one function; in float32 they round the angles differently (one
rotation by the offset's angle against two by the positions'), and this measures how far that
moves the model. Texts: the HF parity prompts (experiments/peers/parity.py), --samples library +
query texts of the exactness experiments (experiments/samples.py), and --ppl_texts passages of
--ppl_tokens tokens of the corpus for perplexity. Per text: the largest |Δlogit| over every
position, the largest and mean KL(float || relative) per position, argmax agreement, and whether
the greedy continuations of --continuation_tokens tokens are equal (and where they part).
Perplexity: of each passage's next tokens under each mode.

Output: schema rope_fidelity (analysis/results.py), in --output or the run folder
(runs/rope_fidelity/).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np
from absl import flags, logging

from experiments import common, samples
from experiments.peers.parity import PROMPTS
from gemma_jax import compare
from graft import shift
from graft.engine import Engine

FLAGS = flags.FLAGS
MODES = ('float', 'relative')


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_integer('samples', 8, 'Samples: library + query texts of the exactness '
                       'experiments.',
                       lower_bound=1)
  flags.DEFINE_integer('seed', 0, 'Seed of the sample draw.', lower_bound=0)
  flags.DEFINE_integer('continuation_tokens', 64, 'Greedy tokens compared after each text.',
                       lower_bound=1)
  flags.DEFINE_integer('ppl_texts', 8, 'Corpus passages whose perplexity is measured.',
                       lower_bound=0)
  flags.DEFINE_integer('ppl_tokens', 512, 'Tokens per perplexity passage.', lower_bound=2)
  common.define_output_flag()
  common.define_model_flags()
  common.define_engine_flags()


OWN_DEFAULTS = {
    'samples': 'eight exactness texts beside the nine parity prompts',
    'continuation_tokens': 'continuations long enough to part where the modes differ',
}


def compare_text(engines: dict[str, Engine], ids: list[int], continuation_tokens: int) -> dict:
  """One text under both modes: logits at every position and a greedy continuation."""
  out = {}
  for mode, engine in engines.items():
    ctx, logits = engine.extend(engine.empty(), ids, logits=len(ids))
    _, continuation = engine.generate(ctx, continuation_tokens, stop_at_eos=False)
    out[mode] = (np.asarray(logits, np.float32), continuation)
  (ref, ref_cont), (rel, rel_cont) = out['float'], out['relative']
  kl = compare.kl_per_position(ref, rel)
  parted = next((i for i, (a, b) in enumerate(zip(ref_cont, rel_cont)) if a != b), None)
  return {'tokens': len(ids), 'max_abs': compare.max_abs(ref, rel),
          'max_abs_over_max_logit': float(compare.max_abs(ref, rel) / np.max(np.abs(ref))),
          'max_kl': float(np.max(kl)), 'mean_kl': float(np.mean(kl)),
          'argmax_agreement': compare.argmax_agreement(ref, rel),
          'continuation_equal': ref_cont == rel_cont, 'continuation_tokens': len(ref_cont),
          'continuations_part_at': parted}


def perplexity(engine: Engine, passages: list[list[int]]) -> float:
  """exp of the mean negative log-likelihood of every passage's next tokens (passages of at
  least two tokens)."""
  nll, count = 0.0, 0
  for ids in passages:
    _, logits = engine.extend(engine.empty(), ids, logits=len(ids))
    logp = compare.log_softmax(np.asarray(logits, np.float32)[:-1])
    nll -= float(np.sum(logp[np.arange(len(ids) - 1), ids[1:]]))
    count += len(ids) - 1
  return math.exp(nll / count)


def main(argv):
  del argv
  loaded = common.load_model()
  engines = {mode: common.make_engine(shift.with_config(loaded, rope_mode=mode))
             for mode in MODES}
  tokenizer = loaded.tokenizer
  texts = [(f'parity:{name}', tokenizer.encode(text)) for name, text in PROMPTS.items()]
  for i, s in enumerate(samples.draw(tokenizer, FLAGS.samples, seed=FLAGS.seed,
                                     window=loaded.config.sliding_window)):
    texts.append((f'sample:{i}', list(s.library) + list(s.query)))
  rows = []
  for n, (name, ids) in enumerate(texts):
    row = {'text': name, **compare_text(engines, ids, FLAGS.continuation_tokens)}
    rows.append(row)
    logging.info('[%d/%d] %s: %d tokens, max|Δlogit| %.3g, max KL %.3g, argmax %.4f, '
                 'continuation equal %s', n + 1, len(texts), name, row['tokens'], row['max_abs'],
                 row['max_kl'], row['argmax_agreement'], row['continuation_equal'])
  corpus = tokenizer.encode(samples.corpus_text())
  passages = [corpus[i * FLAGS.ppl_tokens:(i + 1) * FLAGS.ppl_tokens]
              for i in range(min(FLAGS.ppl_texts, len(corpus) // FLAGS.ppl_tokens))]
  ppl = ({mode: perplexity(engine, passages) for mode, engine in engines.items()}
         if passages else None)  # --ppl_texts=0: no perplexity measured
  summary = {'texts': len(rows), 'max_abs': max(r['max_abs'] for r in rows),
             'max_abs_over_max_logit': max(r['max_abs_over_max_logit'] for r in rows),
             'max_kl': max(r['max_kl'] for r in rows),
             'min_argmax_agreement': min(r['argmax_agreement'] for r in rows),
             'continuations_equal': sum(r['continuation_equal'] for r in rows),
             'perplexity': ppl, 'perplexity_passages': len(passages),
             'perplexity_tokens': sum(len(p) - 1 for p in passages)}
  config = {**common.model_config_json(), 'modes': list(MODES), 'samples': FLAGS.samples,
            'seed': FLAGS.seed, 'continuation_tokens': FLAGS.continuation_tokens,
            'ppl_texts': FLAGS.ppl_texts, 'ppl_tokens': FLAGS.ppl_tokens,
            'engine_config': dataclasses.asdict(engines['float'].engine_config),
            'model_fingerprint': engines['float'].model_fingerprint['sha256']}
  output = common.output_path('rope_fidelity', FLAGS.model, FLAGS.dtype)
  common.write_result(output, 'rope_fidelity', {'config': config, 'texts': rows,
                                                'summary': summary})
  print(f"relative vs float on {len(rows)} texts: max |Δlogit| {summary['max_abs']:.3g} "
        f"({summary['max_abs_over_max_logit']:.2g} of max |logit|), max KL "
        f"{summary['max_kl']:.3g}, argmax agreement >= {summary['min_argmax_agreement']:.4f}, "
        f"{summary['continuations_equal']}/{len(rows)} continuations equal"
        + (f"; perplexity float {ppl['float']:.4f}, relative {ppl['relative']:.4f}" if ppl
           else ''))


if __name__ == '__main__':
  define_flags()
  common.run(main)
