"""Engine modes as plans: how a request is cut into calls, with which numerics and attention.

A plan is everything an engine mode decides; `Engine` asks its plan and never branches on a
mode's name. Adding a mode is one `Plan` subclass here and one entry in `PLANS`.

  spec     the written arithmetic (docs/determinism.md, gemma_jax/spec): pinned's calls, and
           every value a stated sequence of IEEE binary32 operations (gemma_jax.numerics.Spec), so
           that a NumPy interpreter computes the same bits. The engine checks this machine against
           the spec when it is built (gemma_jax.spec.selfcheck) and refuses the mode, naming the
           probe, where it does not compute them; its fingerprint binds the spec and what the
           spec depends on (chunk, tile, rows per call, dtype, model), not the machine, so
           artifacts and stores move between machines that pass the check.
  pinned   fixed reduction orders (gemma_jax.numerics.FixedOrder): Eigen dots over contraction
           chunks, tree sums, fusion barriers, tiled attention reading only the tiles that hold
           the context. A call has 1 row (a decode step, its logits fused into the same
           computation) or a row bucket (min_rows, 2 min_rows, ..., rows_per_call) with padding
           rows (position EMPTY: masked everywhere, writing nothing) after its tokens. A token's
           KV and logits are a pure function of the tokens up to it, whatever the split.
  blocked  the first pinned design, kept bit-identical so its results and manifests replay:
           every call has exactly rows_per_call (16) rows, aligned to the sequence (token j in
           row j mod B; padding rows before the first token of a call that continues a context
           mid-block); XLA's own numerics; attention over the whole cache buffer.
  default  the plain fast path: one call per request padded to the next power of two (XLA sees
           whatever M the request has), logits for the requested rows in one call, local
           layers over the full cache. It shows what pinning buys.

docs/determinism.md has the measurements each plan rests on.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, ClassVar, TypeVar

import jax
from absl import logging
from jax.sharding import Mesh

from gemma_jax import kv_state as kvs
from gemma_jax.config import TransformerConfig
from gemma_jax.kernels import DotKernel, native_build, native_dot
from gemma_jax.numerics import XLA, CallBundle, FixedOrder, Numerics, Spec as SpecNumerics
from gemma_jax.stored import AS_LOADED, WeightLayout
from gemma_jax.sizes import next_power_of_two, round_up
from gemma_jax.spec import selfcheck
from gemma_jax.spec.interpreter import ROPE_MODES
from graft.engine import canary, fingerprint

if TYPE_CHECKING:  # config.py and _engine.py read the plans; the plans only name their classes
  from graft.engine._engine import Engine
  from graft.engine.config import EngineConfig

# The version of how tokens are laid out in calls and cache slots (2: token j in slot j, mod the
# ring on local layers; blocked calls aligned to the sequence). Every fingerprint records it; a
# change of layout must bump it, so that KV computed under the old one is refused.
SLOT_LAYOUT_VERSION = 2

# What computes a fixed-order plan's dots -> the XLA:CPU debug options passed to its every
# compilation (so its numerics do not depend on the process's XLA_FLAGS defaults). Mode spec
# only: 'native', the spec's contractions as our own CPU kernels (gemma_jax.kernels.native_dot:
# FMA chains by construction on every instruction set and thread count); 'pallas', the spec's
# dot as a Pallas kernel (gemma_jax.kernels.spec_dot, for accelerators). Both leave no library
# dot in the engine's functions.
DOT_LIBRARIES = {'eigen': {'xla_cpu_experimental_ynn_fusion_type': ''}, 'ynn': {}, 'pallas': {},
                 'native': {}}


_T = TypeVar('_T')


def decided(value: _T | None) -> _T:
  """A field of a resolved engine config (graft.engine.config.resolve_engine_config decides
  every one a plan reads); ValueError where it was left undecided."""
  if value is None:
    raise ValueError('an engine config field is undecided: resolve it first '
                     '(graft.engine.resolve_engine_config)')
  return value


# A cache of at most this many slots is read whole by every call of a tiled attention (one
# executable per call shape, not one per tile count: the tiny models of the tests); a larger one
# reads the tiles that hold the context. Neither changes a bit (`Plan.tiles_read`).
WHOLE_CACHE_SLOTS = 1024

# The most rows of a spec engine's logits call (more wanted rows take several calls).
HEAD_ROWS = 16


@dataclasses.dataclass(frozen=True)
class Call:
  """One transformer call of a request: `count` tokens from index `first` of the request's
  tokens, after `lead` padding rows, in a call of `rows` rows. with_logits: the call computes
  its rows' logits in the same computation (a decode step of one row)."""

  first: int
  count: int
  lead: int
  rows: int
  with_logits: bool = False


