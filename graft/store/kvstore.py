"""The store's storage layer: TensorStore's kvstore (the layer under Orbax), behind five calls.

One URL names where a store lives, and the same code runs on every driver TensorStore reaches:
`file:///abs/path/` (local disk), `memory://` (this process only), `gs://bucket/path/`,
`s3://bucket/path/`, or any other kvstore URL TensorStore parses; or a TensorStore kvstore spec
as JSON, for what a URL cannot say (an S3-protocol server's endpoint:
`{"driver": "s3", "bucket": "b", "path": "p/", "endpoint": "http://127.0.0.1:9000"}`). Nothing
here assumes a local path: keys are TensorStore keys, never filesystem paths. Keys are built
only by the store from fixed words and hex digests (`check_key`), never from object content.

Writes of whole values are atomic on every driver (the file driver writes a temporary file and
renames it; object stores publish whole objects), so a reader never sees half a value.
`write_if_absent` is the conditional write that makes "first writer wins" hold between
processes. What the store needs of a driver (docs/security.md, "What the store needs from a
kvstore"): atomic whole-value writes, atomic put-if-absent and put-if-generation (S3:
`If-None-Match: *` and `If-Match` on the PUT), reads of a value just written, and listings in
any order; never a rename, a directory, or an atomic conditional delete (TensorStore's S3
driver checks the generation with a HEAD and then deletes).
"""

from __future__ import annotations

import json
import re
import urllib.parse
from typing import Iterable, Sequence

import tensorstore as ts

# TensorStore's storage generation of a missing key: a write conditioned on it succeeds only if
# the key does not exist yet.
_NO_VALUE = b'\x02'
# Every key the store makes (graft/store/_store.py): its description, block objects under a
# writer's unique name, index entries under their parent, writers' signatures of a block (by the
# signing key's id), quarantined objects and their reasons, and puts' leases on their unpublished
# objects.
_KEY = re.compile(r'^(store\.json|objects/[0-9a-f]{64}\.[0-9a-f]{32}|index/[0-9a-f]{64}/[0-9a-f]{64}'
                  r'|signatures/[0-9a-f]{64}/[0-9a-f]{32}|quarantine/[0-9a-f]{32}\.(object|json)'
                  r'|staging/[0-9a-f]{32}\.json)$')


class StoreUrlError(ValueError):
  """A store URL that TensorStore cannot open, or that is unreachable."""


class ShortValueError(ValueError):
  """A byte range past the end of the value: the value is shorter than the caller expected."""


def check_key(key: str) -> str:
  """Keys are lowercase words and hex digests joined by '/': no '..', no absolute paths, no
  characters an object could smuggle in."""
  if len(key) > 300 or not _KEY.match(key):
    raise ValueError(f'refusing store key {key[:80]!r}: not a key this store makes')
  return key


