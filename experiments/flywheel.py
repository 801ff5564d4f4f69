"""The verified-knowledge flywheel: verify once, deposit as KV, graft on every recurrence.

  python -m experiments.flywheel --task_set=arithmetic --tasks_n=100 --solutions=generated
  python -m experiments.flywheel --tasks=aime.jsonl --heldout=aime_heldout.jsonl \
      --solutions=aime_solutions.jsonl --attempts=8 --budget=64

Phases (graft/knowledge/flywheel.py runs them; graft/knowledge/library.py holds the library,
graft/knowledge/verifiers.py the verifiers):
  (a) base: each task asked as "Problem: ...\\nSolution:" after a few-shot header of solved
      examples in the library's own format (drawn apart from the tasks), up to --attempts
      sampled attempts at --temperature within --budget decode tokens each, stopping at the
      first verified answer; every decode token counted;
  (b) deposit: every task with a verified solution enters the library: its own (source
      "self"), else one from --solutions (a file, or `generated`: the generator's worked
      solutions, standing in for a stronger solver's), checked by the verifier first; one that
      fails is rejected and counted, never deposited;
  (c) recurring: each deposited task asked again, greedily, with its entry grafted from the
      store;
  (d) held-out: each held-out problem (--heldout, or a generated set disjoint from the tasks)
      asked greedily without a library (the few-shot header) and with its --k BM25-retrieved
      entries grafted as one library prefix.
With --rounds=2 the library then grows by round one's verified held-out answers and a second
held-out set is asked the same way: does the flywheel turn?

For --sample_exact of the grafted answers the logits of every decode step are compared by
SHA-256 with a fresh computation of library + question (graft_exact). Costs: decode tokens as
counted; FLOPs from the config (gemma_jax/cost.py: a prompt's prefill plus each decode token;
grafted tokens cost no prefill); energy estimated from wall time on the same problems, assuming
the same power draw in both phases (this machine exposes no power counters). The token factor
is the paper's: the base decode tokens spent on the never-solved problems over the library's
decode tokens on the same problems.

Output: schema flywheel (analysis/results.py); --manifest writes every answer's prompt token
ids, decode settings, tokens and logits SHA-256 for `experiments.replay`.
"""

from __future__ import annotations

import dataclasses
import shutil
import sys
import tempfile

from absl import app, flags, logging

from experiments import common
from gemma_jax import cost, files
from graft.knowledge import tasks as tasks_lib
from graft.knowledge.flywheel import Settings, manifest, run, summarize, task_row
from graft.knowledge.library import QUESTION, Library
from graft.store import Store

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('store', None, 'Store URL (default: a temporary file:// store).')
  flags.DEFINE_string('tasks', None, 'JSONL of {"id", "problem", "answer"} tasks.')
  flags.DEFINE_string('task_set', None, f'A generated set instead: {", ".join(tasks_lib.FAMILIES)}.')
  flags.DEFINE_integer('tasks_n', 100, 'Tasks of a generated set.')
  flags.DEFINE_string('heldout', None, 'JSONL of held-out problems (default: generated, disjoint).')
  flags.DEFINE_integer('heldout_n', 100, 'Held-out problems of a generated set.')
  flags.DEFINE_string('solutions', None, 'JSONL of {"id", "solution"}, or `generated`.')
  flags.DEFINE_integer('attempts', 4, 'Sampled attempts per task in the base phase.')
  flags.DEFINE_float('temperature', 0.7, 'Sampling temperature of the base attempts.')
  flags.DEFINE_integer('seed', 0, 'Seed of the generated sets and of the sampler.')
  flags.DEFINE_integer('budget', 40, 'Decode tokens per attempt (a worked solution and its '
                       'answer line).')
  flags.DEFINE_integer('k', 3, 'Entries retrieved for a held-out problem.')
  flags.DEFINE_integer('shots', 3, 'Solved examples in the base few-shot header.')
  flags.DEFINE_integer('sample_exact', 10, 'Grafted answers checked against fresh (per phase).')
  flags.DEFINE_integer('rounds', 2, '1, or 2: grow the library by round one\'s held-out answers.')
  flags.DEFINE_string('output', None, 'Results JSON (default: named after the task set).')
  flags.DEFINE_string('manifest', None, 'Also write a replayable manifest here.')
  common.define_model_flags()
  common.define_store_flags()
  common.define_engine_flags(cache_len=1024)


# ----------------------------------------------------------------------------------------------
# Asking


