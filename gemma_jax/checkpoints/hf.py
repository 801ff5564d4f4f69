"""Conversion between gemma_jax parameters and Hugging Face tensor names and layouts.

HF stores every projection as a [out, in] matrix; gemma_jax keeps the official einsum layouts
(q_einsum [N, D, H], kv_einsum [2, K, D, H], attn_vec_einsum [N, H, D], gating_einsum [2, F, D],
linear [F, D]). GGUF files use the HF layouts under llama.cpp names, so the GGUF loader goes
through this module too.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Mapping

import numpy as np

from gemma_jax.checkpoints import tree
from gemma_jax.config import TransformerConfig


@dataclasses.dataclass(frozen=True)
class Entry:
  hf_name: str
  path: tuple  # path in the gemma_jax params tree
  to_hf: Callable[[np.ndarray], np.ndarray]
  from_hf: Callable[[np.ndarray], np.ndarray]


def _same(x):
  return x


def _transpose(x):
  return x.T


def _heads_to_hf(w):  # [N, D, H] -> [N * H, D]
  return w.transpose(0, 2, 1).reshape(-1, w.shape[1])


def _heads_from_hf(num_heads):  # [N * H, D] -> [N, D, H]
  return lambda m: m.reshape(num_heads, -1, m.shape[1]).transpose(0, 2, 1)


def _out_to_hf(w):  # [N, H, D] -> [D, N * H]
  return w.reshape(-1, w.shape[2]).T


def _out_from_hf(num_heads):  # [D, N * H] -> [N, H, D]
  return lambda m: m.T.reshape(num_heads, -1, m.shape[0])


def entries(config: TransformerConfig) -> list[Entry]:
  """Every parameter of `config`, with its HF name and layout conversions."""
  out = [Entry('model.embed_tokens.weight', ('embedder', 'input_embedding'), _same, _same),
         Entry('model.norm.weight', ('final_norm', 'scale'), _same, _same)]
  p, num_layers, d = config.per_layer_embed_dim, config.num_layers, config.embed_dim
  if p:
    out += [
        Entry('model.embed_tokens_per_layer.weight', ('embedder', 'per_layer_embeddings'),
              lambda w: w.reshape(w.shape[0], -1), lambda m: m.reshape(m.shape[0], num_layers, p)),
        Entry('model.per_layer_model_projection.weight',
              ('embedder', 'per_layer_model_projection', 'w'),
              lambda w: w.reshape(d, -1).T, lambda m: m.T.reshape(d, num_layers, p)),
        Entry('model.per_layer_projection_norm.weight',
              ('embedder', 'per_layer_projection_norm', 'scale'), _same, _same),
    ]
  n = config.num_heads
  for i in range(num_layers):
    spec = config.layer_spec(i)
    owns_kv = spec.kv_source == i
    k = spec.num_kv_heads
    pre, at = f'model.layers.{i}.', ('layers', i, 'attn')

    def norm(hf, *path):
      return Entry(pre + hf + '.weight', ('layers', i) + path + ('scale',), _same, _same)

    out += [
        Entry(pre + 'self_attn.q_proj.weight', at + ('q_einsum', 'w'), _heads_to_hf,
              _heads_from_hf(n)),
        Entry(pre + 'self_attn.o_proj.weight', at + ('attn_vec_einsum', 'w'), _out_to_hf,
              _out_from_hf(n)),
        norm('input_layernorm', 'pre_attention_norm'),
        norm('post_attention_layernorm', 'post_attention_norm'),
        norm('pre_feedforward_layernorm', 'pre_ffw_norm'),
        norm('post_feedforward_layernorm', 'post_ffw_norm'),
        Entry(pre + 'mlp.gate_proj.weight', ('layers', i, 'mlp', 'gating_einsum', 'w', 0), _same,
              _same),
        Entry(pre + 'mlp.up_proj.weight', ('layers', i, 'mlp', 'gating_einsum', 'w', 1), _same,
              _same),
        Entry(pre + 'mlp.down_proj.weight', ('layers', i, 'mlp', 'linear', 'w'), _transpose,
              _transpose),
    ]
    if config.use_qk_norm:
      out.append(norm('self_attn.q_norm', 'attn', 'query_norm'))
      if owns_kv:
        out.append(norm('self_attn.k_norm', 'attn', 'key_norm'))
    if owns_kv and spec.k_eq_v:
      out.append(Entry(pre + 'self_attn.k_proj.weight', at + ('k_einsum', 'w'), _heads_to_hf,
                       _heads_from_hf(k)))
    elif owns_kv:
      for c, name in enumerate(('k_proj', 'v_proj')):
        out.append(Entry(pre + f'self_attn.{name}.weight', at + ('kv_einsum', 'w', c),
                         _heads_to_hf, _heads_from_hf(k)))
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


def params_to_hf(params, config: TransformerConfig) -> dict[str, np.ndarray]:
  return {e.hf_name: np.ascontiguousarray(e.to_hf(tree.get(params, e.path)))
          for e in entries(config)}


def params_from_hf(tensors: Mapping[str, np.ndarray], config: TransformerConfig, *,
                   source: str, dtype=np.float32) -> dict:
  """Params from HF-named tensors; missing or misshapen tensors raise ValueError naming them."""
  missing = [e.hf_name for e in entries(config) if e.hf_name not in tensors]
  if missing:
    raise ValueError(f'{source}: {len(missing)} tensors that {config.name} needs are missing, '
                     f'e.g. {missing[:3]}')
  leaves = {e.path: np.asarray(e.from_hf(np.asarray(tensors[e.hf_name]))) for e in entries(config)}
  return tree.assemble(leaves, config, source=source, dtype=dtype)
