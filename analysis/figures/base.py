"""What every figure shares: reading the results it draws, grouping rows, axes helpers, and
saving within a two-column paper page (at most `MAX_INCHES`), with no two text labels
overlapping, a caption naming the machine and result files it was drawn from (`drawing`), and
a committed figure replaced only where told to (gemma_jax.files.check_replace)."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import io
import pathlib
import subprocess
import textwrap
from typing import Any, Callable, Iterable, Iterator, Sequence

from absl import logging
import matplotlib

matplotlib.use('Agg')  # files only, no display
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top
from matplotlib import text as mtext  # pylint: disable=g-import-not-at-top
import numpy as np

# Type sizes for a figure printed at its own size on a page (7 in wide).
matplotlib.rcParams.update({'font.size': 7, 'axes.titlesize': 7, 'axes.labelsize': 7,
                            'xtick.labelsize': 6, 'ytick.labelsize': 6, 'legend.fontsize': 6,
                            'figure.titlesize': 9})

from gemma_jax import files
from gemma_jax import rope

METHOD_ORDER = ('rerotate', 'pre_rope', 'recompute')  # graft/shift.py METHODS
ROPE_ORDER = tuple(rope.MODES)  # float first, then relative, then the controls
DPI = 120
# The largest figure: a two-column page's text block (width, height in inches); every figure is
# drawn inside it (tests/test_figures.py checks the committed figures' pixel sizes).
MAX_INCHES = (7.0, 9.0)
WIDTH = MAX_INCHES[0]

Found = dict[str, list[tuple[pathlib.Path, dict]]]  # analysis.results.load


def height(rows: int, per_row: float) -> float:
  """A figure's height for `rows` rows of panels, capped at the page's."""
  return min(MAX_INCHES[1], 0.6 + per_row * rows)


@dataclasses.dataclass(frozen=True)
class Drawing:
  """How the figures being drawn are saved: the caption each gets (the machine and result files
  it was drawn from) and whether a committed PNG whose bytes change may be replaced."""

  caption: str = ''
  overwrite: bool = False


_DRAWING = [Drawing()]


@contextlib.contextmanager
def drawing(caption: str = '', overwrite: bool = False) -> Iterator[None]:
  """`save` inside the block captions each figure and guards committed files as told."""
  _DRAWING.append(Drawing(caption, overwrite))
  try:
    yield
  finally:
    _DRAWING.pop()


def drawn_texts(fig) -> list[tuple[str, Any]]:
  """(text, window extent) of every non-empty text the figure draws when rendered: titles,
  axis and tick labels, annotations, legends; ticks outside the view are not drawn, so not
  counted."""
  found = []
  original = mtext.Text.draw

  def record(self, renderer):
    original(self, renderer)
    if self.get_visible() and self.get_text().strip():
      found.append((self.get_text(), self.get_window_extent(renderer)))

  mtext.Text.draw = record
  try:
    fig.canvas.draw()
  finally:
    mtext.Text.draw = original
  return found


def overlapping_texts(fig, tolerance: float = 0.5) -> list[tuple[str, str]]:
  """Pairs of drawn texts whose boxes overlap by more than `tolerance` pixels both ways."""
  boxes = drawn_texts(fig)
  pairs = []
  for i, (a, box_a) in enumerate(boxes):
    for b, box_b in boxes[i + 1:]:
      width = min(box_a.x1, box_b.x1) - max(box_a.x0, box_b.x0)
      height = min(box_a.y1, box_b.y1) - max(box_a.y0, box_b.y0)
      if width > tolerance and height > tolerance:
        pairs.append((a, b))
  return pairs


def clipped_texts(fig, tolerance: float = 1.0) -> list[str]:
  """Drawn texts that run past the figure's edges (cut off in the PNG)."""
  width, height = fig.canvas.get_width_height()
  return [text for text, box in drawn_texts(fig)
          if box.x0 < -tolerance or box.y0 < -tolerance or box.x1 > width + tolerance
          or box.y1 > height + tolerance]


