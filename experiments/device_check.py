"""The one-command check on a real accelerator host (GPU or TPU), in under five minutes.

  bash experiments/device_check.sh          # = python -m experiments.device_check

1. the Pallas kernel tests, compiled for the device (not interpret mode);
2. graft exactness on the embedded 270M, 10 samples, with XLA attention and with the Pallas
   kernel, fresh and grafted logits compared by SHA-256 (a manifest of the run is written for
   later replays on the same kind of device);
3. the flush-to-zero edge on the device (`edge_probe`): a product that rounds up to 2^-126 from
   below, and one just below it that is tiny, through XLA:GPU's multiply (--xla_gpu_ftz=true)
   and the PTX `fma.rn.ftz.f32` of the spec dot kernel, each as the hardware computes it and
   with the spec's rule computed in code (gemma_jax.numerics.spec_multiply,
   spec_dot.fma_flushed_in_code), and the self-check's edge probes both ways: which rule the
   device's flush follows (the spec's: tininess after rounding; Arm's: before);
4. a replay of the committed CI manifest (made on a CPU by the spec engine), as recorded and
   with the spec engine's dots in the spec dot kernel (gemma_jax/kernels/spec_dot.py), with the
   rule in code where step 3 found the device's differs ($GEMMA_JAX_SPEC_FLUSH=code): where
   the device passes the spec self-check, its hashes are the CPU's;
5. on a host of several devices, experiments.mesh_exactness over one device and the largest
   model mesh of 2, 4 or 8 of them (`mesh_plan`): the pinned engine in both layouts, and the
   spec engine with the one-device artifacts restored on the mesh (the portable arithmetic:
   exact on any device count that passes its self-check);
6. hashes and timings of all of it to --output (to commit: results/device_<kind>.json; unset:
   the run folder runs/device_check/), the manifests beside it.

Every step records what it printed and how long it took; a step that fails is recorded and the
rest still run, and the exit status is non-zero when a kernel test or a graft was not exact.
"""

from __future__ import annotations

import json
import os
import re
import sys

from absl import app, flags
import jax
import jax.numpy as jnp
import numpy as np

from experiments import common
from gemma_jax import numerics
from gemma_jax.kernels import native_build, native_dot, spec_dot
from gemma_jax.spec import selfcheck

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_string('edge_probe_only', None, 'Run only the flush-to-zero edge probe and write '
                      'its JSON to this file (what the check runs in a process of its own).')
  flags.DEFINE_integer('samples', 10, 'Samples of graft exactness per attention '
                       'implementation.', lower_bound=1)
  common.define_output_flag('to commit it: --output=results/device_<kind>.json')
  flags.DEFINE_string('manifest_output_dir', None, 'Where the run\'s manifests go (unset: beside '
                      'the result, in <output>_manifests/).')
  flags.DEFINE_integer('mesh_samples', 4, 'Samples per mesh on a host of several devices.',
                       lower_bound=1)


OWN_DEFAULTS = {'samples': 'ten per attention implementation, in the five minutes the check has'}


def edge_probe() -> dict:
  """The flush-to-zero edge on this process's default device. Products a b of the edge
  (selfcheck.UNDERFLOW_EDGE: rounds up to 2^-126, which the spec keeps) and of (1 - 2^-24) 2^-126
  (exact and tiny: flushed under either rule), as bit patterns: by XLA's multiply, by
  numerics.spec_multiply, and on a GPU by the spec dot kernel's FMA (a b + 0) as the hardware
  flushes and with the rule in code; then the self-check's edge probes (the spec dot kernel on a
  GPU, the native kernels or XLA's dots elsewhere) with the hardware's rule and with the rule in
  code. `*_keeps_edge`: whether that computation gives the spec's [2^-126, 0]."""
  a = np.array([selfcheck.UNDERFLOW_EDGE[0], 1 - 2.0 ** -24], np.float32)
  b = np.array([selfcheck.UNDERFLOW_EDGE[1], 2.0 ** -126], np.float32)
  words = lambda x: [f'{w:#010x}' for w in np.asarray(x, np.float32).view(np.uint32).ravel()]
  spec = ['0x00800000', '0x00000000']
  out = {'backend': jax.default_backend()}
  out['xla_multiply'] = words(jax.jit(jnp.multiply)(a, b))
  # As the engine computes it: the scalings kept opaque by its run-time zero.
  out['spec_multiply'] = words(jax.jit(lambda x, y, zero: numerics.spec_multiply(
      x, y, numerics.Spec().with_zero(zero).materialize))(a, b, jnp.uint32(0)))
  gpu = jax.default_backend() in ('cuda', 'rocm', 'gpu')
  if gpu:
    for name, rule in (('ptx_fma', False), ('ptx_fma_in_code', True)):
      dot = spec_dot.SpecDot(platform='gpu', interpret=False, flush_in_code=rule)
      out[name] = words(np.diagonal(np.asarray(dot(a[None, :, None], b[None, None, :]))[0]))
  for name in list(out):
    if name != 'backend':
      out[f'{name}_keeps_edge'] = out[name] == spec
  dot = spec_dot.make_spec_dot() if gpu else None
  if not gpu:
    try:
      dot = native_dot.make_native_dot()
    except native_build.BuildError:
      pass
  for rule in ('hardware', 'code'):
    os.environ[numerics.FLUSH_ENV] = rule
    jax.clear_caches()  # the rule is read when a function is traced
    out[f'selfcheck_edge_failures_{rule}'] = selfcheck.underflow_failures(
        numerics.Spec(kernel=dot), None)
  os.environ.pop(numerics.FLUSH_ENV)
  return out


