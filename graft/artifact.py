"""Artifacts: a KV state saved with its token ids and a manifest of SHA-256 hashes.

On disk an artifact is a directory:

    manifest.json   format, token count and hash, positions, the model and engine fingerprints,
                    {dtype, shape, sha256} of every leaf's raw bytes, and {size, sha256} of
                    every file under state/
    state/          an Orbax checkpoint of the leaves: `tokens` int32 [n] and, for each
                    cache-owning layer i, `layer_{i}/k`, `layer_{i}/v` [slots, K, H] and
                    `layer_{i}/positions` int32 [slots]; compression off, raw dtype

Only the slots that hold tokens are stored (slots [0, min(n, S)) of each layer; a local ring that
wrapped is stored whole), with the K/V of empty slots zeroed so the bytes depend on the tokens
alone. Writes go to a temporary directory beside the target and are renamed into place when
complete. `load` re-hashes every leaf and refuses, with the reason, an artifact from another
model or engine configuration, of another dtype, with a missing, extra or altered leaf, or with
files missing or damaged. `graft` puts a verified artifact at its own positions.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import os
import shutil
import uuid

import jax.numpy as jnp
import numpy as np

from analysis.metrics import sha256_bytes
from gemma_jax import kv_state as kvs
from gemma_jax.checkpoints import orbax_util
from graft.engine import Engine, Sequence

FORMAT = 'kv-graft-artifact/1'
MANIFEST = 'manifest.json'
STATE = 'state'


class ArtifactError(ValueError):
  """An artifact that must not be grafted; the message says why."""


@dataclasses.dataclass(frozen=True)
class Artifact:
  tokens: tuple[int, ...]
  leaves: dict[str, np.ndarray]  # verified, as stored
  manifest: dict

  @property
  def start_position(self) -> int:
    return self.manifest['start_position']


def leaves_of(engine: Engine, seq: Sequence) -> dict[str, np.ndarray]:
  """The canonical leaves of a context's KV state (see the module docstring)."""
  if not seq.tokens:
    raise ArtifactError('an empty context has no KV state to save')
  n = len(seq.tokens)
  out = {'tokens': np.asarray(seq.tokens, np.int32)}
  for layer_index, layer in zip(engine.config.cache_layers, seq.kv.layers):
    stored = min(n, layer.num_slots)
    positions = np.asarray(layer.positions[0, :stored])
    filled = (positions != kvs.EMPTY)[:, None, None]
    out[f'layer_{layer_index}/k'] = np.where(filled, np.asarray(layer.k[0, :stored]), 0)
    out[f'layer_{layer_index}/v'] = np.where(filled, np.asarray(layer.v[0, :stored]), 0)
    out[f'layer_{layer_index}/positions'] = positions
  return out


def describe(leaves: dict[str, np.ndarray]) -> dict[str, dict]:
  return {name: {'dtype': np.dtype(a.dtype).name, 'shape': list(a.shape),
                 'sha256': sha256_bytes(a)} for name, a in sorted(leaves.items())}


def save(path: str, engine: Engine, seq: Sequence) -> dict:
  """Writes the context as an artifact at `path` (which must not exist); returns the manifest."""
  if os.path.exists(path):
    raise FileExistsError(f'{path} already exists; artifacts are immutable')
  leaves = leaves_of(engine, seq)
  manifest = {
      'format': FORMAT,
      'created': datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds'),
      'num_tokens': len(seq.tokens),
      'tokens_sha256': sha256_bytes(leaves['tokens']),
      'start_position': seq.next_position - len(seq.tokens),
      'next_position': seq.next_position,
      'model': engine.model_fingerprint,
      'engine': engine.fingerprint,
      'leaves': describe(leaves),
  }
  parent = os.path.dirname(os.path.abspath(path))
  os.makedirs(parent, exist_ok=True)
  # A fresh hidden name, created with the umask's permissions (mkdtemp's are owner-only).
  staging = os.path.join(parent, f'.{os.path.basename(path)}.{uuid.uuid4().hex}')
  os.mkdir(staging)
  try:
    orbax_util.save(os.path.join(staging, STATE),
                    {name.replace('/', '.'): leaf for name, leaf in leaves.items()})
    manifest['files'] = state_files(staging)
    with open(os.path.join(staging, MANIFEST), 'w') as f:
      json.dump(manifest, f, indent=1, sort_keys=True)
    os.rename(staging, path)
  except BaseException:
    shutil.rmtree(staging, ignore_errors=True)
    raise
  return manifest


