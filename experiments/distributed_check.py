"""Two processes, one engine: exact grafts on a mesh that spans two jax.distributed processes.

  python -m experiments.distributed_check --model=tiny_gemma3 --weights=random:0 --samples=4

Starts two local processes of two host devices each, joined by jax.distributed (JAX's
coordination service on 127.0.0.1, CPU collectives over gloo), that build one engine on the
4-device global mesh (--mesh, default model:4, layout gather) and compute every sample fresh and
through an own-position graft: the library's KV captured to host (multihost_utils gathers what a
process does not hold) and grafted back. Then one process of four host devices computes the
same samples. The result:

  {"config": {...}, "summary": {"samples", "equal", "equal_to_single_process"}, "samples": [...]}

`equal`: samples whose graft equals fresh within the two-process run (SHA-256 of the logits,
and both processes read the same logits); `equal_to_single_process`: samples whose fresh logits
equal the single process's. A process's thread pool grows with its host devices, and where the
engine's self-check refuses one process of four devices (docs/determinism.md: on a 2-core host
it does) the summary says so (`single_process_refused`, `equal_to_single_process` null) and the
reference is one process of one device, which the gather layout promises to equal
(`reference_devices`, `equal_to_reference`). Exit status 1 when `equal` or `equal_to_reference`
falls short of `samples`; a refused two-process run ends with its reason.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import tempfile

from absl import flags, logging

from experiments import common, samples
from gemma_jax import sharding
from graft import exactness
from graft.engine import Engine
from graft.store import artifact

FLAGS = flags.FLAGS
PROCESSES = 2


def define_flags() -> None:
  flags.DEFINE_integer('samples', 4, 'Samples drawn from real text.', lower_bound=1)
  flags.DEFINE_integer('seed', 0, 'Seed of the samples.', lower_bound=0)
  common.define_output_flag()
  flags.DEFINE_string('rows_output', None, 'Internal: where a worker process writes its rows.')
  common.define_model_flags()
  common.define_engine_flags(cache_len=1024)
  flags.FLAGS.set_default('mesh', 'model:4')


OWN_DEFAULTS = {
    'samples': 'four libraries around the sliding window (1, 511, 512, 513 tokens)',
    'cache_len': 'the longest sample (513 tokens) and its query, on a 1,024-slot cache',
    'mesh': 'the mesh the two processes span: two host devices each',
}


def worker() -> None:
  """One process of the run (or the single-process reference): every sample fresh and grafted
  on the mesh; each process writes the rows it read."""
  loaded = common.load_model()
  try:
    engine: Engine = common.make_engine(loaded)
  except ValueError as e:  # the engine refuses this configuration: the launcher reports why
    with open(FLAGS.rows_output, 'w') as f:
      json.dump({'refused': ' '.join(str(e).split())}, f)
    raise
  pairs = [p for p in samples.draw(loaded.tokenizer, FLAGS.samples, seed=FLAGS.seed,
                                   window=loaded.config.sliding_window)
           if len(p.library) + len(p.query) <= FLAGS.cache_len]

  def graft(library):
    ctx, _ = engine.prefill(list(library), logits='none')
    return artifact.graft(engine, artifact.capture(engine, ctx))

  rows = []
  for i, pair in enumerate(pairs):
    row = exactness.check_sample(engine, graft, pair.library, pair.query, continuation_tokens=0)
    rows.append({'library_tokens': len(pair.library), 'query_tokens': len(pair.query),
                 'fresh_sha256': row['fresh_sha256'], 'graft_sha256': row['graft_sha256']})
    logging.info('process %d: sample %d/%d graft %s fresh', FLAGS.process_id, i + 1, len(pairs),
                 'equals' if row['fresh_sha256'] == row['graft_sha256'] else 'DIFFERS from')
  with open(FLAGS.rows_output, 'w') as f:
    json.dump({'rows': rows, 'devices': len(engine.mesh.devices.flat) if engine.mesh else 1,
               'processes': FLAGS.num_processes}, f)


def _free_port() -> int:
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


def _start(args: list[str], rows_output: str, local_devices: int) -> subprocess.Popen:
  """A worker process; its log (progress, and its one-line error) goes to this one's stderr."""
  env = {**os.environ, 'XLA_FLAGS': f'--xla_force_host_platform_device_count={local_devices}'}
  return subprocess.Popen([sys.executable, '-m', 'experiments.distributed_check', *args,
                           f'--rows_output={rows_output}'], env=env)


