"""The one-command check on a real accelerator host (GPU or TPU), in under five minutes.

  bash experiments/device_check.sh          # = python -m experiments.device_check

1. the Pallas kernel tests, compiled for the device (not interpret mode);
2. graft exactness on the embedded 270M, 10 samples, with XLA attention and with the Pallas
   kernel, fresh and grafted logits compared by SHA-256 (a manifest of the run is written for
   later replays on the same kind of device);
3. a replay of the committed CI manifest (made on a CPU by the spec engine), as recorded and
   with the spec engine's dots in the spec dot kernel (gemma_jax/kernels/spec_dot.py): where
   the device passes the spec self-check, its hashes are the CPU's;
4. on a host of several devices, experiments.mesh_exactness over one device and the largest
   model mesh of 2, 4 or 8 of them (`mesh_plan`): the pinned engine in both layouts, and the
   spec engine with the one-device artifacts restored on the mesh (the portable arithmetic:
   exact on any device count that passes its self-check);
5. hashes and timings of all of it to results/device_<kind>.json (kind from the device).

Every step records what it printed and how long it took; a step that fails is recorded and the
rest still run, and the exit status is non-zero when a kernel test or a graft was not exact.
"""

from __future__ import annotations

import json
import os
import re
import sys

from absl import flags

from experiments import common

FLAGS = flags.FLAGS


def define_flags() -> None:
  flags.DEFINE_integer('samples', 10, 'Graft-exactness samples per attention implementation.',
                       lower_bound=1)
  flags.DEFINE_string('output', None, 'Result JSON (default results/device_<kind>.json).')
  flags.DEFINE_string('manifest_dir', 'manifests', 'Where the run\'s manifests go.')
  flags.DEFINE_integer('mesh_samples', 4, 'Samples per mesh on a host of several devices.',
                       lower_bound=1)


def mesh_plan(devices: int) -> str | None:
  """The model mesh the check runs on a host of `devices` devices: the largest of 2, 4, 8 that
  fits (None on one device)."""
  fitting = [n for n in (2, 4, 8) if n <= devices]
  return f'model:{fitting[-1]}' if fitting else None


def mesh_steps(mesh: str, samples: int, model_flags: tuple[str, ...] = ()) -> dict[str, dict]:
  """experiments.mesh_exactness on one device and `mesh`, per engine: the step's record with
  its runs' counts (rows of hashes left out)."""
  steps = {}
  for engine, layouts in (('pinned', 'gather,split'), ('spec', 'gather')):
    output = os.path.join('/tmp', f'device_check_mesh_{engine}_{os.getpid()}.json')
    step = common.run_step([sys.executable, '-m', 'experiments.mesh_exactness', *model_flags,
                            f'--engine={engine}', f'--meshes=,{mesh}', f'--layouts={layouts}',
                            f'--samples={samples}', f'--output={output}'])
    if os.path.exists(output):
      with open(output) as f:
        step['runs'] = [{k: v for k, v in r.items() if k != 'rows'} for r in json.load(f)['runs']]
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
  import jax
  device = jax.devices()[0]
  kind = re.sub(r'[^a-z0-9]+', '_', device.device_kind.lower()).strip('_')
  report = {'backend': jax.default_backend(), 'device_kind': device.device_kind,
            'devices': len(jax.devices()), 'jax': jax.__version__, 'steps': {}}
  steps = report['steps']
  steps['kernel_tests'] = common.run_step([sys.executable, '-m', 'pytest', '-q', '-p',
                                           'no:cacheprovider', '-k', 'pallas or kernel',
                                           'tests/test_pallas_kernel.py'])
  for attention in ('xla', 'pallas'):
    name = f'graft_exactness_gemma3_270m_float32_{attention}_{kind}'
    output = os.path.join('/tmp', f'{name}.json')
    steps[f'graft_exactness_{attention}'] = common.run_step(
        [sys.executable, '-m', 'experiments.graft_exactness', f'--samples={FLAGS.samples}',
         '--engine=pinned', f'--attention={attention}', '--continuation_tokens=8',
         f'--output={output}',
         f'--manifest={os.path.join(FLAGS.manifest_dir, name + ".json")}'])
    if os.path.exists(output):
      with open(output) as f:
        result = json.load(f)
      steps[f'graft_exactness_{attention}']['summary'] = result['summary']
      steps[f'graft_exactness_{attention}']['hashes'] = [
          {k: s[k] for k in ('library_tokens', 'query_tokens', 'fresh_sha256', 'graft_sha256')}
          for s in result['samples']]
  steps['replay_ci_manifest'] = common.run_step(
      [sys.executable, '-m', 'experiments.replay',
       '--manifest=manifests/ci_gemma3_270m_float32.json'])
  # The same CPU-made manifest with the spec engine's dots in the spec dot kernel (Triton, one
  # fma.rn.ftz.f32 per term) and XLA:GPU flushing subnormals as the spec does: equal hashes are
  # a CPU <-> GPU byte-exact graft; a refusal names the self-check probe that differs.
  steps['replay_ci_manifest_spec_dot'] = common.run_step(
      [sys.executable, '-m', 'experiments.replay',
       '--manifest=manifests/ci_gemma3_270m_float32.json', '--dot_library=pallas'],
      env={'XLA_FLAGS': '--xla_gpu_ftz=true'})
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
  report['ok'] = steps['kernel_tests']['status'] == 0 and exact and replayed
  output = FLAGS.output or os.path.join('results', f'device_{kind}.json')
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
