"""The fault-injection campaign behind `python -m experiments.faults` (its entry point, which says
how to run it): the trials, the kinds of fault and how each trial's outcome is judged.

Each trial deposits content (contexts with shared prefixes, some ending mid-block; or, with
block kind 'document', documents stored after a prefix that ends mid-block), injects one fault
of its kind at a random place, then answers: a reader that has cached nothing grafts the
longest stored prefix of one context (or restores an artifact), or composes stored documents in
an order of its own with a recompute strategy, and computes the rest and a query. A
composition's answer must be SHA-256 equal to the same composition of documents computed
without a store (placing moves no bit under RoPE relative). Outcomes, per trial:

  exact      no fault reached stored data (the process kinds), and the answer is SHA-256 equal
             to a fresh computation;
  untouched  a graft was used, nothing was refused, and the answer is SHA-256 equal to fresh
             (the fault missed what the reader used);
  refused    a fault was detected with a reason (refused object, refused store, failed write)
             and the answer, computed around it, is still SHA-256 equal to fresh;
  silent_wrong  anything else (the claim is that this never happens);
  crashed    the trial raised (a traceback is a finding, counted, never hidden).

`lost` counts trials in which a committed object or entry that the fault did not touch is no
longer there, byte for byte, after the trial and a gc. The claim is silent_wrong = 0, crashed =
0 and lost = 0 for every kind.

Kinds (`--kinds`, default all; `PROCESS_KINDS` start processes and run --process_trials each):
  bitflip_data, bitflip_header, bitflip_index   one bit flipped in an object's data or header,
                                                or in an index entry
  truncate, empty, delete, rename, copy_other_key   an object cut short, emptied, deleted,
                                                moved to another name, or overwritten with
                                                another block's object
  failing_write     a kvstore that raises part way through a put (a full disk), after writing
                    a value cut short
  foreign_store     the store opened under another model, engine, dtype or tokenizer
  shape_twin        an artifact or block of another model whose shapes match
  hostile_key       keys shaped like paths ('../', absolute, very long) in listings and entries
  huge_header       a header claiming huge shapes or length (its entry's hash recomputed)
  bad_index_types   index entries of unexpected JSON types
  artifact_manifest a field of an artifact's manifest changed (with its hash recomputed or not)
  forgery           a self-consistent forgery (header, per-leaf hashes, entry all correct for
                    its bytes; one global K value off by 1e-3), before or after an honest put
  forgery_descendants   a forgery, a longer put built on it, then an honest put of its text
  stale_reader      a reader with a cached entry of a block another writer has rewritten
  rebuild_beside_put    rebuild_index run between a put's object writes and its publishing
  gc_beside_put     gc listing a put's objects unpublished and deleting after publication
  gc_inside_put     a whole gc run between a put's object writes and its publishing
  stray_names       names the store never makes under index/ and objects/, then verify and gc
  wrong_json_types  store.json fields of the wrong JSON type
  borrowed_signature    a forgery carrying a signature copied from another block
  kill_put          a process killed (SIGKILL) inside a put, at a step it reports (objects of
                    batch n written, read back or published), then this process
                    reads and writes the same store
  concurrent_put    2 to 8 processes putting the same and overlapping contexts at once

Output: schema faults (analysis/results.py).

Experiment machinery, outside the library: experiments/faults.py (the entry point) and
tests/test_faults.py call it. Modules: world (the deposited contexts and golden store, how an
answer is judged), damage (what each fault does to a store), store_trials (one function per
in-process kind), process_trials (the kinds that start writer processes).
"""

from __future__ import annotations

import collections
import time

from absl import logging
import numpy as np

from experiments.fault_campaign.process_trials import process_trial
from experiments.fault_campaign.store_trials import store_trial
from experiments.fault_campaign.world import (BLOCK_KINDS, World, make_world, other_engines,
                                              reason_class)

STORE_KINDS = ('bitflip_data', 'bitflip_header', 'bitflip_index', 'truncate', 'empty', 'delete',
               'rename', 'copy_other_key', 'failing_write', 'foreign_store', 'shape_twin',
               'hostile_key', 'huge_header', 'bad_index_types', 'artifact_manifest',
               # a writer who is wrong, and other processes at work
               'forgery', 'forgery_descendants', 'stale_reader', 'rebuild_beside_put',
               'gc_beside_put', 'gc_inside_put', 'stray_names', 'wrong_json_types',
               'borrowed_signature')
PROCESS_KINDS = ('kill_put', 'concurrent_put')
KINDS = STORE_KINDS + PROCESS_KINDS

__all__ = ['BLOCK_KINDS', 'KINDS', 'PROCESS_KINDS', 'STORE_KINDS', 'World', 'campaign',
           'make_world', 'other_engines']


def campaign(world: World, kinds, trials: int, process_trials: int, seed: int, others: dict,
             scratch: str) -> dict:
  """kind -> its tally ({trials, exact, untouched, refused, silent_wrong, crashed, lost, the
  refusals' reasons counted by class, examples of what went wrong, seconds}): `trials` trials
  of every in-process kind, `process_trials` of every kind that starts processes, each kind's
  faults drawn from (seed, its index); `others` from `other_engines`."""
  results = {}
  for k, kind in enumerate(kinds):
    rng = np.random.default_rng([seed, k])
    count = process_trials if kind in PROCESS_KINDS else trials
    tally = {'trials': 0, 'exact': 0, 'untouched': 0, 'refused': 0,
             'reasons': collections.Counter(), 'silent_wrong': 0, 'crashed': 0, 'lost': 0,
             'examples': []}
    start = time.perf_counter()
    for i in range(count):
      if kind in PROCESS_KINDS:
        outcome = process_trial(kind, world, rng, scratch)
      else:
        outcome = store_trial(kind, world, rng, others, scratch)
      tally['trials'] += 1
      tally[outcome.outcome] += 1
      tally['lost'] += outcome.lost
      if outcome.outcome == 'refused':
        tally['reasons'][reason_class(outcome.reasons[0])] += 1
      if outcome.outcome in ('silent_wrong', 'crashed') or outcome.lost:
        tally['examples'].append({'fault': outcome.fault, 'reasons': outcome.reasons[:3],
                                  'grafted': outcome.grafted})
        logging.error('%s trial %d: %s, lost=%s (%s)', kind, i, outcome.outcome, outcome.lost,
                      outcome.fault)
    tally['reasons'] = dict(tally['reasons'].most_common())
    tally['seconds'] = round(time.perf_counter() - start, 1)
    results[kind] = tally
    logging.info('%s: %d trials, %d exact, %d untouched, %d refused, %d silent-wrong, %d '
                 'crashed, %d lost (%.0f s)', kind, tally['trials'], tally['exact'],
                 tally['untouched'], tally['refused'], tally['silent_wrong'], tally['crashed'],
                 tally['lost'], tally['seconds'])
  return results
