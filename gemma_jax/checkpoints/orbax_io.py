"""Orbax checkpoints in the official Gemma layout (the `gemma` reference package's parameters).

The official tree is flat at the top: one '/'-joined key per module, each holding that module's
leaves, e.g.

    transformer/embedder                   {input_embedding [V, D], per_layer_embeddings [V, L, P]}
    transformer/layer_3/attn/q_einsum      {w [N, D, H]}
    transformer/layer_3/attn/kv_einsum     {w [2, K, D, H]}  (N == K: qkv_einsum {w [3, N, D, H]})
    transformer/layer_3/attn/_query_norm   {scale [H]}       (Gemma 4: query_norm)
    transformer/layer_3/mlp/gating_einsum  {w [2, F, D]}     (Gemma 2 2B: [2, D, F])
    transformer/layer_3                    {skip_scale [1]}  (Gemma 4)
    transformer/final_norm                 {scale [D]}

gemma_jax stores projections [inputs..., outputs...] under its own names (`layers/3/attn/q_proj/w`
[D, N, H]; see gemma_jax/layers.py for why), so the mapping renames modules (`layers/{i}` <->
`layer_{i}`, q_proj <-> q_einsum, kv_proj <-> kv_einsum, k_proj <-> k_einsum, o_proj <->
attn_vec_einsum, gate_up_proj <-> gating_einsum, down_proj <-> linear) and permutes axes. Gemma 2/3
call the QK norms `_query_norm` and `_key_norm`; Gemma 4 drops the underscore.
On load, a fused `qkv_einsum` is split into `q_einsum` and `kv_einsum`, and a [2, D, F] gating
weight is transposed, each only when the shapes say so. Arrays are restored as NumPy, whatever
sharding they were saved with.
"""

from __future__ import annotations

import os

import jax
import numpy as np
from numpy.typing import DTypeLike

from gemma_jax import model
from gemma_jax.checkpoints import tree
from gemma_jax.config import Family, TransformerConfig

_ROOT = 'transformer'
_STACKED = 'transformer/stacked_layers'


def _ocp():
  import orbax.checkpoint as ocp  # imported lazily: it is slow to import
  return ocp


# Internal module -> (official module, axis permutation from internal to official layout).
_MODULES = {
    'q_proj': ('q_einsum', (1, 0, 2)),  # [D, N, H] -> [N, D, H]
    'k_proj': ('k_einsum', (1, 0, 2)),  # [D, K, H] -> [K, D, H]
    'kv_proj': ('kv_einsum', (1, 2, 0, 3)),  # [D, 2, K, H] -> [2, K, D, H]
    'o_proj': ('attn_vec_einsum', None),  # [N, H, D] both
    'gate_up_proj': ('gating_einsum', (1, 2, 0)),  # [D, 2, F] -> [2, F, D]
    'down_proj': ('linear', None),  # [F, D] both
}


def _module_renames(config: TransformerConfig) -> dict[str, str]:
  """Internal module name -> official name."""
  renames = {name: official for name, (official, _) in _MODULES.items()}
  if config.family is not Family.GEMMA4:
    renames.update(query_norm='_query_norm', key_norm='_key_norm')
  return renames


def official_name(internal: str, config: TransformerConfig) -> tuple[str, str]:
  """'layers/3/attn/query_norm/scale' -> ('transformer/layer_3/attn/_query_norm', 'scale')."""
  parts = internal.split('/')
  if parts[0] == 'layers':
    parts = [f'layer_{parts[1]}'] + parts[2:]
  renames = _module_renames(config)
  parts = [renames.get(p, p) for p in parts]
  return '/'.join([_ROOT] + parts[:-1]), parts[-1]


def _permutation(internal: str) -> tuple[int, ...] | None:
  """Axis permutation taking the internal layout of this leaf to the official one."""
  module = internal.split('/')[-2] if '/' in internal else ''
  return _MODULES.get(module, (None, None))[1]


def to_official(params: dict, config: TransformerConfig) -> dict[str, dict[str, np.ndarray]]:
  """The official flat tree {module key: {leaf name: array}} of `params` (each leaf any shape
  the official layout gives it, e.g. attn/q_einsum/w [N, D, H])."""
  out: dict[str, dict[str, np.ndarray]] = {}
  for internal, leaf in tree.flatten(params).items():
    key, leaf_name = official_name(internal, config)
    value, perm = np.asarray(leaf), _permutation(internal)
    out.setdefault(key, {})[leaf_name] = value if perm is None else value.transpose(perm)
  return out


def _split_fused_qkv(modules: dict, config: TransformerConfig, source: str) -> None:
  """Replaces each `attn/qkv_einsum` {w [3, N, D, H]} by q_einsum [N, D, H] and kv_einsum
  [2, N, D, H] (the fused layout exists only when every head has its own K and V)."""
  for key in [k for k in modules if k.endswith('/attn/qkv_einsum')]:
    w = np.asarray(modules.pop(key)['w'])
    if w.ndim != 4 or w.shape[0] != 3:
      raise ValueError(f'{source}: {key}/w has shape {w.shape}; a fused QKV projection is '
                       '[3, N, D, H]')
    if w.shape[1] != config.num_heads:
      raise ValueError(f'{source}: {key}/w has {w.shape[1]} heads, but {config.name} has '
                       f'{config.num_heads} query heads')
    prefix = key[:-len('qkv_einsum')]
    modules[prefix + 'q_einsum'] = {'w': w[0]}
    modules[prefix + 'kv_einsum'] = {'w': w[1:]}


