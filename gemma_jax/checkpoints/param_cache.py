"""A cache of dequantized float32 parameters, as Orbax checkpoints keyed by the source's SHA-256.

Dequantizing the embedded GGUF takes tens of seconds; reading the cached float32 checkpoint takes
a fraction of a second. An entry holds the parameters (orbax_util.save_leaf_files: each
parameter's raw bytes one file), the tokenizer model and `hashes.json`: its format, the BLAKE3 of
every parameter's raw bytes and the SHA-256 of the tokenizer. Entries are written under a
staging name and renamed into place once complete (gemma_jax.files.atomic_directory), so a
reader sees a whole entry or none. Every read reads each parameter file once, hashing it as it
lands (gemma_jax/digest.py), and checks it against `hashes.json`; an entry that does not match
(a flipped bit, a truncated file, an entry of an older format) is reported, moved aside and
rebuilt from the source, never used.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from typing import Callable

from absl import logging
import numpy as np

from gemma_jax import digest, files
from gemma_jax.checkpoints import orbax_util, tree
from gemma_jax.compare import sha256_bytes
from gemma_jax.tokenizer import Tokenizer

_TOKENIZER_FILE = 'tokenizer.model'
_PARAMS_DIR = 'params'
_HASHES_FILE = 'hashes.json'
FORMAT = 'gemma-jax-param-cache/2'


class CacheEntryError(ValueError):
  """A cache entry that does not match the hashes written with it."""


def cache_root() -> str:
  """$GEMMA_JAX_CACHE, else ~/.cache/gemma_jax."""
  return os.environ.get('GEMMA_JAX_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'gemma_jax')


def _hashes(flat: dict[str, np.ndarray], tokenizer_proto: bytes) -> dict:
  return {'format': FORMAT,
          'params': {name: {'dtype': leaf.dtype.name, 'shape': list(leaf.shape),
                            'blake3': digest.hexdigest('blake3', leaf)}
                     for name, leaf in sorted(flat.items())},
          'tokenizer_sha256': sha256_bytes(np.frombuffer(tokenizer_proto, np.uint8))}


def _leaf_file(name: str, ndim: int) -> str:
  return os.path.join(_PARAMS_DIR, orbax_util.leaf_file(orbax_util.stored_name(name), ndim))


def save_entry(directory: str, params, tokenizer: Tokenizer) -> None:
  """Writes params (flat, float32), the tokenizer and their hashes into `directory` (which must
  not exist), atomically."""
  flat = {name: np.asarray(leaf, np.float32) for name, leaf in tree.flatten(params).items()}
  with files.atomic_directory(directory) as staging:
    orbax_util.save_leaf_files(os.path.join(staging, _PARAMS_DIR),
                               {orbax_util.stored_name(n): leaf for n, leaf in flat.items()})
    with open(os.path.join(staging, _TOKENIZER_FILE), 'wb') as f:
      f.write(tokenizer.model_proto)
    with open(os.path.join(staging, _HASHES_FILE), 'w') as f:
      json.dump(_hashes(flat, tokenizer.model_proto), f, indent=1)


def load_entry(directory: str):
  """(params as a float32 numpy tree, tokenizer) from an entry written by `save_entry`, verified
  against its hashes; raises CacheEntryError naming what does not match."""
  try:
    with open(os.path.join(directory, _HASHES_FILE)) as f:
      expected = json.load(f)
    if expected.get('format') != FORMAT:
      raise CacheEntryError(f'{directory} is of format {expected.get("format")!r}, not {FORMAT}')
    with open(os.path.join(directory, _TOKENIZER_FILE), 'rb') as f:
      proto = f.read()
    params = expected['params']
    flat = {name: np.empty(meta['shape'], np.float32) for name, meta in params.items()}
    where = {_leaf_file(name, leaf.ndim): name for name, leaf in flat.items()}
    digests = digest.read_files(directory, {f: flat[n].nbytes for f, n in where.items()},
                                'blake3', into={f: flat[n] for f, n in where.items()})
  except CacheEntryError:
    raise
  except Exception as e:  # missing or short files, damaged JSON
    raise CacheEntryError(f'{directory} cannot be read ({type(e).__name__}: {e})') from None
  bad = sorted(name for f, name in where.items()
               if params[name] != {'dtype': 'float32', 'shape': list(flat[name].shape),
                                   'blake3': digests[f]})
  if sha256_bytes(np.frombuffer(proto, np.uint8)) != expected['tokenizer_sha256']:
    bad.append('the tokenizer')
  if bad:
    raise CacheEntryError(f'{directory} does not match its hashes ({", ".join(bad[:3])}'
                          f'{" and more" if len(bad) > 3 else ""})')
  return tree.unflatten(flat), Tokenizer.from_model_proto(proto)


def cached_tokenizer(key: str, root: str | None = None) -> Tokenizer | None:
  """The tokenizer of entry `key` alone (without reading its parameters), verified against the
  entry's hashes; None when there is no such entry or it does not verify."""
  directory = os.path.join(root or cache_root(), key)
  try:
    with open(os.path.join(directory, _HASHES_FILE)) as f:
      expected = json.load(f)['tokenizer_sha256']
    with open(os.path.join(directory, _TOKENIZER_FILE), 'rb') as f:
      proto = f.read()
  except (OSError, ValueError, KeyError, TypeError):
    return None
  if sha256_bytes(np.frombuffer(proto, np.uint8)) != expected:
    return None
  return Tokenizer.from_model_proto(proto)


def cached(key: str, build: Callable[[], tuple], root: str | None = None):
  """Returns (params, tokenizer) for `key`, building and caching them on a miss or when the
  cached entry fails verification."""
  root = root or cache_root()
  final = os.path.join(root, key)
  if os.path.isdir(final):
    try:
      return load_entry(final)
    except CacheEntryError as e:
      logging.warning('parameter cache entry rejected, rebuilding it: %s', e)
      aside = os.path.join(root, f'.rejected.{key}.{uuid.uuid4().hex}')
      try:
        os.rename(final, aside)
      except FileNotFoundError:  # another process moved it first
        pass
      shutil.rmtree(aside, ignore_errors=True)
  params, tokenizer = build()
  try:
    save_entry(final, params, tokenizer)
  except FileExistsError:  # another process won the race; its entry is verified next time
    pass
  return params, tokenizer