@dataclasses.dataclass(frozen=True)
class BatchCall:
  """One call of a batched request (`Engine.extend_batch`): tokens [first, first + count) of
  every slot, in `rows` rows per slot. with_logits: the call computes its rows' logits in the
  same computation (a decode step of one row per slot). alone: the request instead runs slot
  by slot through the single-stream calls (this call stands for all of them)."""

  first: int = 0
  count: int = 0
  rows: int = 0
  with_logits: bool = False
  alone: bool = False


def row_buckets(rows_per_call: int, min_rows: int) -> tuple[int, ...]:
  """Row counts a fixed-order call may have: 1, then min_rows doubling, and rows_per_call."""
  buckets, rows = {1, rows_per_call}, min_rows
  while rows < rows_per_call:
    buckets.add(rows)
    rows *= 2
  return tuple(sorted(buckets))


@dataclasses.dataclass(frozen=True)
class Plan:
  """The interface, with the default plan's answers. A plan is made from a resolved
  EngineConfig (graft.engine.config.resolve_engine_config), the platform its kernels are built
  for (None: the default backend's) and the engine's mesh, and decides nothing of the config
  again.

  byte_exact: a token's KV and logits do not depend on how the request was cut (grafts are
  byte-exact; the store needs it). batch_slots: a slot of a batched call gets the bits it gets
  alone (`Engine.extend_batch`)."""

  name: ClassVar[str] = 'default'
  default_rows: ClassVar[int] = 256
  default_attention: ClassVar[str] = 'xla'
  byte_exact: ClassVar[bool] = False
  batch_slots: ClassVar[bool] = False
  dot_libraries: ClassVar[tuple[str, ...]] = ()  # XLA's own dots, as the process's flags choose
  engine_config: 'EngineConfig'
  kernel_platform: str | None = None
  mesh: Mesh | None = None  # the engine's devices (None: one)

  def __post_init__(self) -> None:
    if not self.engine_config.resolved:
      raise ValueError(f'a plan runs a resolved engine config (resolve_engine_config), not '
                       f'{self.engine_config}')

  @property
  def rows_per_call(self) -> int:
    """The resolved config's rows_per_call."""
    return decided(self.engine_config.rows_per_call)

  @property
  def dot_library(self) -> str | None:
    """The resolved config's dot library (None: XLA's own dots, as the process chooses)."""
    return self.engine_config.dot_library

  @classmethod
  def check(cls, config: 'EngineConfig') -> None:
    """Raises ValueError, with the reason, for a config this plan cannot run."""

  @classmethod
  def default_dot_library(cls, platform: str | None = None) -> str | None:
    """The dot library of a config that names none, on `platform` (None: the default
    backend's); None for a plan without a choice of them."""
    del platform
    return None

  @property
  def numerics(self) -> Numerics:
    """The arithmetic, as the fingerprint names it (no kernel, unbound)."""
    return XLA

  @property
  def gathering_mesh(self) -> Mesh | None:
    """The mesh on which every row-parallel projection's input is gathered whole (the 'gather'
    layout's; None: one device, or the 'split' layout)."""
    return self.mesh if self.engine_config.mesh_layout == 'gather' else None

  @functools.cached_property
  def kernel(self) -> DotKernel | None:
    """The dot kernel the arithmetic's contractions run through on the plan's platform and mesh
    (None: XLA's own dots). It decides no bit."""
    return None

  @functools.cached_property
  def running_numerics(self) -> Numerics:
    """The arithmetic as the engine runs it: with its kernel, and the mesh its calls bind."""
    return dataclasses.replace(self.numerics, kernel=self.kernel,
                               call=CallBundle(mesh=self.gathering_mesh))

  @functools.cached_property
  def layout(self) -> WeightLayout:
    """How the engine stores its weights (gemma_jax.stored): here as loaded."""
    return AS_LOADED

  @property
  def by_length(self) -> bool:
    """Whether the plan's calls have one of two shapes whatever the lengths met (a decode step,
    or rows_per_call rows whose padding is not computed) and attention reads the whole cache:
    a byte-exact plan whose kernel computes attention whole (`DotKernel.attends`), so that its
    work follows a call's run-time length. A fixed set of executables."""
    return self.byte_exact and self.kernel is not None and self.kernel.attends

  @property
  def compiler_options(self) -> dict | None:
    """XLA options of every compilation (None: the process's)."""
    return None

  @property
  def max_rows(self) -> int:
    """The most token rows one transformer call has."""
    return self.engine_config.cache_len

  def cache_slots(self, multiple: int) -> int:
    """KV slots of global layers, given the attention's slot multiple."""
    return self.engine_config.cache_len

  def local_slots(self, model_config: TransformerConfig, multiple: int) -> int | None:
    """KV slots of local (sliding-window) layers (None: as many as global layers)."""
    return None

  def calls(self, done: int, num_tokens: int, first_wanted: int | None = None) -> list[Call]:
    """The calls of a request of `num_tokens` tokens after `done` tokens of context, of which
    those from index `first_wanted` on need their logits (None: none do)."""
    wanted = num_tokens if first_wanted is None else first_wanted
    return [dataclasses.replace(call, with_logits=self._fused(call, wanted))
            for call in self._cut(done, num_tokens)]

  def _cut(self, done: int, num_tokens: int) -> list[Call]:
    """`calls` before logits are fused: one call per request padded to the next power of two."""
    del done
    rows = max(num_tokens, min(next_power_of_two(num_tokens), self.engine_config.cache_len))
    return [Call(0, num_tokens, 0, rows)]

  def _fused(self, call: Call, first_wanted: int) -> bool:
    """Whether `call` computes its logits in its own computation (never, here)."""
    del call, first_wanted
    return False

  def tiles_read(self, end: int, tile: int | None, cache_slots: int) -> int | None:
    """The KV tiles a call's attention reads when the context will hold `end` tokens after it
    (None: the whole cache). tile: the attention's KV tile (None: it has none)."""
    del end, tile, cache_slots
    return None

  def logits_calls(self, wanted: int) -> list[tuple[int, int]]:
    """How `wanted` rows' logits are computed: per logits call, (the wanted rows it computes,
    the rows it has, padding after them). Here one call of exactly the wanted rows."""
    return [(wanted, wanted)] if wanted else []

  @property
  def preloads(self) -> tuple[tuple[str, bool], ...]:
    """The executables an engine starts obtaining in the background when it is built, as
    (call, whether to compile it where none is saved): 'block' (rows_per_call rows), 'head' (a
    logits call) and 'decode' (one row, its logits fused). None here."""
    return ()

  def check_batch(self) -> None:
    """Raises ValueError, with the reason, where a call cannot hold several batch slots."""
    if not self.batch_slots:
      raise ValueError(f'batch slots need a plan whose bits do not see the other slots '
                       f'(pinned, spec); this engine is {self.name!r}')

  def batch_calls(self, lengths: list[int]) -> list[BatchCall]:
    """The calls of a batched request giving slot i lengths[i] tokens (plans with
    batch_slots)."""
    del lengths
    self.check_batch()
    return []

  def check_engine(self, engine: 'Engine') -> None:
    """Raises ValueError, with the reason, when this plan cannot run on the engine's model and
    this machine (called once the engine is built)."""

  def fingerprint(self, engine: 'Engine') -> dict:
    """What names the engine's bits: {'sha256', and what went into it}. Every plan but spec binds
    the whole config and this machine's environment (their bits follow the compiler's choices
    there)."""
    return fingerprint.engine_fingerprint(
        self.engine_config, engine.loaded.dtype, slot_layout_version=SLOT_LAYOUT_VERSION,
        kernel_blocks=engine.kernel_blocks, plan={'numerics': self.numerics.describe()})


