"""The written arithmetic's dot as a Pallas kernel: one sequential FMA chain per output.

    dot = make_spec_dot()                      # backend defaults
    out = dot(a, b)                            # a [J, M, I], b [J, I, O] float32 -> [J, M, O]

Every output is c = fma(a[j, m, i], b[j, i, o], c) for i = 0, 1, ..., I - 1 from c = +0, each
FMA rounded once to binary32 (nearest even) and a subnormal result flushed to a zero of its sign:
the dot of docs/determinism.md ("Dots"), which gemma_jax.spec.binary32.dot computes in NumPy and
which Eigen's dot computes on XLA:CPU for the contraction sizes the spec engine uses (checked by
gemma_jax.spec.selfcheck). On an accelerator no library dot follows that order (cuBLAS and
Triton's tensor-core dots split and reorder the contraction), so the spec engine's dots run
through this kernel there (EngineConfig.dot_library='pallas').

Kernel. A program owns a [block_m, block_n] block of outputs of one batch entry j and walks
i = 0 .. I - 1 in order, folding the outer product of a's column i and b's row i into its
accumulator with one FMA per output. Nothing is split, reordered or shared between programs,
so an output's bits depend only on its row of a and column of b. Block shapes are powers of two
(as Triton requires): M and O are padded with zero rows and columns (sliced off), and I with
zero terms *in front*, which keep c = +0 exactly (fma(0, 0, +0) = +0), so the chain over the
real terms starts from +0 as specified. (Zero terms after them would not be exact: they turn a
-0 result into +0.)

The FMA itself is the one thing each backend supplies:
  gpu (Triton): inline PTX `fma.rn.ftz.f32`: round to nearest even, subnormals flushed, and no
      contraction or reordering by the compiler (an explicit instruction, not a mul and an add).
  interpret (any host, how the tests run it on CPU): an exact emulation from binary64, as
      gemma_jax.spec.binary32.fma: the product of two binary32 numbers is exact in binary64,
      the binary64 sum rounds once, and where that sum lies exactly on a binary32 midpoint its
      TwoSum error breaks the tie; a result is flushed when tiny after rounding.
TPU has no binary32 FMA instruction to name; the kernel refuses it.

The flush rule: the spec flushes a result that is tiny after rounding (x86's rule). Where the
FMA's rule is tininess before rounding (Arm's FZ; the GPU's is measured by
experiments/device_check.py), a result that rounds up to 2^-126 from below would be 0, so with
`flush_in_code` (default: gemma_jax.numerics.flush_in_code(), which $GEMMA_JAX_SPEC_FLUSH=code
sets) each FMA is decided again at a scaled exponent (`fma_flushed_in_code`), with the backend's
FMA only.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.sharding import Mesh

from gemma_jax import numerics
from gemma_jax.sizes import next_power_of_two, round_up

PLATFORMS = ('cpu', 'gpu')
KERNEL_NAME = 'gemma_spec_dot'  # pl.pallas_call(name=...): how lowering finds it
# PTX of one binary32 FMA: round to nearest even, subnormal inputs and results flushed to zero.
FMA_PTX = 'fma.rn.ftz.f32 $0, $1, $2, $3;'


@dataclasses.dataclass(frozen=True)
class SpecDot:
  """The spec's dot on `platform` ('cpu': interpret mode only; 'gpu': Triton). block_m, block_n:
  the output block of a program (powers of two; they decide no bit, only speed)."""

  platform: str
  interpret: bool
  block_m: int = 16
  block_n: int = 64
  num_warps: int = 4
  # Each FMA decided again by the spec's flush rule (`fma_flushed_in_code`); None: where
  # gemma_jax.numerics.flush_in_code() says so when the kernel is traced. It decides no bit.
  flush_in_code: bool | None = None

  def __call__(self, a: jax.Array, b: jax.Array) -> jax.Array:
    return spec_dot(a, b, config=self)

  # The contractions of gemma_jax.numerics.Spec, each through __call__.

  def matmul(self, x: jax.Array, w: jax.Array, chunk: int,
             rows: jax.Array | None = None) -> jax.Array:
    """x [M, I] @ w [I, O]: chains over chunks of `chunk` terms, added in chunk order (every row
    computed: `rows`, the count of real ones, only saves work where a kernel can use it)."""
    del rows
    k, n = w.shape
    parts = self(x.reshape(-1, k // chunk, chunk).transpose(1, 0, 2),
                 w.reshape(k // chunk, chunk, n))
    acc = parts[0]
    for i in range(1, k // chunk):
      acc = acc + parts[i]
    return acc

  def packs(self, k: int, n: int) -> bool:
    """Weights stay [I, O] (no panel layout)."""
    return False

  @property
  def attends(self) -> bool:
    """False: attention runs as the tiled XLA ops, its dots through this kernel."""
    return False

  def on_mesh(self, mesh: Mesh | None) -> 'SpecDot':
    """Itself: XLA partitions a Pallas call as it does any custom call."""
    del mesh
    return self

  def matmul_packed(self, x: jax.Array, panels: jax.Array, chunk: int,
                    rows: jax.Array | None = None) -> jax.Array:
    """x [M, I] @ panels [O / P, I, P]: never called, this kernel packs no weight (`packs`)."""
    raise NotImplementedError('the spec dot kernel keeps weights [I, O]')

  def attend(self, q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array,
             k_pos: jax.Array, *, window: int | None, softcap: float | None, tile: int,
             chunk: int, relative: tuple | None = None) -> jax.Array:
    """q [B, T, N, H] over k, v [B, S, K, H]: never called, this kernel does not compute
    attention whole (`attends`)."""
    raise NotImplementedError('the spec dot kernel computes the tiled attention\'s dots only')

  def tile_scores(self, q: jax.Array, k: jax.Array, chunk: int) -> jax.Array:
    """q [B, K, R, H] . k [B, K, n, S, H] -> [B, K, n, R, S], over H in chunks added in order."""
    q = jnp.broadcast_to(q[:, :, None], k.shape[:3] + q.shape[-2:])
    part = lambda j: self._batched(q[..., j * chunk:(j + 1) * chunk],
                                   jnp.swapaxes(k[..., j * chunk:(j + 1) * chunk], -1, -2))
    acc = part(0)
    for j in range(1, q.shape[-1] // chunk):
      acc = acc + part(j)
    return acc

  def tile_values(self, p: jax.Array, v: jax.Array) -> jax.Array:
    """p [B, K, n, R, S] @ v [B, K, n, S, H] -> [B, K, n, R, H]."""
    return self._batched(p, v)

  def _batched(self, a, b):
    """a [..., M, I] . b [..., I, O] through the kernel."""
    lead = a.shape[:-2]
    out = self(a.reshape(-1, *a.shape[-2:]), b.reshape(-1, *b.shape[-2:]))
    return out.reshape(*lead, *out.shape[-2:])


Fma = Callable[[jax.Array, jax.Array, jax.Array], jax.Array]  # (a, b, c) -> a * b + c, once rounded


def fma_emulated(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
  """RN_binary32(a * b + c), flushed when tiny, from binary64 operations (exact; see the module
  doc and gemma_jax.spec.binary32, whose semantics these are); elementwise, any shape."""
  with jax.enable_x64(True):
    f64 = jnp.float64
    p = a.astype(f64) * b.astype(f64)
    c64 = c.astype(f64)
    r = _round_sum(p, c64)
    # Tininess after rounding: a result on +-2^-126 whose unbounded rounding is below it.
    scale = f64(2.0 ** 64)
    edge = (jax.lax.bitcast_convert_type(r, jnp.uint32) & 0x7FFFFFFF) == 0x00800000
    tiny = edge & (jnp.abs(_round_sum(p * scale, c64 * scale)) < jnp.float32(2.0 ** -62))
    r = jnp.where(tiny, jnp.copysign(jnp.zeros_like(r), r), r)
  return flush(r)


def _round_sum(p: jax.Array, c: jax.Array) -> jax.Array:
  """RN_binary32(p + c) on binary32's grid for binary64 p (an exact product) and c."""
  s = p + c
  r = s.astype(jnp.float32)
  midpoint = (jax.lax.bitcast_convert_type(s, jnp.int64) & 0x1FFFFFFF) == 0x10000000
  t = s - p
  err = (p - (s - t)) + (c - t)  # TwoSum: s + err == p + c exactly
  r64 = r.astype(jnp.float64)
  away = midpoint & (err != 0) & (jnp.sign(err) == jnp.sign(s - r64))
  return jnp.where(away, (r64 + 2 * (s - r64)).astype(jnp.float32), r)


