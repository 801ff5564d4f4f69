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


def other_layer(x, w):
  return jnp.tanh(x @ w) - 1.0


def test_a_traced_run_is_joined_to_its_module_and_counts_every_dot(tmp_path):
  # Two programs whose dots differ in size: each thunk must be read against its own program's
  # module (joined on the program id), or the FLOPs come out wrong.
  fns = {'jit_layer': (jax.jit(layer), jnp.ones((M, K)), jnp.ones((K, N))),
         'jit_other_layer': (jax.jit(other_layer), jnp.ones((M, K)), jnp.ones((K, 2 * N)))}
  texts = {name: fn.lower(x, w).compile().as_text() for name, (fn, x, w) in fns.items()}
  for fn, x, w in fns.values():
    fn(x, w).block_until_ready()
  calls = {'jit_layer': 3, 'jit_other_layer': 1}  # unequal, so a swapped join shows
  with jax.profiler.trace(str(tmp_path)):
    for name, (fn, x, w) in fns.items():
      for _ in range(calls[name]):
        fn(x, w).block_until_ready()
  thunks = [t for t in profile.read_trace(str(tmp_path)) if t.module in fns]
  programs = {t.program: t.module for t in thunks}
  assert sorted(programs.values()) == sorted(fns)  # one program id each
  modules = {program: profile.read_module(texts[name]) for program, name in programs.items()}
  summary = profile.summarize(thunks, modules, wall_seconds=1.0, matmul_gflops=1.0)
  assert summary['unattributed_s'] == 0.0
  assert summary['dot_flops'] == 2 * M * K * (3 * N + 1 * 2 * N)
  swapped = dict(zip(modules, reversed(list(modules.values()))))  # the join done wrong
  assert profile.summarize(thunks, swapped, wall_seconds=1.0,
                           matmul_gflops=1.0)['dot_flops'] != summary['dot_flops']
  assert summary['dot_s'] > 0 and summary['thunk_s'] >= summary['dot_s']
  assert summary['by_component'][0]['component'] == 'outside the model'  # not model code


def test_the_profile_experiment_attributes_prefill_and_decode_to_the_model(tmp_path):
  out = tmp_path / 'profile.json'
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.profile', '--model=tiny_gemma3_wide',
       '--weights=random:0', '--engine=spec', '--prompt_tokens=48',
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
  # A prefill's dots run at least the model's dense FLOPs (the spec engine pads rows, and
  # tiny_gemma3_wide computes every projection as a dot: it has none below the pairwise-tree
  # threshold).
  assert result['prefill']['dot_flops'] >= result['prefill']['model_flops']
