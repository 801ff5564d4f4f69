"""experiments.emulated_check: the spec's bits on an emulated CPU of another vendor.

Under QEMU (qemu-x86_64 -cpu EPYC-Rome: an AMD Zen 2 with AVX2 and FMA, no AVX-512) XLA compiles
for that CPU model and QEMU computes every float instruction in software, its reciprocal square
root estimate included. The spec engine's 1 / sqrt must give this machine's bits there, while
XLA's own rsqrt is free to differ.
"""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from experiments import emulated_check
from gemma_jax.spec.selfcheck import SKIP_UNDERFLOW_ENV as SKIP

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_the_probe_names_the_compiler_target_and_computes_the_spec_rsqrt():
  step = emulated_check.probe_step([sys.executable])
  assert step['status'] == 0, step['tail']
  probe = step['probe']
  assert probe['llvm_target_cpu'], 'no target CPU in the dumped topology'
  assert probe['spec_rsqrt_is_the_spec']
  assert len(probe['xla_rsqrt_sha256']) == 64


def test_an_emulated_amd_cpu_computes_the_same_spec_bits():
  if not shutil.which('qemu-x86_64'):
    pytest.skip('qemu-x86_64 is not installed (apt-get install qemu-user)')
  here = emulated_check.probe_step([sys.executable])['probe']
  step = emulated_check.probe_step(['qemu-x86_64', '-cpu', 'EPYC-Rome', sys.executable])
  assert step['status'] == 0, step['tail']
  there = step['probe']
  assert there['llvm_target_cpu'] == 'znver2' and not there['avx512']
  assert there['spec_rsqrt_is_the_spec']
  assert there['spec_rsqrt_sha256'] == here['spec_rsqrt_sha256']
  # At the flush-to-zero edge this CPU keeps the product that rounds up to 2^-126, as the spec
  # does; QEMU's software floating point flushes it (before rounding), so the emulated
  # processes of these checks skip that one probe (selfcheck.SKIP_UNDERFLOW_ENV).
  assert here['underflow_edge_failures'] == []
  assert [f.split(':')[1].strip() for f in there['underflow_edge_failures']] == [
      'product', 'contraction chain']


def test_an_emulated_amd_cpu_computes_this_machines_bits_of_a_model(tmp_path):
  # On the native kernels, whose AVX2 path the emulated EPYC-Rome runs (XLA's Eigen dots are
  # not FMA chains on AVX2 without AVX-512: docs/determinism.md), tiny_gemma3_wide with its
  # chained projections: the interpreter's bits there, and the same digest as here.
  if not shutil.which('qemu-x86_64'):
    pytest.skip('qemu-x86_64 is not installed (apt-get install qemu-user)')
  summaries = []
  for prefix, extra in ((['qemu-x86_64', '-cpu', 'EPYC-Rome'], {SKIP: '1'}), ([], {})):
    output = tmp_path / f'check{len(summaries)}.json'
    result = subprocess.run(
        [*prefix, sys.executable, '-m', 'experiments.spec_check', '--model=tiny_gemma3_wide',
         '--weights=random:0', '--tokens=24', '--rows_per_call=16', '--cache_len=256',
         '--dot_library=native', f'--output={output}'],
        cwd=REPO, capture_output=True, text=True, timeout=1800,
        env={**os.environ, 'PYTHONPATH': str(REPO), **extra})
    assert result.returncode == 0, result.stderr[-2000:]
    summaries.append(json.loads(output.read_text())['summary'])
  emulated, native = summaries
  assert emulated['kv_equal'] and emulated['logits_equal'], emulated
  assert emulated['sha256'] == native['sha256']


def test_random_weights_and_draws_hash_the_same_on_an_emulated_cpu_without_fma():
  """Under QEMU as an Intel SandyBridge (AVX, no FMA: jax.random.normal's inverse error
  function compiled there gave other random:0 weights), random:0 weights and sampled draws
  hash as here (gemma_jax.seeded, gemma_jax.sampling: integers and the spec's exp)."""
  if not shutil.which('qemu-x86_64'):
    pytest.skip('qemu-x86_64 is not installed (apt-get install qemu-user)')
  script = ('import json; from experiments import emulated_check as e; from gemma_jax import '
            "weights; print(json.dumps([weights.load('tiny_gemma3', 'random:0').params_sha256, "
            'e.sampling_digest()]))')
  runs = []
  for prefix in (['qemu-x86_64', '-cpu', 'SandyBridge'], []):
    result = subprocess.run([*prefix, sys.executable, '-c', script], cwd=REPO,
                            capture_output=True, text=True, timeout=1200,
                            env={**os.environ, 'PYTHONPATH': str(REPO)})
    assert result.returncode == 0, result.stderr[-2000:]
    runs.append(json.loads(result.stdout.strip().splitlines()[-1]))
  emulated, native = runs
  assert emulated == native
  assert native[0] == 'b2c7eb9b2c7b261ae871b9ed7d1e142a2bbd7a37f06fa94d9ef888c18b430b64'


def test_a_missing_emulator_is_one_line_and_writes_nothing(tmp_path):
  output = tmp_path / 'emulated.json'
  result = subprocess.run(
      [sys.executable, '-m', 'experiments.emulated_check', '--qemu=no-such-emulator',
       f'--output={output}'], cwd=REPO, capture_output=True, text=True, timeout=120,
      env={**os.environ, 'PYTHONPATH': str(REPO)})
  assert result.returncode == 2
  assert result.stderr.strip().splitlines()[-1] == (
      'error: --qemu=no-such-emulator: not found (apt-get install qemu-user)')
  assert not output.exists()
