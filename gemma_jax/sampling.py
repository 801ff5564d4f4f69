"""Drawing a token from logits at a temperature: the same choice on every machine.

A decode draws its j-th token (j = 0, 1, ...) from that step's float32 logits l [V]:

  temperature <= 0   the argmax (the first of equal maxima);
  otherwise          x = (l - max l) / t, each operation a binary32 one rounded to nearest even
                     (t: the temperature rounded to binary32; subnormals flushed, as the spec
                     does); e = exp(x) by the written arithmetic's exp (gemma_jax.spec.functions,
                     over NumPy's binary32 operations: gemma_jax.spec.binary32), in (0, 1], 1 at
                     the maximum; the weights w = floor(e * 2^44) as integers (exact: a power of
                     two times a binary32 number, then its integer part); u a uniform integer in
                     [0, sum w) (gemma_jax.seeded.below, the stream of 'sample:SEED', draw j);
                     the token is the first i whose running integer sum w_0 + ... + w_i
                     exceeds u.

So the softmax is the spec's exp and integer arithmetic (no sum of floats, whose order a library
chooses); a token whose softmax weight e is below 2^-44 relative to the most likely one's is
never drawn (each such token's probability is below 5.7e-14). The logits of a spec engine are
the same on every machine that passes its check, so the draws are too.

`LEGACY` is the draw manifests made before this one record (the softmax in float64 by NumPy's
exp, and numpy.random.Generator.choice): NumPy picks its float64 exp by the CPU's instruction
set, so its last bits, and in a case as rare as a uniform landing within them of a boundary,
the choice, could follow the machine. Kept only to replay those manifests; it retires when they
are remade (docs/determinism.md, "Inputs").
"""

from __future__ import annotations

import numpy as np

from gemma_jax import seeded
from gemma_jax.spec import binary32, functions

SAMPLER = 'spec-exp-integer/1'  # what a manifest of draws made now records
LEGACY = 'numpy-float64/0'  # what a manifest recording no sampler was drawn with
SAMPLERS = (SAMPLER, LEGACY)
WEIGHT_BITS = 44  # fixed-point bits of a token's weight: 2^19 tokens of weight <= 2^44 sum < 2^64
MAX_VOCABULARY = 1 << 18  # their sum then fits an int64 (Gemma's vocabulary is 2^18 tokens)
# x at or below CUTOFF has weight 0: the spec's exp(x) * 2^44 < 1 for every binary32 x in
# [-87, -31] (tests/test_sampling.py checks each), and exp clamps its argument at -87. Only the
# tokens above it are taken through exp, which gives the same weights as taking all of them.
CUTOFF = -31.0


def weights(logits: np.ndarray, temperature: float) -> np.ndarray:
  """The integer weights floor(exp((l - max l) / t) * 2^44) of logits [V] at temperature > 0:
  int64 [V] (see the module's docstring)."""
  o = binary32.OPS
  l = binary32.flush(np.asarray(logits, np.float32).reshape(-1))
  if l.size > MAX_VOCABULARY:
    raise ValueError(f'{l.size} logits: the integer weights of more than {MAX_VOCABULARY} '
                     'tokens could overflow their int64 sum')
  x = o.div(o.sub(l, l.max()), o.const(temperature))
  out = np.zeros(l.shape, np.int64)
  live = x > np.float32(CUTOFF)
  e = functions.exp(o, x[live])
  out[live] = np.floor(e * np.float32(2.0 ** WEIGHT_BITS)).astype(np.int64)
  return out


def draw(logits: np.ndarray, temperature: float, seed: int, index: int) -> int:
  """The token a decode seeded `seed` draws as its `index`-th (0-based) from logits [V]."""
  if temperature <= 0:
    return int(np.argmax(logits))
  running = np.cumsum(weights(logits, temperature))  # int64, exact
  u = seeded.below(seeded.key(f'sample:{seed}'), index, int(running[-1]))
  return int(np.searchsorted(running, u, side='right'))


class Draws:
  """The draws of one decode (or one batch slot): its seed, how many it has drawn, and the
  sampler (SAMPLER, or LEGACY to replay an older manifest)."""

  def __init__(self, seed: int, sampler: str = SAMPLER):
    if sampler not in SAMPLERS:
      raise ValueError(f'unknown sampler {sampler!r}; expected one of {SAMPLERS}')
    self.seed, self.sampler, self.count = seed, sampler, 0
    self._legacy = np.random.default_rng(seed) if sampler == LEGACY else None

  def next(self, logits: np.ndarray, temperature: float) -> int:
    """The next token drawn from logits [V] (float32) at `temperature` (0 or less: argmax)."""
    if self._legacy is not None:
      token = _legacy_draw(logits, temperature, self._legacy)
    else:
      token = draw(logits, temperature, self.seed, self.count)
    self.count += 1
    return token


def _legacy_draw(logits: np.ndarray, temperature: float, rng: np.random.Generator) -> int:
  """LEGACY: the softmax of logits / temperature in float64 and Generator.choice."""
  if temperature <= 0:
    return int(np.argmax(logits))
  scaled = np.asarray(logits, np.float64) / temperature
  probs = np.exp(scaled - scaled.max())
  return int(rng.choice(len(probs), p=probs / probs.sum()))
