"""The inference engine: pinned (byte-exact by construction), blocked (the first pinned design)
or default (the plain fast path).

Why pinning is needed. XLA picks kernels by shape. Measured on this project's CPU machines (jax
0.10.2, XLA:CPU, float32 and bfloat16): row 0 of `x[:M] @ W` has different bits for M = 1,
M in 2..32 and M >= 64, and XLA's own reductions and fusions (RMSNorm, softmax, multiply-adds
contracted into FMAs) add more classes. So "restore a prefix, then prefill the rest" differs
from a one-shot prefill unless a row's bits stop depending on the call's shape.

mode='pinned': reduction orders fixed by construction (gemma_jax.layers.FixedOrder), so that
calls need no fixed shape.
  * Dots run in Eigen (`dot_library='eigen'`: compiler_options turn XLA:CPU's YNNPACK dot fusion
    off for the pinned engine's computations, whatever the process's XLA_FLAGS).
  * Every projection contracts over chunks of at most k_chunk (256) inputs, a batched dot on a
    free reshape of the weight, and adds the chunk products in chunk order with elementwise adds.
    A dot over <= 256-320 terms accumulates them in one pass, the same for a GEMV (one row) as
    for any GEMM of >= 8 rows (2..7 rows take other kernels for some shapes, so such calls are
    padded to min_rows = 8): a row's bits no longer depend on M. Tiny projections (<= 65536
    weights, the test configs) are broadcast products with tree sums.
  * Row sums are explicit pairwise trees (RMSNorm); products that feed an add across ops pass
    through an integer identity the compiler cannot see through (layers.materialize), and the
    residual stream leaves a run-time lax.cond (layers.fusion_barrier) so XLA does not recompute
    it inside every later fusion (which cost more than the chunking).
  * Attention ('tiled', gemma_jax/tiled_attention.py) reads the first n 256-slot tiles of the
    cache (n: the tiles holding the context, rounded up to a power of two), one dot per tile,
    a two-pass softmax whose tile sums are added in slot order, and a tile a row does not see
    changes nothing, so n follows the context (the cost too) without changing a bit. A token's
    slot is its sequence index (mod the ring size, W + block_size - 1 rounded up to whole tiles,
    on local layers).
  * Logits: `logits_rows` (1) rows per call, the table streamed as table @ row.
A call has 1 row (a decode step, its logits in the same computation) or a row bucket (min_rows,
2 min_rows, ..., block_size = 256) with padding rows (position EMPTY: masked everywhere, writing
nothing) after its tokens; no alignment to the sequence is needed. A token's KV and logits are
then a pure function of the tokens up to it: one-shot prefill, prefix-then-rest and token-by-token
decode agree bit for bit for any split point, before and past the sliding window
(tests/test_graft_exact.py, tests/test_pinned_rows.py, results/graft_exactness_*.json).
What the guarantee rests on is measured, not proven: XLA:CPU's kernel choices for these shapes
(Eigen's K blocking above ~320 terms follows the CPU's cache sizes) and its not fusing through a
lax.cond; the fingerprint pins the CPU model and the versions, and the tests re-measure it.

mode='blocked': the first pinned design, kept bit-identical so that results and manifests made
with it still replay (records without k_chunk map to it, `EngineConfig.from_dict`). Every call
has exactly block_size (16) rows, blocks aligned to the sequence (token j in row j mod B, padding
rows before the first token of a call that continues a context mid-block), attention reduces
over the whole fixed-size buffer, XLA's own numerics. A decode step costs a whole block.

mode='default': the plain fast path: one call per extend padded only to the next power of two
(XLA sees whatever M the request has), logits for the requested rows in one call, local layers
over the full cache. It is here to show what pinning buys (and costs: nothing, see
results/bench_*.json).

Serving several contexts: `extend_batch` runs N contexts per call, one per batch slot, each
getting the bits it gets alone (pinned only; tests/test_batch.py). Devices: `mesh` runs the
engine on a jax.sharding mesh (gemma_jax/sharding.py): layout 'gather' never splits a
contraction, 'split' is Megatron's (experiments/mesh_exactness.py measures both).

Everything that decides bits is in EngineConfig and the engine fingerprint (graft/fingerprint.py):
mesh and layout, mode, block size, row buckets, contraction chunk, dot library, logits rows, cache length,
attention implementation and its tiles, matmul precision, XLA flags, dtype, the layout version,
jax/jaxlib versions, backend, device kind, CPU model and vector extensions. The thread count is
not: tests/test_threads.py shows the bits are the same on one core, two cores, and with Eigen
single-threaded.
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
from gemma_jax import layers
from gemma_jax import model
from gemma_jax import rope
from gemma_jax import sharding
from gemma_jax.config import EOS_ID
from gemma_jax.weights import LoadedModel
from graft import fingerprint

MODES = ('pinned', 'blocked', 'default')
DOT_LIBRARIES = ('eigen', 'ynn')
# XLA:CPU debug options per dot library, passed to every pinned call's compilation (so that the
# pinned numerics do not depend on the process's XLA_FLAGS defaults).
_COMPILER_OPTIONS = {'eigen': {'xla_cpu_experimental_ynn_fusion_type': ''}, 'ynn': {}}
# Per mode: rows per call (block_size) and attention when the config leaves them None.
_DEFAULT_BLOCK_SIZE = {'pinned': 256, 'blocked': 16, 'default': 256}
_DEFAULT_ATTENTION = {'pinned': 'tiled', 'blocked': 'xla', 'default': 'xla'}

# The version of everything outside the config that decides a pinned engine's bits: how tokens
# are laid out in calls and slots (2: token j in slot j, mod the ring on local layers; blocked
# calls aligned to the sequence). Artifacts and store objects record it; a change here must bump
# it, so that KV computed under the old layout is refused instead of grafted.
LAYOUT_VERSION = 2


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """Everything about an engine that can change the bits of its results. `mode` 'pinned' is
  the pinned configuration (byte-exact grafts); 'blocked' the first pinned design; 'default' the
  plain fast path (see the module docstring). block_size and attention left None take the
  mode's default (and the Engine records the value it used)."""

  mode: str = 'pinned'
  block_size: int | None = None  # pinned: most rows per call; blocked: rows of every call
  logits_rows: int = 1  # rows per logits call (pinned, blocked)
  cache_len: int = 4096  # KV slots on global layers: the most tokens a context holds
  attention: str | None = None  # a name in gemma_jax.attention.IMPLEMENTATIONS
  attention_tile: int | None = None  # KV tile of the tiled / Pallas attention (None: default)
  matmul_precision: str = 'highest'  # jax.default_matmul_precision inside every call
  xla_flags: str = ''  # must equal $XLA_FLAGS when the engine is built
  # Pinned numerics: calls of 2 .. min_rows - 1 tokens are padded to min_rows rows (XLA:CPU
  # gives such small GEMMs kernels of their own); k_chunk: the contraction chunk of every
  # projection; dot_library: 'eigen' (YNNPACK dot fusion off) or 'ynn' (XLA's default).
  min_rows: int = 8
  k_chunk: int = 256
  dot_library: str = 'eigen'
  # Devices: '' (one) or a mesh ('model:4', 'model:2,data:2'; gemma_jax/sharding.py) and its
  # layout: 'gather' (no contraction ever split) or 'split' (Megatron).
  mesh: str = ''
  layout: str = 'gather'

  def __post_init__(self):
    if self.mode not in MODES:
      raise ValueError(f'unknown engine mode {self.mode!r}; expected one of {MODES}')
    if self.block_size is None:
      object.__setattr__(self, 'block_size', _DEFAULT_BLOCK_SIZE[self.mode])
    if self.attention is not None and self.attention not in attention_lib.IMPLEMENTATIONS:
      raise ValueError(f'unknown attention {self.attention!r}; expected one of '
                       f'{tuple(attention_lib.IMPLEMENTATIONS)}')
    if self.dot_library not in DOT_LIBRARIES:
      raise ValueError(f'unknown dot library {self.dot_library!r}; expected one of '
                       f'{DOT_LIBRARIES}')
    if (self.block_size < 1 or self.logits_rows < 1 or self.cache_len < self.block_size
        or self.min_rows < 1 or self.k_chunk < 1):
      raise ValueError(f'invalid engine config {self}: need 1 <= block_size <= cache_len and '
                       'logits_rows, min_rows, k_chunk >= 1')
    if self.layout not in sharding.LAYOUTS:
      raise ValueError(f'unknown layout {self.layout!r}; expected one of {sharding.LAYOUTS}')
    if self.mesh:
      sharding.parse_mesh(self.mesh)  # raises on a malformed mesh
    if self.mode == 'blocked' and self.attention == 'tiled':
      raise ValueError("the blocked engine reduces over the whole cache: attention 'xla' or "
                       "'pallas'")

  @classmethod
  def from_dict(cls, values: dict) -> 'EngineConfig':
    """From its JSON form. Also reads older records: `engine` for mode, and a 'pinned' record
    made before the fixed-order design (no k_chunk) describes the blocked engine, which is what
    made it."""
    values = dict(values)
    if 'engine' in values and 'mode' not in values:
      values['mode'] = values.pop('engine')
    if 'k_chunk' not in values and values.get('mode', 'pinned') == 'pinned':
      values['mode'] = 'blocked'
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