def flush(x: jax.Array) -> jax.Array:
  """Subnormal binary32 values as zeros of their sign (any shape, kept)."""
  tiny = (jax.lax.bitcast_convert_type(x, jnp.uint32) & 0x7F800000) == 0
  return jnp.where(tiny, jnp.copysign(jnp.zeros_like(x), x), x)


def fma_ptx(a: jax.Array, b: jax.Array, c: jax.Array) -> jax.Array:
  """RN_binary32(a * b + c), flushed, as one PTX instruction (Triton only); elementwise, any
  shape."""
  from jax.experimental.pallas import triton as pltriton  # Pallas's GPU backend: only on a GPU
  [out] = pltriton.elementwise_inline_asm(
      FMA_PTX, args=[a, b, c], constraints='=r,r,r,r', pack=1,
      result_shape_dtypes=[jax.ShapeDtypeStruct(c.shape, jnp.float32)])
  return out


def fma_flushed_in_code(fma: Fma) -> Fma:
  """`fma` (an FMA that flushes tiny results and reads subnormal inputs as zero, by tininess
  before or after rounding) giving the spec's result under either rule: s = fma(a 2^24, b,
  c 2^24) rounds the exact result times 2^24 at 24 bits in the normal range, so where
  |s| < 2^-101 the result is s 2^-24 (2^-126 where the rounded result is, a zero of its sign
  where it is tiny), elsewhere fma(a, b, c) (gemma_jax/kernels/csrc/chains.h gives the cases).
  The scalings are FMAs too (x k + -0, which keeps x k's sign where it is zero), so a subnormal
  input still reads as zero."""
  def exact(a, b, c):
    zero = jnp.full_like(c, -0.0)
    scale = lambda x, k: fma(x, jnp.full_like(c, k), zero)
    s = fma(scale(a, 2.0 ** 24), b, scale(c, 2.0 ** 24))
    return jnp.where(jnp.abs(s) < jnp.float32(2.0 ** -101), scale(s, 2.0 ** -24),
                     fma(a, b, c))
  return exact


