"""The flywheel loop: attempt, verify, deposit, answer from the library, count what it saved.

The phases and what each counts are described in experiments/flywheel.py, the entry point over
`run`; `summarize` and `manifest` give the result and the replayable record.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import hashlib
import time
from typing import Callable, Sequence

from absl import logging
import numpy as np

from gemma_jax import compare, cost, sampling
from gemma_jax.config import EOS_ID, TransformerConfig
from graft.engine import Context, Engine
from graft.knowledge import tasks as tasks_lib
from graft.knowledge import paired, verifiers
from graft.knowledge.library import Entry, Library, LibraryError, question_tokens, worked
from graft.knowledge.tasks import Task


@dataclasses.dataclass
class Asked:
  """One answer: the prompt it came from, how it was decoded, what came out, what it cost."""

  prompt: list[int]  # every token before the answer (library prefix or few-shot, question)
  grafted: int  # tokens of the prompt grafted from the store (not computed)
  temperature: float
  seed: int
  max_tokens: int  # the decode tokens it was allowed
  tokens: list[int]
  logits_sha256: str
  text: str
  verdict: verifiers.Verdict
  seconds: float  # from the start of the answer (graft or prefill included) to its end
  first_logits_seconds: float  # from the start to the logits of its first token (TTFT)
  cpu_seconds: float  # this process's CPU time over the same span (every thread)
  joules: float | None = None  # RAPL package energy over the same span, where readable
  graft_exact: bool | None = None
  cue: str = ''  # text the prompt ends with that the answer continues ('Answer:' in a recall)


class Meter:
  """Wall time, CPU time and (where the kernel exposes RAPL) package energy since creation."""

  def __init__(self):
    self.wall, self.cpu, self.energy = time.perf_counter(), time.process_time(), rapl_joules()

  def seconds(self) -> float:
    """Wall seconds since the meter started."""
    return time.perf_counter() - self.wall

  def cpu_seconds(self) -> float:
    """This process's CPU seconds (every thread) since the meter started."""
    return time.process_time() - self.cpu

  def joules(self) -> float | None:
    """Package energy since the meter started, from RAPL; None where there is no RAPL."""
    now = rapl_joules()
    return None if now is None or self.energy is None else now - self.energy


RAPL_GLOB = '/sys/class/powercap/intel-rapl:[0-9]*/energy_uj'


def rapl_joules() -> float | None:
  """The summed energy counters of the CPU packages (/sys/class/powercap/intel-rapl:N), in
  joules; None where the kernel exposes none or they are not readable (counter wrap-around
  is not handled: a package counter wraps after hours)."""
  total, found = 0, False
  for path in sorted(glob.glob(RAPL_GLOB)):
    try:
      with open(path) as f:
        total += int(f.read())
      found = True
    except (OSError, ValueError):
      return None
  return total / 1e6 if found else None


