"""CI replays a committed manifest: the spec engine on this machine reproduces every hash.

manifests/ci_gemma3_270m_float32.json holds 4 samples of the embedded 270M (libraries of 1, 511,
512 and 513 tokens: before, at and past the 512-token sliding window) with the SHA-256 of the
fresh and grafted query logits and of the greedy continuation, as recorded on the machine that
made it. The spec engine's bits are the written arithmetic's (docs/determinism.md), so any
machine whose self-check passes reproduces them: the manifest is selected on every machine.
"""

import json
import pathlib

import pytest

from graft import replay

MANIFESTS = pathlib.Path(__file__).resolve().parents[1] / 'manifests'
CI_MANIFEST = MANIFESTS / 'ci_gemma3_270m_float32.json'


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
