"""The bench's interleaving (experiments/interleaved.py): repeat r of every system's operation
runs before repeat r + 1 of any, warm-ups included, and a ratio is taken repeat by repeat.

A ratio of two systems measured in blocks took the machine's drift between the blocks into the
ratio; interleaved and paired, a drift both share cancels. The drift here is made: a clock that
slows by half at a given moment, wherever the run is.
"""

import pytest

from experiments import interleaved


def test_every_system_runs_repeat_r_before_any_runs_repeat_r_plus_one():
  calls = []
  op = lambda system, name: lambda: calls.append((system, name))
  systems = {'a': {'prefill': op('a', 'prefill'), 'decode': op('a', 'decode')},
             'b': {'prefill': op('b', 'prefill')},
             'c': {'decode': op('c', 'decode'), 'prefill': op('c', 'prefill')}}
  times = interleaved.run(systems, repeats=3, warmup=1)
  one = [('a', 'prefill'), ('b', 'prefill'), ('c', 'prefill'), ('a', 'decode'), ('c', 'decode')]
  assert calls == one * 4  # the warm-up, then 3 timed repeats, in the same order
  assert {s: {o: len(t) for o, t in ops.items()} for s, ops in times.items()} == {
      'a': {'prefill': 3, 'decode': 3}, 'b': {'prefill': 3}, 'c': {'decode': 3, 'prefill': 3}}


def test_a_ratio_is_taken_repeat_by_repeat_so_a_shared_drift_cancels(monkeypatch):
  """A costs 1 unit and B 2, on a clock that runs at half speed from some moment on: every
  repeat's own ratio is 0.5, where blocks (A's repeats, then B's) would be off."""
  now = [0.0]
  slow = [False]

  def work(units):
    def run():
      now[0] += units * (2.0 if slow[0] else 1.0)
      if now[0] > 7:  # the machine slows down midway
        slow[0] = True
    return run

  monkeypatch.setattr(interleaved.time, 'perf_counter', lambda: now[0])
  times = interleaved.run({'a': {'op': work(1)}, 'b': {'op': work(2)}}, repeats=5, warmup=0)
  ratio = interleaved.paired(times['a']['op'], times['b']['op'])
  assert ratio['by_repeat'] == [0.5] * 5 and ratio['median'] == 0.5 and ratio['spread'] == 0
  assert times['a']['op'] != [1.0] * 5  # the drift was there
  summary = interleaved.summary(times['b']['op'])
  assert summary['min_s'] == 2.0 and summary['max_s'] == 4.0


def test_paired_ratios_need_repeats_of_equal_count():
  with pytest.raises(ValueError, match='paired ratios need repeats of equal count, not 2 and 3'):
    interleaved.paired([1.0, 2.0], [1.0, 2.0, 3.0])
