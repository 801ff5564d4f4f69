"""GGUF checkpoints (llama.cpp), read and written with the `gguf` package.

Tensors use HF layouts under llama.cpp names and are dequantized to float32 on load (any of the
types `gguf.quants.dequantize` knows: F32, F16, BF16, Q8_0, Q6_K, Q5_0, Q4_K, ...). For Gemma 2/3,
llama.cpp's converter adds 1 to every zero-centred RMSNorm scale; the loader subtracts it again
(measured on the embedded 270M file: norm weights sit around 1 to 300). Gemma 4 scales are stored
as they are used.

The file's metadata is checked against the requested config: architecture, layer count, widths,
heads, window. The local RoPE base (10k) and the 5:1 layer pattern are not in the file; they come
from the config.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from gemma_jax.checkpoints import hf
from gemma_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Family, TransformerConfig
from gemma_jax.tokenizer import Tokenizer

_ARCH = {Family.GEMMA2: 'gemma2', Family.GEMMA3: 'gemma3', Family.GEMMA4: 'gemma4'}

# HF name suffix -> llama.cpp name suffix.
_LAYER_NAMES = {
    'self_attn.q_proj.weight': 'attn_q.weight',
    'self_attn.k_proj.weight': 'attn_k.weight',
    'self_attn.v_proj.weight': 'attn_v.weight',
    'self_attn.o_proj.weight': 'attn_output.weight',
    'self_attn.q_norm.weight': 'attn_q_norm.weight',
    'self_attn.k_norm.weight': 'attn_k_norm.weight',
    'input_layernorm.weight': 'attn_norm.weight',
    'post_attention_layernorm.weight': 'post_attention_norm.weight',
    'pre_feedforward_layernorm.weight': 'ffn_norm.weight',
    'post_feedforward_layernorm.weight': 'post_ffw_norm.weight',
    'mlp.gate_proj.weight': 'ffn_gate.weight',
    'mlp.up_proj.weight': 'ffn_up.weight',
    'mlp.down_proj.weight': 'ffn_down.weight',
    'per_layer_input_gate.weight': 'inp_gate.weight',
    'per_layer_projection.weight': 'proj.weight',
    'post_per_layer_input_norm.weight': 'post_norm.weight',
    'layer_scalar': 'layer_output_scale.weight',
}
_GLOBAL_NAMES = {
    'model.embed_tokens.weight': 'token_embd.weight',
    'model.norm.weight': 'output_norm.weight',
    'model.embed_tokens_per_layer.weight': 'per_layer_token_embd.weight',
    'model.per_layer_model_projection.weight': 'per_layer_model_proj.weight',
    'model.per_layer_projection_norm.weight': 'per_layer_proj_norm.weight',
}


def gguf_name(hf_name: str) -> str:
  """llama.cpp's name of the tensor HF names `hf_name` ('model.layers.0.mlp.down_proj.weight'
  -> 'blk.0.ffn_down.weight')."""
  if hf_name in _GLOBAL_NAMES:
    return _GLOBAL_NAMES[hf_name]
  _, _, index, suffix = hf_name.split('.', 3)  # model.layers.{i}.{suffix}
  return f'blk.{index}.{_LAYER_NAMES[suffix]}'


def _norm_offset(hf_name: str, config: TransformerConfig) -> float:
  """What llama.cpp added to this tensor: 1 on Gemma 2/3 RMSNorm scales, else 0."""
  is_norm = 'norm' in hf_name
  return 1.0 if is_norm and config.family is not Family.GEMMA4 else 0.0


def expected_metadata(config: TransformerConfig) -> dict[str, str | int]:
  """The GGUF metadata keys and values a file of `config` must hold (architecture, layer count,
  widths, heads, window)."""
  arch = _ARCH[config.family]
  return {
      'general.architecture': arch,
      f'{arch}.block_count': config.num_layers,
      f'{arch}.embedding_length': config.embed_dim,
      f'{arch}.feed_forward_length': config.hidden_dim,
      f'{arch}.attention.head_count': config.num_heads,
      f'{arch}.attention.head_count_kv': config.num_kv_heads,
      f'{arch}.attention.key_length': config.head_dim,
      f'{arch}.attention.sliding_window': config.sliding_window,
  }


def open_reader(path: str) -> Any:
  """A gguf.GGUFReader of `path` (FileNotFoundError, or ValueError naming the file where it is
  not a GGUF)."""
  import gguf  # heavy: only where a GGUF file is read or written
  if not os.path.isfile(path):
    raise FileNotFoundError(f'GGUF file not found: {path}')
  try:
    return gguf.GGUFReader(path)
  except Exception as e:  # the gguf package raises a variety of errors on damaged files
    raise ValueError(f'{path} is not a readable GGUF file ({type(e).__name__}: {e})') from e


def check_metadata(reader: Any, config: TransformerConfig, path: str) -> None:
  """Raises ValueError naming every metadata field of the file at `path` that differs from
  `expected_metadata(config)`."""
  for key, want in expected_metadata(config).items():
    field = reader.fields.get(key)
    got = None if field is None else field.contents()
    if key == 'general.architecture' and got != want:
      raise ValueError(f'{path} holds a {got!r} model, but --model={config.name} is a {want!r} '
                       'model')
    if got is not None and got != want:
      raise ValueError(f'{path}: {key} is {got}, but {config.name} has {want}')


def _dequantize(tensor, rows: int = 8192) -> np.ndarray:
  """A GGUF tensor as float32 [rows of the tensor, ...], dequantized `rows` rows at a time into
  one array: gguf's dequantizers hold several temporaries of their input's size, which for the
  whole embedding at once raised the build's peak (docs/performance.md, "The build holds one
  copy")."""
  import gguf  # heavy: only where a GGUF file is read or written
  data = tensor.data
  if tensor.tensor_type == gguf.GGMLQuantizationType.F32 or data.ndim < 2:
    return gguf.quants.dequantize(data, tensor.tensor_type).astype(np.float32, copy=False)
  first = gguf.quants.dequantize(data[:rows], tensor.tensor_type)
  out = np.empty((data.shape[0], *first.shape[1:]), np.float32)
  out[:len(first)] = first
  for start in range(rows, data.shape[0], rows):
    out[start:start + rows] = gguf.quants.dequantize(data[start:start + rows], tensor.tensor_type)
  return out