def edge_step() -> dict:
  """edge_probe in a process of its own under --xla_gpu_ftz=true (as the spec's replays run):
  run_step's record with the probe's JSON under "probe" (None if it failed)."""
  path = os.path.join('/tmp', f'device_check_edge_{os.getpid()}.json')
  step = common.run_step([sys.executable, '-m', 'experiments.device_check',
                          f'--edge_probe_only={path}'], env={'XLA_FLAGS': '--xla_gpu_ftz=true'})
  step['probe'] = None
  if os.path.exists(path):
    with open(path) as f:
      step['probe'] = json.load(f)
    os.unlink(path)
  return step


def flush_rule(probe: dict | None) -> str:
  """How the spec engine's multiplies and FMAs must flush on this device: 'hardware' where its
  own keep the edge, else 'code'."""
  if probe is None:
    return 'code'
  kept = [v for k, v in probe.items() if k in ('xla_multiply_keeps_edge', 'ptx_fma_keeps_edge')]
  return 'hardware' if all(kept) else 'code'


def mesh_plan(devices: int) -> str | None:
  """The model mesh the check runs on a host of `devices` devices: the largest of 2, 4, 8 that
  fits (None on one device)."""
  fitting = [n for n in (2, 4, 8) if n <= devices]
  return f'model:{fitting[-1]}' if fitting else None


def mesh_steps(mesh: str, samples: int, model_flags: tuple[str, ...] = ()) -> dict[str, dict]:
  """experiments.mesh_exactness on one device and `mesh`, per engine: the step's record with
  its runs' counts (rows of hashes left out)."""
  steps = {}
  for engine, layouts in (('pinned', ('gather', 'split')), ('spec', ('gather',))):
    output = os.path.join('/tmp', f'device_check_mesh_{engine}_{os.getpid()}.json')
    step = common.run_step([sys.executable, '-m', 'experiments.mesh_exactness', *model_flags,
                            f'--engine={engine}', '--mesh=', f'--mesh={mesh}',
                            *[f'--mesh_layout={layout}' for layout in layouts],
                            f'--samples={samples}', f'--output={output}'])
    if os.path.exists(output):
      with open(output) as f:
        # Each run's counts, and the reason its first carried artifact was refused (if it was).
        step['runs'] = [{**{k: v for k, v in r.items() if k != 'rows'},
                         'first_refusal': next((row['carried_refused'] for row in r['rows']
                                                if 'carried_refused' in row), None)}
                        for r in json.load(f)['runs']]
      os.unlink(output)
    steps[f'mesh_exactness_{engine}'] = step
  return steps


def mesh_exact(steps: dict[str, dict]) -> bool:
  """Every mesh step ran, every graft equal to fresh, and the spec engine's carried artifacts
  exact on the mesh."""
  for name, step in steps.items():
    runs = step.get('runs')
    if step['status'] != 0 or not runs or any(r['graft_equal'] != r['samples'] for r in runs):
      return False
    if name.endswith('_spec') and any(r['carried_equal'] != r['samples'] for r in runs[1:]):
      return False
  return True