@dataclasses.dataclass(frozen=True)
class _Shaped(Plan):
  """Calls of at most rows_per_call rows, logits a fixed number of rows at a time, local layers
  on a ring just big enough for the largest call: what the byte-exact plans share."""

  byte_exact: ClassVar[bool] = True

  @property
  def max_rows(self) -> int:
    return self.rows_per_call

  def local_slots(self, model_config: TransformerConfig, multiple: int) -> int | None:
    # In whole kernel tiles, so the kernel never pads the cache.
    return round_up(kvs.local_slots_needed(model_config, self.max_rows), multiple)

  @property
  def head_rows(self) -> tuple[int, ...]:
    """The row counts a logits call may have, ascending: wanted rows go in calls of the
    smallest that holds them (at most the largest), padded."""
    return (self.engine_config.logits_rows,)

  def logits_calls(self, wanted: int) -> list[tuple[int, int]]:
    buckets = self.head_rows
    out = []
    for first in range(0, wanted, buckets[-1]):
      count = min(buckets[-1], wanted - first)
      out.append((count, next(r for r in buckets if r >= count)))
    return out


@dataclasses.dataclass(frozen=True)
class Blocked(_Shaped):
  """The first pinned design, kept bit-identical so its manifests replay: every call exactly
  rows_per_call rows aligned to the sequence, XLA's numerics, attention over the whole cache."""

  name: ClassVar[str] = 'blocked'
  default_rows: ClassVar[int] = 16

  @classmethod
  def check(cls, config: 'EngineConfig') -> None:
    if config.attention == 'tiled':
      raise ValueError("the blocked engine reduces over the whole cache: attention 'xla' or "
                       "'pallas'")

  def _cut(self, done: int, num_tokens: int) -> list[Call]:
    # Blocks aligned to the sequence: the token with sequence index j always sits in row
    # j mod B, whatever the calls before (the first block may start with padding rows).
    b = self.rows_per_call
    out = []
    for start in range(-(done % b), num_tokens, b):
      first = max(start, 0)
      out.append(Call(first, min(start + b, num_tokens) - first, first - start, b))
    return out


