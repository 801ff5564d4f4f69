"""Runs never overwrite the evidence, and a valid input is served.

Every entry point is run as a researcher runs it (python -m ..., from the repository root), bare
(no --output), on a tiny model at the edges of its flags' bounds: each run ends with a result in
the git-ignored run folder (runs/<tool>/) or with a one-line usage error, and leaves `git
status` as it was. A run that names a committed result is refused unless --overwrite.
"""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests import cli_reference

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ['--model=tiny_gemma3', '--weights=random:0']

# Per entry point, runs at the edges of its bounds ({tmp}: a scratch folder; {manifest}: a
# graft-exactness manifest of tiny_gemma3, made once). Sizes sit at their lower bounds unless a
# bound is only reachable through a run of minutes (then the smallest that runs in seconds).
# Each must end with a result, or where listed in USAGE_ERRORS with a one-line usage error
# naming that flag: never with another error.
EDGES = {
    'experiments.bench': [TINY + [
        '--systems=ours_spec', '--prompt_tokens=1', '--decode_tokens=1', '--library_tokens=1',
        '--query_tokens=1', '--repeats=1', '--nostart']],
    'experiments.compat_fixture': [[]],
    'experiments.compose': [TINY + [
        '--documents=1', '--lengths=8', '--contexts=1', '--questions=1', '--strategies=none',
        '--fractions=0', '--offsets=0', '--nottft', '--continuation_tokens=0', '--continued=0',
        '--modes=relative', '--facts_per_document=1', '--repeats=1', '--ttft_length=8']],
    'experiments.context_shift': [
        TINY + ['--rope=relative', '--window=96', '--drop=1', '--shifts=1',
                '--continuation_tokens=0'],  # the window the cache once refused (issue 54)
        TINY + ['--window=2', '--drop=1', '--shifts=1', '--continuation_tokens=0',
                '--text_tokens=1'],
        TINY + ['--window=2']],  # --drop's default is not below it: a usage error naming it
    # Not an accelerator host: a one-line refusal that says so.
    'experiments.device_check': [['--samples=1', '--mesh_samples=1']],
    'experiments.emulated_check': [['--cpu=', '--tokens=2', '--config_models=tiny_gemma3',
                                    '--dot_library=native']],
    'experiments.faults': [['--trials=1', '--process_trials=1', '--kinds=bitflip_data']],
    'experiments.flywheel': [TINY + [
        '--task_set=units', '--tasks_n=1', '--heldout_n=1', '--rounds=1', '--budget=1',
        '--attempt_tokens=1', '--k=1', '--shots=0', '--sample_exact=0', '--temperature=0']],
    'experiments.generate': [TINY + ['--max_new_tokens=1', '--prompt=a', '--temperature=0']],
    'experiments.graft_exactness': [TINY + ['--samples=1', '--continuation_tokens=0',
                                            '--preceded_up_to=0', '--cache_len=1']],
    'experiments.kernel_bench': [['--sha256_only', '--cache_sizes=8', '--prefill_rows=1',
                                  '--repeats=1', '--num_heads=1', '--num_kv_heads=1',
                                  '--head_dim=8']],
    'experiments.logits': [TINY + ['--input={tmp}/texts.jsonl', '--cache_len=1']],
    'experiments.main': [TINY + ['--samples=1', '--manifest={manifest}']],
    'experiments.mesh_exactness': [TINY + ['--mesh=', '--samples=1']],
    'experiments.position_sweep': [TINY + ['--library_tokens=1', '--query_tokens=1',
                                           '--offsets=0', '--methods=rerotate']],
    'experiments.profile': [TINY + ['--prompt_tokens=1', '--decode_tokens=1', '--repeats=1']],
    'experiments.replay': [['--manifest={manifest}', '--limit=1']],
    'experiments.rope_fidelity': [TINY + ['--samples=1', '--ppl_texts=0', '--ppl_tokens=2',
                                          '--continuation_tokens=1']],
    'experiments.rope_float': [['--positions=1', '--grid_points=1', '--vectors=1',
                                '--head_dims=2', '--offsets=0', '--dtypes=float32']],
    'experiments.rope_formulation': [['--rows=1', '--slots=1', '--head_dim=2', '--repeats=1']],
    'experiments.spec_check': [TINY + ['--tokens=2']],
    'experiments.store': [['put'] + TINY + ['--store=file://{tmp}/store/',
                                            '--input={tmp}/texts.jsonl', '--host_cache_bytes=0']],
    'experiments.widen_context': [TINY + [
        '--ratio=1', '--cache_len=16', '--library_tokens=2', '--queries=1', '--query_tokens=1',
        '--sampled=0', '--misses=0']],
    'analysis.figures.__main__': [['--only=faults', '--composition_offsets=0']],
}
# (module, the run's last argument) -> what its one-line usage error must name.
USAGE_ERRORS = {
    ('experiments.context_shift', '--window=2'): '--drop=8 must be below --window=2',
    ('experiments.device_check', '--mesh_samples=1'): 'device_check checks an accelerator',
    ('experiments.graft_exactness', '--cache_len=1'): 'raise cache_len',
    ('experiments.logits', '--cache_len=1'): 'raise cache_len',
}
# Entry points not run here, and why.
NOT_RUN = {
    'experiments.distributed_check': 'it starts three processes of a jax.distributed run (minutes '
                                     'on two cores): tests/test_sharding.py runs it on tiny_gemma3',
    'experiments.hf_parity': 'it has no bounded flag, and runs the embedded 270M against HF '
                             'transformers for minutes: tests/test_hf_parity.py compares them',
}


