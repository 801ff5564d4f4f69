"""A cache of dequantized float32 parameters in the layout an engine reads, memory-mapped at start.

Dequantizing the embedded GGUF takes tens of seconds; mapping the cached entry takes
milliseconds. An entry holds each parameter's raw C-order bytes, one file per parameter, in its
*stored* form: as the builder laid it out for the kernels that read it (the native kernels'
column panels, gemma_jax.weights), or as it is; the tokenizer model; and `hashes.json`: the
format, the BLAKE3 of every stored parameter's bytes, the layout (which parameters are stored in
panels, and their canonical shapes), the SHA-256 of the canonical parameters (what the model
fingerprint binds: recorded once, when the entry is built, so that no process hashes every
weight to name its model) and the tokenizer's SHA-256.

Writes. An entry is written one parameter at a time, packed, hashed and written before the next
is packed (the build holds the canonical parameters and one stored copy of one of them), and
each file in one write: the page cache then holds it in large folios (on a kernel and file
system that have them, e.g. ext4 since Linux 6.16), which a mapping maps with 2 MB pages. A
decode step streams every weight once, and with 4 KB pages that is one TLB miss per 4 KB: the
embedded model decoded slower from files written in small pieces (by Orbax, before this) than
from the same weights in anonymous memory (docs/performance.md measures both).

Reads. `mapped` maps every parameter file read-only (the OS pages it in as it is used, asked
for 2 MB pages with MADV_HUGEPAGE, and jax.device_put of a mapped array on a CPU aliases it, so
a process holds one copy of each weight, the page cache's) and starts hashing the files in a
background thread; a caller must `Entry.check()` before it hands out anything computed from
them (gemma_jax.weights and the engine do): a file that does not match its hash (a flipped bit)
raises CacheEntryError there, and the entry is moved aside so that the next process rebuilds it.
`load_entry` reads and verifies at once and returns the canonical parameters.

Entries are written under a staging name and renamed into place once complete
(gemma_jax.files.atomic_directory), so a reader sees a whole entry or none; an entry that does
not match (a damaged file, a truncated one, an older format) is reported, moved aside and
rebuilt from the source, never used.
"""

from __future__ import annotations

import dataclasses
import json
import math
import mmap
import os
import shutil
import threading
import uuid
from typing import Any, Callable

from absl import logging
import numpy as np

from gemma_jax import digest, files
from gemma_jax.files import cache_root
from gemma_jax.checkpoints import tree
from gemma_jax.compare import sha256_bytes
from gemma_jax.tokenizer import Tokenizer

_TOKENIZER_FILE = 'tokenizer.model'
_PARAMS_DIR = 'params'
_HASHES_FILE = 'hashes.json'
FORMAT = 'gemma-jax-param-cache/4'


class CacheEntryError(ValueError):
  """A cache entry that does not match the hashes written with it."""


def _leaf_file(name: str) -> str:
  """Where parameter `name` ('layers/0/mlp/down_proj/w') is stored in an entry."""
  return os.path.join(_PARAMS_DIR, name.replace('/', '.'))


@dataclasses.dataclass
class Entry:
  """A mapped cache entry. stored: flat name ('layers/0/mlp/down_proj/w') -> a read-only
  memory-mapped array of the parameter's stored form; layout: {'panel': P, 'packed': {name:
  canonical shape}} for the parameters stored as column panels [O / P, I, P] of their [I, O]
  matrix (K the product of the input dims; 'embedder/input_embedding' [V, D] as the panels of
  its transpose, the output table), {} when every parameter is stored as it is;
  params_sha256: the canonical parameters' digest (gemma_jax.checkpoints.tree.params_digest)."""

  directory: str
  stored: dict[str, np.ndarray]
  tokenizer: Tokenizer
  layout: dict
  params_sha256: str
  _verified: threading.Event = dataclasses.field(default_factory=threading.Event, repr=False)
  _failure: list = dataclasses.field(default_factory=list, repr=False)

  def check(self) -> None:
    """Waits for the background hash of every file; raises CacheEntryError (and moves the entry
    aside, so that the next process rebuilds it) where a file does not match its hash."""
    self._verified.wait()
    if self._failure:
      _set_aside(self.directory)
      raise CacheEntryError(self._failure[0])

  def canonical(self) -> dict:
    """The parameters in their canonical layout, as a tree of float32 NumPy arrays (a copy of
    the packed ones)."""
    flat = {}
    for name, leaf in self.stored.items():
      shape = self.layout.get('packed', {}).get(name)
      flat[name] = leaf if shape is None else unpack(leaf, shape, name)
    return tree.unflatten(flat)


