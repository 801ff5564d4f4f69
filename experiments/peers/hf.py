"""HF transformers as a peer: Gemma3ForCausalLM on the embedded GGUF, float32, eager attention.

Prefill asks for the last position's logits only (logits_to_keep=1), as ours does. Decode is
one token per call on its DynamicCache. Its "graft" is the library's cache kept in memory: a
deep copy of the DynamicCache, then the query (HF saves no verified artifact).
"""

from __future__ import annotations

import copy
import os
import statistics

from experiments import common
from experiments.peers.row import skipped
from gemma_jax.weights import embedded_gguf_path


def ops(work) -> tuple[dict, object] | dict:
  """The timed operations (closures) and a function of their seconds (operation -> the timed
  runs) giving the row; or the row of a skip where torch or transformers is missing.

  prefill: the prompt from scratch; decode_prompt / decode_loop: the 32-token decode prompt
  alone, and it then decode_tokens greedy steps on its cache (decode is their difference);
  ttft_recompute: library + query; ttft_graft: the library's cache deep-copied, then the
  query."""
  try:
    import torch  # optional (the test extra), and heavy
    from transformers import AutoModelForCausalLM, DynamicCache
  except ImportError as e:
    return skipped(f'{e.name} is not installed (pip install -e ".[test]")')
  path = embedded_gguf_path()
  torch.set_num_threads(os.cpu_count() or 1)
  model = AutoModelForCausalLM.from_pretrained(
      os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32,
      attn_implementation='eager').eval()

  @torch.no_grad()
  def forward(ids, **kwargs):
    return model(torch.tensor([ids]), logits_to_keep=1, **kwargs)

  @torch.no_grad()
  def decode():
    out = forward(work.decode_prompt, past_key_values=DynamicCache(config=model.config),
                  use_cache=True)
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(work.decode_tokens):
      out = model(token, past_key_values=out.past_key_values, use_cache=True)
      token = out.logits[:, -1:].argmax(-1)

  library_cache = forward(work.library, past_key_values=DynamicCache(config=model.config),
                          use_cache=True).past_key_values

  @torch.no_grad()
  def restored():
    return forward(work.query, past_key_values=copy.deepcopy(library_cache), use_cache=True)

  closures = {f'prefill_{len(work.prompt)}': lambda: forward(work.prompt, use_cache=False),
              'decode_prompt': lambda: forward(work.decode_prompt, use_cache=False),
              'decode_loop': decode,
              'ttft_recompute': lambda: forward(work.library + work.query, use_cache=False),
              'ttft_graft': restored}

  def row(times: dict) -> dict:
    median = {name: statistics.median(t) for name, t in times.items()}
    return {'prefill_tok_s': len(work.prompt) / median[f'prefill_{len(work.prompt)}'],
            # The decode loop's time net of its 32-token prompt.
            'decode_tok_s': work.decode_tokens / max(median['decode_loop']
                                                     - median['decode_prompt'], 1e-9),
            'ttft_recompute_s': median['ttft_recompute'], 'ttft_graft_s': median['ttft_graft'],
            'ttft_graft_note': 'the library\'s DynamicCache deep-copied in memory, then the query',
            'torch_threads': torch.get_num_threads()}

  return closures, row


def measure(loaded, work) -> dict:
  """The row of HF alone (its operations timed one after another, medians of work.repeats)."""
  del loaded
  made = ops(work)
  if isinstance(made, dict):
    return made
  closures, row = made
  return row({name: [common.median_seconds(fn, work.repeats)] for name, fn in closures.items()})
