"""Content addressing for the store: namespaces, block keys, block objects and index entries.

Pure functions over bytes; graft/store/_store.py does the I/O. Nothing read is trusted: every decoder
checks its input against what the engine expects and raises BlockError naming the problem.

Namespace. SHA-256 of the canonical JSON of {format, model fingerprint, engine fingerprint}: the
model's parameters, config and tokenizer, and everything that decides the engine's bits (its
config, dtype, slot layout version, the machine). KV from another model, dtype, engine
configuration, slot layout version or kind of machine lands in another namespace, so it can
never be found.

Block key. Block k of a context holds its tokens at sequence indices kB .. kB + B - 1 (B the
store's tokens per block, the engine's rows per call: a block is computed by one call, though
under a byte-exact plan any cut of the sequence gives the same bits). Its key is

    SHA-256( b'kv-graft-block/2' | namespace (32 bytes) | parent key (32 bytes; zeros for block 0)
             | token count (uint32 little-endian) | token ids (int32 little-endian) )

(KEY_DOMAIN: the object format's version before BLAKE3, kept so that objects of both versions
share their keys)
a fixed, prefix-free byte encoding (never Python hash(), never pickle): a block's key names its
whole prefix, so contexts that share a prefix share its blocks, and a block is found only after
the same tokens in the same order. A context's last block may hold fewer than B tokens.
Contexts in a store start at position 0, so a token's position is its sequence index.

Block object (immutable):

    b'KVGRAFT1' | header length (uint32 LE) | header (canonical JSON) | leaf bytes

The header holds the format, namespace, key, parent, start index, token ids and, per leaf, its
name, dtype, shape, byte offset and content hash: BLAKE3 in kv-graft-block/3 (written), SHA-256
in kv-graft-block/2 (still read); gemma_jax/digest.py says why. Leaves are `layer_{i}/k`,
`layer_{i}/v` [T, K, H] for every cache-owning layer, global layers first: the rows a graft
reads from a block far behind its end (global layers only) are one byte range.

Index entry: the small immutable record that publishes an object under its parent
(`index/<parent>/<key>`): format, key, parent, start, tokens, the object's name and size and the
SHA-256 of its header. The index is a prefix tree keyed by parent, rebuildable from the objects'
headers alone.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import re
import struct
from typing import Sequence

import ml_dtypes
import numpy as np

from gemma_jax import digest
from gemma_jax import kv_state as kvs
from gemma_jax.digest import canonical_json
from gemma_jax.config import AttentionType
from graft.engine import Engine, fingerprint

STORE_FORMAT = 'kv-graft-store/2'
BLOCK_FORMAT = 'kv-graft-block/3'
# The content hash of each readable block format's leaves.
CONTENT_HASH = {'kv-graft-block/2': 'sha256', BLOCK_FORMAT: 'blake3'}
KEY_DOMAIN = b'kv-graft-block/2'
DOCUMENT_DOMAIN = b'kv-graft-document/1'  # the domain of a document root (`document_root`)
_DTYPES = {'float32': np.dtype(np.float32), 'bfloat16': np.dtype(ml_dtypes.bfloat16),
           'int32': np.dtype(np.int32)}
ENTRY_FORMAT = 'kv-graft-index/2'
MAGIC = b'KVGRAFT1'
ROOT = '0' * 64  # the parent of block 0
_PREAMBLE = len(MAGIC) + 4
MAX_HEADER_BYTES = 1 << 20
_HEX64 = re.compile('[0-9a-f]{64}')  # a header larger than this is refused before it is parsed


class BlockError(ValueError):
  """An object or entry that must not be used; the message says why."""


def namespace(model_fp: dict, engine_fp: dict, salt: str = '') -> str:
  """The namespace of a model and an engine; a salt separates tenants who share a backing store
  (a stored prefix answers much faster than a miss, which would let one tenant probe
  another's prefixes: docs/security.md)."""
  parts = {'format': STORE_FORMAT, 'model': model_fp['sha256'], 'engine': engine_fp['sha256']}
  return fingerprint.digest({**parts, 'salt': salt} if salt else parts)


def block_key(ns: str, parent: str, tokens: Sequence[int]) -> str:
  """A block's key: the SHA-256 over the namespace, its parent's key and its token ids."""
  ids = np.asarray(tokens, '<i4')
  payload = (KEY_DOMAIN + bytes.fromhex(ns) + bytes.fromhex(parent)
             + struct.pack('<I', len(ids)) + ids.tobytes())
  return hashlib.sha256(payload).hexdigest()


def document_root(ns: str, prefix_key: str) -> str:
  """The root of the document chains stored after a prefix whose chain ends with block
  `prefix_key`: a document's first block has it as its parent. SHA-256 over DOCUMENT_DOMAIN, the
  namespace and the prefix's key, so it depends on the prefix's tokens and the namespace only
  (never on where a document is placed), and no token sequence chains to it."""
  return hashlib.sha256(DOCUMENT_DOMAIN + bytes.fromhex(ns) + bytes.fromhex(prefix_key)).hexdigest()


def document_keys(ns: str, prefix: Sequence[int], document: Sequence[int],
                  block_tokens: int) -> list[str]:
  """The keys of a document's blocks stored after `prefix` (graft/store/documents.py): its
  chain from the document root of the prefix's own last block."""
  root = document_root(ns, chain_keys(ns, prefix, block_tokens)[-1])
  return chain_keys(ns, document, block_tokens, root)


def chain_keys(ns: str, tokens: Sequence[int], block_tokens: int,
               root: str = ROOT) -> list[str]:
  """The keys of every block of a context (the last one partial when len(tokens) % B); `root`:
  the parent of its first block (ROOT for a context from position 0, a document root for a
  document, `document_root`)."""
  keys, parent = [], root
  for start in range(0, len(tokens), block_tokens):
    parent = block_key(ns, parent, tokens[start:start + block_tokens])
    keys.append(parent)
  return keys


@dataclasses.dataclass(frozen=True)
class BlockLayout:
  """What a block object of this engine must hold: per cache-owning layer, K and V rows of
  shape [T, K, H] in `dtype`; global layers first."""

  dtype: str
  block_tokens: int
  layers: tuple[tuple[int, bool, int, int], ...]  # (layer index, is global, K, H), stored order

  @classmethod
  def of(cls, engine: Engine) -> 'BlockLayout':
    """The layout of `engine`'s blocks: its dtype, rows_per_call and cache-owning layers."""
    layers = []
    for i in engine.model_config.cache_layers:
      spec = engine.model_config.layer_spec(i)
      layers.append((i, spec.attention_type is AttentionType.GLOBAL, spec.num_kv_heads,
                     spec.head_dim))
    layers.sort(key=lambda layer: (not layer[1], layer[0]))
    return cls(dtype=engine.loaded.dtype, block_tokens=engine.plan.rows_per_call,
               layers=tuple(layers))

  def leaves(self, num_tokens: int) -> list[dict]:
    """[{name, dtype, shape, offset}] in stored order (without hashes)."""
    itemsize = numpy_dtype(self.dtype).itemsize
    out, offset = [], 0
    for index, _, k, h in self.layers:
      for name in kvs.leaf_names(index)[:2]:  # K, V
        out.append({'name': name, 'dtype': self.dtype,
                    'shape': [num_tokens, k, h], 'offset': offset})
        offset += num_tokens * k * h * itemsize
    return out

  def global_bytes(self, num_tokens: int) -> int:
    """Bytes of the global layers' K and V rows of a block of `num_tokens` tokens."""
    itemsize = numpy_dtype(self.dtype).itemsize
    return sum(2 * num_tokens * k * h * itemsize for _, is_global, k, h in self.layers
               if is_global)

  def data_bytes(self, num_tokens: int) -> int:
    """Bytes of every leaf of a block of `num_tokens` tokens."""
    itemsize = numpy_dtype(self.dtype).itemsize
    return sum(2 * num_tokens * k * h * itemsize for _, _, k, h in self.layers)


def numpy_dtype(name: str) -> np.dtype:
  """The numpy dtype of a stored array's dtype name. Only the plain numeric dtypes stored
  arrays have: a name from a record (an artifact manifest) must never give an object dtype,
  whose array raw bytes would be written into."""
  if name not in _DTYPES:
    raise ValueError(f'unsupported array dtype {name!r} (stored arrays are '
                     f'{", ".join(_DTYPES)})')
  return _DTYPES[name]


def content_hash(header: dict) -> str:
  """The name of the hash a (decoded) header's leaves carry."""
  return CONTENT_HASH[header['format']]


def hash_leaves(leaves: dict[str, np.ndarray], num_tokens: int,
                layout: BlockLayout) -> tuple[list[dict], list[memoryview]]:
  """The costly half of encoding a block, independent of its place in the chain.

  Args:
    leaves: {'layer_<i>/k', 'layer_<i>/v': [T, K, H] array in the layout's dtype} for every
      cache-owning layer i (T = num_tokens); BlockError names a leaf of another shape or dtype.
    num_tokens: T, the block's tokens.
    layout: what the block must hold.

  Returns:
    The described leaves (layout order, with the content hash of BLOCK_FORMAT) and byte views
    of them, as `encode_block` takes them.
  """
  hash_name = CONTENT_HASH[BLOCK_FORMAT]
  described, chunks = [], []
  for leaf in layout.leaves(num_tokens):
    array = np.asarray(leaves[leaf['name']])
    if list(array.shape) != leaf['shape'] or array.dtype.name != leaf['dtype']:
      raise BlockError(f'{leaf["name"]}: got {array.dtype.name}{list(array.shape)}, the layout '
                       f'needs {leaf["dtype"]}{leaf["shape"]}')
    data = digest.as_bytes(array)
    described.append({**leaf, hash_name: digest.hexdigest(hash_name, data)})
    chunks.append(data)
  return described, chunks


def encode_block(ns: str, parent: str, parent_header_sha256: str, start: int,
                 tokens: Sequence[int],
                 hashed: tuple[list[dict], list[memoryview]],
                 layout: BlockLayout) -> tuple[str, bytes, dict]:
  """(key, object bytes, header) of a block whose leaves `hash_leaves` described. The header
  records the SHA-256 of its parent's header (ROOT for block 0), which binds the parent's
  content: a block computed on another version of its parent is found as such."""
  tokens = [int(t) for t in tokens]
  key = block_key(ns, parent, tokens)
  described, chunks = hashed
  header = {'format': BLOCK_FORMAT, 'namespace': ns, 'key': key, 'parent': parent,
            'parent_header_sha256': parent_header_sha256,
            'start': int(start), 'tokens': tokens, 'leaves': described,
            'global_bytes': layout.global_bytes(len(tokens)),
            'data_bytes': layout.data_bytes(len(tokens))}
  header_bytes = canonical_json(header)
  return key, b''.join([MAGIC, struct.pack('<I', len(header_bytes)), header_bytes, *chunks]), header


def header_sha256(data: bytes) -> str:
  """The SHA-256 of an object's header bytes (what its entry and its children record)."""
  offset, length = header_span(data)
  return hashlib.sha256(data[offset:offset + length]).hexdigest()


def header_span(prefix: bytes) -> tuple[int, int]:
  """(offset, length) of the header, from the object's first bytes."""
  if len(prefix) < _PREAMBLE or prefix[:len(MAGIC)] != MAGIC:
    raise BlockError('not a block object (bad magic)')
  (length,) = struct.unpack('<I', prefix[len(MAGIC):_PREAMBLE])
  if not 0 < length <= MAX_HEADER_BYTES:
    raise BlockError(f'header length {length} is out of range')
  return _PREAMBLE, length


def _load_json(data: bytes, what: str):
  try:
    return json.loads(data.decode('utf-8'))
  except (UnicodeDecodeError, json.JSONDecodeError) as e:
    raise BlockError(f'{what} is not valid JSON ({e})') from None


def _check_tokens(tokens, block_tokens: int, vocab_size: int) -> list[int]:
  if (not isinstance(tokens, list) or not 1 <= len(tokens) <= block_tokens
      or not all(type(t) is int and 0 <= t < vocab_size for t in tokens)):
    raise BlockError(f'tokens must be 1..{block_tokens} ids in [0, {vocab_size})')
  return tokens


def _malformed_is_refused(what: str):
  """Turns any error a hostile value could raise while being checked into a BlockError."""
  def wrap(fn):
    @functools.wraps(fn)
    def checked(*args, **kwargs):
      try:
        return fn(*args, **kwargs)
      except BlockError:
        raise
      except (TypeError, ValueError, KeyError, AttributeError, OverflowError) as e:
        raise BlockError(f'{what} is malformed ({type(e).__name__}: {str(e)[:80]})') from None
    return checked
  return wrap


@_malformed_is_refused('the header')
def decode_header(header_bytes: bytes, *, ns: str, expected_key: str, layout: BlockLayout,
                  vocab_size: int) -> dict:
  """The verified header of the object published as `expected_key`."""
  header = _load_json(header_bytes, 'the header')
  if not isinstance(header, dict) or header.get('format') not in CONTENT_HASH:
    raise BlockError(f'the header is not a header of {", ".join(CONTENT_HASH)}')
  hash_name = content_hash(header)
  if header.get('namespace') != ns:
    raise BlockError('the object belongs to another namespace (another model, engine, dtype '
                     'or machine)')
  tokens = _check_tokens(header.get('tokens'), layout.block_tokens, vocab_size)
  parent = header.get('parent')
  if not isinstance(parent, str) or not _HEX64.fullmatch(parent):
    raise BlockError('the header has no valid parent key')
  if not _valid_parent_header(header.get('parent_header_sha256'), parent):
    raise BlockError('the header has no valid parent header hash')
  if block_key(ns, parent, tokens) != header.get('key') or header['key'] != expected_key:
    raise BlockError('the header\'s key does not match its parent and tokens, or the key it '
                     'is stored under')
  want = layout.leaves(len(tokens))
  leaves = header.get('leaves')
  if (not isinstance(leaves, list) or len(leaves) != len(want)
      or any(not isinstance(g, dict) or {k: g.get(k) for k in w} != w
             or not isinstance(g.get(hash_name), str) for g, w in zip(leaves, want))):
    raise BlockError('the header\'s leaves do not match this engine\'s layout (names, dtypes, '
                     'shapes, offsets)')
  if (header.get('global_bytes') != layout.global_bytes(len(tokens))
      or header.get('data_bytes') != layout.data_bytes(len(tokens))):
    raise BlockError('the header\'s byte counts do not match the layout')
  if (type(header.get('start')) is not int or header['start'] < 0
      or header['start'] % layout.block_tokens):
    raise BlockError('the header\'s start index is not a block boundary')
  return header


@_malformed_is_refused('the object')
def decode_leaves(header: dict, data: bytes, data_offset: int, *, global_only: bool,
                  layout: BlockLayout) -> dict[str, np.ndarray]:
  """The leaves of a block object, each re-hashed against its decoded header.

  Args:
    header: the object's verified header.
    data: the object's bytes from `data_offset`: its global layers' rows (global_only), or all
      its rows.
    data_offset: where `data` starts in the object (unused: leaf offsets count from `data`).
    global_only: whether only the global layers were read.
    layout: what the block must hold.

  Returns:
    {'layer_<i>/k', 'layer_<i>/v': [T, K, H] array in the layout's dtype} for each layer read
    (T: the header's tokens); BlockError when a leaf does not hash to its header's hash.
  """
  dtype = numpy_dtype(layout.dtype)
  hash_name = content_hash(header)
  stop = header['global_bytes'] if global_only else header['data_bytes']
  if len(data) != stop:
    raise BlockError(f'{len(data)} data bytes read, the header says {stop} (truncated?)')
  out = {}
  for leaf in header['leaves']:
    begin = leaf['offset']
    if begin >= stop:
      break
    size = int(np.prod(leaf['shape'])) * np.dtype(dtype).itemsize
    chunk = memoryview(data)[begin:begin + size]
    if digest.hexdigest(hash_name, chunk) != leaf[hash_name]:
      raise BlockError(f'leaf {leaf["name"]} was altered ({hash_name} mismatch)')
    out[leaf['name']] = np.frombuffer(chunk, dtype).reshape(leaf['shape'])
  return out


def _valid_parent_header(value, parent: str) -> bool:
  """A 64-hex SHA-256; ROOT exactly for block 0."""
  return (isinstance(value, str) and bool(_HEX64.fullmatch(value))
          and (value == ROOT) == (parent == ROOT))


def encode_entry(header: dict, object_name: str, object_bytes: int, header_bytes: bytes) -> bytes:
  """The index entry that publishes object `object_name` (of `object_bytes` bytes) whose
  header is `header` (decoded) and `header_bytes` (as stored)."""
  return canonical_json({'format': ENTRY_FORMAT, 'key': header['key'], 'parent': header['parent'],
                         'parent_header_sha256': header['parent_header_sha256'],
                         'start': header['start'], 'tokens': header['tokens'],
                         'object': object_name, 'object_bytes': object_bytes,
                         'header_sha256': hashlib.sha256(header_bytes).hexdigest()})


@_malformed_is_refused('the index entry')
def decode_entry(data: bytes, *, ns: str, parent: str, key: str, expected_start: int,
                 layout: BlockLayout, vocab_size: int) -> dict:
  """The verified index entry stored at index/<parent>/<key>, whose block starts at sequence
  index `expected_start` (its depth in the chain times B)."""
  entry = _load_json(data, 'the index entry')
  if not isinstance(entry, dict) or entry.get('format') != ENTRY_FORMAT:
    raise BlockError('unknown index entry format')
  tokens = _check_tokens(entry.get('tokens'), layout.block_tokens, vocab_size)
  if entry.get('parent') != parent or entry.get('key') != key:
    raise BlockError('the entry does not name the parent and key it is stored under')
  if block_key(ns, parent, tokens) != key:
    raise BlockError('the entry\'s tokens do not hash to its key')
  if not _valid_parent_header(entry.get('parent_header_sha256'), parent):
    raise BlockError('the entry has no valid parent header hash')
  name = entry.get('object')
  if not isinstance(name, str) or not re.fullmatch(re.escape(key) + r'\.[0-9a-f]{32}', name):
    raise BlockError('the entry names no object of its key')
  if (type(entry.get('start')) is not int or entry['start'] < 0
      or entry['start'] % layout.block_tokens or entry['start'] != expected_start):
    raise BlockError(f'the entry\'s start index {entry.get("start")!r} is not its place in the '
                     f'chain ({expected_start})')
  if (type(entry.get('object_bytes')) is not int
      or not _PREAMBLE < entry['object_bytes']
      <= _PREAMBLE + MAX_HEADER_BYTES + layout.data_bytes(len(tokens))):
    raise BlockError('the entry\'s object size is out of range')
  if not isinstance(entry.get('header_sha256'), str):
    raise BlockError('the entry has no header hash')
  return entry