def unpack(panels: np.ndarray, shape: tuple[int, ...] | list[int], name: str) -> np.ndarray:
  """A parameter of canonical `shape` from its column panels [O / P, I, P] (see Entry)."""
  if name == OUTPUT_TABLE:  # the panels of the table's transpose [D, V]
    return np.ascontiguousarray(panels.transpose(0, 2, 1)).reshape(shape)
  k = panels.shape[1]
  return np.ascontiguousarray(panels.transpose(1, 0, 2)).reshape(k, -1).reshape(shape)


# The parameter whose stored panels are the transposed table's (the embedding is the output
# table: one copy serves the lookup and the logits).
OUTPUT_TABLE = 'embedder/input_embedding'


def save_entry(directory: str, params: dict, tokenizer: Tokenizer,
               pack: Callable[[dict], tuple[dict, Callable[[str], np.ndarray]]] | None = None
               ) -> None:
  """Writes params (float32, canonical), in the form `pack` stores them, the tokenizer and their
  hashes into `directory` (which must not exist), atomically. pack(flat {name: array}) ->
  (layout, stored): the entry's layout and stored(name) -> that parameter's stored form (of any
  shape: e.g. a [I, O] matrix's column panels [O / P, I, P]), made when it is written (None:
  every parameter as it is)."""
  flat = {name: np.asarray(leaf, np.float32) for name, leaf in tree.flatten(params).items()}
  layout, stored = pack(flat) if pack else ({}, flat.__getitem__)
  record: dict[str, Any] = {
      'format': FORMAT, 'params': {}, 'layout': layout, 'params_sha256': tree.params_digest(flat),
      'tokenizer_sha256': sha256_bytes(np.frombuffer(tokenizer.model_proto, np.uint8))}
  with files.atomic_directory(directory) as staging:
    os.mkdir(os.path.join(staging, _PARAMS_DIR))
    for name in sorted(flat):
      leaf = np.ascontiguousarray(stored(name))
      with open(os.path.join(staging, _leaf_file(name)), 'wb') as f:
        f.write(leaf.reshape(-1).view(np.uint8).data)  # one write: see the module's docstring
      record['params'][name] = {'dtype': leaf.dtype.name, 'shape': list(leaf.shape),
                                'blake3': digest.hexdigest('blake3', leaf)}
      del leaf  # the next parameter's stored form is made after this one's is released
    with open(os.path.join(staging, _TOKENIZER_FILE), 'wb') as f:
      f.write(tokenizer.model_proto)
    with open(os.path.join(staging, _HASHES_FILE), 'w') as f:
      json.dump(record, f, indent=1)


def _read_record(directory: str) -> tuple[dict, bytes]:
  with open(os.path.join(directory, _HASHES_FILE)) as f:
    record = json.load(f)
  if record.get('format') != FORMAT:
    raise CacheEntryError(f'{directory} is of format {record.get("format")!r}, not {FORMAT}')
  with open(os.path.join(directory, _TOKENIZER_FILE), 'rb') as f:
    proto = f.read()
  if sha256_bytes(np.frombuffer(proto, np.uint8)) != record['tokenizer_sha256']:
    raise CacheEntryError(f'{directory} does not match its hashes (the tokenizer)')
  return record, proto


def _mismatch(directory: str, bad: list[str]) -> str:
  return (f'{directory} does not match its hashes ({", ".join(bad[:3])}'
          f'{" and more" if len(bad) > 3 else ""})')


