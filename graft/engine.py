"""The inference engine: pinned (byte-exact by construction) or default (the plain fast path).

Why pinning is needed. XLA picks kernels by shape. Measured on this project's CPU machines (jax
0.10.2, XLA:CPU, float32 and bfloat16): row 0 of `x[:M] @ W` has different bits for M = 1,
M in 2..32 and M >= 64. At a fixed M, a row of the Gemma 3 matmuls has the same bits whatever
its row index and the other rows, but not every shape keeps that: in tiny_gemma4 (the per-layer
input path, a [T, 64] @ [64, 8] matmul) a token's bits change with its row index. An attention
row over a fixed-size buffer has the same bits whatever its neighbours or the (masked) contents
of slots past its position. So "restore a prefix, then prefill the rest" differs from a one-shot
prefill unless every call has the same shape and every token the same row.

The pinned design. Every transformer call processes exactly `block_size` token rows (B), and
blocks are aligned to the sequence: the token with sequence index j sits in row j mod B of its
call, whatever the calls before it. A block holds padding rows (position EMPTY: masked
everywhere, writing nothing) before the first token of a call that continues a context
mid-block, and after its last token. Every logits call processes exactly `logits_rows` rows
(1: a GEMV per row, which is also the cheapest way to get the one row a decode step needs).
Attention writes the block's K/V into the cache first, then reduces over the whole fixed-size
buffer in slot order, where a token's slot is its sequence index (mod the buffer size on local
layers, which use a ring of W + B - 1 slots). With these rules a token's KV and logits are a
pure function of the tokens up to it: prefill, graft continuation and decode all go through the
same two compiled functions, and an own-position graft is byte-exact for any split point and any
chunking, before and far past the sliding window (tests/test_graft_exact.py, results/).

The block size is a trade. A decode step is a whole block (one real row, B - 1 padding rows),
so its matmuls cost B rows; a prefill gets XLA:CPU's better efficiency at larger M. Measured on
the 270M in float32 (2 cores, tokens/s, pinned / default): B = 8: prefill 0.66x, decode 0.90x;
B = 16: prefill ~1.0x, decode 0.65-0.77x; B = 32: prefill 1.3x, decode 0.5x. B = 16 is the
default (results/bench_graft_*.json has the current numbers).

Everything that decides bits is in EngineConfig and the engine fingerprint (graft/fingerprint.py):
block size, logits rows, cache length (attention reduces over the whole buffer), attention
implementation and its kernel blocks, matmul precision, XLA flags, dtype, the layout version
(LAYOUT_VERSION: how tokens map to rows and slots), jax/jaxlib versions, backend, device kind and
CPU vector extensions. The thread count is not: tests/test_threads.py
shows the bits are the same on one core, two cores, and with Eigen single-threaded.

The default engine is the plain fast path: one call per extend, padded only to the next power of
two (so XLA sees whatever M the request has), logits for the requested rows in one call, local
layers over the full cache. It is here to show what pinning buys.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import attention as attention_lib
from gemma_jax import kv_state as kvs
from gemma_jax import model
from gemma_jax import rope
from gemma_jax.config import EOS_ID
from gemma_jax.weights import LoadedModel
from graft import fingerprint

MODES = ('pinned', 'default')

# The version of everything outside the config that decides a pinned engine's bits: how tokens
# are laid out in calls and slots (2: blocks aligned to the sequence, token j in row j mod B).
# Artifacts and store objects record it; a change here must bump it, so that KV computed under
# the old layout is refused instead of grafted.
LAYOUT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Everything about an engine that can change the bits of its results. `mode` 'pinned' is
  the pinned configuration (byte-exact grafts); 'default' is the plain fast path."""

  mode: str = 'pinned'
  block_size: int = 16  # B: token rows per transformer call (pinned); see the module docstring
  logits_rows: int = 1  # rows per logits call (pinned)
  cache_len: int = 4096  # KV slots on global layers: the most tokens a context holds
  attention: str = 'xla'  # a name in gemma_jax.attention.IMPLEMENTATIONS
  attention_tile: int | None = None  # KV tile of the Pallas kernel (None: the backend's)
  matmul_precision: str = 'highest'  # jax.default_matmul_precision inside every call
  xla_flags: str = ''  # must equal $XLA_FLAGS when the engine is built

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f'unknown engine mode {self.mode!r}; expected one of {MODES}')
    if self.attention not in attention_lib.IMPLEMENTATIONS:
      raise ValueError(f'unknown attention {self.attention!r}; expected one of '
                       f'{tuple(attention_lib.IMPLEMENTATIONS)}')
    if self.block_size < 1 or self.logits_rows < 1 or self.cache_len < self.block_size:
      raise ValueError(f'invalid engine config {self}: need 1 <= block_size <= cache_len and '
                       'logits_rows >= 1')

  @classmethod
  def from_dict(cls, values: dict) -> 'EngineConfig':
    """From its JSON form; also reads the form older manifests recorded (`engine` for mode)."""
    values = dict(values)
    if 'engine' in values and 'mode' not in values:
      values['mode'] = values.pop('engine')
    return cls(**values)


