"""Orbax access for the parameter cache and the artifacts: raw bytes, quiet logs.

Orbax compresses with zstd by default; we store raw dtype bytes (use_compression=False) so that
what is hashed is what is on disk. Orbax logs every save and restore at INFO through absl, which
drowns an experiment's own progress lines, so calls run at WARNING verbosity.
"""

from __future__ import annotations

import contextlib

from absl import logging


@contextlib.contextmanager
def quiet():
  previous = logging.get_verbosity()
  logging.set_verbosity(logging.WARNING)
  try:
    yield
  finally:
    logging.set_verbosity(previous)


def raw_checkpointer():
  """A PyTree checkpointer that stores arrays uncompressed, in their own dtype."""
  import orbax.checkpoint as ocp  # imported lazily: it is slow to import
  return ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_compression=False))


def save(path: str, tree) -> None:
  with quiet():
    raw_checkpointer().save(path, tree)


def restore(path: str):
  """Restores to NumPy arrays (no device placement, any device count)."""
  with quiet():
    return raw_checkpointer().restore(path)
