"""HF transformers as a peer: Gemma3ForCausalLM on the embedded GGUF, float32, eager attention.

Prefill asks for the last position's logits only (logits_to_keep=1), as ours does. Decode is
one token per call on its DynamicCache. Its "graft" is the library's cache kept in memory: a
deep copy of the DynamicCache, then the query (HF saves no verified artifact).
"""

from __future__ import annotations

import copy
import os

from experiments import common
from experiments.peers.row import skipped
from gemma_jax.weights import embedded_gguf_path


def measure(loaded, work) -> dict:
  del loaded
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

  prefill = common.median_seconds(lambda: forward(work.prompt, use_cache=False), work.repeats)
  # The decode loop's time net of its 32-token prompt.
  prompt_only = common.median_seconds(lambda: forward(work.decode_prompt, use_cache=False),
                                      work.repeats)
  loop = common.median_seconds(decode, work.repeats)
  recompute = common.median_seconds(lambda: forward(work.library + work.query, use_cache=False),
                                    work.repeats)
  return {'prefill_tok_s': len(work.prompt) / prefill,
          'decode_tok_s': work.decode_tokens / max(loop - prompt_only, 1e-9),
          'ttft_recompute_s': recompute,
          'ttft_graft_s': common.median_seconds(restored, work.repeats),
          'ttft_graft_note': 'the library\'s DynamicCache deep-copied in memory, then the query',
          'torch_threads': torch.get_num_threads()}
