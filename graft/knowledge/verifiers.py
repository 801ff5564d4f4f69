"""Verifiers: plain functions from (expected answer, model output) to a verdict with a reason.

Model output is text, never code: it is read by one documented rule and compared, never
executed or `eval`ed. The same rule reads a solution handed over from elsewhere and the model's
own output.

The extraction rule. The answer is the one the text states last in a final-answer form:
`Answer: X`, `The answer is X` (any case), `\\boxed{X}` or `#### X`, X running to the end of
its line (for `\\boxed`, to the closing brace); of several, the one that starts last, a form
inside another's X included (`Answer: 79 - 19 = 60. The answer is 60.` states 60). A text
the token limit cut (`finished=False`: it ended at the limit, not at a stop rule or EOS) may end
in a statement cut short: one on its unfinished last line (a `\\boxed{` there without its
closing brace included) is no statement, and never overrides a complete one before it; where
it is the only one, the answer is unreadable (`Verdict.unreadable`: not correct, and counted
apart from wrong answers). A text in none of these forms states its answer as its last number
(numeric answers) or its last non-empty line (string answers). A number is an optional minus
sign, digits with optional thousands commas and an optional decimal part
(`-?\\d[\\d,]*(\\.\\d+)?`, commas removed): the first number of a stated answer (of its part
after its last `=` when that part has one: a stated equation, `Answer: 46 + 20 = 66.`, states
its result), or the text's last. An integer answer must equal the expected integer; an
exact-decimal answer must equal the expected decimal as a number (3.50 == 3.5, compared with
`decimal.Decimal`, never floats); a string answer must equal the expected
string exactly after stripping surrounding whitespace (and a sentence's final period, when the
expected string has none); a regex answer must match the expected pattern in full.

`verifier_for(answer)` picks integer, then decimal, then string, from the expected answer's own
form; a task may name one explicitly ('integer', 'decimal', 'string', 'regex').
"""

from __future__ import annotations

import dataclasses
import decimal
import re
from typing import Callable

NUMBER = re.compile(r'-?\d[\d,]*(?:\.\d+)?')
_INTEGER = re.compile(r'-?\d+')
_DECIMAL = re.compile(r'-?\d+(?:\.\d+)?')


@dataclasses.dataclass(frozen=True)
class Verdict:
  """Whether an answer is correct, why, and what was read from it."""

  correct: bool
  reason: str
  extracted: str | None
  unreadable: bool = False  # its only statement was cut by the token limit (never correct)


UNREADABLE = Verdict(False, 'unreadable: the token limit cut its only final-answer statement',
                     None, unreadable=True)


# The final-answer forms, each capturing the stated answer.
_STATED = re.compile(r'Answer:[ \t]*([^\n]*)|[Tt][Hh][Ee] [Aa][Nn][Ss][Ww][Ee][Rr] [Ii][Ss]:?[ \t]*'
                     r'([^\n]*)|\\boxed\{([^{}\n]*)\}|####[ \t]*([^\n]*)')
# Every statement, overlapping ones included (a lookahead matches at each place a form starts).
_EVERY_STATED = re.compile(f'(?=(?:{_STATED.pattern}))')


class Cut(Exception):
  """The text's only final-answer statement was cut by the token limit."""


def stated_answer(text: str, finished: bool = True) -> str | None:
  """The answer a text states last in a complete final-answer form (None when it uses none);
  raises Cut where its only one was cut short (see the module doc)."""
  unfinished = len(text) if finished else text.rfind('\n') + 1  # the cut line starts here
  found, cut = None, False
  for match in _EVERY_STATED.finditer(text):
    if match.start() >= unfinished and not match.group(3):  # a closed \boxed{} is complete
      cut = True
      continue
    found = next(g for g in match.groups() if g is not None)
  if not finished and '\\boxed{' in text[unfinished:]:
    cut |= '}' not in text[text.rfind('\\boxed{'):]
  if found is None and cut:
    raise Cut()
  return None if found is None else found.strip()


def ends_statement(text: str) -> bool:
  """Whether a text holds a complete final-answer statement whose line has ended: where an
  answer stops (graft/knowledge/flywheel.Asker)."""
  return any('\n' in text[match.start():] for match in _STATED.finditer(text))


