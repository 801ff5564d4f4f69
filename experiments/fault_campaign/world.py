"""What every trial starts from (the engine, the deposited contexts, a golden store) and how a
trial's answer is judged."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
from sentencepiece import sentencepiece_model_pb2

from gemma_jax import compare, weights
from gemma_jax.tokenizer import Tokenizer
from graft import exactness
from graft.engine import Engine
from graft.store import Recompute, Store, StoreError, artifact, blocks, compose, signing
from graft.store.artifact import ArtifactError
from graft.store.kvstore import KvStore, StoreUrlError

BLOCK_KINDS = ('context', 'document')  # what a campaign's trials deposit, damage and answer


@dataclasses.dataclass(frozen=True)
class Composed:
  """A document trial's target: documents stored after a prefix (Store.put_document), composed
  in this order before the query with a recompute strategy (Store.compose). Its length is the
  tokens composed."""

  prefix: tuple[int, ...]
  documents: tuple[tuple[int, ...], ...]
  recompute: Recompute

  def __len__(self) -> int:
    return len(self.prefix) + sum(len(d) for d in self.documents)


def tokens_of(target) -> list[int]:
  """A target's tokens in order (a context's own; a composition's prefix and documents)."""
  if isinstance(target, Composed):
    return list(target.prefix) + [t for d in target.documents for t in d]
  return list(target)


def fresh_sha256(engine: Engine, target, query) -> str:
  """SHA-256 of the query logits computed without a store: a context from scratch; a
  composition of documents each computed by the engine after the prefix (placing them moves
  no bit under the relative mode, so a stored composition must give these bytes)."""
  if not isinstance(target, Composed):
    return exactness.fresh_sha256(engine, target, query)
  prefix_ctx, _ = engine.prefill(list(target.prefix), logits='none')
  rows = [compose.compute_rows(engine, prefix_ctx, d) for d in target.documents]
  ctx, _ = compose.compose(engine, prefix_ctx, target.documents, rows,
                           recompute=target.recompute)
  _, logits = engine.extend(ctx, list(query), logits='all', consume=True)
  return compare.sha256_bytes(logits)


def put(store: Store, target, *, recompute: bool = False) -> None:
  """Deposits a target: a context's blocks, or a composition's prefix and documents."""
  if isinstance(target, Composed):
    for document in target.documents:
      store.put_document(target.prefix, document, recompute=recompute)
  else:
    store.put(target, recompute=recompute)


def path_keys(namespace: str, block_tokens: int, target) -> list[str]:
  """The keys of the blocks a target's answer reads: a context's chain; a composition's
  prefix chain and each document's chain."""
  if not isinstance(target, Composed):
    return blocks.chain_keys(namespace, target, block_tokens)
  return blocks.chain_keys(namespace, target.prefix, block_tokens) + [
      k for d in target.documents
      for k in blocks.document_keys(namespace, target.prefix, d, block_tokens)]


def path_entries(store: Store, target) -> list[dict]:
  """The published entries on a target's path (`path_keys`), verified, in path order."""
  if not isinstance(target, Composed):
    return list(store.lookup(target).entries)
  by_key = {e['key']: e for e in store.entries()}
  return [by_key[k] for k in path_keys(store.namespace, store.block_tokens, target)
          if k in by_key]


def extended(target, rng, vocab: int):
  """A longer target that shares the given one's stored blocks: a context with more tokens; a
  composition with one more (new) document among its documents."""
  draw = lambda n: tuple(int(x) for x in rng.integers(3, vocab, n))
  if not isinstance(target, Composed):
    return list(target) + list(draw(int(rng.integers(8, 40))))
  documents = list(target.documents)
  documents.insert(int(rng.integers(len(documents) + 1)), draw(int(rng.integers(8, 40))))
  return dataclasses.replace(target, documents=tuple(documents))


@dataclasses.dataclass
class World:
  """The engine, the deposited contexts with their queries and fresh logits, and a golden
  store's bytes that each trial copies into its own store."""

  engine: Engine
  contexts: list[list[int]]
  queries: list[list[int]]
  fresh: list[str]  # SHA-256 of the fresh query logits, per context
  golden: dict[str, bytes]  # kvstore key -> value of a store holding every context
  model_args: list[str]
  # Signed campaigns: the honest writer's key, and what readers trust (None: every writer).
  signing_key: signing.SigningKey | None = None
  trusted: tuple | None = None

  def store(self, kv: KvStore, engine: Engine | None = None, *, writer: bool = False) -> Store:
    """A reader (or, `writer`, the honest writer) of a trial's store."""
    return Store(kv, engine or self.engine, trusted_keys=self.trusted,
                 signing_key=self.signing_key if writer else None)


