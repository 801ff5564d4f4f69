"""Placement on a jax.sharding mesh: parameters, the KV state, and the layout of the matmuls.

A mesh has a 'model' axis (tensor parallel over heads and the MLP) and a 'data' axis (data
parallel over sequences, the batch). Every projection is stored [inputs..., outputs...], so
Megatron-style tensor parallelism is a choice of one axis per weight: column-parallel
projections (q_proj, kv_proj, k_proj, gate_up_proj, the per-layer gate) split their last
output axis; row-parallel ones (o_proj, down_proj, per_layer_projection) split their first,
contracted, axis; the embedding splits the vocabulary. Norm scales and small tensors are
replicated. A dimension that does not divide by the axis size stays whole. XLA inserts the
collectives.

Two layouts (LAYOUTS), because where a contraction is split decides the bits:

  split    Megatron: row-parallel weights are split along their contraction, each device sums
           its part and an all-reduce adds the parts. Under XLA's own numerics the sum's order
           follows the device count, so results on 2 devices differ in their last bits from
           results on 1 or 4. The fixed-order numerics (pinned, spec) add their contraction
           chunks' results in chunk order whichever device made them, and measured at two
           devices they keep the one-device bits (docs/determinism.md, "Meshes").
  gather   no contraction is ever split: the activation entering a row-parallel projection is
           gathered whole (`whole`, a sharding constraint the model applies before every
           row-parallel projection and after every projection, on the mesh the engine binds into each call's
           gemma_jax.numerics.CallBundle), and
           the row-parallel weights are split by their output columns instead, as the
           column-parallel ones are (each output column is its own chain over the whole
           contraction, wherever it is computed: a column split moves no bit), so each device
           holds its share of them rather than all of them (the 1B's o_proj and down_proj are
           0.95 GB: on model:8 a replica of them on every device was 7.6 GB). The output table
           [D, V] (the embedding's one copy) is split by its columns, the vocabulary
           (`vocabulary_sharding`; the lookup is exact, `table_rows`). More communication, but
           every dot sees the whole contraction on every mesh.

Projections on a mesh: each is kept as the [I, O] matrix it is contracted as (I the product
of its input axes, O of its outputs; graft.engine.placement, gemma_jax.drawn), so a split of its
outputs is a split into contiguous blocks of columns. Kept in its own shape, a weight split along
a minor output axis (q_proj [D, N, H] along H when N does not divide, gate_up_proj [D, 2, F]
along F) has no block sharding once the call reshapes it to [I, O], and XLA gathered it whole on
every device, every call, each device then computing every column (the 270M's block step on
model:8 all-gathered every column-parallel weight). The projection's output is made whole again
after the call (gemma_jax.layers.Dense), as the model reads it by head.

The KV state is sharded over KV heads ('model') where they divide, and over the batch
('data').
"""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


_COLUMN = ('q_proj', 'kv_proj', 'k_proj', 'gate_up_proj', 'per_layer_input_gate')
_ROW = ('o_proj', 'down_proj', 'per_layer_projection')
LAYOUTS = ('split', 'gather')
AXES = ('data', 'model')


def parse_mesh(spec: str) -> dict[str, int]:
  """'model:4' or 'model:2,data:2' -> {'data': d, 'model': m} (absent axes have size 1). Axes
  may also be joined by '+' ('model:2+data:2'), which a list of meshes in one flag needs."""
  axes = {'data': 1, 'model': 1}
  for part in (p.strip() for p in spec.replace('+', ',').split(',') if p.strip()):
    name, sep, size = part.partition(':')
    if not sep or name not in axes or not size.isdigit() or int(size) < 1:
      raise ValueError(f'mesh {spec!r}: expected axis:size pairs over {AXES}, e.g. model:2,data:2')
    axes[name] = int(size)
  return axes


def xla_flags() -> str:
  """$XLA_FLAGS, read here and nowhere else: it decides bits (an engine checks that its config's
  flags are the process's; `set_host_devices` writes it)."""
  return os.environ.get('XLA_FLAGS', '')


def host_device_flag(axes: dict[str, int], processes: int = 1) -> str:
  """The XLA flag that gives a CPU process its share of the mesh's devices."""
  count = math.prod(axes.values())
  if count % processes:
    raise ValueError(f'the mesh {axes} ({count} devices) does not divide over {processes} '
                     'processes')
  return f'--xla_force_host_platform_device_count={count // processes}'


def set_host_devices(axes: dict[str, int], processes: int = 1) -> None:
  """On a CPU host, asks XLA for this process's share of the mesh's devices (before jax starts
  its backend)."""
  flag = host_device_flag(axes, processes)
  current = xla_flags()
  if flag not in current:
    kept = ' '.join(f for f in current.split()
                    if not f.startswith('--xla_force_host_platform_device_count'))
    os.environ['XLA_FLAGS'] = f'{kept} {flag}'.strip()


def initialize_distributed(coordinator: str, num_processes: int, process_id: int) -> None:
  """Joins this process to a jax.distributed run (JAX's own runtime: the coordination service at
  `coordinator`, host:port; CPU collectives over gloo). Before jax starts its backend; after it,
  jax.devices() is every process's devices and a mesh spans them."""
  if not 0 <= process_id < num_processes:
    raise ValueError(f'process id {process_id} is not in [0, {num_processes})')
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  jax.distributed.initialize(coordinator_address=coordinator, num_processes=num_processes,
                             process_id=process_id)