def state_files(artifact_dir: str) -> dict[str, dict]:
  """{relative path: {size, sha256}} of every file under state/: the manifest covers the bytes
  Orbax does not read too, so no file can be truncated or altered unnoticed."""
  out = {}
  root = os.path.join(artifact_dir, STATE)
  for directory, _, names in os.walk(root):
    for name in names:
      path = os.path.join(directory, name)
      with open(path, 'rb') as f:
        data = f.read()
      out[os.path.relpath(path, artifact_dir)] = {'size': len(data),
                                                  'sha256': hashlib.sha256(data).hexdigest()}
  return dict(sorted(out.items()))


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
  ['pinned.block_size: the artifact has 8, expected 16']."""
  if isinstance(expected, dict) and isinstance(actual, dict):
    out = []
    for key in sorted(set(expected) | set(actual)):
      out += differences(expected.get(key), actual.get(key), f'{prefix}{key}.')
    return out
  if expected == actual:
    return []
  return [f'{prefix.rstrip(".")}: the artifact has {actual!r}, expected {expected!r}']


def load(path: str, engine: Engine) -> Artifact:
  """Reads and verifies an artifact for `engine`; raises ArtifactError naming what is wrong."""
  manifest_path = os.path.join(path, MANIFEST)
  if not os.path.isdir(path):
    raise ArtifactError(f'no artifact at {path}')
  try:
    with open(manifest_path) as f:
      manifest = json.load(f)
  except FileNotFoundError:
    raise ArtifactError(f'{path} is not a complete artifact: {MANIFEST} is missing') from None
  except json.JSONDecodeError as e:
    raise ArtifactError(f'{manifest_path} is damaged: {e}') from None
  if manifest.get('format') != FORMAT:
    raise ArtifactError(f'{path}: unknown artifact format {manifest.get("format")!r}')
  if manifest['model']['sha256'] != engine.model_fingerprint['sha256']:
    diffs = differences(engine.model_fingerprint, manifest['model'])
    raise ArtifactError(f'{path} was made by another model: ' + '; '.join(diffs))
  if manifest['engine']['sha256'] != engine.fingerprint['sha256']:
    diffs = [d for d in differences(engine.fingerprint, manifest['engine'])
             if not d.startswith('sha256')]
    raise ArtifactError(f'{path} was made under another engine configuration: '
                        + '; '.join(diffs))
  _check_files(path, manifest.get('files', {}))
  try:
    restored = orbax_util.restore(os.path.join(path, STATE))
  except Exception as e:  # orbax/tensorstore raise many kinds on damaged or missing files
    raise ArtifactError(f'{path}: the state cannot be read ({type(e).__name__}: {e})') from None
  leaves = {name.replace('.', '/'): np.asarray(leaf) for name, leaf in restored.items()}
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
  tokens = tuple(int(t) for t in leaves['tokens'])
  if len(tokens) != manifest['num_tokens']:
    raise ArtifactError(f'{path}: {len(tokens)} tokens stored, manifest says '
                        f'{manifest["num_tokens"]}')
  return Artifact(tokens=tokens, leaves=leaves, manifest=manifest)


def graft(engine: Engine, artifact: Artifact) -> Sequence:
  """A fresh context holding the artifact's KV state at its own positions."""
  empty = engine.empty()
  layers = []
  for layer_index, layer in zip(engine.config.cache_layers, empty.kv.layers):
    k = artifact.leaves[f'layer_{layer_index}/k']
    stored = k.shape[0]
    if stored > layer.num_slots or k.shape[1:] != layer.k.shape[2:]:
      raise ArtifactError(f'layer {layer_index}: stored K {k.shape} does not fit the engine\'s '
                          f'cache {layer.k.shape[1:]}')
    layers.append(kvs.LayerKV(
        k=layer.k.at[0, :stored].set(jnp.asarray(k, layer.k.dtype)),
        v=layer.v.at[0, :stored].set(jnp.asarray(artifact.leaves[f'layer_{layer_index}/v'],
                                                 layer.v.dtype)),
        positions=layer.positions.at[0, :stored].set(
            jnp.asarray(artifact.leaves[f'layer_{layer_index}/positions']))))
  kv = kvs.KVState(layers=tuple(layers),
                   fill=jnp.full((1,), len(artifact.tokens), jnp.int32))
  return Sequence(kv=kv, tokens=artifact.tokens, next_position=artifact.manifest['next_position'])
