"""The self-check: does this machine's XLA compute the written arithmetic, in this process's
configuration (device count, threads, XLA flags)?

A spec engine runs it at construction (graft.engine.plans.Spec) on probes of what it will compute:
every elementwise function of the spec on fixed inputs, and every contraction shape the engine
meets (each projection's weight, with every row count a call may have; the logits' output table;
attention's per-tile dots for every row count), each compared bit for bit with
gemma_jax.spec.binary32 on a sample of output rows and columns. A machine whose XLA picks another
summation order, another reciprocal square root or another exp is refused, with the probe that
failed, never trusted. A pinned engine runs the weaker check its exactness rests on
(`run_rows`: a row's dot does not follow its call's row count). Results are kept per process for
each set of probes.
"""

from __future__ import annotations

import os
from typing import Callable, Hashable

import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import host, rope, sharding, verdicts
from gemma_jax.numerics import FixedOrder, Numerics, Spec, flush_in_code
from gemma_jax.sharding import to_host
from gemma_jax.spec import binary32 as b32
from gemma_jax.spec import functions as fn
from gemma_jax.spec.interpreter import Interpreter, tiled_attention
from gemma_jax.stored import Panels, Weight, WeightLayout
from gemma_jax.tiled_attention import TiledAttention


class SpecError(ValueError):
  """This machine (in this configuration) does not compute the written arithmetic; `failures`
  names each probe that differs."""

  def __init__(self, message: str, failures: tuple[str, ...] = ()):
    super().__init__(message)
    self.failures = tuple(failures)

  @property
  def in_dots_only(self) -> bool:
    """Whether only contractions differ (what a dot kernel of the spec's order replaces)."""
    return bool(self.failures) and all(f.startswith(('matmul ', 'attention '))
                                       for f in self.failures)


class RowDependenceError(ValueError):
  """In this configuration a row's dot depends on how many rows its call has."""


def _inputs(seed: int, shape, scale: float = 1.0) -> np.ndarray:
  """float32 values built from integers by exact operations (the same on every machine), with
  zeros of both signs among them."""
  rng = np.random.default_rng(seed)
  x = (rng.integers(-2 ** 20, 2 ** 20, size=shape).astype(np.float32)
       / np.float32(2 ** 20) * np.float32(scale)).astype(np.float32)
  flat = x.reshape(-1)
  flat[:3] = [0.0, -0.0, 0.0]
  return x