def extract_number(text: str, finished: bool = True) -> str | None:
  """The number `text` states as its answer (the module's rule; commas removed), or None."""
  stated = stated_answer(text, finished)
  if stated is not None and NUMBER.search(stated.rpartition('=')[2]):
    stated = stated.rpartition('=')[2]  # a stated equation states its result
  numbers = NUMBER.findall(text if stated is None else stated)
  if not numbers:
    return None
  return (numbers[-1] if stated is None else numbers[0]).replace(',', '')


def extract_text(text: str, expected: str = '', finished: bool = True) -> str:
  """A string answer: the stated one, else the last non-empty line; a final period dropped
  unless the expected answer ends in one."""
  got = stated_answer(text, finished)
  if got is None:
    lines = [line.strip() for line in text.split('\n') if line.strip()]
    got = lines[-1] if lines else ''
  if got.endswith('.') and not expected.endswith('.'):
    got = got[:-1].rstrip()
  return got


def integer(expected: str, output: str, finished: bool = True) -> Verdict:
  """Correct when the stated number is an integer equal to `expected`."""
  got = extract_number(output, finished)
  if got is None:
    return Verdict(False, 'no number in the answer', None)
  if not _INTEGER.fullmatch(got):
    return Verdict(False, f'{got} is not an integer', got)
  ok = int(got) == int(expected)
  return Verdict(ok, 'equal' if ok else f'{got} != {expected}', got)


def exact_decimal(expected: str, output: str, finished: bool = True) -> Verdict:
  """Correct when the stated number equals `expected` as a decimal (3.50 == 3.5)."""
  got = extract_number(output, finished)
  if got is None:
    return Verdict(False, 'no number in the answer', None)
  ok = decimal.Decimal(got) == decimal.Decimal(expected)
  return Verdict(ok, 'equal' if ok else f'{got} != {expected}', got)


def exact_string(expected: str, output: str, finished: bool = True) -> Verdict:
  """Correct when the stated answer equals `expected` after stripping whitespace."""
  got = extract_text(output, expected, finished)
  ok = got == expected.strip()
  return Verdict(ok, 'equal' if ok else f'{got[:40]!r} != {expected[:40]!r}', got)


def regex(expected: str, output: str, finished: bool = True) -> Verdict:
  """Correct when the stated answer matches the pattern `expected` in full."""
  got = extract_text(output, finished=finished)
  try:
    ok = re.fullmatch(expected, got) is not None
  except re.error as e:
    return Verdict(False, f'the expected pattern is not a regular expression ({e})', got)
  return Verdict(ok, 'matches' if ok else f'{got[:40]!r} does not match', got)


VERIFIERS: dict[str, Callable[..., Verdict]] = {
    'integer': integer, 'decimal': exact_decimal, 'string': exact_string, 'regex': regex}


def verifier_for(answer: str, name: str | None = None) -> str:
  """The verifier a task's answer takes: `name` if given (checked against the answer), else
  integer, decimal or string by the answer's form. Raises ValueError for an answer its
  verifier cannot read."""
  if name is None:
    if _INTEGER.fullmatch(answer.strip()):
      return 'integer'
    if _DECIMAL.fullmatch(answer.strip()):
      return 'decimal'
    return 'string'
  if name not in VERIFIERS:
    raise ValueError(f'unknown verifier {name!r}; expected one of {sorted(VERIFIERS)}')
  if name == 'integer' and not _INTEGER.fullmatch(answer.strip()):
    raise ValueError(f'answer {answer!r} is not an integer')
  if name == 'decimal' and not _DECIMAL.fullmatch(answer.strip()):
    raise ValueError(f'answer {answer!r} is not an exact decimal')
  if name == 'regex':
    try:
      re.compile(answer)
    except re.error as e:
      raise ValueError(f'answer {answer!r} is not a regular expression ({e})') from None
  return name


def verify(answer: str, verifier: str, output: str, finished: bool = True) -> Verdict:
  """The verdict on `output`; finished=False: the token limit ended it (see the module doc)."""
  try:
    return VERIFIERS[verifier](answer.strip(), output, finished)
  except Cut:
    return UNREADABLE
