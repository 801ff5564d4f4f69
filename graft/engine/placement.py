"""Where and in which form an engine holds its weights: placed on its mesh, each in the stored
form its WeightLayout decides (gemma_jax.stored: a projection as the native kernels' column
Panels or as loaded, the embedding as the OutputTable where the layout keeps one); and which of
them a self-check probes.

Functions of what they are given (the loaded model, its config, the engine's layout and mesh);
`Engine` calls them and shares what they make with the other engines of its model
(graft.engine.shared).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from gemma_jax import drawn, model, sharding
from gemma_jax.checkpoints import param_cache, tree
from gemma_jax.config import TransformerConfig
from gemma_jax.kernels import native_dot
from gemma_jax.model import Params
from gemma_jax.stored import OutputTable, Panels, Weight, WeightLayout
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


def _from_cache(loaded: LoadedModel, layout: WeightLayout) -> Params | None:
  """The loaded model's parameter-cache entry as the stored form of `layout`, where the entry
  is laid out so (the embedded model's packed entry: mapped, not copied), else None."""
  entry = loaded.stored
  if entry is None:
    return None
  packing = entry.layout
  if (param_cache.OUTPUT_TABLE not in packing.get('packed', {})
      or packing.get('panel') != native_dot.PANEL
      or layout.storage != (('panels', packing.get('small')), True)):
    return None
  flat: dict[str, Any] = {}
  for name, leaf in entry.stored.items():
    placed = jax.device_put(leaf)
    if name == param_cache.OUTPUT_TABLE:  # the panels of the table's transpose [D, V]
      flat[name] = OutputTable(Panels(placed))
    else:
      flat[name] = Panels(placed) if name in packing['packed'] else placed
  return tree.unflatten(flat)


def place_weights(loaded: LoadedModel, model_config: TransformerConfig, layout: WeightLayout,
                  mesh: Mesh | None, mesh_layout: str) -> Params:
  """The parameters in the stored form of `layout` (gemma_jax.stored), placed on `mesh` (None:
  one device): the loaded model's parameter-cache entry as it is, where it is laid out so (the
  embedded model's packed entry: mapped, not copied); else placed on the mesh and stored by the
  layout (a copy). The embedding becomes the OutputTable ([D, V], or its Panels [V / P, D, P])
  where the layout keeps one: its one copy, which the lookup reads by columns. random:SEED
  weights are drawn where and as they are kept (gemma_jax.drawn: one copy)."""
  if loaded.seed is not None and loaded.draws_where_used:
    return drawn.place(loaded.seed, model_config, loaded.dtype, layout, mesh, mesh_layout)
  cached = _from_cache(loaded, layout) if mesh is None else None
  if cached is not None:
    return cached
  params = loaded.params
  if layout.output_table:  # set apart: it becomes the output table, placed on its own
    embedder = dict(params['embedder'])
    table = embedder.pop('input_embedding')
    params = {**params, 'embedder': embedder}
  if mesh is not None:
    params = sharding.shard_params(_as_matrices(params, model_config), mesh, mesh_layout)
  if layout.output_table:  # its shape stands in while the projections are stored
    params['embedder']['input_embedding'] = jax.ShapeDtypeStruct(table.shape, table.dtype)
  params = model.store_weights(params, model_config, layout)
  if layout.output_table:
    # On a mesh its columns are split over 'model' (sharding.vocabulary_sharding: a column
    # split, no bit moves), so each device holds its share of it, not the whole.
    packed = layout.packs(*table.shape[::-1])
    make = ((lambda t: _output_table(t, packed)) if mesh is None else
            jax.jit(lambda t: t.astype(jnp.float32).T, out_shardings=sharding.vocabulary_sharding(
                mesh, table.shape[0])))
    data = (jax.eval_shape(make, table) if isinstance(table, jax.ShapeDtypeStruct)
            else make(table))
    params['embedder'] = {**params['embedder'],
                          'input_embedding': OutputTable(Panels(data) if packed else data)}
  return params


def _as_matrices(params: Params, model_config: TransformerConfig) -> Params:
  """params with every dense projection as the [I, O] matrix it is contracted as (concrete or
  abstract leaves): how a mesh keeps them (gemma_jax.sharding, "Projections on a mesh")."""
  dense = model.dense_weights(model_config)

  def matrix(path: tuple, w: Any) -> Any:
    shape = dense.get(tree.path_name(path))
    if shape is None:
      return w
    if isinstance(w, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(shape, w.dtype)
    return w.reshape(shape)

  return jax.tree_util.tree_map_with_path(matrix, params)


def projection_weights(loaded: LoadedModel, model_config: TransformerConfig,
                       layout: WeightLayout, mesh: Mesh | None,
                       params: Params) -> dict[str, Weight]:
  """One weight per distinct projection shape the model contracts through a dot (the first
  layer's of each; projections of at most `layout.small` weights are elementwise products and
  sums), and the output table: what a self-check probes, each in the form the engine stores it.
  Read from the model's unplaced parameters where on a mesh (across processes nothing here waits
  on another process; random:SEED weights each drawn alone), else from `params`, as
  `place_weights` made them (no copy).

  Args:
    loaded, model_config: the model.
    layout: the engine's weight layout.
    mesh: the engine's mesh, or None.
    params: the engine's placed parameters (`place_weights`).

  Returns:
    {'<I>x<O>': the weight as stored ([I, O], or the native kernels' Panels [O / P, I, P]),
    'output_table': [D, V] or its Panels [V / P, D, P], where the layout keeps one}.
  """
  out: dict[str, Weight] = {}
  canonical = mesh is not None and not loaded.draws_where_used
  source = loaded.params if canonical else params
  for path, (k, n) in model.dense_weights(model_config).items():
    name = f'{k}x{n}'
    if k * n <= layout.small or name in out:
      continue
    leaf: Any
    if mesh is not None and loaded.seed is not None and loaded.draws_where_used:
      # this one drawn on its own (random:SEED weights are never held as a tree)
      leaf = jnp.asarray(drawn.leaf(loaded.seed, model_config, path, jnp.dtype(loaded.dtype)))
    else:
      leaf = source
      for key in path.split('/'):
        leaf = leaf[int(key) if key.isdigit() else key]
    out[name] = leaf if isinstance(leaf, Panels) else layout.stored(leaf.reshape(k, n))
  table = params['embedder']['input_embedding']
  if isinstance(table, OutputTable):
    data = table.data.data if isinstance(table.data, Panels) else table.data
    if data.size > layout.small:
      out['output_table'] = table.data
  return out
