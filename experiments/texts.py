"""Text in, text or logits out: what the generate and logits entry points (and the main job) do."""

from __future__ import annotations

from absl import logging
import jax
import numpy as np


def continue_text(engine, prompt: str, max_new_tokens: int, temperature: float = 0.0,
                  seed: int = 0, on_first_logits=None) -> str:
  """The continuation of `prompt`; on_first_logits() is called when the prompt's logits are
  computed (before the first new token is chosen)."""
  if not prompt:
    raise ValueError('--prompt is empty: there is nothing to continue')
  tokenizer = engine.loaded.tokenizer
  seq, logits = engine.prefill(tokenizer.encode(prompt), logits='last')
  if on_first_logits:
    jax.block_until_ready(logits)
    on_first_logits()
  _, new_tokens = engine.generate(seq, max_new_tokens, temperature=temperature, seed=seed)
  return tokenizer.decode(new_tokens)


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
