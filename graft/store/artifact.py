"""Artifacts: a KV state saved with its token ids and a manifest of SHA-256 hashes.

On disk an artifact is a directory:

    manifest.json   format, token count and hash, start and next position, the model and engine
                    fingerprints, {dtype, shape, sha256} of every leaf's raw bytes, {size,
                    sha256} of every file under state/, and `manifest_sha256`, the SHA-256 of
                    the canonical JSON of every other field (so no field can change unnoticed)
    state/          an Orbax checkpoint of the leaves: `tokens` int32 [n] and, for each
                    cache-owning layer i, `layer_{i}/k`, `layer_{i}/v` [slots, K, H] and
                    `layer_{i}/positions` int32 [slots] (gemma_jax.kv_state.to_leaves);
                    compression off, raw dtype

Writes build the directory under a staging name and rename it into place when complete
(gemma_jax.files.atomic_directory). `load` trusts nothing it reads: it re-hashes the manifest,
every file and every leaf, checks that the positions a graft will use follow from the recorded
start position and token count, and refuses, with the reason, an artifact from another model,
engine configuration or layout version, of another dtype, with a missing, extra or altered leaf
or file. `graft` puts a verified artifact at its own positions.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import datetime
import hashlib
import json
import os
import time

import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax.checkpoints import orbax_util
from gemma_jax.compare import sha256_bytes
from gemma_jax.files import atomic_directory
from graft.engine import fingerprint
from graft.engine import Context, Engine

FORMAT = 'kv-graft-artifact/2'
MANIFEST = 'manifest.json'
STATE = 'state'


# SHA-256 runs in threads (hashlib releases the GIL on large buffers): a restore verifies its
# files while Orbax reads them, and the leaves with every core (bench: restore_gbps).
_HASHERS = concurrent.futures.ThreadPoolExecutor(max(2, os.cpu_count() or 1),
                                                 thread_name_prefix='artifact-sha256')
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
    return self.next_position - len(self.tokens)


def describe(leaves: dict[str, np.ndarray]) -> dict[str, dict]:
  names = sorted(leaves)
  digests = _HASHERS.map(lambda name: sha256_bytes(leaves[name]), names)
  return {name: {'dtype': np.dtype(leaves[name].dtype).name, 'shape': list(leaves[name].shape),
                 'sha256': digest} for name, digest in zip(names, digests)}


def manifest_digest(manifest: dict) -> str:
  """SHA-256 of the canonical JSON of every manifest field but `manifest_sha256` itself."""
  return fingerprint.digest({k: v for k, v in manifest.items() if k != 'manifest_sha256'})


def capture(engine: Engine, ctx: Context) -> Artifact:
  """The context as an (unsaved) artifact: its canonical leaves and full manifest."""
  if not ctx.tokens:
    raise ArtifactError('an empty context has no KV state to save')
  leaves = {'tokens': np.asarray(ctx.tokens, np.int32),
            **kvs.to_leaves(ctx.kv, engine.config.cache_layers)}
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
    orbax_util.save(os.path.join(staging, STATE),
                    {name.replace('/', '.'): leaf for name, leaf in art.leaves.items()})
    manifest['files'] = state_files(staging)
    manifest['manifest_sha256'] = manifest_digest(manifest)
    with open(os.path.join(staging, MANIFEST), 'w') as f:
      json.dump(manifest, f, indent=1, sort_keys=True)
  return manifest


def state_files(artifact_dir: str) -> dict[str, dict]:
  """{relative path: {size, sha256}} of every file under state/: the manifest covers the bytes
  Orbax does not read too, so no file can be truncated or altered unnoticed."""
  root = os.path.join(artifact_dir, STATE)
  paths = sorted(os.path.join(directory, name)
                 for directory, _, names in os.walk(root) for name in names)

  def summary(path):
    with open(path, 'rb') as f:
      data = f.read()
    return {'size': len(data), 'sha256': hashlib.sha256(data).hexdigest()}

  return {os.path.relpath(path, artifact_dir): entry
          for path, entry in zip(paths, _HASHERS.map(summary, paths))}


def _check_files(path: str, expected: dict[str, dict]) -> None:
  actual = state_files(path) if os.path.isdir(os.path.join(path, STATE)) else {}
  for name in sorted(set(expected) | set(actual)):
    if name not in actual:
      raise ArtifactError(f'{path}: file {name} is missing')
    if name not in expected:
      raise ArtifactError(f'{path}: unexpected file {name}')
    want, got = expected[name], actual[name]
    if got['size'] != want['size']:
      raise ArtifactError(f'{path}: file {name} has {got["size"]} bytes, the manifest says '
                          f'{want["size"]} (truncated or extended)')
    if got['sha256'] != want['sha256']:
      raise ArtifactError(f'{path}: file {name} was altered (SHA-256 mismatch)')


def differences(expected, actual, prefix='') -> list[str]:
  """Readable differences between two JSON-like values, e.g.
  ['engine_config.rows_per_call: the artifact has 8, expected 16']."""
  if isinstance(expected, dict) and isinstance(actual, dict):
    out = []
    for key in sorted(set(expected) | set(actual)):
      out += differences(expected.get(key), actual.get(key), f'{prefix}{key}.')
    return out
  if expected == actual:
    return []
  return [f'{prefix.rstrip(".")}: the artifact has {actual!r}, expected {expected!r}']


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
  if manifest.get('format') != FORMAT:
    raise ArtifactError(f'{path}: unknown artifact format {manifest.get("format")!r} (this '
                        f'code reads {FORMAT})')
  if manifest.get('manifest_sha256') != manifest_digest(manifest):
    raise ArtifactError(f'{path}: the manifest was altered (its SHA-256 does not match)')
  return manifest


def _check_fingerprints(path: str, manifest: dict, engine: Engine) -> None:
  for part in ('model', 'engine'):
    if not fingerprint.hashes_to_its_fields(manifest.get(part)):
      raise ArtifactError(f'{path}: the manifest\'s {part} fingerprint does not hash to the '
                          'fields recorded beside it (altered and resealed?)')
  if manifest['model']['sha256'] != engine.model_fingerprint['sha256']:
    diffs = differences(engine.model_fingerprint, manifest['model'])
    raise ArtifactError(f'{path} was made by another model: ' + '; '.join(diffs))
  if manifest['engine']['sha256'] != engine.fingerprint['sha256']:
    diffs = [d for d in differences(engine.fingerprint, manifest['engine'])
             if not d.startswith('sha256')]
    raise ArtifactError(f'{path} was made under another engine configuration: '
                        + '; '.join(diffs))


def _check_leaves(path: str, manifest: dict, leaves: dict[str, np.ndarray]) -> None:
  """Every leaf as the manifest describes it, and every field a graft uses bound to them."""
  expected = manifest['leaves']
  missing = sorted(set(expected) - set(leaves))
  extra = sorted(set(leaves) - set(expected))
  if missing or extra:
    raise ArtifactError(f'{path}: leaves missing {missing}, unexpected {extra}')
  actual = describe(leaves)
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


def _load(path: str, engine: Engine, timings: dict | None) -> Artifact:
  start = time.perf_counter()
  verify = 0.0
  manifest = _read_manifest(path)
  _check_fingerprints(path, manifest, engine)
  # The files are hashed while Orbax reads them; nothing restored is used before both pass.
  files_checked = _FILE_CHECKS.submit(_check_files, path, manifest.get('files', {}))
  try:
    restored = orbax_util.restore(os.path.join(path, STATE))
  except Exception as e:  # orbax/tensorstore raise many kinds on damaged or missing files
    files_checked.result()  # a damaged file is the better message
    raise ArtifactError(f'{path}: the state cannot be read ({type(e).__name__}: {e})') from None
  leaves = {name.replace('.', '/'): np.asarray(leaf) for name, leaf in restored.items()}
  t = time.perf_counter()
  files_checked.result()
  _check_leaves(path, manifest, leaves)
  verify += time.perf_counter() - t
  if timings is not None:
    timings.update(read_s=time.perf_counter() - start - verify, verify_s=verify)
  return Artifact(tokens=tuple(int(t) for t in leaves['tokens']),
                  next_position=int(manifest['next_position']), leaves=leaves, manifest=manifest)


def rows(engine: Engine, artifact: Artifact) -> list[kvs.KVRows]:
  """The artifact's KV as rows (`Engine.graft`'s input)."""
  try:
    return kvs.rows_from_leaves(artifact.leaves, engine.config.cache_layers,
                                len(artifact.tokens), artifact.start_position)
  except ValueError as e:
    raise ArtifactError(f'the artifact does not fit this engine: {e}') from None


def graft(engine: Engine, artifact: Artifact) -> Context:
  """A fresh context holding the artifact's KV state at its own positions."""
  try:
    return engine.graft(rows(engine, artifact), artifact.tokens, artifact.start_position)
  except ValueError as e:
    raise ArtifactError(f'the artifact does not fit this engine: {e}') from None
