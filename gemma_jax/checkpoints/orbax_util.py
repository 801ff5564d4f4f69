"""Orbax access for the parameter cache and the artifacts: raw bytes, quiet logs.

Orbax compresses with zstd by default; we store raw dtype bytes (use_compression=False) so that
what is hashed is what is on disk. Orbax logs every save and restore at INFO through absl, which
drowns an experiment's own progress lines, so calls run at WARNING verbosity.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

from absl import logging


@contextlib.contextmanager
def quiet(level: int = logging.WARNING) -> Iterator[None]:
  """A context in which absl logs at `level` and above only (Orbax's INFO lines hidden)."""
  previous = logging.get_verbosity()
  logging.set_verbosity(level)
  try:
    yield
  finally:
    logging.set_verbosity(previous)


def raw_checkpointer() -> Any:
  """A PyTree checkpointer that stores arrays uncompressed, in their own dtype."""
  import orbax.checkpoint as ocp  # imported lazily: it is slow to import
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def save(path: str, tree: Any) -> None:
  """Saves a PyTree of arrays at `path`, uncompressed (`raw_checkpointer`), quietly."""
  with quiet():
    raw_checkpointer().save(path, tree)


def save_leaf_files(path: str, tree: dict) -> None:
  """Saves a flat {name: array} tree as an Orbax checkpoint in which every leaf's raw C-order
  bytes are one file, `leaf_file(name, ndim)`: zarr v2 without OCDBT or compression writes one
  chunk per single-device array. Orbax restores it as any checkpoint; a reader that knows the
  leaves' dtypes and shapes can read the files directly, in one pass, at disk speed."""
  import orbax.checkpoint as ocp  # imported lazily: it is slow to import
  with quiet(logging.ERROR):  # it warns that it has no OCDBT files to merge
    handler = ocp.PyTreeCheckpointHandler(use_compression=False, use_ocdbt=False,
                                          use_zarr3=False)
    ocp.Checkpointer(handler).save(path, tree)


def stored_name(leaf: str) -> str:
  """A leaf's name in a flat Orbax tree ('layer_0/k' -> 'layer_0.k': Orbax nests on '/')."""
  return leaf.replace('/', '.')


def leaf_file(name: str, ndim: int) -> str:
  """Where save_leaf_files put leaf `name`'s bytes, relative to the checkpoint: its zarr
  directory and the name of its only chunk ('layer_0.k/0.0.0')."""
  return f'{name}/' + '.'.join(['0'] * max(ndim, 1))


def restore(path: str) -> Any:
  """Restores to NumPy arrays (no device placement, any device count)."""
  with quiet():
    return raw_checkpointer().restore(path)
