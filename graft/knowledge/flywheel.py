"""The flywheel loop: attempt, verify, deposit, answer from the library, count what it saved.

The phases and what each counts are described in experiments/flywheel.py, the entry point over
`run`; `summarize` and `manifest` give the result and the replayable record.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time

from absl import logging
import numpy as np

from gemma_jax import compare, cost
from gemma_jax.config import EOS_ID
from graft.knowledge import tasks as tasks_lib
from graft.knowledge import verifiers
from graft.knowledge.library import Entry, Library, LibraryError, QUESTION, worked


@dataclasses.dataclass
class Asked:
  """One answer: the prompt it came from, how it was decoded, what came out."""

  prompt: list[int]  # every token before the answer (library prefix or few-shot, question)
  grafted: int  # tokens of the prompt grafted from the store (not computed)
  temperature: float
  seed: int
  tokens: list[int]
  logits_sha256: str
  text: str
  verdict: verifiers.Verdict
  seconds: float
  graft_exact: bool | None = None


class Asker:
  """Decodes answers under one engine: a worked solution, then "Answer: ...", stopping at the
  end of the answer's line (or of the entry, at a blank line, or at EOS)."""

  def __init__(self, engine, budget: int):
    self.engine = engine
    self.budget = budget
    self.tokenizer = engine.loaded.tokenizer

  def stop(self, tokens: list[int]) -> bool:
    if tokens[-1] == EOS_ID:
      return True
    text = self.tokenizer.decode(tokens)
    return '\n\n' in text or ('Answer:' in text and '\n' in text.rsplit('Answer:', 1)[1])

  def ask(self, ctx, prompt, grafted, task, *, temperature, seed) -> Asked:
    """Answers from `ctx`, a context holding `prompt` (it is not consumed)."""
    start = time.perf_counter()
    decoded = self.engine.decode(ctx, self.budget, temperature=temperature, seed=seed,
                                 stop=self.stop)
    text = self.tokenizer.decode(decoded.tokens)
    return Asked(prompt=list(prompt), grafted=grafted, temperature=temperature, seed=seed,
                 tokens=decoded.tokens, logits_sha256=decoded.logits_sha256, text=text,
                 verdict=verifiers.verify(task.answer, task.verifier, text),
                 seconds=time.perf_counter() - start)

  def fresh_logits_sha(self, asked: Asked) -> str:
    """The same decoding from a fresh computation of the whole prompt."""
    ctx, _ = self.engine.prefill(asked.prompt, logits='last')
    return self.engine.decode(ctx, self.budget, temperature=asked.temperature, seed=asked.seed,
                              stop=self.stop).logits_sha256


def attempt_seed(seed: int, task_id: str, attempt: int) -> int:
  """The sampler seed of one attempt: a function of the run's seed, the task and the attempt."""
  return int(hashlib.sha256(f'{seed}/{task_id}/{attempt}'.encode()).hexdigest()[:8], 16)


def few_shot(engine, library: Library, examples: list[tasks_lib.Task]):
  """The base condition's header: solved examples in the library's format (computed, not
  grafted: the model without a library)."""
  shots = [Entry(t.id, t.problem, worked(t.reference_solution or t.answer), t.answer, 'example')
           for t in examples]
  tokens = library.prefix(shots)
  ctx, _ = engine.prefill(tokens, logits='none')
  return ctx, tokens


def ask_base(asker: Asker, header, task, attempts: int, temperature: float, seed: int):
  """Up to `attempts` sampled answers after the few-shot header; stops at the first correct."""
  header_ctx, header_tokens = header
  question = asker.tokenizer.encode(QUESTION.format(problem=task.problem), add_bos=False)
  ctx, _ = asker.engine.extend(header_ctx, question, logits='last')
  answers = []
  for attempt in range(attempts):
    asked = asker.ask(ctx, header_tokens + question, 0, task, temperature=temperature,
                      seed=attempt_seed(seed, task.id, attempt))
    answers.append(asked)
    if asked.verdict.correct:
      break
  return answers


def ask_library(asker: Asker, library: Library, entries: list[Entry], task, check: bool):
  """One greedy answer with the entries grafted from the store as one prefix."""
  start = time.perf_counter()
  ctx, match, prefix = library.context(entries)
  question = library.question(task.problem)
  ctx, _ = asker.engine.extend(ctx, prefix[match.tokens:] + question, logits='last',
                               consume=True)
  asked = asker.ask(ctx, prefix + question, match.tokens, task, temperature=0.0, seed=0)
  asked.seconds = time.perf_counter() - start  # graft included: what the library costs
  if check:
    asked.graft_exact = asker.fresh_logits_sha(asked) == asked.logits_sha256
  return asked


# ----------------------------------------------------------------------------------------------
# The loop


