"""Logits of texts, for inspecting the model and comparing other implementations with it.

  python -m experiments.logits --input=FILE.jsonl --output=OUT.npz

Line i of the input is {"text": ...}. The text is tokenized with BOS and the output stores
`ids_{i}` (int32 token ids), `last_{i}` (float32 logits at the last position, the whole
vocabulary) and `argmax_{i}` (int32 argmax at every position).
"""

from __future__ import annotations

import numpy as np
from absl import app, flags, logging

from experiments import common
from gemma_jax import files

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('input', None, 'JSONL file, one {"text": ...} per line.', required=True)
  flags.DEFINE_string('output', None, 'Output .npz file.', required=True)
  common.define_model_flags()
  common.define_engine_flags()


def read_texts(path: str) -> list[str]:
  return [record['text'] for record in common.read_jsonl(path, ('text',))]


def text_logits(engine, texts: list[str]) -> dict[str, np.ndarray]:
  arrays = {}
  for i, text in enumerate(texts):
    ids = engine.loaded.tokenizer.encode(text)
    _, logits = engine.prefill(ids, logits='all')
    arrays[f'ids_{i}'] = np.asarray(ids, np.int32)
    arrays[f'last_{i}'] = logits[-1].astype(np.float32)
    arrays[f'argmax_{i}'] = np.argmax(logits, axis=-1).astype(np.int32)
    logging.info('text %d/%d: %d tokens', i + 1, len(texts), len(ids))
  return arrays


def main(argv):
  del argv
  texts = read_texts(FLAGS.input)
  engine = common.make_engine(common.load_model())
  files.write_npz(FLAGS.output, text_logits(engine, texts))
  print(f'wrote logits of {len(texts)} texts to {FLAGS.output}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
