"""Random weights (`--weights=random:SEED`) drawn straight into an engine's form: one copy.

gemma_jax.seeded makes any element of a parameter from its index alone, so an engine need not
hold the canonical tree and then its own form of it (two copies: the 1B's 4 GB twice): each
parameter is drawn where and as the engine keeps it, and only there. On one device a projection
is drawn and packed into the native kernels' panels before the next is drawn, and the embedding
is drawn as the [D, V] output table; on a mesh each device draws its own shard of each parameter
(`jax.make_array_from_callback`: a column shard of a projection, a vocabulary share of the output
table, a replica of a norm). The values are the tree's, element for element (each is
`seeded.normal_at` of its index in the canonical [..] layout, then given the model's dtype as
gemma_jax.model.init_params gives it), so the engine's bits are those of the tree placed
(tests/test_drawn.py).
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh
from jax.typing import DTypeLike

from gemma_jax import model, seeded, sharding
from gemma_jax.checkpoints import tree
from gemma_jax.config import TransformerConfig
from gemma_jax.kernels import native_dot
from gemma_jax.stored import OutputTable, Panels, WeightLayout

TABLE = 'embedder/input_embedding'
_CHUNK = 1 << 20  # elements drawn at once (their uint64 indices: 8 MB)


def region(seed: int, name: str, shape: tuple[int, ...], mean: float, std: float, dtype: DTypeLike,
           index: tuple[slice, ...] | None = None, transposed: bool = False) -> np.ndarray:
  """The elements of parameter `name` in `index`, of the parameter or of its transpose. Drawn in
  chunks of rows.

  Args:
    seed, name: random:SEED's parameter (its stream: gemma_jax.seeded.parameter_key).
    shape, mean, std: its canonical shape (e.g. the embedding's [V, D]) and distribution.
    dtype: what it is given (float32, or rounded to bfloat16 as init_params rounds it).
    index: slices, one per axis of the parameter or its transpose (None: all).
    transposed: index the 2-D parameter's transpose ([D, V] for the embedding).

  Returns:
    The region, `dtype`, e.g. [D, V / n] for a device's share of the output table.
  """
  view = shape[::-1] if transposed else shape
  index = index or tuple(slice(None) for _ in view)
  ranges = [np.arange(*s.indices(n), dtype=np.uint64) for s, n in zip(index, view)]
  strides = [math.prod(shape[i + 1:]) for i in range(len(shape))]
  if transposed:
    strides = strides[::-1]
  stream = seeded.parameter_key(seed, name)
  out = np.empty(tuple(len(r) for r in ranges), np.float32)
  if out.size == 0:
    return out.astype(dtype)
  rest = [r * np.uint64(s) for r, s in zip(ranges[1:], strides[1:])]
  inner = sum((r.reshape((-1,) + (1,) * (len(rest) - i - 1)) for i, r in enumerate(rest)),
              np.zeros((), np.uint64)) if rest else np.zeros((), np.uint64)
  rows = max(1, _CHUNK // max(1, out[0].size))
  for r0 in range(0, len(ranges[0]), rows):
    lead = ranges[0][r0:r0 + rows] * np.uint64(strides[0])
    flat = lead.reshape((-1,) + (1,) * len(rest)) + inner
    out[r0:r0 + rows] = seeded.normal_at(stream, flat, mean, std)
  return np.asarray(jnp.asarray(out, dtype)) if np.dtype(dtype) != np.float32 else out


def leaf(seed: int, config: TransformerConfig, name: str, dtype: DTypeLike) -> np.ndarray:
  """Parameter `name` of random:`seed`, whole (as gemma_jax.model.init_params draws it).

  Args:
    seed, config, name: the parameter ('layers/0/mlp/down_proj/w').
    dtype: float32 or bfloat16.

  Returns:
    The parameter in its canonical shape (e.g. down_proj's [F, D]), `dtype`.
  """
  shape, mean, std = model.parameter_distributions(config)[name]
  return region(seed, name, shape, mean, std, dtype)


def params_sha256(seed: int, config: TransformerConfig, dtype: DTypeLike) -> str:
  """tree.params_digest of the whole tree, drawn one parameter at a time (never all held)."""
  return tree.digest_of((name, leaf(seed, config, name, dtype))
                        for name in sorted(model.parameter_distributions(config)))


def place(seed: int, config: TransformerConfig, dtype: DTypeLike, layout: WeightLayout,
          mesh: Mesh | None, mesh_layout: str) -> dict:
  """The parameters of random:`seed` in the stored form of `layout` on `mesh` (None: one device)
  (graft.engine.placement.place_weights' form, the same values), each drawn where it is kept: on
  one device, projections the layout packs drawn then packed one at a time; on a mesh, each
  device's shard drawn on its own. The embedding as the OutputTable ([D, V], or its Panels)
  where the layout keeps one."""
  distributions = model.parameter_distributions(config)
  dense = model.dense_weights(config)
  transposed = layout.output_table
  dtype = jnp.dtype(dtype)
  flat: dict[str, Any] = {}
  for name, (shape, mean, std) in distributions.items():
    table = transposed and name == TABLE
    if mesh is not None and name in dense:  # a projection as its [I, O] matrix, as a mesh keeps
      shape = dense[name]                   # it (gemma_jax.sharding): the same elements in order
    # The output table is float32 of the model's values (a bfloat16 table rounded first, as
    # placement's astype of the loaded table rounds it).
    draw = lambda index=None, name=name, shape=shape, mean=mean, std=std, table=table: region(
        seed, name, shape, mean, std, dtype, index, transposed=table).astype(
            np.float32 if table else dtype)
    if mesh is not None:
      spec = (sharding.vocabulary_sharding(mesh, shape[0]) if table else jax.sharding.NamedSharding(
          mesh, sharding.partition_spec(name, shape, mesh.shape['model'], mesh_layout)))
      placed = jax.make_array_from_callback(shape[::-1] if table else shape, spec, draw)
      flat[name] = OutputTable(placed) if table else placed
    elif table:
      data = jnp.asarray(draw())
      flat[name] = OutputTable(Panels(native_dot.pack(data)) if layout.packs(*shape[::-1])
                               else data)
    elif name in dense and layout.packs(*dense[name]):
      flat[name] = layout.stored(jnp.asarray(draw()).reshape(dense[name]))
    else:
      flat[name] = jnp.asarray(draw())
  return tree.unflatten(flat)
