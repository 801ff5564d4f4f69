"""docs/figures.md, rendered from analysis.figures.FIGURES, the committed results and the claims'
headings in docs/claims.md.

    python -m tests.figures_reference > docs/figures.md

tests/test_figures.py renders it again and fails when docs/figures.md differs: a new figure,
result or claim updates the page by this one command.
"""

from __future__ import annotations

import pathlib
import re

from analysis import figures
from analysis import results as results_lib

REPO = pathlib.Path(__file__).resolve().parents[1]
RULES = {'most': 'the machine with the most of its results',
         'newest': "the machine of its newest result (the current code's)"}


def claims() -> dict[int, str]:
  """Claim number -> its title, from docs/claims.md's `## N. title` headings."""
  text = (REPO / 'docs' / 'claims.md').read_text()
  return {int(n): title for n, title in re.findall(r'^## (\d+)\. (.+)$', text, re.M)}


def render() -> str:
  titles = claims()
  found = results_lib.load(REPO / 'results')
  lines = [
      '# Figures',
      '',
      'Rendered by `python -m tests.figures_reference > docs/figures.md` from',
      '`analysis.figures.FIGURES`, the committed results and docs/claims.md; tests/test_figures.py',
      'fails when this page differs. Every figure backs one claim and is drawn from the results of',
      'one machine, chosen by the figure\'s rule below or by `--machine`; results that record no',
      'machine count as one, "not recorded". Its caption names the machine and the result files.',
      '',
      '```',
      'python -m analysis.figures --only=NAME               # one figure, into runs/figures/<time>/',
      'python -m analysis.figures --only=NAME --machine=CPU # from another machine\'s results',
      'python -m analysis.figures --output_dir=figures --overwrite   # redraw the committed ones',
      '```',
      '',
      '| figure | claim | machine, by rule | drawn from (`results/`) |',
      '|---|---|---|---|',
  ]
  for figure in figures.FIGURES:
    chosen, machine, _ = figures.choose(found, figure)
    names = ', '.join(f'`{path.name}`' for kind in figure.kinds for path, _ in chosen[kind])
    claim = f'{figure.claim}. {titles.get(figure.claim, "(no such claim)")}'
    lines.append(f'| `figures/{figure.name}.png` | {claim} | {RULES[figure.rule]}: '
                 f'{machine or "none yet"} | {names or "no result yet"} |')
  return '\n'.join(lines) + '\n'


if __name__ == '__main__':
  print(render(), end='')
