"""The spec's dot as a Pallas kernel (gemma_jax/kernels/spec_dot.py), in interpret mode on CPU.

The kernel is a second, independent implementation of the written arithmetic's dots (Eigen's dot
is the first): each output bit for bit the NumPy reference's sequential FMA chain, and an engine
whose every dot runs through it (dot_library='pallas') computes the interpreter's KV and logits,
with the same fingerprint as the engine on Eigen's dots. Equality is of raw bits.
"""

import fractions

import jax.numpy as jnp
import numpy as np
import pytest

from gemma_jax import weights
from gemma_jax.kernels import native_build, spec_dot
from gemma_jax.spec import binary32 as b32
from graft.engine import spec_check
from graft.engine import Engine, EngineConfig

# As tests/test_spec.py: small tiles and calls, so that 60 tokens wrap the local ring.
SMALL = dict(mode='spec', rows_per_call=16, attention_tile=16, cache_len=128)


def bits(x):
  return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.int32)


def reference(a, b):
  return np.stack([b32.dot(a[j], b[j]) for j in range(a.shape[0])])


@pytest.mark.parametrize('shape', [(1, 3, 160, 70), (2, 16, 256, 64), (3, 5, 7, 9),
                                   (1, 1, 192, 130)])
def test_each_output_is_the_sequential_fma_chain(shape):
  """Shapes that need padding of every dimension (M, N to the block, C to a power of two)."""
  j, m, c, n = shape
  rng = np.random.default_rng(c)
  a = rng.standard_normal((j, m, c)).astype(np.float32)
  b = rng.standard_normal((j, c, n)).astype(np.float32)
  # Row 0 of entry 0 sums to -0 (one product below the smallest normal, flushed with its sign):
  # zero terms padded after the chain, instead of before it, would make it +0.
  a[0, 0] = 0.0
  a[0, 0, -1] = -1e-30
  b[0, -1] = 1e-20
  got = spec_dot.make_spec_dot()(jnp.asarray(a), jnp.asarray(b))
  want = reference(a, b)
  assert np.array_equal(bits(got), bits(want))
  assert np.signbit(np.asarray(got)[0, 0]).all()
  # The order is visible: the other rows' terms summed in binary64 and rounded once differ.
  once = np.einsum('jmc,jcn->jmn', a.astype(np.float64), b.astype(np.float64)).astype(np.float32)
  assert m == 1 or not np.array_equal(bits(once[:, 1:]), bits(want[:, 1:]))


def test_each_fma_is_rounded_once_at_binary32_midpoints():
  """a0 b0 = 1 + 2^-23, then a1 b1 = 2^-24 - 2^-70: the exact sum lies just below the midpoint
  1 + 2^-23 + 2^-24, so it rounds down to 1 + 2^-23; binary64 arithmetic lands on the midpoint
  and a second rounding to even goes up to 1 + 2^-22."""
  a = np.array([[[1 + 2 ** -23, 1 + 2 ** -23]]], np.float32)
  b = np.array([[[1.0], [2 ** -24 - 2 ** -47]]], np.float32)
  exact = (fractions.Fraction(float(a[0, 0, 0])) * fractions.Fraction(float(b[0, 0, 0]))
           + fractions.Fraction(float(a[0, 0, 1])) * fractions.Fraction(float(b[0, 1, 0])))
  assert exact < 1 + fractions.Fraction(3, 2 ** 24)  # below the midpoint
  got = np.asarray(spec_dot.make_spec_dot()(jnp.asarray(a), jnp.asarray(b)))
  assert got[0, 0, 0] == np.float32(1 + 2 ** -23)
  p = np.float64(a[0, 0, 1]) * np.float64(b[0, 1, 0])
  assert np.float32(np.float64(np.float32(1 + 2 ** -23)) + p) == np.float32(1 + 2 ** -22)


