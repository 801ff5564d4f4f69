"""The command-line tools, run as a researcher runs them (python -m experiments.<name>)."""

import collections
import json
import os
import pathlib
import re
import subprocess
import sys

from absl import flags
import numpy as np
import pytest

from tests import cli_reference

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


ENTRY_POINTS = cli_reference.entry_points()  # every `python -m` tool of the project
DEFINED = {}  # module -> its flags (name -> Flag), aliases and absl's own left out


def flags_of(module: str) -> dict:
  if module not in DEFINED:
    DEFINED[module] = cli_reference.own(cli_reference.defined_flags(module))
  return DEFINED[module]


def _group_defaults() -> dict:
  """name -> default, for the flags of experiments/common.py's shared groups."""
  return {name: flag.default for rows in cli_reference.shared_groups().values()
          for name, flag in rows.items()}


def _element_kind(flag) -> str:
  """A flag's type, repeated flags by their element type (a tool that sweeps a value takes the
  same flag repeated: one syntax per value)."""
  parser = flag.parser
  if isinstance(parser, flags.EnumParser):
    return 'enum'
  return type(parser).__name__


def _default(flag) -> str:
  """A flag's default, a repeated flag's of one value as that value (its sweep of one)."""
  value = flag.default
  if isinstance(flag, flags.MultiFlag):
    value = None if not value else value[0] if len(value) == 1 else tuple(value)
  return repr(value)


def test_one_name_one_type_and_one_meaning_across_every_entry_point():
  """A flag name that two entry points define has one element type, a help text that starts
  with its one meaning (experiments/common.py MEANINGS), and one default, unless the tool
  declares its own with a reason (its OWN_DEFAULTS)."""
  import importlib
  from experiments import common
  by_name = collections.defaultdict(dict)
  for module in ENTRY_POINTS:
    for name, flag in flags_of(module).items():
      by_name[name][module] = flag
  shared_defaults = _group_defaults()
  problems = []
  for name, tools in sorted(by_name.items()):
    if len(tools) < 2:
      continue
    kinds = {_element_kind(f) for f in tools.values()}
    if len(kinds) > 1:
      problems.append(f'--{name} has {len(kinds)} types: ' + ', '.join(
          f'{m}: {_element_kind(f)}' for m, f in tools.items()))
    meaning = common.MEANINGS.get(name)
    group = name in shared_defaults
    if meaning is None and not group:
      problems.append(f'--{name} is defined by {len(tools)} tools but has no one meaning in '
                      'experiments/common.py MEANINGS')
    for module, flag in tools.items():
      if meaning and not cli_reference.plain_help(flag).startswith(meaning):
        problems.append(f'--{name} of {module}: help does not start with its meaning '
                        f'"{meaning}": {flag.help[:60]!r}')
    defaults = collections.Counter(_default(f) for f in tools.values())
    usual = (repr(shared_defaults[name]) if group
             else max(defaults, key=lambda d: (defaults[d], d)))
    for module, flag in tools.items():
      if _default(flag) == usual:
        continue
      own = getattr(importlib.import_module(module), 'OWN_DEFAULTS', {})
      if not own.get(name):
        problems.append(f'--{name} of {module} defaults to {flag.default!r}, not {usual}, '
                        'without a reason in its OWN_DEFAULTS')
  assert not problems, '\n'.join(problems)


def test_every_entry_point_defaults_to_the_spec_engine():
  for module in ENTRY_POINTS:
    engine = flags_of(module).get('engine')
    if engine is not None:
      assert engine.default == 'spec', (module, engine.default)


# "default" followed by a value in a help text: the value must be the flag's default. A behaviour
# without a value (a flag left unset) is written "unset: ...".
DEFAULT_IN_HELP = re.compile(r"(?<![`'\"\w])default(?![`'\"\w-])\s*:?\s*(?:is\s+)?"
                             r"`?'?([\w./+-]+)")


def named_defaults(text: str) -> list[str]:
  return DEFAULT_IN_HELP.findall(' '.join(text.split()))


def test_help_texts_name_only_true_defaults():
  """Where a help text names a default, it is the flag's (absl prints the real one beside it;
  a help text repeating another misleads)."""
  wrong = []
  for module in ENTRY_POINTS:
    for name, flag in flags_of(module).items():
      for value in named_defaults(cli_reference.plain_help(flag)):
        actual = flag.default
        actual = (','.join(map(str, actual)) if isinstance(actual, (list, tuple))
                  else str(actual).lower() if isinstance(actual, bool) else str(actual))
        if value.rstrip('.,') != actual:
          wrong.append(f'--{name} of {module}: help names default {value!r}, the default is '
                       f'{actual!r}')
  assert not wrong, '\n'.join(wrong)


def test_a_help_text_naming_a_wrong_default_is_found():
  assert named_defaults('Samples drawn (default: 50).') == ['50']
  assert named_defaults('KV slots; default 4096 where unset.') == ['4096']
  assert named_defaults("the `default` engine: XLA's; unset: eigen") == []


@pytest.mark.parametrize('module', ENTRY_POINTS)
def test_every_numeric_and_list_flag_is_parsed_and_bounded(module):
  """Counts, lengths, sizes, budgets, seeds, fractions and lists: an impossible value (here -3,
  or a word where numbers go) is refused as the flags are read, a one-line usage error
  (experiments/common.py), never run."""
  from experiments import common
  defined = flags_of(module)
  source = (REPO / (module.replace('.', '/') + '.py')).read_text()
  assert 'def define_flags' in source, f'{module} defines its flags outside define_flags'
  values = cli_reference.defined_flags(module)
  for name, flag in defined.items():
    parser = flag.parser
    if isinstance(parser, (flags.IntegerParser, flags.FloatParser)):
      assert parser.lower_bound is not None, f'--{name} of {module} has no lower bound'
      with pytest.raises(ValueError):
        parser.parse('-3')
    elif isinstance(parser, flags.ListParser):
      checked = isinstance(parser, common.CheckedList) or values[name].validators
      assert checked, f'--{name} of {module}: a list whose items are not checked as read'
      if isinstance(parser, common.CheckedList):
        with pytest.raises(ValueError):
          parser.parse('-3,not-a-thing' if parser.integers else 'not-a-thing')


