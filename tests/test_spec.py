"""The written arithmetic (gemma_jax/spec, docs/determinism.md): its binary32 operations are
exact, the engine computes what the NumPy interpreter computes on every family, the self-check
refuses a machine that does not, and the fingerprint binds the spec, not the machine.

Equality is equality of raw bits (int32 views), never a tolerance.
"""

import dataclasses
import fractions
import json
import os
import pathlib
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma_jax import verdicts, weights
from gemma_jax.config import get_config
from gemma_jax.numerics import SPEC, Spec
from gemma_jax.spec import binary32 as b32
from gemma_jax.spec import functions as fn
from gemma_jax.spec import selfcheck
from graft.engine import spec_check
from graft.engine import Engine, EngineConfig, fingerprint
from graft.store import artifact

REPO = pathlib.Path(__file__).resolve().parents[1]
EIGEN = {'xla_cpu_experimental_ynn_fusion_type': ''}
# Small tiles and calls, so that 100 tokens wrap a local ring of 32 slots on the tiny configs.
SMALL = EngineConfig(mode='spec', rows_per_call=16, attention_tile=16, cache_len=128)
# The same on XLA's own dots (Eigen), which are FMA chains on this project's AVX-512 machines.
SMALL_EIGEN = dataclasses.replace(SMALL, dot_library='eigen')


def bits(x):
  return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.int32)


def nearest_binary32(exact: fractions.Fraction) -> np.float32:
  """The binary32 nearest to an exact rational, ties to even (no flush: tests avoid tiny values)."""
  guess = np.float32(float(exact))
  candidates = [np.nextafter(guess, np.float32(-np.inf)), guess,
                np.nextafter(guess, np.float32(np.inf))]
  return min(candidates, key=lambda c: (abs(fractions.Fraction(float(c)) - exact),
                                        int(np.asarray(c).view(np.int32)) & 1))


