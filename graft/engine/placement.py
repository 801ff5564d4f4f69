"""Where and in which form an engine holds its weights: placed on its mesh, each projection stored
as its numerics read it (the native kernels' column panels, or as loaded), the embedding as the
output table where the numerics read one; and which of them a self-check probes.

Functions of what they are given (the loaded model, its config, the engine's numerics and mesh);
`Engine` calls them and shares what they make with the other engines of its model
(graft.engine.shared).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from gemma_jax import drawn, model, sharding
from gemma_jax.checkpoints import tree
from gemma_jax.config import TransformerConfig
from gemma_jax.kernels import native_dot
from gemma_jax.numerics import Numerics
from gemma_jax.weights import LoadedModel


@functools.partial(jax.jit, static_argnums=1)
def _output_table(table: jax.Array, packed: bool) -> jax.Array:
  """The [D, V] float32 copy of a [V, D] table, in the native kernels' column panels where
  `packed` (gemma_jax.kernels.native_dot.pack), in one pass over it (an eager transpose and copy
  made two)."""
  table = table.astype(jnp.float32).T
  if packed:
    return native_dot.pack(table)
  return table


def place_weights(loaded: LoadedModel, config: TransformerConfig, numerics: Numerics, mesh,
                  mesh_layout: str) -> dict:
  """The parameters as an engine of `numerics` on `mesh` (None: one device) reads them: the
  loaded model's stored form as it is, where it is laid out as the numerics store weights (the
  embedded model's packed cache entry: mapped, not copied); else placed on the mesh and stored by
  the numerics (a copy). The embedding becomes the output table ([D, V], or its panels
  [V / P, D, P]) where the numerics read a transposed one."""
  if loaded.draws_where_used:  # random:SEED: each parameter drawn where and as it is kept
    return drawn.place(loaded.seed, config, loaded.dtype, numerics, mesh, mesh_layout)
  entry = loaded.stored
  layout = entry.layout if entry is not None else {}
  if (mesh is None and layout.get('packed') is not None
      and numerics.storage == ('panels', layout.get('small'))
      and layout.get('panel') == native_dot.PANEL):
    return tree.unflatten({name: jax.device_put(leaf) for name, leaf in entry.stored.items()})
  params = loaded.params
  transposed = numerics.output_table == 'transposed'
  if transposed:  # set apart: it becomes the output table, placed on its own
    embedder = dict(params['embedder'])
    table = embedder.pop('input_embedding')
    params = {**params, 'embedder': embedder}
  if mesh is not None:
    params = sharding.shard_params(params, mesh, mesh_layout)
  if transposed:  # its shape stands in while the projections are stored
    params['embedder']['input_embedding'] = jax.ShapeDtypeStruct(table.shape, table.dtype)
  params = model.store_weights(params, config, numerics)
  if transposed:
    # The embedding as the [D, V] output table (in the numerics' panels where they keep
    # them), its one copy: the lookup gathers from it (gemma_jax.model.Embedder). On a mesh
    # its columns are split over 'model' (sharding.vocabulary_sharding: a column split, no
    # bit moves), so each device holds its share of it, not the whole.
    packed = numerics.packs(*table.shape[::-1])
    make = ((lambda t: _output_table(t, packed)) if mesh is None else
            jax.jit(lambda t: t.astype(jnp.float32).T, out_shardings=sharding.vocabulary_sharding(
                mesh, table.shape[0])))
    table = (jax.eval_shape(make, table) if isinstance(table, jax.ShapeDtypeStruct)
             else make(table))
    params['embedder'] = {**params['embedder'], 'input_embedding': table}
  return params


def projection_weights(loaded: LoadedModel, config: TransformerConfig, numerics: Numerics, mesh,
                       params: dict, output_table: jax.Array | None) -> dict[str, jax.Array]:
  """One weight per distinct projection shape the model contracts through a dot (the first
  layer's of each; projections of at most `numerics.small` weights are elementwise products and
  sums), and the output table: what a self-check probes, each in the form the engine stores it.
  Read from the model's unplaced parameters where on a mesh (across processes nothing here waits
  on another process; random:SEED weights each drawn alone), else from `params`, as
  `place_weights` made them (no copy).

  Args:
    loaded, config: the model.
    numerics: the engine's numerics (with its dot kernel).
    mesh: the engine's mesh, or None.
    params: the engine's placed parameters.
    output_table: the engine's output table ([D, V] or its panels), or None.

  Returns:
    {'<I>x<O>': the weight as stored ([I, O], or the native kernels' panels [O / P, I, P]),
    'output_table': [D, V] or its panels [V / P, D, P], where the numerics keep one}.
  """
  out = {}
  small = getattr(numerics, 'small', 0)
  canonical = mesh is not None and not loaded.draws_where_used
  params = loaded.params if canonical else params
  for path, (k, n) in model.dense_weights(config).items():
    name = f'{k}x{n}'
    if k * n <= small or name in out:
      continue
    if mesh is not None and loaded.draws_where_used:  # this one drawn on its own
      leaf = jnp.asarray(drawn.leaf(loaded.seed, config, path, jnp.dtype(loaded.dtype)))
    else:
      leaf = params
      for key in path.split('/'):
        leaf = leaf[int(key) if key.isdigit() else key]
    stored = leaf.ndim == 3 and numerics.packs(k, n) and mesh is None
    out[name] = leaf if stored else numerics.stored(leaf.reshape(k, n))
  if output_table is not None and output_table.size > small:
    out['output_table'] = output_table
  return out