def load_gguf(path: str, config: TransformerConfig, *,
              dtype: DTypeLike = np.float32) -> tuple[dict, Tokenizer]:
  """Returns (params, tokenizer) from a GGUF file, dequantized and checked against `config`."""
  import gguf  # heavy: only where a GGUF file is read or written
  reader = open_reader(path)
  check_metadata(reader, config, path)
  by_name = {t.name: t for t in reader.tensors}
  tensors = {}
  for entry in hf.entries(config):
    name = gguf_name(entry.hf_name)
    if name not in by_name:
      raise ValueError(f'{path}: tensor {name} is missing')
    tensor = by_name[name]
    value = _dequantize(tensor).reshape([int(n) for n in reversed(tensor.shape)])
    if offset := _norm_offset(entry.hf_name, config):  # (norms: small)
      value = value - np.float32(offset)
    tensors[entry.hf_name] = value
  tokenizer = Tokenizer.from_gguf(reader)
  # gguf's reader holds objects per vocabulary entry (docs/performance.md: the build's peak)
  del reader, by_name
  return hf.params_from_hf(tensors, config, source=path, dtype=dtype), tokenizer


def save_gguf(params: dict, config: TransformerConfig, path: str, *,
              tokenizer: Tokenizer) -> None:
  """Writes float32 params as a GGUF file the way llama.cpp's converter lays it out (norm
  offsets included), with the tokenizer's vocabulary. Used by the tests and for export."""
  import gguf  # heavy: only where a GGUF file is read or written
  arch = _ARCH[config.family]
  writer = gguf.GGUFWriter(path, arch)
  for key, value in expected_metadata(config).items():
    if key != 'general.architecture':
      writer.add_uint32(key, int(value))
  writer.add_context_length(config.max_context)
  writer.add_rope_freq_base(config.global_rope_base)
  writer.add_layer_norm_rms_eps(config.rms_norm_eps)
  pieces, scores, types = tokenizer.gguf_vocab()
  writer.add_tokenizer_model('llama')
  writer.add_token_list(pieces)
  writer.add_token_scores(scores)
  writer.add_token_types(types)
  writer.add_bos_token_id(BOS_ID)
  writer.add_eos_token_id(EOS_ID)
  writer.add_unk_token_id(UNK_ID)
  writer.add_pad_token_id(PAD_ID)
  for hf_name, tensor in hf.params_to_hf(params, config).items():
    writer.add_tensor(gguf_name(hf_name),
                      np.asarray(tensor, np.float32) + _norm_offset(hf_name, config))
  writer.write_header_to_file()
  writer.write_kv_data_to_file()
  writer.write_tensors_to_file()
  writer.close()
