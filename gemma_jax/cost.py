"""What a forward pass costs, counted from the config: FLOPs and the bytes of weights read.

Counts are of multiply-adds as 2 FLOPs, for the work a straightforward implementation must do:
every dense projection (q, k/v, o, the gated MLP, Gemma 4's per-layer-input projections) once
per token; attention's q.k and p.v over the keys a token can see (all earlier tokens on global
layers, the last W on local ones); the tied-embedding logits (2 V D) only for the rows whose
logits are computed. Embedding lookups, norms and elementwise work are left out (they are
O(D) per token against O(D^2)). These are the denominators of the benchmark's "fraction of the
matmul ceiling" and of the flywheel's FLOP factor.
"""

from __future__ import annotations

import math

from gemma_jax import model
from gemma_jax.checkpoints import tree
from gemma_jax.config import AttentionType, TransformerConfig


def dense_flops_per_token(config: TransformerConfig) -> int:
  """2 x the weights of every dense projection (leaves named .../w), the embedding excluded."""
  flat = tree.flatten(model.abstract_params(config))
  return 2 * sum(math.prod(leaf.shape) for name, leaf in flat.items() if name.endswith('/w'))


def attention_flops(config: TransformerConfig, position: int) -> int:
  """q.k and p.v of one token at sequence position `position` (it sees position + 1 keys)."""
  total = 0
  for i in range(config.num_layers):
    spec = config.layer_spec(i)
    keys = position + 1
    if spec.attention_type is AttentionType.LOCAL:
      keys = min(keys, config.sliding_window)
    total += 2 * 2 * config.num_heads * spec.head_dim * keys
  return total


def logits_flops(config: TransformerConfig) -> int:
  """FLOPs of one row's logits: a [D] x [D, V] product."""
  return 2 * config.vocab_size * config.embed_dim


def prefill_flops(config: TransformerConfig, num_tokens: int, logits_rows: int = 1,
                  start: int = 0) -> int:
  """Tokens at positions start .. start + num_tokens - 1, logits for `logits_rows` of them."""
  attention = sum(attention_flops(config, p) for p in range(start, start + num_tokens))
  return num_tokens * dense_flops_per_token(config) + attention + logits_rows * logits_flops(config)


def decode_flops(config: TransformerConfig, position: int) -> int:
  """One generated token at `position`, with its logits."""
  return dense_flops_per_token(config) + attention_flops(config, position) + logits_flops(config)


def weight_bytes(config: TransformerConfig, itemsize: int) -> int:
  """Bytes of every parameter: what a decode step reads (the tied embedding is read whole by the
  logits, the other weights once each)."""
  flat = tree.flatten(model.abstract_params(config))
  return itemsize * sum(math.prod(leaf.shape) for leaf in flat.values())
