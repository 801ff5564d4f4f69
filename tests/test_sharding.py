"""Tensor-parallel placement: a sharded model computes what the single-device one does."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
from jax.sharding import PartitionSpec as P

from gemma_jax.sharding import partition_spec

REPO = pathlib.Path(__file__).resolve().parents[1]


def test_partition_specs_split_columns_rows_and_vocabulary():
  assert partition_spec('layers/0/attn/q_proj/w', (640, 4, 256), 2) == P(None, None, 'model')
  assert partition_spec('layers/0/attn/o_proj/w', (4, 256, 640), 2) == P('model', None, None)
  assert partition_spec('layers/0/mlp/down_proj/w', (2048, 640), 2) == P('model', None)
  assert partition_spec('embedder/input_embedding', (262144, 640), 2) == P('model', None)
  assert partition_spec('layers/0/pre_attention_norm/scale', (640,), 2) == P()
  assert partition_spec('layers/0/attn/q_proj/w', (640, 4, 255), 2) == P()  # uneven: whole
  # The gather layout never splits a contraction: row-parallel weights by their outputs.
  gather = lambda name, shape: partition_spec(name, shape, 2, 'gather')
  assert gather('layers/0/attn/o_proj/w', (4, 256, 640)) == P(None, None, 'model')
  assert gather('layers/0/mlp/down_proj/w', (2048, 640)) == P(None, 'model')
  assert gather('layers/0/attn/q_proj/w', (640, 4, 256)) == P(None, None, 'model')
  assert gather('embedder/input_embedding', (262144, 640)) == P()  # the output table's own


SCRIPT = '''
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh
from gemma_jax import config, kv_state, model
from gemma_jax.sharding import shard_params
assert jax.device_count() == 2
cfg = config.get_config('tiny_gemma3')
params = model.init_params(cfg, 0)
tokens = jnp.asarray(np.random.default_rng(0).integers(3, 512, (1, 24)), jnp.int32)
positions = jnp.arange(24)[None]
def logits(p):
  kv = kv_state.init_kv_state(cfg, batch_size=1, cache_len=64, dtype=jnp.float32)
  hidden, _ = model.forward(p, cfg, tokens, positions, kv)
  return model.compute_logits(p, cfg, hidden)
single = jax.jit(logits)(params)
sharded_params = shard_params(params, Mesh(np.array(jax.devices()), ('model',)))
q = sharded_params['layers'][0]['attn']['q_proj']['w']
assert len(q.sharding.device_set) == 2
sharded = jax.jit(logits)(sharded_params)
print('RELATIVE', float(jnp.max(jnp.abs(sharded - single)) / jnp.max(jnp.abs(single))))
'''


def test_two_device_tensor_parallel_forward_matches_one_device():
  # Two host CPU devices stand in for accelerators. Split reductions round differently, so
  # this is a closeness test: 1e-5 of the largest logit (float32; measured ~1e-7).
  env = {**os.environ, 'PYTHONPATH': str(REPO),
         'XLA_FLAGS': '--xla_force_host_platform_device_count=2'}
  out = subprocess.run([sys.executable, '-c', SCRIPT], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=600)
  assert out.returncode == 0, out.stderr[-2000:]
  relative = float(out.stdout.split('RELATIVE')[1])
  assert relative <= 1e-5


def test_every_engine_grafts_exactly_on_every_mesh_and_the_device_check_says_so():
  # experiments.device_check's mesh step (run on a host of several devices), here on
  # tiny_gemma3 over one device and model:2 (two host CPU devices stand in for accelerators):
  # experiments.mesh_exactness of the pinned engine in both layouts and of the spec engine.
  # Within every mesh an own-position graft is SHA-256 equal to fresh. Across device counts
  # only the 'gather' layout can keep bits: measured on tiny_gemma3 at two devices, it keeps the
  # one-device bits. The pinned engine's fingerprint binds its mesh: a one-device artifact is
  # refused on two; the spec engine's binds the arithmetic, not the mesh: its one-device
  # artifacts are accepted on model:2 and their grafts are SHA-256 equal to that mesh's fresh
  # logits. (One run of the step for what were two tests, each running the pinned engine's.)
  from experiments import device_check
  assert [device_check.mesh_plan(n) for n in (1, 2, 3, 4, 7, 8, 16)] == [
      None, 'model:2', 'model:2', 'model:4', 'model:4', 'model:8', 'model:8']
  steps = device_check.mesh_steps('model:2', 3, ('--model=tiny_gemma3', '--weights=random:0',
                                                 '--cache_len=2304'))
  assert device_check.mesh_exact(steps), steps
  pinned = steps['mesh_exactness_pinned']['runs']
  assert [(r['mesh'], r['layout']) for r in pinned] == [('', None), ('model:2', 'gather'),
                                                        ('model:2', 'split')]
  for r in pinned:
    assert r['samples'] == 3 and r['graft_equal'] == 3, r
  assert pinned[1]['equal_to_one_device'] == 3
  for r in pinned[1:]:
    assert r['carried_from'] == '' and r['carried_refused'] == 3, r
    assert 'another engine configuration' in r['first_refusal']
  assert pinned[0]['carried_refused'] == 0
  one, two = steps['mesh_exactness_spec']['runs']
  assert (one['mesh'], two['mesh'], two['layout']) == ('', 'model:2', 'gather')
  assert two['equal_to_one_device'] == 3 and two['carried_equal'] == 3, two
  # A spec artifact that did not graft exactly on the mesh fails the check.
  two['carried_equal'] = 2
  assert not device_check.mesh_exact(steps)


def test_two_jax_distributed_processes_graft_exactly_on_one_mesh(tmp_path):
  # experiments.distributed_check: two processes of two host devices each (jax.distributed on
  # 127.0.0.1, gloo collectives) run one spec engine on the 4-device mesh; every graft equals
  # fresh, both processes read the same logits, and they equal the reference process's. On a
  # 2-core host one process of four devices has four threads and its engine refuses them
  # (docs/determinism.md); then the summary says so and the reference is one device.
  output = tmp_path / 'distributed.json'
  out = subprocess.run(
      [sys.executable, '-m', 'experiments.distributed_check', '--model=tiny_gemma3',
       '--weights=random:0', '--samples=2', f'--output={output}'],
      cwd=REPO, env={**os.environ, 'PYTHONPATH': str(REPO)}, capture_output=True, text=True,
      timeout=900)
  assert out.returncode == 0, out.stderr[-3000:]
  result = json.loads(output.read_text())
  summary = result['summary']
  assert result['config']['processes'] == 2 and result['config']['devices'] == 4
  assert summary['samples'] == summary['equal'] == summary['equal_to_reference'] == 2
  assert all(r['processes_agree'] for r in result['samples'])
  if summary['single_process_refused']:
    assert 'intra-op threads' in summary['single_process_refused']
    assert summary['equal_to_single_process'] is None and summary['reference_devices'] == 1
  else:
    assert summary['equal_to_single_process'] == 2 and summary['reference_devices'] == 4


MESH_SPEC_CHECK = r'''
import re
import sys
import jax
import numpy as np
from gemma_jax import model, weights
from gemma_jax.compare import sha256_bytes
from gemma_jax.config import get_config
from graft import context_shift
from graft.engine import spec_check
from graft.engine import Engine, EngineConfig
rope = sys.argv[1]
loaded = weights.load(get_config('tiny_gemma3_wide').replace(rope_mode=rope), 'random:0',
                      'float32')
tokens = [int(t) for t in np.random.default_rng(0).integers(3, 500, 40)]
# Every shape a weight has, as loaded or as the [I, O] matrix it is contracted as.
weight_shapes = ({shape for shape, _, _ in model.parameter_distributions(loaded.config).values()}
                 | set(model.dense_weights(loaded.config).values()))
for mesh in ('', 'model:2', 'model:4', 'model:2+data:2'):
  engine = Engine(loaded, EngineConfig(mode='spec', rows_per_call=16, attention_tile=16,
                                       cache_len=128, mesh=mesh))
  assert engine.engine_config.dot_library == 'native'
  # The block step's all-gathers: none may gather a weight (each device computes its own
  # columns from its own share).
  rows = jax.ShapeDtypeStruct((1, engine.max_rows), np.int32)
  hlo = engine.step_function(None).jitted.lower(
      engine.params, rows, rows, jax.eval_shape(engine.empty_kv)).compile().as_text()
  gathered = {tuple(int(d) for d in dims.split(',')) for dims in
              re.findall(r'= f32\[([0-9,]+)\]\S* all-gather\(', hlo)}
  print('GATHERED', mesh or 'one', sorted(gathered & weight_shapes), len(gathered))
  summary = spec_check.run(engine, tokens, [17])['summary']
  shifted = '-'
  if rope == 'relative':  # a context shift on the mesh: the oldest 7 tokens dropped, 5 more fed
    ctx, _ = engine.prefill(tokens, logits='none')
    _, logits = engine.extend(context_shift.drop_oldest(ctx, 7), tokens[:5], logits='all')
    shifted = sha256_bytes(logits)
  print('MESH', mesh or 'one', summary['kv_equal'], summary['logits_equal'], summary['sha256'],
        shifted)
'''


@pytest.mark.parametrize('rope', ['float', 'relative'])
def test_the_native_kernels_on_every_mesh_give_the_interpreters_bits(rope):
  """The spec engine's native kernels partitioned over 2 and 4 devices and a 2 x 2 mesh (each
  device its own rows, columns, batch or KV heads; never a contraction): the interpreter's bits
  on tiny_gemma3_wide (chained projections), under float and relative RoPE, and every mesh's
  digests (the spec check's, and under relative the logits after a context shift) the one
  device's; and no mesh's block step gathers a weight whole (each device computes its own
  columns from its own share of it)."""
  env = {**os.environ, 'PYTHONPATH': str(REPO),
         'XLA_FLAGS': '--xla_force_host_platform_device_count=4'}
  out = subprocess.run([sys.executable, '-c', MESH_SPEC_CHECK, rope], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=900)
  assert out.returncode == 0, out.stderr[-2000:]
  gathers = [line.split(' ', 2)[1:] for line in out.stdout.splitlines()
             if line.startswith('GATHERED')]
  # No weight is gathered on any mesh (gemma_jax.sharding, "Projections on a mesh"), while
  # activations are: the count shows the parse finds the all-gathers there are.
  assert [g[0] for g in gathers] == ['one', 'model:2', 'model:4', 'model:2+data:2']
  assert all(g[1].startswith('[] ') for g in gathers), gathers
  assert all(int(g[1].split()[-1]) > 0 for g in gathers[1:]), gathers
  rows = [line.split()[1:] for line in out.stdout.splitlines() if line.startswith('MESH')]
  assert [r[0] for r in rows] == ['one', 'model:2', 'model:4', 'model:2+data:2']
  assert all(r[1:3] == ['True', 'True'] for r in rows), rows
  assert len({r[3] for r in rows}) == 1 and len({r[4] for r in rows}) == 1, rows