def make_world(engine: Engine, rng: np.random.Generator, model_args: list[str],
               signed: bool = False, block_kind: str = 'context') -> World:
  """Targets, their queries and fresh answers, and a golden store holding them; `signed`:
  written by an honest writer whose key every reader trusts. block_kind 'context': contexts,
  some sharing a prefix that ends mid-block; 'document': documents stored after a prefix that
  ends mid-block (the engine runs RoPE 'relative'), composed in several orders and subsets
  with every recompute strategy."""
  if block_kind not in BLOCK_KINDS:
    raise ValueError(f'unknown block kind {block_kind!r}; expected one of {BLOCK_KINDS}')
  vocab = engine.model_config.vocab_size
  B = engine.engine_config.rows_per_call
  draw = lambda n: [int(t) for t in rng.integers(3, vocab, n)]
  contexts = []
  if block_kind == 'context':
    for _ in range(3):
      contexts.append([2] + draw(int(rng.integers(2 * B, 12 * B))))
    for base in list(contexts):  # contexts sharing a prefix that ends mid-block
      shared = int(rng.integers(B + 1, len(base)))
      shared += shared % B == 0
      contexts.append(base[:shared] + draw(int(rng.integers(3, 4 * B))))
  else:
    prefix = tuple([2] + draw(B + 1 + int(rng.integers(B - 1))))
    documents = [tuple(draw(int(rng.integers(1, 4 * B)))) for _ in range(5)]
    strategies = [Recompute(), Recompute('window', 0.25), Recompute('epic', 0.25),
                  Recompute('cacheblend', 0.25), Recompute('epic', 1.0), Recompute()]
    for recompute in strategies:
      chosen = rng.permutation(len(documents))[:int(rng.integers(2, len(documents) + 1))]
      contexts.append(Composed(prefix, tuple(documents[i] for i in chosen), recompute))
  queries = [draw(int(rng.integers(1, 6))) for _ in contexts]
  fresh = [fresh_sha256(engine, c, q) for c, q in zip(contexts, queries)]
  key = signing.SigningKey(signing.ed25519.Ed25519PrivateKey.generate()) if signed else None
  kv = KvStore('memory://')
  store = Store(kv, engine, signing_key=key)
  for context in contexts:
    put(store, context)
  golden = {k: kv.read(k) for k in kv.list('')}
  return World(engine, contexts, queries, fresh, golden, model_args, key,
               (key.public,) if signed else None)


def trial_store(world: World) -> KvStore:
  """A fresh memory:// store holding the golden store's bytes."""
  kv = KvStore('memory://')
  kv.write_many(list(world.golden.items()))
  return kv


def other_engines(loaded, engine: Engine) -> dict[str, Engine]:
  """What another reader could be: another model of the same shapes, another dtype, another
  engine configuration, another tokenizer."""
  config = engine.engine_config
  proto = sentencepiece_model_pb2.ModelProto.FromString(loaded.tokenizer.model_proto)
  proto.pieces[-1].score -= 1.0  # one piece scored otherwise: another tokenizer
  seed = int(loaded.weights.split(':')[1]) + 1 if loaded.weights.startswith('random:') else 1
  twin = weights.load(loaded.config, f'random:{seed}', loaded.dtype)
  return {
      'model': Engine(twin, config),
      'dtype': Engine(weights.load(loaded.config, loaded.weights,
                                   'bfloat16' if loaded.dtype == 'float32' else 'float32'),
                      # the spec is float32
                      dataclasses.replace(config, mode='pinned', dot_library=None)),
      'engine': Engine(loaded, dataclasses.replace(config, rows_per_call=2 * config.rows_per_call)),
      'tokenizer': Engine(loaded.replace(
          tokenizer=Tokenizer.from_model_proto(proto.SerializeToString())), config),
  }


# ----------------------------------------------------------------------------------------------
# Answering and classifying


@dataclasses.dataclass
class Outcome:
  # 'untouched' (the fault missed what the reader used), 'exact' (no fault on stored data),
  # 'refused' (found, named, answered around), 'silent_wrong', or 'crashed' (a traceback)
  outcome: str
  reasons: list[str]
  lost: bool
  grafted: int
  fault: str


