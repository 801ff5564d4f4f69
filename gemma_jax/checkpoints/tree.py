"""Helpers over the params tree: flat '/'-joined names, and assembly checked against the config."""

from __future__ import annotations

import hashlib
from typing import Any, Iterable, Mapping

import jax
import numpy as np
from numpy.typing import DTypeLike

from gemma_jax import model
from gemma_jax.config import TransformerConfig


def path_name(path: tuple) -> str:
  """The flat name ('layers/0/attn/q_proj/w') of a key path of the params tree."""
  return '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)


def flatten(params: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """{'layers/0/attn/q_einsum/w': array, ...}, sorted by name (each leaf any shape: the
  parameter's own)."""
  flat = {path_name(path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  return dict(sorted(flat.items()))


def params_digest(params: Mapping[str, Any]) -> str:
  """SHA-256 over every parameter: name, dtype, shape and raw bytes, in sorted name order (a
  tree or a flat {name: array}). What the model fingerprint binds."""
  return digest_of(flatten(params).items())  # a flat tree's '/' names are its own


def digest_of(named: Iterable[tuple[str, Any]]) -> str:
  """`params_digest` of (name, array) pairs given in sorted name order, one at a time (so that
  they need not all be held at once: graft.engine.drawn)."""
  h = hashlib.sha256()
  for name, leaf in named:
    array = np.ascontiguousarray(np.asarray(leaf))
    h.update(f'{name}|{array.dtype.name}|{array.shape}|'.encode())
    h.update(array.reshape(-1).view(np.uint8).data)  # the bytes in place, not a copy
  return h.hexdigest()


def unflatten(flat: Mapping[str, Any]) -> dict:
  """The nested params tree of a flat {'layers/0/...': array} (`flatten`'s inverse; numeric
  parts become int keys, as the NNX state has them; leaves of any shape, unchanged)."""
  out: dict = {}
  for name, leaf in flat.items():
    parts = [int(p) if p.isdigit() else p for p in name.split('/')]
    node = out
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = leaf
  return out


def get(params: Mapping[str, Any], path: tuple, part: tuple[int, int] | None = None) -> np.ndarray:
  """The leaf at `path` (any shape), or its slice `index` along `axis` when
  part = (axis, index)."""
  node = params
  for key in path:
    node = node[key]
  leaf = np.asarray(node)
  return leaf if part is None else np.take(leaf, part[1], axis=part[0])


def assemble(leaves: Mapping[tuple, np.ndarray], config: TransformerConfig, *, source: str,
             dtype: DTypeLike) -> dict:
  """Builds the params tree of `config` from leaves keyed by (path, part): part None for a whole
  leaf, (axis, index) for slices that are stacked along `axis` (e.g. the gate and up halves of
  gate_up_proj); each leaf of any shape, checked against `abstract_params(config)`. Missing
  leaves and wrong shapes raise ValueError naming them."""
  pieces: dict[tuple, dict] = {}
  for (path, part), value in leaves.items():
    pieces.setdefault(path, {})[part] = np.asarray(value)
  flat = {}
  for name, struct in flatten(model.abstract_params(config)).items():
    path = tuple(int(p) if p.isdigit() else p for p in name.split('/'))
    parts = pieces.get(path)
    if not parts:
      raise ValueError(f'{source}: no weights for {name} of {config.name}')
    if None in parts:
      value = parts[None]
    else:
      axis = next(iter(parts))[0]
      missing = [c for c in range(struct.shape[axis]) if (axis, c) not in parts]
      if missing:
        raise ValueError(f'{source}: {name} of {config.name} lacks parts {missing} along axis '
                         f'{axis}')
      value = np.stack([parts[(axis, c)] for c in range(struct.shape[axis])], axis=axis)
    if value.shape != struct.shape:
      raise ValueError(f'{source}: {name} has shape {value.shape}, but {config.name} expects '
                       f'{struct.shape}')
    flat[name] = np.asarray(value, dtype)  # a copy only where the dtype changes
  return unflatten(flat)
