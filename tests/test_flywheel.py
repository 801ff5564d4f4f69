"""The flywheel's parts: verifiers, tasks, the knowledge library, and the command on Gemma 4."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from graft.knowledge import tasks
from gemma_jax import weights
from graft.knowledge import paired, verifiers
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
    ('decimal', '3.5', ' 9 is less than 3.50', True),  # no stated answer: the last number
    ('decimal', '3.5', ' 3.50 \nmore text 9', False),
    ('integer', '86', '41 + 45 = 86.', True),  # as people write them
    ('integer', '86', '41 + 45 = 86. The answer is 86.', True),
    ('integer', '86', 'So the answer is: 86', True),
    ('integer', '86', 'Adding gives $\\boxed{86}$.', True),
    ('integer', '86', '41 + 45 = 86\n#### 86', True),
    ('integer', '86', '41 + 45 = 86. The answer is 85.', False),  # the stated answer counts
    ('integer', '86', 'Answer: 86\nThe answer is 87', False),  # the last stated one
    ('integer', '86', '\\boxed{85} 86', False),
    # What a recurring problem asked for its answer line writes after `Answer:`:
    ('integer', '60', 'Answer: 79 - 19 = 60. The answer is 60.', True),  # one inside another
    ('integer', '-25', 'Answer: 56 - 81 = -25, which gives \\boxed{-25}.', True),
    ('integer', '66', 'Answer: 46 + 20 = 66.', True),  # a stated equation states its result
    ('integer', '46', 'Answer: 46 + 20 = 66.', False),
    ('integer', '6', 'Answer: 2 * 3 = 6 km', True),
    ('string', '2024-03-22', 'The answer is 2024-03-22.', True),
    ('string', '2024-03-22', 'so we get\n2024-03-22', True),
    ('decimal', '0.1', ' 0.10000001', False),
    ('string', '2024-03-22', 'x\nAnswer: 2024-03-22\n\n', True),
    ('string', '2024-03-22', 'Answer: 2024-03-23', False),
    ('regex', r'\d{4}-\d\d-\d\d', 'Answer: 2024-03-22', True),
    ('integer', '7', "__import__('os').system('true')", False),  # read, never run
])
def test_verifiers(verifier, answer, output, correct):
  verdict = verifiers.verify(answer, verifier, output)
  assert verdict.correct is correct and verdict.reason


# Answers the token limit cut (finished=False): a statement on the unfinished last line is no
# statement; it never overrides a complete one before it, and alone it makes the answer
# unreadable (neither correct nor a wrong reading).
@pytest.mark.parametrize('output, correct, unreadable', [
    # The user's case: the entry copied, then the prompt's answer line begun and cut.
    (' 41 + 45 = 86. The answer is 86.\nAnswer: 8', True, False),
    ('Adding gives \\boxed{8', False, True),  # cut before its closing brace
    ('Adding gives \\boxed{86}', True, False),  # a closed box is whole
    ('Answer: 85\nThe answer is 86.\nAnswer: 9', True, False),  # the later complete one wins
    ('The answer is 86', False, True),  # its only statement, cut: it may have gone on
    ('41 + 45 = 86', True, False),  # no statement at all: the last number, as before
])
def test_a_cut_off_statement_is_no_statement(output, correct, unreadable):
  verdict = verifiers.verify('86', 'integer', output, finished=False)
  assert (verdict.correct, verdict.unreadable) == (correct, unreadable), verdict
  # The same texts ended by a stop rule or EOS read every statement as written.
  assert not verifiers.verify('86', 'integer', output).unreadable


@pytest.mark.parametrize('text, stops', [
    (' 41 + 45 = 86. The answer is 86.\n', True),  # a stated answer's line ended
    (' 41 + 45 = 86. The answer is 86.', False),  # not yet: it may go on
    (' so \\boxed{86}\n', True),
    (' 41 + 45 = 86\n#### 86\n', True),
    (' 41 + 45 = 86.\nAnswer: 86\n', True),
    (' 41 + 45 = 86.\n', False),  # no statement yet
])
def test_an_answer_stops_at_the_line_of_any_stated_answer(text, stops):
  assert verifiers.ends_statement(text) is stops


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


def _task(problem, answer):
  return tasks.Task(f't-{answer}', problem, answer, verifiers.verifier_for(answer))


def test_the_library_verifies_each_entry_itself_and_holds_it_once(engine):
  library = Library(Store('memory://', engine))
  task = _task('What is 1 + 2?', '3')
  with pytest.raises(LibraryError, match='refused its answer'):
    library.add(_entry(4, 'What is 1 + 2?'), task)  # an entry answering 4
  with pytest.raises(LibraryError, match='not task'):
    library.add(_entry(3, 'What is 2 + 1?'), task)  # another problem's entry
  assert not library.entries and library.store.stats()['objects'] == 0  # nothing deposited
  library.add(_entry(3, 'What is 1 + 2?'), task)
  with pytest.raises(LibraryError, match='already holds'):
    library.add(_entry(3, 'What is  1 + 2?'), task)
  assert library.find('what is 1 + 2?').id == 'e3'


def test_a_verdict_for_another_answer_deposits_nothing(engine):
  # What an earlier Library.add accepted: answers '1', '2', '3' under one verdict for '0'.
  library = Library(Store('memory://', engine))
  for i in (1, 2, 3):
    with pytest.raises(LibraryError, match='refused its answer'):
      library.add(_entry(i, f'Problem {i}'), _task(f'Problem {i}', '0'))
  assert not library.entries and library.store.stats()['objects'] == 0


def test_batched_attempts_keep_the_one_at_a_time_record(engine, monkeypatch):
  """Base attempts decoded attempt_slots at a time give the sequential protocol's record,
  attempt for attempt (seed, limit, tokens, logits digest): attempts after the verified one
  are dropped and counted, and the attempt the budget ends inside is decoded alone at its
  limit (so the manifest replays unbatched)."""
  from graft.knowledge import flywheel
  winners = set()
  monkeypatch.setattr(flywheel.verifiers, 'verify', lambda answer, verifier, text, finished:
                      verifiers.Verdict(text in winners, 'planted', None))
  header_tokens = [2, 17, 33, 9]
  header = (engine.prefill(header_tokens, logits='none')[0], header_tokens)
  task = _task('What is 3 + 4?', '7')
  asker = flywheel.Asker(engine)
  record = lambda answers: [(a.seed, a.max_tokens, a.tokens, a.logits_sha256, a.verdict.correct)
                            for a in answers]

  def attempts(slots, budget):
    settings = flywheel.Settings(budget=budget, attempt_tokens=6, temperature=1.0,
                                 attempt_slots=slots)
    return flywheel.ask_base(asker, header, task, settings)

  alone, discarded = attempts(1, 16)
  assert discarded == 0 and sum(len(a.tokens) for a in alone) == 16  # the budget spent
  assert alone[-1].max_tokens < 6  # the budget ended inside the last attempt
  for slots in (3, 8):  # the third attempt of the batch is cut by the budget: decoded alone
    together, discarded = attempts(slots, 16)
    assert record(together) == record(alone) and discarded > 0
  winners.add(attempts(1, 40)[0][4].text)  # now the fifth attempt verifies (the second of a
  # batch of 3)
  alone, _ = attempts(1, 40)
  together, discarded = attempts(3, 40)
  assert len(alone) <= 5 and alone[-1].verdict.correct
  assert record(together) == record(alone) and discarded > 0  # its batch's third was dropped


def test_retrieval_ranks_by_bm25_and_the_same_entries_are_a_store_hit(engine):
  library = Library(Store('memory://', engine))
  for i, problem in enumerate(['How many grams are in 3 kilograms?',
                               'What is 12 + 30?', 'How many meters are in 2 kilometers?',
                               'What date is 3 days after 2021-01-01?']):
    library.add(_entry(i, problem), _task(problem, str(i)))
  found = library.retrieve('How many grams are in 7 kilograms?', 2)
  assert [e.id for e in found] == ['e0', 'e2']
  ctx, match, tokens = library.context(found)
  # The first entry is deposited alone, so its prefix is grafted; the rest is left to compute.
  assert len(library.prefix(found[:1])) <= match.tokens < len(tokens)
  assert len(ctx.tokens) == match.tokens and library.store.counters['blocks_written'] > 0
  written = library.store.counters['blocks_written']
  library.context(found)  # nothing deposited by asking
  assert library.store.counters['blocks_written'] == written
  library.store.put(tokens)  # once deposited, the same entries in the same order are a hit
  assert library.context(found)[1].tokens == len(tokens)


# ----------------------------------------------------------------------------------------------
# The command, on the Gemma 4 architecture (as it would run on an accelerator host)


@pytest.mark.slow
def test_flywheel_runs_on_gemma4_and_its_manifest_replays(tmp_path):
  output, manifest = tmp_path / 'fw.json', tmp_path / 'fw_manifest.json'
  env = {**os.environ, 'PYTHONPATH': str(REPO)}
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.flywheel', '--model=tiny_gemma4', '--weights=random:0',
       '--task_set=units', '--tasks_n=4', '--heldout_n=3', '--attempt_tokens=12', '--budget=30',
       '--solutions=generated', '--sample_exact=2', '--rows_per_call=8', f'--output={output}',
       f'--manifest_output={manifest}'], cwd=REPO, env=env, capture_output=True, text=True, timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  result = json.loads(output.read_text())
  assert result['schema'] == 'flywheel/1'
  for field in ('base_accuracy', 'recurring_accuracy', 'heldout_base_accuracy',
                'heldout_library_accuracy', 'never_solved', 'never_solved_answered',
                'never_solved_base_tokens', 'never_solved_library_decode_tokens',
                'token_factor', 'flops_factor', 'energy_factor', 'graft_exact',
                'budget_per_problem', 'heldout_text_accuracy', 'text_equal_answers',
                'heldout_delta', 'heldout_delta_ci95', 'heldout_mcnemar_p',
                'recurring_delta_ci95', 'prefill_tokens_saved', 'ttft_graft_s', 'ttft_text_s',
                'accuracy_by_round'):
    assert field in result['summary'], field
  summary = result['summary']
  assert summary['graft_exact'] is True and summary['budget_per_problem'] == 30
  # Every held-out answer with the library grafted equals its text baseline, token for token.
  assert summary['text_compared'] == 6 and summary['text_equal_answers'] == 6
  assert summary['heldout_library_accuracy'] == summary['heldout_text_accuracy']
  assert [r['round'] for r in summary['accuracy_by_round']] == [1, 2]
  for row in result['tasks']:
    if row['split'] == 'recurring':  # attempts until verified or the budget is spent
      assert row['base_correct'] or row['base_decode_tokens'] == 30, row
    else:
      assert row['text_equal'] is True and row['text_decode_tokens'] == \
          row['library_decode_tokens']
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
  # Its sampled answers were drawn by the spec's sampler, which the manifest names; read as a
  # manifest that names none (drawn by sampling.LEGACY), the replay draws otherwise and says so.
  from gemma_jax import sampling
  from graft import replay as replays
  recorded = json.loads(manifest.read_text())
  assert recorded['sampler'] == sampling.SAMPLER
  sampled = next(i for i, a in enumerate(recorded['answers']) if a['temperature'] == 0) or 1
  assert all(a['temperature'] > 0 for a in recorded['answers'][:sampled])
  del recorded['sampler']
  assert replays.replay(recorded, limit=sampled), 'sampled answers replayed by another sampler'


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
       '--attempt_tokens=4', '--budget=4', '--rounds=1', '--rows_per_call=8', f'--output={output}'],
      cwd=REPO, env={**os.environ, 'PYTHONPATH': str(REPO)}, capture_output=True, text=True,
      timeout=900)
  assert run.returncode == 0, run.stderr[-3000:]
  summary = json.loads(output.read_text())['summary']
  assert summary['solutions_rejected'] == 1 and summary['deposited'] == 0


@pytest.mark.parametrize('flags, message', [
    (['--budget=8', '--attempt_tokens=16'], 'smaller than one attempt'),
    (['--attempt_tokens=0'], 'flag --attempt_tokens=0: 0 is not a positive integer'),
    (['--rounds=0'], 'flag --rounds=0: 0 is not a positive integer'),
])
def test_bad_budgets_are_refused_in_one_line_before_the_model_loads(tmp_path, flags, message):
  output = tmp_path / 'fw.json'
  run = subprocess.run(
      [sys.executable, '-m', 'experiments.flywheel', '--model=tiny_gemma3', '--weights=random:0',
       '--task_set=units', f'--output={output}', *flags], cwd=REPO,
      env={**os.environ, 'PYTHONPATH': str(REPO)}, capture_output=True, text=True, timeout=300)
  assert run.returncode == 2 and message in run.stderr, run.stderr[-2000:]
  assert run.stderr.strip().count('\n') == 0 and not output.exists()


def test_paired_differences_have_their_interval_and_exact_p_value():
  base = [True] * 10 + [False] * 10
  other = [True] * 10 + [True] * 6 + [False] * 4  # 6 discordant, all for the library
  assert paired.delta(base, other) == pytest.approx(0.3)
  assert paired.mcnemar_exact(base, other) == pytest.approx(2 / 64)  # 2 * 0.5 ** 6
  assert paired.mcnemar_exact(base, base) == 1.0
  low, high = paired.bootstrap_ci(base, other, seed=1)
  assert 0 < low < 0.3 < high <= 0.6
  assert paired.bootstrap_ci(base, other, seed=1) == [low, high]  # seeded
  with pytest.raises(ValueError, match='differ in length'):
    paired.mcnemar_exact(base, other[:-1])


def test_energy_is_read_from_rapl_counters_where_the_kernel_has_them(tmp_path, monkeypatch):
  from graft.knowledge import flywheel
  monkeypatch.setattr(flywheel, 'RAPL_GLOB', str(tmp_path / 'intel-rapl:*' / 'energy_uj'))
  assert flywheel.rapl_joules() is None  # none here: CPU seconds are used instead
  for package, microjoules in ((0, 2_500_000), (1, 500_000)):
    (tmp_path / f'intel-rapl:{package}').mkdir()
    (tmp_path / f'intel-rapl:{package}' / 'energy_uj').write_text(f'{microjoules}\n')
  assert flywheel.rapl_joules() == 3.0
  meter = flywheel.Meter()
  (tmp_path / 'intel-rapl:0' / 'energy_uj').write_text('4500000\n')
  assert meter.joules() == 2.0 and meter.cpu_seconds() >= 0


def test_a_recurring_problem_is_recalled_from_its_own_entry(engine):
  # Its prompt is the entry's own tokens through the answer cue, all but the last grafted from
  # the store; the answer decoded there is the fresh computation's, byte for byte.
  from graft.knowledge import flywheel
  library = Library(Store('memory://', engine))
  task, entry = _task('What is 1 + 2?', '3'), _entry(3, 'What is 1 + 2?')
  library.add(entry, task)
  ctx, match, prompt, cue = library.recall(entry)
  stored = library.prefix([entry])
  assert len(prompt) < len(stored) and prompt == stored[:len(prompt)]
  assert library.tokenizer.decode(prompt[1:]) == 'Problem: What is 1 + 2?\nSolution: worked 3\n' \
      'Answer:' and cue == 'Answer:'
  assert match.tokens == len(ctx.tokens) == len(prompt) - 1
  asked = flywheel.ask_library(flywheel.Asker(engine), library, [entry], task, 6, check=True,
                               recall=True)
  assert asked.prompt == prompt and asked.grafted == len(prompt) - 1 and asked.cue == cue
  assert asked.graft_exact is True and 0 < len(asked.tokens) <= 6


def _scripted_sampler(monkeypatch, script):
  """The engine's sampler replaced by one that writes `script`, token by token, in every decode
  (each decode and each batch slot has its own generator, and so its own place in the script):
  the model on random weights never writes an answer line, so a stop rule could never fire."""
  from graft.engine import _engine, batch
  places = {}

  def sample(logits, temperature, draws):
    places[draws] = places.get(draws, -1) + 1
    return script[min(places[draws], len(script) - 1)]

  monkeypatch.setattr(_engine, 'sample', sample)  # one stream
  monkeypatch.setattr(batch, 'sample', sample)  # batch slots


def test_a_recall_stops_at_the_end_of_its_answer_line(engine, monkeypatch):
  """A recurring problem's prompt ends with the cue "Answer:" (library.RECALL): its answer, as
  the flywheel asks it (ask_library with recall), is decoded by the engine under the stop rule of
  an answer continuing that cue, so the decode ends with the answer's line, as the README's
  decode tokens per recurring answer count it. The same holds for a base attempt (no cue: a
  stated answer's line), alone and in batch slots."""
  from graft.knowledge import flywheel
  from graft.knowledge.library import RECALL, RECALL_CUE
  assert RECALL.endswith(RECALL_CUE)
  asker = flywheel.Asker(engine)
  encode = lambda text: asker.tokenizer.encode(text, add_bos=False)  # noqa: E731
  # The rule itself: the cue and the decoded text are read together.
  assert asker.stopper(RECALL_CUE)(encode(' 86\n'))
  assert not asker.stopper(RECALL_CUE)(encode(' 86'))  # the line may go on
  assert not asker.stopper()(encode(' 86\n'))  # no statement without the cue
  # Through the decode: a recall that writes its answer line, then goes on.
  library = Library(Store('memory://', engine))
  task, entry = _task('What is 1 + 2?', '3'), _entry(3, 'What is 1 + 2?')
  library.add(entry, task)
  answer, more = encode(' 3\n'), encode('Problem: What is 2 + 2?\nSolution: 4 and 4 more')
  _scripted_sampler(monkeypatch, answer + more)
  asked = flywheel.ask_library(asker, library, [entry], task, len(answer + more), check=True,
                               recall=True)
  assert asked.cue == RECALL_CUE and asked.tokens == answer, asker.tokenizer.decode(asked.tokens)
  assert asked.verdict.correct and asked.graft_exact is True
  # A base attempt states its answer and goes on: it stops at the end of the statement's line,
  # decoded alone or three attempts at a time.
  answer = encode(' 1 + 2 = 3. The answer is 3.\n')
  _scripted_sampler(monkeypatch, answer + more)
  header_tokens = [2, 17, 33, 9]
  header = (engine.prefill(header_tokens, logits='none')[0], header_tokens)
  for slots in (1, 3):
    settings = flywheel.Settings(budget=3 * len(answer + more), attempt_tokens=len(answer + more),
                                 temperature=1.0, attempt_slots=slots)
    asked, _ = flywheel.ask_base(asker, header, task, settings)
    assert [a.tokens for a in asked] == [answer] and asked[0].verdict.correct, slots
