"""The op-by-op profile (analysis/profile.py, experiments.profile): XLA:CPU's thunk events joined
to the optimized HLO, each op's kind, FLOPs and the Python code that made it."""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp

from analysis import profile
from tests.test_experiments import REPO, TINY

M, K, N = 64, 256, 512


def projection(x, w):
  return jnp.tanh(x @ w)


def layer(x, w):
  return projection(x, w) * 2.0


def test_a_dot_is_read_with_its_flops_and_the_stack_that_made_it():
  compiled = jax.jit(layer).lower(jnp.ones((M, K)), jnp.ones((K, N))).compile()
  ops = profile.read_module(compiled.as_text())
  dots = [op for op in ops.values() if op.kind == 'dot']
  assert dots and all(op.flops == 2 * M * K * N for op in dots)
  # Innermost first, each frame's caller next: the printer's parent ids are read right.
  stack = dots[0].stack
  assert stack[:2] == ('test_profile.py:projection', 'test_profile.py:layer'), stack
  assert not any(op.flops for op in ops.values() if op.kind != 'dot')


def test_a_traced_run_is_joined_to_its_module_and_counts_every_dot(tmp_path):
  fn = jax.jit(layer)
  x, w = jnp.ones((M, K)), jnp.ones((K, N))
  text = fn.lower(x, w).compile().as_text()
  fn(x, w).block_until_ready()
  calls = 3
  with jax.profiler.trace(str(tmp_path)):
    for _ in range(calls):
      fn(x, w).block_until_ready()
  thunks = [t for t in profile.read_trace(str(tmp_path)) if t.module == 'jit_layer']
  assert thunks
  modules = {t.program: profile.read_module(text) for t in thunks}
  summary = profile.summarize(thunks, modules, wall_seconds=1.0, matmul_gflops=1.0)
  assert summary['unattributed_s'] == 0.0
  assert summary['dot_flops'] == calls * 2 * M * K * N
  assert summary['dot_s'] > 0 and summary['thunk_s'] >= summary['dot_s']
  assert summary['by_component'][0]['component'] == 'outside the model'  # not model code


def test_the_profile_experiment_attributes_prefill_and_decode_to_the_model(tmp_path):
  out = tmp_path / 'profile.json'
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.profile', *TINY, '--engine=spec', '--prompt_tokens=48',
       '--decode_tokens=3', '--repeats=1', f'--output={out}'],
      cwd=REPO, env={**os.environ, 'PYTHONPATH': str(REPO)}, capture_output=True, text=True,
      timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads(out.read_text())
  assert result['schema'] == 'profile/1'
  for phase in ('prefill', 'decode'):
    summary = result[phase]
    assert summary['thunks'] > 0 and summary['unattributed_s'] == 0.0, summary
    assert summary['dot_flops'] > 0 and 0 < summary['dot_share'] <= 1
    components = {row['component'] for row in summary['by_component']}
    assert any('Attention' in c or 'attn' in c for c in components), components
  # A prefill's dots run at least the model's dense FLOPs (the spec engine pads rows).
  assert result['prefill']['dot_flops'] >= result['prefill']['model_flops'] * 0.5