def _flat_leaves(modules: dict, source: str) -> dict[str, np.ndarray]:
  """{official key: {leaf: array}} -> {'key/leaf': array}, checking the nesting depth."""
  flat = {}
  for key, leaves in modules.items():
    if not isinstance(leaves, dict):
      raise ValueError(f'{source}: {key} holds {type(leaves).__name__}, not a dict of arrays; '
                       'is this an official Gemma Orbax checkpoint?')
    for leaf_name, value in leaves.items():
      if isinstance(value, dict):
        raise ValueError(f'{source}: {key}/{leaf_name} is nested deeper than the official '
                         'layout ({module key: {leaf: array}})')
      flat[f'{key}/{leaf_name}'] = value
  return flat


def _is_layer_weight(name: str) -> bool:
  """Weights under transformer/layer_{i}: an unused one means another model structure. Other
  unused names (multimodal parts such as embedder/mm_input_projection or a vision encoder) are
  not the text model's and are ignored."""
  return name.startswith(_ROOT + '/layer_')


def _unused_kv_weight(name: str, config: TransformerConfig) -> bool:
  """K/V weights stored for a KV-shared layer, which reads another layer's cache instead."""
  layer = name[len(_ROOT + '/layer_'):].split('/', 1)[0]
  if not layer.isdigit() or int(layer) >= config.num_layers:
    return False
  i = int(layer)
  kv_modules = ('kv_einsum', 'k_einsum', 'key_norm', '_key_norm')
  return (config.kv_sources[i] != i
          and any(f'/attn/{m}/' in name for m in kv_modules))


def from_official(modules: dict, config: TransformerConfig, *, source: str,
                  dtype: DTypeLike = np.float32) -> dict:
  """Params of `config` from the official flat tree; missing, misshapen or surplus weights raise
  ValueError naming them."""
  if any(k == _STACKED or k.startswith(_STACKED + '/') for k in modules):
    raise ValueError(f'{source} uses the stacked layout ({_STACKED}/...), which gemma_jax does not '
                     'read; convert it to per-layer keys (transformer/layer_{i}/...) first')
  if not any(k == _ROOT or k.startswith(_ROOT + '/') for k in modules):
    raise ValueError(f'{source} has no {_ROOT}/... keys (found e.g. {sorted(modules)[:3]}); it is '
                     'not a Gemma checkpoint in the official Orbax layout')
  modules = dict(modules)
  _split_fused_qkv(modules, config, source)
  stored = _flat_leaves(modules, source)
  expected = tree.flatten(model.abstract_params(config))
  leaves, used = {}, set()
  for internal, struct in expected.items():
    name = '/'.join(official_name(internal, config))
    if name not in stored:
      raise ValueError(f'{source}: weight {name} (for {internal} of {config.name}) is missing')
    value = np.asarray(stored[name])
    used.add(name)
    perm = _permutation(internal)
    if perm is not None:
      official_shape = tuple(struct.shape[a] for a in perm)
      if internal.endswith('mlp/gate_up_proj/w') and value.shape != official_shape and (
          value.shape == (official_shape[0], official_shape[2], official_shape[1])):
        value = value.transpose(0, 2, 1)  # Gemma 2 2B stores [2, D, F]
      if value.ndim == len(perm):
        value = value.transpose(np.argsort(perm))
    path = tuple(int(p) if p.isdigit() else p for p in internal.split('/'))
    leaves[(path, None)] = value
  surplus = sorted(n for n in set(stored) - used if _is_layer_weight(n)
                   and not _unused_kv_weight(n, config))
  if surplus:
    raise ValueError(f'{source}: {len(surplus)} weights have no place in {config.name}, e.g. '
                     f'{surplus[:3]}; is the checkpoint of another model?')
  return tree.assemble(leaves, config, source=source, dtype=dtype)


def _numpy_restore_args(checkpointer, path: str):
  """RestoreArgs asking for NumPy arrays for every leaf in the checkpoint's metadata."""
  ocp = _ocp()
  metadata = checkpointer.metadata(path)
  metadata = getattr(metadata, 'item_metadata', metadata)
  metadata = getattr(metadata, 'tree', metadata)
  return jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), metadata,
                      is_leaf=lambda x: not isinstance(x, dict))


def load_orbax(path: str, config: TransformerConfig, dtype: DTypeLike = np.float32) -> dict:
  """Params (a numpy tree in `dtype`) from an official-layout Orbax checkpoint directory."""
  if not os.path.isdir(path):
    raise FileNotFoundError(f'Orbax checkpoint directory not found: {path}')
  ocp = _ocp()
  checkpointer = ocp.PyTreeCheckpointer()
  try:
    restore_args = _numpy_restore_args(checkpointer, path)
    restored = checkpointer.restore(path, args=ocp.args.PyTreeRestore(restore_args=restore_args))
  except (FileNotFoundError, ValueError, KeyError) as e:
    raise ValueError(f'{path} is not a readable Orbax checkpoint ({type(e).__name__}: {e})') from e
  if not isinstance(restored, dict):
    raise ValueError(f'{path} restored to a {type(restored).__name__}, not a dict of modules')
  return from_official(restored, config, source=path, dtype=dtype)


def save_orbax_official(params: dict, config: TransformerConfig, path: str) -> None:
  """Writes params as an Orbax checkpoint in the official layout (`path` must not exist)."""
  _ocp().PyTreeCheckpointer().save(os.path.abspath(path), to_official(params, config))