def load_sets(tokenizer) -> tuple[list, list, dict, list]:
  if bool(FLAGS.tasks) == bool(FLAGS.task_set):
    raise app.UsageError('give exactly one of --tasks=FILE.jsonl and --task_set=NAME')
  if FLAGS.task_set:
    task_list = tasks_lib.generate(FLAGS.task_set, FLAGS.tasks_n, seed=FLAGS.seed)
  else:
    task_list = tasks_lib.read_tasks(FLAGS.tasks)
  seen = [t.problem for t in task_list]
  family = FLAGS.task_set or 'arithmetic'
  examples = tasks_lib.generate(family, FLAGS.shots, seed=FLAGS.seed + 30_000, exclude=seen)
  seen += [t.problem for t in examples]
  if FLAGS.heldout:
    heldout = [tasks_lib.read_tasks(FLAGS.heldout)]
  elif FLAGS.task_set:
    heldout = [tasks_lib.generate(FLAGS.task_set, FLAGS.heldout_n, seed=FLAGS.seed + 10_000,
                                  exclude=seen)]
    seen += [t.problem for t in heldout[0]]
  else:
    raise app.UsageError('--tasks needs --heldout=FILE.jsonl')
  if FLAGS.rounds > 1:
    if FLAGS.task_set:
      heldout.append(tasks_lib.generate(FLAGS.task_set, FLAGS.heldout_n,
                                        seed=FLAGS.seed + 20_000, exclude=seen))
    else:
      logging.warning('--rounds=2 needs a generated set; a single round is run')
  if FLAGS.solutions == 'generated':
    if not FLAGS.task_set:
      raise app.UsageError('--solutions=generated needs --task_set')
    solutions = {t.id: t.reference_solution for t in task_list}
  else:
    solutions = tasks_lib.read_solutions(FLAGS.solutions) if FLAGS.solutions else {}
  return task_list, heldout, solutions, examples


def main(argv):
  del argv
  loaded = common.load_model()
  engine = common.make_engine(loaded)
  task_list, heldout, solutions, examples = load_sets(loaded.tokenizer)
  scratch = None
  url = FLAGS.store
  if not url:
    scratch = tempfile.mkdtemp(prefix='flywheel.')
    url = f'file://{scratch}/store/'
  store = Store(url, engine, **common.store_args())
  try:
    settings = Settings(attempts=FLAGS.attempts, temperature=FLAGS.temperature, seed=FLAGS.seed,
                        budget=FLAGS.budget, k=FLAGS.k, sample_exact=FLAGS.sample_exact)
    results = run(engine, Library(store), task_list, heldout, solutions, examples, settings)
  finally:
    if scratch:
      shutil.rmtree(scratch, ignore_errors=True)
  config = {**common.model_config_json(), 'task_set': FLAGS.task_set, 'tasks': FLAGS.tasks,
            'tasks_n': len(task_list), 'heldout': FLAGS.heldout,
            'heldout_n': [len(h) for h in heldout], 'solutions': FLAGS.solutions,
            'attempts': FLAGS.attempts, 'temperature': FLAGS.temperature, 'seed': FLAGS.seed,
            'budget': FLAGS.budget, 'k': FLAGS.k, 'shots': FLAGS.shots,
            'rounds': len(heldout), 'sample_exact': FLAGS.sample_exact,
            'engine_config': dataclasses.asdict(engine.engine_config),
            'model_fingerprint': engine.model_fingerprint['sha256'],
            'engine_fingerprint': engine.fingerprint,
            'templates': {'entry': 'Problem: {problem}\\nSolution: {solution}\\nAnswer: {answer}'
                                   '\\n\\n', 'question': QUESTION},
            'cost': {'dense_flops_per_token': cost.dense_flops_per_token(loaded.config)}}
  summary = summarize(loaded.config, results)
  rows = [task_row(r) for r in results['rows']]
  output = FLAGS.output or common.default_output('flywheel', FLAGS.model, FLAGS.dtype,
                                                 FLAGS.task_set or 'file')
  written = common.write_result(output, 'flywheel',
                                {'config': config, 'tasks': rows, 'summary': summary})
  if FLAGS.manifest:
    files.write_json(FLAGS.manifest, manifest(written['config'], engine, results))
  for key, value in summary.items():
    print(f'{key}: {value}')
  if summary['graft_exact'] is False:
    sys.exit(1)


if __name__ == '__main__':
  define_flags()
  common.run(main)
