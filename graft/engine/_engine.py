"""The inference engine: a loaded model run under an EngineConfig, through its plan.

    engine = Engine(loaded, EngineConfig())            # mode 'spec' (graft.engine.plans)
    ctx, logits = engine.prefill(tokens)                # a Context and the last row's logits
    ctx, logits = engine.extend(ctx, more, logits='all')

Contexts are immutable values; every method returns a new one. What the engine does per mode
(calls and row buckets, numerics, attention, cache geometry) is its plan's answer; the engine
itself never branches on a mode's name. Everything that decides bits is in the EngineConfig and
the engine fingerprint (graft/engine/fingerprint.py); docs/determinism.md says what each plan's
exactness rests on and what was measured.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import attention as attention_lib
from gemma_jax import executables
from gemma_jax import kv_state as kvs
from gemma_jax import model
from gemma_jax import rope
from gemma_jax import sampling
from gemma_jax import sharding
from gemma_jax.config import EOS_ID
from gemma_jax.sizes import next_power_of_two
from gemma_jax.weights import LoadedModel
from graft.engine import fingerprint, placement, plans
from graft.engine.batch import Batch
from graft.engine.config import EngineConfig
from graft.engine.context import Context, Decoded, call_inputs, sample
from graft.engine.shared import shared


# A cache of at most this many slots is read whole by every call of a tiled attention (one
# executable per call shape, not one per tile count: the tiny models of the tests); a larger one
# reads the tiles that hold the context. Neither changes a bit (`Engine._tiles_for`).
WHOLE_CACHE_SLOTS = 1024


class Engine:
  """Runs a loaded model under an EngineConfig, through its plan (graft.engine.plans)."""

  def __init__(self, loaded: LoadedModel, config: EngineConfig | None = None, *,
               kernel_platform: str | None = None, canary: bool = True):
    """kernel_platform: the platform the attention kernel is built for ('cpu', 'gpu', 'tpu';
    None: the default backend's). Naming one this host does not have gives an engine whose
    functions lower for that platform (graft/engine/lowering.py) but do not run. canary: whether
    a spec engine's build runs its checks, the self-check and the canary (graft/engine/canary.py;
    False only for the canary's own engine, whose digest is its check)."""
    config = config or EngineConfig()
    if sharding.xla_flags() != config.xla_flags:
      raise ValueError(f'the engine config needs XLA_FLAGS={config.xla_flags!r} but the process '
                       f'has {sharding.xla_flags()!r}; set it before starting Python')
    plan_class = plans.plan_class(config.mode)
    if config.attention is None:
      supported = rope.get_mode(loaded.config.rope_mode).attention
      preferred = plan_class.default_attention
      config = dataclasses.replace(config, attention=preferred if preferred in supported
                                   else 'xla')
    if config.dot_library is None:
      config = dataclasses.replace(config, dot_library=plan_class.default_dot_library())
    rope.check_attention(loaded.config.rope_mode, config.attention)
    self.loaded = loaded
    self.config = loaded.config
    self.engine_config = config
    self.runs_canary = canary
    self.plan = plan_class(config)
    self._attention_fn = attention_lib.build(config.attention, config.attention_tile,
                                             kernel_platform)
    head_dims = tuple(sorted({self.config.layer_spec(i).head_dim
                              for i in range(self.config.num_layers)}))
    self._kernel_blocks = self._attention_fn.blocks(head_dims, self.dtype)
    multiple = self._attention_fn.slot_multiple(head_dims, self.dtype)
    self._cache_slots = self.plan.cache_slots(multiple)
    self._local_slots = self.plan.local_slots(self.config, multiple)
    # (tiles read or None, with logits) -> jitted call, shared by the engines of this model and
    # config (an XLA:CPU executable of the 270M holds ~160 MB: docs/performance.md).
    self._held = []  # what this engine shares with others of its model (`shared`)
    self._steps = shared(self._held, loaded, ('steps', config, kernel_platform), dict)
    # On a mesh: parameters placed by the layout, the KV state over KV heads and sequences,
    # and (layout 'gather') every row-parallel projection's input gathered whole.
    self.mesh = sharding.make_mesh(sharding.parse_mesh(config.mesh)) if config.mesh else None
    self.numerics = self.plan.numerics_on(kernel_platform).on_mesh(
        self.mesh if config.mesh_layout == 'gather' else None)
    # Whether the numerics' kernels do only a call's run-time length of work: then a byte-exact
    # plan's calls have one of two shapes (a decode step, or rows_per_call rows) and attention
    # reads the whole cache, whatever the lengths met (a fixed set of executables).
    self.by_length = self.plan.byte_exact and self.numerics.runs_by_length
    # Weights placed on the mesh and in the form the numerics read them (the native kernels'
    # panels; else as loaded), shared with every other engine of this model that places and
    # stores them alike.
    held_as = (config.mesh, config.mesh_layout, self.numerics.storage)
    self._params = shared(self._held, loaded, ('params', held_as), lambda: placement.place_weights(
        loaded, self.config, self.numerics, self.mesh, config.mesh_layout))
    # The numerics' output table where they read one ('transposed'): the embedding itself,
    # stored as the [D, V] table or its panels (graft.engine.placement), one array for both.
    table = self._params['embedder']['input_embedding']
    abstract = isinstance(table, jax.ShapeDtypeStruct)  # an engine that lowers, never runs
    self._output_table = table if self.numerics.output_table == 'transposed' else None

    def head(params, output_table, hidden, rows, count):
      # hidden [B, T, D], rows [R] -> logits [1, R, V] of those rows of the B x T rows (row
      # b * T + t: slot b's row t; gathered inside the jit, before the output table); count:
      # how many of the rows are wanted (the rest are padding, which a kernel may skip).
      # The run-time zero of the numerics' barriers: row indices are never negative.
      numerics = self.numerics.with_zero((rows[0] < 0).astype(jnp.uint32)).with_rows(count)
      with jax.default_matmul_precision(config.matmul_precision):
        flat = hidden.reshape(1, -1, hidden.shape[-1])
        return model.compute_logits(params, self.config, jnp.take(flat, rows, axis=1),
                                    numerics, output_table)

    self._weights_checked = False
    self._head_fn = head
    self._kernel_platform = kernel_platform
    self._head = shared(self._held, loaded, ('head', config, kernel_platform), lambda: self._compiled(
        'head', jax.jit(head, compiler_options=self.plan.compiler_options)))
    if not abstract:
      self._preload()
      self.plan.check_engine(self)

  def _check_weights(self) -> None:
    """Raises where the loaded weights do not match their recorded hashes (once; see
    LoadedModel.check), before anything computed from them leaves the engine."""
    if not self._weights_checked:
      self.loaded.check()
      self._weights_checked = True

  def head_function(self):
    """The jitted logits call (params, output table, hidden [B, T, D], rows [R] of the B x T,
    count: the first rows wanted, int32) -> logits [1, R, V] (the output table:
    `output_table`)."""
    return self._head

  @property
  def output_table(self) -> jax.Array | None:
    """The numerics' [D, V] output table when it is not the tied embedding (None)."""
    return self._output_table

  def step_function(self, tiles: int | None = None, with_logits: bool = False):
    """The jitted transformer call (params, output table, tokens [B, T], positions [B, T], kv)
    -> (hidden [B, T, D], kv[, logits [1, B T, V]]) whose attention reads the first `tiles` KV
    tiles (None: the whole cache). with_logits: a call that also returns the logits of all its
    rows (a decode step of one row per slot: the same ops as the call then the head, one
    dispatch instead of two).
    The output table (`output_table`) is an argument, never a closed-over constant: a constant
    would be compiled into the executable (hundreds of MB in the persistent cache, slower to
    load than to compile). The KV state is donated: XLA updates the cache in place; callers'
    contexts stay valid because a context that may be used again is copied first (see extend's
    `consume`)."""
    key = (tiles, with_logits)
    if key not in self._steps:
      attention_fn = self._attention_fn
      if tiles is not None:
        attention_fn = attention_fn.reading(tiles)
      precision, numerics = self.engine_config.matmul_precision, self.numerics

      def step(params, output_table, tokens, positions, kv):
        with jax.default_matmul_precision(precision):
          hidden, kv = model.forward(params, self.config, tokens, positions, kv, attention_fn,
                                     numerics)
        if not with_logits:
          return hidden, kv
        # Every row, from a value the compiler cannot know (fill is never negative, so the
        # first is 0; a constant, or a value it can prove non-negative, would let it fold the
        # head's run-time zero, and with it every barrier of the head).
        count = tokens.size
        rows = jnp.minimum(kv.fill[:1], 0) + jnp.arange(count, dtype=jnp.int32)
        return hidden, kv, self._head_fn(params, output_table, hidden, rows, jnp.int32(count))

      self._steps[key] = self._compiled(
          'step', jax.jit(step, donate_argnums=(4,), compiler_options=self.plan.compiler_options),
          tiles=tiles, with_logits=with_logits)
    return self._steps[key]

  def _preload(self) -> None:
    """By length, starts obtaining the executables of the calls every use of an engine makes in
    the background, while the engine is checked and its caller gets on
    (gemma_jax.executables.Saved.preload): a block and a logits call, loaded or compiled, and a
    decode step, loaded where saved."""
    if not self.by_length:
      return
    rows, i32 = self.max_rows, jnp.int32
    kv = jax.eval_shape(self.empty_kv)
    weights = (self._params, self._output_table)
    block, decode = (jax.ShapeDtypeStruct((1, t), i32) for t in (rows, 1))
    functions = [(self.step_function(None), (*weights, block, block, kv), True),
                 (self._head, (*weights, jax.ShapeDtypeStruct((1, rows, self.config.embed_dim),
                                                              self.dtype),
                               jax.ShapeDtypeStruct((plans.HEAD_ROWS,), i32),
                               jax.ShapeDtypeStruct((), i32)), True),
                 (self.step_function(None, with_logits=True), (*weights, decode, decode, kv),
                  False)]
    for function, args, compile in functions:
      if hasattr(function, 'preload'):
        function.preload(*args, compile=compile)

  def _compiled(self, name: str, jitted, **variant):
    """`jitted`, its executables saved ahead of time and loaded by later processes
    (gemma_jax.executables), keyed by everything it closes over; as it is on a mesh (its
    partitioned kernels hold Python callbacks, which XLA cannot serialize) and for another
    platform (graft/engine/lowering.py only lowers it)."""
    if self.mesh is not None or self._kernel_platform is not None:
      return jitted
    key = {'engine': self.engine_config, 'model': self.config, 'dtype': self.loaded.dtype,
           'numerics': self.numerics, 'dot': self.numerics.__dict__.get('dot'),
           'attention': self._attention_fn, 'compiler_options': self.plan.compiler_options,
           'output_table': None if self._output_table is None else self._output_table.shape,
           **variant}
    return executables.Saved(name, jitted, key, fixed=2)

  @property
  def max_rows(self) -> int:
    """The most token rows one transformer call has."""
    return self.plan.max_rows

  def _tiles_for(self, end: int) -> int | None:
    """Tiles the tiled attention reads for a call whose last token has sequence index end - 1:
    the tiles holding slots 0 .. end - 1, rounded up to a power of two (fewer compiled shapes);
    reading more tiles than a row sees does not change its bits (gemma_jax.tiled_attention).
    None (the whole cache) by length, and in a cache of at most WHOLE_CACHE_SLOTS slots, where
    reading all of it costs less than an executable per tile count."""
    if (self.by_length or self._cache_slots <= WHOLE_CACHE_SLOTS
        or not (self.plan.reads_tiles and hasattr(self._attention_fn, 'reading'))):
      return None
    tile = self._attention_fn.tile
    return min(next_power_of_two(-(-end // tile)), self._cache_slots // tile)

  @functools.cached_property
  def model_fingerprint(self) -> dict:
    """{'sha256', and what went into it}: what names the loaded model (graft.engine.fingerprint)."""
    return fingerprint.model_fingerprint(self.loaded)

  @functools.cached_property
  def fingerprint(self) -> dict:
    """{'sha256', and what went into it}: what names this engine's bits (its plan decides)."""
    return self.plan.fingerprint(self)

  @property
  def kernel_blocks(self) -> dict:
    """The attention kernel's block shapes that decide bits ({} when none)."""
    return self._kernel_blocks

  @property
  def attention_tile(self) -> int | None:
    """The KV tile of a tiled attention (None for the others)."""
    return getattr(self._attention_fn, 'tile', None)

  def projection_weights(self) -> dict[str, jax.Array]:
    """What a self-check probes: one weight per distinct projection shape contracted through a
    dot, and the output table, each as this engine stores it.

    Returns:
      As graft.engine.placement.projection_weights: {'<I>x<O>': [I, O] or its panels
      [O / P, I, P], 'output_table': [D, V] or its panels [V / P, D, P]}.
    """
    return placement.projection_weights(self.loaded, self.config, self.numerics, self.mesh,
                                        self._params, self._output_table)

  @property
  def dtype(self):
    """The KV state's and activations' dtype: the loaded model's."""
    return jnp.dtype(self.loaded.dtype)

  @property
  def local_slots(self) -> int:
    """The slots of the smallest layer cache (a local layer's ring, where the model has one)."""
    return min(self._cache_slots, self._local_slots or self._cache_slots)

  def empty_kv(self) -> kvs.KVState:
    """The engine's one fixed-size KV state, empty.

    Returns:
      A KVState: per cache layer k, v [1, S, K, H] in the model's dtype (S: the engine's slots,
      a local ring's on local layers) and positions int32 [1, S], all EMPTY; fill [1] = 0.
    """
    kv = kvs.init_kv_state(self.config, batch_size=1, cache_len=self._cache_slots,
                           dtype=self.dtype, local_cache_len=self._local_slots)
    return kv if self.mesh is None else jax.device_put(kv, sharding.kv_shardings(kv, self.mesh))

  def empty(self, start_position: int = 0) -> Context:
    """An empty context whose first token will sit at `start_position`."""
    return Context(kv=self.empty_kv(), tokens=(), next_position=start_position)

  def graft(self, rows: Sequence[kvs.KVRows], tokens: Sequence[int],
            start_position: int = 0) -> Context:
    """A fresh context holding verified rows: `rows` cover sequence indices [0, len(tokens)) of
    `tokens`, at positions start_position + index (their own), in this engine's one fixed
    cache. Every way of grafting (artifacts, the store, shifted grafts) ends here. Raises
    ValueError when the rows do not fit the engine or do not cover the tokens."""
    tokens, rows = tuple(int(t) for t in tokens), list(rows)
    first = int(rows[0].positions[0][0]) - rows[0].start if rows else start_position
    if first != start_position:
      raise ValueError(f'the rows start at position {first}, not {start_position}')
    kv = kvs.assemble(jax.eval_shape(self.empty_kv), rows, len(tokens))
    if self.mesh is not None:
      kv = jax.device_put(kv, sharding.kv_shardings(kv, self.mesh))
    return Context(kv=kv, tokens=tokens, next_position=start_position + len(tokens))

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

  def _call(self, kv, tokens: list[int], first_position: int, rows: int, lead: int, end: int,
            with_logits: bool = False):
    """One transformer call of `rows` rows: `lead` padding rows, the tokens, padding; `end`:
    the context's length after the call."""
    ids, positions = call_inputs([tokens], [first_position], rows, lead)
    step = self.step_function(self._tiles_for(end), with_logits)
    return step(self._params, self._output_table, ids, positions, kv)

  def _logits(self, hidden: jax.Array, rows: list[int]) -> list[np.ndarray]:
    """float32 logits [V] of the given rows of one call's hidden states [B, T, D] (row
    b * T + t: slot b's row t), in calls of the plan's head row counts (by length: one count,
    plans.HEAD_ROWS, whatever the number wanted)."""
    buckets = (plans.HEAD_ROWS,) if self.by_length else self.plan.head_rows
    if buckets is None:
      return list(sharding.to_host(self._head(self._params, self._output_table, hidden,
                                              np.asarray(rows, np.int32),
                                              np.int32(len(rows))))[0])
    out = []
    while len(out) < len(rows):
      chunk = rows[len(out):len(out) + buckets[-1]]
      padded = np.zeros(next(r for r in buckets if r >= len(chunk)), np.int32)
      padded[:len(chunk)] = chunk
      out.extend(sharding.to_host(self._head(self._params, self._output_table, hidden,
                                             padded, np.int32(len(chunk))))[0, :len(chunk)])
    return out

  def extend(self, ctx: Context, tokens: Sequence[int], *, logits: str | int = 'none',
             consume: bool = False) -> tuple[Context, np.ndarray | None]:
    """Appends tokens to the context, in the calls the plan cuts them into.

    Args:
      ctx: the context to extend (unchanged unless `consume`).
      tokens: the T token ids to append.
      logits: which rows' logits to return: 'none', 'last', 'all', or a count k of trailing
        rows.
      consume: a promise that `ctx` will not be used again, so its KV buffers are updated in
        place instead of copied.

    Returns:
      (the new context, float32 logits [k, V] of the last k tokens: [1, V] for 'last',
      [T, V] for 'all', None for 'none').
    """
    tokens = self._check_tokens(ctx, tokens)
    wanted = {'none': 0, 'last': 1, 'all': len(tokens)}.get(logits, logits)
    if not isinstance(wanted, int) or not 0 <= wanted <= len(tokens):
      raise ValueError(f"logits must be 'none', 'last', 'all' or a row count in "
                       f'[0, {len(tokens)}], not {logits!r}')
    first_wanted = len(tokens) - wanted
    kv = ctx.kv if consume else jax.tree.map(jnp.copy, ctx.kv)
    logit_rows = []
    for call in self.plan.calls(len(ctx.tokens), len(tokens), self.by_length):
      chunk = tokens[call.first:call.first + call.count]
      wanted_rows = [j - call.first + call.lead
                     for j in range(max(call.first, first_wanted), call.first + call.count)]
      end = len(ctx.tokens) + call.first + call.count
      # (By length every one-row call is the decode step: one executable, logits or not.)
      fused = (self.plan.fuses_decode and call.rows == 1
               and (bool(wanted_rows) or self.by_length))
      out = self._call(kv, chunk, ctx.next_position + call.first, call.rows, call.lead, end,
                       with_logits=fused)
      if fused:
        _, kv, row_logits = out
        if wanted_rows:
          logit_rows.append(sharding.to_host(row_logits)[0, 0])
        continue
      hidden, kv = out
      if wanted_rows:
        logit_rows.extend(self._logits(hidden, wanted_rows))
    result = np.stack(logit_rows) if wanted else None
    self._check_weights()
    new = Context(kv=kv, tokens=ctx.tokens + tuple(tokens),
                  next_position=ctx.next_position + len(tokens),
                  last_logits=None if result is None else result[-1])
    return new, result

  def extend_batch(self, ctxs: Sequence[Context], tokens: Sequence[Sequence[int]], *,
                   logits: Sequence[int] | None = None) -> tuple[list[Context], list]:
    """Extends N contexts at once, one per batch slot of every call (plans with batch_slots):
    slot i gets tokens[i] (possibly none) and, when `logits` is given, float32 logits [k_i, V]
    of its last logits[i] tokens (None where k_i is 0). A slot's rows are computed exactly as
    `extend` computes them alone (the fixed reduction orders do not see the other slots; every
    batched call has at least min_rows rows in all, so N x rows stays in the GEMM class), so
    each context gets the bits it gets alone, whatever the other slots hold or whether they
    are empty (tests/test_batch.py)."""
    tokens, wanted = self._check_batch(ctxs, tokens, logits)
    kv, out = self._extend_stacked(self._stack(ctxs), ctxs, tokens, wanted)
    self._check_weights()
    new = [ctx if not t else  # an idle slot's state was not written
           Context(kv=jax.tree.map(lambda x, i=i: x[i:i + 1], kv), tokens=ctx.tokens + tuple(t),
                   next_position=ctx.next_position + len(t),
                   last_logits=out[i][-1] if out[i] else None)
           for i, (ctx, t) in enumerate(zip(ctxs, tokens))]
    return new, [np.stack(o) if o else None for o in out]

  def _check_batch(self, ctxs, tokens, logits) -> tuple[list[list[int]], list[int]]:
    if not self.plan.batch_slots:
      raise ValueError(f'batch slots need a plan whose bits do not see the other slots (pinned); '
                       f'this engine is {self.engine_config.mode!r}')
    if len(ctxs) != len(tokens) or not ctxs:
      raise ValueError(f'{len(ctxs)} contexts and {len(tokens)} token lists: need one each')
    tokens = [self._check_tokens(c, t) if len(t) else [] for c, t in zip(ctxs, tokens)]
    wanted = list(logits) if logits is not None else [0] * len(ctxs)
    for i, (k, t) in enumerate(zip(wanted, tokens)):
      if not 0 <= k <= len(t):
        raise ValueError(f'slot {i}: {k} logit rows asked of {len(t)} tokens')
    return tokens, wanted

  @staticmethod
  def _stack(ctxs: Sequence[Context]):
    """The contexts' KV states stacked over slots, as a copy: the stacked state is donated to
    the calls, so the callers' contexts stay valid (a concatenation of one array is that array,
    hence the explicit copy)."""
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0) if len(xs) > 1 else jnp.copy(xs[0]),
                        *[c.kv for c in ctxs])

  @staticmethod
  def _unstack(kv, n: int) -> list:
    """A stacked state's n slots, each a state of one slot: one split per array (not a slice
    per slot and array: each eager op is a dispatch of its own)."""
    leaves, tree = jax.tree.flatten(kv)
    parts = [jnp.split(x, n, axis=0) for x in leaves]
    return [jax.tree.unflatten(tree, [p[i] for p in parts]) for i in range(n)]

  def _extend_stacked(self, kv, ctxs: Sequence[Context], tokens: list[list[int]],
                      wanted: list[int]):
    """extend_batch on a stacked state (donated): -> (the new stacked state, each slot's list
    of logits rows). Only the contexts' lengths and positions are read."""
    if self.by_length:
      return self._extend_stacked_by_length(kv, ctxs, tokens, wanted)
    b = self.max_rows
    out = [[] for _ in ctxs]
    for first in range(0, max(len(t) for t in tokens), b):
      chunks = [t[first:first + b] for t in tokens]
      # Rows per slot: a row bucket that holds every slot's chunk and gives the call at least
      # min_rows rows in all (one row per slot when there are min_rows slots or more).
      rows = self.plan.rows_for(max(max(len(c) for c in chunks),
                                    -(-self.engine_config.min_rows // len(ctxs))))
      ids, positions = call_inputs(chunks, [c.next_position + first for c in ctxs], rows)
      end = max(len(c.tokens) + min(first + b, len(t)) for c, t in zip(ctxs, tokens))
      hidden, kv = self.step_function(self._tiles_for(end))(self._params, self._output_table,
                                                             ids, positions, kv)
      # Every slot's wanted rows in shared logits calls (row i * rows + j: slot i's row j).
      flat = [(i, i * rows + j - first) for i, chunk in enumerate(chunks)
              for j in range(max(first, len(tokens[i]) - wanted[i]), first + len(chunk))]
      for (i, _), row in zip(flat, self._logits(hidden, [r for _, r in flat])):
        out[i].append(row)
    return kv, out

  def _extend_stacked_by_length(self, kv, ctxs: Sequence[Context], tokens: list[list[int]],
                                wanted: list[int]):
    """`_extend_stacked` by length: a step of one token per slot is one call of the decode
    step with a row per slot and its logits (one executable per slot count); longer requests
    run slot by slot through `extend` on the slot's part of the stacked state (the
    single-stream calls: no executable of their own)."""
    if max(len(t) for t in tokens) == 1:
      ids, positions = call_inputs(tokens, [c.next_position for c in ctxs], 1)
      _, kv, logits = self.step_function(None, with_logits=True)(
          self._params, self._output_table, ids, positions, kv)
      logits = sharding.to_host(logits)[0]
      return kv, [[logits[i]] if wanted[i] else [] for i in range(len(ctxs))]
    parts, out = [], []
    for i, (ctx, t, part) in enumerate(zip(ctxs, tokens, self._unstack(kv, len(ctxs)))):
      if t:
        alone = Context(kv=part, tokens=ctx.tokens, next_position=ctx.next_position)
        new, logits = self.extend(alone, t, logits=wanted[i], consume=True)
        part = new.kv
      parts.append(part)
      out.append(list(logits) if t and wanted[i] else [])
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *parts), out

  def batch(self, ctxs: Sequence[Context]) -> Batch:
    """The contexts on one stacked KV state, a batch slot each, to decode together and keep
    stacked between calls (graft.engine.batch.Batch: the state is split only when a slot
    leaves)."""
    return Batch(self, ctxs)

  def generate_batch(self, ctxs: Sequence[Context], max_new_tokens: int) -> list[list[int]]:
    """Greedy continuations of N contexts (each with its last logits), decoded together one
    token per slot per call (the tokens each context gets alone: see `decode_batch`); the
    contexts are not split back (`batch` keeps them for a caller that goes on)."""
    if len(ctxs) == 1:
      return [self.decode(ctxs[0], max_new_tokens).tokens]
    return [t for t, _ in self.batch(ctxs).decode([max_new_tokens] * len(ctxs), digests=False)]

  def decode_batch(self, ctxs: Sequence[Context], max_new_tokens: Sequence[int], *,
                   temperatures: Sequence[float] | None = None,
                   seeds: Sequence[int] | None = None,
                   stop: Callable[[list[int]], bool] | None = None,
                   sampler: str = sampling.SAMPLER) -> list['Decoded']:
    """`decode` of N contexts together on one stacked state, a batch slot each: slot i gets
    exactly what decode(ctxs[i], max_new_tokens[i], temperature=temperatures[i],
    seed=seeds[i], stop=stop) gets alone (tokens, logits digest, context), by extend_batch's
    slot invariance. A slot that has finished stays idle until every slot has; the contexts
    are split back once at the end (`batch` keeps them stacked for a caller that goes on)."""
    n = len(ctxs)
    if n == 1:  # one slot: the single stream's calls (its logits fused into the step)
      if temperatures is not None and len(temperatures) != 1 or seeds is not None and len(
          seeds) != 1 or len(max_new_tokens) != 1:
        raise ValueError('1 context needs 1 token limit, temperature and seed')
      if ctxs[0].last_logits is None:
        raise ValueError('every context needs logits at its last token')
      self._check_batch(ctxs, [[]], None)
      return [self.decode(ctxs[0], max_new_tokens[0],
                          temperature=temperatures[0] if temperatures else 0.0,
                          seed=seeds[0] if seeds else 0, stop=stop, sampler=sampler)]
    batch = self.batch(ctxs)
    drawn = batch.decode(max_new_tokens, temperatures=temperatures, seeds=seeds, stop=stop,
                         sampler=sampler)
    return [Decoded(context=c, tokens=t, logits_sha256=h)
            for c, (t, h) in zip(batch.contexts(), drawn)]

  def generate(self, ctx: Context, max_new_tokens: int, *, temperature: float = 0.0,
               seed: int = 0, stop_at_eos: bool = True) -> tuple[Context, list[int]]:
    """Greedy (temperature 0) or seeded sampling from the context's last logits. The returned
    context holds every generated token but the last (computing its KV would cost one more
    call that nothing needs unless the context is extended; extend it then)."""
    stop = (lambda tokens: tokens[-1] == EOS_ID) if stop_at_eos else None
    decoded = self.decode(ctx, max_new_tokens, temperature=temperature, seed=seed, stop=stop)
    return decoded.context, decoded.tokens

  def decode(self, ctx: Context, max_new_tokens: int, *, temperature: float = 0.0,
             seed: int = 0, stop: Callable[[list[int]], bool] | None = None,
             sampler: str = sampling.SAMPLER) -> 'Decoded':
    """`generate` that stops once `stop(tokens so far)` holds, and also returns the SHA-256 of
    the float32 logits every token was drawn from (the evidence a replay compares). `sampler`:
    how a temperature's draws are made (gemma_jax.sampling; LEGACY to replay an older
    manifest)."""
    if ctx.last_logits is None:
      raise ValueError('the context has no logits at its last token; extend it with '
                       "logits='last' first")
    draws = sampling.Draws(seed, sampler)
    new_tokens, digest = [], hashlib.sha256()
    while len(new_tokens) < max_new_tokens:
      if new_tokens:  # after the first step the context is this loop's own: update in place
        ctx, _ = self.extend(ctx, new_tokens[-1:], logits='last', consume=len(new_tokens) > 1)
      digest.update(np.ascontiguousarray(ctx.last_logits, np.float32).tobytes())
      new_tokens.append(sample(ctx.last_logits, temperature, draws))
      if stop is not None and stop(new_tokens):
        break
    return Decoded(context=ctx, tokens=new_tokens, logits_sha256=digest.hexdigest())

  def prefill(self, tokens: Sequence[int], *, logits: str = 'last',
              start_position: int = 0) -> tuple[Context, np.ndarray | None]:
    """A fresh context holding `tokens`.

    Args:
      tokens: the T token ids, the first at `start_position`.
      logits: 'last', 'all' or 'none', as for `extend`.
      start_position: the position of the first token.

    Returns:
      (the context, float32 logits [1, V] for 'last', [T, V] for 'all', None for 'none').
    """
    return self.extend(self.empty(start_position), tokens, logits=logits, consume=True)
