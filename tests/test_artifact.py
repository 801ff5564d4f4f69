"""Artifacts: saved atomically, verified on restore, refused with the reason when anything is
off."""

import dataclasses
import json
import os
import pathlib
import shutil
import subprocess
import sys

import numpy as np
import pytest

from gemma_jax.compare import sha256_bytes
from gemma_jax import weights
from gemma_jax.checkpoints import orbax_util
from gemma_jax import digest
from graft.store import artifact
from graft.store.artifact import ArtifactError
from graft.engine import Engine, EngineConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
PINNED = EngineConfig(rows_per_call=8, cache_len=256, attention_tile=8)  # 8-slot tiles: see below
LIBRARY = [int(t) for t in np.random.default_rng(0).integers(3, 512, 41)]
QUERY = [int(t) for t in np.random.default_rng(1).integers(3, 512, 9)]


@pytest.fixture(scope='module')
def eng():
  return Engine(weights.load('tiny_gemma3', 'random:0'), PINNED)


@pytest.fixture
def saved(eng, tmp_path):
  seq, _ = eng.prefill(LIBRARY, logits='none')
  path = tmp_path / 'library'
  artifact.save(str(path), eng, seq)
  return path


def reseal(path, manifest):
  """Writes a tampered manifest with its own hash recomputed, as a tamperer who knows the
  format would: the checks behind the manifest hash must catch what it no longer does."""
  manifest['manifest_sha256'] = artifact.manifest_digest(manifest)
  (path / 'manifest.json').write_text(json.dumps(manifest))


def data_files(path):
  """The files holding the leaves' bytes (one zarr chunk per leaf), largest first."""
  files = [p for p in (path / 'state').rglob('*') if p.is_file() and p.name[0] == '0']
  return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def test_manifest_records_hashes_and_fingerprints(eng, saved):
  manifest = json.loads((saved / 'manifest.json').read_text())
  assert manifest['num_tokens'] == len(LIBRARY)
  assert manifest['model']['sha256'] == eng.model_fingerprint['sha256']
  assert manifest['engine']['sha256'] == eng.fingerprint['sha256']
  assert manifest['engine']['mode'] == 'spec' and manifest['engine']['rows_per_call'] == 8
  assert manifest['format'] == 'kv-graft-artifact/3'
  assert manifest['leaves']['tokens']['blake3'] == digest.hexdigest(
      'blake3', np.asarray(LIBRARY, np.int32))
  # Layer 5 is global (every token stored); layer 0 is local, a ring of W + B - 1 = 15 slots
  # rounded up to whole 8-slot attention tiles.
  assert manifest['leaves']['layer_5/k']['shape'] == [len(LIBRARY), 2, 16]
  assert manifest['leaves']['layer_0/k']['shape'] == [16, 2, 16]
  assert manifest['leaves']['layer_0/k']['dtype'] == 'float32'
  assert all(f.startswith('state/') and f in manifest['files'] for f in map(
      lambda p: str(p.relative_to(saved)), data_files(saved)))
  umask = os.umask(0)
  os.umask(umask)
  assert saved.stat().st_mode & 0o777 == 0o777 & ~umask  # not the staging dir's owner-only mode


def test_each_leaf_is_one_file_of_its_raw_bytes_and_orbax_reads_it_too(eng, saved):
  # The one-pass reader relies on this layout; Orbax, on whatever it wrote.
  seq, _ = eng.prefill(LIBRARY, logits='none')
  leaves = artifact.capture(eng, seq).leaves
  for name, leaf in leaves.items():
    chunk = saved / 'state' / orbax_util.leaf_file(orbax_util.stored_name(name), leaf.ndim)
    assert chunk.read_bytes() == leaf.tobytes(), name
  restored = orbax_util.restore(str(saved / 'state'))
  assert {orbax_util.stored_name(n): sha256_bytes(v) for n, v in leaves.items()} == {
      n: sha256_bytes(v) for n, v in restored.items()}


