"""The main job on the embedded model: a tour that ends with every figure drawn from results/.

  python -m experiments.main

1. generation: "The capital of France is" continued greedily (the spec engine, as every step);
2. logits: a few texts through experiments.logits' format (ids, last-position logits, argmax);
3. graft exactness: a handful of fresh-vs-graft samples on the embedded model, byte for byte;
4. replay: the committed CI manifest made on a machine like this one, recomputed hash for hash;
5. store: a few texts deposited in a knowledge store (a temporary file:// one), queries grafted
   from it by longest prefix (one diverging mid-block), hits, bytes and SHA-256 equality;
6. flywheel: a few unit-conversion tasks attempted, verified solutions deposited, asked again
   with their entries grafted: base against library accuracy and the token factor;
7. figures: analysis.figures draws every figure from the committed results/ into the run folder
   (runs/main/<time>_figures/; --output_dir names another).

It writes nothing else: results/, manifests/ and figures/ stay as committed.

Any exactness check that does not hold (a graft not byte-equal, a replayed hash that differs)
fails the job: it exits with status 1 after listing them.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import tempfile

import jax
import numpy as np
from absl import flags

from analysis import figures
from experiments import common, samples
from experiments.texts import continue_text, text_logits
from graft import replay
from graft.knowledge import flywheel, tasks
from gemma_jax import compare, files
from graft import exactness
from graft.knowledge.library import Library
from graft.store import Store

FLAGS = flags.FLAGS


def define_flags() -> None:
  """Flags of this entry point (defined only when it runs, so importing it is free)."""
  flags.DEFINE_integer('samples', 6, 'Samples of graft exactness in step 3.', lower_bound=1)
  flags.DEFINE_string('manifest', 'manifests/ci_gemma3_270m_float32.json',
                      'A manifest to read and replay in step 4 (a glob: the one made on a '
                      'machine like this one).')
  flags.DEFINE_string('results_dir', 'results', 'Directory of the results JSON files the '
                      'figures are drawn from.')
  flags.DEFINE_string('output_dir', None, 'The directory this run writes its figures to (unset: '
                      'a new one under runs/main/; --output_dir=figures --overwrite redraws the '
                      'committed ones).')
  common.define_model_flags()
  common.define_engine_flags(cache_len=common.GRAFT_CACHE_LEN)


OWN_DEFAULTS = {
    'samples': 'a handful, to show the check in a minute',
    'manifest': 'the CI manifest, replayed on whatever machine runs the job',
    'cache_len': "the graft samples' longest context, as experiments.graft_exactness",
}


DEMO_TEXTS = [
    'The capital of France is',
    'def fibonacci(n):\n    """Returns the n-th Fibonacci number."""\n',
    'Der schnellste Weg von Berlin nach München ist',
]


# What the job is doing, for the heartbeat (a line every 10 s at most, however long a step's
# silent parts take: compiling, dequantizing, the replay).
_DOING = ['loading the model']


def step(title: str) -> None:
  _DOING[0] = title
  print(f'\n== {title} ==', flush=True)


def store_demo(engine, libraries) -> list[str]:
  """Deposits the libraries, grafts a query after each (and after a text that diverges from the
  first one inside a block) from the store, and compares with fresh computation."""
  failed = []
  with tempfile.TemporaryDirectory() as scratch:
    store = Store(f'file://{scratch}/store/', engine)
    libraries = [list(lib) for lib in libraries]
    for library in libraries:
      report = store.put(library)
      print(f"put {report['tokens']} tokens: {report['blocks_written']} blocks, "
            f"{report['bytes_written'] / 1e6:.1f} MB")
    diverging = libraries[0][:150] + libraries[1][1:100]  # leaves library 0 mid-block
    query = libraries[2][-12:]
    for name, context in [('library 0', libraries[0]), ('library 1', libraries[1]),
                          ('diverging text', diverging)]:
      ctx, match = store.graft(context)
      grafted, _ = exactness.graft_logits(engine, ctx, context, query, rows=1)
      equal = (compare.sha256_bytes(grafted)
               == exactness.fresh_sha256(engine, context, query, rows=1))
      print(f'{name}: {match.tokens}/{len(context)} tokens grafted from the store, '
            f'SHA-256 equal to fresh: {equal}')
      if not equal:
        failed.append(f'store graft of {name} is not byte-equal to fresh')
    stats = store.stats()
    print(f"store: {stats['objects']} blocks, {stats['bytes'] / 1e6:.1f} MB, "
          f"{stats['tokens_addressable']} tokens, {stats['bytes_per_token']:.0f} bytes/token; "
          f"host hits {store.counters['host_hits']}, backing reads "
          f"{store.counters['backing_reads']}")
  return failed


def flywheel_demo(engine) -> list[str]:
  """A short flywheel run (experiments/flywheel.py): 6 unit conversions, 4 held out."""
  task_list = tasks.generate('units', 6, seed=0)
  seen = [t.problem for t in task_list]
  examples = tasks.generate('units', 3, seed=30_000, exclude=seen)
  heldout = tasks.generate('units', 4, seed=10_000, exclude=seen + [t.problem for t in examples])
  solutions = {t.id: t.reference_solution for t in task_list}
  with tempfile.TemporaryDirectory() as scratch:
    library = Library(Store(f'file://{scratch}/store/', engine))
    results = flywheel.run(engine, library, task_list, [heldout], solutions, examples,
                           flywheel.Settings(budget=80, attempt_tokens=40, sample_exact=4))
  summary = flywheel.summarize(engine.model_config, results)
  low, high = summary['heldout_delta_ci95']
  print(f"base accuracy {summary['base_accuracy']:.2f}, with the library (recurring) "
        f"{summary['recurring_accuracy']:.2f} in "
        f"{summary['recurring_library_decode_tokens_per_answer']:.1f} decode tokens an answer; "
        f"held out {summary['heldout_base_accuracy']:.2f} -> "
        f"{summary['heldout_library_accuracy']:.2f} (change {summary['heldout_delta']:+.2f}, "
        f"95% interval [{low:+.2f}, {high:+.2f}] over {len(heldout)} problems: a demonstration "
        "too small to judge the change; experiments.flywheel measures it at size); token factor "
        f"on the never-solved: {summary['token_factor']}; sampled grafts SHA-256 equal to fresh: "
        f"{summary['graft_exact_equal']}/{summary['graft_exact_checked']}; held-out answers "
        f"equal to the library as text: {summary['text_equal_answers']}/"
        f"{summary['text_compared']}")
  failed = [] if summary['graft_exact'] is not False else ['flywheel: a graft is not exact']
  if summary['text_equal_answers'] != summary['text_compared']:
    failed.append('flywheel: a grafted answer differs from its text baseline')
  return failed


def main(argv):
  del argv
  with common.heartbeat(lambda: _DOING[0]):
    tour()


def tour() -> None:
  failed = []  # every exactness check that did not hold: any one fails the job
  loaded = common.load_model()
  engine = common.make_engine(loaded)

  step('1. generation')
  prompt = DEMO_TEXTS[0]
  print(prompt + continue_text(engine, prompt, 24))

  step('2. logits')
  arrays = text_logits(engine, DEMO_TEXTS)
  for i, text in enumerate(DEMO_TEXTS):
    top = loaded.tokenizer.decode([int(arrays[f'argmax_{i}'][-1])])
    print(f'{len(arrays[f"ids_{i}"]):3d} tokens, next-token argmax {top!r} after {text[:40]!r}')
  with tempfile.TemporaryDirectory() as scratch:
    files.write_npz(os.path.join(scratch, 'demo.npz'), arrays)
    print('npz keys:', sorted(np.load(os.path.join(scratch, 'demo.npz')).files)[:6], '...')

  step('3. graft exactness')
  writer = common.make_engine(loaded)
  pairs = samples.draw(loaded.tokenizer, FLAGS.samples, seed=0,
                       window=loaded.config.sliding_window)
  rows = []
  with tempfile.TemporaryDirectory() as scratch:
    for i, s in enumerate(pairs):
      r = exactness.check_sample(
          engine, exactness.artifact_graft(writer, engine, os.path.join(scratch, f'a{i}')),
          s.library, s.query)
      rows.append(r)
      print(f"{i + 1}/{len(pairs)}: library {r['library_tokens']:5d}  query "
            f"{r['query_tokens']:4d}  fresh {r['fresh_sha256'][:16]}  graft "
            f"{r['graft_sha256'][:16]}  equal={r['equal']}", flush=True)
  summary = exactness.summarize(rows)
  print(json.dumps(summary))
  if summary['equal'] != summary['samples']:
    failed.append(f"graft exactness: {summary['samples'] - summary['equal']} of "
                  f"{summary['samples']} samples not byte-equal")

  # Replay builds two engines of its own: release the writer and every compiled executable first
  # (the main engine recompiles what it needs, from the compilation cache).
  del writer
  jax.clear_caches()
  gc.collect()

  step('4. replay')
  path = replay.select(FLAGS.manifest)
  with open(path) as f:
    failures = replay.replay(json.load(f))
  print(f'replay of {path}:', 'all hashes reproduce' if not failures else '\n'.join(failures))
  failed.extend(f'replay: {line}' for line in failures)

  step('5. store')
  failed.extend(store_demo(engine, samples.distinct_libraries(loaded.tokenizer, 300, count=3)))

  step('6. flywheel')
  failed.extend(flywheel_demo(engine))

  step('7. figures')
  output_dir = FLAGS.output_dir or common.run_path('figures', suffix='')
  written = figures.draw_figures(FLAGS.results_dir, output_dir, overwrite=FLAGS.overwrite)
  print(f'{sum(p is not None for p in written.values())} figures written to {output_dir}/')
  if failed:
    print('\nFAILED:\n' + '\n'.join(failed))
    sys.exit(1)


if __name__ == '__main__':
  define_flags()
  common.run(main)
