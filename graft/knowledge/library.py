"""The verified-knowledge library: verified solutions kept as KV in the store, grafted on demand.

An entry is a problem, a worked solution and its answer, accepted only when the library itself
has run the task's verifier (graft/knowledge/verifiers.py) on the entry's text. Its canonical
text is one template:

    Problem: {problem}
    Solution: {solution}
    Answer: {answer}
    <blank line>

and a question is asked as `QUESTION` ("Problem: {problem}\\nSolution:"): the model writes a
worked solution and a stated answer, from which graft/knowledge/verifiers.py reads it. A
recurring problem is recalled from its own entry (`recall`): the entry's text up to its answer
cue ("...Solution: {solution}\\nAnswer:"), all but its last token grafted from the store, so the
model states the answer after the verified trace that reached it, in a few decode tokens. A
library prefix is BOS followed by the canonical texts of some entries in a fixed order,
tokenized as one text. Every entry is deposited alone, as its own prefix, in the
store (graft/store/_store.py), computed once by the byte-exact engine; a prefix of several entries
grafts its longest stored prefix and computes the rest.

Lookup: `find` (the exact problem: the recurring case), or `retrieve`: the k entries most similar
to a problem by BM25 (the bm25s package) over the entries' problem texts, most similar first
(ties by entry id), assembled as one prefix by `context`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from gemma_jax.config import BOS_ID
from gemma_jax.tokenizer import Tokenizer
from graft.knowledge import verifiers
from graft.knowledge.tasks import Task
from graft.engine import Context
from graft.store import Match, Store

ENTRY = 'Problem: {problem}\nSolution: {solution}\nAnswer: {answer}\n\n'
QUESTION = 'Problem: {problem}\nSolution:'
# A recurring problem's prompt: its entry up to the answer, which the model states after the cue.
RECALL_CUE = 'Answer:'
RECALL = ENTRY.split(RECALL_CUE)[0] + RECALL_CUE


def question_tokens(tokenizer: Tokenizer, problem: str) -> list[int]:
  """A problem asked as `QUESTION`, tokenized to follow a prefix (no BOS): the one form the
  base, library and text conditions share."""
  return tokenizer.encode(QUESTION.format(problem=problem), add_bos=False)


class LibraryError(ValueError):
  """An entry that must not enter the library; the message says why."""


@dataclasses.dataclass(frozen=True)
class Entry:
  """A verified worked solution: the problem, its solution, the answer, and who solved it."""

  id: str
  problem: str
  solution: str  # the worked solution, without its final "Answer:" line
  answer: str
  source: str  # who solved it: 'self' (this model), 'solutions' (handed over), ...

  def text(self) -> str:
    """The entry as the library's prefix holds it (`ENTRY`)."""
    return ENTRY.format(problem=self.problem, solution=self.solution, answer=self.answer)


def worked(solution: str) -> str:
  """A solution's text without its trailing "Answer: ..." (the entry states the answer)."""
  text = solution.rsplit('Answer:', 1)[0] if 'Answer:' in solution else solution
  return ' '.join(text.split()) or '-'


def _normal(problem: str) -> str:
  return ' '.join(problem.split()).lower()


class Library:
  """Entries, their BM25 index and their KV in a store."""

  def __init__(self, store: Store):
    self.store = store
    self.tokenizer = store.engine.loaded.tokenizer
    self.entries: dict[str, Entry] = {}
    self._by_problem: dict[str, Entry] = {}
    # (bm25s.BM25, ids in index order); rebuilt when entries change
    self._index: tuple[Any, list[str]] | None = None

  def add(self, entry: Entry, task: Task) -> dict:
    """Deposits an entry for `task` (a graft/knowledge/tasks.Task) after the library has run the
    task's verifier on the entry's own text (its worked solution and answer line): what a
    caller says about the entry is not taken on trust. Returns the store's put report. An entry
    for another problem, one whose answer fails, or a second entry for the same problem is
    refused, and nothing is deposited."""
    if _normal(entry.problem) != _normal(task.problem):
      raise LibraryError(f'{entry.id}: its problem is not task {task.id}\'s')
    verdict = verifiers.verify(task.answer, task.verifier, entry.text())
    if not verdict.correct:
      raise LibraryError(f'{entry.id}: the verifier refused its answer ({verdict.reason})')
    if entry.id in self.entries or _normal(entry.problem) in self._by_problem:
      raise LibraryError(f'{entry.id}: the library already holds this problem')
    report = self.store.put(self.prefix([entry]))
    self.entries[entry.id] = entry
    self._by_problem[_normal(entry.problem)] = entry
    self._index = None
    return report

  def find(self, problem: str) -> Entry | None:
    """The entry of `problem` (whitespace and case normalized), or None."""
    return self._by_problem.get(_normal(problem))

  def retrieve(self, problem: str, k: int) -> list[Entry]:
    """The k entries whose problems BM25 ranks closest to `problem`, closest first."""
    import bm25s  # heavy to import: only when retrieval is first asked for
    if not self.entries or k < 1:
      return []
    if self._index is None:
      ids = sorted(self.entries)
      retriever = bm25s.BM25()
      retriever.index(bm25s.tokenize([self.entries[i].problem for i in ids], stopwords=None,
                                     show_progress=False), show_progress=False)
      self._index = (retriever, ids)
    retriever, ids = self._index
    k = min(k, len(ids))
    found, scores = retriever.retrieve(bm25s.tokenize([problem], stopwords=None,
                                                      show_progress=False),
                                       k=k, show_progress=False)
    ranked = sorted(zip(found[0].tolist(), scores[0].tolist()), key=lambda p: (-p[1], ids[p[0]]))
    return [self.entries[ids[i]] for i, _ in ranked]

  def prefix(self, entries: list[Entry]) -> list[int]:
    """BOS and the entries' canonical texts, in order, tokenized as one text."""
    return [BOS_ID] + self.tokenizer.encode(''.join(e.text() for e in entries), add_bos=False)

  def context(self, entries: list[Entry]) -> tuple[Context, Match, list[int]]:
    """The longest stored prefix of the entries' prefix, grafted from the store, and the whole
    prefix's tokens: the caller computes the rest (an entry deposited alone is its own prefix,
    so the first entry is always a hit; a new combination of entries is computed, not
    deposited, and the match says how much was grafted)."""
    tokens = self.prefix(entries)
    ctx, match = self.store.graft(tokens)
    return ctx, match, tokens

  def recall(self, entry: Entry) -> tuple[Context, Match, list[int], str]:
    """A recurring problem's prompt: BOS and `entry`'s text through its answer cue, tokenized
    alone, with its longest stored prefix but the last token grafted (the caller computes the
    rest, so the answer's first logits come from the engine's own step: where the cue's
    tokens are the entry's own, that is one token). Returns the context, the match, the
    prompt's tokens and the cue."""
    tokens = [BOS_ID] + self.tokenizer.encode(
        RECALL.format(problem=entry.problem, solution=entry.solution), add_bos=False)
    ctx, match = self.store.graft(tokens[:-1])
    return ctx, match, tokens, RECALL_CUE