def answer(engine: Engine, open_store, context, query) -> tuple[str, list[str], int]:
  """(SHA-256 of the query logits, reasons anything was refused for, tokens grafted): a reader
  that has cached nothing grafts what the store gives (a context's longest stored prefix, or a
  composition's stored prefix and documents) and computes the rest; a store it cannot open
  gives nothing, and the engine computes everything."""
  reasons = []
  try:
    store = open_store()
    if isinstance(context, Composed):
      composed = store.compose(context.prefix, context.documents, query,
                               recompute=context.recompute)
      reasons += [p.reason for p in store.problems]
      record = composed.record
      return compare.sha256_bytes(composed.logits), reasons, record['prefix_grafted'] + sum(
          d['tokens'] for d in record['documents'] if d['source'] == 'store')
    ctx, match = store.graft(context)
    reasons += [p.reason for p in store.problems]
    grafted = match.tokens
  except (StoreError, StoreUrlError) as e:
    reasons.append(str(e))
    if isinstance(context, Composed):
      return fresh_sha256(engine, context, query), reasons, 0
    ctx, grafted = engine.empty(), 0
  logits, _ = exactness.graft_logits(engine, ctx, context, query)
  return compare.sha256_bytes(logits), reasons, grafted


def artifact_answer(engine: Engine, path: str, context, query) -> tuple[str, list[str], int]:
  """As `answer`, from the artifact at `path` (an artifact refused: the engine computes
  everything)."""
  try:
    ctx = artifact.graft(engine, artifact.load(path, engine))
    reasons, grafted = [], len(ctx.tokens)
  except ArtifactError as e:
    ctx, reasons, grafted = engine.empty(), [str(e)], 0
  logits, _ = exactness.graft_logits(engine, ctx, context, query)
  return compare.sha256_bytes(logits), reasons, grafted


def classify(sha: str, want: str, reasons: list[str], grafted: int) -> str:
  """The outcome of an answer whose logits hash to `sha` where fresh gives `want`."""
  if sha != want:
    return 'silent_wrong'
  if reasons:
    return 'refused'
  return 'untouched' if grafted else 'silent_wrong'  # nothing refused: a graft was used


def untouched_intact(kv: KvStore, golden: dict[str, bytes], touched: set[str]) -> bool:
  """Every committed block the fault did not touch is still published with its content, and
  every other committed key (the description, signatures) still holds its bytes. A block counts
  by content: its entry may now name another object of the same header (a writer that replaced
  it with an identical recomputation), not a missing or different one."""
  keys = [k for k in golden if k not in touched and not k.startswith(('quarantine/', 'objects/'))]
  now = dict(zip(keys, kv.read_many([(k, None) for k in keys])))
  for key in keys:
    if not key.startswith('index/'):
      if now[key] != golden[key]:
        return False
      continue
    try:
      was, is_ = json.loads(golden[key]), json.loads(now[key] or b'null')
    except ValueError:
      return False
    if not isinstance(is_, dict) or is_.get('header_sha256') != was.get('header_sha256'):
      return False
    if is_['object'] != was['object'] and kv.read(f'objects/{is_["object"]}') is None:
      return False
    if is_['object'] == was['object'] and f'objects/{was["object"]}' not in touched and (
        kv.read(f'objects/{was["object"]}') != golden.get(f'objects/{was["object"]}')):
      return False
  return True


def finish(world: World, kv: KvStore, touched: set, outcome: Outcome,
           golden: dict | None = None) -> Outcome:
  """gc after the trial: what it removes of what the fault did not touch is lost too."""
  golden = world.golden if golden is None else golden
  try:
    world.store(kv).gc()
  except StoreError:
    pass  # a store that cannot be opened is not collected
  outcome.lost = outcome.lost or not untouched_intact(kv, golden, touched)
  return outcome


def reason_class(reason: str) -> str:
  """A reason without the paths, hex digests, numbers and quoted values that make every message
  unique, so that reasons can be counted."""
  reason = re.sub(r'(?:(?<=\s)|^)(?:file://)?/[\w.\-/]+', '<path>', reason)
  reason = re.sub(r'[0-9a-f]{16,}(?:\.\.)?', '<key>', reason)
  reason = re.sub(r'(?<![\w-])\d+(?!\w)', 'N', reason)
  reason = re.sub(r"(?<![A-Za-z])'[^']*'", "'...'", reason)
  return reason[:120]
