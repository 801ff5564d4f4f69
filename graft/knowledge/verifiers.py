"""Verifiers: plain functions from (expected answer, model output) to a verdict with a reason.

Model output is text, never code: it is read by one documented rule and compared, never
executed or `eval`ed.

The extraction rule. The answer is read from the line after the output's last "Answer:" (up to
the next newline), or, when the output has no "Answer:", from its first line; for numbers, the
first number in it:
an optional minus sign, digits with optional thousands commas, an optional decimal part
(`-?\\d[\\d,]*(\\.\\d+)?`), commas removed. An integer answer must equal the expected integer;
an exact-decimal answer must equal the expected decimal as a number (3.50 == 3.5, compared with
`decimal.Decimal`, never floats); a string answer must equal the expected string exactly after
stripping surrounding whitespace; a regex answer must match the expected pattern in full.

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
  correct: bool
  reason: str
  extracted: str | None


def first_line(output: str) -> str:
  """The answer's text: what follows the last "Answer:" up to the newline, else line one."""
  if 'Answer:' in output:
    output = output.rsplit('Answer:', 1)[1]
  return output.split('\n', 1)[0].strip()


def extract_number(output: str) -> str | None:
  match = NUMBER.search(first_line(output))
  return match.group().replace(',', '') if match else None


def integer(expected: str, output: str) -> Verdict:
  got = extract_number(output)
  if got is None:
    return Verdict(False, 'no number in the answer', None)
  if not _INTEGER.fullmatch(got):
    return Verdict(False, f'{got} is not an integer', got)
  ok = int(got) == int(expected)
  return Verdict(ok, 'equal' if ok else f'{got} != {expected}', got)


def exact_decimal(expected: str, output: str) -> Verdict:
  got = extract_number(output)
  if got is None:
    return Verdict(False, 'no number in the answer', None)
  ok = decimal.Decimal(got) == decimal.Decimal(expected)
  return Verdict(ok, 'equal' if ok else f'{got} != {expected}', got)


def exact_string(expected: str, output: str) -> Verdict:
  got = first_line(output)
  ok = got == expected.strip()
  return Verdict(ok, 'equal' if ok else f'{got[:40]!r} != {expected[:40]!r}', got)


def regex(expected: str, output: str) -> Verdict:
  got = first_line(output)
  try:
    ok = re.fullmatch(expected, got) is not None
  except re.error as e:
    return Verdict(False, f'the expected pattern is not a regular expression ({e})', got)
  return Verdict(ok, 'matches' if ok else f'{got[:40]!r} does not match', got)


VERIFIERS: dict[str, Callable[[str, str], Verdict]] = {
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


def verify(answer: str, verifier: str, output: str) -> Verdict:
  return VERIFIERS[verifier](answer.strip(), output)
