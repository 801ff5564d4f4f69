"""The spec engine on an emulated CPU of another vendor, for when no such machine is at hand,
and in every process configuration of this one.

  python -m experiments.emulated_check                  # an AMD EPYC-Rome (Zen 2: AVX2, FMA)
  python -m experiments.emulated_check --cpu=Haswell --replay_limit=4
  python -m experiments.emulated_check --cpu=SandyBridge --dot_library=native --flywheel_limit=4
  python -m experiments.emulated_check --dot_library=native --compose_limit=14
  python -m experiments.emulated_check --cpu= --configurations=devices:8,threads:1,isa:SSE4_2
  QEMU_LD_PREFIX=ROOT CXX=aarch64-linux-gnu-g++ python -m experiments.emulated_check \
      --qemu=qemu-aarch64 --cpu=max --python=ROOT/usr/bin/python3.11 --dot_library=native

Runs this repository's checks under QEMU's user-mode emulator (`qemu-x86_64 -cpu CPU`, the
Debian package qemu-user; 7.2 or later emulates AVX2 and FMA):

1. a probe, here and emulated: the CPU XLA compiles for (the LLVM target in the IR of a small
   jitted function) and the bits of XLA's reciprocal square root against the spec's 1 / sqrt.
   A different target and different rsqrt bits show the emulated machine is not this one. It
   also hashes the inputs the spec's bits rest on: the random:0 weights of the tiny models
   (gemma_jax.seeded) and the draws of a sampled decode from fixed logits (gemma_jax.sampling),
   which must hash the same there as here;
2. experiments.spec_check on tiny Gemma 2, 3, 4 and 3-wide (chained projections) past their
   sliding windows, with each --dot_library: XLA's own dots (eigen), the spec engine's
   native kernels (native), the spec dot kernel in Pallas's interpret mode (pallas); each also
   here, and its digest compared with the emulated one's;
3. with --replay_limit, experiments.replay of the first records of the committed spec CI
   manifest (made on a real CPU; the embedded 270M, self-check included), with each; with
   --flywheel_limit, of the first records of a committed flywheel manifest whose answers were
   sampled at a temperature (--flywheel_manifest: tiny Gemma 3 on random:0 weights), emulated
   on the native kernels; with --compose_limit, likewise of the committed compose manifest
   (documents stored once and composed in another order, at every strategy, both RoPE modes);
4. with --configurations, the same spec_checks (and --config_models, the 270M among them) run
   natively in processes of other configurations: `devices:N` host devices, `threads:1` (one
   core of the affinity mask), `isa:X` (XLA_FLAGS=--xla_cpu_max_isa=X); --cpu= (empty) skips
   the emulated steps;
5. everything to --output (unset: the run folder runs/emulated_check/), with what each step
   printed and its time.

Each spec_check or replay ends `equal` (the spec's bits, the manifest's hashes) or `refused`
(the engine's self-check named the probes this machine does not compute as the spec says);
`differs` would be a silent difference, which the design rules out. The check passes when the
machine is another one, every step is equal or refused, every emulated spec_check that is equal
has this machine's digest, the random weights and the draws hash as here, and the spec dot
kernel is equal. Under QEMU's x86 emulator the
self-checks skip the flush-to-zero edge (QEMU flushes before rounding there, x86 after:
`skip_env`); under its aarch64 emulator they probe it.

What emulation shows, and what not: XLA and Eigen choose their kernels for the emulated CPU
model and its instruction set (no AVX-512), and QEMU executes every floating-point instruction
in software, with its own results for the estimate instructions (rcpps, rsqrtps) whose bits
each vendor defines. So it is another machine in everything XLA and the spec look at. It is not
the other vendor's silicon: a hardware defect or an undocumented rounding of a real chip is not
covered. Under qemu-user /proc/cpuinfo is the host's, so the `made_on` of the steps' own results
name the host; this result records the emulated CPU. About 50 to 100 times slower than native.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile

from absl import flags
import jax
import numpy as np

from experiments import common
from gemma_jax import numerics, sampling, weights
from gemma_jax.config import names as config_names
from gemma_jax.kernels import native_build, native_dot
from gemma_jax.spec import binary32, functions, selfcheck
from graft.engine import fingerprint

FLAGS = flags.FLAGS

CI_MANIFEST = 'manifests/ci_gemma3_270m_float32.json'
# Sampled answers (temperature 0.7) of tiny Gemma 3 on random:0 weights, made on a real CPU.
FLYWHEEL_MANIFEST = 'manifests/flywheel_tiny_gemma3_sampled.json'
# Documents of tiny Gemma 3 (random:0) composed at every strategy, relative and float, made on a
# real CPU: each record a composed KV state, the query's logits and a continuation.
COMPOSE_MANIFEST = 'manifests/compose_tiny_gemma3_float32_spec.json'
# Fixed logits of the sampling probe: 4,096 values from -8 to 23.2 (tests/test_sampling.py).
SAMPLING_LOGITS = (np.arange(4096, dtype=np.int64) * 7919 % 1000).astype(np.float32) / 32 - 8
# XLA's own dots (Eigen); the spec engine's native kernels and the spec dot kernel in Pallas's
# interpret mode, both sequential FMA chains by construction (gemma_jax/kernels).
DOT_LIBRARIES = ('eigen', 'native', 'pallas')
BY_CONSTRUCTION = ('native', 'pallas')
TINY_MODELS = ('tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4', 'tiny_gemma3_wide')


def define_flags() -> None:
  flags.DEFINE_string('cpu', 'EPYC-Rome', 'The CPU model QEMU emulates (qemu-x86_64 -cpu help); '
                      'empty: no emulated steps.')
  flags.DEFINE_multi_enum('dot_library', ['eigen', 'native'], list(DOT_LIBRARIES),
                          "What computes the spec engine's dots in the spec_checks and replays: "
                          'each one given is run (repeat the flag).')
  flags.DEFINE_list('configurations', [], 'Process configurations of this machine to run the '
                    'spec_checks in natively: devices:N, threads:1, isa:AVX2, isa:SSE4_2, ...')
  flags.register_validator('configurations', lambda items: all(_configuration_valid(c)
                                                                for c in items),
                           message='--configurations: expected devices:N, threads:1 or isa:NAME')
  common.define_list('config_models', list(TINY_MODELS), 'Models of those spec_checks (the '
                     'embedded gemma3_270m computes 64 tokens).', integers=False,
                     words=config_names())
  flags.DEFINE_string('qemu', 'qemu-x86_64', 'The QEMU user-mode emulator.')
  flags.DEFINE_string('python', None, 'The Python the emulator runs (unset: this one). For '
                      'another architecture (--qemu=qemu-aarch64 --cpu=max), a Python of that '
                      'architecture with this project\'s dependencies, its libraries under '
                      '$QEMU_LD_PREFIX (docs/determinism.md, "aarch64").')
  flags.DEFINE_integer('tokens', 60, 'Tokens computed by each tiny model\'s spec_check (windows '
                       'are 8).', lower_bound=2)
  flags.DEFINE_integer('replay_limit', 0, 'Records of the CI manifest to replay with each dot '
                       'library (0: none; one record of the 270M took 7 min on the native kernels '
                       'under EPYC-Rome, and did not finish in 70 min on the Pallas kernel).',
                       lower_bound=0)
  flags.DEFINE_string('flywheel_manifest', FLYWHEEL_MANIFEST, 'A flywheel manifest of sampled '
                      'answers to replay emulated on the native kernels.')
  flags.DEFINE_integer('flywheel_limit', 0, 'Records of --flywheel_manifest to replay (0: none).',
                       lower_bound=0)
  flags.DEFINE_integer('compose_limit', 0, f'Records of {COMPOSE_MANIFEST} (composed documents) '
                       'to replay emulated on the native kernels (0: none).', lower_bound=0)
  flags.DEFINE_integer('step_timeout', 7200, 'Seconds a step may take before it is recorded as '
                       'timed out.', lower_bound=1)
  flags.DEFINE_string('probe_only', None, 'Run only the probe, with XLA dumping to this folder, '
                      'and write it there as probe.json (what the check runs here and emulated).')
  common.define_output_flag()


OWN_DEFAULTS = {
    'dot_library': "a sweep: XLA's Eigen dots and the native kernels",
    'tokens': "past the tiny models' 8-token windows, in minutes under QEMU",
}


def _configuration_valid(item: str) -> bool:
  kind, _, value = item.partition(':')
  return ((kind == 'devices' and value.isdigit() and int(value) >= 1)
          or (kind == 'threads' and value == '1') or (kind == 'isa' and bool(value)))


def probe(dump: str) -> dict:
  """What XLA compiles for in this process (run with --xla_dump_to=`dump`), and the bits of its
  reciprocal square root and of the spec engine's (1 / sqrt, gemma_jax.numerics.Spec) on
  163,840 inputs, and whether the latter is the interpreter's, and the flush-to-zero edge's
  probes, and the inputs' hashes: {"llvm_target_cpu", "avx512", "underflow_edge_failures"
  (with XLA's dots), "underflow_edge_failures_native" (with the native kernels),
  "flush_in_code", "xla_rsqrt_sha256", "spec_rsqrt_sha256", "spec_rsqrt_is_the_spec",
  "random_weights_sha256" (each tiny model's random:0 params_sha256), "sampling_sha256"}."""
  rng = np.random.default_rng(0)
  # Integers to binary32 (one correctly rounded conversion), then a power of two: exact, the
  # same inputs on every machine (a float64 uniform's multiply-add may be fused by a compiler).
  x = (rng.integers(10_486, 104_857_600, (256, 640)).astype(np.float32)
       * np.float32(2.0 ** -20))
  xla = np.asarray(jax.jit(jax.lax.rsqrt)(x))
  spec = np.asarray(jax.jit(lambda v, zero: numerics.Spec().with_zero(zero).rsqrt(v))(
      x, np.uint32(0)))
  # XLA:CPU dumps the target machine with each module: triple, CPU name, feature list.
  topology = ''.join(open(p, errors='replace').read()
                     for p in glob.glob(f'{dump}/*/topology.textproto'))
  targets = set(re.findall(r'gnu\\022(?:\\\d{3}|\\[a-z]|.)([a-z][a-z0-9_-]*)\\032', topology))
  sha = lambda a: hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()
  # Run without the emulated steps' skip: what this machine does at the flush-to-zero edge, with
  # XLA's own dots and with the native kernels (the spec engine's on a CPU).
  os.environ.pop(selfcheck.SKIP_UNDERFLOW_ENV, None)
  underflow = selfcheck.underflow_failures(numerics.Spec(), None)
  try:
    native = selfcheck.underflow_failures(numerics.Spec(kernel=native_dot.make_native_dot()), None)
  except native_build.BuildError as e:
    native = [f'no native kernels: {e}']
  return {'llvm_target_cpu': ','.join(sorted(targets)), 'avx512': '+avx512f,' in topology,
          'underflow_edge_failures': underflow, 'underflow_edge_failures_native': native,
          'flush_in_code': numerics.flush_in_code(),
          'xla_rsqrt_sha256': sha(xla), 'spec_rsqrt_sha256': sha(spec),
          'spec_rsqrt_is_the_spec': sha(spec) == sha(functions.rsqrt(binary32.OPS, x)),
          'random_weights_sha256': {m: weights.load(m, 'random:0', 'float32').params_sha256
                                    for m in TINY_MODELS},
          'sampling_sha256': sampling_digest()}


def sampling_digest() -> str:
  """SHA-256 of the integer weights of SAMPLING_LOGITS at temperature 0.7 and of the 64 tokens a
  decode seeded 3 draws from them (gemma_jax.sampling)."""
  h = hashlib.sha256(sampling.weights(SAMPLING_LOGITS, 0.7).astype('<i8').tobytes())
  h.update(np.asarray([sampling.draw(SAMPLING_LOGITS, 0.7, 3, j) for j in range(64)],
                      '<i8').tobytes())
  return h.hexdigest()


def probe_step(command: list[str], timeout: int = 7200, env: dict | None = None) -> dict:
  """Runs the probe as `command` (a python, emulated or not; `env` added to its environment):
  run_step's record with the probe's JSON under "probe" (None if it failed). Compiled afresh (no
  executable from the cache), so that XLA dumps the target machine."""
  dump = tempfile.mkdtemp(prefix='emulated_check_ir_')
  step = common.run_step(command + ['-m', 'experiments.emulated_check', f'--probe_only={dump}',
                                    '--nocompilation_cache'], timeout=timeout,
                         env={**(env or {}), 'XLA_FLAGS': f'--xla_dump_to={dump}'})
  path = os.path.join(dump, 'probe.json')
  step['probe'] = None
  if step['status'] == 0 and os.path.exists(path):
    with open(path) as f:
      step['probe'] = json.load(f)
  shutil.rmtree(dump, ignore_errors=True)
  return step


def outcome(step: dict) -> str:
  """What a spec_check or replay step found: 'equal' (every bit the spec's, or every hash the
  manifest's), 'refused' (the self-check named a probe this machine does not compute as the spec
  says), 'differs' (a silent difference: what must never happen) or 'failed' (anything else)."""
  if step['status'] == 0:
    return 'equal'
  if step['status'] == 2 and 'does not compute the written arithmetic' in step['tail']:
    return 'refused'
  return 'differs' if step['status'] == 1 else 'failed'


def skip_env() -> dict[str, str]:
  """The environment of the emulated steps' self-checks: under QEMU's x86 emulator, whose flush
  rule is not x86's (tininess before rounding, where x86 decides after; the x86 paths trust the
  hardware's rule), the flush-to-zero edge is skipped (selfcheck.SKIP_UNDERFLOW_ENV); under
  another emulator (aarch64, whose rule the engine computes in code) it is probed."""
  return {selfcheck.SKIP_UNDERFLOW_ENV: '1'} if 'x86_64' in FLAGS.qemu else {}


def digest_equal(step: dict, here: dict) -> bool:
  """Whether two spec_check steps computed the same digest, each equal to the interpreter."""
  digests = [s.get('summary', {}).get('sha256') for s in (step, here)]
  return (step['outcome'] == here['outcome'] == 'equal' and digests[0] is not None
          and digests[0] == digests[1])


def _qemu_version() -> str:
  out = subprocess.run([FLAGS.qemu, '--version'], capture_output=True, text=True).stdout
  return out.splitlines()[0] if out else ''


def configuration(spec: str) -> tuple[list[str], dict[str, str]]:
  """A --configurations entry -> (command prefix, environment) of a process in it."""
  kind, _, value = spec.partition(':')
  if kind == 'devices' and value.isdigit():
    return [], {'XLA_FLAGS': f'--xla_force_host_platform_device_count={value}'}
  if kind == 'threads' and value == '1':
    return ['taskset', '-c', str(min(os.sched_getaffinity(0)))], {}
  if kind == 'isa' and value:
    return [], {'XLA_FLAGS': f'--xla_cpu_max_isa={value}'}
  raise ValueError(f'--configurations: {spec!r} is not devices:N, threads:1 or isa:NAME')


def spec_check_step(prefix: list[str], model: str, library: str, env: dict, outputs: str) -> dict:
  """experiments.spec_check of `model` (seeded random weights; the embedded 270M's own) with a
  dot library, run as prefix + python: run_step's record, its summary and outcome."""
  output = os.path.join(outputs, f'{model}_{library}.json')
  weights = (['--weights=embedded', '--tokens=64'] if model == 'gemma3_270m' else
             ['--weights=random:0', f'--tokens={FLAGS.tokens}', '--rows_per_call=16',
              '--cache_len=256'])
  step = common.run_step(prefix + ['-m', 'experiments.spec_check', f'--model={model}', *weights,
                                   f'--dot_library={library}', f'--output={output}'],
                         timeout=FLAGS.step_timeout, env=env)
  if os.path.exists(output):
    with open(output) as f:
      step['summary'] = json.load(f)['summary']
    os.unlink(output)
  step['outcome'] = outcome(step)
  return step


def main(argv):
  del argv
  if FLAGS.probe_only:
    with open(os.path.join(FLAGS.probe_only, 'probe.json'), 'w') as f:
      json.dump(probe(FLAGS.probe_only), f)
    return 0
  configurations = {c: configuration(c) for c in FLAGS.configurations}
  if FLAGS.cpu and not shutil.which(FLAGS.qemu):
    raise FileNotFoundError(f'--qemu={FLAGS.qemu}: not found (apt-get install qemu-user)')
  # Executables compiled for another CPU are kept apart by JAX's cache key (the topology
  # fingerprint holds the target machine); a folder of the run's own keeps the check clean.
  cache = tempfile.mkdtemp(prefix='emulated_check_cache_')
  env = {'GEMMA_JAX_COMPILATION_CACHE': cache}
  outputs = tempfile.mkdtemp(prefix='emulated_check_')
  steps = {}
  if FLAGS.cpu:
    emulate = [FLAGS.qemu, '-cpu', FLAGS.cpu, FLAGS.python or sys.executable]
    emulated_env = {**env, **skip_env()}
    steps['probe_here'] = probe_step([sys.executable], FLAGS.step_timeout, {'CXX': ''})
    steps['probe_emulated'] = probe_step(emulate, FLAGS.step_timeout)
    for model in TINY_MODELS:
      for library in dict.fromkeys(FLAGS.dot_library):
        step = steps[f'spec_check_{model}_{library}'] = spec_check_step(emulate, model, library,
                                                                        emulated_env, outputs)
        # The same here ($CXX, which may name the emulated machine's cross compiler, cleared):
        # the digests must be this machine's.
        here = steps[f'spec_check_{model}_{library}_here'] = spec_check_step(
            [sys.executable], model, library, {**env, 'CXX': ''}, outputs)
        print(f'spec_check {model} {library}: {step["outcome"]}, {step["seconds"]:.0f} s; '
              f'here {here["outcome"]}, digest equal {digest_equal(step, here)}', flush=True)
    for library in dict.fromkeys(FLAGS.dot_library) if FLAGS.replay_limit else ():
      step = common.run_step(
          emulate + ['-m', 'experiments.replay', f'--manifest={CI_MANIFEST}',
                     f'--limit={FLAGS.replay_limit}', f'--dot_library={library}'],
          timeout=FLAGS.step_timeout, env=emulated_env)
      step['outcome'] = outcome(step)
      steps[f'replay_ci_manifest_{library}'] = step
      print(f'replay {library}: {step["outcome"]}, {step["seconds"]:.0f} s', flush=True)
    for kind, manifest, limit in (('flywheel', FLAGS.flywheel_manifest, FLAGS.flywheel_limit),
                                  ('compose', COMPOSE_MANIFEST, FLAGS.compose_limit)):
      if not limit:
        continue
      step = common.run_step(
          emulate + ['-m', 'experiments.replay', f'--manifest={manifest}', f'--limit={limit}',
                     '--dot_library=native'],
          timeout=FLAGS.step_timeout, env=emulated_env)
      step['outcome'] = outcome(step)
      steps[f'replay_{kind}_manifest_native'] = step
      print(f'replay of {manifest}: {step["outcome"]}, {step["seconds"]:.0f} s', flush=True)
  for name, (prefix, config_env) in configurations.items():
    for model in FLAGS.config_models:
      for library in dict.fromkeys(FLAGS.dot_library):
        step = spec_check_step(prefix + [sys.executable], model, library,
                               {**env, **config_env}, outputs)
        steps[f'config_{name}_{model}_{library}'] = step
        print(f'{name}: spec_check {model} {library}: {step["outcome"]}, '
              f'{step["seconds"]:.0f} s', flush=True)
  shutil.rmtree(cache, ignore_errors=True)
  shutil.rmtree(outputs, ignore_errors=True)
  here = steps.get('probe_here', {}).get('probe')
  there = steps.get('probe_emulated', {}).get('probe')
  checks = [s['outcome'] for s in steps.values() if 'outcome' in s]
  report = {
      'emulator': _qemu_version() if FLAGS.cpu else None, 'cpu': FLAGS.cpu or None,
      'steps': steps,
      'another_machine': bool(here and there and (
          here['llvm_target_cpu'] != there['llvm_target_cpu'] or
          here['xla_rsqrt_sha256'] != there['xla_rsqrt_sha256'])),
      'spec_rsqrt_equal': bool(here and there and
                               here['spec_rsqrt_sha256'] == there['spec_rsqrt_sha256']),
      # The inputs: random:0 weights and sampled draws, the same bits there as here.
      'random_weights_equal': bool(here and there and here['random_weights_sha256']
                                   == there['random_weights_sha256']),
      'sampling_equal': bool(here and there and
                             here['sampling_sha256'] == there['sampling_sha256']),
      'outcomes': {o: checks.count(o) for o in sorted(set(checks))},
      # Each emulated spec_check's digest against the same run here (both equal to the spec).
      'digests_equal_here': {name[len('spec_check_'):]: digest_equal(steps[name], step)
                             for name, step in steps.items()
                             if name.startswith('spec_check_') and not name.endswith('_here')
                             for step in [steps[name + '_here']]},
  }
  # Exact or refused, never different; and the kernels that are FMA chains by construction
  # exact everywhere.
  report['ok'] = ((not FLAGS.cpu or (report['another_machine'] and report['spec_rsqrt_equal']
                                     and report['random_weights_equal']
                                     and report['sampling_equal']))
                  and all(o in ('equal', 'refused') for o in checks)
                  and all(equal for name, equal in report['digests_equal_here'].items()
                          if steps[f'spec_check_{name}']['outcome'] == 'equal')
                  and all(s['outcome'] == 'equal' for n, s in steps.items()
                          if n.endswith(BY_CONSTRUCTION)))
  name = re.sub(r'[^a-z0-9]+', '_', FLAGS.cpu.lower()) if FLAGS.cpu else 'configurations'
  output = common.output_path('emulated', name)
  common.write_result(output, 'emulated_check', {
      'config': {'cpu': FLAGS.cpu or None, 'qemu': FLAGS.qemu, 'python': FLAGS.python,
                 # An emulated x86's self-checks skip the flush-to-zero edge (QEMU's own rule
                 # there; each probe records what its machine does at it); aarch64's run it.
                 'emulated_env': skip_env() if FLAGS.cpu else {},
                 'tokens': FLAGS.tokens,
                 'host': fingerprint.environment(),
                 'dot_libraries': list(dict.fromkeys(FLAGS.dot_library)),
                 'configurations': FLAGS.configurations,
                 'config_models': FLAGS.config_models,
                 'replay_limit': FLAGS.replay_limit, 'manifest': CI_MANIFEST,
                 'flywheel_limit': FLAGS.flywheel_limit,
                 'flywheel_manifest': FLAGS.flywheel_manifest,
                 'compose_limit': FLAGS.compose_limit, 'compose_manifest': COMPOSE_MANIFEST},
      'report': report})
  for name, step in steps.items():
    print(f'{name}: {step.get("outcome", step["status"])}, {step["seconds"]:.0f} s')
  print(f'another machine: {report["another_machine"]}; random weights and draws as here: '
        f'{report["random_weights_equal"]}, {report["sampling_equal"]}; every check exact or '
        f'refused, the kernels of the spec\'s order exact: {report["ok"]}')
  return 0 if report['ok'] else 1


if __name__ == '__main__':
  define_flags()
  common.run(main)
