"""Checkpoint formats: each format's own writer, read back through `weights.load`.

A tiny random model is written as GGUF (gguf.GGUFWriter, via gguf_io.save_gguf), HF safetensors
(the safetensors library's writer) and official-layout Orbax (orbax), then loaded by path with
`gemma_jax.weights.load` and run: the logits must be bit-identical to those of the original
parameters. Damaged or mismatched files must fail with ValueErrors that name the problem.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from gemma_jax import kv_state, model, weights
from gemma_jax.checkpoints import gguf_io, hf, orbax_io, safetensors_io, tree
from gemma_jax.config import get_config
from gemma_jax.tokenizer import synthetic_tokenizer

FAMILIES = ('tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4')
# Longer than every tiny sliding window (8), so local and global layers both matter.
TOKENS = np.array([[2, 17, 300, 45, 45, 9, 511, 128, 77, 260, 3, 14, 99, 400, 5, 6, 7, 8, 250, 1]],
                  np.int32)


@functools.lru_cache(maxsize=None)
def _logits_fn(config):
  @jax.jit
  def run(params, tokens):
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    kv = kv_state.init_kv_state(config, batch_size=tokens.shape[0], cache_len=tokens.shape[1],
                                dtype=jnp.float32)
    hidden, _ = model.forward(params, config, tokens, positions, kv)
    return model.compute_logits(params, config, hidden)
  return run


def logits(params, config) -> np.ndarray:
  params = jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params)
  return np.asarray(_logits_fn(config)(params, jnp.asarray(TOKENS)))


def gguf_exact_params(config, seed: int = 0):
  """Random params whose Gemma 2/3 norm scales are multiples of 2^-23, so that llama.cpp's
  stored 1 + scale is exact in float32 and subtracting 1 on load gives the scale back bit for
  bit (with arbitrary scales the round trip is off by up to an ulp of 1, about 6e-8: a property
  of the converter's convention, tested separately below)."""
  params = model.init_params(config, seed)
  flat = {name: np.asarray(leaf) for name, leaf in tree.flatten(params).items()}
  if config.norm_scale_offset:
    for name, leaf in flat.items():
      if name.endswith('/scale'):
        flat[name] = (np.round(leaf.astype(np.float64) * 2.0 ** 23) / 2.0 ** 23).astype(np.float32)
  return tree.unflatten(flat)


def assert_same_logits(params, loaded, config):
  want, got = logits(params, config), logits(loaded.params, config)
  assert got.dtype == np.float32 and want.shape == got.shape
  assert np.array_equal(want, got), f'max |diff| {np.max(np.abs(want - got))}'


# ----------------------------------------------------------------------------------------------
# Round trips through each format's writer.


@pytest.mark.parametrize('name', FAMILIES)
def test_gguf_round_trip_gives_identical_logits(tmp_path, name):
  config = get_config(name)
  params = gguf_exact_params(config)
  path = str(tmp_path / f'{name}.gguf')
  gguf_io.save_gguf(params, config, path, tokenizer=synthetic_tokenizer(config.vocab_size))
  loaded = weights.load(name, path)
  assert_same_logits(params, loaded, config)


@pytest.mark.parametrize('name', ('tiny_gemma2', 'tiny_gemma3'))
def test_gguf_stores_one_plus_scale_and_the_loader_subtracts_it(tmp_path, name):
  import gguf
  config = get_config(name)
  params = model.init_params(config, 3)
  path = str(tmp_path / 'm.gguf')
  gguf_io.save_gguf(params, config, path, tokenizer=synthetic_tokenizer(config.vocab_size))
  stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
  scale = np.asarray(params['layers'][0]['pre_attention_norm']['scale'])
  np.testing.assert_array_equal(stored['blk.0.attn_norm.weight'], scale + np.float32(1))
  np.testing.assert_array_equal(stored['output_norm.weight'],
                                np.asarray(params['final_norm']['scale']) + np.float32(1))
  loaded = weights.load(name, path).params
  for got, want in ((loaded['layers'][0]['pre_attention_norm']['scale'], scale),
                    (loaded['final_norm']['scale'], params['final_norm']['scale'])):
    # (1 + s) - 1 in float32 is s to within half an ulp of 1; far from s + 1.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=0, atol=2 ** -24)


@pytest.mark.parametrize('name', ('tiny_gemma2', 'tiny_gemma3'))
def test_gguf_writer_agrees_with_gguf_py_names_and_layouts(tmp_path, name):
  # A round trip through our own writer and reader cannot see a bug they share. Here the file
  # is read by gguf-py (llama.cpp's reader) and every tensor is found under the name gguf-py's
  # own HF-to-GGUF table gives, holding the HF layout's values (HF names and layouts are
  # checked against HF transformers' GGUF loader on the real model in test_hf_parity.py);
  # Gemma 2/3 norms are stored as 1 + scale, as llama.cpp's converter writes them.
  import gguf
  from gemma_jax.checkpoints import hf as hf_names
  config = get_config(name)
  params = model.init_params(config, 3)
  path = str(tmp_path / 'm.gguf')
  gguf_io.save_gguf(params, config, path, tokenizer=synthetic_tokenizer(config.vocab_size))
  stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
  arch = {'tiny_gemma2': gguf.MODEL_ARCH.GEMMA2, 'tiny_gemma3': gguf.MODEL_ARCH.GEMMA3}[name]
  table = gguf.get_tensor_name_map(arch, config.num_layers)
  expected = {}
  for hf_name, value in hf_names.params_to_hf(jax.tree.map(np.asarray, params), config).items():
    gguf_name = table.get_name(hf_name, try_suffixes=('.weight',))
    assert gguf_name, hf_name
    expected[gguf_name] = value + np.float32(1) if hf_name.endswith('norm.weight') else value
  assert set(stored) == set(expected)
  for gguf_name, value in expected.items():
    np.testing.assert_array_equal(stored[gguf_name], value, err_msg=gguf_name)


def test_gguf_gemma4_scales_are_stored_as_used(tmp_path):
  import gguf
  config = get_config('tiny_gemma4')
  params = model.init_params(config, 3)
  path = str(tmp_path / 'm.gguf')
  gguf_io.save_gguf(params, config, path, tokenizer=synthetic_tokenizer(config.vocab_size))
  stored = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(path).tensors}
  np.testing.assert_array_equal(stored['blk.0.attn_norm.weight'],
                                np.asarray(params['layers'][0]['pre_attention_norm']['scale']))