def map_entry(directory: str) -> Entry:
  """The entry at `directory`, every parameter file mapped read-only and hashed in a background
  thread (`Entry.check`). Raises CacheEntryError where the entry's record, its tokenizer or a
  file's size does not match."""
  try:
    record, proto = _read_record(directory)
    stored = {}
    for name, meta in record['params'].items():
      path = os.path.join(directory, _leaf_file(name))
      shape = tuple(meta['shape'])
      if os.path.getsize(path) != int(np.prod(shape)) * np.dtype(meta['dtype']).itemsize:
        raise CacheEntryError(_mismatch(directory, [name]))
      stored[name] = _map(path, np.dtype(meta['dtype']), shape)
  except CacheEntryError:
    raise
  except Exception as e:  # missing files, damaged JSON
    raise CacheEntryError(f'{directory} cannot be read ({type(e).__name__}: {e})') from None
  entry = Entry(directory, stored, Tokenizer.from_model_proto(proto), record.get('layout', {}),
                record['params_sha256'])

  def verify():
    try:
      bad = sorted(name for name, leaf in stored.items()
                   if digest.hexdigest('blake3', leaf) != record['params'][name]['blake3'])
      if bad:
        entry._failure.append(_mismatch(directory, bad))
    except Exception as e:  # a file that shrank under the mapping
      entry._failure.append(f'{directory} cannot be read ({type(e).__name__}: {e})')
    finally:
      entry._verified.set()

  threading.Thread(target=verify, name='param-cache-verify', daemon=True).start()
  return entry


def _map(path: str, dtype: np.dtype, shape: tuple) -> np.ndarray:
  """The file at `path` as a read-only array, mapped with 2 MB pages where the kernel can (see
  the module's docstring; advice only: a kernel without it maps 4 KB pages)."""
  if not math.prod(shape):
    return np.zeros(shape, dtype)
  with open(path, 'rb') as f:
    mapping = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
  if hasattr(mmap, 'MADV_HUGEPAGE'):
    try:
      mapping.madvise(mmap.MADV_HUGEPAGE)
    except OSError:  # a kernel built without transparent huge pages
      pass
  return np.frombuffer(mapping, dtype).reshape(shape)


def load_entry(directory: str) -> tuple[dict, Tokenizer]:
  """(params as a float32 NumPy tree in the canonical layout, tokenizer) from an entry written
  by `save_entry`, verified against its hashes before it returns; raises CacheEntryError naming
  what does not match."""
  entry = map_entry(directory)
  entry._verified.wait()
  if entry._failure:
    raise CacheEntryError(entry._failure[0])
  return entry.canonical(), entry.tokenizer


def cached_tokenizer(key: str, root: str | None = None) -> Tokenizer | None:
  """The tokenizer of entry `key` alone (without reading its parameters), verified against the
  entry's hashes; None when there is no such entry or it does not verify."""
  try:
    _, proto = _read_record(os.path.join(root or cache_root(), key))
  except (OSError, ValueError, KeyError, TypeError):
    return None
  return Tokenizer.from_model_proto(proto)


def _set_aside(final: str) -> None:
  """Moves a rejected entry out of the way (another process may have moved it first)."""
  aside = os.path.join(os.path.dirname(final),
                       f'.rejected.{os.path.basename(final)}.{uuid.uuid4().hex}')
  try:
    os.rename(final, aside)
  except FileNotFoundError:
    return
  shutil.rmtree(aside, ignore_errors=True)


def mapped(key: str, build: Callable[[], tuple], root: str | None = None,
           pack: Callable[[dict], tuple[dict, Callable]] | None = None) -> Entry:
  """The mapped entry `key` (`map_entry`), built from build() -> (canonical params, tokenizer)
  and cached in the form `pack` stores them (see save_entry) on a miss, or when the cached entry
  cannot be mapped (an entry that is mapped and later fails its background hash is rejected by
  `Entry.check`)."""
  root = root or cache_root()
  final = os.path.join(root, key)
  if os.path.isdir(final):
    try:
      return map_entry(final)
    except CacheEntryError as e:
      logging.warning('parameter cache entry rejected, rebuilding it: %s', e)
      _set_aside(final)
  params, tokenizer = build()
  try:
    save_entry(final, params, tokenizer, pack)
  except FileExistsError:  # another process won the race; its entry is verified as it is read
    pass
  del params  # the canonical copy: the mapped entry is the one this process holds
  return map_entry(final)


def cached(key: str, build: Callable[[], tuple], root: str | None = None) -> tuple[dict, Tokenizer]:
  """Returns (params, tokenizer) for `key` in the canonical layout, verified, building and
  caching them on a miss or when the cached entry fails verification."""
  entry = mapped(key, build, root)
  try:
    entry.check()
  except CacheEntryError as e:
    logging.warning('parameter cache entry rejected, rebuilding it: %s', e)
    entry = mapped(key, build, root)
    entry.check()
  return entry.canonical(), entry.tokenizer