class Asker:
  """Decodes answers under one engine: a worked solution and a stated answer, stopping at the
  end of the line of any final-answer statement the extraction rule reads (`Answer: X`, `The
  answer is X`, `\\boxed{X}`, `#### X`: graft/knowledge/verifiers.py), at a blank line, or at
  EOS. An answer the token limit ended instead is unfinished, and its verdict knows it."""

  def __init__(self, engine: Engine):
    self.engine = engine
    self.tokenizer = engine.loaded.tokenizer

  def stopper(self, cue: str = '') -> Callable[[list[int]], bool]:
    """The stop rule of an answer that continues `cue` (text its prompt ends with)."""
    def stop(tokens: list[int]) -> bool:
      if tokens[-1] == EOS_ID:
        return True
      text = cue + self.tokenizer.decode(tokens)
      return '\n\n' in text or verifiers.ends_statement(text)
    return stop

  def ask(self, ctx: Context, prompt: Sequence[int], grafted: int, task: Task, meter: Meter, *,
          max_tokens: int, temperature: float, seed: int, cue: str = '') -> Asked:
    """Answers from `ctx`, a context holding `prompt` with its last logits (it is not consumed);
    `meter` was started before the prompt was grafted or computed; `cue`: the text the prompt
    ends with that the answer continues."""
    first = meter.seconds()
    decoded = self.engine.decode(ctx, max_tokens, temperature=temperature, seed=seed,
                                 stop=self.stopper(cue))
    return self._asked(prompt, grafted, task, decoded, temperature, seed, max_tokens, first,
                       meter, 1.0, cue)

  def ask_batch(self, ctx: Context, prompt: Sequence[int], task: Task, meter: Meter, *,
                max_tokens: int, temperature: float, seeds: Sequence[int]) -> list[Asked]:
    """`ask` for several sampled attempts at once, one engine batch slot each
    (`Engine.decode_batch`: each gets exactly what it gets alone). The meter's span is shared
    equally among them."""
    first = meter.seconds()
    decoded = self.engine.decode_batch([ctx] * len(seeds), [max_tokens] * len(seeds),
                                       temperatures=[temperature] * len(seeds), seeds=seeds,
                                       stop=self.stopper())
    return [self._asked(prompt, 0, task, d, temperature, seed, max_tokens, first, meter,
                        1 / len(seeds)) for d, seed in zip(decoded, seeds)]

  def _asked(self, prompt, grafted, task, decoded, temperature, seed, max_tokens, first,
             meter: Meter, share: float, cue: str = '') -> Asked:
    text = self.tokenizer.decode(decoded.tokens)
    finished = bool(decoded.tokens) and self.stopper(cue)(decoded.tokens)  # not cut by the limit
    joules = meter.joules()
    return Asked(prompt=list(prompt), grafted=grafted, temperature=temperature, seed=seed,
                 max_tokens=max_tokens, tokens=decoded.tokens,
                 logits_sha256=decoded.logits_sha256, text=text, cue=cue,
                 verdict=verifiers.verify(task.answer, task.verifier, cue + text, finished),
                 seconds=meter.seconds() * share, first_logits_seconds=first,
                 cpu_seconds=meter.cpu_seconds() * share,
                 joules=None if joules is None else joules * share)

  def ask_fresh(self, prompt: Sequence[int], task: Task, *, max_tokens: int,
                temperature: float = 0.0, seed: int = 0, cue: str = '') -> Asked:
    """The same question with its whole prompt prefilled fresh (no graft): the text baseline,
    and the fresh computation a grafted answer must equal byte for byte."""
    meter = Meter()
    ctx, _ = self.engine.prefill(prompt, logits='last')
    return self.ask(ctx, prompt, 0, task, meter, max_tokens=max_tokens,
                    temperature=temperature, seed=seed, cue=cue)


def attempt_seed(seed: int, task_id: str, attempt: int) -> int:
  """The sampler seed of one attempt: a function of the run's seed, the task and the attempt."""
  return int(hashlib.sha256(f'{seed}/{task_id}/{attempt}'.encode()).hexdigest()[:8], 16)


def few_shot(engine: Engine, library: Library,
             examples: list[tasks_lib.Task]) -> tuple[Context, list[int]]:
  """The base condition's header: solved examples in the library's format (computed, not
  grafted: the model without a library)."""
  shots = [Entry(t.id, t.problem, worked(t.reference_solution or t.answer), t.answer, 'example')
           for t in examples]
  tokens = library.prefix(shots)
  ctx, _ = engine.prefill(tokens, logits='none')
  return ctx, tokens


