"""This project's Gemma 3 270M against HF transformers on the same GGUF: the parity prompts and
the per-prompt comparison (experiments/hf_parity.py is the entry point; tests/test_hf_parity.py
asserts what the README claims from it).
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import kv_state, model, weights
from gemma_jax.config import EOS_ID

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
# HF's side, and the comparison.


def load_hf():
  """HF transformers' Gemma3ForCausalLM on the embedded GGUF, float32, eager attention."""
  import torch  # optional (the test extra), and heavy
  import transformers
  path = weights.embedded_gguf_path()
  hf_model = transformers.AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
      attn_implementation='eager')
  return hf_model.eval()


def compare_prompt(loaded, hf_model, text: str) -> dict:
  """The parity figures of one prompt (see the module docstring)."""
  import torch  # optional (the test extra), and heavy
  ids = loaded.tokenizer.encode(text)
  start = time.time()
  ours_logits, kv = ours_prefill(loaded, ids)
  ours_tokens = ours_greedy(loaded, ids, ours_logits[-1], kv, GREEDY_STEPS)
  ours_s = time.time() - start
  start = time.time()
  input_ids = torch.tensor([ids])
  with torch.no_grad():
    hf_logits = hf_model(input_ids).logits[0].float().numpy()
    generated = hf_model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                  do_sample=False, max_new_tokens=GREEDY_STEPS,
                                  pad_token_id=0)[0, len(ids):].tolist()
  hf_s = time.time() - start
  scale = float(np.max(np.abs(hf_logits[-1])))
  return {
      'tokens': len(ids),
      'argmax_agreement': float(np.mean(np.argmax(ours_logits, -1) == np.argmax(hf_logits, -1))),
      'max_abs_over_max_logit': float(np.max(np.abs(ours_logits[-1] - hf_logits[-1])) / scale),
      'all_positions_max_abs_over_max_logit': float(
          np.max(np.abs(ours_logits - hf_logits)) / np.max(np.abs(hf_logits))),
      'continuation_equal': ours_tokens == generated,
      'continuation_tokens': len(generated),
      'continuation': loaded.tokenizer.decode(ours_tokens),
      'ours_seconds': round(ours_s, 2), 'hf_seconds': round(hf_s, 2),
  }
