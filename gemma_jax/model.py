"""The pure functions over the Gemma transformer (families 2, 3, 4; its Flax NNX modules are
gemma_jax.modules, imported where a call is traced or a tree's structure is asked).

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

import functools
import math
from typing import TYPE_CHECKING, Any

import jax
import jax.numpy as jnp
from jax.typing import DTypeLike

from gemma_jax import kv_state as kvs
from gemma_jax import seeded
from gemma_jax.attention import XLA_ATTENTION, AttendFn
from gemma_jax.config import TransformerConfig
from gemma_jax.kernels import native_dot
from gemma_jax.numerics import XLA, Numerics
from gemma_jax.stored import Panels, WeightLayout

if TYPE_CHECKING:  # the type only
  from gemma_jax.modules import Transformer

Params = dict[str, Any]  # nested dict of arrays, keyed like the NNX state

# Version of the parameter tree's names and array layouts; caches of converted params key on it.
PARAMS_TREE_VERSION = 2


def _nnx():
  """(flax.nnx, gemma_jax.modules), imported on first use: where a call is traced, a tree's
  structure is asked or weights are stored; a spec engine's warm start does none of these
  (gemma_jax.modules says which starts do), and so imports no Flax (docs/performance.md)."""
  from flax import nnx  # deferred: Flax takes 0.4 s to import (treescope, flax.linen)
  from gemma_jax import modules  # deferred: it defines the NNX modules over Flax
  return nnx, modules


@functools.lru_cache(maxsize=None)
def _abstract_model(config: TransformerConfig, dtype_name: str):
  # Every parameter as its jax.ShapeDtypeStruct (gemma_jax.layers.init_param): no memory, no
  # tracing.
  nnx, modules = _nnx()
  return nnx.split(modules.Transformer(config, dtype=jnp.dtype(dtype_name)))


def abstract_params(config: TransformerConfig, dtype: DTypeLike = jnp.float32) -> Params:
  """The parameter tree as jax.ShapeDtypeStruct leaves (no memory allocated)."""
  _, state = _abstract_model(config, jnp.dtype(dtype).name)
  return _nnx()[0].to_pure_dict(state)


def parameter_distributions(config: TransformerConfig) -> dict[str, tuple[tuple[int, ...], float,
                                                                          float]]:
  """Every parameter by flat name ('layers/0/mlp/down_proj/w'), sorted: (shape, mean, std) of
  the distribution random weights draw it from (gemma_jax.layers.init_param)."""
  _, state = _abstract_model(config, 'float32')
  out = {}
  for path, variable in _nnx()[0].to_flat_state(state):
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
  return _nnx()[0].merge(graphdef, params)


def dense_weights(config: TransformerConfig) -> dict[str, tuple[int, int]]:
  """Every dense projection's weight, by flat name ('layers/0/mlp/down_proj/w'), as the [I, O]
  matrix it is contracted as (I the product of its input dims, O of its outputs)."""
  nnx, modules = _nnx()
  out = {}
  for path, node in nnx.iter_graph(modules.Transformer(config)):
    if isinstance(node, modules.Dense):
      name = '/'.join(str(p) for p in path) + '/w'
      out[name] = (math.prod(node.in_shape), math.prod(node.out_shape))
  return out


def store_weights(params: Params, config: TransformerConfig, layout: WeightLayout) -> Params:
  """params with every dense projection's weight in its stored form under `layout`
  (gemma_jax.stored: Panels where the layout packs it, else the parameter as it is). Concrete or
  abstract (jax.ShapeDtypeStruct) leaves. The embedding is left as it is (graft.engine.placement
  makes the output table)."""
  nnx, modules = _nnx()
  module = bind(params, config)
  for _, node in nnx.iter_graph(module):
    if isinstance(node, modules.Dense):
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