def save(fig, path: pathlib.Path) -> pathlib.Path:
  """Writes the figure at its own size (never grown to fit what overflows it: constrained
  layout keeps its labels inside), with the current `drawing`'s caption at the bottom, after
  checking that no two of its text labels overlap; atomically, and a committed PNG only where
  its bytes stay or `drawing` allows."""
  path = pathlib.Path(path)
  width, tall = fig.get_size_inches()
  if width > MAX_INCHES[0] + 1e-6 or tall > MAX_INCHES[1] + 1e-6:
    plt.close(fig)
    raise ValueError(f'{path.name}: {width:.2f} x {tall:.2f} in is larger than a two-column '
                     f'page ({MAX_INCHES[0]} x {MAX_INCHES[1]} in)')
  settings = _DRAWING[-1]
  if settings.caption:
    fig.supxlabel(textwrap.fill(settings.caption, int(width * 24)), fontsize=5, color='dimgray')
  clipped = clipped_texts(fig)
  if clipped:
    plt.close(fig)
    raise ValueError(f'{path.name}: {len(clipped)} text labels run past the figure\'s edge, e.g. '
                     f'"{" ".join(clipped[0].split())[:60]}"')
  overlapping = overlapping_texts(fig)
  if overlapping:
    plt.close(fig)
    a, b = (' '.join(t.split())[:60] for t in overlapping[0])
    raise ValueError(f'{path.name}: {len(overlapping)} pairs of text labels overlap, e.g. '
                     f'"{a}" and "{b}"')
  buffer = io.BytesIO()
  fig.savefig(buffer, format='png', dpi=DPI)
  plt.close(fig)
  files.check_replace(str(path), buffer.getvalue(), overwrite=settings.overwrite)
  files.write_bytes(str(path), buffer.getvalue())
  return path


# --------------------------------------------------------------------------------------------
# Reading results


def position_sweep_rows(found: Found) -> list[dict[str, Any]]:
  """Rows of every position-sweep result, each completed with its file's config where it lacks
  model/weights/dtype/rope, and the file name under 'source'."""
  rows = []
  for path, data in found['position_sweep']:
    config = data.get('config') or {}
    for row in data['rows']:
      if not isinstance(row, dict) or 'method' not in row or 'offset' not in row:
        logging.warning('%s: skipping a row without method/offset', path)
        continue
      full = {key: config.get(key) for key in ('model', 'weights', 'dtype', 'rope')}
      full.update(row)
      full['source'] = path.name
      rows.append(full)
  return rows


def graft_exactness_results(found: Found) -> list[dict[str, Any]]:
  """Every graft-exactness result as {"config", "samples" (count), "equal" (count), "max_kl",
  "source"}."""
  out = []
  for path, data in found['graft_exactness']:
    summary = data['summary']
    if not summary.get('samples'):
      logging.warning('skipping %s: no samples', path)
      continue
    out.append({'config': data.get('config') or {}, 'samples': int(summary['samples']),
                'equal': int(summary['equal']), 'max_kl': summary.get('max_kl'),
                'source': path.name})
  return out


def rope_float_result(found: Found) -> dict[str, Any] | None:
  """The RoPE float analysis (the last file in name order when there are several)."""
  return found['rope_float'][-1][1] if found['rope_float'] else None


def machine(data: dict) -> str:
  """The CPU (or device) a result was made on, as its config records it: `made_on` or
  `environment`, else the first `cpu_model` inside it (older results keep it only in their
  engine fingerprints); '' where it records none."""
  config = data.get('config') if isinstance(data.get('config'), dict) else {}
  for where in (config.get('made_on'), config.get('environment')):
    if isinstance(where, dict) and where.get('cpu_model'):
      return str(where['cpu_model'])
  return _cpu_model_inside(config, depth=0)


def _cpu_model_inside(value, depth: int) -> str:
  if depth > 4:
    return ''
  if isinstance(value, dict):
    if isinstance(value.get('cpu_model'), str) and value['cpu_model']:
      return value['cpu_model']
    items = value.values()
  elif isinstance(value, list):
    items = value[:4]
  else:
    return ''
  for item in items:
    found = _cpu_model_inside(item, depth + 1)
    if found:
      return found
  return ''


def commit_time(data: dict) -> int:
  """The time of the commit a result records (0 where it records none)."""
  config = data.get('config') if isinstance(data.get('config'), dict) else {}
  commit = config.get('git_commit') or config.get('git_base_commit') or ''
  return _commit_time(commit) if commit else 0


