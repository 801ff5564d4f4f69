"""Tensor-parallel placement of parameters on a jax.sharding mesh.

Every projection is stored [inputs..., outputs...], so Megatron-style tensor parallelism is a
choice of one axis per weight: column-parallel projections (q_proj, kv_proj, k_proj,
gate_up_proj, the per-layer gate) split their last output axis over the mesh's 'model' axis;
row-parallel ones (o_proj, down_proj, per_layer_projection) split their first input axis; the
embedding splits the vocabulary. Norm scales and small tensors are replicated. XLA inserts the
collectives. Sharded results are close to, not bit-equal with, single-device ones (the reductions
are split), so the pinned engine fingerprints the device set it runs on.
"""

from __future__ import annotations

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from gemma_jax.checkpoints import tree

_COLUMN = ('q_proj', 'kv_proj', 'k_proj', 'gate_up_proj', 'per_layer_input_gate')
_ROW = ('o_proj', 'down_proj', 'per_layer_projection')


def partition_spec(name: str, shape: tuple[int, ...], model_size: int) -> P:
  """The PartitionSpec of the parameter called `name` ('layers/0/attn/q_proj/w', ...)."""
  parts = name.split('/')
  module = parts[-2] if len(parts) > 1 else ''
  spec = [None] * len(shape)
  if module in _COLUMN:
    axis = len(shape) - 1
  elif module in _ROW:
    axis = 0
  elif parts[-1] == 'input_embedding':
    axis = 0
  else:
    return P()
  if shape[axis] % model_size:  # a dimension that does not split evenly stays whole
    return P()
  spec[axis] = 'model'
  return P(*spec)


def shard_params(params, mesh: Mesh):
  """Places params on `mesh` (which must have a 'model' axis) by `partition_spec`."""
  model_size = mesh.shape['model']
  flat = {name: jax.device_put(leaf, NamedSharding(
              mesh, partition_spec(name, np.shape(leaf), model_size)))
          for name, leaf in tree.flatten(params).items()}
  return tree.unflatten(flat)