@pytest.mark.parametrize('name', FAMILIES)
def test_safetensors_round_trip_gives_identical_logits(tmp_path, name):
  config = get_config(name)
  params = model.init_params(config, 1)
  path = str(tmp_path / 'model.safetensors')
  safetensors_io.save_safetensors(params, config, path)
  assert_same_logits(params, weights.load(name, path), config)
  assert_same_logits(params, weights.load(name, str(tmp_path)), config)  # the directory


@pytest.mark.parametrize('name', FAMILIES)
def test_orbax_round_trip_gives_identical_logits(tmp_path, name):
  config = get_config(name)
  params = model.init_params(config, 2)
  path = str(tmp_path / 'ckpt')
  orbax_io.save_orbax_official(params, config, path)
  assert_same_logits(params, weights.load(name, path), config)


# ----------------------------------------------------------------------------------------------
# Safetensors variants: bfloat16, shards, multimodal names, a tied lm_head.


def _hf_tensors(params, config, dtype=np.float32):
  return {k: np.ascontiguousarray(v.astype(dtype)) for k, v in hf.params_to_hf(params,
                                                                               config).items()}


def test_safetensors_bfloat16_loads_exactly(tmp_path):
  import safetensors.numpy
  config = get_config('tiny_gemma3')
  params = model.init_params(config, 4)
  rounded = jax.tree.map(lambda x: np.asarray(x).astype(ml_dtypes.bfloat16).astype(np.float32),
                         params)
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(_hf_tensors(params, config, ml_dtypes.bfloat16), path)
  assert safetensors_io.read_file(path)['model.norm.weight'].dtype == ml_dtypes.bfloat16
  loaded = weights.load('tiny_gemma3', path)
  assert_same_logits(rounded, loaded, config)