@functools.lru_cache(maxsize=None)
def _commit_time(commit: str) -> int:
  try:
    out = subprocess.run(['git', 'show', '-s', '--format=%ct', commit], capture_output=True,
                         text=True, timeout=10, cwd=pathlib.Path(__file__).parent)
    return int(out.stdout.strip() or 0)
  except (OSError, ValueError, subprocess.SubprocessError):
    return 0


def newest_per_machine(found_results: Sequence[tuple[pathlib.Path, dict]],
                       key: Callable[[dict], Any] = lambda data: None
                       ) -> list[tuple[pathlib.Path, dict]]:
  """Of the results of each machine (and `key`), the newest: the one whose recorded commit is
  the latest (by its commit time; results without one count as oldest, then by file name)."""
  newest = {}
  for source, data in found_results:
    config = data.get('config') if isinstance(data.get('config'), dict) else {}
    commit = config.get('git_commit') or config.get('git_base_commit') or ''
    rank = (_commit_time(commit) if commit else 0, source.name)
    group = (machine(data), key(data))
    if group not in newest or rank > newest[group][0]:
      newest[group] = (rank, source, data)
  return [(source, data) for _, source, data in sorted(newest.values(), key=lambda v: v[0])]


# --------------------------------------------------------------------------------------------
# Rows and axes


def group_rows(rows: Iterable[dict[str, Any]], keys: Sequence[str]) -> dict[tuple, list[dict]]:
  groups: dict[tuple, list[dict]] = collections.OrderedDict()
  for row in sorted(rows, key=lambda r: tuple(str(r.get(k)) for k in keys)):
    groups.setdefault(tuple(row.get(k) for k in keys), []).append(row)
  return groups


def by_offset(rows: Sequence[dict[str, Any]], field: str,
              reduce: Callable) -> tuple[np.ndarray, np.ndarray]:
  """(offsets, reduce(values of `field`)) over the rows of each offset, offsets ascending;
  rows without the field (or with null) are left out."""
  values = collections.defaultdict(list)
  for row in rows:
    if row.get(field) is not None:
      values[int(row['offset'])].append(float(row[field]))
  offsets = np.array(sorted(values), np.int64)
  return offsets, np.array([reduce(values[o]) for o in offsets], np.float64)


def methods(rows: Sequence[dict[str, Any]]) -> list[str]:
  present = {r['method'] for r in rows}
  return [m for m in METHOD_ORDER if m in present] + sorted(present - set(METHOD_ORDER))


def label(model, weights, dtype) -> str:
  return f'{model} ({weights}) {dtype}' if weights else f'{model} {dtype}'


def symlog_offsets(ax) -> None:
  ax.set_xscale('symlog', linthresh=1)
  if not ax.dataLim.x0 < 0:  # no negative offsets drawn: no negative half
    ax.set_xlim(left=-0.3)
  ax.set_xlabel('offset δ (positions; symlog)')


def symlog_y(ax, values: Iterable[float]) -> None:
  """symlog y whose linear region ends below the smallest positive value, so zeros (exact
  results) stay visible on the axis instead of vanishing from a log scale."""
  values = [v for v in values if np.isfinite(v)]
  positive = [v for v in values if v > 0]
  if not positive:  # everything exact: a linear axis around 0 says it plainly
    ax.set_ylim(-0.05, 1.0)
    ax.text(0.5, 0.5, 'all values 0 (exact)', transform=ax.transAxes, ha='center', color='gray')
    return
  # The linear region ends at the power of ten at or below the smallest value: 0 and that power
  # are then a decade apart on the axis, as every two labelled powers are, so their labels
  # never collide.
  ax.set_yscale('symlog', linthresh=10.0 ** np.floor(np.log10(min(positive))), linscale=1.0)
  if all(v >= 0 for v in values):
    ax.set_ylim(bottom=0)


def title(ax, text: str, across: int = 1, fontsize: float = 6) -> None:
  """A panel title wrapped to the width of a panel among `across` in a row (its lines kept; a
  character taken as 0.6 of the type size wide, the panel as 0.6 of its share of the figure)."""
  width = ax.figure.get_size_inches()[0] / across * 0.6
  chars = max(10, int(width * 72 / (fontsize * 0.6)))
  ax.set_title('\n'.join(textwrap.fill(line, chars) for line in text.split('\n')),
               fontsize=fontsize)


def small_legend(ax, **kwargs) -> None:
  ax.legend(fontsize=6, title_fontsize=6, **kwargs)
