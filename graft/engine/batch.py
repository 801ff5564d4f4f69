"""N contexts decoded together, kept stacked between steps: `Engine.batch`.

    batch = engine.batch(ctxs)               # the slots' KV states stacked once
    drawn = batch.decode([32] * len(ctxs))   # [(tokens, logits digest)], a step per token
    more = batch.decode([32] * len(ctxs))    # the next 32 of each, on the same stacked state
    ctx = batch.context(3)                   # slot 3 leaves: its state split out

A decode step of N slots is one call on the stacked state [N, S, K, H] per array, which the
call updates in place (it is donated). Stacking the slots' states and splitting them back each
copy every slot's whole state (at the 270M's 2,560 slots, 94 MB a slot): a caller that decodes
slots together keeps them stacked here, and pays a slot's split only when it leaves. Every slot
gets exactly the bits it gets alone (Engine.extend_batch's slot invariance; tests/test_batch.py).
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import TYPE_CHECKING, Callable, Sequence

import jax
import numpy as np

from gemma_jax import sampling
from graft.engine.context import Context, sample

if TYPE_CHECKING:  # _engine.py imports this module: a name only
  from graft.engine._engine import Engine


@dataclasses.dataclass(frozen=True)
class Slot:
  """A batch slot: its context's tokens, where its next token goes and its last logits (float32
  [V]); its KV state is its row of the batch's stacked state (a graft.engine.context.Place)."""

  tokens: tuple[int, ...]
  next_position: int
  last_logits: np.ndarray


class Batch:
  """Contexts of one engine on one stacked KV state, a batch slot each."""

  def __init__(self, engine: Engine, ctxs: Sequence[Context]):
    """engine: an Engine whose plan has batch slots; ctxs: the slots' contexts, each with its
    last logits (they stay valid: the stacked state is a copy)."""
    if not ctxs:
      raise ValueError('a batch needs at least one context')
    engine._check_batch(ctxs, [[] for _ in ctxs], None)
    self._engine = engine
    self._kv = engine._stack(ctxs)
    # Each slot's context without its state (the stacked state holds it), and its last logits.
    self._slots = [Slot(tokens=c.tokens, next_position=c.next_position,
                        last_logits=_last_logits(c)) for c in ctxs]
    self._pending: list[int | None] = [None] * len(ctxs)  # drawn, not yet in the state

  def __len__(self) -> int:
    return len(self._slots)

  def decode(self, max_new_tokens: Sequence[int], *,
             temperatures: Sequence[float] | None = None, seeds: Sequence[int] | None = None,
             stop: Callable[[list[int]], bool] | None = None,
             digests: bool = True,
             sampler: str = sampling.SAMPLER) -> list[tuple[list[int], str | None]]:
    """`Engine.decode` of every slot at once, going on where the batch's last decode stopped:
    slot i's next tokens, up to max_new_tokens[i] or until `stop` (of this call's tokens)
    holds, and the SHA-256 of the float32 logits each was drawn from (None without
    `digests`). A slot that has finished idles until all have. The last token a slot drew is
    not in its state until the next decode steps it in first; so each slot's `context` holds
    every token drawn but the last, as decode leaves it, and decoding a batch in pieces gives
    the tokens of one decode (the pieces' digests each of their own logits)."""
    n = len(self._slots)
    temperatures = list(temperatures) if temperatures is not None else [0.0] * n
    seeds = list(seeds) if seeds is not None else [0] * n
    if not len(max_new_tokens) == len(temperatures) == len(seeds) == n:
      raise ValueError(f'{n} slots need {n} token limits, temperatures and seeds')
    draws = [sampling.Draws(s, sampler) for s in seeds]
    hashes = [hashlib.sha256() if digests else None for _ in range(n)]
    new: list[list[int]] = [[] for _ in range(n)]
    done = [m < 1 for m in max_new_tokens]
    # The tokens the last decode drew last, stepped in first by the slots that go on.
    step = [[] if d or p is None else [p] for d, p in zip(done, self._pending)]
    while True:
      if any(step):
        self._step(step)
      for i in range(n):
        if not done[i]:
          logits = self._slots[i].last_logits
          digest = hashes[i]
          if digest is not None:
            digest.update(np.ascontiguousarray(logits, np.float32).tobytes())
          new[i].append(sample(logits, temperatures[i], draws[i]))
          done[i] = len(new[i]) >= max_new_tokens[i] or (stop is not None and stop(new[i]))
      if all(done):
        break
      step = [[] if d else t[-1:] for d, t in zip(done, new)]
    self._pending = [t[-1] if t else p for t, p in zip(new, self._pending)]
    return [(t, h.hexdigest() if h is not None else None) for t, h in zip(new, hashes)]

  def _step(self, step: list[list[int]]) -> None:
    """One call on the stacked state: slot i takes step[i] (one token, or none: idle)."""
    engine = self._engine
    step = [engine._check_tokens(c, t) if t else [] for c, t in zip(self._slots, step)]
    self._kv, rows = engine._extend_stacked(self._kv, self._slots, step, [len(t) for t in step])
    engine._check_weights()
    self._slots = [Slot(tokens=c.tokens + tuple(t), next_position=c.next_position + len(t),
                        last_logits=r[-1] if r else c.last_logits)
                   for c, t, r in zip(self._slots, step, rows)]

  def context(self, i: int) -> Context:
    """Slot i's context, its state split out of the stacked one (a copy: the batch goes on)."""
    c = self._slots[i]
    return Context(kv=jax.tree.map(lambda x: x[i:i + 1], self._kv), tokens=c.tokens,
                   next_position=c.next_position, last_logits=c.last_logits)

  def contexts(self) -> list[Context]:
    """Every slot's context, the stacked state split once (one split per array)."""
    return [Context(kv=kv, tokens=c.tokens, next_position=c.next_position,
                    last_logits=c.last_logits)
            for c, kv in zip(self._slots, self._engine._unstack(self._kv, len(self._slots)))]


def _last_logits(ctx: Context) -> np.ndarray:
  if ctx.last_logits is None:
    raise ValueError('every context needs logits at its last token')
  return ctx.last_logits
