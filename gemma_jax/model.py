"""The Gemma transformer (families 2, 3, 4) as Flax NNX modules, and the pure functions over it.

Parameters travel as a plain nested dict (`Params`), the interchange format of the checkpoint
loaders, the parameter cache and the fingerprints, in one form: the stored form
(gemma_jax.stored), whose leaves say what they are (an array as loaded, a kernel's Panels, the
OutputTable); a checkpoint's tree is its simplest case. The model calls are pure functions of
(params, config, tokens, positions, KV state):

    hidden, kv = forward(params, config, tokens, positions, kv)   # hidden after the final norm
    logits = compute_logits(params, config, hidden)              # float32 [B, T, V]

Both take the attention implementation and the `Numerics` value that decide their arithmetic
(defaults: XLA attention, XLA's numerics); nothing else decides a bit.

Logits are a separate call so that an engine computes them only for the rows it needs: the tied
262,144 x D embedding makes them the most expensive matmul of a small model.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from jax.typing import DTypeLike

from gemma_jax import kv_state as kvs
from gemma_jax import seeded, sharding
from gemma_jax.attention import XLA_ATTENTION, AttendFn, Attention, Step
from gemma_jax.config import TransformerConfig
from gemma_jax.kernels import native_dot
from gemma_jax.layers import Dense, FeedForward, RMSNorm, init_param
from gemma_jax.numerics import XLA, Numerics
from gemma_jax.stored import OutputTable, Panels, Table, WeightLayout

Params = dict[str, Any]  # nested dict of arrays, keyed like the NNX state

# Version of the parameter tree's names and array layouts; caches of converted params key on it.
PARAMS_TREE_VERSION = 2


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
      x = n.barrier(x + norm(sharding.whole(project(sharding.whole(gated, mesh), n), mesh), n))
    if self.skip_scale is not None:
      x = n.barrier(n.mul(x, self.skip_scale[...]))
    return x, cache


class Transformer(nnx.Module):
  """The Gemma decoder: the embedder, L blocks (attention and MLP, each between norms) and the
  final norm, as `config` describes them (gemma_jax.config: per-layer attention types, windows,
  RoPE, KV sharing). Its state is the parameter tree (`Params`, in its stored form:
  gemma_jax.stored); `forward` and `compute_logits` are the pure functions over it that engines
  call.

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


@functools.lru_cache(maxsize=None)
def _abstract_model(config: TransformerConfig, dtype_name: str):
  # Every parameter as its jax.ShapeDtypeStruct (gemma_jax.layers.init_param): no memory, no
  # tracing.
  return nnx.split(Transformer(config, dtype=jnp.dtype(dtype_name)))


def abstract_params(config: TransformerConfig, dtype: DTypeLike = jnp.float32) -> Params:
  """The parameter tree as jax.ShapeDtypeStruct leaves (no memory allocated)."""
  _, state = _abstract_model(config, jnp.dtype(dtype).name)
  return nnx.to_pure_dict(state)


def parameter_distributions(config: TransformerConfig) -> dict[str, tuple[tuple[int, ...], float,
                                                                          float]]:
  """Every parameter by flat name ('layers/0/mlp/down_proj/w'), sorted: (shape, mean, std) of
  the distribution random weights draw it from (gemma_jax.layers.init_param)."""
  _, state = _abstract_model(config, 'float32')
  out = {}
  for path, variable in nnx.to_flat_state(state):
    meta = variable.get_metadata()
    out['/'.join(str(p) for p in path)] = (tuple(variable.get_value().shape),
                                           meta['init_mean'], meta['init_std'])
  return dict(sorted(out.items()))


def init_params(config: TransformerConfig, seed: int, dtype: DTypeLike = jnp.float32) -> Params:
  """Seeded random weights (`--weights=random:SEED`: tests and random-weight ablations): each
  parameter drawn by its name from the integer stream of (seed, name) (gemma_jax.seeded.normal),
  the same bits on every machine; made in float32, then given `dtype` (rounded to nearest even)."""
  distributions = parameter_distributions(config)
  def draw(path: tuple, leaf: jax.ShapeDtypeStruct) -> jax.Array:
    name = '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)
    shape, mean, std = distributions[name]
    return jnp.asarray(seeded.normal(seed, name, shape, mean, std), dtype)
  return jax.tree_util.tree_map_with_path(draw, abstract_params(config))