@dataclasses.dataclass(frozen=True)
class Pinned(_Shaped):
  """Fixed reduction orders (numerics.FixedOrder): calls of one row or a row bucket, padding
  after the tokens, the tiled attention reading the tiles that hold the context."""

  name: ClassVar[str] = 'pinned'
  default_attention: ClassVar[str] = 'tiled'
  batch_slots: ClassVar[bool] = True
  dot_libraries: ClassVar[tuple[str, ...]] = ('eigen', 'ynn')

  @classmethod
  def default_dot_library(cls, platform: str | None = None) -> str | None:
    del platform
    return 'eigen'

  @property
  def numerics(self) -> FixedOrder:
    return FixedOrder(k_chunk=self.engine_config.k_chunk)

  @functools.cached_property
  def layout(self) -> WeightLayout:
    return WeightLayout(self.kernel, self.numerics.small)

  @property
  def dot_library(self) -> str:
    return decided(self.engine_config.dot_library)

  @property
  def compiler_options(self) -> dict | None:
    return DOT_LIBRARIES[self.dot_library] or None

  def cache_slots(self, multiple: int) -> int:
    return round_up(self.engine_config.cache_len, multiple)

  def rows_for(self, num_tokens: int) -> int:
    """The smallest row bucket that holds `num_tokens` tokens (one row for one token)."""
    buckets = row_buckets(self.rows_per_call, self.engine_config.min_rows)
    return next(r for r in buckets if r >= num_tokens)

  def _cut(self, done: int, num_tokens: int) -> list[Call]:
    # At most rows_per_call tokens per call, padding after them; no alignment to the sequence
    # is needed. By length: a call is one row (a decode step) or rows_per_call rows, whatever
    # its token count (its padding rows are not computed).
    del done
    b = self.rows_per_call
    out = []
    for first in range(0, num_tokens, b):
      count = min(b, num_tokens - first)
      out.append(Call(first, count, 0,
                      (1 if count == 1 else b) if self.by_length else self.rows_for(count)))
    return out

  def _fused(self, call: Call, first_wanted: int) -> bool:
    # A one-row call with logits computes them in the step itself; by length every one-row
    # call is the decode step (one executable, logits or not).
    return (self.engine_config.logits_rows == 1 and call.rows == 1
            and (call.first + call.count > first_wanted or self.by_length))

  def tiles_read(self, end: int, tile: int | None, cache_slots: int) -> int | None:
    # The tiles holding slots 0 .. end - 1, rounded up to a power of two (fewer compiled
    # shapes); reading more tiles than a row sees does not change its bits
    # (gemma_jax.tiled_attention). By length the kernel reads what the context fills; a cache
    # of at most WHOLE_CACHE_SLOTS slots is read whole, which costs less than an executable per
    # tile count.
    if self.by_length or tile is None or cache_slots <= WHOLE_CACHE_SLOTS:
      return None
    return min(next_power_of_two(-(-end // tile)), cache_slots // tile)

  @property
  def preloads(self) -> tuple[tuple[str, bool], ...]:
    # By length: a block and a logits call, loaded or compiled, and a decode step, loaded
    # where saved (gemma_jax.executables.Saved.preload).
    return (('block', True), ('head', True), ('decode', False)) if self.by_length else ()

  def batch_calls(self, lengths: list[int]) -> list[BatchCall]:
    """The calls of a batched request giving slot i lengths[i] tokens. By length: one decode
    step of a row per slot (one executable per slot count) where every slot has at most one
    token, else the slots one by one. Else calls of rows_per_call tokens, each of the smallest
    row bucket that holds every slot's part and gives the call at least min_rows rows in all
    (one row per slot when there are min_rows slots or more)."""
    longest = max(lengths)
    if self.by_length:
      return [BatchCall(0, 1, 1, with_logits=True)] if longest == 1 else [BatchCall(alone=True)]
    b, least = self.rows_per_call, -(-self.engine_config.min_rows // len(lengths))
    return [BatchCall(first, b, self.rows_for(max(max(min(b, n - first) for n in lengths),
                                                  least)))
            for first in range(0, longest, b)]

  def check_engine(self, engine: 'Engine') -> None:
    """Refuses a configuration (device count, threads, flags) where a row's dot follows its
    call's row count: a graft would then differ from fresh (gemma_jax.spec.selfcheck)."""
    selfcheck.run_rows(engine.numerics.bind(CallBundle()), self.compiler_options,
                       weights=engine.projection_weights, weights_key=engine.weights_key,
                       rows=row_buckets(self.rows_per_call,
                                        self.engine_config.min_rows))


@dataclasses.dataclass(frozen=True)
class Spec(Pinned):
  """The written arithmetic (numerics.Spec): pinned's calls, every value a stated sequence of
  binary32 operations; checked against the spec when an engine is built (self-check, canary)."""

  name: ClassVar[str] = 'spec'
  dot_libraries: ClassVar[tuple[str, ...]] = tuple(DOT_LIBRARIES)

  @classmethod
  def check(cls, config: 'EngineConfig') -> None:
    if config.attention not in (None, 'tiled'):
      raise ValueError(f"the spec engine's attention is the tiled one (its sums are the "
                       f"spec's); not {config.attention!r}")
    if config.mesh and config.mesh_layout != 'gather':
      raise ValueError('the spec engine never splits a contraction: mesh layout gather')

  @classmethod
  def default_dot_library(cls, platform: str | None = None) -> str | None:
    return kernel_library(platform) or 'eigen'

  @property
  def numerics(self) -> SpecNumerics:
    return SpecNumerics(k_chunk=self.engine_config.k_chunk)

  @property
  def head_rows(self) -> tuple[int, ...]:
    # By length: one logits call shape, HEAD_ROWS rows, whatever the number wanted. Else the
    # self-check proves every one of these row counts computes a row's logits as the spec
    # does, so a logits call may hold the wanted rows of several slots or tokens at once (one
    # pass over the output table for all of them) without changing a bit.
    if self.by_length:
      return (HEAD_ROWS,)
    return tuple(sorted({self.engine_config.logits_rows,
                         *row_buckets(HEAD_ROWS, self.engine_config.min_rows)}))

  @functools.cached_property
  def kernel(self) -> DotKernel | None:
    library = self.dot_library
    kernel: DotKernel
    if library == 'native':
      kernel = native_dot.make_native_dot()
    elif library == 'pallas':
      from gemma_jax.kernels import spec_dot  # deferred: Pallas, imported only where it runs
      kernel = spec_dot.make_spec_dot(platform=self.kernel_platform)
    else:
      return None
    return kernel.on_mesh(self.gathering_mesh)

  @functools.cached_property
  def layout(self) -> WeightLayout:
    # The logits read the output table (the transposed embedding); projections and the table
    # in the kernel's panels where it keeps them.
    return WeightLayout(self.kernel, self.numerics.small, output_table=True)

  def check_engine(self, engine: 'Engine') -> None:
    if not engine.runs_checks:  # the canary's own engine: the canary's digest is its check
      return
    if engine.loaded.dtype != 'float32':
      raise ValueError(f'the written arithmetic (spec version {SpecNumerics.version}) is '
                       f'float32; this model is {engine.loaded.dtype}')
    cfg = engine.model_config
    if cfg.rope_mode not in ROPE_MODES:
      raise ValueError(f'the spec engine runs RoPE modes {ROPE_MODES}, not {cfg.rope_mode!r}')
    # with its dot kernel, off the mesh
    numerics = dataclasses.replace(self.numerics, kernel=engine.numerics.kernel)
    head_dims = tuple(sorted({cfg.layer_spec(i).head_dim for i in range(cfg.num_layers)}))
    groups = {cfg.num_heads // cfg.layer_spec(i).num_kv_heads for i in range(cfg.num_layers)}
    # The row counts its calls have: by length, a decode step's and a block's (fewer real rows
    # compute the same chains), and one logits call's; else every bucket.
    rows_per_call, min_rows = self.rows_per_call, self.engine_config.min_rows
    rows = (1, rows_per_call) if self.by_length else row_buckets(rows_per_call, min_rows)
    try:
      selfcheck.run(numerics, self.compiler_options, weights=engine.projection_weights,
                    weights_key=engine.weights_key, rows=rows,
                    head_rows=self.head_rows,
                    # (two rows: the relative mode's per-row scores, numerics.row_scores)
                    attention_rows=tuple(sorted({max(r * g, 2) for r in rows for g in groups}
                                                | {2})),
                    head_dims=head_dims, tile=decided(engine.attention_tile),
                    kv_heads=max(cfg.layer_spec(i).num_kv_heads for i in range(cfg.num_layers)),
                    groups=max(groups), softcap=cfg.attn_logits_softcap,
                    relative=_relative_rope(cfg))
    except selfcheck.SpecError as e:
      if self.dot_library in ('pallas', 'native') or not e.in_dots_only:
        raise
      # Where a library's dots are not FMA chains (XLA:CPU's Eigen on AVX2 machines without
      # AVX-512, docs/determinism.md), the spec dot kernel is, by construction.
      raise selfcheck.SpecError(f'{e}; --dot_library=native computes every dot with the spec '
                                "engine's own kernels (sequential FMA by construction)",
                                e.failures) from None
    # The canary, in an engine of its own, of this one's classes.
    canary.check(self.numerics.version, canary.model_for(cfg), self.dot_library,
                 type(engine), type(self.engine_config))

  def fingerprint(self, engine: 'Engine') -> dict:
    """What decides the bits of the written arithmetic, and not the source code: a release that
    moves no bit keeps every artifact and store; one that moves a bit must bump the spec
    version, which the self-check and the canary enforce (graft/engine/canary.py;
    docs/security.md). The cache length is left out: it decides no bit (tests/test_spec.py)."""
    version = self.numerics.version
    parts = {'mode': self.name, 'numerics': self.numerics.describe(),
             'attention': 'tiled', 'attention_tile': engine.attention_tile,
             'rows_per_call': self.rows_per_call, 'dtype': engine.loaded.dtype,
             'slot_layout_version': SLOT_LAYOUT_VERSION, 'rope': engine.model_config.rope_mode,
             'canary': canary.EXPECTED.get(version, {}).get(canary.model_for(engine.model_config))}
    return {'sha256': fingerprint.digest(parts), **parts,
            'made_on': fingerprint.environment()}


def _relative_rope(cfg: TransformerConfig) -> tuple | None:
  """(base, scale, rotary fraction) of the first layer's RoPE where the model runs the relative
  mode (what the self-check probes the kernel's turned scores with), else None."""
  if cfg.rope_mode != 'relative':
    return None
  spec = cfg.layer_spec(0)
  return (spec.rope_base, spec.rope_scale, spec.rotary_fraction)


def kernel_library(platform: str | None = None) -> str | None:
  """The dot library whose contractions are the spec's chains by construction on `platform`
  (None: this process's backend): 'native' (our CPU kernels) on a CPU, 'pallas' on an
  accelerator; None on a CPU where the native kernels cannot be built (no compiler, or a build
  that fails; said once, in one line: Eigen's dots then run, with the self-check deciding)."""
  if (platform or jax.default_backend()) != 'cpu':
    return 'pallas'
  reason = native_unavailable()
  if reason:
    _warn_once(f"{reason.rstrip('.')}: computing on Eigen's dots (the self-check decides)")
    return None
  return 'native'


def native_unavailable() -> str | None:
  """Why the native kernels cannot be built (or found built) here, in one line; None where they
  can (building them on first use: gemma_jax.kernels.native_build)."""
  try:
    native_build.library()
  except native_build.BuildError as e:
    return str(e)
  return None


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
  logging.warning('%s', message)


# name -> the plan of that engine mode.
PLANS: dict[str, type[Plan]] = {p.name: p for p in (Spec, Pinned, Blocked, Plan)}


def plan_class(mode: str) -> type[Plan]:
  """The plan of engine mode `mode` (ValueError naming the modes otherwise)."""
  if mode not in PLANS:
    raise ValueError(f'unknown engine mode {mode!r}; expected one of {tuple(PLANS)}')
  return PLANS[mode]