def status() -> str:
  return subprocess.run(['git', 'status', '--porcelain', '--untracked-files=all'], cwd=REPO,
                        capture_output=True, text=True, check=True).stdout


def runs() -> set[pathlib.Path]:
  return set((REPO / 'runs').rglob('*')) if (REPO / 'runs').exists() else set()


def run(module: str, *args: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, '-m', module.removesuffix('.__main__'), *args],
                        cwd=REPO, env={**os.environ, 'PYTHONPATH': str(REPO)},
                        capture_output=True, text=True, timeout=900)


@pytest.fixture(scope='module')
def scratch(tmp_path_factory):
  """A scratch folder with a texts file and a tiny graft-exactness manifest."""
  tmp = tmp_path_factory.mktemp('edges')
  (tmp / 'texts.jsonl').write_text('{"text": "the quick brown fox"}\n{"text": "zebra"}\n')
  made = run('experiments.graft_exactness', *TINY, '--samples=1', '--continuation_tokens=2',
             f'--output={tmp}/graft.json', f'--manifest_output={tmp}/manifest.json')
  assert made.returncode == 0, made.stderr[-2000:]
  return tmp


def test_every_entry_point_is_run_at_its_edges_or_says_why_not():
  assert set(EDGES) | set(NOT_RUN) == set(cli_reference.entry_points())
  assert not set(EDGES) & set(NOT_RUN)
  assert all(last in [a[-1] for a in EDGES[module]] for module, last in USAGE_ERRORS)


@pytest.mark.parametrize('module, args', [(m, a) for m, cases in EDGES.items() for a in cases],
                         ids=lambda v: v if isinstance(v, str) else ' '.join(
                             a for a in v if a not in TINY)[:70])
def test_a_bare_run_at_the_edges_of_its_bounds_ends_well_and_leaves_git_clean(
    module, args, scratch):
  before, made_before = status(), runs()
  args = [a.format(tmp=scratch, manifest=scratch / 'manifest.json') for a in args]
  out = run(module, *args)
  made = runs() - made_before
  try:
    assert status() == before, f'{module} changed the working tree:\n{status()}'
    expected = USAGE_ERRORS.get((module, args[-1] if args else ''))
    if expected is None:
      assert out.returncode == 0, out.stderr[-3000:]
      # Its result (where it writes one) went to the run folder.
      assert all(str(p.relative_to(REPO)).startswith('runs/') for p in made)
    else:
      lines = [line for line in out.stderr.strip().splitlines()
               if not line.startswith(('I1', 'W1', 'WARNING', 'INFO', 'note: '))]
      assert out.returncode == 2 and len(lines) == 1 and lines[0].startswith('error: '), (
          out.returncode, out.stderr[-3000:])
      assert expected in lines[0] and 'Traceback' not in out.stderr, lines[0]
  finally:
    for path in sorted(made, reverse=True):
      if path.is_dir():
        path.rmdir() if not any(path.iterdir()) else None
      else:
        path.unlink()


def test_a_bare_run_writes_its_result_in_the_run_folder():
  made_before, before = runs(), status()
  out = run('experiments.spec_check', *TINY, '--tokens=4')
  assert out.returncode == 0, out.stderr[-2000:]
  written = [p for p in runs() - made_before if p.suffix == '.json']
  try:
    assert len(written) == 1 and written[0].parent == REPO / 'runs' / 'spec_check'
    assert f'wrote runs/spec_check/{written[0].name}' in out.stdout
    result = json.loads(written[0].read_text())
    # Its command names every flag that decides its bits, the engine's as resolved.
    command = result['config']['command']
    for flag in ('--model=tiny_gemma3', '--tokens=4', '--engine=spec', '--rows_per_call=256',
                 '--cache_len=4096', '--rope=float', '--dtype=float32', '--seed=0'):
      assert flag in command.split(), (flag, command)
    assert status() == before
  finally:
    for path in written:
      path.unlink()


def test_an_unforced_write_over_a_committed_result_is_refused():
  committed = REPO / 'results' / 'spec_check_tiny_gemma3_float32_relative.json'
  kept, made_before = committed.read_bytes(), runs()
  out = run('experiments.spec_check', *TINY, '--rope=relative', '--tokens=4',
            f'--output={committed.relative_to(REPO)}')
  made = [p for p in runs() - made_before if p.is_file()]
  try:
    assert out.returncode == 2, out.stderr[-2000:]
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith('error: results/spec_check_tiny_gemma3_float32_relative.json is a '
                           "committed file and this run's content differs"), line
    assert '--overwrite' in line and 'runs/spec_check/' in line
    assert committed.read_bytes() == kept
    assert len(made) == 1 and json.loads(made[0].read_text())['config']['rope'] == 'relative'
  finally:
    for path in made:
      path.unlink()


def test_redrawing_a_committed_figure_writes_only_what_is_equal(tmp_path):
  """The committed figures redraw from the committed results byte for byte, so naming figures/
  needs no --overwrite; from other results the same run is refused and figures/ is kept."""
  before = status()
  same = run('analysis.figures', '--only=faults', '--output_dir=figures')
  assert same.returncode == 0, same.stderr[-2000:]
  assert status() == before
  results = tmp_path / 'results'
  results.mkdir()
  for path in (REPO / 'results').glob('faults_*.json'):
    data = json.loads(path.read_text())
    data['summary']['trials'] += 1  # another campaign's count: the title changes
    (results / path.name).write_text(json.dumps(data))
  other = run('analysis.figures', '--only=faults', '--output_dir=figures',
              f'--results_dir={results}')
  assert other.returncode == 2
  assert other.stderr.strip().splitlines()[-1].startswith(
      "error: figures/faults.png is a committed file and this run's content differs")
  assert status() == before
