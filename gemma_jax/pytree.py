"""Frozen dataclasses that are JAX pytrees: the values a model call takes and returns (the KV
state, the numerics, the stored weights, a call's `Step`).

    @pytree.dataclass
    class CallBundle:
      zero: jax.Array                                   # a leaf: traced, donated, sharded
      mesh: Mesh | None = pytree.field(static=True, default=None)  # part of the jit cache key

Built on JAX's own `jax.tree_util.register_dataclass`, so that defining them imports nothing
beyond jax: the `flax.struct` these were before imports the whole of Flax (flax.linen, and
flax.nnx with treescope), most of the project's import time on a warm start
(docs/performance.md, "The start"). Flax NNX is imported where a model's modules are built or
traced, or its weights put in their stored form (gemma_jax.model), not where its state is only
held.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, dataclass_transform

import jax

T = TypeVar('T')


def field(*, static: bool = False, **kwargs: Any) -> Any:
  """A dataclass field; static: not a leaf but part of the tree's structure (hashable; a jitted
  function is compiled again for another value). kwargs: dataclasses.field's (default,
  metadata, ...)."""
  metadata = {**kwargs.pop('metadata', {}), 'static': static}
  return dataclasses.field(metadata=metadata, **kwargs)


@dataclass_transform(frozen_default=True, field_specifiers=(field, dataclasses.field))
def dataclass(cls: type[T]) -> type[T]:
  """`cls` as a frozen dataclass registered as a pytree: its fields are leaves (subtrees) unless
  made with `field(static=True)`, and `value.replace(**changes)` is `dataclasses.replace`."""
  cls = dataclasses.dataclass(frozen=True)(cls)
  setattr(cls, 'replace', _replace)
  return jax.tree_util.register_dataclass(cls)


def _replace(self: Any, **changes: Any) -> Any:
  """A copy with `changes` (dataclasses.replace)."""
  return dataclasses.replace(self, **changes)
