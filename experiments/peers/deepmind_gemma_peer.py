"""google-deepmind `gemma` (JAX) as a benchmark peer, run inside its own virtual environment.

This file imports nothing from the project: the benchmark runs it as a subprocess with the peer
venv's Python (gemma 4.x needs Python >= 3.12 and its own jax/flax), hands it a JSON job and
reads one JSON object back from the last line of stdout.

  ~/.cache/gemma_jax/peers/gemma/bin/python experiments/peers/deepmind_gemma_peer.py JOB.json
  ... | python deepmind_gemma_peer.py -          (job on stdin)

Job keys (all optional except `checkpoint`):
  checkpoint       Orbax checkpoint in the official layout (the project's save_orbax_official).
  tokenizer        SentencePiece .model file (the project's Tokenizer.model_proto); only used to
                   decode the sampler's output text, since prompts are given as token ids.
  logits_prompts   list of token-id lists: forward each, return last-position logits (as .npy
                   path in `logits_output`) and every position's argmax.
  logits_output    .npz path for those logits.
  prompt_ids       prefill prompt (token ids, BOS included).
  decode_tokens    greedy decode steps to time.
  greedy_prompts   list of token-id lists: greedy continuations of `greedy_tokens` (16) tokens.
  library_ids, query_ids   time to first token for library+query, recomputed, and with the
                   library's KV cache kept in the sampler's multi-turn state.
  repeats          timed repetitions (median) after one warm-up.
  cache_length     sampler KV cache length (default 4096).

Timings are medians of `repeats` runs after a warm-up (the warm-up compiles).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np


WARMUP = 2  # untimed runs before the timed ones
TIMES: list[list[float]] = []  # every timed run, in order


def _median_seconds(fn, repeats: int) -> float:
  for _ in range(WARMUP):
    fn()  # warm-up (compiles); the first large runs are much slower here
  times = []
  for _ in range(repeats):
    start = time.perf_counter()
    fn()
    times.append(time.perf_counter() - start)
  TIMES.append([round(t, 4) for t in times])
  return statistics.median(times)


def _load(job):
  from gemma import gm  # the peer: installed only in its own environment
  model = gm.nn.Gemma3_270M()
  params = gm.ckpts.load_params(os.path.abspath(job['checkpoint']))
  return gm, model, params


def _block(x):
  return jax.block_until_ready(x)


class _Ids(str):
  """A prompt given as token ids; a str so that the sampler's type checks take it."""

  def __new__(cls, ids):
    self = super().__new__(cls, f'<{len(ids)} token ids>')
    self.ids = [int(t) for t in ids]
    return self


def _sampler_class(gm):

  class IdsSampler(gm.text.Sampler):
    """gm.text.Sampler fed token ids; BOS is expected in the ids of a first turn."""

    def _tokenize_prompts(self, prompt, *, add_bos, pad_length=None):
      prompts = [prompt] if isinstance(prompt, str) else list(prompt)
      if not all(isinstance(p, _Ids) for p in prompts):
        return super()._tokenize_prompts(prompt, add_bos=add_bos, pad_length=pad_length)
      tokens = [p.ids for p in prompts]
      if len({len(t) for t in tokens}) != 1:
        raise ValueError('batched id prompts must have one length')
      return jnp.asarray(tokens, jnp.int32)

  return IdsSampler


def logits(job, gm, model, params) -> dict:
  forward = jax.jit(lambda p, t: model.apply({'params': p}, t, return_last_only=False).logits)
  arrays, argmax = {}, []
  for i, ids in enumerate(job['logits_prompts']):
    out = np.asarray(forward(params, jnp.asarray([ids], jnp.int32))[0], np.float32)
    arrays[f'ids_{i}'] = np.asarray(ids, np.int32)
    arrays[f'last_{i}'] = out[-1]
    arrays[f'argmax_{i}'] = out.argmax(-1).astype(np.int32)
    argmax.append(arrays[f'argmax_{i}'].tolist())
  if job.get('logits_output'):
    np.savez(job['logits_output'], **arrays)
  return {'argmax': argmax, 'logits_output': job.get('logits_output')}


