"""gemma_jax against an independent implementation: Hugging Face transformers (PyTorch, CPU).

a. The embedded Gemma 3 270M, ours from the cached dequantized GGUF, HF's Gemma3ForCausalLM
   reading the same GGUF file (its own GGUF loader and dequantization). Both get the same token
   ids (our tokenizer's, with BOS), so tokenizer differences do not enter.
b. Tiny Gemma 2 / 3 / 4 models with random weights drawn in HF, saved with `save_pretrained`
   (safetensors, HF names and layouts), and read back through `gemma_jax.weights.load`.

Both sides compute in float32 but not in the same order (HF: precomputed inverse frequencies,
cos/sin tables, pow(-0.5) in Gemma 4's RMSNorm, its own matmul blocking), so logits agree to
float32 rounding, not bit for bit; the tolerances below say how closely.
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip('torch')
transformers = pytest.importorskip('transformers')

from gemma_jax import kv_state, model, weights  # noqa: E402
from gemma_jax.config import EOS_ID, get_config  # noqa: E402

CACHE_LEN = 1024
GREEDY_STEPS = 24
PREFILL_BUCKETS = (80, 768)  # prompts are padded up to one of these (fewer compilations)

# A long passage (about 720 tokens), so that the continuation and the last positions of the
# prompt lie beyond the 512-token sliding window of the local layers.
LONG_PROSE = (
    'The lighthouse at the end of the northern breakwater was built in the winter of 1887, when '
    'the harbour commission finally admitted that the old lantern on the church tower could not '
    'be seen from the shoals beyond the point. The engineer they hired, a quiet man from the '
    'inland canals who had never spent a night at sea, spent his first month walking the beach '
    'at low tide and writing down the depth of every channel in a small notebook bound in green '
    'cloth. The fishermen laughed at him at first. They said the sea would move the sand again '
    'before he had finished counting it, and in a sense they were right: the channels shifted '
    'every spring, and the chart he drew was wrong within two years. But the tower he designed '
    'was not wrong. He placed it on a foundation of granite blocks dovetailed into one another, '
    'so that a wave striking the base would spread its force through the whole ring of stone '
    'instead of prising a single block loose. The blocks were cut in a quarry forty miles away '
    'and carried to the coast on flat barges, each one numbered in red paint so that the masons '
    'could set it in its proper place. When the first autumn storm arrived, the water climbed '
    'halfway up the unfinished tower and fell back, and not one block had moved.\n\n'
    'The keepers who lived in the tower over the following decades left behind a set of log '
    'books that the town museum still keeps in a glass case near the entrance. Most of the '
    'entries are brief and practical: the hour the lamp was lit, the hour it was put out, the '
    'quantity of oil burned, the direction and strength of the wind. Every so often, however, a '
    'keeper wrote something more. One recorded the night in 1903 when a schooner loaded with '
    'timber ran aground on the outer bar, and how the crew of seven climbed into the rigging and '
    'waited there until dawn, when the lifeboat could finally reach them. Another described a '
    'flock of migrating birds that circled the lantern for hours in the fog, confused by the '
    'light, and how in the morning he found dozens of them resting on the gallery rail, too '
    'tired to fly on. A third, who kept the light during the hard winter of 1929, wrote almost '
    'nothing about the weather and a great deal about the books he was reading, as if the long '
    'nights had turned the tower into a library with a lamp at the top.\n\n'
    'The light was electrified in 1951 and automated in 1978, and the last keeper moved into a '
    'house in the town, from which he could still see the beam sweep across the water every '
    'twelve seconds. He told visitors that he slept better knowing it was there, although he no '
    'longer had to climb the stairs to trim the wick. Today the tower is painted white with a '
    'single red band, the lens has been replaced by a small rotating beacon that uses less power '
    'than a kitchen kettle, and ships find their way into the harbour with satellite receivers '
    'that know their position to within a few metres. Yet the fishing boats still steer by the '
    'light when they come home late, partly from habit and partly because a signal on a screen '
    'is not the same thing as a light on a rock. The granite foundation has now stood for more '
    'than a century without repair, and the engineers who inspect it every ten years report the '
    'same thing each time: the joints are tight, the stone is sound, and the sea, for all its '
    'patience, has not yet found a way in. The daughter of the last keeper, who still lives '
    'in the house by the harbour, says that')

PROMPTS = {
    'capital': 'The capital of France is',  # the README's generate example
    'english': 'The old bridge over the river had been closed for repairs since the spring, so '
               'every morning the baker took the long road through the village, past the school '
               'and the empty market square, and',
    'python': 'def merge_sorted(a: list[int], b: list[int]) -> list[int]:\n'
              '    """Merges two sorted lists into one sorted list."""\n'
              '    result = []\n    i = j = 0\n    while i < len(a) and j < len(b):\n',
    'chinese': '长江是中国最长的河流，发源于青藏高原，流经十一个省级行政区，最后在上海注入东海。'
               '长江流域气候温和，雨量充沛，',
    'japanese': '京都は千年以上にわたって日本の都であり、今でも多くの寺院や神社が残っている。'
                '春には桜が咲き、秋には紅葉が美しく、',
    'russian': 'Москва расположена на берегах реки Москвы. Город был впервые упомянут в летописи '
               'в 1147 году, и с тех пор он',
    'arabic': 'تقع مدينة القاهرة على ضفاف نهر النيل، وهي أكبر مدن العالم العربي من حيث عدد '
              'السكان، ويعود تاريخها إلى',
    'math': 'Solve for x: 3x + 7 = 22. Subtract 7 from both sides to get 3x = 15. Then divide '
            'both sides by 3, so x =',
    'long_prose': LONG_PROSE,
}


# ----------------------------------------------------------------------------------------------
# Our side: a jitted forward (prefill padded to a bucket, then one token at a time).


@functools.lru_cache(maxsize=None)
def _step_fn(config):
  @jax.jit
  def step(params, tokens, positions, kv):
    hidden, kv = model.forward(params, config, tokens, positions, kv)
    return model.compute_logits(params, config, hidden), kv
  return step


def ours_prefill(loaded, ids: list[int]):
  """(logits [T, V] float32 for every prompt position, KV state after the prompt)."""
  length = len(ids)
  bucket = next(b for b in PREFILL_BUCKETS if b >= length)
  tokens = np.zeros((1, bucket), np.int32)
  tokens[0, :length] = ids
  positions = np.full((1, bucket), kv_state.EMPTY, np.int32)  # EMPTY rows: padding, masked
  positions[0, :length] = np.arange(length)
  kv = kv_state.init_kv_state(loaded.config, batch_size=1, cache_len=CACHE_LEN, dtype=jnp.float32)
  logits, kv = _step_fn(loaded.config)(loaded.params, jnp.asarray(tokens),
                                       jnp.asarray(positions), kv)
  return np.asarray(logits[0, :length]), kv


def ours_greedy(loaded, ids: list[int], first_logits: np.ndarray, kv, steps: int) -> list[int]:
  """Greedy continuation: feed the argmax back one token at a time on the KV state."""
  step = _step_fn(loaded.config)
  out = [int(np.argmax(first_logits))]
  for i in range(steps - 1):
    if out[-1] == EOS_ID:
      break
    tokens = jnp.asarray([[out[-1]]], jnp.int32)
    positions = jnp.asarray([[len(ids) + i]], jnp.int32)
    logits, kv = step(loaded.params, tokens, positions, kv)
    out.append(int(jnp.argmax(logits[0, -1])))
  return out


# ----------------------------------------------------------------------------------------------
# a. The embedded Gemma 3 270M.


@pytest.fixture(scope='module')
def ours_270m():
  return weights.load('gemma3_270m', 'embedded', dtype='float32')


@pytest.fixture(scope='module')
def hf_270m():
  path = weights.embedded_gguf_path()
  start = time.time()
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
      attn_implementation='eager')
  hf_model.eval()
  print(f'\nHF Gemma3ForCausalLM from the GGUF: {time.time() - start:.1f} s')
  # One intra-op thread while these tests run: XLA's thread pool shares the (two) cores, and
  # torch's threads contending with it made generation up to five times slower and erratic.
  threads = torch.get_num_threads()
  torch.set_num_threads(1)
  yield hf_model
  torch.set_num_threads(threads)


@pytest.mark.slow
def test_270m_weights_match_hf_gguf_loader(ours_270m, hf_270m):
  """Both GGUF loaders (dequantization, +1 on norms undone, layouts) give the same float32
  weights, so any logit difference below comes from the model code."""
  from gemma_jax.checkpoints import hf as hf_names
  state = hf_270m.state_dict()
  ours = hf_names.params_to_hf(jax.tree.map(np.asarray, ours_270m.params), ours_270m.config)
  for name, value in ours.items():
    theirs = state[name].numpy()
    assert theirs.shape == value.shape, name
    assert np.array_equal(theirs, value), f'{name}: max |diff| {np.max(np.abs(theirs - value))}'


@pytest.mark.slow
@pytest.mark.parametrize('prompt', list(PROMPTS))
def test_270m_matches_hf(ours_270m, hf_270m, prompt):
  ids = ours_270m.tokenizer.encode(PROMPTS[prompt])
  if prompt == 'long_prose':
    assert len(ids) > 600, len(ids)  # crosses the 512-token sliding window

  start = time.time()
  ours_logits, kv = ours_prefill(ours_270m, ids)
  ours_tokens = ours_greedy(ours_270m, ids, ours_logits[-1], kv, GREEDY_STEPS)
  ours_s = time.time() - start

  start = time.time()
  input_ids = torch.tensor([ids])
  with torch.no_grad():
    hf_logits = hf_270m(input_ids).logits[0].float().numpy()
    generated = hf_270m.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                 do_sample=False, max_new_tokens=GREEDY_STEPS,
                                 pad_token_id=0)[0, len(ids):].tolist()
  hf_s = time.time() - start

  agreement = np.mean(np.argmax(ours_logits, -1) == np.argmax(hf_logits, -1))
  scale = np.max(np.abs(hf_logits[-1]))
  last_diff = np.max(np.abs(ours_logits[-1] - hf_logits[-1]))
  all_diff = np.max(np.abs(ours_logits - hf_logits)) / np.max(np.abs(hf_logits))
  print(f'\n{prompt}: {len(ids)} tokens, argmax agreement {agreement:.4f}, last-position '
        f'max|diff| {last_diff:.2e} = {last_diff / scale:.2e} x max|logit| ({scale:.1f}), '
        f'all positions {all_diff:.2e} x max|logit|; ours {ours_s:.1f} s, HF {hf_s:.1f} s')
  print(f'  ours: {ours_270m.tokenizer.decode(ours_tokens)!r}')

  assert agreement >= 0.99
  assert last_diff <= 1e-3 * scale
  assert ours_tokens == generated, (ours_tokens, generated)
  # No prompt's continuation stops early at EOS, so all 24 tokens are compared (for the long
  # prompt, all of them at positions past the 512-token window).
  assert len(generated) == GREEDY_STEPS


# ----------------------------------------------------------------------------------------------
# b. Tiny models with HF's random weights, saved with save_pretrained and loaded by path.


def _hf_tiny_config(name: str):
  """An HF config with the same architecture as our tiny config `name`."""
  c = get_config(name)
  layer_types = ['full_attention' if t.value == 'global' else 'sliding_attention'
                 for t in c.attention_types]
  common = dict(vocab_size=c.vocab_size, hidden_size=c.embed_dim, intermediate_size=c.hidden_dim,
                num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim,
                max_position_embeddings=c.max_context, rms_norm_eps=c.rms_norm_eps,
                sliding_window=c.sliding_window, layer_types=layer_types,
                hidden_activation='gelu_pytorch_tanh', attn_implementation='eager')
  if name == 'tiny_gemma2':
    return transformers.Gemma2Config(
        **common, query_pre_attn_scalar=c.query_pre_attn_scalar,
        attn_logit_softcapping=c.attn_logits_softcap,
        final_logit_softcapping=c.final_logit_softcap,
        rope_parameters={'rope_type': 'default', 'rope_theta': c.local_rope_base})
  if name == 'tiny_gemma3':
    return transformers.Gemma3TextConfig(
        **common, query_pre_attn_scalar=c.query_pre_attn_scalar,
        rope_parameters={
            'sliding_attention': {'rope_type': 'default', 'rope_theta': c.local_rope_base},
            'full_attention': {'rope_type': 'default', 'rope_theta': c.global_rope_base}})
  if name == 'tiny_gemma4':
    return transformers.Gemma4TextConfig(
        **common, final_logit_softcapping=c.final_logit_softcap,
        global_head_dim=c.global_head_dim, num_global_key_value_heads=c.global_num_kv_heads,
        attention_k_eq_v=c.global_k_eq_v, hidden_size_per_layer_input=c.per_layer_embed_dim,
        vocab_size_per_layer_input=c.vocab_size, num_kv_shared_layers=c.num_kv_shared_layers,
        use_double_wide_mlp=c.double_wide_mlp_in_shared,
        rope_parameters={
            'sliding_attention': {'rope_type': 'default', 'rope_theta': c.local_rope_base},
            'full_attention': {'rope_type': 'proportional', 'rope_theta': c.global_rope_base,
                               'partial_rotary_factor': c.global_rotary_fraction}})
  raise ValueError(name)


_HF_CLASSES = {'tiny_gemma2': 'Gemma2ForCausalLM', 'tiny_gemma3': 'Gemma3ForCausalLM',
               'tiny_gemma4': 'Gemma4ForCausalLM'}


def _randomize(hf_model, zero_centred_norms: bool, seed: int) -> None:
  """Weights with activations of order 1 everywhere (HF's default init, std 0.02 and unit norms,
  makes every layer nearly the identity): matrices N(0, 1/fan_in), embeddings N(0, 1/D) (the
  model multiplies them by sqrt(D)), norm scales 1 + N(0, 0.1^2) (stored zero-centred for
  Gemma 2/3), layer scalars around 1."""
  generator = torch.Generator().manual_seed(seed)
  with torch.no_grad():
    for name, tensor in list(hf_model.named_parameters()) + list(hf_model.named_buffers()):
      if name.endswith('inv_freq') or name.endswith('embed_scale'):
        continue  # RoPE tables and constants, not weights
      noise = torch.randn(tensor.shape, generator=generator, dtype=torch.float32)
      if 'norm' in name or name.endswith('layer_scalar'):
        value = 0.1 * noise + (0.0 if zero_centred_norms and 'norm' in name else 1.0)
      else:  # [out, in] matrices: fan_in is the last axis; embeddings [V, D]: std D^-1/2
        value = noise * tensor.shape[-1] ** -0.5
      tensor.copy_(value)


def _tiny_checkpoint(name: str, directory: str):
  torch.manual_seed(0)
  hf_config = _hf_tiny_config(name)
  hf_model = getattr(transformers, _HF_CLASSES[name])(hf_config)
  _randomize(hf_model, zero_centred_norms=name != 'tiny_gemma4', seed=1234)
  hf_model.tie_weights()
  hf_model.eval()
  hf_model.save_pretrained(directory)
  return hf_model


TINY_SEQUENCES = np.array([
    [2, 17, 300, 45, 45, 9, 511, 128, 77, 260, 3, 14, 99, 400, 5, 6, 7, 8, 250, 1, 33, 34, 35, 36,
     101, 202, 303, 404, 505, 11, 22, 33],
    [2, 500, 499, 498, 10, 10, 10, 10, 10, 10, 10, 10, 10, 10, 60, 61, 62, 63, 64, 65, 66, 67, 68,
     69, 70, 71, 72, 73, 74, 75, 76, 77],
], np.int32)  # 32 tokens: four windows of 8


# Relative to max|logit|. Both sides are float32 with different operation orders. Measured:
# Gemma 2 and 3 differ by about 7e-7 of max|logit|, Gemma 4 by about 1.4e-5. Gemma 4 is more
# sensitive to rounding, not wrong: it has no query pre-scaling, so its attention logits are larger
# and the softmax amplifies rounding; HF's own float32 logits differ from its float64 ones by
# 2e-5 there, more than ours do. 1e-4 leaves room for that while still catching a real mistake
# (a wrong scale, mask or RoPE angle moves logits by 1e-2 of their range or more).
TINY_TOLERANCE = 1e-4


@pytest.mark.parametrize('name', ['tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4'])
def test_tiny_matches_hf(tmp_path_factory, name):
  directory = str(tmp_path_factory.mktemp(name))
  hf_model = _tiny_checkpoint(name, directory)
  tokens = torch.tensor(TINY_SEQUENCES, dtype=torch.long)
  with torch.no_grad():
    hf32 = hf_model(tokens).logits.float().numpy()
    # float64 HF: a reference closer to exact arithmetic, telling which side a gap comes from.
    hf64 = hf_model.to(torch.float64)(tokens).logits.numpy()

  loaded = weights.load(name, directory)
  config = loaded.config
  batch, length = TINY_SEQUENCES.shape
  positions = jnp.broadcast_to(jnp.arange(length, dtype=jnp.int32), (batch, length))
  kv = kv_state.init_kv_state(config, batch_size=batch, cache_len=length, dtype=jnp.float32)
  hidden, _ = model.forward(loaded.params, config, jnp.asarray(TINY_SEQUENCES), positions, kv)
  ours = np.asarray(model.compute_logits(loaded.params, config, hidden))

  scale = np.max(np.abs(hf64))
  diff32, diff64 = np.max(np.abs(ours - hf32)), np.max(np.abs(ours - hf64))
  hf_own = np.max(np.abs(hf32 - hf64))
  print(f'\n{name}: max|logit| {scale:.2f} (std {np.std(hf64):.2f}); max|ours - HF fp32| '
        f'{diff32 / scale:.2e}, max|ours - HF fp64| {diff64 / scale:.2e}, '
        f'max|HF fp32 - HF fp64| {hf_own / scale:.2e} (relative to max|logit|)')
  assert scale > 1.0, 'weights too small for a meaningful comparison'
  assert diff32 <= TINY_TOLERANCE * scale
  assert diff64 <= TINY_TOLERANCE * scale
  np.testing.assert_array_equal(np.argmax(ours, -1), np.argmax(hf32, -1))
  np.testing.assert_array_equal(np.argmax(ours, -1), np.argmax(hf64, -1))
