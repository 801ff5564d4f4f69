"""The Gemma transformer as Flax NNX modules: the embedder, the blocks, their attention, and the
whole decoder (`Transformer`), built from gemma_jax.layers (RMSNorm, Dense, FeedForward).

Engines never hold these modules: gemma_jax.model binds a parameter tree to them where a call is
traced, a tree's structure is asked or weights are put in their stored form (`bind`,
`abstract_params`, `dense_weights`, `store_weights`), and imports this module only then. So a
spec engine's warm start (saved executables loaded, the weights mapped from the parameter cache
in their stored form) imports no Flax (docs/performance.md, "The start"); an engine that stores
its weights itself (pinned, blocked, on a mesh, random:SEED weights) imports it as it builds.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.typing import DTypeLike

from gemma_jax import kv_state as kvs
from gemma_jax import rope, sharding
from gemma_jax.attention import XLA_ATTENTION, AttendFn, RopeKey, Step
from gemma_jax.config import LayerSpec, TransformerConfig
from gemma_jax.layers import Dense, FeedForward, RMSNorm, init_param
from gemma_jax.numerics import XLA, Numerics
from gemma_jax.stored import OutputTable, Table


class Attention(nnx.Module):
  """Projections, QK(V)-norms, RoPE, cache write, attention, output projection.

  Weights, stored [inputs..., outputs...]: q_proj [D, N, H]; kv_proj [D, 2, K, H], or k_proj
  [D, K, H] when one projection feeds K and V; o_proj [N, H, D]. A KV-shared layer owns no K/V
  weights and reads the cache of its source layer.
  """

  def __init__(self, config: TransformerConfig, spec: LayerSpec, *, owns_kv: bool,
               dtype: DTypeLike):
    d, n, k, h = config.embed_dim, config.num_heads, spec.num_kv_heads, spec.head_dim
    self.config = config
    self.spec = spec
    self.owns_kv = owns_kv
    self.q_proj = Dense((d,), (n, h), dtype=dtype)
    self.o_proj = Dense((n, h), (d,), dtype=dtype)
    norm = functools.partial(RMSNorm, offset=config.norm_scale_offset, eps=config.rms_norm_eps,
                           dtype=dtype)
    self.query_norm = norm(h) if config.use_qk_norm else None
    self.key_norm = norm(h) if config.use_qk_norm and owns_kv else None
    self.value_norm = (norm(h, with_scale=False)
                       if config.use_v_norm and owns_kv else None)
    self.k_proj = (Dense((d,), (k, h), dtype=dtype)
                   if owns_kv and spec.k_eq_v else None)
    self.kv_proj = (Dense((d,), (2, k, h), dtype=dtype)
                    if owns_kv and not spec.k_eq_v else None)

  def rope_key(self) -> RopeKey:
    """What decides this layer's rotation angles besides the positions (layers that share it
    share one sin/cos table per call)."""
    return (self.spec.head_dim, self.spec.rope_base, self.spec.rope_scale,
            self.spec.rotary_fraction)

  def angles(self, positions: jax.Array,
             numerics: Numerics) -> tuple[jax.Array, jax.Array] | None:
    """(sin, cos) [B, T, H/2] of this layer's RoPE at positions [B, T] (None: no rotation)."""
    return rope.sin_cos(positions, self.spec.head_dim, base=self.spec.rope_base,
                        scale=self.spec.rope_scale, rotary_fraction=self.spec.rotary_fraction,
                        mode=self.config.rope_mode, numerics=numerics)

  def keys_values(self, x: jax.Array, angles: tuple[jax.Array, jax.Array] | None,
                  numerics: Numerics) -> tuple[jax.Array, jax.Array]:
    """The cache entries of new tokens: normed K (turned by `angles` unless the config caches
    keys before RoPE) and normed V, each [B, T, K, H]."""
    if self.k_proj is not None:
      k = v = self.k_proj(x, numerics)
    else:
      assert self.kv_proj is not None  # a layer that owns its KV has one of the two
      kv = self.kv_proj(x, numerics)  # [B, T, 2, K, H]
      k, v = kv[:, :, 0], kv[:, :, 1]
    if self.key_norm is not None:
      k = self.key_norm(k, numerics)
    if self.value_norm is not None:
      v = self.value_norm(v, numerics)
    return (k if self.config.kv_cache_pre_rope else rope.rotate_heads(k, angles, numerics)), v

  def __call__(self, x: jax.Array, cache: kvs.LayerKV,
               step: Step) -> tuple[jax.Array, kvs.LayerKV]:
    """x [B, T, D] -> ([B, T, D], the layer cache after this call's write), at the call's
    positions with this layer's RoPE angles (`step`). For a KV-shared layer `cache` is the source
    layer's, already updated, and is returned as is."""
    positions, numerics = step.positions, step.numerics
    angles = step.angles[self.rope_key()]
    q = self.q_proj(x, numerics)
    if self.query_norm is not None:
      q = self.query_norm(q, numerics)
    q = rope.rotate_heads(q, angles, numerics)
    if self.config.query_pre_attn_scalar is not None:
      q = numerics.mul(q, jnp.asarray(self.config.query_pre_attn_scalar ** -0.5, q.dtype))
    if self.owns_kv:
      k, v = self.keys_values(x, angles, numerics)
      cache = kvs.write(cache, k, v, positions, step.start)
    keys = cache.k
    if self.config.kv_cache_pre_rope:  # every slot rotated by its own position (empty: masked)
      keys = rope.rotate_heads(keys, self.angles(cache.positions, numerics), numerics)
    mode = rope.get_mode(self.config.rope_mode)
    scores = mode.scores(self.spec, numerics) if mode.scores else None
    encoded = step.attention_fn(q, keys, cache.v, positions, cache.positions,
                                window=self.spec.window, softcap=self.config.attn_logits_softcap,
                                scores=scores, numerics=numerics)
    mesh = numerics.call.mesh
    return self.o_proj(sharding.whole(encoded, mesh), numerics), cache


