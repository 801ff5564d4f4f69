"""Verifiable tasks: seeded generators with ground truth, and a JSONL loader for anyone's own set.

Generated families (`--task_set`): a problem, its answer (the verifier checks it) and a worked
reference solution (what a stronger solver would hand over; used with --solutions=generated):

  arithmetic      2- and 3-digit addition and subtraction
  multiplication  a 1- or 2-digit number times a 1- or 2-digit number
  word            two-step word problems (buy some, give some away)
  dates           a date plus or minus a number of days (answer YYYY-MM-DD, exact string)
  units           unit conversions with decimals (answer an exact decimal)

Files: one {"id": ..., "problem": ..., "answer": ...} a line (optional "verifier": integer,
decimal, string or regex); solutions: one {"id": ..., "solution": ...} a line. A solution's
answer is read by the verifiers' extraction rule (graft/knowledge/verifiers.py: `Answer: X`,
`The answer is X`, `\\boxed{X}`, `#### X`, else its last number) and checked by the task's
verifier before the solution may enter a library. Bad input raises ValueError naming
the file, line and problem; a solution that fails its check is rejected and counted, never
deposited.
"""

from __future__ import annotations

import dataclasses
import datetime
from typing import Iterable

import numpy as np

from gemma_jax import files
from graft.knowledge import verifiers

FAMILIES = ('arithmetic', 'multiplication', 'word', 'dates', 'units')
_NAMES = ('Ana', 'Ben', 'Chen', 'Dara', 'Eli', 'Fatima', 'Goran', 'Hana', 'Ivan', 'Juno')
_ITEMS = ('apples', 'books', 'marbles', 'stamps', 'pencils', 'coins', 'shells', 'cards')
_UNITS = (('meters', 'centimeters', 100), ('kilometers', 'meters', 1000),
          ('kilograms', 'grams', 1000), ('hours', 'minutes', 60), ('liters', 'milliliters', 1000),
          ('minutes', 'seconds', 60))


@dataclasses.dataclass(frozen=True)
class Task:
  """A problem with its expected answer and the verifier that judges an answer to it."""

  id: str
  problem: str
  answer: str
  verifier: str
  family: str = 'file'
  reference_solution: str | None = None  # generated sets only


def _one(family: str, rng: np.random.Generator) -> tuple[str, str, str]:
  """(problem, answer, worked solution) of one task of `family`."""
  if family == 'arithmetic':
    digits = int(rng.integers(2, 4))
    a, b = (int(x) for x in rng.integers(10 ** (digits - 1), 10 ** digits, 2))
    if rng.random() < 0.5:
      return f'What is {a} + {b}?', str(a + b), f'{a} + {b} = {a + b}.'
    return f'What is {a} - {b}?', str(a - b), f'{a} - {b} = {a - b}.'
  if family == 'multiplication':
    a, b = int(rng.integers(2, 40)), int(rng.integers(2, 13))
    return f'What is {a} * {b}?', str(a * b), f'{a} * {b} = {a * b}.'
  if family == 'word':
    name, item = _NAMES[int(rng.integers(len(_NAMES)))], _ITEMS[int(rng.integers(len(_ITEMS)))]
    have, buy = int(rng.integers(3, 30)), int(rng.integers(2, 20))
    give = int(rng.integers(1, have + buy))
    total = have + buy - give
    return (f'{name} has {have} {item}, buys {buy} more and gives away {give}. How many {item} '
            f'does {name} have now?', str(total),
            f'{have} + {buy} = {have + buy}, and {have + buy} - {give} = {total}.')
  if family == 'dates':
    start = datetime.date(2020, 1, 1) + datetime.timedelta(days=int(rng.integers(0, 2000)))
    days = int(rng.integers(1, 60))
    after = rng.random() < 0.5
    end = start + datetime.timedelta(days=days if after else -days)
    word = 'after' if after else 'before'
    return (f'What date is {days} days {word} {start.isoformat()}?', end.isoformat(),
            f'{start.isoformat()} {"+" if after else "-"} {days} days = {end.isoformat()}.')
  if family == 'units':
    big, small, factor = _UNITS[int(rng.integers(len(_UNITS)))]
    value = int(rng.integers(1, 200)) / (2 if rng.random() < 0.5 else 1)
    text = f'{value:g}'
    result = f'{value * factor:g}'
    return (f'How many {small} are in {text} {big}?', result,
            f'1 {big[:-1]} is {factor} {small}, so {text} * {factor} = {result}.')
  raise ValueError(f'unknown task set {family!r}; expected one of {FAMILIES}')


def generate(family: str, count: int, *, seed: int, exclude: Iterable[str] = ()) -> list[Task]:
  """`count` distinct tasks of `family` (none whose problem is in `exclude`)."""
  rng = np.random.default_rng([seed, FAMILIES.index(family) if family in FAMILIES else -1])
  seen, tasks = set(exclude), list[Task]()
  for _ in range(100 * count):
    if len(tasks) == count:
      break
    problem, answer, solution = _one(family, rng)
    if problem in seen:
      continue
    seen.add(problem)
    tasks.append(Task(id=f'{family}-{seed}-{len(tasks)}', problem=problem, answer=answer,
                      verifier=verifiers.verifier_for(answer), family=family,
                      reference_solution=f'{solution}\nAnswer: {answer}'))
  if len(tasks) < count:
    raise ValueError(f'{family}: only {len(tasks)} distinct tasks, {count} asked for')
  return tasks


def read_tasks(path: str) -> list[Task]:
  """Tasks of a JSONL file (see the module docstring); every problem is reported with its line."""
  tasks, ids = [], set()
  for number, record in files.jsonl_records(path):
    where = f'{path}:{number}'
    for field in ('id', 'problem', 'answer'):
      if field not in record:
        raise ValueError(f'{where}: missing field "{field}"')
    task_id, problem, answer = (str(record['id']), record['problem'], record['answer'])
    if not isinstance(problem, str) or not problem.strip():
      raise ValueError(f'{where}: "problem" must be a non-empty string')
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
      answer = str(answer)
    if not isinstance(answer, str) or not answer.strip():
      raise ValueError(f'{where}: "answer" must be a non-empty string or number')
    if task_id in ids:
      raise ValueError(f'{where}: duplicate id {task_id!r}')
    ids.add(task_id)
    try:
      verifier = verifiers.verifier_for(answer, record.get('verifier'))
    except ValueError as e:
      raise ValueError(f'{where}: {e}') from None
    tasks.append(Task(id=task_id, problem=problem, answer=answer.strip(), verifier=verifier))
  return tasks


def read_solutions(path: str) -> dict[str, str]:
  """{task id: solution text} from a JSONL file of {"id", "solution"} records (ValueError
  naming the line of a malformed or duplicate record)."""
  solutions = {}
  for number, record in files.jsonl_records(path):
    if not isinstance(record.get('solution'), str) or 'id' not in record:
      raise ValueError(f'{path}:{number}: expected {{"id": ..., "solution": "..."}}')
    if str(record['id']) in solutions:
      raise ValueError(f'{path}:{number}: duplicate id {record["id"]!r}')
    solutions[str(record['id'])] = record['solution']
  return solutions


def check_solution(task: Task, solution: str) -> verifiers.Verdict:
  """A handed-over solution, read by the verifiers' one extraction rule."""
  return verifiers.verify(task.answer, task.verifier, solution)
