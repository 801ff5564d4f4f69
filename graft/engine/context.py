"""The values an engine's calls take and give: a `Context` (a KV state and its tokens), what a
decode gives (`Decoded`), the rows of one call (`call_inputs`) and the draw of a token from
logits (`sample`)."""

from __future__ import annotations

import dataclasses
from typing import Protocol, Sequence

import numpy as np

from gemma_jax import kv_state as kvs
from gemma_jax import sampling


@dataclasses.dataclass(frozen=True)
class Context:
  """A context: its KV state, the tokens in it, and where the next token goes."""

  kv: kvs.KVState
  tokens: tuple[int, ...]
  next_position: int
  last_logits: np.ndarray | None = None  # float32 [V] at the last token, when computed


class Place(Protocol):
  """Where a context's tokens end, all a call needs of it besides its KV state: a `Context`,
  or a batch slot (graft.engine.batch.Slot) whose state lives in a stacked one."""

  @property
  def tokens(self) -> tuple[int, ...]:
    """The tokens in it."""
    ...

  @property
  def next_position(self) -> int:
    """Where its next token goes."""
    ...


@dataclasses.dataclass(frozen=True)
class Decoded:
  """What `Engine.decode` produced: the tokens, the SHA-256 of the logits each was drawn from
  (concatenated float32 rows), and the context after all but the last token."""

  context: Context
  tokens: list[int]
  logits_sha256: str


def call_inputs(chunks: Sequence[Sequence[int]], first_positions: Sequence[int], rows: int,
                lead: int = 0) -> tuple[np.ndarray, np.ndarray]:
  """Token ids and positions [N, rows] of one call: slot i holds `lead` padding rows, then
  chunks[i] at positions first_positions[i], ..., then padding (position EMPTY: masked
  everywhere, writing nothing).

  Args:
    chunks: N token lists, one per batch slot, each at most rows - lead long.
    first_positions: the position of each chunk's first token.
    rows: T, the call's rows per slot.
    lead: padding rows before each chunk.
  Returns:
    (ids, positions): int32 [N, T] each.
  """
  ids = np.zeros((len(chunks), rows), np.int32)
  positions = np.full((len(chunks), rows), kvs.EMPTY, np.int32)
  for i, (chunk, first) in enumerate(zip(chunks, first_positions)):
    ids[i, lead:lead + len(chunk)] = chunk
    positions[i, lead:lead + len(chunk)] = first + np.arange(len(chunk))
  return ids, positions


def sample(logits: np.ndarray, temperature: float, draws: sampling.Draws) -> int:
  """One token drawn from logits: the next draw of a decode's `draws` (gemma_jax.sampling:
  the argmax at temperature 0 or less, else the spec's softmax in integer weights and an
  integer uniform, the same choice on every machine).

  Args:
    logits: float32 [V].
    temperature: the decode's temperature.
    draws: the decode's (or batch slot's) draws: its seed, the count so far, its sampler.

  Returns:
    The token id.
  """
  return draws.next(logits, temperature)
