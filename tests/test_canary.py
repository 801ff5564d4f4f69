"""The canary (graft/engine/canary.py): the spec fingerprint binds the spec version and the
canary instead of the source, and a change that moves a bit without a new spec version is
refused at build."""

import pytest

from gemma_jax import verdicts, weights
from gemma_jax.spec import SPEC_VERSION, functions, selfcheck
from graft.engine import Engine, EngineConfig, canary

MODELS = sorted(canary.MODELS.values())


@pytest.mark.parametrize('model', MODELS)
def test_the_committed_digests_are_the_interpreters(model):
  got = canary.interpreted(model, Engine, EngineConfig)
  assert got == canary.expected(SPEC_VERSION, model), f"{model}: the interpreter's digest {got}"


@pytest.mark.parametrize('model', MODELS)
def test_this_machine_computes_the_canary(model):
  assert canary.computed(model, Engine, EngineConfig) == canary.expected(SPEC_VERSION, model)


def test_the_spec_fingerprint_binds_the_canary_not_the_source():
  engine = Engine(weights.load('tiny_gemma3', 'random:0', 'float32'),
                  EngineConfig(rows_per_call=8, cache_len=64))
  fp = engine.fingerprint
  assert fp['canary'] == canary.expected(SPEC_VERSION, 'tiny_gemma3')
  assert fp['numerics']['version'] == SPEC_VERSION and fp['rope'] == 'float'
  assert 'source_sha256' not in fp
  pinned = Engine(engine.loaded, EngineConfig(mode='pinned', rows_per_call=8, cache_len=64))
  assert 'source_sha256' in pinned.fingerprint  # its bits are the compiler's: the code binds


def test_a_planted_bit_change_is_refused_by_the_canary_not_the_self_check(monkeypatch):
  # tanh's last coefficient moved by one ulp, in the functions both the engine (XLA's GELU, on
  # a family without attention's soft-cap) and the interpreter use: the self-check compares the
  # two and cannot see it (the engine is built past it: the refusal is the canary's, not a
  # SpecError); the canary does. (The native attention kernel's exp and tanh take their
  # constants from the same file, compiled in: a change there is an edit of functions.py, a new
  # kernel build, and the canary's to catch.)
  import numpy as np
  moved = float(np.nextafter(np.float32(functions.TANH_P[-1]), np.float32(1)))
  monkeypatch.setattr(functions, 'TANH_P', functions.TANH_P[:-1] + (moved,))
  monkeypatch.setattr(selfcheck, '_RESULTS', {})
  monkeypatch.setenv(verdicts.RECHECK_ENV, '1')  # a patch in memory is no edit of the files
  monkeypatch.setattr(canary, '_CHECKED', {})  # no check of this process answers for it
  loaded = weights.load('tiny_gemma3', 'random:0', 'float32')
  with pytest.raises(canary.CanaryError, match=f'spec version {SPEC_VERSION} defines.*without '
                     'a new SPEC_VERSION'):
    Engine(loaded, EngineConfig(rows_per_call=8, cache_len=64))


def test_a_spec_version_without_digests_is_refused():
  with pytest.raises(canary.CanaryError, match='spec version 99 has no canary digest'):
    canary.expected(99, 'tiny_gemma3')
