"""The stored form of the parameters: the one form the model's modules read.

A parameter tree (gemma_jax.model.Params) is in the stored form when each leaf says what it is:

  jax.Array     a weight as the checkpoint holds it ([inputs..., outputs...]; the embedding
                [V, D], the tied output table)
  Panels        a projection's [I, O] weight as a dot kernel's column panels [O / P, I, P]
  OutputTable   the embedding as the output table [D, V] (a jax.Array, or its Panels): the
                embedding's one copy, which the lookup gathers columns of

A checkpoint's tree is the stored form of the layout that stores nothing otherwise. A
`WeightLayout` (an engine's, from its plan and dot kernel) decides which weights take which
form; `gemma_jax.model.store_weights` and graft.engine.placement apply it once, and the modules
dispatch on the leaf's type, never on its shape.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Hashable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from gemma_jax import pytree, sharding
from gemma_jax.kernels import native_dot

if TYPE_CHECKING:  # the interface only
  from gemma_jax.kernels import DotKernel


@pytree.dataclass
class Panels:
  """A weight [I, O] kept as a dot kernel's column panels (gemma_jax.kernels.native_dot.pack):
  data [O / P, I, P], P = native_dot.PANEL."""

  data: jax.Array

  @property
  def dtype(self) -> jnp.dtype:
    """The weight's dtype."""
    return self.data.dtype


@pytree.dataclass
class OutputTable:
  """The embedding kept as the float32 output table [D, V] (data: that array, or its Panels
  [V / P, D, P]): the logits' weight and, read by columns, the lookup's table."""

  data: jax.Array | Panels

  @property
  def dtype(self) -> jnp.dtype:
    """float32."""
    return self.data.dtype

  def rows(self, tokens: jax.Array, mesh: Mesh | None = None) -> jax.Array:
    """The embedding rows of `tokens` [B, T] -> [B, T, D], exactly (a gather of columns). mesh:
    where the table's columns are split over 'model' (gemma_jax.sharding.table_rows)."""
    if isinstance(self.data, Panels):
      panels = self.data.data
      return panels[tokens // panels.shape[2], :, tokens % panels.shape[2]]
    return sharding.table_rows(self.data, tokens, mesh)


Weight = jax.Array | Panels  # a projection's weight as stored
Table = jax.Array | OutputTable  # the embedding as stored


@dataclasses.dataclass(frozen=True)
class WeightLayout:
  """How an engine stores its weights. kernel: the dot kernel whose column panels a projection
  of more than `small` values is kept in, where it `packs` it (None: every weight as loaded).
  output_table: the embedding kept as the output table [D, V] (in the kernel's panels where it
  packs [D, V]), not as the tied [V, D] table."""

  kernel: DotKernel | None = None
  small: int = 0
  output_table: bool = False

  def packs(self, k: int, n: int) -> bool:
    """Whether a [k, n] weight is kept as Panels."""
    return self.kernel is not None and k * n > self.small and self.kernel.packs(k, n)

  @property
  def storage(self) -> Hashable:
    """What decides every stored weight: engines whose layouts store alike share weights."""
    panels = self.kernel is not None and self.kernel.packs(1, native_dot.PANEL)
    return (('panels', self.small) if panels else None, self.output_table)

  def stored(self, w: jax.Array) -> Weight:
    """An [I, O] weight in its stored form (Panels where packed, else itself)."""
    return Panels(native_dot.pack(w)) if self.packs(*w.shape) else w


# The layout of a checkpoint's tree: every weight as loaded.
AS_LOADED = WeightLayout()
