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
from graft.store import Store, StoreError, artifact, signing
from graft.store.artifact import ArtifactError
from graft.store.kvstore import KvStore, StoreUrlError


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
               signed: bool = False) -> World:
  """Contexts (some sharing a prefix that ends mid-block), their queries and fresh answers, and
  a golden store holding them; `signed`: written by an honest writer whose key every reader
  trusts."""
  vocab = engine.model_config.vocab_size
  B = engine.engine_config.rows_per_call
  draw = lambda n: [int(t) for t in rng.integers(3, vocab, n)]
  contexts = []
  for _ in range(3):
    contexts.append([2] + draw(int(rng.integers(2 * B, 12 * B))))
  for base in list(contexts):  # contexts sharing a prefix that ends mid-block
    shared = int(rng.integers(B + 1, len(base)))
    shared += shared % B == 0
    contexts.append(base[:shared] + draw(int(rng.integers(3, 4 * B))))
  queries = [draw(int(rng.integers(1, 6))) for _ in contexts]
  fresh = [exactness.fresh_sha256(engine, c, q) for c, q in zip(contexts, queries)]
  key = signing.SigningKey(signing.ed25519.Ed25519PrivateKey.generate()) if signed else None
  kv = KvStore('memory://')
  store = Store(kv, engine, signing_key=key)
  for context in contexts:
    store.put(context)
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
                      dataclasses.replace(config, mode='pinned', dot_library=None)),  # the spec is float32
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
  that has cached nothing grafts what the store gives and computes the rest; a store it cannot
  open gives nothing, and the engine computes everything."""
  reasons = []
  try:
    store = open_store()
    ctx, match = store.graft(context)
    reasons += [p.reason for p in store.problems]
    grafted = match.tokens
  except (StoreError, StoreUrlError) as e:
    reasons.append(str(e))
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
