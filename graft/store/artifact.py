"""Artifacts: a KV state saved with its token ids and a manifest of content hashes.

On disk an artifact is a directory:

    manifest.json   format, token count and SHA-256, start and next position, the model and
                    engine fingerprints, {dtype, shape, blake3} of every leaf's raw bytes,
                    {size, blake3} of every file under state/, and `manifest_sha256`, the
                    SHA-256 of the canonical JSON of every other field (so no field can change
                    unnoticed)
    state/          an Orbax checkpoint of the leaves: `tokens` int32 [n] and, for each
                    cache-owning layer i, `layer_{i}/k`, `layer_{i}/v` [slots, K, H] and
                    `layer_{i}/positions` int32 [slots] (gemma_jax.kv_state.to_leaves), zarr
                    without OCDBT or compression: each leaf's raw C-order bytes are one file
                    (orbax_util.save_leaf_files), so Orbax restores it and so can a plain read

Writes build the directory under a staging name and rename it into place when complete
(gemma_jax.files.atomic_directory). `load` trusts nothing it reads: it re-hashes the manifest,
every file and every leaf, checks that the positions a graft will use follow from the recorded
start position and token count, and refuses, with the reason, an artifact from another model,
engine configuration or layout version, of another dtype, with a missing, extra or altered leaf
or file. It reads every file once, on every core, hashing each piece as it lands
(gemma_jax/digest.py), without Orbax, whose own restore of the same files is several times
slower (experiments.bench: orbax_restore_gbps against restore_gbps). Artifacts of format 2 (Orbax's OCDBT layout,
SHA-256) still read, through Orbax. `graft` puts a verified artifact at its own positions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import json
import os
import time

import numpy as np

from gemma_jax import digest
from gemma_jax import kv_state as kvs
from gemma_jax.checkpoints import orbax_util
from gemma_jax.compare import sha256_bytes
from gemma_jax.files import atomic_directory
from graft.engine import fingerprint
from graft.engine.fingerprint import differences
from graft.engine import Context, Engine
from graft.store import blocks

FORMAT = 'kv-graft-artifact/3'
# The content hash each readable format's leaves and files carry (digest.py).
CONTENT_HASH = {'kv-graft-artifact/2': 'sha256', FORMAT: 'blake3'}
MANIFEST = 'manifest.json'
STATE = 'state'


_FILE_CHECKS = concurrent.futures.ThreadPoolExecutor(4, thread_name_prefix='artifact-files')


class ArtifactError(ValueError):
  """An artifact that must not be grafted; the message says why."""


@dataclasses.dataclass(frozen=True)
class Artifact:
  """A verified KV state (or one captured in memory) with its tokens and manifest."""

  tokens: tuple[int, ...]
  next_position: int
  leaves: dict[str, np.ndarray]  # kv_state.to_leaves plus 'tokens', as stored
  manifest: dict

  @property
  def start_position(self) -> int:
    """The position of the first token."""
    return self.next_position - len(self.tokens)


def describe(leaves: dict[str, np.ndarray], hash_name: str = 'blake3',
             digests: dict[str, str] | None = None) -> dict[str, dict]:
  """{name: {dtype, shape, <hash_name>}} of each leaf (any shape); `digests` gives hashes already
  made."""
  names = sorted(leaves)
  if digests is None:
    digests = dict(zip(names, digest.POOL.map(
        lambda name: digest.hexdigest(hash_name, leaves[name]), names)))
  return {name: {'dtype': np.dtype(leaves[name].dtype).name, 'shape': list(leaves[name].shape),
                 hash_name: digests[name]} for name in names}


def _dtype(name) -> np.dtype:
  try:
    return blocks.numpy_dtype(name)
  except (TypeError, ValueError) as e:
    raise ArtifactError(f'leaf dtype: {e}') from None


def manifest_digest(manifest: dict) -> str:
  """SHA-256 of the canonical JSON of every manifest field but `manifest_sha256` itself."""
  return fingerprint.digest({k: v for k, v in manifest.items() if k != 'manifest_sha256'})


def capture(engine: Engine, ctx: Context) -> Artifact:
  """The context as an (unsaved) artifact: its canonical leaves and full manifest."""
  if not ctx.tokens:
    raise ArtifactError('an empty context has no KV state to save')
  leaves = {'tokens': np.asarray(ctx.tokens, np.int32),
            **kvs.to_leaves(ctx.kv, engine.model_config.cache_layers)}
  manifest = {
      'format': FORMAT,
      'num_tokens': len(ctx.tokens),
      'tokens_sha256': sha256_bytes(leaves['tokens']),
      'start_position': ctx.next_position - len(ctx.tokens),
      'next_position': ctx.next_position,
      'model': engine.model_fingerprint,
      'engine': engine.fingerprint,
      'leaves': describe(leaves),
  }
  return Artifact(tokens=ctx.tokens, next_position=ctx.next_position, leaves=leaves,
                  manifest=manifest)


def save(path: str, engine: Engine, ctx: Context) -> dict:
  """Writes the context as an artifact at `path` (which must not exist); returns the manifest."""
  if os.path.exists(path):
    raise FileExistsError(f'{path} already exists; artifacts are immutable')
  art = capture(engine, ctx)
  manifest = dict(art.manifest)
  manifest['created'] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')
  with atomic_directory(path) as staging:
    orbax_util.save_leaf_files(os.path.join(staging, STATE),
                               {orbax_util.stored_name(name): leaf
                                for name, leaf in art.leaves.items()})
    manifest['files'] = state_files(staging)
    manifest['manifest_sha256'] = manifest_digest(manifest)
    with open(os.path.join(staging, MANIFEST), 'w') as f:
      json.dump(manifest, f, indent=1, sort_keys=True)
  return manifest


def _listing(artifact_dir: str) -> dict[str, int]:
  """{path relative to the artifact: size} of every file under state/ (symbolic links are
  listed as what they point to)."""
  out = {}
  pending = [STATE]
  while pending:
    relative = pending.pop()
    try:
      entries = list(os.scandir(os.path.join(artifact_dir, relative)))
    except FileNotFoundError:
      continue
    for entry in entries:
      name = f'{relative}/{entry.name}'
      if entry.is_dir():
        pending.append(name)
      else:
        out[name] = entry.stat().st_size
  return dict(sorted(out.items()))


def state_files(artifact_dir: str, hash_name: str = 'blake3') -> dict[str, dict]:
  """{relative path: {size, <hash_name>}} of every file under state/: the manifest covers the
  bytes no leaf holds too (Orbax's metadata), so no file can be truncated or altered
  unnoticed."""
  def summary(relative):
    with open(os.path.join(artifact_dir, relative), 'rb') as f:
      data = f.read()
    return {'size': len(data), hash_name: digest.hexdigest(hash_name, data)}

  names = list(_listing(artifact_dir))
  return dict(zip(names, digest.POOL.map(summary, names)))


def _check_listing(path: str, expected: dict[str, dict], actual: dict[str, int]) -> None:
  for name in sorted(set(expected) | set(actual)):
    if name not in actual:
      raise ArtifactError(f'{path}: file {name} is missing')
    if name not in expected:
      raise ArtifactError(f'{path}: unexpected file {name}')
    if actual[name] != expected[name]['size']:
      raise ArtifactError(f'{path}: file {name} has {actual[name]} bytes, the manifest says '
                          f'{expected[name]["size"]} (truncated or extended)')


def _check_digest(path: str, name: str, hash_name: str, got: str, want: str) -> None:
  if got != want:
    raise ArtifactError(f'{path}: file {name} was altered ({hash_name} mismatch)')


def _check_files(path: str, expected: dict[str, dict], hash_name: str) -> None:
  """Format 2: every file listed, of its size, hashed (a second read, beside Orbax's)."""
  _check_listing(path, expected, _listing(path))
  for name, got in state_files(path, hash_name).items():
    _check_digest(path, name, hash_name, got[hash_name], expected[name][hash_name])


def _read_manifest(path: str) -> dict:
  if not os.path.isdir(path):
    raise ArtifactError(f'no artifact at {path}')
  manifest_path = os.path.join(path, MANIFEST)
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
  except FileNotFoundError:
    raise ArtifactError(f'{path} is not a complete artifact: {MANIFEST} is missing') from None
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise ArtifactError(f'{manifest_path} is damaged: {e}') from None
  if not isinstance(manifest, dict):
    raise ArtifactError(f'{manifest_path} is not a JSON object')
  if manifest.get('format') not in CONTENT_HASH:
    raise ArtifactError(f'{path}: unknown artifact format {manifest.get("format")!r} (this '
                        f'code reads {", ".join(CONTENT_HASH)})')
  if manifest.get('manifest_sha256') != manifest_digest(manifest):
    raise ArtifactError(f'{path}: the manifest was altered (its SHA-256 does not match)')
  for field, kind in _FIELD_TYPES.items():
    value = manifest.get(field)
    if field in manifest and not (isinstance(value, kind) and not isinstance(value, bool)):
      raise ArtifactError(f'{path}: manifest field {field!r} is a {type(value).__name__}, '
                          f'expected {kind.__name__}')
  return manifest


# The manifest's fields whose JSON type a reader relies on (a resealed manifest may lie in any).
_FIELD_TYPES = {'leaves': dict, 'files': dict, 'num_tokens': int, 'start_position': int,
                'next_position': int, 'model': dict, 'engine': dict}


def _check_fingerprints(path: str, manifest: dict, engine: Engine) -> None:
  for part in ('model', 'engine'):
    if not fingerprint.hashes_to_its_fields(manifest.get(part)):
      raise ArtifactError(f'{path}: the manifest\'s {part} fingerprint does not hash to the '
                          'fields recorded beside it (altered and resealed?)')
  if manifest['model']['sha256'] != engine.model_fingerprint['sha256']:
    diffs = differences(engine.model_fingerprint, manifest['model'])
    raise ArtifactError(f'{path} was made by another model: ' + '; '.join(diffs))
  diffs = fingerprint.engine_differences(engine.fingerprint, manifest['engine'],
                                         labels=('the artifact has', 'expected'))
  if diffs:
    raise ArtifactError(f'{path} was made under another engine configuration: '
                        + '; '.join(diffs))


def _check_leaves(path: str, manifest: dict, leaves: dict[str, np.ndarray],
                  digests: dict[str, str] | None = None) -> None:
  """Every leaf as the manifest describes it (hashed here unless `digests` has its hash), and
  every field a graft uses bound to them."""
  expected = manifest['leaves']
  missing = sorted(set(expected) - set(leaves))
  extra = sorted(set(leaves) - set(expected))
  if missing or extra:
    raise ArtifactError(f'{path}: leaves missing {missing}, unexpected {extra}')
  actual = describe(leaves, CONTENT_HASH[manifest['format']], digests)
  for name in sorted(expected):
    if actual[name] != expected[name]:
      diffs = differences(expected[name], actual[name])
      raise ArtifactError(f'{path}: leaf {name} does not match its manifest: ' + '; '.join(diffs))
  n = len(leaves['tokens'])
  if n != manifest['num_tokens'] or n < 1:
    raise ArtifactError(f'{path}: {n} tokens stored, manifest says {manifest["num_tokens"]}')
  if sha256_bytes(leaves['tokens']) != manifest['tokens_sha256']:
    raise ArtifactError(f'{path}: the tokens do not match tokens_sha256')
  start = manifest['start_position']
  if manifest['next_position'] != start + n or start < 0:
    raise ArtifactError(f'{path}: next_position {manifest["next_position"]} is not start '
                        f'{start} + {n} tokens')
  for name, positions in leaves.items():
    if name.endswith('/positions') and not np.array_equal(
        positions, kvs.expected_positions(start, n, len(positions))):
      raise ArtifactError(f'{path}: {name} does not hold positions {start}..{start + n - 1} '
                          'in sequence order')


def load(path: str, engine: Engine, *, timings: dict | None = None) -> Artifact:
  """Reads and verifies an artifact for `engine`; raises ArtifactError naming what is wrong.
  `timings`, when given, receives the seconds spent reading ('read_s', with the file hashes
  that run alongside) and hashing and checking what was read ('verify_s')."""
  try:
    return _load(path, engine, timings)
  except (TypeError, KeyError, AttributeError, IndexError) as e:  # a field of the wrong type
    raise ArtifactError(f'{path}: the manifest is malformed ({type(e).__name__}: '
                        f'{str(e)[:120]})') from None


def _read_leaves(path: str, manifest: dict) -> tuple[dict[str, np.ndarray], dict[str, str]]:
  """Format 3: every file under state/ read once, on every core, hashed piece by piece as it
  lands, each leaf straight into its array (its file is its raw bytes). Returns the leaves and
  their digests; any file of the wrong size or hash is refused."""
  expected = manifest['files']
  _check_listing(path, expected, _listing(path))
  hash_name = CONTENT_HASH[manifest['format']]
  leaf_files, arrays = {}, {}
  for name, meta in manifest['leaves'].items():
    relative = os.path.join(STATE, orbax_util.leaf_file(orbax_util.stored_name(name),
                                                         len(meta['shape'])))
    dtype = _dtype(meta['dtype'])
    nbytes = int(np.prod(meta['shape'], dtype=np.int64)) * dtype.itemsize
    if expected.get(relative, {}).get('size') != nbytes:  # so nothing allocated exceeds the files
      raise ArtifactError(f'{path}: leaf {name} has no file {relative} of its {nbytes} bytes')
    leaf_files[name] = relative
    arrays[relative] = np.empty(meta['shape'], dtype)

  try:
    digests = digest.read_files(path, {f: entry['size'] for f, entry in expected.items()},
                                hash_name, into=arrays)
  except digest.ReadError as e:
    raise ArtifactError(f'{path}: {e}') from None
  for relative, got in sorted(digests.items()):
    _check_digest(path, relative, hash_name, got, expected[relative][hash_name])
  return ({name: arrays[f] for name, f in leaf_files.items()},
          {name: digests[f] for name, f in leaf_files.items()})


def _restore_v2(path: str, manifest: dict) -> dict[str, np.ndarray]:
  """Format 2: Orbax restores the OCDBT checkpoint while the files are hashed beside it."""
  files_checked = _FILE_CHECKS.submit(_check_files, path, manifest.get('files', {}),
                                      CONTENT_HASH[manifest['format']])
  try:
    restored = orbax_util.restore(os.path.join(path, STATE))
  except Exception as e:  # orbax/tensorstore raise many kinds on damaged or missing files
    files_checked.result()  # a damaged file is the better message
    raise ArtifactError(f'{path}: the state cannot be read ({type(e).__name__}: {e})') from None
  files_checked.result()  # nothing restored is used before the files pass
  return {name.replace('.', '/'): np.asarray(leaf) for name, leaf in restored.items()}


def _load(path: str, engine: Engine, timings: dict | None) -> Artifact:
  start = time.perf_counter()
  manifest = _read_manifest(path)
  _check_fingerprints(path, manifest, engine)
  if manifest['format'] == FORMAT:
    leaves, digests = _read_leaves(path, manifest)
  else:
    leaves, digests = _restore_v2(path, manifest), None
  t = time.perf_counter()
  _check_leaves(path, manifest, leaves, digests)
  verify = time.perf_counter() - t
  if timings is not None:
    timings.update(read_s=t - start, verify_s=verify)
  return Artifact(tokens=tuple(int(t) for t in leaves['tokens']),
                  next_position=int(manifest['next_position']), leaves=leaves, manifest=manifest)


def rows(engine: Engine, artifact: Artifact) -> list[kvs.KVRows]:
  """The artifact's KV as rows (`Engine.graft`'s input)."""
  try:
    return kvs.rows_from_leaves(artifact.leaves, engine.model_config.cache_layers,
                                len(artifact.tokens), artifact.start_position)
  except ValueError as e:
    raise ArtifactError(f'the artifact does not fit this engine: {e}') from None


def graft(engine: Engine, artifact: Artifact) -> Context:
  """A fresh context holding the artifact's KV state at its own positions."""
  try:
    return engine.graft(rows(engine, artifact), artifact.tokens, artifact.start_position)
  except ValueError as e:
    raise ArtifactError(f'the artifact does not fit this engine: {e}') from None