@dataclasses.dataclass(frozen=True)
class Context:
  """A context: its KV state, the tokens in it, and where the next token goes."""

  kv: kvs.KVState
  tokens: tuple[int, ...]
  next_position: int
  last_logits: np.ndarray | None = None  # float32 [V] at the last token, when computed


@dataclasses.dataclass(frozen=True)
class Decoded:
  """What `Engine.decode` produced: the tokens, the SHA-256 of the logits each was drawn from
  (concatenated float32 rows), and the context after all but the last token."""

  context: Context
  tokens: list[int]
  logits_sha256: str


def _next_power_of_two(n: int) -> int:
  return 1 << max(0, n - 1).bit_length()


class Engine:
  """Runs a loaded model under an EngineConfig. Contexts are immutable values; every method
  returns a new one, so a context can be branched freely."""

  def __init__(self, loaded: LoadedModel, config: EngineConfig = EngineConfig(), *,
               kernel_platform: str | None = None):
    """kernel_platform: the platform the attention kernel is built for ('cpu', 'gpu', 'tpu';
    None: the default backend's). Naming one this host does not have gives an engine whose
    functions lower for that platform (graft/lowering.py) but do not run."""
    if os.environ.get('XLA_FLAGS', '') != config.xla_flags:
      raise ValueError(f'the engine config needs XLA_FLAGS={config.xla_flags!r} but the process '
                       f'has {os.environ.get("XLA_FLAGS", "")!r}; set it before starting Python')
    rope.check_attention(loaded.config.rope_mode, config.attention)
    self.loaded = loaded
    self.config = loaded.config
    self.engine_config = config
    self._pinned_shapes = config.mode == 'pinned'
    self._attention_fn = attention_lib.build(config.attention, config.attention_tile,
                                             kernel_platform)
    head_dims = tuple(sorted({self.config.layer_spec(i).head_dim
                              for i in range(self.config.num_layers)}))
    self._kernel_blocks = self._attention_fn.blocks(head_dims, self.dtype)
    if self._pinned_shapes:
      # Local layers: a ring just big enough for one block (rounded up to whole kernel tiles,
      # so the kernel never pads the cache).
      multiple = self._attention_fn.slot_multiple(head_dims, self.dtype)
      self._local_slots = -(-kvs.local_slots_needed(self.config, config.block_size)
                            // multiple) * multiple
    else:
      self._local_slots = None  # one-shot calls of any length need the full cache

    def step(params, tokens, positions, kv):
      with jax.default_matmul_precision(config.matmul_precision):
        return model.forward(params, self.config, tokens, positions, kv, self._attention_fn)

    def head(params, hidden, rows):
      # hidden [1, T, D], rows [R] -> logits [1, R, V] of those rows (gathered inside the jit).
      with jax.default_matmul_precision(config.matmul_precision):
        return model.compute_logits(params, self.config, jnp.take(hidden, rows, axis=1))

    # The KV state is donated: XLA updates the cache in place. Callers' contexts stay valid
    # because a context that may be used again is copied first (see extend's `consume`).
    self._step = jax.jit(step, donate_argnums=(3,))
    self._head = jax.jit(head)

  @functools.cached_property
  def model_fingerprint(self) -> dict:
    return fingerprint.model_fingerprint(self.loaded)

  @functools.cached_property
  def fingerprint(self) -> dict:
    return fingerprint.engine_fingerprint(self.engine_config, self.loaded.dtype,
                                          layout_version=LAYOUT_VERSION,
                                          kernel_blocks=self._kernel_blocks)

  @property
  def dtype(self):
    return jax.tree.leaves(self.loaded.params)[0].dtype

  def empty(self, start_position: int = 0) -> Context:
    """An empty context whose first token will sit at `start_position`."""
    kv = kvs.init_kv_state(self.config, batch_size=1, cache_len=self.engine_config.cache_len,
                           dtype=self.dtype, local_cache_len=self._local_slots)
    return Context(kv=kv, tokens=(), next_position=start_position)

  def _check_tokens(self, ctx: Context, tokens: Sequence[int]) -> list[int]:
    tokens = [int(t) for t in tokens]
    if not tokens:
      raise ValueError('nothing to process: the token list is empty')
    vocab = self.config.vocab_size
    for i, t in enumerate(tokens):
      if not 0 <= t < vocab:
        raise ValueError(f'token id {t} at index {i} is outside the vocabulary [0, {vocab})')
    if len(ctx.tokens) + len(tokens) > self.engine_config.cache_len:
      raise ValueError(
          f'a context of {len(ctx.tokens)} + {len(tokens)} tokens does not fit the cache of '
          f'{self.engine_config.cache_len} slots; raise cache_len')
    if ctx.next_position + len(tokens) > self.config.max_context:
      raise ValueError(f'positions up to {ctx.next_position + len(tokens) - 1} exceed '
                       f'{self.config.name}\'s context of {self.config.max_context}')
    return tokens

  def _rows_per_call(self, num_tokens: int) -> int:
    """Pinned: the block size. Default: the next power of two, but no more rows than the cache
    has slots."""
    if self._pinned_shapes:
      return self.engine_config.block_size
    return max(num_tokens, min(_next_power_of_two(num_tokens), self.engine_config.cache_len))

  def _call(self, kv, tokens: list[int], first_position: int, rows: int, lead: int):
    """One transformer call of `rows` rows: `lead` padding rows, the tokens, padding."""
    ids = np.zeros((1, rows), np.int32)
    positions = np.full((1, rows), kvs.EMPTY, np.int32)
    ids[0, lead:lead + len(tokens)] = tokens
    positions[0, lead:lead + len(tokens)] = first_position + np.arange(len(tokens))
    return self._step(self.loaded.params, ids, positions, kv)

  def _logits(self, hidden: jax.Array, rows: list[int]) -> list[np.ndarray]:
    """float32 logits [V] of the given rows of one call's hidden states [1, T, D]."""
    if not self._pinned_shapes:
      return list(np.asarray(self._head(self.loaded.params, hidden, np.asarray(rows, np.int32))[0]))
    r, out = self.engine_config.logits_rows, []
    for i in range(0, len(rows), r):
      chunk = rows[i:i + r]
      padded = np.zeros(r, np.int32)  # every logits call has exactly r rows
      padded[:len(chunk)] = chunk
      out.extend(np.asarray(self._head(self.loaded.params, hidden, padded)[0, :len(chunk)]))
    return out

  def extend(self, ctx: Context, tokens: Sequence[int], *, logits: str | int = 'none',
             consume: bool = False) -> tuple[Context, np.ndarray | None]:
    """Appends tokens to the context and returns float32 logits for the last rows asked for:
    `logits` is 'none', 'last' ([1, V]), 'all' ([n, V]) or a count k of trailing rows ([k, V]).
    `consume=True` promises that `ctx` will not be used again, so its KV buffers are updated in
    place instead of copied."""
    tokens = self._check_tokens(ctx, tokens)
    wanted = {'none': 0, 'last': 1, 'all': len(tokens)}.get(logits, logits)
    if not isinstance(wanted, int) or not 0 <= wanted <= len(tokens):
      raise ValueError(f"logits must be 'none', 'last', 'all' or a row count in "
                       f'[0, {len(tokens)}], not {logits!r}')
    first_wanted = len(tokens) - wanted
    rows = self._rows_per_call(len(tokens))
    # Pinned: blocks are aligned to the sequence, so the token with sequence index j always sits
    # in row j mod B, whatever the calls before (the first block may start with padding rows).
    lead = len(ctx.tokens) % rows if self._pinned_shapes else 0
    kv = ctx.kv if consume else jax.tree.map(jnp.copy, ctx.kv)
    logit_rows = []
    for block_start in range(-lead, len(tokens), rows):  # token index of the block's row 0
      first = max(block_start, 0)
      chunk = tokens[first:block_start + rows]
      hidden, kv = self._call(kv, chunk, ctx.next_position + first, rows, first - block_start)
      wanted_rows = [j - block_start for j in range(max(first, first_wanted), first + len(chunk))]
      if wanted_rows:
        logit_rows.extend(self._logits(hidden, wanted_rows))
    result = np.stack(logit_rows) if wanted else None
    new = Context(kv=kv, tokens=ctx.tokens + tuple(tokens),
                  next_position=ctx.next_position + len(tokens),
                  last_logits=None if result is None else result[-1])
    return new, result

  def generate(self, ctx: Context, max_new_tokens: int, *, temperature: float = 0.0,
               seed: int = 0, stop_at_eos: bool = True) -> tuple[Context, list[int]]:
    """Greedy (temperature 0) or seeded sampling from the context's last logits. The returned
    context holds every generated token but the last (computing its KV would cost one more
    call that nothing needs unless the context is extended; extend it then)."""
    stop = (lambda tokens: tokens[-1] == EOS_ID) if stop_at_eos else None
    decoded = self.decode(ctx, max_new_tokens, temperature=temperature, seed=seed, stop=stop)
    return decoded.context, decoded.tokens

  def decode(self, ctx: Context, max_new_tokens: int, *, temperature: float = 0.0,
             seed: int = 0, stop: Callable[[list[int]], bool] | None = None) -> 'Decoded':
    """`generate` that stops once `stop(tokens so far)` holds, and also returns the SHA-256 of
    the float32 logits every token was drawn from (the evidence a replay compares)."""
    if ctx.last_logits is None:
      raise ValueError('the context has no logits at its last token; extend it with '
                       "logits='last' first")
    rng = np.random.default_rng(seed)
    new_tokens, digest = [], hashlib.sha256()
    while len(new_tokens) < max_new_tokens:
      if new_tokens:  # after the first step the context is this loop's own: update in place
        ctx, _ = self.extend(ctx, new_tokens[-1:], logits='last', consume=len(new_tokens) > 1)
      digest.update(np.ascontiguousarray(ctx.last_logits, np.float32).tobytes())
      new_tokens.append(sample(ctx.last_logits, temperature, rng))
      if stop is not None and stop(new_tokens):
        break
    return Decoded(context=ctx, tokens=new_tokens, logits_sha256=digest.hexdigest())

  def prefill(self, tokens: Sequence[int], *, logits: str = 'last',
              start_position: int = 0) -> tuple[Context, np.ndarray | None]:
    """A fresh context holding `tokens`."""
    return self.extend(self.empty(start_position), tokens, logits=logits, consume=True)


def sample(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
  """Argmax at temperature 0; otherwise a draw from softmax(logits / temperature) in float64."""
  if temperature <= 0:
    return int(np.argmax(logits))
  scaled = np.asarray(logits, np.float64) / temperature
  probs = np.exp(scaled - scaled.max())
  return int(rng.choice(len(probs), p=probs / probs.sum()))
