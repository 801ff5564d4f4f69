"""Logits of texts, for inspecting the model and comparing other implementations with it.

  python -m experiments.logits --input=FILE.jsonl --output=OUT.npz

Line i of the input is {"text": ...}. The text is tokenized with BOS and the output stores
`ids_{i}` (int32 token ids), `last_{i}` (float32 logits at the last position, the whole
vocabulary) and `argmax_{i}` (int32 argmax at every position).
"""

from __future__ import annotations

import io

from absl import flags
import numpy as np

from experiments import common
from experiments.texts import text_logits
from gemma_jax import files

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('input', None, 'JSONL input: one {"text": ...} per line.', required=True)
  common.define_output_flag('an uncompressed .npz of ids_i, last_i, argmax_i')
  common.define_model_flags()
  common.define_engine_flags()


def read_texts(path: str) -> list[str]:
  return [record['text'] for record in files.read_jsonl(path, ('text',))]


def main(argv):
  del argv
  texts = read_texts(FLAGS.input)
  engine = common.make_engine(common.load_model())
  output = common.output_path('logits', FLAGS.model, FLAGS.dtype, suffix='.npz')
  buffer = io.BytesIO()
  np.savez(buffer, **text_logits(engine, texts))
  common.write_checked(output, buffer.getvalue())
  print(f'wrote logits of {len(texts)} texts to {output}')


if __name__ == '__main__':
  define_flags()
  common.run(main)
