"""Logits of texts, for inspecting the model and comparing other implementations with it.

  python -m experiments.logits --input=FILE.jsonl --output=OUT.npz

Line i of the input is {"text": ...}. The text is tokenized with BOS and the output stores
`ids_{i}` (int32 token ids), `last_{i}` (float32 logits at the last position, the whole
vocabulary) and `argmax_{i}` (int32 argmax at every position).
"""

from __future__ import annotations

import os

import numpy as np
from absl import app, flags, logging

from experiments import common

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


def write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  staging = common.staging_path(path, suffix='.npz')  # savez appends .npz to other names
  try:
    np.savez(staging, **arrays)
    os.replace(staging, path)
  except BaseException:
    if os.path.exists(staging):
      os.unlink(staging)
    raise


def main(argv):
  del argv
  texts = read_texts(FLAGS.input)
  engine = common.make_engine(common.load_model())
  write_npz(FLAGS.output, text_logits(engine, texts))
  print(f'wrote logits of {len(texts)} texts to {FLAGS.output}')


if __name__ == '__main__':
  define_flags()
  app.run(main)
