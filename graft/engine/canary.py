"""The canary: a fixed short computation whose bits the written arithmetic defines, run by every
spec engine's build and recorded in its fingerprint.

The spec engine's fingerprint binds what decides a bit (the spec version, the configuration
fields that order sums, the model), not the source code, so that a release that moves no bit
keeps every artifact and store (docs/security.md). What refuses a release that moves a bit
without bumping `SPEC_VERSION` (gemma_jax/spec/__init__.py):

  - the self-check (gemma_jax.spec.selfcheck): the engine's functions and contractions against
    binary32 on this machine. It cannot see a change made to both sides at once: the
    elementwise functions are written once for both (gemma_jax.spec.functions).
  - the canary: the tiny model of the engine's family (weights NumPy draws exactly) computes a
    fixed token sequence in a spec engine of the same dot library, whole and in pieces, and the
    SHA-256 of its K and V rows and logits (graft.engine.spec_check.rows_digest) must equal the
    digest committed here for the spec version. The digests are the NumPy interpreter's
    (tests/test_canary.py recomputes them), so a changed coefficient, a reordered sum in the
    model or the engine's calls, or another slot layout is refused at build, naming the version
    to bump.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np

from gemma_jax import model as gmodel
from gemma_jax import verdicts, weights
from gemma_jax.config import Family, TransformerConfig, get_config
from graft.engine import spec_check

# The family's tiny model (gemma_jax.config), with weights of its own (`_loaded`).
MODELS = {Family.GEMMA2: 'tiny_gemma2', Family.GEMMA3: 'tiny_gemma3', Family.GEMMA4: 'tiny_gemma4'}
# 8-row calls, 8-slot tiles and a 32-term chunk: the tiny model's contractions are chained over
# chunks, attention crosses tiles and wraps the local ring.
ENGINE = {'mode': 'spec', 'rows_per_call': 8, 'cache_len': 64, 'attention_tile': 8,
          'k_chunk': 32}
TOKENS = (2, 17, 300, 41, 5, 98, 77, 256, 3, 140, 61, 9, 444, 31, 200, 18, 7, 350, 90, 12, 65)
SPLITS = (5, 13)  # the pieces of the second run: a prefill, then continued calls

# Spec version -> tiny model -> the canary's digest, as the interpreter computes it.
EXPECTED = {
    1: {
        'tiny_gemma2': '5f3d51f869fd7e2eb0e276790633abac68dc5a0794d974c434dac50cedaf67d8',
        'tiny_gemma3': '32898472e895c2f8b8f55085bc65ca1f22044ad328ca1ea97081c43609f39ffc',
        'tiny_gemma4': '772d2ef27db28a6413c51f0c2908e6da3fe9916311be6044ad8705eac1268c4c',
    },
}


class CanaryError(ValueError):
  """This build computes other bits than its spec version defines."""


def model_for(config: TransformerConfig) -> str:
  """The canary model of a model config's family."""
  return MODELS[config.family]


def expected(version: int, model: str) -> str:
  """The committed digest of `model`'s canary under spec version `version`."""
  digest = EXPECTED.get(version, {}).get(model)
  if digest is None:
    raise CanaryError(f'spec version {version} has no canary digest for {model} '
                      '(graft/engine/canary.py EXPECTED: a new version commits the '
                      "interpreter's digests, which tests/test_canary.py prints)")
  return digest


# (version, model, dot library) -> the digest a check of this process found as it should be.
_CHECKED: dict[tuple[int, str, str], str] = {}


def check(version: int, model: str, dot_library: str, engine_class: type,
          config_class: type) -> str:
  """Runs `model`'s canary in a spec engine of `dot_library` and returns its digest; CanaryError
  when it is not the digest spec version `version` defines (once per process and arguments, and
  not at all where this process configuration's pass is recorded: gemma_jax.verdicts).
  engine_class, config_class: `Engine` and `EngineConfig`, passed by the engine being built
  (graft.engine.plans): the canary runs in an engine of its own while one is built, and this
  module sits below both classes' modules."""
  if (version, model, dot_library) in _CHECKED:
    return _CHECKED[(version, model, dot_library)]
  want = expected(version, model)
  key = f'spec version {version}, {model}, {dot_library}'
  if verdicts.passed('canary', key):
    _CHECKED[(version, model, dot_library)] = want
    return want
  got = computed(model, engine_class, config_class, dot_library)
  if got != want:
    raise CanaryError(
        f'the canary ({model}, {len(TOKENS)} tokens) computes {got[:16]}.. where spec version '
        f'{version} defines {want[:16]}..: this build moves bits without a new SPEC_VERSION '
        '(gemma_jax/spec/__init__.py); bump it (stores and artifacts of the old version are then '
        'refused, with the versions named) or undo the change')
  verdicts.record('canary', key)
  _CHECKED[(version, model, dot_library)] = got
  return got


def _loaded(model: str):
  """`model` with the canary's weights: every leaf an integer in [-1024, 1024) over 2^14, drawn
  by NumPy's PCG64 (exact in float32, the same on every machine; kept apart from random:SEED,
  gemma_jax.seeded, so that the canary's digests, and with them every spec fingerprint, stay
  what they were before random:SEED was drawn by integers)."""
  config = get_config(model)
  rng = np.random.default_rng(0)  # drawn leaf by leaf in the tree's order, from its shapes
  params = jax.tree.map(lambda leaf: jnp.asarray(
      (rng.integers(-1024, 1024, leaf.shape) / 16384).astype(np.float32)),
      gmodel.abstract_params(config))
  return weights.LoadedModel(config=config, params=params,
                             tokenizer=weights.tokenizer_for(config), weights='canary',
                             dtype='float32')


def _engine(model: str, engine_class: type, config_class: type, dot_library: str | None):
  return engine_class(_loaded(model), config_class(**ENGINE, dot_library=dot_library),
                      checks=False)


def computed(model: str, engine_class: type, config_class: type,
             dot_library: str | None = None) -> str:
  """The canary's digest as a spec engine (`engine_class`, `config_class`: graft.engine's
  Engine and EngineConfig) of `dot_library` computes it here (whole and in pieces; pieces that
  differ from the whole give a digest no version defines)."""
  engine = _engine(model, engine_class, config_class, dot_library)
  rows = spec_check.logit_rows(len(TOKENS), SPLITS)
  whole, logits = engine.extend(engine.empty(), list(TOKENS), logits=len(TOKENS))
  digest = spec_check.rows_digest(spec_check.engine_rows(engine, whole),
                                  {r: logits[r] for r in rows}, rows)
  ctx, pieces = engine.empty(), {}
  for lo, hi in zip((0,) + SPLITS, SPLITS + (len(TOKENS),)):
    ctx, piece = engine.extend(ctx, list(TOKENS[lo:hi]), logits='last')
    pieces[hi - 1] = piece[0]
  if spec_check.rows_digest(spec_check.engine_rows(engine, ctx), pieces, rows) != digest:
    return 'pieces differ from the whole: ' + digest
  return digest


def interpreted(model: str, engine_class: type, config_class: type) -> str:
  """The canary's digest as the NumPy interpreter computes it (what EXPECTED commits)."""
  engine = _engine(model, engine_class, config_class, None)  # for its geometry only
  rows = spec_check.logit_rows(len(TOKENS), SPLITS)
  reference = spec_check.interpreter(engine).run(list(TOKENS), logit_rows=rows)
  return spec_check.rows_digest(spec_check.reference_rows(engine, reference, len(TOKENS)),
                                reference.logits, rows)
