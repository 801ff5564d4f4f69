"""docs/cli.md, rendered from the entry points' own flag definitions.

    python -m tests.cli_reference > docs/cli.md

tests/test_experiments.py renders it again and fails when docs/cli.md differs, so the page
cannot drift from the flags. Each entry point's flags are defined into a FlagValues of their own
(`defined_flags`), never into absl's global one.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import pathlib

from absl import flags

REPO = pathlib.Path(__file__).resolve().parents[1]

# absl's own flags (logging, app): not the project's.
ABSL_FLAGS = frozenset({
    'alsologtostderr', 'log_dir', 'logger_levels', 'logtostderr', 'showprefixforinfo',
    'stderrthreshold', 'verbosity', 'v', 'run_with_pdb', 'pdb', 'pdb_post_mortem',
    'run_with_profiling', 'profile_file', 'use_cprofile_for_profiling', 'only_check_args',
    'op_conversion_fallback_to_while_loop', 'delta_threshold', 'helpshort', 'helpfull',
    'helpxml', 'help', '?', 'flagfile', 'undefok'})


def entry_points() -> list[str]:
  """Every `python -m` tool: the experiments that run through the shared runner, and
  analysis.figures."""
  names = sorted(f'experiments.{p.stem}' for p in (REPO / 'experiments').glob('*.py')
                 if "if __name__ == '__main__':" in p.read_text()
                 and '\n  common.run(main)' in p.read_text())
  return names + ['analysis.figures.__main__']


def defined_flags(module: str, definer: str = 'define_flags',
                  runner: bool = False) -> flags.FlagValues:
  """The flags `module.definer()` defines (and the runner's, with `runner`), in a FlagValues
  of their own."""
  fresh = flags.FlagValues()
  saved = {}
  for name in dir(flags):  # every definer and validator that takes flag_values: onto `fresh`
    function = getattr(flags, name)
    if (callable(function) and not inspect.isclass(function) and name[0] != '_'
        and 'flag_values' in getattr(inspect.signature(function), 'parameters', {})):
      saved[name] = function
      setattr(flags, name, lambda *a, _f=function, **k: _f(*a, **{'flag_values': fresh, **k}))
  saved_global = flags.FLAGS
  flags.FLAGS = fresh
  try:
    getattr(importlib.import_module(module), definer)()
    if runner:
      importlib.import_module('experiments.common').define_runner_flags()
  finally:
    flags.FLAGS = saved_global
    for name, function in saved.items():
      setattr(flags, name, function)
  return fresh


def parse(module: str, argv: list[str]) -> flags.FlagValues:
  """argv parsed by the entry point's flags and the runner's (raises flags.Error as its run
  would refuse it)."""
  values = defined_flags(module, runner=True)
  values(argv)
  return values


def own(values: flags.FlagValues) -> dict[str, flags.Flag]:
  """name -> Flag, aliases and absl's own flags left out."""
  return {name: values[name] for name in values
          if name == values[name].name and name not in ABSL_FLAGS}


def shared_groups() -> dict[str, dict[str, flags.Flag]]:
  """The shared flag groups of experiments/common.py, each as its definer makes it."""
  groups = {}
  for title, definer in (('model', 'define_model_flags'), ('RoPE', 'define_rope_flag'),
                         ('engine', 'define_engine_flags'), ('store', 'define_store_flags'),
                         ('runner', 'define_runner_flags')):
    groups[title] = own(defined_flags('experiments.common', definer))
  return groups


def kind(flag: flags.Flag) -> str:
  parser = flag.parser
  name = type(parser).__name__
  if isinstance(parser, flags.EnumParser):
    text = ' \\| '.join(parser.enum_values)
  elif type(parser).__name__ == 'CheckedList':
    words = ' \\| '.join(parser.words)
    text = (f'list of int{_bounds(parser)}' + (f' or {words}' if words else '')
            if parser.integers else f'list of {words}')
  elif isinstance(parser, flags.ListParser):
    text = 'list'
  elif 'Integer' in name:
    text = 'int' + _bounds(parser)
  elif 'Float' in name:
    text = 'float' + _bounds(parser)
  elif 'Boolean' in name:
    text = 'bool'
  else:
    text = 'string'
  return ('repeated ' if isinstance(flag, flags.MultiFlag) else '') + text


def _bounds(parser) -> str:
  low, high = getattr(parser, 'lower_bound', None), getattr(parser, 'upper_bound', None)
  if low is None and high is None:
    return ''
  return f" [{'' if low is None else low}, {'' if high is None else high}]"


def default(flag: flags.Flag) -> str:
  value = flag.default
  if value is None:
    return '(none)'
  if isinstance(value, bool):
    return 'true' if value else 'false'
  if isinstance(value, (list, tuple)):
    return ','.join(str(v) for v in value) if value else "''"
  return f'`{value}`' if str(value) else "''"


def plain_help(flag: flags.Flag) -> str:
  """The help text as its definition wrote it, whitespace folded (absl prepends an enum's
  choices: left out)."""
  text = ' '.join((flag.help or '').split())
  if (isinstance(flag.parser, (flags.EnumParser, flags.EnumClassParser))
      or type(flag.parser).__name__ == 'EnumParser') and text.startswith('<'):
    text = text.split('>: ', 1)[-1]
  return text


def help_text(flag: flags.Flag) -> str:
  return plain_help(flag).replace('|', '\\|')


def table(rows: dict[str, flags.Flag], differing: dict[str, str] | None = None) -> list[str]:
  lines = ['| flag | type | default | meaning |', '|---|---|---|---|']
  for name in sorted(rows):
    flag = rows[name]
    lines.append(f'| `--{name}` | {kind(flag)} | {default(flag)} | {help_text(flag)} |')
  return lines


def command(module: str) -> str:
  """How the entry point is run: python -m NAME."""
  return module.removesuffix('.__main__')


def summary(module: str) -> list[str]:
  """The entry point's docstring (a package's __main__: the package's): its first paragraph
  and its usage lines."""
  path = REPO / (module.replace('.', '/') + '.py')
  if module.endswith('.__main__'):
    path = path.parent / '__init__.py'
  doc = ast.get_docstring(ast.parse(path.read_text())) or ''
  paragraphs = doc.split('\n\n')
  first = ' '.join(paragraphs[0].split())
  usage = [line.strip() for p in paragraphs[1:3] for line in p.splitlines()
           if line.strip().startswith(('python -m', 'bash '))]
  out = [first, '']
  if usage:
    out += ['```'] + usage + ['```', '']
  return out


def render() -> str:
  groups = shared_groups()
  lines = [
      '# Command-line tools',
      '',
      'Rendered from the flag definitions by `python -m tests.cli_reference > docs/cli.md`;',
      'tests/test_experiments.py fails when this page differs from them. `--help` on any tool',
      'prints the same. Every tool runs through one runner (experiments/common.py `run`): an',
      'expected failure prints one line `error: ...` and exits with status 2 (`--verbose` shows',
      'the traceback); a check that finds a differing hash exits with status 1.',
      '',
      '## Shared flags',
      '',
      'A tool that takes a group takes all of it, with the same meaning everywhere; a tool\'s own',
      'default, where it differs, is listed under the tool.',
      '',
  ]
  for title, rows in groups.items():
    lines += [f'### {title}', ''] + table(rows) + ['']
  shared = {name for rows in groups.values() for name in rows}
  for module in entry_points():
    values = own(defined_flags(module))
    taken = [title for title, rows in groups.items()
             if set(rows) <= set(values) or title == 'runner']  # every tool runs in the runner
    differing = {name: flag for name, flag in values.items() if name in shared and
                 any(name in rows and default(rows[name]) != default(flag)
                     for rows in groups.values())}
    mine = {name: flag for name, flag in values.items() if name not in shared}
    lines += [f'## {command(module)}', ''] + summary(module)
    if taken:
      lines += ['Shared flags: ' + ', '.join(taken) + '.', '']
    if differing:
      lines += ['Shared flags with a default of its own:', ''] + table(differing) + ['']
    if mine:
      lines += table(mine) + ['']
  return '\n'.join(lines).rstrip('\n') + '\n'


if __name__ == '__main__':
  print(render(), end='')
