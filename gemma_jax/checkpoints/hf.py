"""Conversion between gemma_jax parameters and Hugging Face tensor names and layouts.

HF stores every projection as an [out, in] matrix; gemma_jax stores [in..., out...] (q_proj
[D, N, H], kv_proj [D, 2, K, H], o_proj [N, H, D], gate_up_proj [D, 2, F], down_proj [F, D]).
Two HF tensors can fill one gemma_jax weight: k_proj and v_proj are the halves of kv_proj, gate
and up the halves of gate_up_proj (each a `part`: an index along an axis). GGUF files use the HF
layouts under llama.cpp names, so the GGUF loader goes through this module too.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np
from numpy.typing import DTypeLike

from gemma_jax.checkpoints import tree
from gemma_jax.config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class Entry:
  """One HF tensor: its name, where it lives in the params tree, and the layout conversions
  both ways."""

  hf_name: str
  path: tuple  # path in the gemma_jax params tree
  to_hf: Callable[[np.ndarray], np.ndarray]
  from_hf: Callable[[np.ndarray], np.ndarray]
  part: tuple[int, int] | None = None  # (axis, index) when the HF tensor is a slice of the leaf


def _same(x):
  return x


def _transpose(x):
  return x.T


def _in_to_hf(w):  # [D, *out] -> [prod(out), D]
  return w.reshape(w.shape[0], -1).T


def _in_from_hf(*out):  # [prod(out), D] -> [D, *out]
  return lambda m: m.T.reshape(m.shape[1], *out)


def _out_to_hf(w):  # [*in, D] -> [D, prod(in)]
  return w.reshape(-1, w.shape[-1]).T


def _out_from_hf(*in_shape):  # [D, prod(in)] -> [*in, D]
  return lambda m: m.T.reshape(*in_shape, m.shape[0])


def entries(config: TransformerConfig) -> list[Entry]:
  """Every parameter of `config`, with its HF name and layout conversions."""
  out = [Entry('model.embed_tokens.weight', ('embedder', 'input_embedding'), _same, _same),
         Entry('model.norm.weight', ('final_norm', 'scale'), _same, _same)]
  p, num_layers = config.per_layer_embed_dim, config.num_layers
  if p:
    out += [
        Entry('model.embed_tokens_per_layer.weight', ('embedder', 'per_layer_embeddings'),
              lambda w: w.reshape(w.shape[0], -1), lambda m: m.reshape(m.shape[0], num_layers, p)),
        Entry('model.per_layer_model_projection.weight',
              ('embedder', 'per_layer_model_projection', 'w'), _in_to_hf,
              _in_from_hf(num_layers, p)),
        Entry('model.per_layer_projection_norm.weight',
              ('embedder', 'per_layer_projection_norm', 'scale'), _same, _same),
    ]
  n = config.num_heads
  for i in range(num_layers):
    spec = config.layer_spec(i)
    owns_kv = spec.kv_source == i
    k, h = spec.num_kv_heads, spec.head_dim
    pre, at, mlp = f'model.layers.{i}.', ('layers', i, 'attn'), ('layers', i, 'mlp')

    def norm(hf, *path):
      return Entry(pre + hf + '.weight', ('layers', i) + path + ('scale',), _same, _same)

    out += [
        Entry(pre + 'self_attn.q_proj.weight', at + ('q_proj', 'w'), _in_to_hf, _in_from_hf(n, h)),
        Entry(pre + 'self_attn.o_proj.weight', at + ('o_proj', 'w'), _out_to_hf,
              _out_from_hf(n, h)),
        norm('input_layernorm', 'pre_attention_norm'),
        norm('post_attention_layernorm', 'post_attention_norm'),
        norm('pre_feedforward_layernorm', 'pre_ffw_norm'),
        norm('post_feedforward_layernorm', 'post_ffw_norm'),
        Entry(pre + 'mlp.gate_proj.weight', mlp + ('gate_up_proj', 'w'), _transpose, _transpose,
              part=(1, 0)),
        Entry(pre + 'mlp.up_proj.weight', mlp + ('gate_up_proj', 'w'), _transpose, _transpose,
              part=(1, 1)),
        Entry(pre + 'mlp.down_proj.weight', mlp + ('down_proj', 'w'), _transpose, _transpose),
    ]
    if config.use_qk_norm:
      out.append(norm('self_attn.q_norm', 'attn', 'query_norm'))
      if owns_kv:
        out.append(norm('self_attn.k_norm', 'attn', 'key_norm'))
    if owns_kv and spec.k_eq_v:
      out.append(Entry(pre + 'self_attn.k_proj.weight', at + ('k_proj', 'w'), _in_to_hf,
                       _in_from_hf(k, h)))
    elif owns_kv:
      for c, name in enumerate(('k_proj', 'v_proj')):
        out.append(Entry(pre + f'self_attn.{name}.weight', at + ('kv_proj', 'w'), _in_to_hf,
                         _in_from_hf(k, h), part=(1, c)))
    if p:
      out += [
          Entry(pre + 'per_layer_input_gate.weight', ('layers', i, 'per_layer_input_gate', 'w'),
                _transpose, _transpose),
          Entry(pre + 'per_layer_projection.weight', ('layers', i, 'per_layer_projection', 'w'),
                _transpose, _transpose),
          norm('post_per_layer_input_norm', 'post_per_layer_input_norm'),
      ]
    if config.use_skip_scale:
      out.append(Entry(pre + 'layer_scalar', ('layers', i, 'skip_scale'), _same, _same))
  return out


def params_to_hf(params: dict, config: TransformerConfig) -> dict[str, np.ndarray]:
  """Every parameter under its HF name, in HF's layout (projections [out, in]; each tensor any
  shape its HF name has)."""
  return {e.hf_name: np.ascontiguousarray(e.to_hf(tree.get(params, e.path, e.part)))
          for e in entries(config)}


def params_from_hf(tensors: Mapping[str, np.ndarray], config: TransformerConfig, *,
                   source: str, dtype: DTypeLike = np.float32) -> dict:
  """Params from HF-named tensors (each any shape its HF name has, converted to the params
  tree's layout, e.g. q_proj [D, N, H]); missing or misshapen tensors raise ValueError naming
  them."""
  missing = [e.hf_name for e in entries(config) if e.hf_name not in tensors]
  if missing:
    raise ValueError(f'{source}: {len(missing)} tensors that {config.name} needs are missing, '
                     f'e.g. {missing[:3]}')
  leaves = {(e.path, e.part): np.asarray(e.from_hf(np.asarray(tensors[e.hf_name])))
            for e in entries(config)}
  return tree.assemble(leaves, config, source=source, dtype=dtype)
