"""Draws at a temperature by the spec's exp and integers (gemma_jax.sampling): the same choice
on every machine from the same logits and seed.

The committed values below must hold on every machine that runs the suite (docs/determinism.md,
"Inputs").
"""

import hashlib

import numpy as np

from gemma_jax import sampling
from gemma_jax.spec import binary32, functions

# 4,096 fixed logits from -8 to 23.2: at temperature 0.7 some fall below the cutoff.
LOGITS = (np.arange(4096, dtype=np.int64) * 7919 % 1000).astype(np.float32) / 32 - 8


def test_the_weights_and_draws_of_fixed_logits_are_the_committed_ones():
  w = sampling.weights(LOGITS, 0.7)
  assert (hashlib.sha256(w.astype('<i8').tobytes()).hexdigest()
          == 'c835aa6ec74df045f538856d65e3cfffe64ba3bd099904dfbff0fe4979f74089')
  assert int((w > 0).sum()) == 2802
  assert [sampling.draw(LOGITS, 0.7, 3, j) for j in range(12)] == [
      778, 3630, 4025, 346, 3420, 1951, 3321, 2161, 2914, 2815, 568, 2593]


def test_the_weights_are_the_spec_exp_in_fixed_point():
  """Every token's weight is floor(exp((l - max) / t) * 2^44) with the spec's operations,
  the tokens under the cutoff included (their weight is 0 either way)."""
  o = binary32.OPS
  x = o.div(o.sub(LOGITS, LOGITS.max()), o.const(0.7))
  every = np.floor(functions.exp(o, x) * np.float32(2.0 ** 44)).astype(np.int64)
  assert sampling.weights(LOGITS, 0.7).tobytes() == every.tobytes()


def test_below_the_cutoff_every_weight_is_zero():
  """Each binary32 x in [-87, -31] (and exp clamps below -87): exp(x) * 2^44 < 1, so skipping
  the tokens at or below sampling.CUTOFF gives the same weights."""
  bits = np.arange(np.float32(-87.0).view(np.int32), np.float32(sampling.CUTOFF).view(np.int32) - 1,
                   -1, dtype=np.int32)
  x = bits.view(np.float32)
  assert x[0] == -87.0 and x[-1] == sampling.CUTOFF and np.all(np.diff(x) > 0)
  largest = max(functions.exp(binary32.OPS, x[i:i + (1 << 20)]).max()
                for i in range(0, x.size, 1 << 20))
  assert largest * np.float32(2.0 ** 44) < 1


def test_draws_follow_the_softmax():
  """3,000 draws over 4 tokens: each frequency within 0.04 of its softmax probability (4.6 times
  the largest standard error, 0.0087)."""
  logits = np.array([0.0, 1.0, 2.0, 3.0], np.float32)
  counts = np.bincount([sampling.draw(logits, 1.0, 5, j) for j in range(3000)], minlength=4)
  p = np.exp(logits - logits.max())
  assert np.all(np.abs(counts / 3000 - p / p.sum()) < 0.04)


def test_greedy_is_the_first_argmax_and_a_sampler_is_named():
  logits = np.array([1.0, 3.0, 3.0, 0.0], np.float32)
  assert sampling.draw(logits, 0.0, 1, 0) == 1
  draws = sampling.Draws(3)
  assert [draws.next(LOGITS, 0.7) for _ in range(3)] == [778, 3630, 4025] and draws.count == 3
  try:
    sampling.Draws(3, 'float64')
  except ValueError as e:
    assert 'unknown sampler' in str(e)
  else:
    raise AssertionError('an unknown sampler was accepted')


def test_the_legacy_sampler_is_the_one_older_manifests_were_drawn_with():
  """LEGACY: the float64 softmax and numpy's Generator.choice, as decode drew before (what the
  flywheel manifests recording no sampler hold)."""
  draws = sampling.Draws(11, sampling.LEGACY)
  got = [draws.next(LOGITS, 0.7) for _ in range(5)]
  rng = np.random.default_rng(11)
  scaled = LOGITS.astype(np.float64) / 0.7
  p = np.exp(scaled - scaled.max())
  assert got == [int(rng.choice(4096, p=p / p.sum())) for _ in range(5)]
