"""The trials that start processes (`experiments.store put` writers) on a file:// copy of the
golden store: a writer killed inside a put, and writers putting at once."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

from experiments.fault_campaign.world import (Composed, Outcome, World, answer, fresh_sha256,
                                              put, untouched_intact)
from graft.store import Store
from graft.store.kvstore import KvStore
from graft.store.publish import PAUSED

# The repository root: the writers run the store's entry point from it.
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def process_trial(kind: str, world: World, rng, scratch: str) -> Outcome:
  """One trial of `kind` ('kill_put' or 'concurrent_put') in a store of its own under
  `scratch`."""
  directory = tempfile.mkdtemp(dir=scratch)
  url, kv = _file_store(world, directory)
  draw = lambda n: [int(t) for t in rng.integers(3, world.engine.model_config.vocab_size, n)]
  trial = _kill_put if kind == 'kill_put' else _concurrent_put
  done = trial(world, rng, scratch, directory, url, kv, draw)
  if isinstance(done, Outcome):  # the trial could not run as asked (its store is removed)
    return done
  outcome, reasons, fault = done
  lost = not untouched_intact(kv, world.golden, set())
  shutil.rmtree(directory, ignore_errors=True)
  return Outcome(outcome, reasons, lost, 0, fault)


def _kill_put(world: World, rng, scratch, directory, url, kv, draw):
  """A writer killed (SIGKILL) inside a put, at a step it reports (objects of batch n written,
  read back or published); then this process reads and writes the same store."""
  engine = world.engine
  target = world.contexts[int(rng.integers(len(world.contexts)))]
  documents = isinstance(target, Composed)
  if documents:  # new documents after the world's prefix (a put each)
    new = [draw(int(rng.integers(100, 400))) for _ in range(3)]
    lines = [{'prefix': list(target.prefix), 'tokens': d} for d in new]
  else:
    new = [target[:int(rng.integers(2, 30))] + draw(int(rng.integers(100, 400)))
           for _ in range(3)]
    lines = [{'tokens': c} for c in new]
  path = os.path.join(directory, '..', os.path.basename(directory) + '.jsonl')
  with open(path, 'w') as f:
    f.writelines(json.dumps(line) + '\n' for line in lines)
  # Killed inside the put, at a step the writer reports: after batch n's objects were
  # written, read back or published (each context is one write batch).
  step, n = str(rng.choice(['written', 'verified', 'published'])), int(rng.integers(1, 4))
  reached = _kill_when_paused(_put_process(url, path, world.model_args, f'{step}:{n}'))
  fault = f'put killed after batch {n} was {step}'
  if reached != step:
    shutil.rmtree(directory, ignore_errors=True)
    return Outcome('crashed', [f'the writer was not killed where asked ({step}:{n})'], False, 0,
                   fault)
  context, query = new[int(rng.integers(len(new)))], draw(3)
  if documents:  # the new document among the target's
    context = Composed(target.prefix, target.documents + (tuple(context),), target.recompute)
  want = fresh_sha256(engine, context, query)
  # A second process (this one) reads, then writes the same store, then reads again.
  sha, found, grafted = answer(engine, lambda: Store(kv, engine), context, query)
  writer = Store(kv, engine)
  put(writer, context)
  sha2, found2, grafted2 = answer(engine, lambda: Store(kv, engine), context, query)
  reasons = found + found2
  ok = sha == want and sha2 == want and grafted2 == len(context)
  return ('silent_wrong' if not ok else 'refused' if reasons else 'exact'), reasons, fault


def _concurrent_put(world: World, rng, scratch, directory, url, kv, draw):
  """2 to 8 writers putting the same and overlapping contexts at once."""
  engine = world.engine
  writers = int(rng.integers(2, 9))
  target = world.contexts[0]
  documents = isinstance(target, Composed)
  if documents:  # documents after the world's prefix
    shared = [draw(int(rng.integers(20, 120))) for _ in range(3)]
  else:
    shared = [target[:int(rng.integers(2, 40))] + draw(int(rng.integers(20, 120)))
              for _ in range(3)]
  line = lambda c: {'prefix': list(target.prefix), 'tokens': c} if documents else {'tokens': c}
  paths = []
  for w in range(writers):  # each writer: the shared contexts plus one of its own, in its order
    own = shared[int(rng.integers(3))][:int(rng.integers(2, 30))] + draw(40)
    mine = [shared[i] for i in rng.permutation(3)] + [own]
    paths.append(os.path.join(scratch, f'{os.path.basename(directory)}_{w}.jsonl'))
    with open(paths[-1], 'w') as f:
      f.writelines(json.dumps(line(c)) + '\n' for c in mine)
  procs = [_put_process(url, p, world.model_args) for p in paths]
  failures = []
  for proc in procs:
    _, err = proc.communicate(timeout=900)
    if proc.returncode:
      failures.append(err[-300:])
  fault = f'{writers} writers at once'
  reasons = [f'a writer failed: {f}' for f in failures]
  store = Store(kv, engine)
  problems = store.verify()
  entries = store.entries()
  one_copy = len(kv.list('objects/')) == len(entries)
  outcome = 'exact'
  for context in shared:
    query = draw(3)
    if documents:
      context = Composed(target.prefix, (tuple(context),), target.recompute)
    sha, found, grafted = answer(engine, lambda: Store(kv, engine), context, query)
    if sha != fresh_sha256(engine, context, query) or grafted != len(context):
      outcome = 'silent_wrong'
    reasons += found
  if problems or not one_copy or failures:
    outcome = 'silent_wrong'  # a writer must neither fail nor leave a bad or second copy
    reasons += [p.reason for p in problems] + ([] if one_copy else ['a second copy was left'])
  elif reasons and outcome == 'exact':
    outcome = 'refused'
  return outcome, reasons, fault


def _put_process(url: str, path: str, model_args: list[str],
                 pause: str | None = None) -> subprocess.Popen:
  """`experiments.store put` in another process; pause: its --pause_at ('STEP:N')."""
  return subprocess.Popen([sys.executable, '-m', 'experiments.store', 'put', f'--store={url}',
                           f'--input={path}', *model_args,
                           *([f'--pause_at={pause}'] if pause else [])], cwd=REPO,
                          env={**os.environ, 'PYTHONPATH': REPO},
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def _kill_when_paused(proc: subprocess.Popen) -> str | None:
  """Waits for the writer to report that it paused inside a put, kills it (SIGKILL) and returns
  the step; None (the writer killed all the same) when it ended without reporting it or the
  kill did not land."""
  step = None
  for line in proc.stderr:
    if line.startswith(PAUSED):
      step = line[len(PAUSED):].split()[0]
      break
  proc.send_signal(signal.SIGKILL)
  proc.wait()
  return step if proc.returncode == -signal.SIGKILL else None


def _file_store(world: World, directory: str) -> tuple[str, KvStore]:
  url = f'file://{directory}/'
  kv = KvStore(url)
  kv.write_many(list(world.golden.items()))
  return url, kv
