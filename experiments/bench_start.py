"""A fresh process to its first logits, by phase: what `experiments.bench --start` and
`--start_only` time.

Ours: a fresh `python -m experiments.generate --max_new_tokens=1`, its phases stamped by the
process itself (START_PHASES), cold (an empty compilation cache, no saved executables, every
check run again) and warm (on what the first cold run left). llama.cpp's: a process that
imports only llama-cpp-python (experiments/peers/llama_start.py). And the floor of our import:
a process that imports only jax, whose time is set against our import phase
interleaved with the warm runs (`import_beyond_jax_s`: what the project adds to jax's own
import, repeat by repeat).
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from absl import flags, logging

from experiments import common
from experiments.peers import llama_cpp
from gemma_jax import compilation_cache as compilation_cache_module
from gemma_jax import executables, verdicts
from graft.engine import fingerprint

FLAGS = flags.FLAGS

# A fresh process's phases, in order, and the stamp (experiments.generate --phases) that ends each.
START_PHASES = (('import_s', 'imported'), ('load_s', 'loaded'), ('engine_s', 'engine'),
                ('first_logits_s', 'first_logits'))


def process_phases(command: list[str], env: dict | None = None) -> dict:
  """Runs `command` (which takes --phases=PATH and writes there the wall-clock stamps of
  START_PHASES) as a fresh process; returns each phase's seconds and `total_s`, from the
  process's start to its first logits."""
  with tempfile.TemporaryDirectory() as scratch:
    path = os.path.join(scratch, 'phases.json')
    start = time.time()
    subprocess.run(command + [f'--phases={path}'], env=env, check=True, capture_output=True,
                   cwd=common.REPO)
    with open(path) as f:
      stamps = json.load(f)
  phases, last = {}, start
  for name, stamp in START_PHASES:
    phases[name] = stamps[stamp] - last
    last = stamps[stamp]
  phases['total_s'] = stamps['first_logits'] - start
  return phases


def _medians(runs: list[dict]) -> dict:
  return {key: statistics.median(r[key] for r in runs) for key in runs[0]}


# A process that imports only jax and stamps the time it is done.
JAX_ONLY = ('import json, sys, time\nimport jax\n'
            'json.dump({"imported": time.time()}, open(sys.argv[1], "w"))')


def jax_import_s() -> float:
  """A fresh Python process that imports only jax: seconds from its start to the import's end
  (the floor of our import phase)."""
  with tempfile.TemporaryDirectory() as scratch:
    path = os.path.join(scratch, 'stamp.json')
    start = time.time()
    subprocess.run([sys.executable, '-c', JAX_ONLY, path], check=True, capture_output=True,
                   cwd=common.REPO)
    with open(path) as f:
      return json.load(f)['imported'] - start


def measure_start(mode: str, dot_library: str | None, repeats: int) -> dict:
  """A fresh process (`experiments.generate`, one new token) to its first logits: cold (each run
  on an empty compilation cache and no saved executables, every check run again:
  GEMMA_JAX_RECHECK) and warm (on what the first cold run left, with its kept verdicts); medians
  of `repeats`, per phase
  (START_PHASES). Weights come from the parameter cache in both."""
  command = [sys.executable, '-m', 'experiments.generate', '--max_new_tokens=1',
             f'--model={FLAGS.model}', f'--weights={FLAGS.weights}', f'--dtype={FLAGS.dtype}',
             f'--engine={mode}'] + ([f'--dot_library={dot_library}'] if dot_library else [])
  with tempfile.TemporaryDirectory() as scratch:
    env = lambda i, **more: {**os.environ,
                             compilation_cache_module.ENV: os.path.join(scratch, str(i), 'xla'),
                             executables.ENV: os.path.join(scratch, str(i), 'executables'),
                             **more}
    cold = [process_phases(command, env(i, **{verdicts.RECHECK_ENV: '1'}))
            for i in range(repeats)]
    jax_import_s()  # untimed: jax's files in the page cache, as the warm runs have them
    # Each warm run, then a process importing only jax (A B A B): the project's import beyond
    # jax's own, repeat by repeat.
    warm, jax_only = [], []
    for _ in range(repeats):
      warm.append(process_phases(command, env(0)))
      jax_only.append(jax_import_s())
  beyond = [w['import_s'] - j for w, j in zip(warm, jax_only)]
  cold, warm = _medians(cold), _medians(warm)
  return {'ttft_cold_start_s': cold['total_s'], 'ttft_warm_start_s': warm['total_s'],
          'start_phases_s': {'cold': cold, 'warm': warm},
          'jax_import_only_s': statistics.median(jax_only), 'jax_import_only_runs_s': jax_only,
          # The project's import (the warm runs' import phase) beyond jax's own: a median of
          # the repeats' own differences, and each.
          'import_beyond_jax_s': statistics.median(beyond), 'import_beyond_jax_runs_s': beyond}


def measure_peer_start(name: str, repeats: int) -> dict:
  """llama.cpp's fresh process to its first logits on the same GGUF (after one untimed run,
  so the file is in the page cache as ours is warm); {} for a peer without a start measure."""
  if not name.startswith('llama_cpp'):
    return {}
  path = llama_cpp.gguf_for(name.removeprefix('llama_cpp_'))
  if path is None:
    return {}
  command = [sys.executable, '-P', os.path.join(common.REPO, 'experiments', 'peers',
                                                'llama_start.py'),
             path, json.dumps(llama_cpp.settings())]
  process_phases(command)
  warm = _medians([process_phases(command) for _ in range(repeats)])
  return {'ttft_warm_start_s': warm['total_s'], 'start_phases_s': {'warm': warm}}


def start_only(systems: list[str], ours: dict, repeats: int, output: str | None) -> None:
  """The start phases of every system in `systems` that has them (`ours`: our systems -> (mode,
  dot library)), and jax's import alone: written to --output (unset: the run folder)."""
  rows = []
  for name in systems:
    logging.info('timing the start of %s', name)
    if name in ours:
      row = measure_start(*ours[name], repeats)
    else:
      row = measure_peer_start(name, repeats) or {
          'skipped': 'no start measure for this peer, or it is not installed'}
    rows.append({'name': name, 'skipped': None, **row})
  config = {**common.model_config_json(), 'systems': list(systems), 'start_only': True,
            'repeats': repeats, 'environment': fingerprint.environment()}
  output = common.output_path('bench', FLAGS.model, FLAGS.dtype, 'start')
  common.write_result(output, 'bench', {'config': config, 'ceilings': {}, 'systems': rows})
  for row in rows:
    if row['skipped']:
      print(f"{row['name']:18s} skipped ({row['skipped']})")
      continue
    for when, phases in row['start_phases_s'].items():
      print(f"{row['name']:18s} {when}: " + ', '.join(
          f"{k.removesuffix('_s')} {v:.2f}s" for k, v in phases.items())
            + (f"; jax's import alone {row['jax_import_only_s']:.2f}s, the project's beyond it "
               f"{row['import_beyond_jax_s']:.2f}s" if when == 'warm' and 'jax_import_only_s' in row
               else ''))


