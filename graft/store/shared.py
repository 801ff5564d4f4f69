"""What the parts of graft.store.Store share: its names, the codec bound to its namespace, the
problem log, and the errors and results they return.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import os
import re

from absl import logging

from graft.store import blocks

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


@dataclasses.dataclass(frozen=True)
class Match:
  """The longest stored prefix of a token sequence: `tokens` tokens, covered by `entries` (the
  last one possibly used for its first rows only: `rows` of it)."""

  tokens: int
  entries: tuple[dict, ...]
  rows: int  # rows used of the last entry


class Kind(enum.Enum):
  """What a Problem is. `gc` acts on verify's findings by their kind, never by their wording."""

  STRAY = 'stray'  # a name this store never makes: left alone (never read, followed or deleted)
  BAD_ENTRY = 'bad entry'  # an index entry that does not verify
  BAD_OBJECT = 'bad object'  # the object of a published entry does not verify
  UNREACHABLE = 'unreachable'  # a sound entry whose parent is not published
  UNPUBLISHED = 'unpublished'  # an object no entry names (left by an interrupted or losing put)
  CONFLICT = 'conflict'  # a published block whose bytes differ from a writer's computation
  FORGED = 'forged'  # audit: its bytes differ from a recomputation by the reader's engine
  BUILT_ON_FORGERY = 'built on a forgery'  # audit: its recorded parent header is a forgery's
  UNTRUSTED = 'untrusted'  # not signed by a trusted key: a miss, recomputed
  OTHER_PARENT = 'other parent'  # computed on another version of its parent: a miss


@dataclasses.dataclass
class Problem:
  """A bad entry or object: what kind of problem was found, where, and why it was refused."""

  kind: Kind
  key: str  # the block's key ('' for a stray name)
  name: str  # the kvstore key that was read
  reason: str


class Problems(list):
  """Every Problem the parts of one store reported, in order (a list); `report` adds one and
  logs it."""

  def __init__(self, url: str):
    super().__init__()
    self.url = url

  def report(self, kind: Kind, key: str, name: str, reason: str) -> None:
    """Records a refused entry or object and logs it with the store's URL."""
    self.append(Problem(kind, key=key, name=name, reason=reason))
    logging.warning('store %s: refusing %s (block %s..): %s', self.url, name, key[:16], reason)


@dataclasses.dataclass(frozen=True)
class Codec:
  """The block formats (graft/store/blocks.py) bound to one store: every entry and header is
  decoded against its namespace, the engine's block layout and vocabulary."""

  namespace: str
  layout: blocks.BlockLayout
  vocab_size: int
  block_tokens: int  # tokens per block: the engine's rows_per_call

  def entry(self, data: bytes, *, parent: str, key: str, start: int) -> dict:
    """The verified index entry index/<parent>/<key> of a block at sequence index `start`
    (BlockError if it is not one)."""
    return blocks.decode_entry(data, ns=self.namespace, parent=parent, key=key,
                               expected_start=start, layout=self.layout,
                               vocab_size=self.vocab_size)

  def header(self, header_bytes: bytes, key: str) -> dict:
    """The verified header of block `key`'s object (BlockError if it is not one)."""
    return blocks.decode_header(header_bytes, ns=self.namespace, expected_key=key,
                                layout=self.layout, vocab_size=self.vocab_size)