class KvStore:
  """A TensorStore kvstore opened from a URL, with the operations the store needs."""

  def __init__(self, url: str):
    """`url`: a kvstore URL, or a TensorStore kvstore spec as a JSON object (see above)."""
    if isinstance(url, str) and url.lstrip().startswith('{'):
      try:
        spec = json.loads(url)
      except ValueError as e:
        raise StoreUrlError(f'store spec {url[:80]!r} is not JSON: {e}') from None
      if not isinstance(spec, dict):
        raise StoreUrlError(f'store spec {url[:80]!r}: expected a JSON object')
      self.url = url
    elif isinstance(url, str) and '://' in url:
      self.url = spec = url if url.endswith('/') or url.endswith('://') else url + '/'
    else:
      raise StoreUrlError(f'store URL {url!r}: expected a kvstore URL such as '
                          'file:///abs/path/, memory://, gs://bucket/path/, or a kvstore '
                          'spec as JSON')
    try:
      self._kv = ts.KvStore.open(spec).result()
    except Exception as e:  # TensorStore raises ValueError for unparsable or unsupported URLs
      raise StoreUrlError(f'cannot open store {url!r}: {e}') from None

  def read_many(self, requests: Sequence[tuple[str, tuple[int, int] | None]]
                ) -> list[bytes | ShortValueError | None]:
    """Reads [(key, byte range [start, stop) or None)] concurrently. Per request: the bytes,
    None when the key is missing, or a ShortValueError when the range runs past the value."""
    futures = []
    for key, byte_range in requests:
      futures.append(self._kv.read(check_key(key)) if byte_range is None else
                     self._kv.read(check_key(key), byte_range=slice(*byte_range)))
    out: list[bytes | ShortValueError | None] = []
    for (key, byte_range), future in zip(requests, futures):
      try:
        result = future.result()
      except Exception as e:  # an unreachable store, a permission error, a driver failure
        if 'OUT_OF_RANGE' not in str(e):
          raise StoreUrlError(f'{self.url}: reading {key} failed: {e}') from None
        out.append(ShortValueError(f'{key} is shorter than bytes {byte_range}'))
        continue
      out.append(result.value if result.state == 'value' else None)
    return out

  def read(self, key: str, byte_range: tuple[int, int] | None = None) -> bytes | None:
    """The value (or bytes [start, stop) of it), or None when the key is missing."""
    (value,) = self.read_many([(key, byte_range)])
    if isinstance(value, ShortValueError):
      raise value
    return value

  def write_many(self, items: Iterable[tuple[str, bytes]]) -> None:
    """Writes [(key, value)] concurrently (each write whole and atomic)."""
    futures = [self._kv.write(check_key(key), value) for key, value in items]
    for future in futures:
      future.result()

  def write(self, key: str, value: bytes) -> None:
    """Writes `value` under `key`, whole and atomic."""
    self.write_many([(key, value)])

  def write_if_absent_many(self, items: Iterable[tuple[str, bytes]]) -> list[bool]:
    """Writes each [(key, value)] only if its key does not exist, concurrently; per item, True
    when this call wrote it."""
    futures = [self._kv.write(check_key(key), value, if_equal=_NO_VALUE) for key, value in items]
    return [future.result().generation != b'' for future in futures]

  def write_if_absent(self, key: str, value: bytes) -> bool:
    """Writes `value` only if `key` does not exist; True when this call wrote it."""
    return self.write_if_absent_many([(key, value)])[0]

  def delete(self, key: str) -> None:
    """Deletes `key` (nothing when it does not exist)."""
    self._kv.write(check_key(key), None).result()

  def read_versioned(self, key: str) -> tuple[bytes | None, bytes]:
    """(value or None, its generation): what `replace_if` and `delete_if` compare against."""
    try:
      result = self._kv.read(check_key(key)).result()
    except Exception as e:
      raise StoreUrlError(f'{self.url}: reading {key} failed: {e}') from None
    value = result.value if result.state == 'value' else None
    return value, result.stamp.generation

  def delete_if(self, key: str, generation: bytes) -> bool:
    """Deletes `key` only if it is still the value of `generation` (nobody rewrote it since it
    was read); True when this call deleted it."""
    return self._kv.write(check_key(key), None, if_equal=generation).result().generation != b''

  def replace_if(self, key: str, value: bytes, generation: bytes) -> bool:
    """Writes `value` only if `key` still holds `generation`; True when this call wrote it."""
    return self._kv.write(check_key(key), value, if_equal=generation).result().generation != b''

  def delete_all(self) -> None:
    """Deletes every key under the URL."""
    self._kv.delete_range(ts.KvStore.KeyRange(b'', b'')).result()

  def list(self, prefix: str = '') -> list[str]:
    """Every key starting with `prefix`, sorted."""
    if prefix:
      end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
      keys = self._kv.list(ts.KvStore.KeyRange(prefix.encode(), end.encode())).result()
    else:
      keys = self._kv.list().result()
    return sorted(k.decode() for k in keys)


def local_directory(url: str) -> str | None:
  """The directory of a file:// store (None for any other driver): only for measuring the disk
  and evicting its pages from the OS cache, never for reading the store."""
  parsed = urllib.parse.urlparse(url)
  return urllib.parse.unquote(parsed.path) if parsed.scheme == 'file' else None
