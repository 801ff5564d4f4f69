"""CI replays a committed manifest: the pinned engine on this machine reproduces every hash.

manifests/ci_gemma3_270m_float32.json holds 4 samples of the embedded 270M (libraries of 1, 511,
512 and 513 tokens: before, at and past the 512-token sliding window) with the SHA-256 of the
fresh and grafted query logits and of the greedy continuation, as recorded when it was made.
"""

import json
import pathlib

import pytest

from experiments import replay

MANIFEST = pathlib.Path(__file__).resolve().parents[1] / 'manifests/ci_gemma3_270m_float32.json'


@pytest.mark.slow
def test_committed_manifest_replays_hash_for_hash():
  manifest = json.loads(MANIFEST.read_text())
  assert manifest['config']['engine'] == 'pinned' and len(manifest['samples']) == 4
  assert replay.replay(manifest) == []
