"""Passed checks kept across processes (gemma_jax/verdicts.py): an edit, another steering
variable or GEMMA_JAX_RECHECK is never served an old verdict, and a failure is never kept."""

import shutil

import pytest

from gemma_jax import verdicts
from gemma_jax.spec import selfcheck


@pytest.fixture
def cache(tmp_path, monkeypatch):
  monkeypatch.setenv('GEMMA_JAX_CACHE', str(tmp_path / 'cache'))
  monkeypatch.delenv(verdicts.RECHECK_ENV, raising=False)
  return tmp_path / 'cache' / 'verdicts'


def test_a_pass_is_kept_for_the_same_process_configuration_only(cache, monkeypatch):
  assert not verdicts.passed('probe', 'k')
  verdicts.record('probe', 'k')
  assert verdicts.passed('probe', 'k') and len(list(cache.iterdir())) == 1
  assert not verdicts.passed('probe', 'another key')
  assert not verdicts.passed('another check', 'k')
  monkeypatch.setenv('GEMMA_JAX_NATIVE_ISA', 'portable')  # steers the kernels
  assert not verdicts.passed('probe', 'k')
  monkeypatch.delenv('GEMMA_JAX_NATIVE_ISA')
  monkeypatch.setenv(verdicts.RECHECK_ENV, '1')
  assert not verdicts.passed('probe', 'k')


def test_an_edit_of_the_code_is_never_served_an_old_verdict(cache, tmp_path, monkeypatch):
  tree = tmp_path / 'tree'
  for top in verdicts._CODE:
    source = verdicts._ROOT + '/' + top
    (shutil.copy if top.endswith('.py') else shutil.copytree)(
        source, tree / top, **({} if top.endswith('.py') else
                               {'ignore': shutil.ignore_patterns('__pycache__')}))
  monkeypatch.setattr(verdicts, '_ROOT', str(tree))
  verdicts.code_digest.cache_clear()
  try:
    verdicts.record('probe', 'k')
    assert verdicts.passed('probe', 'k')
    functions = tree / 'gemma_jax' / 'spec' / 'functions.py'
    functions.write_text(functions.read_text().replace('EXP_LO, EXP_HI = -87.0, 88.0',
                                                       'EXP_LO, EXP_HI = -87.0, 88.5'))
    verdicts.code_digest.cache_clear()
    assert not verdicts.passed('probe', 'k')
  finally:
    verdicts.code_digest.cache_clear()


def test_a_failure_is_never_kept(cache, monkeypatch):
  monkeypatch.setattr(selfcheck, '_RESULTS', {})
  assert selfcheck._cached(('a probe',), lambda: ['exp: 3% differ']) == ['exp: 3% differ']
  assert not cache.exists() or not list(cache.iterdir())
  monkeypatch.setattr(selfcheck, '_RESULTS', {})
  assert selfcheck._cached(('a probe',), lambda: []) == []
  monkeypatch.setattr(selfcheck, '_RESULTS', {})
  # The kept pass answers without running the probe again.
  assert selfcheck._cached(('a probe',), lambda: pytest.fail('ran again')) == []