class Embedder(nnx.Module):
  """Token embedding (tied with the output head); Gemma 4 E-models add per-layer embeddings.

  input_embedding [V, D] (or, stored, the OutputTable [D, V]: gemma_jax.stored). Per-layer
  embeddings (PLE, width E): per_layer_embeddings [V, L, E], per_layer_model_projection
  [D, L, E], per_layer_projection_norm over E.
  """

  def __init__(self, config: TransformerConfig, *, dtype: DTypeLike):
    self.config = config
    d, p = config.embed_dim, config.per_layer_embed_dim
    self.input_embedding = init_param((config.vocab_size, d), dtype, std=1 / math.sqrt(d))
    if p:
      num_layers = config.num_layers
      self.per_layer_embeddings = init_param((config.vocab_size, num_layers, p), dtype,
                                             std=1 / math.sqrt(p))
      self.per_layer_model_projection = Dense((d,), (num_layers, p), dtype=dtype)
      self.per_layer_projection_norm = RMSNorm(p, offset=config.norm_scale_offset,
                                               eps=config.rms_norm_eps, dtype=dtype)

  def encode(self, tokens: jax.Array,
             numerics: Numerics) -> tuple[jax.Array, jax.Array | None]:
    """tokens [B, T] -> (x [B, T, D], per-layer inputs [B, T, L, E] or None)."""
    table: Table = self.input_embedding.get_value()
    if isinstance(table, OutputTable):  # the output table's columns
      rows = table.rows(tokens, numerics.call.mesh)
    else:
      rows = table[tokens]
    # sqrt(D) is rounded to the activation dtype first, as the reference does (in bfloat16,
    # sqrt(640) = 25.298 becomes 25.25).
    x = numerics.barrier(numerics.mul(
        rows, jnp.asarray(math.sqrt(self.config.embed_dim), table.dtype)))
    if not self.config.per_layer_embed_dim:
      return x, None
    ple_table = self.per_layer_embeddings[...]
    by_token = numerics.mul(ple_table[tokens], jnp.asarray(
        math.sqrt(self.config.per_layer_embed_dim), ple_table.dtype))
    by_context = numerics.mul(self.per_layer_model_projection(x, numerics), jnp.asarray(
        self.config.embed_dim ** -0.5, x.dtype))
    by_context = self.per_layer_projection_norm(by_context, numerics)
    by_token = numerics.materialize(by_token)
    return x, numerics.materialize(numerics.mul(by_context + by_token,
                                                jnp.asarray(2.0 ** -0.5, x.dtype)))

  def decode(self, hidden: jax.Array, numerics: Numerics) -> jax.Array:
    """hidden [B, T, D] -> logits [B, T, V] in float32, soft-capped where the family does,
    against the embedding as stored (the tied [V, D] table or the OutputTable).

    Float32 operands (bfloat16 ones are widened exactly): on XLA:CPU a 3D einsum, or a bfloat16
    dot with a float32 result, is much slower (docs/determinism.md, "Layouts and speed")."""
    table: Table = self.input_embedding.get_value()
    if not isinstance(table, OutputTable):
      table = table.astype(jnp.float32)  # [V, D]
    rows = hidden.reshape(-1, hidden.shape[-1]).astype(jnp.float32)
    logits = numerics.logits(table, rows)
    logits = logits.reshape(hidden.shape[:-1] + (logits.shape[-1],))
    cap = self.config.final_logit_softcap
    if cap is not None:
      logits = numerics.softcap(logits, cap)
    return logits


