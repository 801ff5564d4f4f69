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
from typing import Any, Callable, Protocol, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import attention as attention_lib
from gemma_jax import compilation_cache, executables
from gemma_jax import kv_state as kvs
from gemma_jax import model
from gemma_jax import sampling
from gemma_jax import sharding
from gemma_jax.config import EOS_ID
from gemma_jax.model import Params
from gemma_jax.stored import Weight
from gemma_jax.weights import LoadedModel
from graft.engine import fingerprint, placement, plans
from graft.engine.batch import Batch
from graft.engine.config import EngineConfig, resolve_engine_config
from graft.engine.context import Context, Decoded, Place, call_inputs, sample
from graft.engine.shared import shared


class Compiled(Protocol):
  """An engine's jitted function (`jitted`, the jax.jit function): called like it, lowered like
  it, and asked to start obtaining its executable for some argument shapes ahead of the call."""

  jitted: Any

  def __call__(self, *args: Any) -> Any: ...

  def lower(self, *args: Any) -> Any:
    """The jitted function's lowering for these arguments (graft/engine/lowering.py)."""
    ...

  def preload(self, *args: Any, compile: bool = False) -> None:
    """Starts obtaining the executable for arguments of these shapes, in the background (with
    `compile`, compiling it where none is saved)."""
    ...


class Unsaved:
  """A jitted function as it is (no saved executables: `Compiled.preload` does nothing)."""

  def __init__(self, jitted: Any):
    self.jitted = jitted  # a jax.jit function

  def __call__(self, *args: Any) -> Any:
    return self.jitted(*args)

  def lower(self, *args: Any) -> Any:
    """The jitted function's lowering."""
    return self.jitted.lower(*args)

  def preload(self, *args: Any, compile: bool = False) -> None:
    """Nothing to obtain ahead: the call compiles."""
    del args, compile