def _columns(n: int) -> np.ndarray:
  """Output columns compared: the first, middle and last few (edge tiles take other paths)."""
  return np.unique(np.r_[0:min(8, n), max(n // 2 - 4, 0):n // 2 + 4, max(n - 8, 0):n])


def _bits(x) -> np.ndarray:
  return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.int32)


def _differ(name: str, got, want, against: str = 'the spec') -> str | None:
  got, want = _bits(got), _bits(want)
  if np.array_equal(got, want):
    return None
  return f'{name}: {np.mean(got != want):.1%} of the checked outputs differ from {against}'


def elementwise_failures(numerics: Spec, compiler_options: dict | None) -> list[str]:
  """The spec's functions through the engine's numerics against binary32."""
  x = np.concatenate([_inputs(1, (4096,), s) for s in (0.05, 1.0, 6.0, 40.0)]
                     + [np.asarray([0.624, 0.625, -0.625, 87.5, -87.5, 89.0, -89.0], np.float32)])
  angles = (np.arange(4096, dtype=np.float32) * np.float32(37.25)).astype(np.float32)
  cases = {'exp': (fn.exp, -np.abs(x)), 'tanh': (fn.tanh, x), 'gelu': (fn.gelu, x),
           'rsqrt': (fn.rsqrt, np.abs(x) + np.float32(1e-6)),
           'softcap': (lambda o, v: fn.softcap(o, v, 30.0), x * np.float32(10))}

  def probe(zero, values, angle_values):
    ops = numerics.with_zero(zero)._ops()
    out = {name: f(ops, values[name]) for name, (f, _) in cases.items()}
    out['sin'], out['cos'] = fn.sin_cos(ops, angle_values)
    return out

  got = jax.jit(probe, compiler_options=compiler_options)(
      jnp.uint32(0), {name: v for name, (_, v) in cases.items()}, angles)
  want = {name: f(b32.OPS, v) for name, (f, v) in cases.items()}
  want['sin'], want['cos'] = fn.sin_cos(b32.OPS, angles)
  return [f for name in want if (f := _differ(f'elementwise {name}', got[name], want[name]))]


# (1 - 2^-23) x (1 + 2^-23) 2^-126 = (1 - 2^-46) 2^-126 rounds up to 2^-126 at 24 bits: tiny
# before rounding, not after. The spec keeps it (tininess after rounding: x86's FTZ); Arm's FZ
# flushes it to 0, so on aarch64 the engine computes the spec's rule in code (numerics.
# flush_in_code, the native kernels' exact operations): this probe checks that it does
# (docs/determinism.md, "Operations", "aarch64").
UNDERFLOW_EDGE = (np.float32(1 - 2 ** -23), np.float32((1 + 2 ** -23) * 2 ** -126))
# Set to 1 by experiments.emulated_check for the processes it runs under QEMU's x86 emulator,
# and nowhere else: QEMU's software floating point flushes before rounding on every target, x86
# included (real x86 does not: measured), and the x86 paths trust the hardware's rule, so an
# emulated x86 fails this one probe for the emulator's sake. Skipping it there lets emulation test
# everything else; the run records that it did. (Under qemu-aarch64 the probe runs: the aarch64
# engine computes the rule in code.)
SKIP_UNDERFLOW_ENV = 'GEMMA_JAX_SELFCHECK_EMULATED'


def underflow_failures(numerics: Spec, compiler_options: dict | None) -> list[str]:
  """The product at UNDERFLOW_EDGE through the engine's multiply and as the first term of a
  contraction chain (a weight above the pairwise threshold, as the engine stores it), against
  binary32: a machine that flushes by tininess before rounding is refused here, by name."""
  if os.environ.get(SKIP_UNDERFLOW_ENV) == '1':
    return []
  a, b = UNDERFLOW_EDGE
  n = (numerics.small // 2 // 64 + 1) * 64  # 2 n weights: over the threshold, whole panels
  x = np.asarray([[a, 0]], np.float32)
  w = np.zeros((2, n), np.float32)
  w[0] = b

  # The weight as a spec engine of this kernel stores it (gemma_jax.stored).
  layout = WeightLayout(numerics.kernel, numerics.small)

  def probe(zero, x, w):
    ops = numerics.with_zero(zero)
    return ops._ops().mul(x[0, :1], w[0, :1]), ops.dense(x, layout.stored(w), 2, n)

  product, chain = jax.jit(probe, compiler_options=compiler_options)(jnp.uint32(0), x, w)
  want = b32.OPS.mul(x[0, :1], w[0, :1])
  return [f for f in (
      _differ('underflow edge: product', product, want),
      _differ('underflow edge: contraction chain', chain,
              b32.matmul(x, w, k_chunk=numerics.k_chunk, small=numerics.small))) if f]


def _logical(w: Weight) -> tuple[int, int]:
  """(I, O) of a weight stored [I, O] or as a kernel's Panels [O / P, I, P]."""
  if isinstance(w, Panels):
    return w.data.shape[1], w.data.shape[0] * w.data.shape[2]
  return w.shape[0], w.shape[1]


def _weight_columns(w: Weight, cols: np.ndarray) -> np.ndarray:
  """Columns `cols` [I, len(cols)] of a weight stored [I, O] or as Panels [O / P, I, P], on
  the host."""
  if isinstance(w, Panels):
    panels = to_host(w.data)
    return panels[cols // panels.shape[2], :, cols % panels.shape[2]].T
  return to_host(w)[:, cols]


def matmul_failures(numerics: FixedOrder, compiler_options: dict | None,
                    weights: dict[str, Weight],
                    rows: tuple[int, ...], head_rows: tuple[int, ...]) -> list[str]:
  """numerics.dense of rows x [M, I] against each named weight (in the form the engine stores
  it: gemma_jax.stored), for every M in rows (head_rows for the 'output_table'), against the
  spec's contraction (on a sample of columns)."""
  xs = {(name, m): _inputs(m * 7 + len(name), (m, _logical(w)[0]))
        for name, w in weights.items()
        for m in (head_rows if name == 'output_table' else rows)}

  def probe(zeros, ws, xs):
    # Each probe gets its own copy of the weight (OR a run-time zero of its own): XLA merges
    # dots that share an operand into one bigger dot, which would probe another kernel.
    out = {}
    for i, (key, x) in enumerate(xs.items()):
      n, w = numerics.with_zero(zeros[i]), ws[key[0]]
      out[key] = n.dense(x, jax.tree.map(n.materialize, w) if key[0] != 'output_table' else w,
                         *_logical(w))
    return out

  got = jax.jit(probe, compiler_options=compiler_options)(
      jnp.zeros((len(xs),), jnp.uint32), weights, xs)
  failures = []
  for name in weights:
    # The spec computes each output row on its own, so one reference call per weight holds
    # the sampled rows of every row count (a chain per row and column either way).
    w = weights[name]
    k, n = _logical(w)
    cols, keys = _columns(n), [key for key in xs if key[0] == name]
    samples = [_rows(m) for _, m in keys]
    want = b32.matmul(np.concatenate([xs[key][sample] for key, sample in zip(keys, samples)]),
                      b32.flush(_weight_columns(w, cols)), k_chunk=numerics.k_chunk,
                      small=numerics.small, weight_count=k * n)
    wants = np.split(want, np.cumsum([len(sample) for sample in samples])[:-1])
    for (_, m), sample, want in zip(keys, samples, wants):
      failure = _differ(f'matmul {name} [{m}, {k}] x [{k}, {n}]',
                        to_host(got[(name, m)])[sample][:, cols], want)
      if failure:
        failures.append(failure)
  return failures


def attention_failures(numerics: FixedOrder, compiler_options: dict | None, *,
                       head_dims: tuple[int, ...], rows: tuple[int, ...], tile: int,
                       kv_heads: int) -> list[str]:
  """Attention's per-tile dots (scores over H, p . v over a tile's slots) for every row count
  against sequential FMA chains (on a sample of rows), in the engine's layout [B, K, n, R, H]
  with the model's KV heads K and two tiles (batch slots are one more leading axis of the same
  layout: 1 here), every head and tile compared."""
  cases = {}
  for h in head_dims:
    for r in rows:
      cases[(h, r)] = (_inputs(h + r, (1, kv_heads, r, h)),
                       _inputs(h + r + 1, (1, kv_heads, 2, tile, h), 0.5),
                       np.abs(_inputs(h + r + 2, (1, kv_heads, 2, r, tile))),
                       _inputs(h + r + 3, (1, kv_heads, 2, tile, h)))

  def probe(zero, cases):
    n = numerics.with_zero(zero)
    return {key: (n.tile_scores(q, k), n.tile_values(p, v))
            for key, (q, k, p, v) in cases.items()}

  got = jax.jit(probe, compiler_options=compiler_options)(jnp.uint32(0), cases)
  failures = []
  for (h, r), (q, k, p, v) in cases.items():
    sample = _rows(r)
    want_scores = np.stack([[b32.chunked_dot(q[0, i][sample], k[0, i, j].T, numerics.k_chunk)
                             for j in range(2)] for i in range(kv_heads)])
    want_pv = np.stack([[b32.dot(p[0, i, j][sample], v[0, i, j]) for j in range(2)]
                        for i in range(kv_heads)])
    scores, pv = (to_host(a)[0][:, :, sample] for a in got[(h, r)])
    for name, g, want in (('scores', scores, want_scores), ('p . v', pv, want_pv)):
      failure = _differ(f'attention {name}, {r} rows, head dim {h}, tile {tile}', g, want)
      if failure:
        failures.append(failure)
  return failures


def fused_attention_failures(numerics: FixedOrder, compiler_options: dict | None, *,
                             head_dims: tuple[int, ...], tile: int,
                             kv_heads: int, groups: int, softcap: float | None,
                             relative: tuple[float, float, float] | None = None) -> list[str]:
  """Attention computed whole by the numerics' kernel (the tiled attention where its kernel
  `attends`: the engine's path where its call shapes follow the run-time length) against the
  spec's tiled algorithm (gemma_jax.spec.interpreter.tiled_attention): rows at the end of a context that fills a tile
  and a half of a two-tile cache, with and without a sliding window of half a tile, the model's
  soft-cap, every head compared. relative: the model's RoPE (base, scale, rotary fraction) where
  it runs the relative mode, whose scores the kernel then computes (turning every key)."""
  failures = []
  for h in head_dims:
    q = _inputs(h, (1, 5, kv_heads * groups, h))
    k, v = _inputs(h + 1, (1, 2 * tile, kv_heads, h), 0.5), _inputs(h + 2, (1, 2 * tile, kv_heads, h))
    fill = tile + tile // 2
    k_pos = np.where(np.arange(2 * tile) < fill, np.arange(2 * tile), -1).astype(np.int32)[None]
    q_pos = np.arange(fill - 5, fill, dtype=np.int32)[None]
    scores, table = None, None
    if relative is not None:
      base, scale, fraction = relative
      scores = rope.RelativeScores(h, base, scale, fraction, numerics)
      table = Interpreter.angles(np.arange(2 * tile), h, base, scale, fraction)
    for window in (None, max(tile // 2, 1)):
      got = jax.jit(lambda *a, w=window: TiledAttention(tile)(
          *a[:5], window=w, softcap=softcap, scores=scores, numerics=numerics.with_zero(a[5])),
          compiler_options=compiler_options)(q, k, v, q_pos, k_pos, jnp.uint32(0))
      want = tiled_attention(q[0], k[0], v[0], q_pos[0], k_pos[0], window=window,
                             softcap=softcap, tile=tile, k_chunk=numerics.k_chunk,
                             relative=table)
      failure = _differ(f'attention whole, head dim {h}, tile {tile}, window {window}',
                        to_host(got)[0], want)
      if failure:
        failures.append(failure)
  return failures


def row_dependence_failures(numerics: Numerics, compiler_options: dict | None,
                            weights: dict[str, np.ndarray],
                            rows: tuple[int, ...]) -> list[str]:
  """The pinned engine's premise, without the spec: a row's numerics.matmul against each weight
  is the same whatever the number of rows in the call. For every M in rows, an M-row call's first
  rows are compared with one-row calls of them and its last rows with the largest call's (on a
  sample of columns). XLA:CPU hands Eigen a thread pool of max(CPUs in the affinity mask, host
  devices) threads, and Eigen blocks a contraction by the thread count: on some counts a 16-row
  dot over 160-224 terms stops being the one-row dot (docs/determinism.md). weights: name ->
  [I, O] (or its panels [O / P, I, P]); returns a line per differing probe."""
  weights = {n: w for n, w in weights.items() if n != 'output_table'}
  most = max(rows)
  xs = {name: _inputs(len(name), (most, w.shape[0])) for name, w in weights.items()}

  def probe(zeros, ws, xs):
    out, i = {}, 0
    for name, x in xs.items():
      calls = {}
      for m in rows:
        n = numerics.with_zero(zeros[i])
        calls[m], i = n.matmul(x[:m], n.materialize(ws[name])), i + 1
      ones = []
      for r in range(min(4, most)):
        n = numerics.with_zero(zeros[i])
        ones.append(n.matmul(x[r:r + 1], n.materialize(ws[name]))[0])
        i += 1
      out[name] = (calls, jnp.stack(ones))
    return out

  calls_per_weight = len(rows) + min(4, most)
  got = jax.jit(probe, compiler_options=compiler_options)(
      jnp.zeros((len(xs) * calls_per_weight,), jnp.uint32), weights, xs)
  failures = []
  for name, (calls, ones) in got.items():
    k, n = weights[name].shape
    cols, ones, largest = _columns(n), to_host(ones), to_host(calls[most])
    for m in rows:
      many, first = to_host(calls[m]), min(4, m)
      failure = _differ(f'matmul {name} [{m}, {k}] x [{k}, {n}]',
                        np.concatenate([many[:first], many[m - first:]])[:, cols],
                        np.concatenate([ones[:first], largest[m - first:m]])[:, cols],
                        against=f'one-row and {most}-row calls of the same rows')
      if failure:
        failures.append(failure)
  return failures


def run_rows(numerics: Numerics, compiler_options: dict | None, *,
             weights: Callable[[], dict], weights_key: Hashable,
             rows: tuple[int, ...]) -> None:
  """Raises RowDependenceError naming every probe where a row's bits follow its call's row
  count in this process's configuration. weights: the weights probed, obtained only where the
  check runs (a recorded pass skips it: gemma_jax.verdicts); weights_key: what decides their
  names, shapes and forms (graft.engine.Engine.weights_key), a value whose repr names all of it
  (a recorded pass is kept under the key's repr)."""
  key = ('rows', numerics, tuple(sorted((compiler_options or {}).items())), weights_key, rows,
         jax.device_count(), _xla_flags(), host.intra_op_threads())
  failures = _cached(key, lambda: row_dependence_failures(numerics, compiler_options, weights(),
                                                          rows))
  if failures:
    raise RowDependenceError(
        "a row's dot depends on its call's row count here, so grafts would not be exact "
        f'(pinned engine self-check, {jax.device_count()} device(s), {host.intra_op_threads()} '
        f'intra-op threads, XLA_FLAGS={_xla_flags()!r}): ' + '; '.join(failures[:4])
        + (f'; and {len(failures) - 4} more' if len(failures) > 4 else ''))


def _rows(m: int) -> np.ndarray:
  """Output rows compared: the first and last few."""
  return np.unique(np.r_[0:min(4, m), max(m - 4, 0):m])


def run(numerics: Spec, compiler_options: dict | None, *,
        weights: Callable[[], dict], weights_key: Hashable, rows: tuple[int, ...],
        head_rows: tuple[int, ...], attention_rows: tuple[int, ...], head_dims: tuple[int, ...],
        tile: int, kv_heads: int, groups: int = 1, softcap: float | None = None,
        relative: tuple[float, float, float] | None = None) -> None:
  """Raises SpecError naming every probe whose bits differ from the spec's. Attention is probed
  as the engine computes it: its per-tile dots for every row count in attention_rows and, where
  the numerics' kernel computes it whole (its kernel `attends`), that too. weights,
  weights_key: as `run_rows`'."""
  whole = numerics.kernel is not None and numerics.kernel.attends
  key = (numerics, tuple(sorted((compiler_options or {}).items())),
         weights_key, rows, head_rows,
         attention_rows, head_dims, tile, kv_heads,
         (groups, softcap, relative) if whole else (),
         jax.device_count(), _xla_flags(), host.intra_op_threads(),
         os.environ.get(SKIP_UNDERFLOW_ENV), flush_in_code())
  failures = _cached(key, lambda: (
      elementwise_failures(numerics, compiler_options)
      + underflow_failures(numerics, compiler_options)
      + matmul_failures(numerics, compiler_options, weights(), rows, head_rows)
      + attention_failures(numerics, compiler_options, head_dims=head_dims,
                           rows=attention_rows, tile=tile, kv_heads=kv_heads)
      + (fused_attention_failures(numerics, compiler_options, head_dims=head_dims, tile=tile,
                                  kv_heads=kv_heads, groups=groups, softcap=softcap,
                                  relative=relative)
         if whole else [])))
  if failures:
    raise SpecError('this machine does not compute the written arithmetic (spec self-check, '
                    f'{jax.device_count()} device(s), {host.intra_op_threads()} intra-op threads, '
                    f'XLA_FLAGS={_xla_flags()!r}): '
                    + '; '.join(failures[:6]) + (f'; and {len(failures) - 6} more'
                                                  if len(failures) > 6 else ''), failures)


_RESULTS: dict = {}


def _cached(key, compute):
  """compute()'s failures for `key`: once per process, and not at all where a pass for the same
  key and process configuration is recorded (gemma_jax.verdicts; failures are never recorded)."""
  if key not in _RESULTS:
    name = repr(key)
    if verdicts.passed('selfcheck', name):
      _RESULTS[key] = []
    else:
      _RESULTS[key] = compute()
      if not _RESULTS[key]:
        verdicts.record('selfcheck', name)
  return _RESULTS[key]


def _xla_flags() -> str:
  return sharding.xla_flags()