def test_safetensors_reader_agrees_with_the_library(tmp_path):
  torch = pytest.importorskip('torch')
  import safetensors.torch
  rng = np.random.default_rng(0)
  tensors = {'a': torch.from_numpy(rng.standard_normal((3, 5), np.float32)).to(torch.bfloat16),
             'b': torch.from_numpy(rng.standard_normal((7,), np.float32)),
             'c': torch.from_numpy(rng.standard_normal((2, 2, 2)).astype(np.float16))}
  path = str(tmp_path / 'x.safetensors')
  safetensors.torch.save_file(tensors, path)
  ours = safetensors_io.read_file(path)
  assert ours['a'].dtype == ml_dtypes.bfloat16
  for name, value in tensors.items():
    np.testing.assert_array_equal(ours[name].astype(np.float32), value.float().numpy())


@pytest.mark.parametrize('with_index', [True, False])
def test_safetensors_sharded_directory_with_multimodal_names(tmp_path, with_index):
  import safetensors.numpy
  config = get_config('tiny_gemma4')
  params = model.init_params(config, 5)
  tensors = {name.replace('model.', 'model.language_model.', 1): value
             for name, value in _hf_tensors(params, config).items()}
  tensors['model.vision_tower.patch.weight'] = np.ones((2, 2), np.float32)  # another tower
  tensors['lm_head.weight'] = tensors['model.language_model.embed_tokens.weight'].copy()
  names = sorted(tensors)
  shards = {'model-00001-of-00002.safetensors': names[::2],
            'model-00002-of-00002.safetensors': names[1::2]}
  for file, shard_names in shards.items():
    safetensors.numpy.save_file({n: tensors[n] for n in shard_names}, str(tmp_path / file))
  if with_index:
    weight_map = {n: file for file, shard_names in shards.items() for n in shard_names}
    (tmp_path / safetensors_io.INDEX_FILE).write_text(json.dumps({'weight_map': weight_map}))
  assert_same_logits(params, weights.load('tiny_gemma4', str(tmp_path)), config)


def test_safetensors_embedding_padded_with_image_tokens(tmp_path):
  """Multimodal Gemma 3 exports pad the embedding with image placeholder rows past the text
  vocabulary; the text model keeps the first V rows."""
  import safetensors.numpy
  config = get_config('tiny_gemma3')
  params = model.init_params(config, 7)
  tensors = _hf_tensors(params, config)
  table = tensors['model.embed_tokens.weight']
  tensors['model.embed_tokens.weight'] = np.concatenate([table, np.ones((64, 64), np.float32)])
  safetensors.numpy.save_file(tensors, str(tmp_path / 'model.safetensors'))
  assert_same_logits(params, weights.load('tiny_gemma3', str(tmp_path)), config)


def test_safetensors_missing_tensor_is_named(tmp_path):
  import safetensors.numpy
  config = get_config('tiny_gemma2')
  tensors = _hf_tensors(model.init_params(config, 0), config)
  del tensors['model.layers.2.mlp.up_proj.weight']
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(tensors, path)
  with pytest.raises(ValueError, match=r'model\.layers\.2\.mlp\.up_proj\.weight'):
    weights.load('tiny_gemma2', path)


def test_safetensors_wrong_shape_is_named(tmp_path):
  import safetensors.numpy
  config = get_config('tiny_gemma2')
  tensors = _hf_tensors(model.init_params(config, 0), config)
  tensors['model.norm.weight'] = np.zeros((63,), np.float32)
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(tensors, path)
  with pytest.raises(ValueError, match=r'final_norm/scale has shape \(63,\)'):
    weights.load('tiny_gemma2', path)