class Block(nnx.Module):
  """One transformer layer: normed attention and normed MLP, each with a residual."""

  def __init__(self, config: TransformerConfig, index: int, *, dtype: DTypeLike):
    spec = config.layer_spec(index)
    d = config.embed_dim
    norm = functools.partial(RMSNorm, offset=config.norm_scale_offset, eps=config.rms_norm_eps,
                           dtype=dtype)
    self.index = index
    self.pre_attention_norm = norm(d)
    self.attn = Attention(config, spec, owns_kv=spec.kv_source == index, dtype=dtype)
    self.post_attention_norm = norm(d)
    self.pre_ffw_norm = norm(d)
    self.mlp = FeedForward(d, spec.mlp_hidden, dtype=dtype)
    self.post_ffw_norm = norm(d)
    p = config.per_layer_embed_dim  # Gemma 4 E-models: a gated per-layer input after the MLP
    self.per_layer_input_gate = (
        Dense((d,), (p,), dtype=dtype) if p else None)
    self.per_layer_projection = (
        Dense((p,), (d,), dtype=dtype) if p else None)
    self.post_per_layer_input_norm = norm(d) if p else None
    self.skip_scale = (init_param((1,), dtype, std=0.1, mean=1.0)
                       if config.use_skip_scale else None)

  def __call__(self, x: jax.Array, cache: kvs.LayerKV,
               step: Step) -> tuple[jax.Array, kvs.LayerKV]:
    """x [B, T, D] -> (x [B, T, D], the layer cache after this call's write)."""
    n = step.numerics
    attn_out, cache = self.attn(self.pre_attention_norm(x, n), cache, step)
    x = n.barrier(x + self.post_attention_norm(attn_out, n))
    x = n.barrier(x + self.post_ffw_norm(self.mlp(self.pre_ffw_norm(x, n), n), n))
    if step.per_layer_inputs is not None:  # a model with per-layer inputs has these modules
      gate, project, norm = (self.per_layer_input_gate, self.per_layer_projection,
                             self.post_per_layer_input_norm)
      assert gate is not None and project is not None and norm is not None
      gated = n.mul(n.gelu(gate(x, n)), step.per_layer_inputs[:, :, self.index])
      mesh = n.call.mesh
      x = n.barrier(x + norm(project(sharding.whole(gated, mesh), n), n))
    if self.skip_scale is not None:
      x = n.barrier(n.mul(x, self.skip_scale[...]))
    return x, cache


class Transformer(nnx.Module):
  """The Gemma decoder: the embedder, L blocks (attention and MLP, each between norms) and the
  final norm, as `config` describes them (gemma_jax.config: per-layer attention types, windows,
  RoPE, KV sharing). Its state is the parameter tree (gemma_jax.model.Params, in its stored
  form: gemma_jax.stored); gemma_jax.model's `forward` and `compute_logits` are the pure
  functions over it that engines call.

  Args:
    config: the model's TransformerConfig.
    dtype: the parameters' dtype (float32 or bfloat16).

  Built abstract: every parameter is its jax.ShapeDtypeStruct with the distribution random
  weights draw it from (gemma_jax.layers.init_param); `bind` fills it.
  """

  def __init__(self, config: TransformerConfig, *, dtype: DTypeLike = jnp.float32):
    self.config = config
    self.embedder = Embedder(config, dtype=dtype)
    self.layers = nnx.List([Block(config, i, dtype=dtype)
                            for i in range(config.num_layers)])
    self.final_norm = RMSNorm(config.embed_dim, offset=config.norm_scale_offset,
                              eps=config.rms_norm_eps, dtype=dtype)

  def __call__(self, tokens: jax.Array, positions: jax.Array, kv: kvs.KVState,
               attention_fn: AttendFn = XLA_ATTENTION,
               numerics: Numerics = XLA) -> tuple[jax.Array, kvs.KVState]:
    """tokens, positions [B, T] (position EMPTY marks a padding row) -> (hidden [B, T, D] after
    the final norm, the KV state with these tokens written)."""
    # The call's bundle: the run-time zero of numerics.materialize (fill is never negative; the
    # compiler cannot know that) and, for one sequence, the rows through the last real one (a
    # kernel may skip the rest).
    call = dataclasses.replace(numerics.call, zero=(kv.fill[0] < 0).astype(jnp.uint32))
    if tokens.shape[0] == 1:
      rows = jnp.arange(1, tokens.shape[1] + 1, dtype=jnp.int32)
      call = dataclasses.replace(
          call, rows=jnp.max(jnp.where(positions[0] != kvs.EMPTY, rows, 0)))
    numerics = numerics.bind(call)
    x, per_layer_inputs = self.embedder.encode(tokens, numerics)
    # Each layer's RoPE angles, computed once per call for the layers that share them.
    angles = {}
    for block in self.layers:
      if block.attn.rope_key() not in angles:
        angles[block.attn.rope_key()] = block.attn.angles(positions, numerics)
    # Row 0's sequence index: padding rows before the first real token (an engine aligning its
    # calls to the sequence) sit at the indices just before kv.fill.
    start = kv.fill - jnp.argmax(positions != kvs.EMPTY, axis=1).astype(jnp.int32)
    step = Step(positions=positions, start=start, angles=angles,
                per_layer_inputs=per_layer_inputs, numerics=numerics,
                attention_fn=attention_fn)
    cache_index = {layer: j for j, layer in enumerate(self.config.cache_layers)}
    caches = list(kv.layers)
    for i, block in enumerate(self.layers):
      j = cache_index[self.config.kv_sources[i]]
      x, caches[j] = block(x, caches[j], step)
    fill = kv.fill + jnp.sum(positions != kvs.EMPTY, axis=1, dtype=jnp.int32)
    return self.final_norm(x, numerics), kvs.KVState(layers=tuple(caches), fill=fill)
