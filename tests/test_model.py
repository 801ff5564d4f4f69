"""The Gemma model itself: config registry, norms, masks, KV state, tokenizer."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma_jax import config as C
from gemma_jax import kv_state as kvs
from gemma_jax import model
from gemma_jax.attention import attention_mask
from gemma_jax.layers import RMSNorm
from gemma_jax.numerics import XLA
from flax import nnx


def param_count(name: str) -> int:
  return sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(
      model.abstract_params(C.get_config(name))))


@pytest.mark.parametrize('name, low, high', [
    ('gemma3_270m', 0.26e9, 0.28e9),   # "270M": 268M with the 168M tied embedding
    ('gemma3_1b', 0.95e9, 1.05e9),
    ('gemma3_4b', 3.8e9, 4.1e9),
    ('gemma3_12b', 11.5e9, 12.5e9),
    ('gemma3_27b', 26.5e9, 27.5e9),
    ('gemma2_2b', 2.55e9, 2.7e9),
    ('gemma2_9b', 9.0e9, 9.4e9),
    ('gemma2_27b', 26.5e9, 27.5e9),
    ('gemma4_e2b', 4.5e9, 5.2e9),  # E2B: ~2B effective, ~5B with per-layer embeddings
    ('gemma4_31b', 30e9, 32e9),
])
def test_registry_full_size_configs_have_the_published_sizes(name, low, high):
  # Shapes only (jax.eval_shape): the big models cost no memory here.
  assert low <= param_count(name) <= high


def test_registry_rejects_unknown_and_unsupported_names():
  with pytest.raises(ValueError, match='unknown model config .*known: .*gemma3_270m'):
    C.get_config('gemma3_271m')
  with pytest.raises(ValueError, match='mixture-of-experts'):
    C.get_config('gemma4_26b_a4b')


def test_layer_patterns_and_kv_sharing():
  g3 = C.get_config('gemma3_270m')
  assert [t.value[0] for t in g3.attention_types[:7]] == list('lllllgl')
  g2 = C.get_config('gemma2_2b')
  assert g2.attention_types[:2] == (C.AttentionType.LOCAL, C.AttentionType.GLOBAL)
  e2b = C.get_config('gemma4_e2b')
  assert e2b.kv_sources[:15] == tuple(range(15))
  # Shared layers read the last unshared layer of their own type (13 local, 14 global).
  assert set(e2b.kv_sources[15:]) == {13, 14}
  assert all(e2b.attention_types[i] is e2b.attention_types[e2b.kv_sources[i]] for i in range(35))
  spec = C.get_config('gemma4_31b').layer_spec(5)
  assert (spec.head_dim, spec.num_kv_heads, spec.k_eq_v, spec.rotary_fraction) == (512, 4, True,
                                                                                   0.25)


def test_rmsnorm_golden_values_zero_centred_and_direct():
  x = jnp.array([[1.0, 2.0, 3.0, 4.0]], jnp.float32)
  rms = math.sqrt((1 + 4 + 9 + 16) / 4 + 1e-6)
  for offset, scale in [(1.0, 0.5), (0.0, 1.5)]:
    norm = RMSNorm(4, offset=offset, eps=1e-6, dtype=jnp.float32)
    norm.scale = nnx.Param(jnp.full((4,), scale, jnp.float32))
    np.testing.assert_allclose(norm(x, XLA), np.array([[1, 2, 3, 4]]) / rms * 1.5, rtol=1e-6)


def test_embedding_scale_is_rounded_to_the_activation_dtype():
  cfg = C.get_config('tiny_gemma3').replace(embed_dim=640)
  params = jax.tree.map(jnp.zeros_like, model.abstract_params(cfg, jnp.bfloat16))
  params['embedder']['input_embedding'] = jnp.ones((cfg.vocab_size, 640), jnp.bfloat16)
  x, _ = model.bind(params, cfg).embedder.encode(jnp.array([[5]]), XLA)
  assert float(x[0, 0, 0]) == 25.25  # sqrt(640) = 25.298 rounds to 25.25 in bfloat16


def test_attention_mask_causal_and_sliding_window_from_slot_positions():
  q_pos = jnp.array([[2, 3, kvs.EMPTY]])
  k_pos = jnp.array([[0, 1, 2, 3, kvs.EMPTY]])
  causal = np.array(attention_mask(q_pos, k_pos, None)[0], int)
  np.testing.assert_array_equal(causal, [[1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [0, 0, 0, 0, 0]])
  window = np.array(attention_mask(q_pos, k_pos, 2)[0], int)
  np.testing.assert_array_equal(window, [[0, 1, 1, 0, 0], [0, 0, 1, 1, 0], [0, 0, 0, 0, 0]])


def test_kv_write_uses_sequence_index_slots_in_a_ring():
  layer = kvs.LayerKV(k=jnp.zeros((1, 4, 1, 2)), v=jnp.zeros((1, 4, 1, 2)),
                      positions=jnp.full((1, 4), kvs.EMPTY, jnp.int32))
  new = jnp.arange(3, dtype=jnp.float32).reshape(1, 3, 1, 1) * jnp.ones((1, 3, 1, 2))
  out = kvs.write(layer, new, new, jnp.array([[100, 101, 102]]), start=jnp.array([3]))
  # Sequence indices 3, 4, 5 land in slots 3, 0, 1; positions are stored as given.
  np.testing.assert_array_equal(out.positions[0], [101, 102, kvs.EMPTY, 100])
  np.testing.assert_array_equal(out.k[0, :, 0, 0], [1, 2, 0, 0])


@pytest.mark.parametrize('start', [0, 2, 3])  # no wrap (in-place slice), and wrapping (select)
def test_kv_write_padding_rows_leave_their_slots_alone(start):
  old = jnp.full((1, 6, 1, 2), 7.0)
  layer = kvs.LayerKV(k=old, v=old, positions=jnp.arange(6, dtype=jnp.int32)[None] + 50)
  new = jnp.arange(4, dtype=jnp.float32).reshape(1, 4, 1, 1) * jnp.ones((1, 4, 1, 2))
  positions = jnp.array([[kvs.EMPTY, 10, 11, kvs.EMPTY]])  # padding before and after
  out = kvs.write(layer, new, new, positions, start=jnp.array([start]))
  slots = [(start + r) % 6 for r in range(4)]
  expected_k = np.full(6, 7.0)
  expected_pos = np.arange(6) + 50
  expected_k[slots[1:3]] = [1, 2]
  expected_pos[slots[1:3]] = [10, 11]
  np.testing.assert_array_equal(out.k[0, :, 0, 0], expected_k)
  np.testing.assert_array_equal(out.v[0, :, 0, 1], expected_k)
  np.testing.assert_array_equal(out.positions[0], expected_pos)


def _logits(cfg, params, tokens, *, local_cache_len, block):
  kv = kvs.init_kv_state(cfg, batch_size=1, cache_len=256, dtype=jnp.float32,
                         local_cache_len=local_cache_len)
  step = jax.jit(lambda p, t, pos, kv: model.forward(p, cfg, t, pos, kv))
  out = []
  for start in range(0, len(tokens), block):
    chunk = jnp.array([tokens[start:start + block]])
    pos = jnp.arange(start, start + chunk.shape[1])[None]
    hidden, kv = step(params, chunk, pos, kv)
    out.append(model.compute_logits(params, cfg, hidden)[0])
  return np.concatenate(out)


@pytest.mark.parametrize('name', ['tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4'])
def test_sliding_window_ring_stays_correct_far_past_the_window(name):
  # W = 8 on the tiny configs: 96 tokens run 12 windows past it. A ring of W + 4 - 1 slots fed
  # 4 tokens at a time must match one call over a full cache. Different reduction lengths give
  # different roundings, so this is a closeness test relative to the largest logit: 1e-5 on
  # Gemma 2/3 (measured 1e-6); 1e-4 on Gemma 4, whose tiny random config amplifies float32
  # rounding about tenfold (direct norm scales, per-layer inputs; measured 2e-5), the same
  # amount as merely changing the call size with a full cache.
  cfg = C.get_config(name)
  params = model.init_params(cfg, 0)
  tokens = list(np.random.default_rng(0).integers(3, cfg.vocab_size, 96))
  ring = _logits(cfg, params, tokens, local_cache_len=cfg.sliding_window + 3, block=4)
  full = _logits(cfg, params, tokens, local_cache_len=None, block=96)
  tolerance = 1e-4 if cfg.family is C.Family.GEMMA4 else 1e-5
  assert np.max(np.abs(ring - full)) <= tolerance * np.max(np.abs(full))
  assert (ring.argmax(-1) == full.argmax(-1)).all()


def test_window_limits_what_a_local_layer_sees():
  # One local layer: changing token 5 may change positions 5 .. 5+W-1 only. Later positions must
  # be bit-identical (the changed key is masked, contributing exactly 0), earlier ones too.
  cfg = C.get_config('tiny_gemma3').replace(num_layers=1,
                                            attention_pattern=(C.AttentionType.LOCAL,))
  params = model.init_params(cfg, 1)
  tokens = list(np.random.default_rng(1).integers(3, cfg.vocab_size, 40))
  changed = list(tokens)
  changed[5] = (changed[5] + 1) % cfg.vocab_size
  a = _logits(cfg, params, tokens, local_cache_len=None, block=40)
  b = _logits(cfg, params, changed, local_cache_len=None, block=40)
  w = cfg.sliding_window
  np.testing.assert_array_equal(a[:5], b[:5])
  assert all(not np.array_equal(a[p], b[p]) for p in range(5, 5 + w))
  np.testing.assert_array_equal(a[5 + w:], b[5 + w:])


TOKENIZER_TEXTS = [
    'The capital of France is',
    'Привет, мир! 你好，世界。',
    'def f(x):\n\treturn x  *  2\n\n\n',  # tabs, double spaces, a run of newlines
    'Ünïcödé — “quotes”, emoji 🙂 and numbers 1234567 and 3.14159.',
]


@pytest.mark.slow
def test_gguf_tokenizer_agrees_with_an_independent_tokenizer():
  # Ours is built from the GGUF vocabulary by gemma_jax.tokenizer; HF transformers builds its
  # own from the same GGUF with its own converter. On texts without runs of 17+ spaces (where
  # HF's converter is known to differ from llama.cpp, docs/gemma.md) the ids must be the same.
  import os
  transformers = pytest.importorskip('transformers')
  from gemma_jax import weights
  tok = weights.embedded_tokenizer()
  path = weights.embedded_gguf_path()
  hf = transformers.AutoTokenizer.from_pretrained(os.path.dirname(path),
                                                  gguf_file=os.path.basename(path))
  for text in TOKENIZER_TEXTS:
    want = hf(text)['input_ids']
    assert want[0] == 2  # BOS, as ours adds it
    assert tok.encode(text) == want, text
    assert tok.decode(want[1:]) == text


def test_gguf_tokenizer_keeps_user_defined_whitespace_pieces():
  from gemma_jax import weights
  tok = weights.embedded_tokenizer()
  code = TOKENIZER_TEXTS[2]
  ids = tok.encode(code)
  assert tok.decode(ids[1:]) == code
  assert tok.decode(ids[-1:]) == '\n\n\n'  # a run of newlines is one user-defined piece