def test_safetensors_untied_head_is_rejected(tmp_path):
  import safetensors.numpy
  config = get_config('tiny_gemma2')
  tensors = _hf_tensors(model.init_params(config, 0), config)
  tensors['lm_head.weight'] = tensors['model.embed_tokens.weight'] + 1
  path = str(tmp_path / 'model.safetensors')
  safetensors.numpy.save_file(tensors, path)
  with pytest.raises(ValueError, match='lm_head.weight differs from the token embedding'):
    weights.load('tiny_gemma2', path)


def test_safetensors_of_another_size_or_architecture(tmp_path):
  config = get_config('tiny_gemma2')
  params = model.init_params(config, 0)
  safetensors_io.save_safetensors(params, config, str(tmp_path / 'model.safetensors'))
  # Surplus layers: a 4-layer checkpoint read as a 2-layer model.
  with pytest.raises(ValueError, match=r'no place in tiny_gemma2.*model\.layers\.2\.'):
    weights.load(config.replace(num_layers=2), str(tmp_path))
  # config.json of another family.
  (tmp_path / 'config.json').write_text(json.dumps({'model_type': 'gemma2',
                                                    'num_hidden_layers': 4}))
  with pytest.raises(ValueError, match=r"'gemma2' model, but tiny_gemma3 is a gemma3 model"):
    weights.load('tiny_gemma3', str(tmp_path))


def test_safetensors_truncated_file(tmp_path):
  config = get_config('tiny_gemma2')
  path = str(tmp_path / 'model.safetensors')
  safetensors_io.save_safetensors(model.init_params(config, 0), config, path)
  size = os.path.getsize(path)
  with open(path, 'r+b') as f:
    f.truncate(size - 1000)
  with pytest.raises(ValueError, match='truncated or damaged'):
    weights.load('tiny_gemma2', path)
  with open(path, 'r+b') as f:
    f.truncate(20)
  with pytest.raises(ValueError, match='truncated or not a safetensors file'):
    weights.load('tiny_gemma2', path)


# ----------------------------------------------------------------------------------------------
# Orbax layout variants.


def test_orbax_official_names(tmp_path):
  config = get_config('tiny_gemma4')
  official = orbax_io.to_official(model.init_params(config, 0), config)
  assert official['transformer/embedder']['per_layer_embeddings'].shape == (512, 6, 8)
  assert official['transformer/embedder/per_layer_model_projection']['w'].shape == (64, 6, 8)
  assert official['transformer/layer_2/attn/k_einsum']['w'].shape == (1, 64, 32)
  assert 'scale' in official['transformer/layer_0/attn/query_norm']
  assert official['transformer/layer_5']['skip_scale'].shape == (1,)
  assert 'transformer/layer_5/attn/kv_einsum' not in official  # KV-shared layer
  g3 = orbax_io.to_official(model.init_params(get_config('tiny_gemma3'), 0),
                            get_config('tiny_gemma3'))
  assert 'transformer/layer_0/attn/_query_norm' in g3 and 'transformer/layer_0/attn/_key_norm' in g3


def test_orbax_fused_qkv_and_transposed_gating(tmp_path):
  """N == K checkpoints fuse Q, K, V into qkv_einsum [3, N, D, H]; Gemma 2 2B stores the gating
  as [2, D, F]. Both load to the same model."""
  import orbax.checkpoint as ocp
  config = get_config('tiny_gemma2').replace(num_kv_heads=4)
  params = model.init_params(config, 6)
  official = orbax_io.to_official(params, config)
  for i in range(config.num_layers):
    attn = f'transformer/layer_{i}/attn/'
    q = official.pop(attn + 'q_einsum')['w']
    kv = official.pop(attn + 'kv_einsum')['w']
    official[attn + 'qkv_einsum'] = {'w': np.concatenate([q[None], kv])}
    gating = official[f'transformer/layer_{i}/mlp/gating_einsum']
    gating['w'] = np.ascontiguousarray(gating['w'].transpose(0, 2, 1))
  path = str(tmp_path / 'ckpt')
  ocp.PyTreeCheckpointer().save(path, official)
  assert_same_logits(params, weights.load(config, path), config)


