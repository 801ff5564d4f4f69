"""Atomic, durable local writes (the one writer behind every JSON, NPZ, figure and cache entry),
the one JSONL reader, and where the caches live (`cache_root`).

A reader must see the old file or the whole new one, never half of one, even after a crash or
when two runs write the same name at once. So every write goes to a fresh hidden staging name
in the target's directory (a uuid: two writers never share one), is flushed and fsynced, and is
renamed over the target; the directory is fsynced after the rename so the new name survives a
power loss. Staging files get the umask's permissions (unlike mkstemp's owner-only ones), so
results and caches stay readable by others. A failed write removes its staging file and leaves
the target as it was.

`atomic_directory` does the same for a directory built in place (Orbax checkpoints, artifacts):
built under a staging name, every file fsynced, then renamed to a target that must not exist.

Committed files are evidence: `check_replace` refuses to replace a file git tracks with other
bytes unless told to (the command-line tools' --overwrite), so a run never rewrites a committed
result, manifest or figure by accident.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import uuid
from typing import Any, BinaryIO, Callable, Iterator

import numpy as np


def cache_root() -> str:
  """$GEMMA_JAX_CACHE, else ~/.cache/gemma_jax: the parameter cache, the native kernels' builds,
  saved executables, XLA's compilation cache and kept verdicts all live under it."""
  return os.environ.get('GEMMA_JAX_CACHE') or os.path.join(
      os.path.expanduser('~'), '.cache', 'gemma_jax')


def staging_path(path: str, suffix: str = '') -> str:
  """A fresh hidden name beside `path` (`suffix` keeps tools that append extensions happy)."""
  directory, name = os.path.split(os.path.abspath(path))
  return os.path.join(directory, f'.{name}.{uuid.uuid4().hex}{suffix}')


def fsync_directory(directory: str) -> None:
  """Flushes a directory's entries (a rename into it) to disk."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)


def write_atomic(path: str, write: Callable[[BinaryIO], None], *, suffix: str = '') -> None:
  """Calls write(f) on a staging file, fsyncs it and renames it over `path`."""
  directory = os.path.dirname(os.path.abspath(path))
  os.makedirs(directory, exist_ok=True)
  staging = staging_path(path, suffix)
  try:
    with open(staging, 'xb') as f:
      write(f)
      f.flush()
      os.fsync(f.fileno())
    os.replace(staging, path)
  except BaseException:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(staging)
    raise
  fsync_directory(directory)


class CommittedFileError(ValueError):
  """A write would replace a committed (git-tracked) file with other content."""


def committed(path: str) -> bool:
  """Whether git tracks the file at `path` (False outside a checkout or without git)."""
  directory = os.path.dirname(os.path.abspath(path))
  if not os.path.isfile(path) or not os.path.isdir(directory):
    return False
  try:
    return subprocess.run(['git', 'ls-files', '--error-unmatch', '--', os.path.basename(path)],
                          cwd=directory, capture_output=True, timeout=30).returncode == 0
  except (OSError, subprocess.SubprocessError):
    return False


def check_replace(path: str, data: bytes, *, overwrite: bool) -> None:
  """Raises CommittedFileError where writing `data` would replace a committed file whose bytes
  differ, unless `overwrite`. Equal bytes, a new file or an untracked one pass."""
  if overwrite or not committed(path):
    return
  with open(path, 'rb') as f:
    if f.read() == data:
      return
  raise CommittedFileError(f'{path} is a committed file and this run\'s content differs; name '
                           'another --output, or add --overwrite to replace it')


def write_bytes(path: str, data: bytes) -> None:
  """`data` at `path`, atomically and durably (`write_atomic`)."""
  def write(f: BinaryIO) -> None:
    f.write(data)
  write_atomic(path, write)


def write_text(path: str, text: str) -> None:
  """`text` (UTF-8) at `path`, atomically and durably."""
  write_bytes(path, text.encode())


def to_json(value: Any, indent: int = 0) -> str:
  """JSON with one key per line but every list of scalars on a single line (readable diffs,
  small files)."""
  pad, inner = ' ' * indent, ' ' * (indent + 1)
  if isinstance(value, dict) and value:
    items = [f'{inner}{json.dumps(str(k))}: {to_json(v, indent + 1)}' for k, v in value.items()]
    return '{\n' + ',\n'.join(items) + '\n' + pad + '}'
  if isinstance(value, (list, tuple)) and any(isinstance(v, (dict, list, tuple)) for v in value):
    return '[\n' + ',\n'.join(inner + to_json(v, indent + 1) for v in value) + '\n' + pad + ']'
  return json.dumps(value)


def write_json(path: str, value: Any) -> None:
  """JSON (UTF-8, `to_json`'s layout, a trailing newline), atomically."""
  write_text(path, to_json(value) + '\n')


def write_npz(path: str, arrays: dict[str, np.ndarray]) -> None:
  """An uncompressed .npz of the named arrays (any shape and dtype each), atomically."""
  def write(f: BinaryIO) -> None:
    np.savez(f, allow_pickle=False, **arrays)  # numeric arrays only
  write_atomic(path, write, suffix='.npz')


def fsync_tree(root: str, *, then: Callable[[int], None] | None = None) -> None:
  """fsyncs every file under `root` (calling then(fd) on each, still open) and every directory."""
  for directory, _, names in os.walk(root):
    for name in names:
      fd = os.open(os.path.join(directory, name), os.O_RDONLY)
      try:
        os.fsync(fd)
        if then:
          then(fd)
      finally:
        os.close(fd)
    fsync_directory(directory)


@contextlib.contextmanager
def atomic_directory(path: str) -> Iterator[str]:
  """Yields a staging directory to fill; on success it is fsynced and renamed to `path`.

  `path` must not exist (directories are published once: FileExistsError otherwise, also when
  another writer published it first). On any error the staging directory is removed."""
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  if os.path.exists(path):
    raise FileExistsError(f'{path} already exists')
  staging = staging_path(path)
  os.mkdir(staging)
  try:
    yield staging
    fsync_tree(staging)
    try:
      os.rename(staging, path)
    except OSError as e:  # a non-empty directory appeared at `path` meanwhile
      raise FileExistsError(f'{path} already exists') from e
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  fsync_directory(parent)


def jsonl_records(path: str) -> list[tuple[int, dict]]:
  """(line number, object) of every non-empty line of a JSONL file; a line that is not a JSON
  object, an unreadable or empty file raise ValueError naming the file and line."""
  try:
    with open(path) as f:
      lines = f.readlines()
  except OSError as e:
    raise ValueError(f'{path}: cannot be read ({e})') from None
  records = []
  for number, line in enumerate(lines, 1):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ValueError(f'{path}:{number}: not valid JSON ({e})') from None
    if not isinstance(record, dict):
      raise ValueError(f'{path}:{number}: expected a JSON object')
    records.append((number, record))
  if not records:
    raise ValueError(f'{path} holds no records')
  return records


def read_jsonl(path: str, fields: tuple[str, ...]) -> list[dict]:
  """Records of a JSONL file, each required to hold non-empty strings under `fields`."""
  out = []
  for number, record in jsonl_records(path):
    if not all(isinstance(record.get(k), str) and record[k] for k in fields):
      names = ', '.join(f'"{k}"' for k in fields)
      raise ValueError(f'{path}:{number}: expected an object with non-empty string fields '
                       f'{names}')
    out.append(record)
  return out