def ask_base(asker: Asker, header: tuple[Context, list[int]], task: Task, settings: 'Settings', *,
             greedy: bool = False) -> tuple[list[Asked], int]:
  """Without a library, after the few-shot header. Attempts until one verifies or the
  problem's decode budget is spent: each at most `attempt_tokens` (the last one what is
  left), sampled at the settings' temperature with a seed per attempt; every decode token
  counts. `greedy`: one greedy answer of at most `attempt_tokens` (the held-out condition).

  Attempts run `attempt_slots` at a time in the engine's batch slots; the record is the
  sequential protocol's, attempt by attempt: those after the first verified one (or past the
  budget) are dropped and counted in the returned `discarded` tokens, and an attempt longer
  than what the budget leaves it is decoded again alone at that limit (its logits digest
  covers only the tokens it may have)."""
  budget = settings.attempt_tokens if greedy else settings.budget
  header_ctx, header_tokens = header
  meter = Meter()
  question = question_tokens(asker.tokenizer, task.problem)
  prompt = header_tokens + question
  ctx, _ = asker.engine.extend(header_ctx, question, logits='last')
  if greedy:
    return [asker.ask(ctx, prompt, 0, task, meter, max_tokens=budget, temperature=0.0,
                      seed=0)], 0
  answers: list[Asked] = []
  spent, discarded = 0, 0
  while spent < budget:
    limit = min(settings.attempt_tokens, budget - spent)
    seeds = [attempt_seed(settings.seed, task.id, len(answers) + j)
             for j in range(min(settings.attempt_slots, -(-(budget - spent) // limit)))]
    batch = (asker.ask_batch(ctx, prompt, task, meter, max_tokens=limit,
                             temperature=settings.temperature, seeds=seeds) if len(seeds) > 1
             else [asker.ask(ctx, prompt, 0, task, meter, max_tokens=limit,
                             temperature=settings.temperature, seed=seeds[0])])
    meter = Meter()
    for j, asked in enumerate(batch):
      if spent >= budget or (answers and answers[-1].verdict.correct):
        discarded += sum(len(a.tokens) for a in batch[j:])
        break
      allowed = min(settings.attempt_tokens, budget - spent)
      if len(asked.tokens) > allowed:  # the budget ends inside it: decoded alone to the limit
        discarded += len(asked.tokens)
        asked = asker.ask(ctx, prompt, 0, task, Meter(), max_tokens=allowed,
                          temperature=settings.temperature, seed=asked.seed)
      asked.max_tokens = allowed
      answers.append(asked)
      spent += len(asked.tokens)
    if answers[-1].verdict.correct:
      break
  return answers, discarded


def ask_library(asker: Asker, library: Library, entries: list[Entry], task: Task,
                max_tokens: int, check: bool, recall: bool = False) -> Asked:
  """One greedy answer with the entries grafted from the store as one prefix; `check`: also
  decoded from a fresh prefill of the same prompt, and compared by SHA-256. `recall`: the
  problem is the one entry's own (a recurring one), so the prompt is that entry up to its
  answer cue (Library.recall) and the model states the answer it holds."""
  meter = Meter()
  if recall:
    ctx, match, prompt, cue = library.recall(entries[0])
  else:
    ctx, match, prefix = library.context(entries)
    prompt, cue = prefix + question_tokens(library.tokenizer, task.problem), ''
  ctx, _ = asker.engine.extend(ctx, prompt[match.tokens:], logits='last', consume=True)
  asked = asker.ask(ctx, prompt, match.tokens, task, meter, max_tokens=max_tokens,
                    temperature=0.0, seed=0, cue=cue)
  if check:
    fresh = asker.ask_fresh(asked.prompt, task, max_tokens=max_tokens, cue=cue)
    asked.graft_exact = fresh.logits_sha256 == asked.logits_sha256
  return asked


# ----------------------------------------------------------------------------------------------
# The loop


def base_flops(config: TransformerConfig, asked: list[Asked]) -> int:
  """A base task: its prompt prefilled once, then every decode token of every attempt."""
  if not asked:
    return 0
  prompt = len(asked[0].prompt)
  return (cost.prefill_flops(config, prompt) + sum(
      cost.decode_flops(config, prompt + i) for a in asked for i in range(len(a.tokens))))


def library_flops(config: TransformerConfig, asked: Asked) -> int:
  """A library answer: only the prompt's tokens after the grafted prefix are prefilled."""
  prompt = len(asked.prompt)
  computed = prompt - asked.grafted
  return (cost.prefill_flops(config, computed, start=asked.grafted)
          + sum(cost.decode_flops(config, prompt + i) for i in range(len(asked.tokens))))


def deposit(library: Library, task: Task, base: list[Asked], solutions: dict,
            counts: dict[str, int]) -> str | None:
  """Puts the task in the library if a verified solution exists; returns its source."""
  solved = [a for a in base if a.verdict.correct]
  if solved:
    entry = Entry(task.id, task.problem, worked(solved[0].text), task.answer, 'self')
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
    library.add(entry, task)
  except LibraryError as e:
    counts['entries_refused'] += 1
    logging.warning('%s', e)
    return None
  return entry.source


def round_of_heldout(asker: Asker, library: Library, header: tuple[Context, list[int]],
                     heldout: Sequence[Task], settings: Settings, round_: int) -> list[dict]:
  """Each held-out problem three ways: the base model (one greedy answer), its k retrieved
  entries grafted from the store, and the same entries' text prefilled fresh (the text
  baseline: a graft gives exactly its logits, so the answers must be token-for-token equal,
  and their logits SHA-256 equal; what the graft changes is the cost)."""
  rows = []
  for i, task in enumerate(heldout):
    base, _ = ask_base(asker, header, task, settings, greedy=True)
    entries = library.retrieve(task.problem, settings.k)
    lib = text = None
    if entries:
      lib = ask_library(asker, library, entries, task, settings.attempt_tokens, check=False)
      text = asker.ask_fresh(lib.prompt, task, max_tokens=settings.attempt_tokens)
      lib.graft_exact = text.logits_sha256 == lib.logits_sha256
    rows.append({'task': task, 'split': 'heldout', 'round': round_, 'base': base,
                 'library': lib, 'text': text, 'retrieved': [e.id for e in entries]})
    logging.info('held-out (round %d) %d/%d: base %s, library %s, the same tokens as text %s',
                 round_, i + 1, len(heldout), base[0].verdict.correct,
                 lib.verdict.correct if lib else None,
                 text.tokens == lib.tokens if lib and text else None)
  return rows


def deposit_round(library: Library, rows: list[dict], round_: int) -> int:
  """The next round's library: this round's verified held-out answers (the library's when it
  was right, else the base model's), each checked by the library again; returns how many."""
  added = 0
  for row in rows:
    right = [a for a in (row['library'], row['base'][0]) if a is not None and a.verdict.correct]
    if not right:
      continue
    task = row['task']
    try:
      library.add(Entry(task.id, task.problem, worked(right[0].text), task.answer,
                        f'self_round{round_}'), task)
      row['deposited_next_round'] = True
      added += 1
    except LibraryError:
      pass
  return added


@dataclasses.dataclass(frozen=True)
class Settings:
  """How the loop asks (the flags of the same names)."""

  budget: int = 64  # decode tokens a recurring problem may spend in all, over its attempts
  attempt_tokens: int = 40  # decode tokens of one attempt (and of every greedy answer)
  temperature: float = 0.7
  seed: int = 0
  k: int = 3
  sample_exact: int = 10
  attempt_slots: int = 1  # attempts of a problem decoded together in the engine's batch slots

  def __post_init__(self):
    if self.attempt_tokens < 1:
      raise ValueError(f'--attempt_tokens={self.attempt_tokens}: an attempt needs at least one '
                       'decode token')
    if self.budget < self.attempt_tokens:
      raise ValueError(f'--budget={self.budget} is smaller than one attempt '
                       f'(--attempt_tokens={self.attempt_tokens})')
    if self.k < 1:
      raise ValueError(f'--k={self.k}: retrieve at least one entry')
    if self.attempt_slots < 1:
      raise ValueError(f'--attempt_slots={self.attempt_slots}: decode at least one attempt '
                       'at a time')


def run(engine: Engine, library: Library, task_list: Sequence[Task],
        heldout_sets: Sequence[Sequence[Task]], solutions: dict, examples: list[Task],
        settings: Settings) -> dict:
  """The recurring phases, then one held-out round per set in `heldout_sets`; after each round
  but the last, the library grows by that round's verified answers. Rows of Asked."""
  asker = Asker(engine)
  header = few_shot(engine, library, examples)
  counts = {'solutions_rejected': 0, 'entries_refused': 0}
  rows: list[dict] = []
  for i, task in enumerate(task_list):  # (a) base within the budget, (b) deposit
    base, discarded = ask_base(asker, header, task, settings)
    source = deposit(library, task, base, solutions, counts)
    rows.append({'task': task, 'split': 'recurring', 'base': base, 'source': source,
                 'discarded_tokens': discarded})
    logging.info('task %d/%d %s: base %s in %d attempts (%d tokens), deposited: %s', i + 1,
                 len(task_list), task.id, base[-1].verdict.correct, len(base),
                 sum(len(a.tokens) for a in base), source)
  checked = 0
  for row in rows:  # (c) recurring
    entry = library.find(row['task'].problem) if row['source'] else None
    row['library'] = (ask_library(asker, library, [entry], row['task'], settings.attempt_tokens,
                                  check=checked < settings.sample_exact, recall=True)
                      if entry else None)
    checked += entry is not None
  rounds = []
  for r, heldout in enumerate(heldout_sets, 1):  # (d) held out, round by round
    entries = len(library.entries)
    round_rows = round_of_heldout(asker, library, header, heldout, settings, r)
    added = deposit_round(library, round_rows, r) if r < len(heldout_sets) else 0
    rounds.append({'round': r, 'library_entries': entries, 'deposited_after': added})
    rows += round_rows
  return {'rows': rows, 'counts': counts, 'rounds': rounds,
          'settings': dataclasses.asdict(settings)}


def task_row(row: dict) -> dict:
  """One task's row of the result: its base attempts and library answer, what each decoded and
  cost, and what it deposited."""
  base, lib, text = row['base'], row.get('library'), row.get('text')
  return {
      'id': row['task'].id, 'split': row['split'], 'round': row.get('round', 1),
      'family': row['task'].family,
      'base_correct': any(a.verdict.correct for a in base),
      'base_decode_tokens': sum(len(a.tokens) for a in base),
      'base_attempts': len(base),
      'base_discarded_tokens': row.get('discarded_tokens', 0),
      'deposited': row.get('source') is not None if row['split'] == 'recurring'
                   else bool(row.get('deposited_next_round')),
      'source': row.get('source'),
      'library_correct': None if lib is None else lib.verdict.correct,
      'library_unreadable': None if lib is None else lib.verdict.unreadable,
      'library_decode_tokens': None if lib is None else len(lib.tokens),
      'grafted_tokens': None if lib is None else lib.grafted,
      'graft_exact': None if lib is None else lib.graft_exact,
      'text_correct': None if text is None else text.verdict.correct,
      'text_decode_tokens': None if text is None else len(text.tokens),
      'text_equal': None if text is None or lib is None else text.tokens == lib.tokens,
      'retrieved': row.get('retrieved'),
      'base_answer': base[-1].text, 'library_answer': None if lib is None else lib.text,
      'base_seconds': sum(a.seconds for a in base),
      'library_seconds': None if lib is None else lib.seconds,
      'library_first_logits_seconds': None if lib is None else lib.first_logits_seconds,
      'text_first_logits_seconds': None if text is None else text.first_logits_seconds,
  }


def summarize(config: TransformerConfig, results: dict, *, seed: int = 0) -> dict:
  """The flywheel result (schema flywheel, analysis/results.py) of `run`'s results: per-task
  rows, the recurring and held-out phases' accuracies with Wilson intervals, and the decode
  tokens, FLOPs and energy the library saved."""
  rows = results['rows']
  recurring = [r for r in rows if r['split'] == 'recurring']
  by_round = collections.defaultdict(list)
  for r in rows:
    if r['split'] == 'heldout':
      by_round[r['round']].append(r)
  heldout = by_round.get(1, [])
  tasks = [task_row(r) for r in recurring]
  accuracy = lambda xs: sum(xs) / len(xs) if xs else None
  correct = lambda asked: bool(asked and asked.verdict.correct)
  median = lambda xs: float(np.median(xs)) if xs else None
  never = [r for r in recurring if not any(a.verdict.correct for a in r['base'])]
  never_lib = [r for r in never if r.get('library') is not None]
  base_tokens = sum(len(a.tokens) for r in never_lib for a in r['base'])
  lib_tokens = sum(len(r['library'].tokens) for r in never_lib)
  base_f = sum(base_flops(config, r['base']) for r in never_lib)
  lib_f = sum(library_flops(config, r['library']) for r in never_lib)
  base_asked = [a for r in never_lib for a in r['base']]
  lib_asked = [r['library'] for r in never_lib]
  method = ('rapl' if never_lib and all(a.joules is not None for a in base_asked + lib_asked)
            else 'cpu_seconds')
  energy = lambda xs: sum(a.joules if method == 'rapl' else a.cpu_seconds for a in xs)
  base_e, lib_e = energy(base_asked), energy(lib_asked)
  checks = [r['library'].graft_exact for r in rows
            if r.get('library') is not None and r['library'].graft_exact is not None]
  compared = [r for rr in by_round.values() for r in rr if r.get('text') is not None]
  h_base = [correct(r['base'][0]) for r in heldout]
  h_lib = [correct(r.get('library')) for r in heldout]
  r_base = [t['base_correct'] for t in tasks]
  r_lib = [bool(t['library_correct']) for t in tasks]
  rounds = []
  for info in results.get('rounds', []):
    rr = by_round[info['round']]
    rounds.append({**info, 'n': len(rr),
                   'base': accuracy([correct(r['base'][0]) for r in rr]),
                   'library': accuracy([correct(r.get('library')) for r in rr]),
                   'text': accuracy([correct(r.get('text')) for r in rr]),
                   'delta_ci95': paired.bootstrap_ci([correct(r['base'][0]) for r in rr],
                                                     [correct(r.get('library')) for r in rr],
                                                     seed=seed)})
  second = by_round.get(2, [])
  phases = {'base': [a for r in rows for a in r['base']],
            'library': [r['library'] for r in rows if r.get('library') is not None],
            'text': [r['text'] for r in rows if r.get('text') is not None]}
  return {
      'budget_per_problem': results['settings']['budget'],
      'attempt_tokens': results['settings']['attempt_tokens'],
      'base_accuracy': accuracy(r_base),
      'recurring_accuracy': accuracy(r_lib),
      'recurring_delta_ci95': paired.bootstrap_ci(r_base, r_lib, seed=seed),
      'heldout_base_accuracy': accuracy(h_base),
      'heldout_library_accuracy': accuracy(h_lib),
      'heldout_text_accuracy': accuracy([correct(r.get('text')) for r in heldout]),
      'heldout_delta': paired.delta(h_base, h_lib),
      'heldout_delta_ci95': paired.bootstrap_ci(h_base, h_lib, seed=seed),
      'heldout_mcnemar_p': paired.mcnemar_exact(h_base, h_lib),
      'text_equal_answers': sum(r['text'].tokens == r['library'].tokens for r in compared),
      'text_compared': len(compared),
      'prefill_tokens_saved': sum(r['library'].grafted for r in compared),
      'prefill_flops_saved': sum(cost.prefill_flops(config, r['library'].grafted)
                                 for r in compared if r['library'].grafted),
      'ttft_graft_s': median([r['library'].first_logits_seconds for r in compared]),
      'ttft_text_s': median([r['text'].first_logits_seconds for r in compared]),
      'accuracy_by_round': rounds,
      'heldout_round2_base_accuracy': accuracy([correct(r['base'][0]) for r in second]),
      'heldout_round2_library_accuracy': accuracy([correct(r.get('library')) for r in second]),
      'library_entries_round2': rounds[0]['deposited_after'] if rounds else 0,
      'deposited': sum(t['deposited'] for t in tasks),
      'deposited_self': sum(t['source'] == 'self' for t in tasks),
      'deposited_solutions': sum(t['source'] == 'solutions' for t in tasks),
      'solutions_rejected': results['counts']['solutions_rejected'],
      'entries_refused': results['counts']['entries_refused'],
      'never_solved': len(never),
      'never_solved_answered': sum(r['library'].verdict.correct for r in never_lib),
      'never_solved_base_tokens': base_tokens,
      'attempt_slots': results['settings'].get('attempt_slots', 1),
      'batch_discarded_tokens': sum(t['base_discarded_tokens'] for t in tasks),
      'never_solved_library_decode_tokens': lib_tokens,
      'recurring_library_decode_tokens_per_answer': (
          sum(t['library_decode_tokens'] for t in tasks if t['library_decode_tokens'])
          / max(1, sum(1 for t in tasks if t['library_decode_tokens']))),
      'token_factor': base_tokens / lib_tokens if lib_tokens else None,
      'flops_factor': base_f / lib_f if lib_f else None,
      'energy_factor': base_e / lib_e if lib_e else None,
      'energy_method': ('RAPL package energy counters, base attempts against graft + library '
                        'answer on the same problems' if method == 'rapl' else
                        'CPU seconds of this process (every thread) on the same problems, base '
                        'attempts against graft + library answer, at the same power per busy '
                        'core in both: this machine exposes no RAPL counters'),
      # Answers whose only final-answer statement the token limit cut: not correct, and not
      # read as a wrong answer either (graft/knowledge/verifiers.py), per phase.
      'unreadable_answers': {phase: sum(a.verdict.unreadable for a in asked)
                             for phase, asked in phases.items()},
      'graft_exact': all(checks) if checks else None,
      'graft_exact_checked': len(checks),
      'graft_exact_equal': sum(checks),
  }


def manifest(config: dict, engine: Engine, results: dict) -> dict:
  """The replayable record of a run: the config, the engine and model fingerprints, how sampled
  tokens were drawn (gemma_jax.sampling.SAMPLER), and every answer's prompt token ids, decoding
  settings, tokens and logits SHA-256 (graft.replay)."""
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
                      'seed': a.seed, 'max_tokens': a.max_tokens, 'tokens': a.tokens,
                      'logits_sha256': a.logits_sha256, 'cue': a.cue})
  return {'kind': 'flywheel', 'config': config, 'model_fingerprint': engine.model_fingerprint,
          'engine_fingerprint': engine.fingerprint, 'budget': config['budget'],
          'sampler': sampling.SAMPLER, 'answers': answers}
