"""CI replays a committed manifest: the pinned engine on this machine reproduces every hash.

manifests/ci_gemma3_270m_float32_<cpu>.json hold 4 samples of the embedded 270M (libraries of 1,
511, 512 and 513 tokens: before, at and past the 512-token sliding window) with the SHA-256 of
the fresh and grafted query logits and of the greedy continuation, as recorded when each was
made. Bits depend on the CPU model (experiments/replay.py), so the test replays the one made on a
machine like this one, and fails (saying how to make one) when none was.
"""

import json
import pathlib

import pytest

from experiments import replay

CI_MANIFESTS = str(pathlib.Path(__file__).resolve().parents[1] /
                   'manifests/ci_gemma3_270m_float32_*.json')


@pytest.mark.slow
def test_committed_manifest_replays_hash_for_hash():
  manifest = json.loads(pathlib.Path(replay.select(CI_MANIFESTS)).read_text())
  assert manifest['config']['engine'] == 'pinned' and len(manifest['samples']) == 4
  assert replay.replay(manifest) == []


def test_a_manifest_from_another_kind_of_machine_is_not_selected(tmp_path):
  # The committed AMD manifest records its CPU; on any other machine it is not the one chosen.
  amd = json.loads(pathlib.Path(CI_MANIFESTS.replace('*', 'amd')).read_text())
  other = json.loads(json.dumps(amd))
  other['engine_fingerprint']['environment']['cpu_features'] = ['no-such-extension']
  (tmp_path / 'ci_x_other.json').write_text(json.dumps(other))
  assert not replay.made_on_this_kind_of_machine(other)
  with pytest.raises(FileNotFoundError, match='none of .* was made on a machine like this one'):
    replay.select(str(tmp_path / 'ci_x_*.json'))