def _wait(procs: dict[str, subprocess.Popen]) -> str | None:
  """Waits for every process; returns None, or the first failure (the others are then
  stopped; the failed process printed its reason above)."""
  failed = None
  for name, proc in procs.items():
    proc.wait()
    if proc.returncode and failed is None:
      failed = f'{name} failed (exit {proc.returncode}; its error is above)'
      for other in procs.values():
        other.kill()
  return failed


def launch() -> int:
  devices = math.prod(sharding.parse_mesh(FLAGS.mesh).values())
  common_args = [f'--model={FLAGS.model}', f'--weights={FLAGS.weights}',
                 f'--dtype={FLAGS.dtype}', f'--samples={FLAGS.samples}', f'--seed={FLAGS.seed}',
                 *common.engine_flag_args()]
  with tempfile.TemporaryDirectory() as scratch:
    coordinator = f'127.0.0.1:{_free_port()}'
    logging.info('two processes of %d host devices each, coordinator %s', devices // PROCESSES,
                 coordinator)
    failed = _wait({f'process {i}': _start(
        [*common_args, f'--coordinator={coordinator}', f'--num_processes={PROCESSES}',
         f'--process_id={i}'], f'{scratch}/rows_{i}.json', devices // PROCESSES)
        for i in range(PROCESSES)})
    if failed:
      raise SystemExit(failed)
    runs = []
    for i in range(PROCESSES):
      with open(f'{scratch}/rows_{i}.json') as f:
        runs.append(json.load(f)['rows'])
    # The reference: one process of as many host devices. Its engine may refuse that
    # configuration (a process's thread pool grows with its host devices, docs/determinism.md);
    # then one process of one device is the reference the layout promises to keep.
    logging.info('one process of %d host devices', devices)
    failed = _wait({'the single process': _start(common_args, f'{scratch}/single.json',
                                                 devices)})
    refused, reference_devices = None, devices
    if failed:
      if not os.path.exists(f'{scratch}/single.json'):  # not a refusal: a failure
        raise SystemExit(failed)
      with open(f'{scratch}/single.json') as f:
        refused = json.load(f)['refused']
      logging.warning('%s; the reference is one process of one device', refused)
      reference_devices = 1
      failed = _wait({'the one-device process': _start(
          [a for a in common_args if not a.startswith('--mesh')] + ['--mesh='],
          f'{scratch}/single.json', 1)})
      if failed:
        raise SystemExit(failed)
    with open(f'{scratch}/single.json') as f:
      single = json.load(f)['rows']
  rows = [{**row, 'reference_sha256': one['fresh_sha256'],
           'processes_agree': all(run[i] == row for run in runs[1:])}
          for i, (row, one) in enumerate(zip(runs[0], single))]
  summary = {
      'samples': len(rows),
      'equal': sum(r['fresh_sha256'] == r['graft_sha256'] and r['processes_agree']
                   for r in rows),
      'equal_to_single_process': None if refused else sum(
          r['fresh_sha256'] == r['reference_sha256'] for r in rows),
      'single_process_refused': refused,
      'reference_devices': reference_devices,
      'equal_to_reference': sum(r['fresh_sha256'] == r['reference_sha256'] for r in rows),
  }
  config = {**common.model_config_json(), 'engine_config': dataclasses.asdict(
      common.engine_config()), 'processes': PROCESSES, 'devices': devices,
            'samples': FLAGS.samples, 'seed': FLAGS.seed, 'collectives': 'gloo',
            'coordinator': '127.0.0.1'}
  output = common.output_path('distributed_check', FLAGS.model, FLAGS.dtype)
  common.write_result(output, 'distributed_check',
                      {'config': config, 'summary': summary, 'samples': rows})
  print(f"{PROCESSES} processes x {devices // PROCESSES} devices, mesh {FLAGS.mesh}: grafts equal "
        f"{summary['equal']}/{len(rows)}, equal to one process of {reference_devices} "
        f"device(s) {summary['equal_to_reference']}/{len(rows)}"
        + (f' (one process of {devices} devices refused: {refused})' if refused else ''))
  return 0 if summary['equal'] == summary['equal_to_reference'] == len(rows) else 1


def main(argv):
  del argv
  if FLAGS.rows_output:
    worker()
    return 0
  return launch()


if __name__ == '__main__':
  define_flags()
  common.run(main)
