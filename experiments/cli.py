"""The command line's one vocabulary: what a flag name means in every entry point (`MEANINGS`),
which flags decide no bit (`NOT_BITS`), the old spellings committed results record and the
release that retires each (`OLD_SPELLINGS`, read by `modernize`), and comma lists checked as the
flags are read (`CheckedList`, `define_list`). experiments/common.py's runner uses them;
tests/test_experiments.py walks every entry point's flags against them.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

from absl import flags


# A name two entry points define means one thing: its help text starts with this meaning
# (tests/test_experiments.py walks every entry point's flags against it).
MEANINGS = {
    'output': 'The one result file this run writes',
    'output_dir': 'The directory this run writes',
    'manifest': 'A manifest to read',
    'manifest_output': 'Also write a replayable manifest of this run here',
    'samples': 'Samples',
    'seed': 'Seed',
    'input': 'JSONL input',
    'store': 'Store URL',
    'host_cache_bytes': 'Bound of the store\'s host LRU',
    'offsets': 'Offsets δ',
    'library_tokens': 'Library length in tokens',
    'query_tokens': 'Query length in tokens',
    'prompt_tokens': 'Prompt length in tokens',
    'decode_tokens': 'Greedy decode steps',
    'continuation_tokens': 'Greedy tokens compared',
    'repeats': 'Timed repetitions',
    'temperature': 'Sampling temperature',
    'tokens': 'Tokens computed',
    'head_dim': 'Head dimension H',
    'batch_slots': 'Batch slots',
    'mesh': 'Devices',
    'mesh_layout': 'Mesh layout',
    'dot_library': 'What computes the spec',
    'results_dir': 'Directory of the results JSON files',
    'rows_per_call': 'The most token rows',
    'cache_len': 'KV slots',
    'engine': 'The engine mode',
    'dtype': 'Activation dtype',
}

# Flags that never decide what a result holds: where it goes, how the run reports, secrets.
# `recorded_command` leaves them out; every other flag is named with its value.
NOT_BITS = frozenset({
    'output', 'output_dir', 'overwrite', 'verbose', 'compilation_cache', 'manifest_output',
    'manifest_output_dir', 'artifact_dir', 'keep_store', 'step_timeout', 'rows_output',
    'resume_file', 'pause_at', 'phases', 'probe_only', 'edge_probe_only', 'coordinator',
    'process_id', 'namespace_salt', 'signing_key', 'trusted_keys', 'store', 'host_cache_bytes',
    'python', 'qemu'})


@dataclasses.dataclass(frozen=True)
class OldSpelling:
  """A flag spelling that committed results' commands and manifests record: read as `new` (in
  `tools`, or every tool where empty) until the release `retires`. `split`: the old flag took a
  comma list, the new one is repeated; `value`: rewrites each value."""

  old: str
  new: str
  tools: tuple[str, ...] = ()
  split: bool = False
  value: Callable[[str], str] | None = None
  retires: str = '0.2.0'

  def rewrite(self, value: str) -> list[str]:
    values = value.split(',') if self.split else [value]
    return [f'--{self.new}={self.value(v) if self.value else v}' for v in values]


OLD_SPELLINGS: tuple[OldSpelling, ...] = (
    OldSpelling('block_size', 'rows_per_call'),
    OldSpelling('layout', 'mesh_layout'),
    OldSpelling('exactness_samples', 'samples', ('experiments.main',)),
    OldSpelling('replay_manifest', 'manifest', ('experiments.main',)),
    OldSpelling('figures_dir', 'output_dir', ('experiments.main',)),
    OldSpelling('results', 'results_dir', ('analysis.figures',)),
    OldSpelling('output', 'output_dir', ('analysis.figures', 'experiments.compat_fixture')),
    OldSpelling('manifest', 'manifest_output',
                ('experiments.graft_exactness', 'experiments.flywheel')),
    OldSpelling('manifest_dir', 'manifest_output_dir', ('experiments.device_check',)),
    OldSpelling('output', 'signing_key', ('experiments.store',)),
    OldSpelling('meshes', 'mesh', ('experiments.mesh_exactness',), split=True,
                value=lambda v: v.replace('+', ',')),
    OldSpelling('layouts', 'mesh_layout', ('experiments.mesh_exactness',), split=True),
    OldSpelling('dot_libraries', 'dot_library', ('experiments.emulated_check',), split=True),
    OldSpelling('batch_slots', 'batch_slots', ('experiments.bench',), split=True),
    OldSpelling('continuation', 'continuation_tokens', ('experiments.context_shift',)),
    OldSpelling('window', 'sliding_window', ('experiments.kernel_bench',)),
    OldSpelling('contexts', 'cache_sizes', ('experiments.kernel_bench',)),
)


def modernize(tool: str, argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """argv with every old spelling of `tool`'s flags rewritten (`OLD_SPELLINGS`), and a note for
  each. Only the `--name=value` form is rewritten, as recorded commands write it."""
  out, notes = [argv[0]], []
  for arg in argv[1:]:
    name, eq, value = arg[2:].partition('=') if arg.startswith('--') else ('', '', '')
    old = next((o for o in OLD_SPELLINGS if o.old == name and eq and (
        not o.tools or tool in o.tools)), None)
    if old is None:
      out.append(arg)
      continue
    out += old.rewrite(value)
    notes.append(f'--{old.old}={value} is read as {" ".join(old.rewrite(value))} (the old '
                 f'spelling is read until {old.retires})')
  return out, notes


class CheckedList(flags.ListParser):
  """A comma list whose items are parsed and bounded as the flags are read (a bad item is a
  one-line usage error naming the flag): integers within [lower_bound, upper_bound], or words
  from `words` (an item that is neither is refused). `integers=False`: words only."""

  def __init__(self, *, integers: bool = True, lower_bound: int | None = None,
               upper_bound: int | None = None, words: Sequence[str] = (),
               match: Callable[[str], bool] | None = None):
    super().__init__()
    self.integers, self.words, self.match = integers, tuple(words), match
    self.lower_bound, self.upper_bound = lower_bound, upper_bound

  def parse(self, argument):
    return [self._item(str(item).strip()) for item in super().parse(argument)]

  def _item(self, item: str):
    if item in self.words or (self.match and self.match(item)):
      return item
    if not self.integers:
      raise ValueError(f'{item!r} is not one of {", ".join(self.words)}')
    try:
      value = int(item)
    except ValueError:
      also = f' or one of {", ".join(self.words)}' if self.words else ''
      raise ValueError(f'{item!r} is not an integer{also}') from None
    if self.lower_bound is not None and value < self.lower_bound:
      raise ValueError(f'{value} is below {self.lower_bound}')
    if self.upper_bound is not None and value > self.upper_bound:
      raise ValueError(f'{value} is above {self.upper_bound}')
    return value

  def flag_type(self) -> str:
    return 'comma list of integers' if self.integers else 'comma list of words'


def define_list(name: str, default: Sequence, help_text: str, **bounds) -> None:
  """A comma-list flag whose items are checked as the flags are read (`CheckedList`)."""
  flags.DEFINE(CheckedList(**bounds), name, list(default) if default is not None else None,
               help_text, serializer=flags.CsvListSerializer(','))
