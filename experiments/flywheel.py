"""The verified-knowledge flywheel: verify once, deposit as KV, graft on every recurrence.

  python -m experiments.flywheel --task_set=units --tasks_n=100 --heldout_n=100 \
      --budget=1024 --attempt_tokens=48 --solutions=generated --rounds=2
  python -m experiments.flywheel --tasks=aime.jsonl --heldout=aime_heldout.jsonl \
      --solutions=aime_solutions.jsonl --budget=4096 --attempt_tokens=256
  python -m experiments.flywheel --task_set=units --solutions=none --rounds=3   # pure flywheel

Phases (graft/knowledge/flywheel.py runs them; graft/knowledge/library.py holds the library,
graft/knowledge/verifiers.py the verifiers and their one answer-extraction rule):
  (a) base: each task asked as "Problem: ...\\nSolution:" after a few-shot header of solved
      examples in the library's own format (drawn apart from the tasks): attempts of at most
      --attempt_tokens decode tokens, sampled at --temperature (a seed per attempt from
      --seed), until one verifies or the problem's --budget of decode tokens is spent; every
      decode token counted. --attempt_slots attempts are decoded together in the engine's
      batch slots, each with the bits it gets alone; the record is the one-at-a-time
      protocol's (attempts computed past the verified one or the budget are dropped and
      reported as batch_discarded_tokens);
  (b) deposit: every task with a verified solution enters the library: its own (source
      "self"), else one from --solutions (a file, `generated`: the generator's worked
      solutions, standing in for a stronger solver's, or `none`: only the model's own), which
      the library verifies itself; one that fails is rejected and counted, never deposited;
  (c) recurring: each deposited task asked again, greedily, as its own entry up to the answer
      ("Problem: ...\\nSolution: ...\\nAnswer:", graft/knowledge/library.py RECALL), all but the
      last token grafted from the store: the model states the answer after the verified
      trace, in a few decode tokens (tokens per recurring answer reported);
  (d) held-out, per round: each held-out problem (--heldout, or generated sets disjoint from
      the tasks, one per --rounds) asked greedily three ways: without a library (the few-shot
      header), with its --k BM25-retrieved entries grafted as one library prefix, and with the
      same entries' text prefilled fresh (the text baseline: the graft must give the same
      answer token for token; it changes the cost: prefill tokens and time to first token).
      After each round but the last, the library grows by that round's verified answers.

Every answer stops at the end of the line of any final-answer statement the extraction rule
reads (or at a blank line, or EOS); one the token limit cut is read without a statement it cut
short, and where that was its only one it is unreadable: not correct, and counted apart
(summary `unreadable_answers`, per phase).

Every held-out graft is compared with its text baseline (logits SHA-256 of every decode
step), and --sample_exact recurring grafts with a fresh computation (graft_exact). Accuracy
differences are paired: a 95% bootstrap interval over problems and McNemar's exact p-value
(graft/knowledge/paired.py). Costs: decode tokens as counted; FLOPs from the config
(gemma_jax/cost.py: a prompt's prefill plus each decode token; grafted tokens cost no prefill);
energy from the CPU packages' RAPL counters where the kernel exposes them, else this process's
CPU seconds at the same power per busy core in both phases (energy_method says which). The
token factor is the paper's: the base decode tokens spent within the budget on the
never-solved problems over the library's decode tokens on the same problems.

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
from gemma_jax import cost
from graft.engine import plans
from graft.knowledge import tasks as tasks_lib
from graft.knowledge.flywheel import Settings, manifest, run, summarize, task_row
from graft.knowledge.library import ENTRY, QUESTION, RECALL, Library
from graft.store import Store

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_string('store', None, 'Store URL (unset: a temporary file:// store).')
  flags.DEFINE_string('tasks', None, 'JSONL of {"id", "problem", "answer"} tasks.')
  flags.DEFINE_string('task_set', None, f'A generated set instead: {", ".join(tasks_lib.FAMILIES)}.')
  flags.DEFINE_integer('tasks_n', 100, 'Tasks of a generated set.', lower_bound=1)
  flags.DEFINE_string('heldout', None, 'JSONL of held-out problems (unset: generated, disjoint).')
  flags.DEFINE_integer('heldout_n', 100, 'Held-out problems of a generated set.', lower_bound=1)
  flags.DEFINE_string('solutions', None, 'JSONL of {"id", "solution"}; `generated`; or `none` '
                      '(only the model\'s own verified attempts enter the library).')
  flags.DEFINE_float('temperature', 0.7, 'Sampling temperature of the base attempts (0: greedy).',
                     lower_bound=0.0)
  flags.DEFINE_integer('seed', 0, 'Seed of the generated sets and of the sampler.', lower_bound=0)
  flags.DEFINE_integer('budget', 64, 'Decode tokens a recurring problem may spend in all, over '
                       'its base attempts.', lower_bound=1)
  flags.DEFINE_integer('attempt_tokens', 40, 'Decode tokens of one attempt (a worked solution '
                       'and its answer line), and of every greedy answer.', lower_bound=1)
  flags.DEFINE_integer('attempt_slots', None, 'Base attempts of a problem decoded together, one '
                       'per engine batch slot (each gets the bits it gets alone; the record is '
                       'the one-at-a-time protocol\'s, and the manifest replays unbatched). '
                       'Unset: 8 on an engine with batch slots (spec, pinned), else 1.',
                       lower_bound=1)
  flags.DEFINE_integer('k', 3, 'Entries retrieved for a held-out problem.', lower_bound=1)
  flags.DEFINE_integer('shots', 3, 'Solved examples in the base few-shot header.', lower_bound=0)
  flags.DEFINE_integer('sample_exact', 10, 'Grafted answers checked against fresh (per phase).',
                       lower_bound=0)
  flags.DEFINE_integer('rounds', 2, 'Held-out rounds; after each but the last the library grows '
                       'by that round\'s verified answers.', lower_bound=1)
  common.define_output_flag()
  flags.DEFINE_string('manifest_output', None, 'Also write a replayable manifest of this run here '
                      '(experiments.replay --manifest reads it).')
  common.define_model_flags()
  common.define_store_flags()
  common.define_engine_flags(cache_len=1024)


OWN_DEFAULTS = {
    'cache_len': 'a few-shot header, k entries and an attempt fit in 1,024 slots',
    'temperature': 'base attempts are sampled',
}


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
      for r in range(2, FLAGS.rounds + 1):  # seeds 20,000, then 50,000, 60,000, ... (30,000
        # draws the few-shot examples)
        offset = 20_000 if r == 2 else 10_000 * (r + 2)
        heldout.append(tasks_lib.generate(FLAGS.task_set, FLAGS.heldout_n,
                                          seed=FLAGS.seed + offset, exclude=seen))
        seen += [t.problem for t in heldout[-1]]
    else:
      logging.warning('--rounds=%d needs a generated set; a single round is run', FLAGS.rounds)
  if FLAGS.solutions == 'generated':
    if not FLAGS.task_set:
      raise app.UsageError('--solutions=generated needs --task_set')
    solutions = {t.id: t.reference_solution for t in task_list}
  elif FLAGS.solutions in (None, 'none'):
    solutions = {}
  else:
    solutions = tasks_lib.read_solutions(FLAGS.solutions)
  return task_list, heldout, solutions, examples


def main(argv):
  del argv
  settings = Settings(budget=FLAGS.budget, attempt_tokens=FLAGS.attempt_tokens,
                      temperature=FLAGS.temperature, seed=FLAGS.seed, k=FLAGS.k,
                      sample_exact=FLAGS.sample_exact,
                      attempt_slots=FLAGS.attempt_slots or 1)  # bad settings refused early
  batch_slots = plans.plan_class(FLAGS.engine).batch_slots
  if settings.attempt_slots > 1 and not batch_slots:
    raise app.UsageError(f'--attempt_slots={settings.attempt_slots} needs an engine with batch '
                         f'slots (spec, pinned), not --engine={FLAGS.engine}')
  if FLAGS.attempt_slots is None and batch_slots:
    settings = dataclasses.replace(settings, attempt_slots=8)
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
    results = run(engine, Library(store), task_list, heldout, solutions, examples, settings)
  finally:
    if scratch:
      shutil.rmtree(scratch, ignore_errors=True)
  config = {**common.model_config_json(), 'task_set': FLAGS.task_set, 'tasks': FLAGS.tasks,
            'tasks_n': len(task_list), 'heldout': FLAGS.heldout,
            'heldout_n': [len(h) for h in heldout], 'solutions': FLAGS.solutions,
            'attempt_tokens': FLAGS.attempt_tokens, 'temperature': FLAGS.temperature,
            'seed': FLAGS.seed, 'budget': FLAGS.budget, 'attempt_slots': settings.attempt_slots,
            'k': FLAGS.k, 'shots': FLAGS.shots,
            'rounds': len(heldout), 'sample_exact': FLAGS.sample_exact,
            'engine_config': dataclasses.asdict(engine.engine_config),
            'model_fingerprint': engine.model_fingerprint['sha256'],
            'engine_fingerprint': engine.fingerprint,
            'templates': {'entry': ENTRY, 'question': QUESTION, 'recall': RECALL},
            'cost': {'dense_flops_per_token': cost.dense_flops_per_token(loaded.config)}}
  summary = summarize(loaded.config, results, seed=FLAGS.seed)
  rows = [task_row(r) for r in results['rows']]
  output = common.output_path('flywheel', FLAGS.model, FLAGS.dtype, FLAGS.task_set or 'file')
  written = common.write_result(output, 'flywheel',
                                {'config': config, 'tasks': rows, 'summary': summary})
  if FLAGS.manifest_output:
    common.write_json(FLAGS.manifest_output, manifest(written['config'], engine, results))
  for key, value in summary.items():
    print(f'{key}: {value}')
  if summary['graft_exact'] is False:
    sys.exit(1)


if __name__ == '__main__':
  define_flags()
  common.run(main)
