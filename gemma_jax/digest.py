"""Content hashes of stored bytes, computed while the bytes are read.

Object formats name the function their hashes were made with (an artifact's or a block's
format version decides it), so objects written under an older format still read: SHA-256 in
kv-graft-artifact/2 and kv-graft-block/2, BLAKE3 from version 3 on. BLAKE3 (the `blake3`
package) is a cryptographic hash several times faster than SHA-256 per core, so hashing no
longer bounds a restore (docs/security.md; experiments.bench measures
restore_fraction_of_raw_read). Keys, namespaces and manifests stay SHA-256
chains; only the per-leaf and per-file content hashes change.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import enum
import hashlib
import json
import os
from typing import Any, Callable

import blake3
import numpy as np

HASHES: dict[str, Callable[..., Any]] = {'sha256': hashlib.sha256, 'blake3': blake3.blake3}
PIECE = 4 << 20  # bytes read and hashed at a time: they are hashed while still in the cache
WORKERS = max(2, os.cpu_count() or 1)
# Reads and hashes run in threads (file reads and both hashes release the GIL): every core.
POOL = concurrent.futures.ThreadPoolExecutor(WORKERS, thread_name_prefix='read-hashed')


class ReadError(OSError):
  """A file that cannot be read, or holds fewer bytes than expected; the message names it."""


def canonical_json(value: Any) -> bytes:
  """`value` as canonical JSON: sorted keys, no spaces, UTF-8 (dataclasses as their fields, enums
  as their values; any other non-JSON value is a TypeError). The one text that is hashed, signed
  and stored as a document: fingerprints, block headers and index entries, signatures, verdict
  keys."""
  def default(obj: object) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
      return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
      return obj.value
    raise TypeError(f'cannot write {type(obj).__name__} as canonical JSON')
  return json.dumps(value, sort_keys=True, separators=(',', ':'), default=default).encode()


def as_bytes(data: bytes | memoryview | np.ndarray) -> memoryview:
  """A byte view of bytes or of an array's raw C-order bytes (any shape and dtype, bfloat16
  included)."""
  if isinstance(data, np.ndarray):
    return np.ascontiguousarray(data).reshape(-1).view(np.uint8).data
  return memoryview(data).cast('B')


def hexdigest(name: str, data: bytes | memoryview | np.ndarray) -> str:
  """The `name` hash of `data` (bytes, or an array's raw C-order bytes: any shape)."""
  return HASHES[name](as_bytes(data)).hexdigest()


def read_into(path: str, out: memoryview, name: str) -> tuple[int, str]:
  """Reads the file at `path` into `out` (a byte view of its expected size), hashing each piece
  as it arrives: one pass over the bytes. Returns (bytes read, hex digest of them); a file
  shorter than `out` returns fewer bytes, so the caller can refuse it (bytes past `out` are not
  read: what was read is what the digest covers)."""
  h = HASHES[name]()
  done = 0
  with open(path, 'rb', buffering=0) as f:
    while done < len(out):
      n = f.readinto(out[done:done + PIECE])
      if not n:
        break
      h.update(out[done:done + n])
      done += n
  return done, h.hexdigest()


def read_files(root: str, sizes: dict[str, int], name: str,
               into: dict[str, np.ndarray] | None = None) -> dict[str, str]:
  """Reads each file (a path relative to `root`, of the size given) once, hashing it as it
  lands, the files shared out by bytes over every core (one task per core: a task per file
  would cost more than a small file's read). A file named in `into` lands in that array (of
  any shape, its raw bytes the file's `sizes` of them); any other is hashed and dropped.
  Returns {file: hex digest}."""
  into = into or {}

  def read(relative):
    out = (as_bytes(into[relative]) if relative in into
           else memoryview(bytearray(sizes[relative])))
    try:
      size, got = read_into(os.path.join(root, relative), out, name)
    except OSError as e:
      raise ReadError(f'file {relative} cannot be read ({e})') from None
    if size != len(out):
      raise ReadError(f'file {relative} has {size} bytes, {len(out)} expected')
    return got

  shares: list[list[str]] = [[] for _ in range(WORKERS)]
  loads = [0] * WORKERS
  for relative in sorted(sizes, key=lambda relative: -sizes[relative]):
    i = loads.index(min(loads))
    shares[i].append(relative)
    loads[i] += sizes[relative]
  others = [POOL.submit(lambda share: [(f, read(f)) for f in share], share)
            for share in shares[1:]]
  digests = dict((f, read(f)) for f in shares[0])
  for other in others:
    digests.update(other.result())
  return digests