def test_the_engine_on_the_kernel_computes_what_the_interpreter_computes():
  # tiny_gemma3_wide: every projection and the output table above the pairwise threshold, so
  # the kernel computes them too (chunked), not only attention's tile dots.
  loaded = weights.load('tiny_gemma3_wide', 'random:0', 'float32')
  engine = Engine(loaded, EngineConfig(dot_library='pallas', **SMALL))
  assert engine.numerics.kernel is not None and engine.projection_weights()
  tokens = [int(t) for t in np.random.default_rng(2).integers(3, 512, 40)]
  result = spec_check.run(engine, tokens, splits=[17])
  summary = result['summary']
  assert (summary['kv_equal'], summary['logits_equal'], summary['first_difference']) == (
      True, True, None), result
  # The dot library decides no bit, so it is not in the fingerprint (artifacts and stores made
  # on one graft on the other), and the native kernels compute the same bits.
  native = Engine(loaded, EngineConfig(dot_library='native', **SMALL))
  assert engine.fingerprint['sha256'] == native.fingerprint['sha256']
  assert spec_check.run(native, tokens, splits=[17])['summary']['sha256'] == summary['sha256']


def test_the_kernel_is_the_spec_engines_only():
  with pytest.raises(ValueError, match="dot library 'pallas' is not one of mode pinned's"):
    EngineConfig(mode='pinned', dot_library='pallas')
  with pytest.raises(ValueError, match="no spec dot kernel for platform 'tpu'"):
    spec_dot.make_spec_dot(platform='tpu')


def fma_before_rounding(a, b, c):
  """An FMA with Arm's FZ rule, emulated: the spec's FMA, but a zero of its sign wherever the
  exact result is below 2^-126 (tininess before rounding)."""
  import jax
  with jax.enable_x64(True):
    exact = a.astype(jnp.float64) * b.astype(jnp.float64) + c.astype(jnp.float64)
    r = spec_dot.fma_emulated(a, b, c)
    return jnp.where(jnp.abs(exact) < 2.0 ** -126,
                     jnp.copysign(jnp.zeros_like(r), exact.astype(jnp.float32)), r)


def test_the_rule_in_code_makes_an_fma_of_arms_rule_the_spec():
  # On the operands of tests/test_native_edges.py: in the window (2^-126 in the spec), just below
  # it, special values. The emulated Arm-rule FMA differs exactly in the window; wrapped, it is the
  # spec's FMA, and wrapping the spec's FMA changes nothing.
  from tests import test_native_edges as edges
  rows = (edges.edge_operands('fma') + edges.edge_operands('mul') + edges.special_operands())
  a, b, c = (jnp.asarray(np.array(col, np.float32)) for col in zip(*rows))
  with np.errstate(all='ignore'):
    want = bits(b32.fma(*(b32.flush(np.asarray(v)) for v in (a, b, c))))
  window = np.zeros(len(rows), bool)
  window[:12] = window[24:36] = True
  arm = bits(fma_before_rounding(a, b, c))
  assert np.array_equal(arm != want, window)
  assert np.array_equal(bits(spec_dot.fma_flushed_in_code(fma_before_rounding)(a, b, c)), want)
  assert np.array_equal(bits(spec_dot.fma_flushed_in_code(spec_dot.fma_emulated)(a, b, c)), want)


def test_the_kernel_with_the_rule_in_code_is_the_chain():
  rng = np.random.default_rng(4)
  a = rng.standard_normal((2, 5, 24)).astype(np.float32)
  b = rng.standard_normal((2, 24, 7)).astype(np.float32)
  a[0, :, :], b[0, :, :] = 0, 0  # entry 0: edge chains on the diagonal, c then a b
  for i, (x, y, c) in enumerate([(np.float32(1 - 2 ** -23), np.float32((1 + 2 ** -23) * 2 ** -126),
                                  np.float32(0))] * 5):
    a[0, i, 3 * i], b[0, 3 * i, i] = x, y
  dot = spec_dot.SpecDot(platform='cpu', interpret=True, flush_in_code=True)
  got = dot(jnp.asarray(a), jnp.asarray(b))
  assert np.array_equal(bits(got), bits(reference(a, b)))
  assert (bits(np.diagonal(np.asarray(got)[0])) == 0x00800000).all()


def test_the_device_checks_edge_probe_runs_here():
  from experiments import device_check
  probe = device_check.edge_probe()
  assert probe['spec_multiply_keeps_edge']
  assert probe['selfcheck_edge_failures_code'] == []
  if native_build._architecture() == 'x86_64':  # x86 keeps the edge itself
    assert probe['xla_multiply_keeps_edge'] and probe['selfcheck_edge_failures_hardware'] == []
  assert device_check.flush_rule(probe) == ('hardware' if probe['xla_multiply_keeps_edge']
                                            else 'code')
  assert device_check.flush_rule({**probe, 'ptx_fma_keeps_edge': False}) == 'code'
  assert device_check.flush_rule(None) == 'code'
