"""The command-line tools, run as a researcher runs them (python -m experiments.<name>)."""

import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
TINY = ['--model=tiny_gemma3', '--weights=random:0']


def run(module, *args, check=True):
  out = subprocess.run([sys.executable, '-m', f'experiments.{module}', *args], cwd=REPO,
                       env={**os.environ, 'PYTHONPATH': str(REPO)}, capture_output=True,
                       text=True, timeout=900)
  if check:
    assert out.returncode == 0, out.stderr[-3000:]
  return out


def test_write_json_is_atomic_and_readable_by_others(tmp_path):
  from gemma_jax import files
  path = tmp_path / 'out' / 'result.json'
  files.write_json(str(path), {'a': [1, 2]})
  assert json.loads(path.read_text()) == {'a': [1, 2]}
  umask = os.umask(0)
  os.umask(umask)
  assert path.stat().st_mode & 0o777 == 0o666 & ~umask
  assert [p.name for p in path.parent.iterdir()] == ['result.json']  # no staging file left


def test_generate_prints_prompt_and_continuation_and_samples_reproducibly():
  greedy = run('generate', *TINY, '--prompt=hello there', '--max_new_tokens=8').stdout
  assert greedy.startswith('hello there') and len(greedy.strip()) > len('hello there')
  sampled = [run('generate', *TINY, '--prompt=hello', '--max_new_tokens=12', '--temperature=1.0',
                 f'--seed={seed}').stdout for seed in (1, 1, 2)]
  assert sampled[0] == sampled[1] != sampled[2]


def test_generate_refuses_an_empty_prompt_and_an_unknown_model():
  empty = run('generate', *TINY, '--prompt=', check=False)
  assert empty.returncode != 0 and 'empty' in empty.stderr
  unknown = run('generate', '--model=gemma9_1t', check=False)
  assert unknown.returncode != 0 and "unknown model config 'gemma9_1t'" in unknown.stderr


ENTRY_POINTS = sorted(p.stem for p in (REPO / 'experiments').glob('*.py')
                      if 'common.run(main)' in p.read_text())


def _defined_flags(module_name):
  """The flags an entry point defines (its define_flags()), in a FlagValues of their own."""
  import importlib
  import inspect
  from absl import flags
  fresh = flags.FlagValues()
  saved = {'FLAGS': flags.FLAGS}
  flags.FLAGS = fresh
  for name in dir(flags):  # every definer and validator that takes flag_values: onto `fresh`
    function = getattr(flags, name)
    if (callable(function) and not inspect.isclass(function) and name[0] != '_'
        and 'flag_values' in getattr(inspect.signature(function), 'parameters', {})):
      saved[name] = function
      setattr(flags, name, lambda *a, _f=function, **k: _f(*a, **{'flag_values': fresh, **k}))
  try:
    importlib.import_module(f'experiments.{module_name}').define_flags()
  finally:
    for name, function in saved.items():
      setattr(flags, name, function)
  return fresh


@pytest.mark.parametrize('module', ENTRY_POINTS)
def test_every_integer_flag_declares_its_bound(module):
  """Counts, lengths, sizes, budgets, seeds: an impossible value (here -3) is refused as the
  flags are read, a one-line usage error (experiments/common.py), never run."""
  from absl import flags
  source = (REPO / 'experiments' / f'{module}.py').read_text()
  if 'def define_flags' not in source:
    assert 'DEFINE_integer' not in source, f'{module} defines integer flags outside define_flags'
    return
  defined = _defined_flags(module)
  integers = [name for name in defined if isinstance(defined[name].parser, flags.IntegerParser)]
  assert integers or 'DEFINE_integer' not in source
  for name in integers:
    parser = defined[name].parser
    assert parser.lower_bound is not None, f'--{name} of experiments.{module} has no lower bound'
    with pytest.raises(ValueError):
      parser.parse('-3')


def test_an_impossible_flag_value_is_a_one_line_usage_error():
  out = run('generate', *TINY, '--prompt=hello', '--max_new_tokens=-3', check=False)
  assert out.returncode == 2 and not out.stdout, (out.stdout, out.stderr[-2000:])
  assert out.stderr.strip() == 'error: flag --max_new_tokens=-3: -3 is not a positive integer'


def test_logits_writes_ids_last_logits_and_argmax(tmp_path):
  texts = tmp_path / 'in.jsonl'
  texts.write_text('\n'.join(json.dumps({'text': t}) for t in ['abc def', 'zebra']) + '\n')
  out = tmp_path / 'out.npz'
  run('logits', *TINY, f'--input={texts}', f'--output={out}')
  data = np.load(out)
  assert sorted(data.files) == ['argmax_0', 'argmax_1', 'ids_0', 'ids_1', 'last_0', 'last_1']
  for i in range(2):
    assert data[f'ids_{i}'].dtype == np.int32 and data[f'ids_{i}'][0] == 2  # BOS
    assert data[f'last_{i}'].dtype == np.float32 and data[f'last_{i}'].shape == (512,)
    assert data[f'argmax_{i}'].shape == data[f'ids_{i}'].shape
    assert data[f'argmax_{i}'][-1] == np.argmax(data[f'last_{i}'])


def test_logits_refuses_bad_input_and_writes_nothing(tmp_path):
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"txt": "no text field"}\n')
  out = tmp_path / 'out.npz'
  result = run('logits', *TINY, f'--input={bad}', f'--output={out}', check=False)
  assert result.returncode != 0 and '"text"' in result.stderr
  assert not out.exists()


