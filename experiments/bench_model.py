"""Model speed against HF transformers on the same weights, side by side in one run.

  python -m experiments.bench_model --output=results/bench_model_gemma3_270m_float32.json

Prefill: tokens/s on a --prefill_tokens prompt, logits at the last position only (ours; HF is
asked for the last position too with logits_to_keep=1, and also timed computing every
position's logits, its default). Decode: tokens/s over --decode_tokens greedy steps after a
short prompt, one token per call with a KV cache on both sides. Each is the median of --repeats
timed runs after a warm-up. The engines measured are the pinned engine (--block_size) and the
default engine; HF runs Gemma3ForCausalLM on the dequantized GGUF in float32 with eager attention.
"""

from __future__ import annotations

import dataclasses
import os

from absl import app, flags, logging

from experiments import common, samples

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_integer('prefill_tokens', 2000, 'Prompt length for prefill.')
  flags.DEFINE_integer('decode_tokens', 32, 'Greedy decode steps.')
  flags.DEFINE_integer('repeats', 3, 'Timed repetitions after one warm-up.')
  flags.DEFINE_bool('hf', True, 'Also measure HF transformers (needs torch and transformers).')
  flags.DEFINE_string('output', None, 'Results JSON.', required=True)
  common.define_model_flags()
  common.define_engine_flags(cache_len=2560)


def ours(engine, prompt: list[int], decode_tokens: int, repeats: int) -> dict:
  prefill = common.median_seconds(lambda: engine.prefill(prompt, logits='last'), repeats)
  seq, _ = engine.prefill(prompt[:32], logits='last')
  decode = common.median_seconds(
      lambda: engine.generate(seq, decode_tokens + 1, stop_at_eos=False), repeats)
  return {'prefill_tokens_per_s': len(prompt) / prefill,
          'decode_tokens_per_s': decode_tokens / decode}


def huggingface(gguf_path: str, prompt: list[int], decode_tokens: int, repeats: int) -> dict:
  import torch
  from transformers import AutoModelForCausalLM, DynamicCache
  torch.set_num_threads(os.cpu_count() or 1)
  model = AutoModelForCausalLM.from_pretrained(
      os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path), dtype=torch.float32,
      attn_implementation='eager').eval()
  ids = torch.tensor([prompt])

  @torch.no_grad()
  def prefill(keep):
    return model(ids, logits_to_keep=keep, use_cache=False).logits

  @torch.no_grad()
  def decode():
    cache = DynamicCache(config=model.config)
    out = model(ids[:, :32], past_key_values=cache, use_cache=True, logits_to_keep=1)
    token = out.logits[:, -1:].argmax(-1)
    for _ in range(decode_tokens):
      out = model(token, past_key_values=out.past_key_values, use_cache=True)
      token = out.logits[:, -1:].argmax(-1)

  last = common.median_seconds(lambda: prefill(1), repeats)
  every = common.median_seconds(lambda: prefill(0), repeats)
  # Time the decode loop net of its 32-token prompt.
  prompt_only = common.median_seconds(lambda: model(ids[:, :32], logits_to_keep=1), repeats)
  loop = common.median_seconds(decode, repeats)
  return {'prefill_tokens_per_s': len(prompt) / last,
          'prefill_all_logits_tokens_per_s': len(prompt) / every,
          'decode_tokens_per_s': decode_tokens / max(loop - prompt_only, 1e-9),
          'torch_threads': torch.get_num_threads()}


def main(argv):
  del argv
  loaded = common.load_model()
  prompt = loaded.tokenizer.encode(samples.corpus_text())[:FLAGS.prefill_tokens]
  result = {'config': {**common.model_config_json(), 'prefill_tokens': len(prompt),
                       'decode_tokens': FLAGS.decode_tokens, 'repeats': FLAGS.repeats}}
  for kind in ('pinned', 'default'):
    engine = common.make_engine(loaded, engine=kind)
    result['config'][f'{kind}_engine'] = dataclasses.asdict(engine.pinned)
    result[kind] = ours(engine, prompt, FLAGS.decode_tokens, FLAGS.repeats)
    logging.info('%s: %s', kind, result[kind])
    result.setdefault('environment', engine.fingerprint['environment'])
  if FLAGS.hf:
    from gemma_jax.weights import embedded_gguf_path
    if FLAGS.weights != 'embedded' or FLAGS.dtype != 'float32':
      raise ValueError('the HF comparison runs the embedded GGUF in float32')
    result['hf_transformers'] = huggingface(embedded_gguf_path(), prompt, FLAGS.decode_tokens,
                                            FLAGS.repeats)
    hf = result['hf_transformers']
    result['ratios'] = {
        f'{kind}_{what}': result[kind][f'{what}_tokens_per_s'] / hf[f'{what}_tokens_per_s']
        for kind in ('pinned', 'default') for what in ('prefill', 'decode')}
    result['ratios']['pinned_prefill_vs_hf_all_logits'] = (
        result['pinned']['prefill_tokens_per_s'] / hf['prefill_all_logits_tokens_per_s'])
  common.write_json(FLAGS.output, result)
  for name in ('pinned', 'default', 'hf_transformers'):
    if name in result:
      print(f"{name:16s} prefill {result[name]['prefill_tokens_per_s']:7.1f} tok/s  "
            f"decode {result[name]['decode_tokens_per_s']:6.2f} tok/s")
  if 'ratios' in result:
    print('ratios:', {k: round(v, 3) for k, v in result['ratios'].items()})


if __name__ == '__main__':
  define_flags()
  app.run(main)
