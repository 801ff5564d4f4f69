"""The input audit (docs/determinism.md, "The input audit"): every module that draws random
numbers is named there with why its bits are the same on every machine, every module named
exists, and the model's constants that come from the C library's pow are the same binary32
numbers whatever pow's last bit.
"""

import ast
import decimal
import importlib.util
import pathlib
import re

import numpy as np

from gemma_jax.config import get_config, names

REPO = pathlib.Path(__file__).resolve().parents[1]
AUDITED = ('gemma_jax', 'graft', 'experiments', 'analysis')
# Calls that draw random numbers (or make a generator that does): a module making one is an
# input's source and must be in the table.
DRAWS = {'standard_normal', 'normal', 'uniform', 'random', 'choice', 'integers', 'permutation',
         'shuffle', 'gumbel', 'categorical', 'truncated_normal', 'exponential', 'bits', 'bytes',
         'randint', 'rand', 'randn', 'bernoulli', 'poisson', 'beta', 'gamma', 'laplace',
         'default_rng', 'RandomState', 'PRNGKey', 'Rngs', 'normal_at', 'below'}


def audit_table(text: str) -> list[dict]:
  """The rows of the audit table: {'input', 'modules', 'recorded', 'why'}."""
  section = text.split('### The input audit', 1)[1]
  rows = []
  for line in section.splitlines():
    if not line.startswith('|'):
      if rows:
        break
      continue
    cells = [c.strip() for c in line.strip('|').split('|')]
    if cells[0] in ('input', '---') or set(cells[0]) <= {'-'}:
      continue
    rows.append({'input': cells[0], 'modules': re.findall(r'`([\w.]+)`', cells[1]),
                 'recorded': cells[2], 'why': cells[3]})
  return rows


def audited_modules(rows) -> set[str]:
  return {m for row in rows for m in row['modules']}


def drawing_modules(roots=AUDITED) -> dict[str, list[int]]:
  """module -> the lines of its calls in DRAWS (attribute or name), from the source (ast)."""
  out = {}
  for root in roots:
    for path in sorted((REPO / root).rglob('*.py')):
      module = '.'.join(path.relative_to(REPO).with_suffix('').parts)
      module = module[:-len('.__init__')] if module.endswith('.__init__') else module
      lines = []
      for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
          f = node.func
          name = f.attr if isinstance(f, ast.Attribute) else getattr(f, 'id', None)
          if name in DRAWS:
            lines.append(node.lineno)
      if lines:
        out[module] = lines
  return out


def unaudited(rows, drawing) -> list[str]:
  listed = audited_modules(rows)
  return [f'{m}:{lines[0]}' for m, lines in sorted(drawing.items()) if m not in listed]


def test_every_module_that_draws_random_numbers_is_in_the_audit():
  rows = audit_table((REPO / 'docs' / 'determinism.md').read_text())
  assert len(rows) >= 10 and all(r['why'] and r['modules'] for r in rows), rows
  missing = unaudited(rows, drawing_modules())
  assert not missing, ('modules drawing random numbers that docs/determinism.md\'s input audit '
                       f'does not name (say why their bits are machine-independent): {missing}')


def test_every_module_the_audit_names_exists():
  rows = audit_table((REPO / 'docs' / 'determinism.md').read_text())
  absent = sorted(m for m in audited_modules(rows) if importlib.util.find_spec(m) is None)
  assert not absent, f'the input audit names modules that do not exist: {absent}'


def test_the_audit_check_finds_a_planted_draw(tmp_path):
  """A module with a draw the table does not name is reported, with its line."""
  rows = audit_table((REPO / 'docs' / 'determinism.md').read_text())
  drawing = drawing_modules()
  assert 'gemma_jax.rope' not in drawing
  planted = {**drawing, 'gemma_jax.rope': [12]}
  assert 'gemma_jax.rope:12' in unaudited(rows, planted)
  assert 'gemma_jax.rope:12' not in unaudited(rows, drawing)
  without = [r for r in rows if 'gemma_jax.sampling' not in r['modules']]
  assert any(m.startswith('gemma_jax.sampling:') for m in unaudited(without, drawing))


def test_the_constants_from_pow_are_the_same_binary32_whatever_its_last_bit():
  """x^-1/2 of every config's width, query scale and 2 (gemma_jax/modules.py and
  the interpreter compute them with Python's `**`, the C library's pow in binary64, then
  round to binary32): the exact value is farther than 2^-40 (relative) from a binary32
  rounding boundary, and this machine's pow gives the binary32 nearest to it; so any pow
  within an ulp of binary64 (2^-52) gives that binary32 on every machine."""
  context = decimal.Context(prec=60)
  values = {2}
  for name in names():
    config = get_config(name)
    values.add(config.embed_dim)
    if config.query_pre_attn_scalar:
      values.add(config.query_pre_attn_scalar)
  for x in sorted(values):
    exact = context.divide(1, context.sqrt(decimal.Decimal(x)))
    nearest = np.float32(float(exact))
    boundaries = [(decimal.Decimal(float(nearest)) + decimal.Decimal(float(n))) / 2
                  for n in (np.nextafter(nearest, np.float32(0)),
                            np.nextafter(nearest, np.float32(1)))]
    margin = min(abs(exact - b) for b in boundaries) / exact
    assert margin > decimal.Decimal(2) ** -40, (x, margin)
    assert np.float32(x ** -0.5) == nearest, x
