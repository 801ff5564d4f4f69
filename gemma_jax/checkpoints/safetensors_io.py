"""Hugging Face safetensors checkpoints: one file, or a directory of shards.

Files are written with the safetensors library but read here, since `safetensors.numpy` cannot
represent bfloat16, the dtype of every released Gemma checkpoint. The format is an 8-byte
little-endian header length, a JSON header {name: {dtype, shape, data_offsets}}, then the raw
little-endian bytes; bfloat16 tensors become `ml_dtypes.bfloat16` arrays, which widen to float32
exactly.

Names are normalized to the text model's `model.` prefix: multimodal checkpoints keep the
language model under `model.language_model.` (transformers >= 4.50) or `language_model.model.`
(earlier Gemma 3 exports), next to vision and audio towers that are ignored. A `lm_head.weight`
is accepted only when it equals the tied embedding, since every Gemma ties them.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Mapping

import ml_dtypes
import numpy as np
from numpy.typing import DTypeLike
import safetensors.numpy  # the library's own writer, so files are what HF tools expect

from gemma_jax.checkpoints import hf
from gemma_jax.config import Family, TransformerConfig

INDEX_FILE = 'model.safetensors.index.json'

_DTYPES = {
    'F64': np.dtype(np.float64), 'F32': np.dtype(np.float32), 'F16': np.dtype(np.float16),
    'BF16': np.dtype(ml_dtypes.bfloat16), 'F8_E4M3': np.dtype(ml_dtypes.float8_e4m3fn),
    'F8_E5M2': np.dtype(ml_dtypes.float8_e5m2), 'I64': np.dtype(np.int64),
    'I32': np.dtype(np.int32), 'I16': np.dtype(np.int16), 'I8': np.dtype(np.int8),
    'U8': np.dtype(np.uint8), 'BOOL': np.dtype(np.bool_),
}

# Prefixes under which multimodal checkpoints keep the text model, mapped to `model.`.
_LANGUAGE_PREFIXES = ('model.language_model.', 'language_model.model.')
_HEAD_NAMES = ('lm_head.weight', 'language_model.lm_head.weight')

# HF `model_type` values of each family (text-only and multimodal wrappers).
_MODEL_TYPES = {
    Family.GEMMA2: ('gemma2',),
    Family.GEMMA3: ('gemma3_text', 'gemma3'),
    Family.GEMMA4: ('gemma4_text', 'gemma4'),
}


def read_file(path: str) -> dict[str, np.ndarray]:
  """All tensors of one .safetensors file, as arrays of the stored dtype and any shape the file
  gives them (memory-mapped)."""
  size = os.path.getsize(path)
  with open(path, 'rb') as f:
    prefix = f.read(8)
    if len(prefix) < 8:
      raise ValueError(f'{path} is not a safetensors file: it is only {size} bytes long')
    (header_len,) = struct.unpack('<Q', prefix)
    if header_len > size - 8:
      raise ValueError(f'{path} is truncated or not a safetensors file: its header claims '
                       f'{header_len} bytes, but the file has {size - 8} after the length')
    try:
      header = json.loads(f.read(header_len))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
      raise ValueError(f'{path} is not a safetensors file: unreadable header ({e})') from e
  header.pop('__metadata__', None)
  data_start = 8 + header_len
  if not header:
    return {}
  data = np.memmap(path, dtype=np.uint8, mode='r', offset=data_start)
  tensors = {}
  for name, info in header.items():
    if info.get('dtype') not in _DTYPES:
      raise ValueError(f'{path}: tensor {name} has dtype {info.get("dtype")!r}, which this loader '
                       f'does not read (known: {", ".join(_DTYPES)})')
    dtype = _DTYPES[info['dtype']]
    shape = tuple(int(n) for n in info['shape'])
    begin, end = (int(n) for n in info['data_offsets'])
    if end > data.size or end - begin != int(np.prod(shape)) * dtype.itemsize:
      raise ValueError(f'{path}: tensor {name} ({info["dtype"]} {list(shape)}) has byte range '
                       f'[{begin}, {end}), inconsistent with its shape or past the end of the file '
                       f'({data.size} data bytes); the file is truncated or damaged')
    tensors[name] = data[begin:end].view(dtype).reshape(shape)
  return tensors


def checkpoint_files(path: str) -> list[str]:
  """The .safetensors files of `path`: the file itself, the shards its index names, or every
  .safetensors file in the directory."""
  if os.path.isfile(path):
    return [path]
  if not os.path.isdir(path):
    raise FileNotFoundError(f'safetensors checkpoint not found: {path}')
  index = os.path.join(path, INDEX_FILE)
  if os.path.isfile(index):
    with open(index) as f:
      weight_map = json.load(f).get('weight_map')
    if not isinstance(weight_map, dict):
      raise ValueError(f'{index} has no "weight_map" object')
    files = [os.path.join(path, name) for name in sorted(set(weight_map.values()))]
    missing = [f for f in files if not os.path.isfile(f)]
    if missing:
      raise ValueError(f'{index} names shards that are not there: {missing}')
    return files
  files = sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith('.safetensors'))
  if not files:
    raise ValueError(f'{path} holds no .safetensors files')
  return files


def read_checkpoint(path: str) -> dict[str, np.ndarray]:
  """Every tensor of a file or sharded directory, by its stored name (any shape, as stored)."""
  tensors: dict[str, np.ndarray] = {}
  for file in checkpoint_files(path):
    for name, value in read_file(file).items():
      if name in tensors:
        raise ValueError(f'{path}: tensor {name} appears in more than one shard')
      tensors[name] = value
  return tensors


def _hf_config(path: str) -> dict | None:
  directory = path if os.path.isdir(path) else os.path.dirname(path)
  config_file = os.path.join(directory, 'config.json')
  if not os.path.isfile(config_file):
    return None
  with open(config_file) as f:
    return json.load(f)


def check_hf_config(path: str, config: TransformerConfig) -> None:
  """Compares the checkpoint's config.json (when there is one) with `config`, so that loading a
  checkpoint of another architecture says so instead of failing on a tensor shape."""
  hf_config = _hf_config(path)
  if hf_config is None:
    return
  text = hf_config.get('text_config') or hf_config
  model_type = hf_config.get('model_type')
  if model_type is not None and model_type not in _MODEL_TYPES[config.family]:
    raise ValueError(f'{path} holds a {model_type!r} model, but {config.name} is a '
                     f'{config.family.value} model (HF model_type {_MODEL_TYPES[config.family]})')
  for key, want in (('num_hidden_layers', config.num_layers), ('hidden_size', config.embed_dim),
                    ('num_attention_heads', config.num_heads)):
    got = text.get(key)
    if got is not None and got != want:
      raise ValueError(f'{path}: config.json has {key}={got}, but {config.name} has {want}')


def normalize_names(tensors: Mapping[str, np.ndarray], *, source: str) -> dict[str, np.ndarray]:
  """Text-model tensors under `model.` names (any shape, unchanged); other towers dropped; a tied
  lm_head checked and dropped."""
  multimodal = any(name.startswith(_LANGUAGE_PREFIXES) for name in tensors)
  out, head = {}, None
  for name, value in tensors.items():
    if name in _HEAD_NAMES:
      head = (name, value)
      continue
    for prefix in _LANGUAGE_PREFIXES:
      if name.startswith(prefix):
        out['model.' + name[len(prefix):]] = value
        break
    else:
      if not multimodal:  # in a multimodal checkpoint, other names belong to other towers
        out[name] = value
  if head is not None:
    embedding = out.get('model.embed_tokens.weight')
    if embedding is None or not np.array_equal(np.asarray(head[1]), np.asarray(embedding)):
      raise ValueError(f'{source}: {head[0]} differs from the token embedding; Gemma ties them, '
                       'so an untied output head cannot be loaded')
  return out


def _unused_kv_weight(name: str, config: TransformerConfig) -> bool:
  """K/V projections and norms stored for KV-shared layers, which never use them (released
  Gemma 4 E-model checkpoints carry them)."""
  parts = name.split('.')
  if len(parts) < 5 or parts[1] != 'layers' or not parts[2].isdigit():
    return False
  layer = int(parts[2])
  if layer >= config.num_layers or config.kv_sources[layer] == layer:
    return False
  return parts[3] == 'self_attn' and parts[4] in ('k_proj', 'v_proj', 'k_norm', 'v_norm')


def load_safetensors(path: str, config: TransformerConfig,
                     dtype: DTypeLike = np.float32) -> dict:
  """Params (a numpy tree in `dtype`) from a .safetensors file or a directory of shards.

  Raises ValueError naming the problem: a config.json of another architecture, a missing tensor,
  a tensor of the wrong shape, or tensors the config has no place for (another layer count)."""
  check_hf_config(path, config)
  tensors = normalize_names(read_checkpoint(path), source=path)
  known = {e.hf_name for e in hf.entries(config)}
  unexpected = sorted(n for n in tensors if n not in known and not _unused_kv_weight(n, config))
  if unexpected:
    raise ValueError(f'{path}: {len(unexpected)} tensors have no place in {config.name}, e.g. '
                     f'{unexpected[:3]}; is the checkpoint of another model size?')
  tensors = {name: value.astype(np.float32) for name, value in tensors.items() if name in known}
  embedding = tensors.get('model.embed_tokens.weight')
  if embedding is not None and embedding.shape[0] > config.vocab_size:
    # Multimodal Gemma 3 exports pad the table to 262,208 rows with image placeholder tokens
    # that text never contains; the first V rows are the text vocabulary.
    tensors['model.embed_tokens.weight'] = embedding[:config.vocab_size]
  return hf.params_from_hf(tensors, config, source=path, dtype=dtype)


def save_safetensors(params: dict, config: TransformerConfig, path: str, *,
                     dtype: DTypeLike | None = None) -> None:
  """Writes params under HF names to one .safetensors file with the safetensors library, in
  `dtype` (default: as they are; `ml_dtypes.bfloat16` arrays are written as BF16)."""
  tensors = {}
  for name, value in hf.params_to_hf(params, config).items():
    value = np.asarray(value) if dtype is None else np.asarray(value).astype(dtype)
    tensors[name] = np.ascontiguousarray(value)
  safetensors.numpy.save_file(tensors, path, metadata={'format': 'pt'})