def base_flops(config, asked: list[Asked]) -> int:
  """A base task: its prompt prefilled once, then every decode token of every attempt."""
  if not asked:
    return 0
  prompt = len(asked[0].prompt)
  return (cost.prefill_flops(config, prompt) + sum(
      cost.decode_flops(config, prompt + i) for a in asked for i in range(len(a.tokens))))


def library_flops(config, asked: Asked) -> int:
  """A library answer: only the prompt's tokens after the grafted prefix are prefilled."""
  prompt = len(asked.prompt)
  computed = prompt - asked.grafted
  return (cost.prefill_flops(config, computed, start=asked.grafted)
          + sum(cost.decode_flops(config, prompt + i) for i in range(len(asked.tokens))))


def deposit(library: Library, task, base: list[Asked], solutions: dict, counts) -> str | None:
  """Puts the task in the library if a verified solution exists; returns its source."""
  solved = [a for a in base if a.verdict.correct]
  if solved:
    entry = Entry(task.id, task.problem, worked(solved[0].text), task.answer, 'self')
    verdict = solved[0].verdict
  elif task.id in solutions:
    verdict = tasks_lib.check_solution(task, solutions[task.id])
    if not verdict.correct:
      counts['solutions_rejected'] += 1
      logging.warning('%s: solution rejected (%s)', task.id, verdict.reason)
      return None
    entry = Entry(task.id, task.problem, worked(solutions[task.id]), task.answer, 'solutions')
  else:
    return None
  try:
    library.add(entry, verdict)
  except LibraryError as e:
    counts['entries_refused'] += 1
    logging.warning('%s', e)
    return None
  return entry.source


def round_of_heldout(asker, library, header, heldout, k, sample_exact, round_) -> list[dict]:
  rows = []
  for i, task in enumerate(heldout):
    base = ask_base(asker, header, task, 1, 0.0, 0)[0]
    entries = library.retrieve(task.problem, k)
    lib = ask_library(asker, library, entries, task, check=i < sample_exact) if entries else None
    rows.append({'task': task, 'split': 'heldout', 'round': round_, 'base': [base],
                 'library': lib, 'retrieved': [e.id for e in entries]})
    logging.info('held-out (round %d) %d/%d: base %s, library %s', round_, i + 1, len(heldout),
                 base.verdict.correct, lib.verdict.correct if lib else None)
  return rows


@dataclasses.dataclass(frozen=True)
class Settings:
  """How the loop asks (the flags of the same names)."""

  attempts: int = 4
  temperature: float = 0.7
  seed: int = 0
  budget: int = 40
  k: int = 3
  sample_exact: int = 10


def run(engine, library: Library, task_list, heldout_sets, solutions, examples,
        settings: Settings) -> dict:
  """The four phases (and round two when `heldout_sets` has two sets); rows of Asked."""
  asker = Asker(engine, settings.budget)
  header = few_shot(engine, library, examples)
  counts = {'solutions_rejected': 0, 'entries_refused': 0}
  rows = []
  for i, task in enumerate(task_list):  # (a) base, (b) deposit
    base = ask_base(asker, header, task, settings.attempts, settings.temperature,
                    settings.seed)
    source = deposit(library, task, base, solutions, counts)
    rows.append({'task': task, 'split': 'recurring', 'base': base, 'source': source})
    logging.info('task %d/%d %s: base %s in %d attempts (%d tokens), deposited: %s', i + 1,
                 len(task_list), task.id, base[-1].verdict.correct, len(base),
                 sum(len(a.tokens) for a in base), source)
  checked = 0
  for row in rows:  # (c) recurring
    entry = library.find(row['task'].problem) if row['source'] else None
    row['library'] = (ask_library(asker, library, [entry], row['task'],
                                  check=checked < settings.sample_exact) if entry else None)
    checked += entry is not None
  heldout_rows = round_of_heldout(asker, library, header, heldout_sets[0], settings.k,
                                  settings.sample_exact, 1)
  second = []
  if len(heldout_sets) > 1:  # round two: the library grows by round one's held-out answers
    for row in heldout_rows:
      lib = row['library']
      if lib is not None and lib.verdict.correct:
        task = row['task']
        try:
          library.add(Entry(task.id, task.problem, worked(lib.text), task.answer,
                            'self_heldout'), lib.verdict)
          row['deposited_round2'] = True
        except LibraryError:
          pass
    second = round_of_heldout(asker, library, header, heldout_sets[1], settings.k,
                              settings.sample_exact, 2)
  return {'rows': rows + heldout_rows + second, 'counts': counts}


