"""What the rooms of graft.store.Store share: its names, errors and results."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import re

DESCRIPTION = 'store.json'
# Hashing runs in threads: hashlib and blake3 release the GIL on large buffers.
POOL = concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2)
HEX64 = re.compile('[0-9a-f]{64}')
OBJECT_NAME = re.compile('objects/[0-9a-f]{64}\\.[0-9a-f]{32}')
# Bytes read for a header: enough for any block object's preamble and header (about 150 bytes
# per leaf), so a graft reads a block far behind its end (global layers only) in one read.
HEADER_PROBE = 1 << 16
# How long a put's lease keeps its unpublished objects from gc (a put publishes a batch within
# seconds; a lease this old is a writer that was killed). Like git's prune expiry.
LEASE_SECONDS = 3600.0


class StoreError(ValueError):
  """A store that cannot be used with this engine; the message says why."""


class BadBlock(Exception):
  """A published block whose object failed verification during a graft."""

  def __init__(self, entry: dict, reason: str):
    super().__init__(reason)
    self.entry, self.reason = entry, reason


@dataclasses.dataclass(frozen=True)
class Match:
  """The longest stored prefix of a token sequence: `tokens` tokens, covered by `entries` (the
  last one possibly used for its first rows only: `rows` of it)."""

  tokens: int
  entries: tuple[dict, ...]
  rows: int  # rows used of the last entry


@dataclasses.dataclass
class Problem:
  """A bad entry or object: what was found and why it was refused."""

  key: str
  name: str  # the kvstore key that was read
  reason: str