def test_format_2_artifacts_still_read(eng, tmp_path):
  # Written as format 2 was (Orbax's default OCDBT layout, SHA-256 of files and leaves): read
  # through Orbax, verified, grafted exactly; a flipped byte is still refused.
  seq, _ = eng.prefill(LIBRARY, logits='none')
  art = artifact.capture(eng, seq)
  path = tmp_path / 'v2'
  orbax_util.save(str(path / 'state'),
                  {orbax_util.stored_name(n): v for n, v in art.leaves.items()})
  manifest = {**art.manifest, 'format': 'kv-graft-artifact/2',
              'leaves': artifact.describe(art.leaves, 'sha256'),
              'files': artifact.state_files(str(path), 'sha256')}
  reseal(path, manifest)
  _, fresh = eng.extend(eng.empty(), LIBRARY + QUERY, logits=len(QUERY))
  _, grafted = eng.extend(artifact.graft(eng, artifact.load(str(path), eng)), QUERY,
                          logits='all')
  assert sha256_bytes(fresh) == sha256_bytes(grafted)
  ocdbt = [p for p in (path / 'state').rglob('*') if p.is_file() and p.parent.name == 'd']
  data = bytearray(ocdbt[0].read_bytes())
  data[len(data) // 2] ^= 0x01
  ocdbt[0].write_bytes(bytes(data))
  with pytest.raises(ArtifactError, match='was altered \\(sha256 mismatch\\)'):
    artifact.load(str(path), eng)


def test_restore_verifies_and_grafts_exactly(eng, saved):
  _, fresh = eng.extend(eng.empty(), LIBRARY + QUERY, logits=len(QUERY))
  _, grafted = eng.extend(artifact.graft(eng, artifact.load(str(saved), eng)), QUERY,
                          logits='all')
  assert sha256_bytes(fresh) == sha256_bytes(grafted)


def test_restore_in_a_fresh_process_is_byte_exact(eng, saved):
  _, fresh = eng.extend(eng.empty(), LIBRARY + QUERY, logits=len(QUERY))
  script = f'''
from gemma_jax.compare import sha256_bytes
from gemma_jax import weights
from gemma_jax.checkpoints import orbax_util
from gemma_jax import digest
from graft.store import artifact
from graft.engine import Engine, EngineConfig
eng = Engine(weights.load('tiny_gemma3', 'random:0'), EngineConfig(rows_per_call=8, cache_len=256, attention_tile=8))
seq = artifact.graft(eng, artifact.load({str(saved)!r}, eng))
print(sha256_bytes(eng.extend(seq, {QUERY!r}, logits='all')[1]))
'''
  out = subprocess.run([sys.executable, '-c', script], cwd=REPO, capture_output=True, text=True,
                       env={**os.environ, 'PYTHONPATH': str(REPO)}, check=True)
  assert out.stdout.strip().splitlines()[-1] == sha256_bytes(fresh)


def test_refuses_an_artifact_of_another_model(saved):
  other = Engine(weights.load('tiny_gemma3', 'random:1'), PINNED)
  with pytest.raises(ArtifactError, match='another model.*params_sha256'):
    artifact.load(str(saved), other)


def test_refuses_another_dtype(saved):
  # (The spec's arithmetic is float32: a bfloat16 engine is a pinned one.)
  other = Engine(weights.load('tiny_gemma3', 'random:0', 'bfloat16'),
                 dataclasses.replace(PINNED, mode='pinned'))
  with pytest.raises(ArtifactError, match="dtype: the artifact has 'float32', expected "
                                          "'bfloat16'"):
    artifact.load(str(saved), other)


def test_refuses_another_engine_configuration(eng, saved):
  other = Engine(eng.loaded, EngineConfig(rows_per_call=16, cache_len=256, attention_tile=8))
  with pytest.raises(ArtifactError, match='rows_per_call: the artifact has 8, expected 16'):
    artifact.load(str(saved), other)


def test_refuses_one_flipped_byte(eng, saved):
  target = data_files(saved)[0]
  data = bytearray(target.read_bytes())
  data[len(data) // 2] ^= 0x01
  target.write_bytes(bytes(data))
  with pytest.raises(ArtifactError, match=f'file {target.relative_to(saved)} was altered'):
    artifact.load(str(saved), eng)


def test_refuses_a_truncated_file(eng, saved):
  target = data_files(saved)[0]
  target.write_bytes(target.read_bytes()[:-100])
  with pytest.raises(ArtifactError, match='bytes, the manifest says .* \\(truncated'):
    artifact.load(str(saved), eng)


def test_leaf_hashes_catch_what_the_file_list_would_miss(eng, saved):
  # Even with the file list rewritten to match a damaged file, the leaf hashes refuse it.
  target = data_files(saved)[0]
  data = bytearray(target.read_bytes())
  data[len(data) // 3] ^= 0x10
  target.write_bytes(bytes(data))
  manifest = json.loads((saved / 'manifest.json').read_text())
  manifest['files'] = artifact.state_files(str(saved))
  reseal(saved, manifest)
  with pytest.raises(ArtifactError, match='does not match its manifest|cannot be read'):
    artifact.load(str(saved), eng)


def test_refuses_missing_files(eng, saved, tmp_path):
  no_manifest = tmp_path / 'no_manifest'
  shutil.copytree(saved, no_manifest)
  (no_manifest / 'manifest.json').unlink()
  with pytest.raises(ArtifactError, match='manifest.json is missing'):
    artifact.load(str(no_manifest), eng)
  data_files(saved)[0].unlink()
  with pytest.raises(ArtifactError, match='file state/.* is missing'):
    artifact.load(str(saved), eng)
  with pytest.raises(ArtifactError, match='no artifact'):
    artifact.load(str(tmp_path / 'nothing_here'), eng)


def test_refuses_a_missing_leaf_and_a_tampered_manifest(eng, saved):
  manifest_path = saved / 'manifest.json'
  original = json.loads(manifest_path.read_text())
  manifest = json.loads(manifest_path.read_text())
  manifest['leaves']['layer_99/k'] = manifest['leaves']['layer_0/k']  # as if its data vanished
  manifest_path.write_text(json.dumps(manifest))
  with pytest.raises(ArtifactError, match='the manifest was altered'):
    artifact.load(str(saved), eng)
  reseal(saved, manifest)
  with pytest.raises(ArtifactError, match='leaf layer_99/k has no file state/layer_99.k/0.0.0'):
    artifact.load(str(saved), eng)
  del manifest['leaves']['layer_99/k']
  manifest['leaves']['layer_0/v']['blake3'] = '0' * 64
  reseal(saved, manifest)
  with pytest.raises(ArtifactError, match='leaf layer_0/v does not match'):
    artifact.load(str(saved), eng)
  reseal(saved, original)
  artifact.load(str(saved), eng)  # the untouched fields verify again


def test_a_resealed_manifest_cannot_ask_for_an_object_array(eng, saved):
  # Raw bytes are read straight into each leaf's array: a dtype from the manifest must never
  # make it an array of object pointers (same byte size, so only the dtype check stands).
  manifest = json.loads((saved / 'manifest.json').read_text())
  leaf = manifest['leaves']['layer_0/k']
  assert leaf['dtype'] == 'float32' and leaf['shape'] == [16, 2, 16]
  manifest['leaves']['layer_0/k'] = {**leaf, 'dtype': 'object', 'shape': [256]}
  reseal(saved, manifest)
  with pytest.raises(ArtifactError, match="leaf dtype: unsupported array dtype 'object'"):
    artifact.load(str(saved), eng)


@pytest.mark.parametrize('field, value, message', [
    ('next_position', 1000, 'next_position 1000 is not start 0'),
    ('start_position', 5, 'next_position 41 is not start 5'),
    ('num_tokens', 40, '41 tokens stored, manifest says 40'),
    ('tokens_sha256', '0' * 64, 'the tokens do not match tokens_sha256'),
])
def test_every_field_a_graft_uses_is_cross_checked(eng, saved, field, value, message):
  # Even a manifest whose own hash was recomputed cannot move the graft's positions or swap
  # its tokens: each field is checked against the leaves it describes.
  manifest = json.loads((saved / 'manifest.json').read_text())
  manifest[field] = value
  reseal(saved, manifest)
  with pytest.raises(ArtifactError, match=message):
    artifact.load(str(saved), eng)


def test_positions_must_follow_from_the_start_and_token_count(eng, tmp_path):
  # An artifact computed from position 7 records it; claiming position 0 with consistent
  # counts is refused because the positions leaf says otherwise.
  ctx, _ = eng.extend(eng.empty(start_position=7), LIBRARY, logits='none')
  path = tmp_path / 'at7'
  artifact.save(str(path), eng, ctx)
  manifest = json.loads((path / 'manifest.json').read_text())
  assert (manifest['start_position'], manifest['next_position']) == (7, 7 + len(LIBRARY))
  manifest['start_position'], manifest['next_position'] = 0, len(LIBRARY)
  reseal(path, manifest)
  with pytest.raises(ArtifactError, match='does not hold positions 0..40 in sequence order'):
    artifact.load(str(path), eng)


def test_refuses_an_artifact_of_another_slot_layout_version(eng, saved, monkeypatch):
  monkeypatch.setattr('graft.engine.plans.SLOT_LAYOUT_VERSION', 1)
  old = Engine(eng.loaded, PINNED)
  with pytest.raises(ArtifactError, match='slot_layout_version: the artifact has 2, expected 1'):
    artifact.load(str(saved), old)


def test_a_refused_artifact_harms_nothing_else(eng, saved, tmp_path):
  good = tmp_path / 'good'
  shutil.copytree(saved, good)
  before = {p: p.read_bytes() for p in good.rglob('*') if p.is_file()}
  data_files(saved)[0].write_bytes(b'garbage')
  with pytest.raises(ArtifactError):
    artifact.load(str(saved), eng)
  assert {p: p.read_bytes() for p in good.rglob('*') if p.is_file()} == before
  artifact.graft(eng, artifact.load(str(good), eng))  # the engine still works


def test_save_is_atomic_and_never_overwrites(eng, saved, tmp_path, monkeypatch):
  seq, _ = eng.prefill(LIBRARY, logits='none')
  with pytest.raises(FileExistsError):
    artifact.save(str(saved), eng, seq)

  def broken_save(*args, **kwargs):
    raise OSError('disk full')

  monkeypatch.setattr(artifact.orbax_util, 'save_leaf_files', broken_save)
  with pytest.raises(OSError, match='disk full'):
    artifact.save(str(tmp_path / 'half'), eng, seq)
  assert sorted(p.name for p in tmp_path.iterdir()) == ['library']  # nothing half-written


def test_empty_context_cannot_be_saved(eng, tmp_path):
  with pytest.raises(ArtifactError, match='empty'):
    artifact.save(str(tmp_path / 'x'), eng, eng.empty())
