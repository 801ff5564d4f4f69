"""Helpers over the params tree: flat '/'-joined names, and assembly checked against the config."""

from __future__ import annotations

from typing import Mapping

import jax
import numpy as np

from gemma_jax import model


def _key(entry) -> str:
  return str(getattr(entry, 'key', getattr(entry, 'idx', entry)))


def flatten(params) -> dict[str, np.ndarray]:
  """{'layers/0/attn/q_einsum/w': array, ...}, sorted by name."""
  flat = {'/'.join(_key(k) for k in path): leaf
          for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]}
  return dict(sorted(flat.items()))


def unflatten(flat: Mapping[str, np.ndarray]) -> dict:
  out: dict = {}
  for name, leaf in flat.items():
    parts = [int(p) if p.isdigit() else p for p in name.split('/')]
    node = out
    for part in parts[:-1]:
      node = node.setdefault(part, {})
    node[parts[-1]] = leaf
  return out


def get(params, path: tuple):
  """The leaf at `path`; trailing integers past a leaf index into the array."""
  node = params
  for part in path:
    node = node[part]
  return np.asarray(node)


def assemble(leaves: Mapping[tuple, np.ndarray], config, *, source: str, dtype) -> dict:
  """Builds the params tree of `config` from leaves keyed by path. A leaf may also be given as
  slices `path + (c,)` along its first axis (e.g. the gate and up halves of gating_einsum).
  Missing leaves and wrong shapes raise ValueError naming them."""
  expected = flatten(model.abstract_params(config))
  flat = {}
  for name, struct in expected.items():
    path = tuple(int(p) if p.isdigit() else p for p in name.split('/'))
    if path in leaves:
      value = np.asarray(leaves[path])
    elif path + (0,) in leaves:
      value = np.stack([np.asarray(leaves[path + (c,)]) for c in range(struct.shape[0])])
    else:
      raise ValueError(f'{source}: no weights for {name} of {config.name}')
    if value.shape != struct.shape:
      raise ValueError(f'{source}: {name} has shape {value.shape}, but {config.name} expects '
                       f'{struct.shape}')
    flat[name] = value.astype(dtype)
  return unflatten(flat)
