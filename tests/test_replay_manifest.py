"""CI replays a committed manifest: the spec engine on this machine reproduces every hash.

manifests/ci_gemma3_270m_float32.json holds 4 samples of the embedded 270M (libraries of 1, 511,
512 and 513 tokens: before, at and past the 512-token sliding window) with the SHA-256 of the
fresh and grafted query logits and of the greedy continuation, as recorded on the machine that
made it. The spec engine's bits are the written arithmetic's (docs/determinism.md), so any
machine whose self-check passes reproduces them: the manifest is selected on every machine.
"""

import dataclasses
import json
import logging
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from gemma_jax import weights
from graft import exactness, replay
from graft.engine import Engine, EngineConfig

REPO = pathlib.Path(__file__).resolve().parents[1]
MANIFESTS = REPO / 'manifests'
CI_MANIFEST = MANIFESTS / 'ci_gemma3_270m_float32.json'


@pytest.fixture(scope='module')
def tiny_manifest(tmp_path_factory):
  """A spec manifest of the tiny Gemma 3, made on the native kernels (as six committed manifests
  are), of one sample."""
  made = Engine(weights.load('tiny_gemma3', 'random:0', 'float32'),
                EngineConfig(mode='spec', rows_per_call=16, attention_tile=16, cache_len=128))
  assert made.engine_config.dot_library == 'native'
  rng = np.random.default_rng(11)
  library, query = ([int(t) for t in rng.integers(3, 512, n)] for n in (40, 5))
  graft = exactness.artifact_graft(made, made, str(tmp_path_factory.mktemp('artifact') / 'a'))
  row = exactness.check_sample(made, graft, library, query, continuation_tokens=4)
  return {'kind': 'graft_exactness',
          'config': {'model': 'tiny_gemma3', 'weights': 'random:0', 'dtype': 'float32',
                     'engine_config': dataclasses.asdict(made.engine_config),
                     'continuation_tokens': 4},
          'engine_fingerprint': made.fingerprint, 'model_fingerprint': made.model_fingerprint,
          'samples': [{'library': library, 'query': query,
                       **{h: row[h] for h in replay.HASHES}}]}


def test_a_replay_warns_only_where_the_fingerprint_differs(tiny_manifest, caplog):
  """A manifest made before the fingerprint recorded the canary and the RoPE mode (as the CI
  manifest was) replays quietly: those fields read as what they stood for. A field that
  differs is named."""
  older = json.loads(json.dumps(tiny_manifest))
  for field in ('canary', 'rope'):
    del older['engine_fingerprint'][field]
  with caplog.at_level(logging.WARNING):
    replay._engine(older)
  assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
  other = json.loads(json.dumps(tiny_manifest))
  other['engine_fingerprint']['canary'] = 'f' * 64
  with caplog.at_level(logging.WARNING):
    replay._engine(other)
  warned = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
  assert len(warned) == 1 and "canary: the manifest has 'ffff" in warned[0], warned


def test_a_native_manifest_replays_on_eigen_where_no_compiler_is_found(tiny_manifest, tmp_path):
  """Where the native kernels cannot be built (no C++ compiler), a manifest made on them
  replays on Eigen's dots, whose bits the self-check vouches for here, saying why in one line;
  asking for the native kernels there is a one-line error."""
  path = tmp_path / 'native.json'
  path.write_text(json.dumps(tiny_manifest))
  bare = tmp_path / 'bin'  # a PATH without a compiler
  bare.mkdir()
  env = {**os.environ, 'PYTHONPATH': str(REPO), 'PATH': str(bare), 'CXX': ''}
  command = [sys.executable, '-m', 'experiments.replay', f'--manifest={path}']
  done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert done.returncode == 0 and 'all 1 records reproduce' in done.stdout, done.stderr[-3000:]
  said = [line for line in done.stderr.splitlines() if 'native' in line]
  assert len(said) == 1 and 'C++17 compiler' in said[0] and "on Eigen's dots" in said[0], (
      done.stderr[-3000:])
  assert 'Traceback' not in done.stderr
  asked = subprocess.run(command + ['--dot_library=native'], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=900)
  # (jax's own INFO lines, such as a TPU it does not find, are not this project's)
  lines = [line for line in asked.stderr.strip().splitlines() if not line.startswith('I')]
  assert asked.returncode == 2 and len(lines) == 1, asked.stderr[-3000:]
  assert lines[0].startswith('error: ') and 'C++17 compiler' in lines[0]


@pytest.mark.slow
def test_committed_manifest_replays_hash_for_hash():
  manifest = json.loads(CI_MANIFEST.read_text())
  assert manifest['config']['engine'] == 'spec' and len(manifest['samples']) == 4
  assert replay.replay(manifest) == []


def test_a_spec_manifest_is_chosen_whatever_machine_made_it(tmp_path):
  spec = json.loads(CI_MANIFEST.read_text())
  spec['engine_fingerprint']['made_on'] = {'cpu_model': 'AuthenticAMD/25/17', 'jax': '9.9'}
  pinned = json.loads((MANIFESTS / 'graft_exactness_gemma3_270m_float32_pinned_intel.json')
                      .read_text())
  pinned['engine_fingerprint']['environment']['cpu_features'] = ['no-such-extension']
  (tmp_path / 'ci_a.json').write_text(json.dumps(pinned))
  (tmp_path / 'ci_b.json').write_text(json.dumps(spec))
  assert replay.made_on_this_kind_of_machine(spec)
  assert not replay.made_on_this_kind_of_machine(pinned)
  assert replay.select(str(tmp_path / 'ci_*.json')).endswith('ci_b.json')
  (tmp_path / 'ci_b.json').unlink()
  with pytest.raises(FileNotFoundError, match='none of .* was made on a machine like this one'):
    replay.select(str(tmp_path / 'ci_*.json'))


def test_a_manifest_of_another_model_is_refused_naming_both_sides():
  manifest = json.loads(CI_MANIFEST.read_text())
  manifest['model_fingerprint']['sha256'] = '0' * 64
  with pytest.raises(ValueError, match="sha256: the manifest has '0000000000.*', this machine '"):
    replay.replay(manifest)