def to_host(x: Any) -> np.ndarray:
  """A jax.Array as one NumPy array in every process: as is where this process holds all of it
  (one process, or replicated), else gathered from every process (multihost_utils; every
  process must call it, as with any computation on a global array). Any shape, kept."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable and not x.is_fully_replicated:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(x)


def make_mesh(axes: dict[str, int]) -> Mesh:
  """A Mesh of the first data x model devices, axes AXES ('data', 'model'), from
  `parse_mesh`'s sizes (ValueError when this process has fewer devices)."""
  count = math.prod(axes.values())
  devices = jax.devices()
  if len(devices) < count:
    raise ValueError(f'the mesh {axes} needs {count} devices; this process has {len(devices)} '
                     '(on a CPU, --xla_force_host_platform_device_count)')
  return Mesh(np.array(devices[:count]).reshape(axes['data'], axes['model']), AXES)


def partition_spec(name: str, shape: tuple[int, ...], model_size: int,
                   layout: str = 'split') -> P:
  """The PartitionSpec of the parameter called `name` ('layers/0/attn/q_proj/w', ...)."""
  parts = name.split('/')
  module = parts[-2] if len(parts) > 1 else ''
  spec: list[str | None] = [None] * len(shape)
  if module in _COLUMN:
    axis = len(shape) - 1
  elif module in _ROW:  # split: the contraction; gather: the outputs (the input whole)
    axis = 0 if layout == 'split' else len(shape) - 1
  elif parts[-1] == 'input_embedding' and layout == 'split':
    axis = 0
  else:
    return P()
  if shape[axis] % model_size:  # a dimension that does not split evenly stays whole
    return P()
  spec[axis] = 'model'
  return P(*spec)


def param_shardings(params: Any, mesh: Mesh, layout: str = 'split') -> Any:
  """The NamedSharding of every parameter, as a tree like `params`."""
  if layout not in LAYOUTS:
    raise ValueError(f'unknown layout {layout!r}; expected one of {LAYOUTS}')
  model_size = mesh.shape['model']

  def sharding(path, leaf):
    name = '/'.join(str(getattr(k, 'key', getattr(k, 'idx', k))) for k in path)
    return NamedSharding(mesh, partition_spec(name, np.shape(leaf), model_size, layout))

  return jax.tree_util.tree_map_with_path(sharding, params)


def shard_params(params: Any, mesh: Mesh, layout: str = 'split') -> Any:
  """Places params on `mesh` (which must have a 'model' axis) by `partition_spec`."""
  return jax.tree.map(jax.device_put, params, param_shardings(params, mesh, layout))


def whole(x: jax.Array, mesh: Mesh | None) -> jax.Array:
  """x [B, ...], about to be contracted by a row-parallel projection, or just made by a
  projection from its weight's output columns (gemma_jax.layers.Dense): whole on every device of `mesh` (the 'gather' layout: the
  contraction is never split, and the residual stream, whose norms reduce over its features,
  never holds them split; sequences stay split over 'data' where B divides), unchanged where
  mesh is None."""
  if mesh is None:
    return x
  batch = 'data' if x.shape[0] % mesh.shape['data'] == 0 else None
  return jax.lax.with_sharding_constraint(
      x, NamedSharding(mesh, P(batch, *([None] * (x.ndim - 1)))))


def vocabulary_sharding(mesh: Mesh, vocab: int) -> NamedSharding:
  """The output table [D, V]'s sharding on a mesh: its columns (the vocabulary) split over the
  'model' axis where it divides them (each device holds its share, and the logits' columns are
  computed where they are: no contraction is split), else whole on every device."""
  return NamedSharding(mesh, P(None, 'model') if vocab % mesh.shape['model'] == 0 else P())


def table_rows(table: jax.Array, tokens: jax.Array, mesh: Mesh | None) -> jax.Array:
  """The embedding rows of `tokens` [B, T] from the output table [D, V] (the embedding's one
  copy, transposed) -> [B, T, D], exactly: each device takes the rows its share of the
  vocabulary holds and gives -0 for the others, and the shares are added over 'model' (x + -0
  is x for every x, -0 included, so the sum is the owner's value whatever the order)."""
  if mesh is None or mesh.shape['model'] == 1 or table.shape[1] % mesh.shape['model']:
    return jnp.moveaxis(jnp.take(table, tokens, axis=1), 0, -1)

  def local(share, ids):  # share [D, V / n], ids [B, T]
    width = share.shape[1]
    mine = ids - jax.lax.axis_index('model') * width
    inside = (mine >= 0) & (mine < width)
    rows = jnp.take(share, jnp.clip(mine, 0, width - 1), axis=1)  # [D, B, T]
    return jax.lax.psum(jnp.where(inside[None], rows, -0.0), 'model')

  rows = jax.shard_map(local, mesh=mesh, in_specs=(P(None, 'model'), P()), out_specs=P(),
                       check_vma=False)(table, tokens)
  return jnp.moveaxis(rows, 0, -1)


def kv_shardings(kv: Any, mesh: Mesh) -> Any:
  """The NamedSharding of every KV-state leaf: K/V [B, S, K, H] over ('data', -, 'model'
  where K divides, -), positions [B, S] and fill [B] over 'data' where B divides."""
  data, model = mesh.shape['data'], mesh.shape['model']

  def spec(leaf):
    batch = 'data' if leaf.shape[0] % data == 0 else None
    if leaf.ndim == 4:
      return NamedSharding(mesh, P(batch, None, 'model' if leaf.shape[2] % model == 0 else None,
                                   None))
    return NamedSharding(mesh, P(batch, *([None] * (leaf.ndim - 1))))

  return jax.tree.map(spec, kv)