def test_orbax_missing_weight_and_stacked_layout(tmp_path):
  import orbax.checkpoint as ocp
  config = get_config('tiny_gemma3')
  official = orbax_io.to_official(model.init_params(config, 0), config)
  del official['transformer/layer_3/attn/_key_norm']
  ocp.PyTreeCheckpointer().save(str(tmp_path / 'a'), official)
  with pytest.raises(ValueError, match=r'transformer/layer_3/attn/_key_norm/scale .* missing'):
    weights.load('tiny_gemma3', str(tmp_path / 'a'))
  stacked = {'transformer/embedder': official['transformer/embedder'],
             'transformer/stacked_layers/attn/q_einsum': {'w': np.zeros((7, 4, 64, 16),
                                                                        np.float32)}}
  ocp.PyTreeCheckpointer().save(str(tmp_path / 'b'), stacked)
  with pytest.raises(ValueError, match='stacked layout'):
    weights.load('tiny_gemma3', str(tmp_path / 'b'))


def test_orbax_ignores_multimodal_parts_but_not_surplus_layers(tmp_path):
  import orbax.checkpoint as ocp
  config = get_config('tiny_gemma3')
  params = model.init_params(config, 8)
  official = orbax_io.to_official(params, config)
  official['transformer/embedder/mm_input_projection'] = {'w': np.ones((4, 64), np.float32)}
  official['SigLiPFromPatches_0/siglip_encoder/embedding'] = {'kernel': np.ones((2, 2),
                                                                                np.float32)}
  ocp.PyTreeCheckpointer().save(str(tmp_path / 'a'), official)
  assert_same_logits(params, weights.load('tiny_gemma3', str(tmp_path / 'a')), config)
  with pytest.raises(ValueError, match=r'no place in tiny_gemma3.*transformer/layer_6/'):
    weights.load(config.replace(num_layers=6), str(tmp_path / 'a'))


def test_directory_that_is_no_checkpoint(tmp_path):
  (tmp_path / 'notes.txt').write_text('nothing here')
  with pytest.raises(ValueError, match='not a readable Orbax checkpoint'):
    weights.load('tiny_gemma3', str(tmp_path))


def test_orbax_of_another_family_is_rejected(tmp_path):
  config = get_config('tiny_gemma2')
  orbax_io.save_orbax_official(model.init_params(config, 0), config, str(tmp_path / 'ckpt'))
  with pytest.raises(ValueError, match='tiny_gemma3'):
    weights.load('tiny_gemma3', str(tmp_path / 'ckpt'))


# ----------------------------------------------------------------------------------------------
# Bad GGUF files.


def test_gguf_of_another_architecture_names_both(tmp_path):
  config = get_config('tiny_gemma2')
  path = str(tmp_path / 'g2.gguf')
  gguf_io.save_gguf(model.init_params(config, 0), config, path,
                    tokenizer=synthetic_tokenizer(config.vocab_size))
  with pytest.raises(ValueError) as error:
    weights.load('tiny_gemma3', path)
  assert "'gemma2'" in str(error.value) and "'gemma3'" in str(error.value)
  assert 'tiny_gemma3' in str(error.value)


@pytest.mark.parametrize('keep', [100, 0.5])
def test_truncated_gguf_raises_a_clear_error(tmp_path, keep):
  config = get_config('tiny_gemma3')
  path = str(tmp_path / 'm.gguf')
  gguf_io.save_gguf(model.init_params(config, 0), config, path,
                    tokenizer=synthetic_tokenizer(config.vocab_size))
  size = os.path.getsize(path)
  with open(path, 'r+b') as f:
    f.truncate(keep if isinstance(keep, int) else int(size * keep))
  with pytest.raises(ValueError, match='not a readable GGUF file'):
    weights.load('tiny_gemma3', path)


def test_not_a_gguf_file(tmp_path):
  path = tmp_path / 'junk.gguf'
  path.write_bytes(b'this is not a gguf file at all' * 10)
  with pytest.raises(ValueError, match='not a readable GGUF file'):
    weights.load('tiny_gemma3', str(path))