def task_row(row: dict) -> dict:
  base, lib = row['base'], row.get('library')
  return {
      'id': row['task'].id, 'split': row['split'], 'round': row.get('round', 1),
      'family': row['task'].family,
      'base_correct': any(a.verdict.correct for a in base),
      'base_decode_tokens': sum(len(a.tokens) for a in base),
      'base_attempts': len(base),
      'deposited': row.get('source') is not None if row['split'] == 'recurring'
                   else bool(row.get('deposited_round2')),
      'source': row.get('source'),
      'library_correct': None if lib is None else lib.verdict.correct,
      'library_decode_tokens': None if lib is None else len(lib.tokens),
      'grafted_tokens': None if lib is None else lib.grafted,
      'graft_exact': None if lib is None else lib.graft_exact,
      'retrieved': row.get('retrieved'),
      'base_answer': base[-1].text, 'library_answer': None if lib is None else lib.text,
      'base_seconds': sum(a.seconds for a in base),
      'library_seconds': None if lib is None else lib.seconds,
  }


def summarize(config, results: dict) -> dict:
  rows = results['rows']
  recurring = [r for r in rows if r['split'] == 'recurring']
  heldout = [r for r in rows if r['split'] == 'heldout' and r['round'] == 1]
  second = [r for r in rows if r['split'] == 'heldout' and r['round'] == 2]
  tasks = [task_row(r) for r in recurring]
  accuracy = lambda xs: sum(xs) / len(xs) if xs else None
  never = [r for r in recurring if not any(a.verdict.correct for a in r['base'])]
  never_lib = [r for r in never if r.get('library') is not None]
  base_tokens = sum(len(a.tokens) for r in never_lib for a in r['base'])
  lib_tokens = sum(len(r['library'].tokens) for r in never_lib)
  base_f = sum(base_flops(config, r['base']) for r in never_lib)
  lib_f = sum(library_flops(config, r['library']) for r in never_lib)
  base_s = sum(a.seconds for r in never_lib for a in r['base'])
  lib_s = sum(r['library'].seconds for r in never_lib)
  checks = [r['library'].graft_exact for r in rows
            if r.get('library') is not None and r['library'].graft_exact is not None]
  return {
      'base_accuracy': accuracy([t['base_correct'] for t in tasks]),
      'recurring_accuracy': accuracy([bool(t['library_correct']) for t in tasks]),
      'heldout_base_accuracy': accuracy([r['base'][0].verdict.correct for r in heldout]),
      'heldout_library_accuracy': accuracy(
          [bool(r['library'] and r['library'].verdict.correct) for r in heldout]),
      'heldout_round2_base_accuracy': accuracy([r['base'][0].verdict.correct for r in second]),
      'heldout_round2_library_accuracy': accuracy(
          [bool(r['library'] and r['library'].verdict.correct) for r in second]),
      'library_entries_round2': sum(bool(r.get('deposited_round2')) for r in heldout),
      'deposited': sum(t['deposited'] for t in tasks),
      'deposited_self': sum(t['source'] == 'self' for t in tasks),
      'deposited_solutions': sum(t['source'] == 'solutions' for t in tasks),
      'solutions_rejected': results['counts']['solutions_rejected'],
      'never_solved': len(never),
      'never_solved_answered': sum(r['library'].verdict.correct for r in never_lib),
      'never_solved_base_tokens': base_tokens,
      'never_solved_library_decode_tokens': lib_tokens,
      'token_factor': base_tokens / lib_tokens if lib_tokens else None,
      'flops_factor': base_f / lib_f if lib_f else None,
      'energy_factor': base_s / lib_s if lib_s else None,
      'energy_method': 'wall time on the same problems (base attempts against graft + library '
                       'answer), assuming the same CPU power draw in both: this machine exposes '
                       'no power counters',
      'graft_exact': all(checks) if checks else None,
      'graft_exact_checked': len(checks),
      'graft_exact_equal': sum(checks),
  }


def manifest(config: dict, engine, results: dict) -> dict:
  answers = []
  for row in results['rows']:
    task = row['task']
    asked = [('base', a) for a in row['base']]
    if row.get('library') is not None:
      asked.append(('library', row['library']))
    for phase, a in asked:
      answers.append({'id': task.id, 'split': row['split'], 'phase': phase,
                      'problem_sha256': compare.sha256_bytes(
                          np.frombuffer(task.problem.encode(), np.uint8)),
                      'answer_sha256': compare.sha256_bytes(
                          np.frombuffer(task.answer.encode(), np.uint8)),
                      'prompt': a.prompt, 'grafted': a.grafted, 'temperature': a.temperature,
                      'seed': a.seed, 'tokens': a.tokens, 'logits_sha256': a.logits_sha256})
  return {'kind': 'flywheel', 'config': config, 'model_fingerprint': engine.model_fingerprint,
          'engine_fingerprint': engine.fingerprint, 'budget': config['budget'],
          'answers': answers}
