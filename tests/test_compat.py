"""Knowledge outlives a release: artifacts and stores that earlier releases of the spec engine
made (tests/data/compat, experiments/compat_fixture.py) graft with the current code, SHA-256
equal to a fresh computation, for as long as the spec version they record is current; under
another spec version they are refused with the versions named."""

import functools
import json
import pathlib
import shutil

import pytest

from gemma_jax import numerics, weights
from gemma_jax.compare import sha256_bytes
from graft.engine import Engine, EngineConfig, plans
from graft.store import ArtifactError, Store, StoreError, artifact

FIXTURES = sorted(p for p in (pathlib.Path(__file__).parent / 'data' / 'compat').iterdir()
                  if (p / 'fixture.json').exists())


def record(folder):
  return json.loads((folder / 'fixture.json').read_text())


@functools.lru_cache(maxsize=None)
def engine_of(model, weights_spec, config_json):
  return Engine(weights.load(model, weights_spec, 'float32'),
                EngineConfig(**json.loads(config_json)))


def fixture_weights(folder, rec):
  """The weights a fixture was made with: its own weights.safetensors (the parameters that
  release's `random:0` gave; a later release may draw random:0 otherwise), else its spec."""
  path = folder / 'weights.safetensors'
  return str(path) if path.exists() else rec['weights']


def fixture_engine(folder, rec):
  return engine_of(rec['model'], fixture_weights(folder, rec),
                   json.dumps(rec['engine_config'], sort_keys=True))


def spec_version(rec):
  return rec['engine_fingerprint']['numerics']['version']


def fresh_sha(engine, rec):
  logits = engine.extend(engine.empty(), rec['tokens'] + rec['query'],
                         logits=len(rec['query']))[1]
  return sha256_bytes(logits)


def query_sha(engine, ctx, rec, start):
  _, logits = engine.extend(ctx, rec['tokens'][start:] + rec['query'], logits=len(rec['query']))
  return sha256_bytes(logits)


def test_there_is_a_fixture_of_the_current_spec_version():
  assert any(spec_version(record(f)) == numerics.Spec.version for f in FIXTURES)


@pytest.mark.parametrize('folder', FIXTURES, ids=lambda p: p.name)
def test_an_artifact_of_an_earlier_release_grafts_exactly(folder):
  rec = record(folder)
  if spec_version(rec) != numerics.Spec.version:
    pytest.skip(f'spec version {spec_version(rec)}: test_another_spec_version_is_refused covers it')
  engine = fixture_engine(folder, rec)
  fresh = fresh_sha(engine, rec)
  assert engine.model_fingerprint['sha256'] == rec['model_fingerprint']
  assert fresh == rec['fresh_logits_sha256']
  ctx = artifact.graft(engine, artifact.load(str(folder / 'artifact'), engine))
  assert query_sha(engine, ctx, rec, len(rec['tokens'])) == fresh


@pytest.mark.parametrize('folder', FIXTURES, ids=lambda p: p.name)
def test_a_store_of_an_earlier_release_grafts_exactly_and_takes_new_blocks(folder, tmp_path):
  rec = record(folder)
  if spec_version(rec) != numerics.Spec.version:
    pytest.skip(f'spec version {spec_version(rec)}: test_another_spec_version_is_refused covers it')
  engine = fixture_engine(folder, rec)
  shutil.copytree(folder / 'store', tmp_path / 'store')
  store = Store(f'file://{tmp_path}/store/', engine)
  ctx, match = store.graft(rec['tokens'])
  assert match.tokens == len(rec['tokens'])
  assert query_sha(engine, ctx, rec, match.tokens) == fresh_sha(engine, rec)
  # The old store keeps working: a longer context reuses its blocks and adds its own.
  report = store.put(rec['tokens'] + rec['query'])
  assert report['reused_tokens'] > 0 and report['blocks_written'] >= 1
  assert store.verify() == []


@pytest.mark.parametrize('folder', FIXTURES, ids=lambda p: p.name)
def test_another_spec_version_is_refused_with_the_versions_named(folder, tmp_path, monkeypatch):
  rec = record(folder)
  other = spec_version(rec) + 1
  if other == numerics.Spec.version:
    other += 1
  # An engine of that version (its self-check and canary are another version's business).
  monkeypatch.setattr(plans, 'SpecNumerics', functools.partial(numerics.Spec, version=other))
  monkeypatch.setattr(plans.Spec, 'check_engine', lambda self, engine: None)
  engine = Engine(weights.load(rec['model'], fixture_weights(folder, rec), 'float32'),
                  EngineConfig(**rec['engine_config']))
  assert engine.fingerprint['numerics']['version'] == other
  with pytest.raises(ArtifactError, match=f'spec version {spec_version(rec)}.*{other}'):
    artifact.load(str(folder / 'artifact'), engine)
  shutil.copytree(folder / 'store', tmp_path / 'store')
  with pytest.raises(StoreError, match=f'spec version {spec_version(rec)}.*{other}'):
    Store(f'file://{tmp_path}/store/', engine)

