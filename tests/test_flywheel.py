"""The flywheel's parts: verifiers, tasks, the knowledge library, and the command on Gemma 4."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from graft.knowledge import tasks
from gemma_jax import weights
from graft.knowledge import verifiers
from graft.engine import Engine, EngineConfig
from graft.knowledge.library import Entry, Library, LibraryError
from graft.store import Store

REPO = pathlib.Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------
# Verifiers: one extraction rule, numbers compared exactly, output never executed


@pytest.mark.parametrize('verifier, answer, output, correct', [
    ('integer', '1233', ' 673 + 560 = 1233.\nAnswer: 1233\n', True),
    ('integer', '1233', ' 673 + 560 = 1233.\nAnswer: 1,233', True),  # thousands commas
    ('integer', '1233', ' 1233 is wrong.\nAnswer: 1232\n', False),  # the last Answer: counts
    ('integer', '-11', 'Answer: -11', True),
    ('integer', '5', ' five', False),
    ('integer', '5', ' 5.5', False),
    ('decimal', '350', ' Answer: 350.0', True),
    ('decimal', '3.5', ' 3.50 \nmore text 9', True),  # no Answer: the first line
    ('decimal', '0.1', ' 0.10000001', False),
    ('string', '2024-03-22', 'x\nAnswer: 2024-03-22\n\n', True),
    ('string', '2024-03-22', 'Answer: 2024-03-23', False),
    ('regex', r'\d{4}-\d\d-\d\d', 'Answer: 2024-03-22', True),
    ('integer', '7', "__import__('os').system('true')", False),  # read, never run
])
def test_verifiers(verifier, answer, output, correct):
  verdict = verifiers.verify(answer, verifier, output)
  assert verdict.correct is correct and verdict.reason


def test_verifier_is_chosen_from_the_answer_or_refused():
  assert verifiers.verifier_for('42') == 'integer'
  assert verifiers.verifier_for('-4.25') == 'decimal'
  assert verifiers.verifier_for('2024-01-02') == 'string'
  with pytest.raises(ValueError, match='not an integer'):
    verifiers.verifier_for('4.5', 'integer')
  with pytest.raises(ValueError, match='not a regular expression'):
    verifiers.verifier_for('(', 'regex')


# ----------------------------------------------------------------------------------------------
# Tasks


@pytest.mark.parametrize('family', tasks.FAMILIES)
def test_generated_tasks_are_seeded_distinct_and_their_solutions_verify(family):
  a = tasks.generate(family, 30, seed=1)
  assert a == tasks.generate(family, 30, seed=1) != tasks.generate(family, 30, seed=2)
  assert len({t.problem for t in a}) == 30
  held = tasks.generate(family, 30, seed=2, exclude=[t.problem for t in a])
  assert not {t.problem for t in a} & {t.problem for t in held}
  for task in a:
    assert tasks.check_solution(task, task.reference_solution).correct, task


def _jsonl(path, records):
  path.write_text(''.join(json.dumps(r) + '\n' for r in records))
  return str(path)


@pytest.mark.parametrize('records, message', [
    ([{'id': 1, 'problem': 'p'}], 'missing field "answer"'),
    ([{'id': 1, 'problem': 'p', 'answer': '3'}, {'id': 1, 'problem': 'q', 'answer': '4'}],
     'duplicate id'),
    ([{'id': 1, 'problem': 'p', 'answer': 'x', 'verifier': 'integer'}], 'not an integer'),
    ([{'id': 1, 'problem': '', 'answer': '3'}], 'non-empty string'),
    ([], 'holds no records'),
])
def test_bad_task_files_are_refused_naming_the_line(tmp_path, records, message):
  with pytest.raises(ValueError, match=message):
    tasks.read_tasks(_jsonl(tmp_path / 't.jsonl', records))


def test_task_files_read_numbers_and_explicit_verifiers(tmp_path):
  read = tasks.read_tasks(_jsonl(tmp_path / 't.jsonl', [
      {'id': 'a', 'problem': 'p', 'answer': 17},
      {'id': 'b', 'problem': 'q', 'answer': '2.5'},
      {'id': 'c', 'problem': 'r', 'answer': r'\d+', 'verifier': 'regex'}]))
  assert [(t.answer, t.verifier) for t in read] == [('17', 'integer'), ('2.5', 'decimal'),
                                                     (r'\d+', 'regex')]


# ----------------------------------------------------------------------------------------------
# The library


@pytest.fixture(scope='module')
def engine():
  return Engine(weights.load('tiny_gemma3', 'random:0'), EngineConfig(rows_per_call=8,
                                                                      cache_len=1024))


def _entry(i, problem):
  return Entry(f'e{i}', problem, f'worked {i}', str(i), 'solutions')


def test_the_library_accepts_only_verified_entries_once(engine):
  library = Library(Store('memory://', engine))
  good = verifiers.verify('3', 'integer', 'Answer: 3')
  bad = verifiers.verify('3', 'integer', 'Answer: 4')
  with pytest.raises(LibraryError, match='refused its answer'):
    library.add(_entry(3, 'What is 1 + 2?'), bad)
  assert not library.entries and library.store.stats()['objects'] == 0  # nothing deposited
  library.add(_entry(3, 'What is 1 + 2?'), good)
  with pytest.raises(LibraryError, match='already holds'):
    library.add(_entry(4, 'What is  1 + 2?'), good)
  assert library.find('what is 1 + 2?').id == 'e3'


def test_retrieval_ranks_by_bm25_and_the_same_entries_are_a_store_hit(engine):
  library = Library(Store('memory://', engine))
  ok = verifiers.Verdict(True, 'equal', '0')
  for i, problem in enumerate(['How many grams are in 3 kilograms?',
                               'What is 12 + 30?', 'How many meters are in 2 kilometers?',
                               'What date is 3 days after 2021-01-01?']):
    library.add(_entry(i, problem), ok)
  found = library.retrieve('How many grams are in 7 kilograms?', 2)
  assert [e.id for e in found] == ['e0', 'e2']
  ctx, match, tokens = library.context(found)
  assert match.tokens == len(tokens)
  written = library.store.counters['blocks_written']
  again_ctx, again, _ = library.context(found)  # the same entries in the same order: a hit
  assert again.tokens == len(tokens) and library.store.counters['blocks_written'] == written


# ----------------------------------------------------------------------------------------------
# The command, on the Gemma 4 architecture (as it would run on an accelerator host)


@pytest.mark.slow
def test_flywheel_runs_on_gemma4_and_its_manifest_replays(tmp_path):
  output, manifest = tmp_path / 'fw.json', tmp_path / 'fw_manifest.json'
  env = {**os.environ, 'PYTHONPATH': str(REPO)}
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.flywheel', '--model=tiny_gemma4', '--weights=random:0',
       '--task_set=units', '--tasks_n=4', '--heldout_n=3', '--attempts=2', '--budget=12',
       '--solutions=generated', '--sample_exact=2', '--block_size=8', f'--output={output}',
       f'--manifest={manifest}'], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads(output.read_text())
  assert result['schema'] == 'flywheel/1'
  for field in ('base_accuracy', 'recurring_accuracy', 'heldout_base_accuracy',
                'heldout_library_accuracy', 'never_solved', 'never_solved_answered',
                'never_solved_base_tokens', 'never_solved_library_decode_tokens',
                'token_factor', 'flops_factor', 'energy_factor', 'graft_exact'):
    assert field in result['summary'], field
  assert result['summary']['graft_exact'] is True
  assert result['summary']['deposited'] == 4  # the generated solutions, verified
  for row in result['tasks']:
    assert row['split'] in ('recurring', 'heldout')
    assert set(row) >= {'id', 'base_correct', 'base_decode_tokens', 'deposited', 'source',
                        'library_correct', 'library_decode_tokens', 'grafted_tokens',
                        'graft_exact'}
  replay = subprocess.run([sys.executable, '-m', 'experiments.replay',
                           f'--manifest={manifest}'], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=900)
  assert replay.returncode == 0 and 'reproduce' in replay.stdout, replay.stderr[-2000:]


def test_a_solution_that_fails_verification_is_rejected_and_counted(tmp_path):
  task_file = _jsonl(tmp_path / 't.jsonl', [{'id': 'a', 'problem': 'What is 2 + 2?',
                                             'answer': '4'}])
  solutions = _jsonl(tmp_path / 's.jsonl', [{'id': 'a', 'solution': '2 + 2 = 5\nAnswer: 5'}])
  heldout = _jsonl(tmp_path / 'h.jsonl', [{'id': 'h', 'problem': 'What is 3 + 3?',
                                           'answer': '6'}])
  output = tmp_path / 'fw.json'
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.flywheel', '--model=tiny_gemma3', '--weights=random:0',
       f'--tasks={task_file}', f'--heldout={heldout}', f'--solutions={solutions}',
       '--attempts=1', '--budget=4', '--rounds=1', '--block_size=8', f'--output={output}'],
      cwd=REPO, env={**os.environ, 'PYTHONPATH': str(REPO)}, capture_output=True, text=True,
      timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  summary = json.loads(output.read_text())['summary']
  assert summary['solutions_rejected'] == 1 and summary['deposited'] == 0