def speed(job, gm, model, params) -> dict:
  repeats = int(job.get('repeats', 3))
  decode_tokens = int(job.get('decode_tokens', 32))
  cache_length = int(job.get('cache_length', 4096))
  tokenizer = gm.text.Gemma3Tokenizer(job['tokenizer']) if job.get('tokenizer') else None
  special = gm.text.Gemma3Tokenizer.special_tokens
  sampler = _sampler_class(gm)(
      model=model, params=params, tokenizer=tokenizer, sampling=gm.text.Greedy(),
      cache_length=cache_length, max_out_length=max(decode_tokens + 1, 8), pad_length=None,
      # Fixed-length decode: the end tokens can never be sampled, so every run does N steps.
      forbidden_tokens=[special.EOS, special.END_OF_TURN])
  result = {'jax': jax.__version__, 'devices': [str(d) for d in jax.devices()],
            'cache_length': cache_length, 'repeats': repeats}

  def sample(ids, n, **kw):
    out = sampler.sample(_Ids(ids), max_new_tokens=n, return_state=True, **kw)
    _block(out.state.predicted_tokens)
    return out

  for ids in job.get('greedy_prompts', []):
    out = sample(ids, int(job.get('greedy_tokens', 16)))
    result.setdefault('greedy', []).append(
        [int(t) for t in jax.device_get(out.state.predicted_tokens[0])])
  prompt = job.get('prompt_ids')
  if prompt:
    # The sampler as shipped: prefill (model.apply, not jitted as a whole) plus one step.
    first = _median_seconds(lambda: sample(prompt, 1), repeats)
    result['sampler_first_token_s'] = first
    result['sampler_prefill_tokens_per_s'] = len(prompt) / first
    # The bare forward pass under jax.jit, last position's logits only.
    forward = jax.jit(lambda p, t: model.apply({'params': p}, t, return_last_only=True).logits)
    tokens = jnp.asarray([prompt], jnp.int32)
    seconds = _median_seconds(lambda: _block(forward(params, tokens)), repeats)
    result['jit_forward_prefill_tokens_per_s'] = len(prompt) / seconds
    result['prefill_tokens'] = len(prompt)
  if decode_tokens:
    short = (prompt or job['library_ids'])[:32]
    one = _median_seconds(lambda: sample(short, 1), repeats)
    many = _median_seconds(lambda: sample(short, decode_tokens + 1), repeats)
    result['decode_tokens_per_s'] = decode_tokens / max(many - one, 1e-9)
    out = sample(short, decode_tokens + 1)
    result['decode_ids'] = [int(t) for t in jax.device_get(out.state.predicted_tokens[0])]
    if tokenizer is not None:
      result['decode_text'] = out.text
  if job.get('library_ids') and job.get('query_ids'):
    library, query = job['library_ids'], job['query_ids']
    result['ttft_recompute_s'] = _median_seconds(lambda: sample(library + query, 1), repeats)
    # Multi-turn: the library's cache is kept in the sampler state, the query is a next turn.
    # The state also holds the one token sampled after the library (a turn must sample one).
    state = sample(library, 1).state
    result['ttft_cached_library_s'] = _median_seconds(
        lambda: sample(query, 1, last_state=state), repeats)
    result['ttft_note'] = ('cached: library in the multi-turn sampler state (plus the one '
                           'token sampled after it), then the query as a new turn')
  result['runs_s'] = list(TIMES)
  result['loadavg_1m_end'] = os.getloadavg()[0]
  return result


def main(argv) -> int:
  source = argv[1] if len(argv) > 1 else '-'
  job = json.load(sys.stdin if source == '-' else open(source))
  start = time.perf_counter()
  gm, model, params = _load(job)
  result = {'load_s': time.perf_counter() - start}
  import gemma  # the peer: installed only in its own environment
  result['gemma_version'] = getattr(gemma, '__version__', None)
  if job.get('logits_prompts'):
    result['logits'] = logits(job, gm, model, params)
  if job.get('prompt_ids') or job.get('library_ids') or job.get('decode_tokens'):
    result['speed'] = speed(job, gm, model, params)
  sys.stdout.flush()
  print(json.dumps(result))
  return 0


if __name__ == '__main__':
  sys.exit(main(sys.argv))