@pytest.mark.slow
def test_graft_exactness_schema_and_replay_detects_a_changed_hash(tmp_path):
  output, manifest = tmp_path / 'r.json', tmp_path / 'm.json'
  run('graft_exactness', *TINY, '--samples=4', '--cache_len=2304', f'--output={output}',
      f'--manifest={manifest}', '--continuation_tokens=4')
  result = json.loads(output.read_text())
  assert {'model', 'weights', 'dtype', 'engine', 'attention'} <= set(result['config'])
  assert set(result['summary']) >= {'samples', 'equal', 'max_kl', 'argmax_agreement',
                                    'continuations_equal'}
  for row in result['samples']:
    assert set(row) >= {'library_tokens', 'query_tokens', 'fresh_sha256', 'graft_sha256', 'equal',
                        'kl', 'argmax_agreement', 'continuation_equal'}
  assert result['summary'] == {'samples': 4, 'equal': 4, 'max_kl': 0.0, 'argmax_agreement': 1.0,
                               'continuations_equal': 4}

  assert 'reproduce' in run('replay', f'--manifest={manifest}').stdout
  tampered = json.loads(manifest.read_text())
  tampered['samples'][2]['graft_sha256'] = '0' * 64
  manifest.write_text(json.dumps(tampered))
  failed = run('replay', f'--manifest={manifest}', check=False)
  assert failed.returncode == 1
  assert 'sample 2: graft_sha256' in failed.stdout and 'sample 1' not in failed.stdout


def test_graft_exactness_reads_pairs_from_jsonl(tmp_path):
  pairs = tmp_path / 'pairs.jsonl'
  pairs.write_text(json.dumps({'library': 'the quick brown fox', 'query': ' jumps'}) + '\n')
  output = tmp_path / 'r.json'
  run('graft_exactness', *TINY, f'--input={pairs}', f'--output={output}',
      '--continuation_tokens=2', '--cache_len=256')
  rows = json.loads(output.read_text())['samples']
  assert len(rows) == 1 and rows[0]['equal'] and rows[0]['query_tokens'] > 0


def test_graft_exactness_offsets_under_relative_rope(tmp_path):
  # Every own-text graft at another position is exact; the library after other tokens is not.
  pairs, output = tmp_path / 'pairs.jsonl', tmp_path / 'r.json'
  pairs.write_text(''.join(json.dumps({'library': text, 'query': ' and then'}) + '\n' for text in
                           ('the quick brown fox jumps over the lazy dog',
                            'a stitch in time saves nine, or so they say')))
  out = run('graft_exactness', *TINY, '--rope=relative', f'--input={pairs}',
            '--offsets=0,5,3000', '--preceded_up_to=8', '--continuation_tokens=2',
            '--cache_len=2048', f'--output={output}')
  result = json.loads(output.read_text())
  summary = result['summary']
  assert result['config']['rope'] == 'relative' and summary['offsets'] == [0, 5, 3000]
  assert summary['samples'] == summary['equal'] == 6
  assert summary['preceded']['samples'] == 2 and summary['preceded']['equal'] == 0
  assert 'after other tokens: 0/2' in out.stdout
  bad = run('graft_exactness', *TINY, '--offsets=-3', check=False)
  assert bad.returncode != 0 and 'δ >= 0' in bad.stderr.strip().splitlines()[-1]


def test_relative_rope_with_pallas_attention_is_refused_in_one_line():
  out = run('graft_exactness', *TINY, '--rope=relative', '--engine=default', '--attention=pallas',
            '--samples=1',
            check=False)
  last = out.stderr.strip().splitlines()[-1]
  assert out.returncode != 0 and 'Traceback' not in out.stderr
  assert "'relative' RoPE mode needs attention in ('xla', 'tiled')" in last


def test_rope_fidelity_compares_relative_with_float(tmp_path):
  output = tmp_path / 'f.json'
  run('rope_fidelity', '--model=tiny_gemma4', '--weights=random:0', '--samples=1',
      '--ppl_texts=1', '--ppl_tokens=64', '--continuation_tokens=4', f'--output={output}')
  result = json.loads(output.read_text())
  summary = result['summary']
  assert result['schema'].startswith('rope_fidelity')
  assert summary['texts'] == len(result['texts']) > 1
  # Rounding apart, the same model: small, nonzero logit differences (random weights, 4 layers).
  assert 0 < summary['max_abs'] < 1e-2 and summary['min_argmax_agreement'] > 0.99
  ppl = summary['perplexity']
  assert abs(ppl['relative'] / ppl['float'] - 1) < 1e-4


def test_batch_slots_run_replays_unbatched(tmp_path):
  # 4 samples in slots of 3 (the last batch is partial); the replay recomputes every sample
  # alone, so a batched hash that differed from the unbatched one would fail it.
  output, manifest = tmp_path / 'r.json', tmp_path / 'm.json'
  run('graft_exactness', *TINY, '--samples=4', '--cache_len=2304', '--batch_slots=3',
      f'--output={output}', f'--manifest={manifest}', '--continuation_tokens=4')
  result = json.loads(output.read_text())
  assert result['config']['batch_slots'] == 3
  assert result['summary']['equal'] == 4 and result['summary']['continuations_equal'] == 4
  assert 'reproduce' in run('replay', f'--manifest={manifest}').stdout


def test_the_heartbeat_says_what_runs_while_a_step_prints_nothing(capsys):
  import threading
  from experiments import common
  done = threading.Event()
  with common.heartbeat(lambda: 'compiling', every=0.05):
    done.wait(0.5)
  lines = capsys.readouterr().out.splitlines()
  assert lines and all(line.endswith('] compiling') for line in lines)
  assert len(lines) <= 11  # at most one a beat, and none after the block
