"""A cache of dequantized float32 parameters, as Orbax checkpoints keyed by the source's SHA-256.

Dequantizing the embedded GGUF takes tens of seconds; reading the cached float32 checkpoint takes a
few. Entries are written to a temporary directory beside their final place and renamed into it
once complete, so a reader sees a whole entry or none, and a failed or interrupted write leaves
nothing behind under the entry's name.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from typing import Callable

import numpy as np

from gemma_jax.checkpoints import orbax_util, tree
from gemma_jax.tokenizer import Tokenizer

_TOKENIZER_FILE = 'tokenizer.model'
_PARAMS_DIR = 'params'


def cache_root() -> str:
  """$GEMMA_JAX_CACHE, else ~/.cache/gemma_jax."""
  return os.environ.get('GEMMA_JAX_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'gemma_jax')


def save_entry(directory: str, params, tokenizer: Tokenizer) -> None:
  """Writes params (flat, float32) and the tokenizer into `directory`, which must not exist."""
  flat = {name: np.asarray(leaf, np.float32) for name, leaf in tree.flatten(params).items()}
  orbax_util.save(os.path.join(directory, _PARAMS_DIR), flat)
  with open(os.path.join(directory, _TOKENIZER_FILE), 'wb') as f:
    f.write(tokenizer.model_proto)


def load_entry(directory: str):
  """(params as a float32 numpy tree, tokenizer) from an entry written by `save_entry`."""
  flat = orbax_util.restore(os.path.join(directory, _PARAMS_DIR))
  return tree.unflatten(flat), Tokenizer.from_file(os.path.join(directory, _TOKENIZER_FILE))


def cached(key: str, build: Callable[[], tuple], root: str | None = None):
  """Returns (params, tokenizer) for `key`, building and caching them on a miss."""
  root = root or cache_root()
  final = os.path.join(root, key)
  if os.path.isdir(final):
    return load_entry(final)
  params, tokenizer = build()
  os.makedirs(root, exist_ok=True)
  staging = tempfile.mkdtemp(prefix=f'.{key}.', dir=root)
  try:
    entry = os.path.join(staging, 'entry')
    save_entry(entry, params, tokenizer)
    try:
      os.rename(entry, final)
    except OSError:
      if not os.path.isdir(final):  # another process may have won the race; that is fine
        raise
  finally:
    shutil.rmtree(staging, ignore_errors=True)
  return params, tokenizer