def _kernel(a_ref, b_ref, o_ref, *, fma):
  # a_ref [bm, C], b_ref [C, bn], o_ref [bm, bn]; the chain walks k in order.
  block_m, terms = a_ref.shape
  block_n = b_ref.shape[1]

  def step(k, acc):
    column = jnp.broadcast_to(a_ref[:, pl.ds(k, 1)], (block_m, block_n))
    row = jnp.broadcast_to(b_ref[pl.ds(k, 1), :], (block_m, block_n))
    return fma(column, row, acc)

  o_ref[...] = jax.lax.fori_loop(0, terms, step, jnp.zeros((block_m, block_n), jnp.float32))


@functools.partial(jax.jit, static_argnames=('config',))
def spec_dot(a: jax.Array, b: jax.Array, *, config: SpecDot) -> jax.Array:
  """a [J, M, I] @ b [J, I, O] -> [J, M, O], float32, each output one sequential FMA chain."""
  if a.dtype != jnp.float32 or b.dtype != jnp.float32:
    raise ValueError(f'the spec dot is binary32; got {a.dtype} and {b.dtype}')
  (j, m, c), n = a.shape, b.shape[-1]
  if b.shape[:2] != (j, c):
    raise ValueError(f'spec dot shapes do not contract: {a.shape} @ {b.shape}')
  bm = min(config.block_m, next_power_of_two(m))
  bn = min(config.block_n, next_power_of_two(n))
  mp, np_, cp = round_up(m, bm), round_up(n, bn), next_power_of_two(c)
  # Zero terms in front (exact: the chain stays +0 through them), zero rows and columns after.
  a = jnp.pad(a, ((0, 0), (0, mp - m), (cp - c, 0)))
  b = jnp.pad(b, ((0, 0), (cp - c, 0), (0, np_ - n)))
  compiler_params = None
  if config.interpret:
    fma: Fma = fma_emulated
  else:
    from jax.experimental.pallas import triton as pltriton  # Pallas's GPU backend: only on a GPU
    fma = fma_ptx
    compiler_params = pltriton.CompilerParams(num_warps=config.num_warps, num_stages=1)
  if config.flush_in_code if config.flush_in_code is not None else numerics.flush_in_code():
    fma = fma_flushed_in_code(fma)
  out = pl.pallas_call(
      functools.partial(_kernel, fma=fma),
      out_shape=jax.ShapeDtypeStruct((j, mp, np_), jnp.float32),
      grid=(j, mp // bm, np_ // bn),
      in_specs=[pl.BlockSpec((None, bm, cp), lambda t, i, k: (t, i, 0)),
                pl.BlockSpec((None, cp, bn), lambda t, i, k: (t, 0, k))],
      out_specs=pl.BlockSpec((None, bm, bn), lambda t, i, k: (t, i, k)),
      compiler_params=compiler_params,
      interpret=config.interpret,
      name=KERNEL_NAME,
  )(a, b)
  return out[:, :m, :n]


def make_spec_dot(*, platform: str | None = None, interpret: bool | None = None) -> SpecDot:
  """The spec dot for `platform` ('cpu', 'gpu'; None: the default backend's). interpret
  defaults to True for 'cpu' only, so platform='gpu' builds the Triton kernel on any host (it
  lowers there, graft/engine/lowering.py; it runs only on a GPU)."""
  if platform is None:
    backend = jax.default_backend()
    platform = {'cuda': 'gpu', 'rocm': 'gpu'}.get(backend, backend)
  if platform not in PLATFORMS:
    raise ValueError(f'no spec dot kernel for platform {platform!r}: it needs a binary32 FMA '
                     f'instruction ({", ".join(PLATFORMS)})')
  if interpret is None:
    interpret = platform == 'cpu'
  if platform == 'cpu' and not interpret:
    raise ValueError('Pallas kernels run on CPU only in interpret mode')
  return SpecDot(platform=platform, interpret=bool(interpret))
