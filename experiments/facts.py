"""A retrieval task for experiments.compose: facts spread over documents, a question whose
answer is in one of them.

Each document is a record book: lines "<First> <Last> lives in <City>." until it reaches its
length in tokens. Every person appears once in a context (its documents together); a question
asks where one of them lives and ends as the fact's own line begins,

    Question: Where does Maria Lopez live?
    Answer: Maria Lopez lives in

so the answer is the next token: a city, each of them one token of the Gemma tokenizer
(`CITIES`, checked when a task is made). A question is answered right when the city's logit is
the largest among every city's (the candidates' log-probabilities compared: one logits row per
question, no decoding); `top1` also says whether it is the largest of the whole vocabulary.

A tokenizer that splits the cities (the tiny models' synthetic one) gets the same task in ids
(`make_id_context`): a fact is two key ids, a separator and a value id; a question is the keys
and the separator, its answer the value.

Seeded: the same seed, lengths and counts give the same tokens on any machine (NumPy's
Generator draws integers exactly).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from experiments import samples

PREFIX_TEXT = ('The record books below say where people live. Answer the question from '
               'them.\n\n')
FIRST = ('Maria Anna Lena Sofia Clara Julia Nora Emma Alice Rosa Ines Marta Paula Elena Laura '
         'Vera Irene Lucia Diana Helen Grace Olivia Ruth Sara Mila John Peter Paul Mark Luke '
         'David Daniel Thomas James Robert Victor Oscar Hugo Felix Adam Leo Ivan Noah Simon '
         'Tom Max Karl Omar Ali Yuri Igor Pedro Pablo Diego Marco Luca Jonas Erik Hans').split()
LAST = ('Lopez Smith Brown Meyer Novak Rossi Silva Costa Garcia Martin Weber Fischer Wagner '
        'Becker Schulz Dubois Moreau Laurent Petit Leroy Santos Pereira Ferreira Almeida '
        'Romano Greco Conti Russo Ricci Marino Kowalski Nowak Horvat Popescu Ionescu Jensen '
        'Hansen Larsen Olsen Nielsen Berg Lund Holm Strand Dahl Walsh Byrne Ryan Kelly '
        'Murphy Evans Hughes Lewis Morgan Price Turner Parker Collins Edwards Stewart').split()
CITIES = ('Lisbon Paris London Berlin Madrid Rome Vienna Prague Warsaw Dublin Oslo Stockholm '
          'Helsinki Athens Cairo Tokyo Seoul Beijing Delhi Mumbai Sydney Toronto Chicago Boston '
          'Denver Miami Dallas Seattle Houston Lima Havana Nairobi Lagos Istanbul Moscow '
          'Budapest Munich Milan Naples Venice Geneva Zurich Brussels Amsterdam Hamburg '
          'Barcelona Manila Jakarta Bangkok Dubai').split()


@dataclasses.dataclass(frozen=True)
class Question:
  """A question about one fact: its token ids, the answer's token id, and the document
  (index in its context's order) that holds the fact."""

  tokens: tuple[int, ...]
  answer: int
  document: int
  text: str


@dataclasses.dataclass(frozen=True)
class Context:
  """A prefix, documents (token ids each), the questions asked about them and the answers a
  question is scored among (None: every city's token, `candidates`)."""

  prefix: tuple[int, ...]
  documents: tuple[tuple[int, ...], ...]
  questions: tuple[Question, ...]
  candidates: tuple[int, ...] | None = None


def filler_lines(tokenizer) -> list[list[int]]:
  """The lines of real text documents are filled with (the Python documentation's topics,
  experiments/samples.py), each as token ids ending with a newline."""
  lines = [line.strip() for line in samples.corpus_text().split('\n')]
  return [tokenizer.encode(line + '\n', add_bos=False) for line in lines
          if 20 <= len(line) <= 200]


def make_needle_context(tokenizer, lengths, facts_per_document: int, questions: int,
                        rng: np.random.Generator, filler: list[list[int]]) -> Context:
  """Documents of real text (consecutive `filler` lines from a random place) with
  `facts_per_document` fact lines each inserted between its lines, every person and city
  distinct within the context; questions on distinct facts, round robin over the documents,
  scored among the context's cities."""
  cities = city_tokens(tokenizer)
  if facts_per_document * len(lengths) > len(CITIES):
    raise ValueError(f'{facts_per_document * len(lengths)} facts need as many cities; there are '
                     f'{len(CITIES)}')
  people = rng.permutation(len(FIRST) * len(LAST))
  places = [CITIES[int(i)] for i in rng.permutation(len(CITIES))]
  documents, facts = [], []
  for d, length in enumerate(lengths):
    lines = []
    for f in range(facts_per_document):
      person = int(people[d * facts_per_document + f])
      name = f'{FIRST[person // len(LAST)]} {LAST[person % len(LAST)]}'
      lines.append((name, places[d * facts_per_document + f]))
    fact_tokens = [tokenizer.encode(f'{name} lives in {city}.\n', add_bos=False)
                   for name, city in lines]
    budget = length - sum(len(t) for t in fact_tokens)
    body, at = [], int(rng.integers(len(filler)))
    while sum(len(t) for t in body) + len(filler[at % len(filler)]) <= budget:
      body.append(filler[at % len(filler)])
      at += 1
    for tokens in fact_tokens:  # each fact between two lines of text
      body.insert(int(rng.integers(len(body) + 1)), tokens)
    documents.append(tuple(t for line in body for t in line))
    facts.append(lines)
  asked, order = [], [(d, f) for f in range(facts_per_document) for d in range(len(lengths))]
  for q in range(questions):
    d, f = order[q % len(order)]
    name, city = facts[d][f]
    text = f'\nQuestion: Where does {name} live?\nAnswer: {name} lives in'
    asked.append(Question(tuple(tokenizer.encode(text, add_bos=False)), cities[city], d, text))
  prefix = tuple(tokenizer.encode(PREFIX_TEXT))
  used = tuple(sorted(cities[c] for lines in facts for _, c in lines))
  return Context(prefix, tuple(documents), tuple(asked), used)


def splits_a_city(tokenizer) -> str | None:
  """A city the tokenizer does not keep as one token (None: it keeps every one)."""
  try:
    city_tokens(tokenizer)
  except ValueError as e:
    return str(e)
  return None


def city_tokens(tokenizer) -> dict[str, int]:
  """Each city's one token id (ValueError naming a city the tokenizer splits)."""
  out = {}
  for city in CITIES:
    ids = tokenizer.encode(' ' + city, add_bos=False)
    if len(ids) != 1:
      raise ValueError(f'the city {city!r} is {len(ids)} tokens for this tokenizer, not one')
    out[city] = ids[0]
  return out


def make_context(tokenizer, lengths, questions: int, rng: np.random.Generator) -> Context:
  """A context of documents of at most `lengths[i]` tokens each (whole fact lines; a line is
  ~10 tokens), and `questions` questions spread evenly over the documents; in ids where the
  tokenizer splits a city (`make_id_context`)."""
  try:
    cities = city_tokens(tokenizer)
  except ValueError:
    return make_id_context(tokenizer.vocab_size, lengths, questions, rng)
  people = rng.permutation(len(FIRST) * len(LAST))
  used = 0
  documents, facts = [], []
  for d, length in enumerate(lengths):
    head = tokenizer.encode(f'Record book {d + 1}:\n', add_bos=False)
    tokens, lines = list(head), []
    while True:
      person = int(people[used])
      name = f'{FIRST[person // len(LAST)]} {LAST[person % len(LAST)]}'
      city = CITIES[int(rng.integers(len(CITIES)))]
      line = tokenizer.encode(f'{name} lives in {city}.\n', add_bos=False)
      if len(tokens) + len(line) > length:
        break
      used += 1
      tokens += line
      lines.append((name, city))
    if not lines:
      raise ValueError(f'a document of {length} tokens holds no fact line')
    documents.append(tuple(tokens))
    facts.append(lines)
  asked = []
  for q in range(questions):
    d = q % len(documents)
    name, city = facts[d][int(rng.integers(len(facts[d])))]
    text = f'\nQuestion: Where does {name} live?\nAnswer: {name} lives in'
    asked.append(Question(tuple(tokenizer.encode(text, add_bos=False)), cities[city], d, text))
  prefix = tuple(tokenizer.encode(PREFIX_TEXT))
  return Context(prefix, tuple(documents), tuple(asked))


SEPARATOR, VALUES = 3, 32  # the id task: its separator id, and the values are ids 4 .. 4 + 31


def candidates(tokenizer) -> np.ndarray:
  """The answers a question is scored among: every city's token, or the id task's values."""
  try:
    return np.array(sorted(city_tokens(tokenizer).values()))
  except ValueError:
    return np.arange(SEPARATOR + 1, SEPARATOR + 1 + VALUES)


def make_id_context(vocab: int, lengths, questions: int, rng: np.random.Generator) -> Context:
  """The task in ids: facts [k1, k2, SEPARATOR, value] with distinct key pairs drawn above the
  values, documents of whole facts, questions [k1, k2, SEPARATOR] -> value."""
  low = SEPARATOR + 1 + VALUES
  documents, facts, seen = [], [], set()
  for length in lengths:
    tokens, lines = [], []
    while len(tokens) + 4 <= length:
      keys = tuple(int(k) for k in rng.integers(low, vocab, 2))
      if keys in seen:
        continue
      seen.add(keys)
      value = int(rng.integers(SEPARATOR + 1, low))
      tokens += [*keys, SEPARATOR, value]
      lines.append((keys, value))
    if not lines:
      raise ValueError(f'a document of {length} tokens holds no fact')
    documents.append(tuple(tokens))
    facts.append(lines)
  asked = []
  for q in range(questions):
    d = q % len(documents)
    keys, value = facts[d][int(rng.integers(len(facts[d])))]
    asked.append(Question((*keys, SEPARATOR), value, d, f'{keys} ->'))
  return Context((2, int(rng.integers(low, vocab))), tuple(documents), tuple(asked))


def score(logits: np.ndarray, answer: int, candidates: np.ndarray) -> dict:
  """Whether the answer's logit is the largest among the candidates' (`correct`) and of the
  whole vocabulary (`top1`), from the question's last logits row [V]."""
  best = int(candidates[np.argmax(logits[candidates])])
  return {'correct': best == answer, 'top1': int(np.argmax(logits)) == answer,
          'chosen': best}


def wilson(correct: int, total: int, z: float = 1.959964) -> tuple[float, float]:
  """The 95% Wilson score interval of a proportion."""
  if not total:
    return (0.0, 1.0)
  p = correct / total
  centre = (p + z * z / (2 * total)) / (1 + z * z / total)
  half = z * np.sqrt(p * (1 - p) / total + z * z / (4 * total * total)) / (1 + z * z / total)
  return (float(centre - half), float(centre + half))