class Engine:
  """Runs a loaded model under an EngineConfig, through its plan (graft.engine.plans)."""

  def __init__(self, loaded: LoadedModel, engine_config: EngineConfig | None = None, *,
               kernel_platform: str | None = None, checks: bool = True):
    """engine_config: what is asked for (None: the defaults), resolved here
    (`resolve_engine_config`: a resolved config resolves to itself). kernel_platform: the
    platform the attention kernel is built for ('cpu', 'gpu', 'tpu'; None: the default
    backend's). Naming one this host does not have gives an engine whose functions lower for
    that platform (graft/engine/lowering.py) but do not run. checks: whether the plan's checks
    run when the engine is built (the spec engine's self-check and canary,
    graft/engine/canary.py; False only for the canary's own engine, whose digest is its
    check)."""
    compilation_cache.use_default()  # before the engine compiles anything
    config = resolve_engine_config(loaded.config, engine_config)
    if sharding.xla_flags() != config.xla_flags:
      raise ValueError(f'the engine config needs XLA_FLAGS={config.xla_flags!r} but the process '
                       f'has {sharding.xla_flags()!r}; set it before starting Python')
    self.loaded = loaded
    self.model_config = loaded.config
    self.engine_config = config
    self.runs_checks = checks
    # On a mesh: parameters placed by the layout, the KV state over KV heads and sequences,
    # and (layout 'gather') every row-parallel projection's input gathered whole.
    self.mesh = sharding.make_mesh(sharding.parse_mesh(config.mesh)) if config.mesh else None
    self.plan = plans.plan_class(config.mode)(config, kernel_platform, self.mesh)
    self._attention_fn = attention_lib.build(plans.decided(config.attention),
                                             config.attention_tile, kernel_platform)
    head_dims = tuple(sorted({self.model_config.layer_spec(i).head_dim
                              for i in range(self.model_config.num_layers)}))
    self._kernel_blocks = self._attention_fn.blocks(head_dims, self.dtype)
    multiple = self._attention_fn.slot_multiple(head_dims, self.dtype)
    self._cache_slots = self.plan.cache_slots(multiple)
    self._local_slots = self.plan.local_slots(self.model_config, multiple)
    # (tiles read or None, with logits) -> jitted call, shared by the engines of this model and
    # config (an executable holds much memory once loaded: docs/performance.md, "The light
    # engine").
    self._held: list[Any] = []  # what this engine shares with others of its model (`shared`)
    self._steps: dict[tuple[int | None, bool], Compiled] = shared(
        self._held, loaded, ('steps', config, kernel_platform), dict)
    # The arithmetic with its kernel (on the mesh), and the form the weights are stored in.
    self.numerics = self.plan.running_numerics
    self.layout = self.plan.layout
    # Weights placed on the mesh and in their stored form (gemma_jax.stored: the native
    # kernels' panels, the output table; else as loaded), shared with every other engine of
    # this model that places and stores them alike.
    held_as = (config.mesh, config.mesh_layout, self.layout.storage)
    self._params = shared(self._held, loaded, ('params', held_as), lambda: placement.place_weights(
        loaded, self.model_config, self.layout, self.mesh, config.mesh_layout))
    abstract = isinstance(jax.tree.leaves(self._params)[0], jax.ShapeDtypeStruct)  # lowers only

    def head(params: Params, hidden: jax.Array, rows: jax.Array,
             count: jax.Array) -> jax.Array:
      # hidden [B, T, D], rows [R] -> logits [1, R, V] of those rows of the B x T rows (row
      # b * T + t: slot b's row t; gathered inside the jit, before the output table); count:
      # how many of the rows are wanted (the rest are padding, which a kernel may skip).
      # The run-time zero of the numerics' barriers: row indices are never negative.
      numerics = self.numerics.bind(dataclasses.replace(
          self.numerics.call, zero=(rows[0] < 0).astype(jnp.uint32), rows=count))
      with jax.default_matmul_precision(config.matmul_precision):
        flat = hidden.reshape(1, -1, hidden.shape[-1])
        return model.compute_logits(params, self.model_config, jnp.take(flat, rows, axis=1),
                                    numerics)

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

  def head_function(self) -> Compiled:
    """The jitted logits call (params, hidden [B, T, D], rows [R] of the B x T, count: the
    first rows wanted, int32) -> logits [1, R, V], against the embedding as stored (the tied
    table or the output table: `params`)."""
    return self._head

  @property
  def params(self) -> Params:
    """The engine's weights, placed and in their stored form (gemma_jax.stored): what its
    functions take first."""
    return self._params

  def step_function(self, tiles: int | None = None, with_logits: bool = False) -> Compiled:
    """The jitted transformer call (params, tokens [B, T], positions [B, T], kv) -> (hidden
    [B, T, D], kv[, logits [1, B T, V]]) whose attention reads the first `tiles` KV tiles (None:
    the whole cache). with_logits: a call that also returns the logits of all its rows (a
    decode step of one row per slot: the same ops as the call then the head, one dispatch
    instead of two).
    The weights (`params`) are an argument, never closed-over constants: a constant would be
    compiled into the executable (docs/performance.md says what that costs). The KV state is
    donated: XLA updates the cache in place; callers' contexts stay valid because a context that
    may be used again is copied first (see extend's `consume`)."""
    key = (tiles, with_logits)
    if key not in self._steps:
      attention_fn = self._attention_fn.reading(tiles)
      precision, numerics = self.engine_config.matmul_precision, self.numerics

      def step(params: Params, tokens: jax.Array, positions: jax.Array,
               kv: kvs.KVState) -> tuple:
        with jax.default_matmul_precision(precision):
          hidden, kv = model.forward(params, self.model_config, tokens, positions, kv,
                                     attention_fn, numerics)
        if not with_logits:
          return hidden, kv
        # Every row, from a value the compiler cannot know (fill is never negative, so the
        # first is 0; a constant, or a value it can prove non-negative, would let it fold the
        # head's run-time zero, and with it every barrier of the head).
        count = tokens.size
        rows = jnp.minimum(kv.fill[:1], 0) + jnp.arange(count, dtype=jnp.int32)
        return hidden, kv, self._head_fn(params, hidden, rows, jnp.int32(count))

      self._steps[key] = self._compiled(
          'step', jax.jit(step, donate_argnums=(3,), compiler_options=self.plan.compiler_options),
          tiles=tiles, with_logits=with_logits)
    return self._steps[key]

  def _preload(self) -> None:
    """Starts obtaining, in the background, the executables the plan names
    (`Plan.preloads`: by length, the calls every use of an engine makes), while the engine is
    checked and its caller gets on (gemma_jax.executables.Saved.preload)."""
    rows, i32 = self.max_rows, jnp.int32
    kv = jax.eval_shape(self.empty_kv)
    block, decode = (jax.ShapeDtypeStruct((1, t), i32) for t in (rows, 1))
    head_rows = self.plan.logits_calls(1)[0][1]
    calls = {
        'block': lambda: (self.step_function(None), (self._params, block, block, kv)),
        'head': lambda: (self._head, (
            self._params, jax.ShapeDtypeStruct((1, rows, self.model_config.embed_dim),
                                               self.dtype),
            jax.ShapeDtypeStruct((head_rows,), i32), jax.ShapeDtypeStruct((), i32))),
        'decode': lambda: (self.step_function(None, with_logits=True),
                           (self._params, decode, decode, kv)),
    }
    for name, compile in self.plan.preloads:
      function, args = calls[name]()
      function.preload(*args, compile=compile)

  def _compiled(self, name: str, jitted, **variant) -> Compiled:
    """`jitted`, its executables saved ahead of time and loaded by later processes
    (gemma_jax.executables), keyed by everything it closes over; as it is (`Unsaved`) on a mesh
    (its partitioned kernels hold Python callbacks, which XLA cannot serialize) and for another
    platform (graft/engine/lowering.py only lowers it)."""
    if self.mesh is not None or self._kernel_platform is not None:
      return Unsaved(jitted)
    key = {'engine': self.engine_config, 'model': self.model_config, 'dtype': self.loaded.dtype,
           'numerics': self.numerics, 'layout': self.layout, 'attention': self._attention_fn,
           'compiler_options': self.plan.compiler_options, **variant}
    return executables.Saved(name, jitted, key, fixed=1)

  @property
  def max_rows(self) -> int:
    """The most token rows one transformer call has."""
    return self.plan.max_rows

  @property
  def by_length(self) -> bool:
    """Whether the plan's calls have a fixed set of shapes whatever the lengths
    (`Plan.by_length`)."""
    return self.plan.by_length

  def _tiles_for(self, end: int) -> int | None:
    """Tiles the attention reads for a call whose last token has sequence index end - 1 (None:
    the whole cache), as the plan says (`Plan.tiles_read`)."""
    return self.plan.tiles_read(end, self._attention_fn.tile, self._cache_slots)

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
    return self._attention_fn.tile

  def projection_weights(self) -> dict[str, Weight]:
    """What a self-check probes: one weight per distinct projection shape contracted through a
    dot, and the output table, each as this engine stores it.

    Returns:
      As graft.engine.placement.projection_weights: {'<I>x<O>': [I, O] or its Panels
      [O / P, I, P], 'output_table': [D, V] or its Panels [V / P, D, P]}.
    """
    return placement.projection_weights(self.loaded, self.model_config, self.layout, self.mesh,
                                        self._params)

  @property
  def weights_key(self) -> tuple:
    """What decides `projection_weights`' names, shapes and forms (the model config, the dtype,
    the weight layout, whose kernel says whether it is partitioned over a mesh): a self-check's
    verdict is kept under it, so that a recorded pass is found without building the weights
    (gemma_jax.spec.selfcheck). Verdicts are kept on disk by its repr: whatever else comes to
    decide those weights must be added here."""
    return (self.model_config, self.loaded.dtype, self.layout)

  @property
  def dtype(self) -> np.dtype:
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
    kv = kvs.init_kv_state(self.model_config, batch_size=1, cache_len=self._cache_slots,
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
    ValueError, in the one-line words of `extend`, when the tokens do not fit the engine (the
    vocabulary, cache_len, the model's context), and when the rows do not cover the tokens."""
    rows = list(rows)
    tokens = tuple(self._check_fit(0, start_position, tokens))
    first = kvs.first_position(rows, start_position)
    if first != start_position:
      raise ValueError(f'the rows start at position {first}, not {start_position}')
    kv = kvs.assemble(jax.eval_shape(self.empty_kv), rows, len(tokens))
    if self.mesh is not None:
      kv = jax.device_put(kv, sharding.kv_shardings(kv, self.mesh))
    return Context(kv=kv, tokens=tokens, next_position=start_position + len(tokens))

  def _check_tokens(self, ctx: Place, tokens: Sequence[int]) -> list[int]:
    """`tokens` as ints, checked to extend `ctx` (`_check_fit`) and not empty."""
    if not len(tokens):
      raise ValueError('nothing to process: the token list is empty')
    return self._check_fit(len(ctx.tokens), ctx.next_position, tokens)

  def _check_fit(self, held: int, next_position: int, tokens: Sequence[int]) -> list[int]:
    """`tokens` as ints, after a context of `held` tokens whose next position is
    `next_position`; ValueError, in one line, for an id outside the vocabulary, a context past
    cache_len or positions past the model's context."""
    tokens = [int(t) for t in tokens]
    vocab = self.model_config.vocab_size
    for i, t in enumerate(tokens):
      if not 0 <= t < vocab:
        raise ValueError(f'token id {t} at index {i} is outside the vocabulary [0, {vocab})')
    if held + len(tokens) > self.engine_config.cache_len:
      raise ValueError(
          f'a context of {held} + {len(tokens)} tokens does not fit the cache of '
          f'{self.engine_config.cache_len} slots; raise cache_len')
    if next_position + len(tokens) > self.model_config.max_context:
      raise ValueError(f'positions up to {next_position + len(tokens) - 1} exceed '
                       f'{self.model_config.name}\'s context of {self.model_config.max_context}')
    return tokens

  def _logits(self, hidden: jax.Array, rows: list[int]) -> list[np.ndarray]:
    """float32 logits [V] of the given rows of one call's hidden states [B, T, D] (row
    b * T + t: slot b's row t), in the logits calls the plan cuts them into
    (`Plan.logits_calls`), each padded to its row count."""
    out: list[np.ndarray] = []
    for count, padded_rows in self.plan.logits_calls(len(rows)):
      padded = np.zeros(padded_rows, np.int32)
      padded[:count] = rows[len(out):len(out) + count]
      out.extend(sharding.to_host(self._head(self._params, hidden, padded,
                                             np.int32(count)))[0, :count])
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
    named = {'none': 0, 'last': 1, 'all': len(tokens)}
    wanted = named.get(logits, logits) if isinstance(logits, str) else logits
    if not isinstance(wanted, int) or not 0 <= wanted <= len(tokens):
      raise ValueError(f"logits must be 'none', 'last', 'all' or a row count in "
                       f'[0, {len(tokens)}], not {logits!r}')
    first_wanted = len(tokens) - wanted
    kv = ctx.kv if consume else jax.tree.map(jnp.copy, ctx.kv)
    logit_rows: list[np.ndarray] = []
    for call in self.plan.calls(len(ctx.tokens), len(tokens), first_wanted):
      # One transformer call as the plan cut it: `lead` padding rows, the tokens, padding.
      ids, positions = call_inputs([tokens[call.first:call.first + call.count]],
                                   [ctx.next_position + call.first], call.rows, call.lead)
      wanted_rows = [j - call.first + call.lead
                     for j in range(max(call.first, first_wanted), call.first + call.count)]
      end = len(ctx.tokens) + call.first + call.count  # the context's length after it
      out = self.step_function(self._tiles_for(end), call.with_logits)(
          self._params, ids, positions, kv)
      kv = out[1]
      if call.with_logits:  # one row, its logits computed by the step itself
        logit_rows.extend(sharding.to_host(out[2])[0, :len(wanted_rows)])
      else:
        logit_rows.extend(self._logits(out[0], wanted_rows))
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
    self.plan.check_batch()
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

  def _extend_stacked(self, kv: kvs.KVState, ctxs: Sequence[Place], tokens: list[list[int]],
                      wanted: list[int]) -> tuple[kvs.KVState, list[list[np.ndarray]]]:
    """extend_batch on a stacked state (donated), in the batch calls the plan cuts the request
    into (`Plan.batch_calls`): -> (the new stacked state, each slot's list of logits rows).
    Only the contexts' lengths and positions are read."""
    out: list[list[np.ndarray]] = [[] for _ in ctxs]
    for call in self.plan.batch_calls([len(t) for t in tokens]):
      if call.alone:
        return self._extend_slots_alone(kv, ctxs, tokens, wanted)
      chunks = [t[call.first:call.first + call.count] for t in tokens]
      ids, positions = call_inputs(chunks, [c.next_position + call.first for c in ctxs],
                                   call.rows)
      end = max(len(c.tokens) + min(call.first + call.count, len(t))
                for c, t in zip(ctxs, tokens))
      step = self.step_function(self._tiles_for(end), call.with_logits)
      result = step(self._params, ids, positions, kv)
      kv = result[1]
      # Every slot's wanted rows (row i * rows + j: slot i's row j).
      flat = [(i, i * call.rows + j - call.first) for i, chunk in enumerate(chunks)
              for j in range(max(call.first, len(tokens[i]) - wanted[i]),
                             call.first + len(chunk))]
      if call.with_logits:  # one row per slot, its logits computed by the step itself
        logits = sharding.to_host(result[2])[0]
        rows = [logits[r] for _, r in flat]
      else:
        rows = self._logits(result[0], [r for _, r in flat])
      for (i, _), row in zip(flat, rows):
        out[i].append(row)
    return kv, out

  def _extend_slots_alone(self, kv: kvs.KVState, ctxs: Sequence[Place], tokens: list[list[int]],
                          wanted: list[int]) -> tuple[kvs.KVState, list[list[np.ndarray]]]:
    """`_extend_stacked` slot by slot through `extend` on the slot's part of the stacked state
    (the single-stream calls: no executable of their own)."""
    parts, out = [], []
    for i, (ctx, t, part) in enumerate(zip(ctxs, tokens, self._unstack(kv, len(ctxs)))):
      rows: list[np.ndarray] = []
      if t:
        alone = Context(kv=part, tokens=ctx.tokens, next_position=ctx.next_position)
        new, logits = self.extend(alone, t, logits=wanted[i], consume=True)
        part = new.kv
        rows = [] if logits is None else list(logits)
      parts.append(part)
      out.append(rows)
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
    return [Decoded(context=c, tokens=t, logits_sha256=h or '')  # (digests: every h is made)
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
    last = _last_logits(ctx)
    draws = sampling.Draws(seed, sampler)
    new_tokens: list[int] = []
    digest = hashlib.sha256()
    while len(new_tokens) < max_new_tokens:
      if new_tokens:  # after the first step the context is this loop's own: update in place
        ctx, _ = self.extend(ctx, new_tokens[-1:], logits='last', consume=len(new_tokens) > 1)
        last = _last_logits(ctx)
      digest.update(np.ascontiguousarray(last, np.float32).tobytes())
      new_tokens.append(sample(last, temperature, draws))
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


def _last_logits(ctx: Context) -> np.ndarray:
  """The context's logits at its last token: float32 [V]; ValueError where it has none."""
  if ctx.last_logits is None:
    raise ValueError("the context has no logits at its last token; extend it with logits='last' "
                     'first')
  return ctx.last_logits
