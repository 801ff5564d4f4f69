"""The systems a user would otherwise pick, measured on the same weights and token ids as ours.

Each peer returns the benchmark's row fields (experiments/bench.py): prefill_tok_s,
decode_tok_s, ttft_recompute_s, ttft_graft_s (None where the peer cannot restore a saved KV
state) and `skipped` (None, or why it was not measured: a peer that is not installed is skipped
with the reason, never silently).

  hf_transformers     HF transformers' Gemma3ForCausalLM on the embedded GGUF, float32, eager
                      attention; prefill asks for the last position's logits only
                      (logits_to_keep=1), as ours does
"""

from __future__ import annotations

import os

from experiments import common

NAMES = ('hf_transformers',)


def measure(name: str, loaded, work) -> dict:
  if name == 'hf_transformers':
    return hf_transformers(loaded, work)
  raise ValueError(f'unknown peer {name!r}; expected one of {NAMES}')


def skipped(reason: str) -> dict:
  return {'skipped': reason, 'prefill_tok_s': None, 'decode_tok_s': None,
          'ttft_recompute_s': None, 'ttft_graft_s': None}


def _embedded_float32(loaded) -> str | None:
  """Why a peer that reads the embedded GGUF cannot run this configuration (None: it can)."""
  if loaded.weights != 'embedded' or loaded.dtype != 'float32':
    return 'peers run the embedded GGUF in float32 (--weights=embedded --dtype=float32)'
  return None


def hf_transformers(loaded, work) -> dict:
  reason = _embedded_float32(loaded)
  if reason:
    return skipped(reason)
  try:
    import torch
    from transformers import AutoModelForCausalLM, DynamicCache
  except ImportError as e:
    return skipped(f'{e.name} is not installed (pip install -e ".[test]")')
  from gemma_jax.weights import embedded_gguf_path
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

  prefill = common.median_seconds(lambda: forward(work.prompt, use_cache=False), work.repeats)
  # The decode loop's time net of its 32-token prompt.
  prompt_only = common.median_seconds(lambda: forward(work.decode_prompt, use_cache=False),
                                      work.repeats)
  loop = common.median_seconds(decode, work.repeats)
  recompute = common.median_seconds(lambda: forward(work.library + work.query, use_cache=False),
                                    work.repeats)
  return {'prefill_tok_s': len(work.prompt) / prefill,
          'decode_tok_s': work.decode_tokens / max(loop - prompt_only, 1e-9),
          'ttft_recompute_s': recompute, 'ttft_graft_s': None,
          'torch_threads': torch.get_num_threads()}