def main(argv):
  del argv
  if FLAGS.edge_probe_only:
    with open(FLAGS.edge_probe_only, 'w') as f:
      json.dump(edge_probe(), f)
    return
  if jax.default_backend() == 'cpu':
    raise app.UsageError('device_check checks an accelerator (GPU or TPU), and jax sees only the '
                         'CPU here: run it on the accelerator host (the CPU has its checks in '
                         'tests/)')
  device = jax.devices()[0]
  kind = re.sub(r'[^a-z0-9]+', '_', device.device_kind.lower()).strip('_')
  report = {'backend': jax.default_backend(), 'device_kind': device.device_kind,
            'devices': len(jax.devices()), 'jax': jax.__version__, 'steps': {}}
  steps = report['steps']
  steps['kernel_tests'] = common.run_step([sys.executable, '-m', 'pytest', '-q', '-p',
                                           'no:cacheprovider', '-k', 'pallas or kernel',
                                           'tests/test_pallas_kernel.py'])
  output = common.output_path('device', kind)
  manifests = FLAGS.manifest_output_dir or os.path.splitext(output)[0] + '_manifests'
  for attention in ('xla', 'pallas'):
    name = f'graft_exactness_gemma3_270m_float32_{attention}_{kind}'
    step_output = os.path.join('/tmp', f'{name}.json')
    steps[f'graft_exactness_{attention}'] = common.run_step(
        [sys.executable, '-m', 'experiments.graft_exactness', f'--samples={FLAGS.samples}',
         '--engine=pinned', f'--attention={attention}', '--continuation_tokens=8',
         f'--output={step_output}',
         f'--manifest_output={os.path.join(manifests, name + ".json")}'])
    if os.path.exists(step_output):
      with open(step_output) as f:
        result = json.load(f)
      steps[f'graft_exactness_{attention}']['summary'] = result['summary']
      steps[f'graft_exactness_{attention}']['hashes'] = [
          {k: s[k] for k in ('library_tokens', 'query_tokens', 'fresh_sha256', 'graft_sha256')}
          for s in result['samples']]
  steps['edge'] = edge_step()
  report['spec_flush'] = flush_rule(steps['edge']['probe'])
  steps['replay_ci_manifest'] = common.run_step(
      [sys.executable, '-m', 'experiments.replay',
       '--manifest=manifests/ci_gemma3_270m_float32.json'])
  # The same CPU-made manifest with the spec engine's dots in the spec dot kernel (Triton, one
  # fma.rn.ftz.f32 per term) and XLA:GPU flushing subnormals as the spec does, with the flush rule
  # computed in code where the device's is not the spec's: equal hashes are a CPU <-> GPU
  # byte-exact graft; a refusal names the self-check probe that differs.
  steps['replay_ci_manifest_spec_dot'] = common.run_step(
      [sys.executable, '-m', 'experiments.replay',
       '--manifest=manifests/ci_gemma3_270m_float32.json', '--dot_library=pallas'],
      env={'XLA_FLAGS': '--xla_gpu_ftz=true', 'GEMMA_JAX_SPEC_FLUSH': report['spec_flush']})
  steps['lowering_summary'] = common.run_step(
      [sys.executable, '-m', 'graft.engine.lowering', 'gemma3_270m'])
  mesh = mesh_plan(len(jax.devices()))
  meshes = mesh_steps(mesh, FLAGS.mesh_samples) if mesh else {}
  steps.update(meshes)
  exact = all(steps[f'graft_exactness_{a}'].get('summary', {}).get('equal') == FLAGS.samples
              for a in ('xla', 'pallas')) and (not meshes or mesh_exact(meshes))
  # A replay that differs (or fails) is a failed check, not a note.
  replayed = all(steps[name]['status'] == 0
                 for name in ('replay_ci_manifest', 'replay_ci_manifest_spec_dot'))
  # The edge probed, and the self-check's edge probes pass with the rule in code at least.
  edge = steps['edge']['status'] == 0 and steps['edge']['probe'] is not None and not steps[
      'edge']['probe']['selfcheck_edge_failures_code']
  report['ok'] = steps['kernel_tests']['status'] == 0 and exact and replayed and edge
  common.write_result(output, 'device_check', {
      'config': {'samples': FLAGS.samples, 'mesh': mesh, 'mesh_samples': FLAGS.mesh_samples},
      'report': report})
  for name, step in steps.items():
    print(f'{name}: status {step["status"]}, {step["seconds"]:.0f} s'
          + (f', {step["summary"]}' if 'summary' in step else ''))
  if not report['ok']:
    sys.exit(1)


if __name__ == '__main__':
  define_flags()
  common.run(main)