def bind(params: Params, config: TransformerConfig) -> Transformer:
  """The NNX module holding `params` (works inside jit: nothing is copied)."""
  dtype = jax.tree.leaves(params)[0].dtype
  graphdef, _ = _abstract_model(config, jnp.dtype(dtype).name)
  return nnx.merge(graphdef, params)


def dense_weights(config: TransformerConfig) -> dict[str, tuple[int, int]]:
  """Every dense projection's weight, by flat name ('layers/0/mlp/down_proj/w'), as the [I, O]
  matrix it is contracted as (I the product of its input dims, O of its outputs)."""
  out = {}
  for path, node in nnx.iter_graph(Transformer(config)):
    if isinstance(node, Dense):
      name = '/'.join(str(p) for p in path) + '/w'
      out[name] = (math.prod(node.in_shape), math.prod(node.out_shape))
  return out


def store_weights(params: Params, config: TransformerConfig, layout: WeightLayout) -> Params:
  """params with every dense projection's weight in its stored form under `layout`
  (gemma_jax.stored: Panels where the layout packs it, else the parameter as it is). Concrete or
  abstract (jax.ShapeDtypeStruct) leaves. The embedding is left as it is (graft.engine.placement
  makes the output table)."""
  module = bind(params, config)
  for _, node in nnx.iter_graph(module):
    if isinstance(node, Dense):
      k, n = math.prod(node.in_shape), math.prod(node.out_shape)
      if layout.packs(k, n):  # else kept as the parameter it is
        w = node.w.get_value()
        node.w.set_value(Panels(jax.eval_shape(_packed, w, k, n)
                                if isinstance(w, jax.ShapeDtypeStruct) else _packed(w, k, n)))
  return nnx.to_pure_dict(nnx.state(module))


@functools.partial(jax.jit, static_argnums=(1, 2))
def _packed(w: jax.Array, k: int, n: int) -> jax.Array:
  return native_dot.pack(w.reshape(k, n))


def forward(params: Params, config: TransformerConfig, tokens: jax.Array, positions: jax.Array,
            kv: kvs.KVState, attention_fn: AttendFn = XLA_ATTENTION,
            numerics: Numerics = XLA) -> tuple[jax.Array, kvs.KVState]:
  """One model call: the tokens' hidden states, and the KV state with their K and V written.

  Args:
    params: the parameter tree in its stored form (`Params`: `init_params`,
      gemma_jax.weights.load, or an engine's placed weights: gemma_jax.stored).
    config: the model's TransformerConfig.
    tokens: int32 [B, T] token ids.
    positions: int32 [B, T] RoPE positions; kv_state.EMPTY (-1) marks a padding row, which
      attends to nothing and writes nothing.
    kv: the KV state (`init_kv_state`): per cache layer k, v [B, S, K, H] and positions
      [B, S]; the tokens go at sequence indices kv.fill .. kv.fill + T - 1.
    attention_fn: the attention implementation (gemma_jax.attention.IMPLEMENTATIONS).
    numerics: how every operation is computed (gemma_jax.numerics).

  Returns:
    (hidden [B, T, D] after the final norm, in the parameters' dtype; the new KV state, fill
    advanced by each row's real tokens).
  """
  return bind(params, config)(tokens, positions, kv, attention_fn, numerics)


def compute_logits(params: Params, config: TransformerConfig, hidden: jax.Array,
                   numerics: Numerics = XLA) -> jax.Array:
  """The logits of hidden states against the embedding as stored (the tied table, or the
  output table: gemma_jax.stored), soft-capped where the family caps them.

  Args:
    params: the parameter tree in its stored form.
    config: the model's TransformerConfig.
    hidden: [B, T, D] hidden states from `forward`.
    numerics: how the contraction is computed.

  Returns:
    float32 [B, T, V] logits.
  """
  return bind(params, config).embedder.decode(hidden, numerics)
