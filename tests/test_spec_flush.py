"""The spec's flush rule in what XLA computes for the spec engine (gemma_jax.numerics).

Arm's FPCR.FZ, under which XLA:CPU runs on aarch64, flushes a product that is tiny before
rounding; the spec keeps one that rounds up to 2^-126 (x86's rule). Where the host's rule is
Arm's (or $GEMMA_JAX_SPEC_FLUSH=code) every multiply of the spec engine's XLA computation is
`numerics.spec_multiply`, which gives the spec's product under either rule: checked here under
x86's rule, on the operands of tests/test_native_edges.py, and by lowering the engine's functions
(every float32 multiply of every tiny family is one); under Arm's rule by the self-check's probe
under qemu-aarch64 (experiments.emulated_check, results/emulated_aarch64_native.json). On x86
nothing changes: the lowered modules are the ones without it (docs/determinism.md, "aarch64").
"""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from gemma_jax import numerics
from gemma_jax.config import get_config
from gemma_jax.spec import binary32 as b32
from graft.engine import EngineConfig, lowering
from tests import test_native_edges as edges


def bits(x):
  return np.ascontiguousarray(np.asarray(x, np.float32)).view(np.uint32)


def test_the_rule_follows_the_machine_and_the_variable(monkeypatch):
  monkeypatch.delenv(numerics.FLUSH_ENV, raising=False)
  monkeypatch.setattr(numerics.platform, 'machine', lambda: 'aarch64')
  assert numerics.flush_in_code()
  monkeypatch.setattr(numerics.platform, 'machine', lambda: 'x86_64')
  assert not numerics.flush_in_code()
  monkeypatch.setenv(numerics.FLUSH_ENV, 'code')
  assert numerics.flush_in_code()
  monkeypatch.setenv(numerics.FLUSH_ENV, 'hardware')
  assert not numerics.flush_in_code()
  monkeypatch.setenv(numerics.FLUSH_ENV, 'sometimes')
  with pytest.raises(ValueError, match=r"^\$GEMMA_JAX_SPEC_FLUSH='sometimes': expected code or "
                     r'hardware$'):
    numerics.flush_in_code()


def test_the_multiply_gives_the_spec_product(monkeypatch):
  monkeypatch.setenv(numerics.FLUSH_ENV, 'code')
  rows = edges.edge_operands('mul') + edges.special_operands()
  a, b = (np.array(col, np.float32) for col in list(zip(*rows))[:2])
  with np.errstate(all='ignore'):
    want = b32.OPS.mul(b32.flush(a), b32.flush(b))
  spec = numerics.Spec()
  got = jax.jit(lambda x, y, zero: spec.with_zero(zero).mul(x, y))(a, b, jnp.uint32(0))
  assert np.array_equal(bits(got), bits(want))
  assert list(bits(want[:24]) & 0x7FFFFFFF) == [0x00800000] * 12 + [0] * 12  # the edges


def _multiplies(text: str) -> tuple[int, list[str]]:
  """(how many float32 multiplies of a lowered module (with debug info) lie inside spec_multiply's
  named scope, the locations of those that do not)."""
  locations = dict(re.findall(r'^#(loc\d+) = loc\((.*)\)$', text, re.M))
  inside, outside = 0, []
  for m in re.finditer(r'stablehlo\.multiply\b[^\n]*?(tensor<[^>]*>)\s+loc\(#(loc\d+)\)', text):
    if not m.group(1).endswith('f32>'):
      continue
    name = re.match(r'"([^"]*)"', locations[m.group(2)])
    if name and '/spec_flush/' in name.group(1):
      inside += 1
    else:
      outside.append(locations[m.group(2)])
  return inside, outside


def _lowered(config, rule, monkeypatch):
  # The rule is read when a function is traced: no trace made under another may be reused.
  jax.clear_caches()
  monkeypatch.setenv(numerics.FLUSH_ENV, rule)
  lowered = lowering.lower_engine_functions(config, EngineConfig(mode='spec',
                                                                 dot_library='native'), 'cpu')
  return {name: _multiplies(low.as_text(debug_info=True)) for name, low in lowered.items()}


@pytest.mark.parametrize('model', ['tiny_gemma2', 'tiny_gemma3', 'tiny_gemma4'])
@pytest.mark.parametrize('rope', ['float', 'relative'])
def test_every_multiply_of_the_engine_computes_the_rule(model, rope, monkeypatch):
  config = get_config(model)
  if rope != 'float':
    config = dataclasses.replace(config, rope_mode=rope)
  for name, (inside, outside) in _lowered(config, 'code', monkeypatch).items():
    assert inside > 0 and outside == [], (name, outside[:3])
  # And under the hardware's rule (x86's) none does.
  for name, (inside, outside) in _lowered(config, 'hardware', monkeypatch).items():
    assert inside == 0 and len(outside) > 0, name