def _round_up(n: int, multiple: int) -> int:
  return -(-n // multiple) * multiple


def row_buckets(block_size: int, min_rows: int) -> tuple[int, ...]:
  """Row counts a pinned call may have: 1, then min_rows doubling, and block_size."""
  buckets, rows = {1, block_size}, min_rows
  while rows < block_size:
    buckets.add(rows)
    rows *= 2
  return tuple(sorted(buckets))


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
    if config.attention is None:
      preferred = _DEFAULT_ATTENTION[config.mode]
      supported = rope.get_mode(loaded.config.rope_mode).attention
      config = dataclasses.replace(config, attention=preferred if preferred in supported
                                   else 'xla')
    rope.check_attention(loaded.config.rope_mode, config.attention)
    self.loaded = loaded
    self.config = loaded.config
    self.engine_config = config
    self._pinned = config.mode == 'pinned'
    self._blocked = config.mode == 'blocked'
    self._attention_fn = attention_lib.build(config.attention, config.attention_tile,
                                             kernel_platform)
    head_dims = tuple(sorted({self.config.layer_spec(i).head_dim
                              for i in range(self.config.num_layers)}))
    self._kernel_blocks = self._attention_fn.blocks(head_dims, self.dtype)
    multiple = self._attention_fn.slot_multiple(head_dims, self.dtype)
    self._cache_slots = config.cache_len
    self._local_slots = None  # default: one-shot calls of any length need the full cache
    if self._pinned or self._blocked:
      # Local layers: a ring just big enough for the largest call, in whole kernel tiles (so
      # the kernel never pads the cache).
      self._local_slots = _round_up(kvs.local_slots_needed(self.config, config.block_size),
                                    multiple)
    if self._pinned:
      self._cache_slots = _round_up(config.cache_len, multiple)
      self._row_buckets = row_buckets(config.block_size, config.min_rows)
    self._numerics = layers.FixedOrder(k_chunk=config.k_chunk) if self._pinned else None
    self._compiler_options = (_COMPILER_OPTIONS[config.dot_library] or None
                              if self._pinned else None)
    self._steps = {}  # (tiles read or None, with logits) -> jitted call
    # On a mesh: parameters placed by the layout, the KV state over KV heads and sequences,
    # and (layout 'gather') every row-parallel projection's input gathered whole.
    self.mesh = sharding.make_mesh(sharding.parse_mesh(config.mesh)) if config.mesh else None
    self._params = (sharding.shard_params(loaded.params, self.mesh, config.layout)
                    if self.mesh is not None else loaded.params)
    self._gather_mesh = self.mesh if config.layout == 'gather' else None

    def head(params, hidden, rows):
      # hidden [1, T, D], rows [R] -> logits [1, R, V] of those rows (gathered inside the jit).
      with jax.default_matmul_precision(config.matmul_precision), \
           layers.fixed_order(self._numerics), sharding.gathered_contractions(self._gather_mesh):
        return model.compute_logits(params, self.config, jnp.take(hidden, rows, axis=1))

    self._head_fn = head
    self._head = jax.jit(head, compiler_options=self._compiler_options)

  def step_function(self, tiles: int | None = None, with_logits: bool = False):
    """The jitted transformer call (params, tokens [1, T], positions [1, T], kv) -> (hidden
    [1, T, D], kv[, logits [1, 1, V]]) whose attention reads the first `tiles` KV tiles (None:
    the whole cache). with_logits: a one-row call that also returns its logits (a decode step:
    the same ops as the call then the head on row 0, one dispatch instead of two). The KV state
    is donated: XLA updates the cache in place; callers' contexts stay valid because a context
    that may be used again is copied first (see extend's `consume`)."""
    key = (tiles, with_logits)
    if key not in self._steps:
      attention_fn = self._attention_fn
      if tiles is not None:
        attention_fn = attention_fn.reading(tiles)
      precision, numerics = self.engine_config.matmul_precision, self._numerics

      def step(params, tokens, positions, kv):
        with jax.default_matmul_precision(precision), layers.fixed_order(numerics), \
             sharding.gathered_contractions(self._gather_mesh):
          hidden, kv = model.forward(params, self.config, tokens, positions, kv, attention_fn)
        if not with_logits:
          return hidden, kv
        return hidden, kv, self._head_fn(params, hidden, jnp.zeros((1,), jnp.int32))

      self._steps[key] = jax.jit(step, donate_argnums=(3,),
                                 compiler_options=self._compiler_options)
    return self._steps[key]

  @property
  def max_rows(self) -> int:
    """The most token rows one transformer call has."""
    if self._pinned or self._blocked:
      return self.engine_config.block_size
    return self.engine_config.cache_len

  def _tiles_for(self, end: int) -> int | None:
    """Tiles the tiled attention reads for a call whose last token has sequence index end - 1:
    the tiles holding slots 0 .. end - 1, rounded up to a power of two (fewer compiled shapes);
    reading more tiles than a row sees does not change its bits (gemma_jax.tiled_attention)."""
    if not (self._pinned and hasattr(self._attention_fn, 'reading')):
      return None
    tile = self._attention_fn.tile
    return min(_next_power_of_two(-(-end // tile)), self._cache_slots // tile)

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

  def empty_kv(self) -> kvs.KVState:
    """The engine's one fixed-size KV state, empty."""
    kv = kvs.init_kv_state(self.config, batch_size=1, cache_len=self._cache_slots,
                           dtype=self.dtype, local_cache_len=self._local_slots)
    return kv if self.mesh is None else jax.device_put(kv, sharding.kv_shardings(kv, self.mesh))

  def empty(self, start_position: int = 0) -> Context:
    """An empty context whose first token will sit at `start_position`."""
    return Context(kv=self.empty_kv(), tokens=(), next_position=start_position)

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
    """Pinned: the smallest row bucket that holds the tokens (one row for one token). Blocked:
    the block size. Default: the next power of two, but no more rows than the cache has slots."""
    if self._blocked:
      return self.engine_config.block_size
    if self._pinned:
      return next(r for r in self._row_buckets if r >= num_tokens)
    return max(num_tokens, min(_next_power_of_two(num_tokens), self.engine_config.cache_len))

  def _calls(self, done: int, tokens: list[int]) -> list[tuple[int, list[int], int]]:
    """(index of the first token, tokens, leading padding rows) per call, for `tokens` after
    `done` tokens of context."""
    b = self.engine_config.block_size
    if self._pinned:  # at most block_size tokens per call, padding after them
      return [(first, tokens[first:first + b], 0) for first in range(0, len(tokens), b)]
    if self._blocked:
      # Blocks aligned to the sequence: the token with sequence index j always sits in row
      # j mod B, whatever the calls before (the first block may start with padding rows).
      lead = done % b
      return [(max(start, 0), tokens[max(start, 0):start + b], max(start, 0) - start)
              for start in range(-lead, len(tokens), b)]
    return [(0, tokens, 0)]

  def _call(self, kv, tokens: list[int], first_position: int, rows: int, lead: int, end: int,
            with_logits: bool = False):
    """One transformer call of `rows` rows: `lead` padding rows, the tokens, padding; `end`:
    the context's length after the call."""
    ids = np.zeros((1, rows), np.int32)
    positions = np.full((1, rows), kvs.EMPTY, np.int32)
    ids[0, lead:lead + len(tokens)] = tokens
    positions[0, lead:lead + len(tokens)] = first_position + np.arange(len(tokens))
    step = self.step_function(self._tiles_for(end), with_logits)
    return step(self._params, ids, positions, kv)

  def _logits(self, hidden: jax.Array, rows: list[int]) -> list[np.ndarray]:
    """float32 logits [V] of the given rows of one call's hidden states [1, T, D]."""
    if not (self._pinned or self._blocked):
      return list(np.asarray(self._head(self._params, hidden, np.asarray(rows, np.int32))[0]))
    r, out = self.engine_config.logits_rows, []
    for i in range(0, len(rows), r):
      chunk = rows[i:i + r]
      padded = np.zeros(r, np.int32)  # every logits call has exactly r rows
      padded[:len(chunk)] = chunk
      out.extend(np.asarray(self._head(self._params, hidden, padded)[0, :len(chunk)]))
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
    kv = ctx.kv if consume else jax.tree.map(jnp.copy, ctx.kv)
    logit_rows = []
    for first, chunk, lead in self._calls(len(ctx.tokens), tokens):
      rows = self._rows_per_call(len(chunk))
      wanted_rows = [j - first + lead for j in range(max(first, first_wanted), first + len(chunk))]
      end = len(ctx.tokens) + first + len(chunk)
      if self._pinned and rows == 1 and wanted_rows and self.engine_config.logits_rows == 1:
        hidden, kv, row_logits = self._call(kv, chunk, ctx.next_position + first, rows, lead,
                                            end, with_logits=True)
        logit_rows.append(np.asarray(row_logits)[0, 0])
        continue
      hidden, kv = self._call(kv, chunk, ctx.next_position + first, rows, lead, end)
      if wanted_rows:
        logit_rows.extend(self._logits(hidden, wanted_rows))
    result = np.stack(logit_rows) if wanted else None
    new = Context(kv=kv, tokens=ctx.tokens + tuple(tokens),
                  next_position=ctx.next_position + len(tokens),
                  last_logits=None if result is None else result[-1])
    return new, result

  def extend_batch(self, ctxs: Sequence[Context], tokens: Sequence[Sequence[int]], *,
                   logits: Sequence[int] | None = None) -> tuple[list[Context], list]:
    """Extends N contexts at once, one per batch slot of every call (pinned engine only):
    slot i gets tokens[i] (possibly none) and, when `logits` is given, float32 logits [k_i, V]
    of its last logits[i] tokens (None where k_i is 0). A slot's rows are computed exactly as
    `extend` computes them alone (the fixed reduction orders do not see the other slots; every
    batched call has at least min_rows rows per slot, so N x rows stays in the GEMM class), so
    each context gets the bits it gets alone, whatever the other slots hold or whether they
    are empty (tests/test_batch.py)."""
    if not self._pinned:
      raise ValueError('batch slots need the pinned engine (mode pinned): the bits of the '
                       'other modes depend on the call')
    if len(ctxs) != len(tokens) or not ctxs:
      raise ValueError(f'{len(ctxs)} contexts and {len(tokens)} token lists: need one each')
    tokens = [self._check_tokens(c, t) if len(t) else [] for c, t in zip(ctxs, tokens)]
    wanted = list(logits) if logits is not None else [0] * len(ctxs)
    for i, (k, t) in enumerate(zip(wanted, tokens)):
      if not 0 <= k <= len(t):
        raise ValueError(f'slot {i}: {k} logit rows asked of {len(t)} tokens')
    # Copies (the stacked state is this call's own, so the callers' contexts stay valid).
    kv = jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *[c.kv for c in ctxs])
    b, slots = self.engine_config.block_size, len(ctxs)
    out = [[] for _ in ctxs]
    for first in range(0, max(len(t) for t in tokens), b):
      chunks = [t[first:first + b] for t in tokens]
      rows = max(self._rows_per_call(max(len(c) for c in chunks)), self.engine_config.min_rows)
      ids = np.zeros((slots, rows), np.int32)
      positions = np.full((slots, rows), kvs.EMPTY, np.int32)
      for i, chunk in enumerate(chunks):
        ids[i, :len(chunk)] = chunk
        positions[i, :len(chunk)] = ctxs[i].next_position + first + np.arange(len(chunk))
      end = max(len(c.tokens) + min(first + b, len(t)) for c, t in zip(ctxs, tokens))
      hidden, kv = self.step_function(self._tiles_for(end))(self._params, ids, positions,
                                                             kv)
      for i, chunk in enumerate(chunks):
        start = len(tokens[i]) - wanted[i]  # the slot's first token with logits
        rows_wanted = [j - first for j in range(max(first, start), first + len(chunk))]
        if rows_wanted:
          out[i].extend(self._logits(hidden[i:i + 1], rows_wanted))
    new = [ctx if not t else  # an idle slot's state was not written
           Context(kv=jax.tree.map(lambda x, i=i: x[i:i + 1], kv), tokens=ctx.tokens + tuple(t),
                   next_position=ctx.next_position + len(t),
                   last_logits=out[i][-1] if out[i] else None)
           for i, (ctx, t) in enumerate(zip(ctxs, tokens))]
    return new, [np.stack(o) if o else None for o in out]

  def generate_batch(self, ctxs: Sequence[Context], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of N contexts (each with its last logits), decoded together one
    token per slot per call (the tokens each context gets alone: see `extend_batch`)."""
    if any(c.last_logits is None for c in ctxs):
      raise ValueError('every context needs logits at its last token')
    outputs = [[int(np.argmax(c.last_logits))] for c in ctxs]
    ctxs = list(ctxs)
    while len(outputs[0]) < max_new_tokens:
      ctxs, rows = self.extend_batch(ctxs, [o[-1:] for o in outputs], logits=[1] * len(ctxs))
      for o, r in zip(outputs, rows):
        o.append(int(np.argmax(r[-1])))
    return outputs

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