def test_docs_cli_md_is_rendered_from_the_flags():
  """docs/cli.md is what `python -m tests.cli_reference` renders: no flag, default or help text
  differs from the code."""
  assert (REPO / 'docs' / 'cli.md').read_text() == cli_reference.render(), (
      'docs/cli.md is stale: python -m tests.cli_reference > docs/cli.md')


def test_old_spellings_are_read_as_todays_until_their_release():
  from experiments import common
  argv, notes = common.modernize('experiments.mesh_exactness', [
      'x', '--meshes=,model:2,model:2+data:2', '--layouts=gather,split', '--block_size=16',
      '--samples=3'])
  assert argv == ['x', '--mesh=', '--mesh=model:2', '--mesh=model:2,data:2',
                  '--mesh_layout=gather', '--mesh_layout=split', '--rows_per_call=16',
                  '--samples=3']
  assert len(notes) == 3 and all('0.2.0' in n for n in notes)
  # A spelling is read as another only in the tools that used it.
  assert common.modernize('experiments.replay', ['x', '--manifest=m.json'])[0] == [
      'x', '--manifest=m.json']
  assert common.modernize('experiments.flywheel', ['x', '--manifest=m.json'])[0] == [
      'x', '--manifest_output=m.json']


# Commands recorded before a flag changed its meaning, not only its name: no spelling maps them.
# Their manifests replay from their records (experiments.replay), not from the command.
MEANING_CHANGED = {
    'flywheel_arithmetic_intel.json': 'before 63d8fa7, --budget was the tokens of one attempt',
    'flywheel_units_intel.json': 'before 63d8fa7, --budget was the tokens of one attempt',
}


def _recorded_commands():
  """(file, command) of every committed result and manifest that records its command."""
  found = []
  for path in sorted((REPO / 'results').glob('*.json')) + sorted(
      (REPO / 'manifests').glob('*.json')):
    data = json.loads(path.read_text())
    config = data.get('config') if isinstance(data.get('config'), dict) else {}
    command = config.get('command')
    if (isinstance(command, str) and command.startswith('python -m ')
        and path.name not in MEANING_CHANGED):
      found.append((path.name, command))
  return found


def test_every_committed_command_parses_with_todays_flags():
  """The commands committed results and manifests record still parse, their old spellings read
  as today's (experiments/common.py OLD_SPELLINGS): none names a flag that no longer exists."""
  import shlex
  from experiments import common
  commands = _recorded_commands()
  assert len(commands) > 40
  failed = []
  for name, command in commands:
    words = shlex.split(command)
    module = words[2]
    module = {'analysis.figures': 'analysis.figures.__main__'}.get(module, module)
    if module not in ENTRY_POINTS:
      failed.append(f'{name}: {module} is no entry point')
      continue
    argv, _ = common.modernize(module, ['x'] + words[3:])
    try:
      cli_reference.parse(module, argv)
    except flags.Error as e:
      failed.append(f'{name}: {e}')
  assert not failed, '\n'.join(failed)


def test_a_recorded_command_names_no_flag_a_library_defines(monkeypatch):
  """orbax defines absl flags of its own on import; a result's recorded command names the
  project's flags only (today's tools would not parse the library's)."""
  import orbax.checkpoint  # noqa: F401
  from experiments import common
  assert any(m.startswith('orbax') for m in flags.FLAGS.flags_by_module_dict())
  monkeypatch.setattr(common, '_GIVEN_ARGV', ['--seed=3'])
  command = common.recorded_command()
  assert '--seed=3' in command and 'orbax' not in command, command


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
      f'--manifest_output={manifest}', '--continuation_tokens=4')
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
  assert bad.returncode == 2
  assert bad.stderr.strip() == 'error: flag --offsets=-3: -3 is below 0'


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
      f'--output={output}', f'--manifest_output={manifest}', '--continuation_tokens=4')
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


def test_the_readme_is_a_map_whose_commands_are_todays():
  """README.md: at most 200 lines; every `python -m` command it shows parses with today's flags
  (no old spelling), every figure is listed with its --only, and its set-up commands are the
  ones CI runs."""
  import shlex
  readme = (REPO / 'README.md').read_text()
  assert len(readme.splitlines()) <= 200
  commands = [c for c in re.findall(r'`(python -m (?:experiments|analysis)\.[^`]+)`', readme)
              if '<name>' not in c and 'NAME' not in c]
  assert len(commands) >= 12, commands
  for command in commands:
    words = shlex.split(command.split(' (')[0])
    module = {'analysis.figures': 'analysis.figures.__main__'}.get(words[2], words[2])
    assert module in ENTRY_POINTS, command
    cli_reference.parse(module, ['x'] + words[3:])  # raises on an unknown or old flag
  from analysis import figures
  for figure in figures.FIGURES:
    assert f'--only={figure.name}`' in readme, figure.name
  assert ("python3 -m venv .venv && .venv/bin/pip install -q -e '.[test]' && .venv/bin/python "
          '-m pytest && bash .ci/bazel_test.sh') in readme
  assert ('python3 -m venv .venv && .venv/bin/pip install -q -e . && .venv/bin/python -m '
          'experiments.main') in readme
