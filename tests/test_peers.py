"""Peers read this project's files as their own: the official Orbax layout through
google-deepmind's `gemma` library (which needs its own Python 3.12 environment: the test says so
and is skipped when it is absent), and the float GGUFs written for llama.cpp, which must keep the
embedded file's values (checked with the `gguf` package alone)."""

import tempfile

import numpy as np
import pytest

from experiments.peers import parity as hf_parity
from experiments.peers import deepmind
from gemma_jax import weights


@pytest.mark.slow
def test_the_official_layout_reads_in_deepmind_gemma_with_our_logits():
  python = deepmind.python_path()
  if python is None:
    pytest.skip('needs google-deepmind gemma in its own Python 3.12 environment: '
                'bash experiments/peers/setup_peer_envs.sh (or $GEMMA_PEER_PYTHON)')
  loaded = weights.load('gemma3_270m', 'embedded', 'float32')
  prompts = [loaded.tokenizer.encode(t) for t in list(hf_parity.PROMPTS.values())[:4]]
  with tempfile.TemporaryDirectory() as directory:
    files = deepmind.prepare(loaded, directory)
    rows = deepmind.logits_parity(loaded, python, prompts, files, directory)
  for row in rows:
    # Two float32 implementations (another jax, its own op order): measured 1.1-1.4e-6 of
    # max|logit|; a wrong name, layout or transpose moves logits by far more than 1e-5.
    assert row['max_abs_over_max_logit'] < 1e-5, row
    assert row['argmax_agreement'] == 1.0, row


@pytest.mark.slow
def test_a_float32_gguf_written_from_the_q4_file_keeps_its_values(tmp_path):
  # Writing and reading GGUF needs only the `gguf` package (a dependency), not llama.cpp.
  import gguf
  from experiments.peers import llama_cpp as peer
  source = weights.embedded_gguf_path()
  target = str(tmp_path / 'f32.gguf')
  peer.write_gguf(source, target, 'float32')
  ours = {t.name: np.asarray(t.data) for t in gguf.GGUFReader(target).tensors}
  for tensor in gguf.GGUFReader(source).tensors[:12]:
    want = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    np.testing.assert_array_equal(ours[tensor.name].reshape(want.shape), want)
