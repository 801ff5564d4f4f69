"""Fast smoke test for the Bazel setup (`bash .ci/bazel_test.sh`): imports and configs work."""

import pytest

from gemma_jax import config


def test_tiny_gemma3_config():
  assert config.get_config('tiny_gemma3').num_layers == 7


def test_unknown_config_raises():
  with pytest.raises(ValueError):
    config.get_config('no_such_model')
