"""What the live engines of one loaded model share: their placed and stored weights, output
table and compiled steps (a second engine of a replay costs no second copy), each freed with
the last engine that holds it."""

from __future__ import annotations

import weakref
from typing import Callable, Hashable, TypeVar

T = TypeVar('T')

# id(loaded model) -> {key: a weak reference to what engines of that model share under key}.
_SHARED: dict[int, dict] = {}


class _Held:
  """One shared value; the engines that use it hold it, the table only refers to it."""

  __slots__ = ('value', '__weakref__')

  def __init__(self, value):
    self.value = value


def shared(holder: list, loaded: object, key: Hashable, make: Callable[[], T]) -> T:
  """make(), shared by the live engines of `loaded` (a LoadedModel) that ask for the same key;
  `holder`, the asking engine's list of what it holds, keeps the value alive as long as that
  engine lives."""
  entry = _SHARED.get(id(loaded))
  if entry is None:
    entry = _SHARED[id(loaded)] = {}
    weakref.finalize(loaded, _SHARED.pop, id(loaded), None)
  held = entry[key]() if key in entry else None
  if held is None:
    held = _Held(make())
    entry[key] = weakref.ref(held)
  holder.append(held)
  return held.value
