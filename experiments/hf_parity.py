"""This project's Gemma 3 270M against HF transformers on the same GGUF, prompt by prompt.

  python -m experiments.hf_parity --output=results/hf_parity_gemma3_270m_float32.json
  python -m experiments.hf_parity --rope=relative   # the same model scored from offsets

Ours runs from the cached dequantized GGUF; HF's Gemma3ForCausalLM reads the same file with its
own GGUF loader and dequantization. Both get the same token ids (ours, with BOS), so tokenizer
differences do not enter. Both compute in float32 but not in the same order (HF precomputes
inverse frequencies and cos/sin tables, and blocks its matmuls its own way), so logits agree to
float32 rounding, not bit for bit. Per prompt: argmax agreement over every position, the
last-position and all-position max |difference| relative to max |logit|, and whether the
24-token greedy continuations are identical. tests/test_hf_parity.py asserts what the README
claims from this result.
"""

from __future__ import annotations

from absl import flags, logging
import jax

from experiments import common
from experiments.peers.parity import GREEDY_STEPS, PROMPTS, compare_prompt, load_hf
from gemma_jax import weights
from gemma_jax.config import get_config

FLAGS = flags.FLAGS

def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  common.define_output_flag()
  common.define_rope_flag()


def main(argv):
  del argv
  import torch  # optional (the test extra), and heavy
  import transformers
  loaded = weights.load(get_config('gemma3_270m').replace(rope_mode=FLAGS.rope), 'embedded',
                        'float32')
  hf_model = load_hf()
  rows = []
  for name, text in PROMPTS.items():
    row = {'name': name, **compare_prompt(loaded, hf_model, text)}
    rows.append(row)
    logging.info('%s: %d tokens, argmax agreement %.4f, last-position max|diff| %.2e of '
                 'max|logit|, continuation equal %s', name, row['tokens'],
                 row['argmax_agreement'], row['max_abs_over_max_logit'],
                 row['continuation_equal'])
  summary = {'prompts': len(rows),
             'min_argmax_agreement': min(r['argmax_agreement'] for r in rows),
             'max_abs_over_max_logit': max(r['max_abs_over_max_logit'] for r in rows),
             'continuations_equal': sum(r['continuation_equal'] for r in rows)}
  config = {'model': 'gemma3_270m', 'weights': 'embedded', 'dtype': 'float32',
            'rope': FLAGS.rope, 'greedy_steps': GREEDY_STEPS, 'torch': torch.__version__,
            'transformers': transformers.__version__, 'jax': jax.__version__}
  output = common.output_path(
      'hf_parity', 'gemma3_270m', 'float32', FLAGS.rope if FLAGS.rope != 'float' else '')
  common.write_result(output, 'hf_parity',
                      {'config': config, 'prompts': rows, 'summary': summary})
  print(summary)


if __name__ == '__main__':
  define_flags()
  common.run(main)