def test_fma_is_rounded_once_including_binary32_midpoints():
  rng = np.random.default_rng(0)
  a = rng.standard_normal(3000).astype(np.float32)
  b = rng.standard_normal(3000).astype(np.float32)
  c = rng.standard_normal(3000).astype(np.float32)
  # Cases where the binary64 sum lands exactly on a binary32 midpoint: c = 1 and a b = 2^-24 +
  # m 2^-71 (A B = 2^47 + m for 24-bit integers A, B): binary64 drops the m 2^-71 tail, leaving
  # 1 + 2^-24, half an ulp of 1, while the exact sum lies above it (and below it for - m).
  for i, sign in enumerate((1, -1)):
    big = next(x for x in range(2 ** 23 + 12345, 2 ** 24)
               if 0 < sign * (x * -(-2 ** 47 // x) if sign > 0 else x * (2 ** 47 // x)) - sign * 2 ** 47 < 2 ** 18)
    other = -(-2 ** 47 // big) if sign > 0 else 2 ** 47 // big
    a[4 * i:4 * i + 4] = np.float32(big * 2.0 ** -23)
    b[4 * i:4 * i + 4] = np.float32(other * 2.0 ** -48)
    c[4 * i:4 * i + 4] = np.float32(1.0)
  got = b32.fma(a, b, c)
  want = np.array([nearest_binary32(fractions.Fraction(float(x)) * fractions.Fraction(float(y))
                                    + fractions.Fraction(float(z))) for x, y, z in zip(a, b, c)],
                  np.float32)
  assert np.array_equal(bits(got), bits(want))
  assert got[0] == np.float32(1 + 2 ** -23) and got[4] == np.float32(1.0)  # above / below
  # binary64 arithmetic alone rounds the midpoint case twice, the wrong way: the test can fail.
  naive = (a.astype(np.float64) * b + c).astype(np.float32)
  assert not np.array_equal(bits(naive[:4]), bits(want[:4]))


def test_operations_flush_subnormal_results_as_xla_cpu_does():
  tiny = np.float32(1e-20)
  assert b32.OPS.mul(tiny, tiny) == 0 and np.asarray(jax.jit(jnp.multiply)(tiny, tiny)) == 0
  assert np.signbit(b32.OPS.mul(-tiny, tiny))
  assert b32.dot(np.full((1, 4), 1e-20, np.float32), np.full((4, 1), 1e-20, np.float32)) == 0


@pytest.mark.parametrize('name', ['exp', 'tanh', 'gelu', 'rsqrt', 'sin_cos', 'softcap'])
def test_each_function_has_the_same_bits_through_xla_and_numpy(name):
  x = np.concatenate([np.random.default_rng(1).standard_normal(5000).astype(np.float32) * s
                      for s in (0.1, 3.0, 50.0)])
  arg = {'exp': -np.abs(x), 'rsqrt': np.abs(x) + np.float32(1e-3),
         'sin_cos': np.abs(x) * np.float32(100)}.get(name, x)
  f = {'softcap': lambda o, v: fn.softcap(o, v, 30.0)}.get(name, getattr(fn, name))
  got = jax.jit(lambda v, z: f(SPEC.with_zero(z)._ops(), v), compiler_options=EIGEN)(
      arg, jnp.uint32(0))
  want = f(b32.OPS, arg)
  for g, w in zip(*(t if isinstance(t, tuple) else (t,) for t in (got, want))):
    assert np.array_equal(bits(g), bits(w))


def test_functions_are_close_to_the_mathematical_ones():
  # Accuracy is not what makes bits equal, but the model must stay the model: stated bounds.
  x = np.linspace(-20, 20, 4001, dtype=np.float32)
  x64 = x.astype(np.float64)
  assert np.max(np.abs(fn.exp(b32.OPS, -np.abs(x)) / np.exp(-np.abs(x64)) - 1)) < 2e-7
  assert np.max(np.abs(fn.tanh(b32.OPS, x) - np.tanh(x64))) < 1e-7
  angles = np.linspace(0, 30000, 100001, dtype=np.float32)
  sin, cos = fn.sin_cos(b32.OPS, angles)
  assert np.max(np.abs(sin - np.sin(angles.astype(np.float64)))) < 2e-7
  assert np.max(np.abs(cos - np.cos(angles.astype(np.float64)))) < 2e-7
  inverse = fn.inverse_frequencies(256, 10_000.0)
  exact = 10_000.0 ** (-np.arange(0, 256, 2) / 256)
  assert np.max(np.abs(inverse / exact - 1)) <= 2 ** -24  # correctly rounded: half an ulp


@pytest.mark.parametrize('rope_mode', ['float', 'relative'])
@pytest.mark.parametrize('name', ['tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4', 'tiny_gemma3_wide'])
def test_the_spec_engine_computes_what_the_interpreter_computes(name, rope_mode):
  config = get_config(name).replace(rope_mode=rope_mode)
  engine = Engine(weights.load(config, 'random:0', 'float32'), SMALL)
  assert engine.engine_config.dot_library == 'native'  # the default where g++ is found
  tokens = [int(t) for t in np.random.default_rng(2).integers(3, 512, 100)]
  result = spec_check.run(engine, tokens, splits=[1, 17, 50])
  summary = result['summary']
  assert (summary['tokens'], summary['kv_equal'], summary['logits_equal'],
          summary['first_difference']) == (100, True, True, None), result


def test_a_difference_is_found_and_named(monkeypatch):
  engine = Engine(weights.load('tiny_gemma3', 'random:0', 'float32'), SMALL)
  tokens = [int(t) for t in np.random.default_rng(3).integers(3, 512, 40)]
  original = fn.gelu

  def planted(o, x):  # the interpreter's GELU one ulp up: the engine no longer matches it
    y = original(o, x)
    return np.nextafter(y, np.float32(np.inf)) if isinstance(o, b32.Ops) else y

  monkeypatch.setattr(fn, 'gelu', planted)
  summary = spec_check.run(engine, tokens, splits=[20])['summary']
  assert not summary['kv_equal'] and not summary['logits_equal']
  # Layer 0's MLP first feeds layer 1's K and V: that is where the bits part (at the first
  # token whose one-ulp change survives the rounding of what follows).
  first = summary['first_difference']
  assert (first['run'], first['layer'], first['op']) == ('one-shot', 1, 'k')
  assert 0 <= first['position'] < 40


def test_a_global_layer_is_compared_from_its_first_token(monkeypatch):
  """A global layer's K is compared over every token, not only the local ring's last rows: a
  one-bit difference planted in the interpreter's first row of one is found there."""
  from gemma_jax.spec.interpreter import Interpreter
  engine = Engine(weights.load('tiny_gemma3', 'random:0', 'float32'), SMALL)
  tokens = [int(t) for t in np.random.default_rng(4).integers(3, 512, 3 * engine.local_slots)]
  j, layer = next((j, layer) for j, layer in enumerate(engine.model_config.cache_layers)
                  if engine.model_config.layer_spec(layer).window is None)
  original = Interpreter.run

  def planted(self, *args, **kwargs):
    out = original(self, *args, **kwargs)
    k = np.array(out.k[j], np.float32)
    k.view(np.int32).reshape(len(k), -1)[0, 0] ^= 1
    out.k[j] = k
    return out

  monkeypatch.setattr(Interpreter, 'run', planted)
  summary = spec_check.run(engine, tokens, splits=[20])['summary']
  assert summary['first_difference'] == {'run': 'one-shot', 'layer': layer, 'op': 'k',
                                         'position': 0}



@pytest.fixture(autouse=True)
def run_every_check(monkeypatch):
  """Checks are run, never answered by a verdict kept from another process: several tests here
  plant a difference in memory, which is no edit of the files the verdicts are keyed by
  (gemma_jax/verdicts.py)."""
  monkeypatch.setenv(verdicts.RECHECK_ENV, '1')

def test_the_self_check_refuses_a_machine_whose_function_differs(monkeypatch):
  from gemma_jax import numerics
  monkeypatch.setattr(numerics._SpecOps, 'floor', staticmethod(jnp.round))  # another rounding
  selfcheck._RESULTS.clear()
  with pytest.raises(selfcheck.SpecError, match='elementwise exp'):
    selfcheck.run(Spec(k_chunk=256), EIGEN, weights=dict, weights_key='none', rows=(1,),
                  head_rows=(), attention_rows=(), head_dims=(), tile=16, kv_heads=1)
  selfcheck._RESULTS.clear()


def test_the_self_check_refuses_a_flush_before_rounding(monkeypatch):
  """Arm's flush-to-zero decides tininess before rounding (docs/determinism.md): a product
  that rounds up to 2^-126 from below is flushed there. Here both the engine's multiply and its
  contraction chains keep it, as the spec does; a multiply planted to flush it is refused."""
  from gemma_jax import numerics
  spec = Spec(k_chunk=256)
  assert selfcheck.underflow_failures(spec, EIGEN) == []
  mul = numerics._SpecOps.mul
  monkeypatch.setattr(numerics._SpecOps, 'mul', lambda self, a, b: (lambda r: jnp.where(
      jnp.abs(r) <= np.float32(2 ** -126), r * 0, r))(mul(self, a, b)))
  assert selfcheck.underflow_failures(spec, EIGEN) == [
      'underflow edge: product: 100.0% of the checked outputs differ from the spec']


def test_the_self_check_catches_a_dot_of_another_order(monkeypatch):
  w = jnp.asarray(np.random.default_rng(4).standard_normal((256, 512)).astype(np.float32))
  reversed_chain = lambda self, x, w: x[:, ::-1] @ w[::-1] if x.shape[0] > 1 else x @ w  # noqa
  monkeypatch.setattr(Spec, 'matmul', reversed_chain)
  selfcheck._RESULTS.clear()
  with pytest.raises(selfcheck.SpecError, match=r'matmul w \[8, 256\]') as refused:
    selfcheck.run(Spec(k_chunk=256), EIGEN, weights=lambda: {'w': w}, weights_key='w',
                  rows=(1, 8), head_rows=(), attention_rows=(), head_dims=(), tile=16, kv_heads=1)
  assert 'matmul w [1, 256]' not in str(refused.value)  # the one-row probe kept the order
  selfcheck._RESULTS.clear()


def test_a_recorded_pass_is_found_without_building_the_weights(monkeypatch, tmp_path):
  """A warm start skips the self-check on a pass kept from an earlier process, and so never
  builds the weights it would probe (which asks the model's structure, and imports Flax): the
  verdict is keyed by what decides them (`weights_key`), not by the weights."""
  monkeypatch.delenv(verdicts.RECHECK_ENV)
  monkeypatch.setenv(verdicts.DIRECTORY_ENV, str(tmp_path))
  w = jnp.asarray(np.random.default_rng(5).standard_normal((256, 512)).astype(np.float32))
  built = []
  def weights():
    built.append(1)
    return {'w': w}
  check = lambda: selfcheck.run(Spec(k_chunk=256), EIGEN, weights=weights,  # noqa: E731
                                weights_key=('w', 256, 512), rows=(1, 8), head_rows=(),
                                attention_rows=(), head_dims=(), tile=16, kv_heads=1)
  selfcheck._RESULTS.clear()
  check()
  assert built == [1]  # run, and its pass recorded
  selfcheck._RESULTS.clear()  # as in a new process
  check()
  assert built == [1]  # found: the weights were not built again


@pytest.mark.parametrize('m', [1, 8, 40])
def test_the_eigen_fallback_computes_the_interpreters_chained_projection(m):
  """--dot_library=eigen, what a machine without a C++ compiler runs: a projection over more
  terms than one chunk (1024 terms, four chunks of 256) is XLA's own dot per chunk, the chunk
  results added in chunk order, bit for bit the interpreter's (the tiny configs' projections
  are too small to be chunked, so the engine tests never cross this)."""
  k, n = 1024, 160
  spec = Spec(k_chunk=256)  # dot=None: XLA's own dots
  assert k * n > spec.small and spec.chunk(k) == 256
  rng = np.random.default_rng(m)
  x = rng.standard_normal((m, k)).astype(np.float32)
  w = (rng.standard_normal((k, n)) / 16).astype(np.float32)
  got = jax.jit(spec.matmul, compiler_options=EIGEN)(x, w)
  want = b32.matmul(x, w, k_chunk=spec.k_chunk, small=spec.small)
  assert np.array_equal(bits(got), bits(want)), f'{np.mean(bits(got) != bits(want)):.1%} differ'


def test_a_refused_engine_names_the_spec_dot_kernel(monkeypatch):
  # An engine refused for its dots (here: attention's scores summed in reverse) says what
  # computes them as FMA chains by construction.
  reversed_scores = lambda self, q, k: jnp.einsum('bkrh,bkjsh->bkjrs', q[..., ::-1],  # noqa
                                                  k[..., ::-1])
  monkeypatch.setattr(Spec, 'tile_scores', reversed_scores)
  selfcheck._RESULTS.clear()
  with pytest.raises(selfcheck.SpecError, match=r'attention .*--dot_library=native computes'):
    Engine(weights.load('tiny_gemma3', 'random:0', 'float32'), SMALL_EIGEN)
  selfcheck._RESULTS.clear()


def test_a_spec_manifest_replays_on_this_machines_kernels_whatever_dots_made_it(monkeypatch,
                                                                                 tmp_path):
  # A manifest made on XLA's dots (Eigen); then XLA's attention dots made to differ from the
  # spec (the native kernels' path left as it is): replay() runs on the native kernels, as it
  # would anyway (the dot library decides no bit), and reproduces it.
  from graft import exactness, replay
  from gemma_jax import numerics
  loaded = weights.load('tiny_gemma3', 'random:0', 'float32')
  made = Engine(loaded, SMALL_EIGEN)
  rng = np.random.default_rng(9)
  library, query = ([int(t) for t in rng.integers(3, 512, n)] for n in (40, 5))
  row = exactness.check_sample(made, exactness.artifact_graft(made, made, str(tmp_path / 'a')),
                               library, query, continuation_tokens=4)
  manifest = {'kind': 'graft_exactness',
              'config': {'model': 'tiny_gemma3', 'weights': 'random:0', 'dtype': 'float32',
                         'engine_config': dataclasses.asdict(made.engine_config),
                         'continuation_tokens': 4},
              'engine_fingerprint': made.fingerprint, 'model_fingerprint': made.model_fingerprint,
              'samples': [{'library': library, 'query': query,
                           **{h: row[h] for h in replay.HASHES}}]}
  tile_scores = Spec.tile_scores
  monkeypatch.setattr(Spec, 'tile_scores', lambda self, q, k: tile_scores(
      self, q[..., ::-1], k[..., ::-1]) if self.kernel is None else tile_scores(self, q, k))
  selfcheck._RESULTS.clear()
  engine, writer = replay._engine(manifest)
  assert engine.engine_config.dot_library == writer.engine_config.dot_library == 'native'
  assert replay.replay(manifest) == []  # every hash reproduced
  with pytest.raises(selfcheck.SpecError, match='attention scores'):
    replay._engine(manifest, dot_library='eigen')  # a library asked for is not replaced
  # A machine that does not compute the spec (another rounding of floor, which exp's range
  # reduction uses) is refused on the native kernels too, naming the function.
  monkeypatch.setattr(numerics._SpecOps, 'floor', staticmethod(jnp.round))
  selfcheck._RESULTS.clear()
  with pytest.raises(selfcheck.SpecError, match='elementwise exp'):
    replay.replay(manifest)
  selfcheck._RESULTS.clear()


def test_the_fingerprint_binds_the_spec_not_the_machine(monkeypatch):
  loaded = weights.load('tiny_gemma3', 'random:0', 'float32')
  spec = Engine(loaded, SMALL)
  pinned = Engine(loaded, EngineConfig(mode='pinned', rows_per_call=16, cache_len=512))
  before = spec.fingerprint['sha256'], pinned.fingerprint['sha256']
  other = {**fingerprint.environment(), 'cpu_model': 'AuthenticAMD/25/17', 'jax': '0.0.0'}
  monkeypatch.setattr(fingerprint, 'environment', lambda: other)
  after = (Engine(loaded, SMALL).fingerprint['sha256'],
           Engine(loaded, EngineConfig(mode='pinned', rows_per_call=16,
                                       cache_len=512)).fingerprint['sha256'])
  assert after[0] == before[0] and after[1] != before[1]
  assert 'cache_len' not in str(spec.fingerprint) and 'cpu_model' not in {
      k for k in spec.fingerprint if k != 'made_on'}


def test_cache_length_decides_no_bit_so_an_artifact_moves_between_them(tmp_path):
  loaded = weights.load('tiny_gemma4', 'random:0', 'float32')
  small, large = (Engine(loaded, EngineConfig(mode='spec', rows_per_call=16, attention_tile=16,
                                              cache_len=n)) for n in (128, 512))
  tokens = [int(t) for t in np.random.default_rng(5).integers(3, 512, 90)]
  _, a = small.prefill(tokens, logits='all')
  _, b = large.prefill(tokens, logits='all')
  assert np.array_equal(bits(a), bits(b))
  library, _ = large.prefill(tokens[:60], logits='none')
  artifact.save(str(tmp_path / 'a'), large, library)
  grafted = artifact.graft(small, artifact.load(str(tmp_path / 'a'), small))
  _, c = small.extend(grafted, tokens[60:], logits='all')
  assert np.array_equal(bits(c), bits(a[60:]))


# Process configurations in which the spec engine, on its own kernels, must compute the
# interpreter's bits: more host devices than cores (XLA's thread pool grows with them), XLA's
# code for an AVX2 machine and for one without FMA (the kernels' avx2 and portable paths), and
# one core.
CONFIGURATIONS = {
    '8 host devices': ({'XLA_FLAGS': '--xla_force_host_platform_device_count=8'}, []),
    'AVX2': ({'XLA_FLAGS': '--xla_cpu_max_isa=AVX2'}, []),
    'SSE4.2, no FMA': ({'XLA_FLAGS': '--xla_cpu_max_isa=SSE4_2'}, []),
    'one core': ({}, ['taskset', '-c', '0']),
}


@pytest.mark.parametrize('configuration', list(CONFIGURATIONS))
def test_spec_check_passes_in_every_configuration(tmp_path, configuration):
  """The self-check and the whole model against the interpreter, on the config whose dots are
  chains (tiny_gemma3_wide), in a process of each configuration: every one must pass."""
  env, prefix = CONFIGURATIONS[configuration]
  output = tmp_path / 'check.json'
  result = subprocess.run(
      [*prefix, sys.executable, '-m', 'experiments.spec_check', '--model=tiny_gemma3_wide',
       '--weights=random:0', '--tokens=60', '--rows_per_call=16', '--cache_len=256',
       f'--output={output}'],
      cwd=REPO, env={**os.environ, 'PYTHONPATH': str(REPO), 'XLA_FLAGS': '', **env},
      capture_output=True, text=True, timeout=900)
  assert result.returncode == 0, result.stderr[-2000:]
  record = json.loads(output.read_text())
  assert record['config']['engine_config']['dot_library'] == 'native'
  assert record['summary']['kv_equal'] and record['summary']['logits_equal'], record['summary']


@pytest.mark.slow
def test_the_embedded_270m_computes_what_the_interpreter_computes():
  # The CI manifest's engine configuration (tests/test_replay_manifest.py): the same executables.
  engine = Engine(weights.load('gemma3_270m', 'embedded', 'float32'),
                  EngineConfig(mode='spec', cache_len=2560))
  tokens = weights.load('gemma3_270m', 'embedded', 'float32').tokenizer.encode(
      'The written arithmetic defines every bit: ' * 12)[:40]
  result = spec_check.run(engine, tokens, splits=[17])
  assert result['summary']['kv_equal'] and result['summary']['logits_equal'], result
