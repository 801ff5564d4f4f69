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
from gemma_jax.kernels import spec_dot
from gemma_jax.spec import binary32 as b32
from graft import spec_check
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
  assert engine.numerics.dot is not None and engine.projection_weights()
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
