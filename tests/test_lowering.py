"""The pinned engine's functions lower for GPU (cuda) and TPU on a host without either.

For each platform x attention x function the engine's `_step` (the transformer over one block
with the KV state) and `_head` (logits) are lowered from abstract shapes (graft/engine/lowering.py):
the Pallas kernel must appear as the platform's kernel custom call (Triton on cuda, Mosaic on
tpu) in the step and nowhere else, and XLA attention must lower to plain StableHLO (no custom
call at all, and jax.export's compatibility checks pass). The kernels' own IR is decoded from
the module to check what the device compiler will get (dot precision, grid, Triton warps).

Lowering is not compiling: Mosaic's layout passes and the Triton-to-PTX compile run on the
device (experiments/device_check.sh). A component this install lacks makes a test xfail with
the component's name (graft.lowering.MissingComponent), never pass.
"""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import pytest

from gemma_jax import config as gcfg
from gemma_jax.kernels import spec_dot
from gemma_jax.kernels.pallas_attention import default_block_config
from graft.engine import lowering
from graft.engine import EngineConfig

PLATFORMS = ('cuda', 'tpu')
ATTENTIONS = ('xla', 'pallas')
# The kernel's custom call per platform: the gpu driver passes Triton CompilerParams, so it is
# Triton even though jax 0.10.2 lowers a pallas_call without compiler params to Mosaic GPU.
KERNEL_TARGET = {'cuda': '__gpu$xla.gpu.triton', 'tpu': 'tpu_custom_call'}
# tiny_gemma3 has head dim 16; Mosaic needs a multiple of 128, so the tiny case uses 128.
CONFIGS = {
    'tiny_gemma3_h128': gcfg.get_config('tiny_gemma3').replace(head_dim=128,
                                                               query_pre_attn_scalar=128),
    'gemma3_270m': gcfg.get_config('gemma3_270m'),
}


def _pinned(**kw) -> EngineConfig:
  return EngineConfig(mode='pinned', **kw)


@functools.lru_cache(maxsize=None)
def _lowered(config_name: str, platform: str, attention: str, dtype: str = 'float32'):
  try:
    return lowering.lower_engine_functions(CONFIGS[config_name], _pinned(), platform, attention,
                                           dtype=dtype)
  except lowering.MissingComponent as e:
    return e


def _get(config_name, platform, attention, dtype='float32'):
  result = _lowered(config_name, platform, attention, dtype)
  if isinstance(result, lowering.MissingComponent):
    pytest.xfail(f'missing component: {result.component} ({result})')
  return result


@pytest.mark.parametrize('function', lowering.FUNCTIONS)
@pytest.mark.parametrize('attention', ATTENTIONS)
@pytest.mark.parametrize('platform', PLATFORMS)
@pytest.mark.parametrize('config_name', sorted(CONFIGS))
def test_engine_lowers(config_name, platform, attention, function):
  text = _get(config_name, platform, attention)[function].as_text()
  assert text.startswith('module @jit_')
  targets = lowering.custom_call_targets(text)
  if attention == 'pallas' and function == 'step':
    assert lowering.kernel_calls(text, platform) == [KERNEL_TARGET[platform]], targets
    assert targets == [KERNEL_TARGET[platform]], targets  # nothing else platform-specific
    # One kernel per distinct (cache length, window): local ring and global cache.
    assert text.count(f'stablehlo.custom_call @{KERNEL_TARGET[platform]}') == 2
    assert lowering.KERNEL_NAME in text
  else:
    # XLA attention (and the logits call, which has no attention) is plain StableHLO: no
    # custom call that needs a platform component, so nothing platform-specific is missing.
    assert targets == [], targets
    assert lowering.KERNEL_NAME not in text
  if function == 'step':  # the KV state is donated: XLA updates the cache in place
    num_kv_leaves = 3 * len(CONFIGS[config_name].cache_layers) + 1
    assert text.count('tf.aliasing_output') == num_kv_leaves


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_triton_kernel_ir(dtype):
  """The 270M's kernel for cuda: Triton IR with IEEE float32 dots (no TF32) and the block
  table's warps and stages in the call's backend config."""
  step = _get('gemma3_270m', 'cuda', 'pallas', dtype)['step']
  text = step.as_text()
  blocks = default_block_config('gpu', 256, jnp.dtype(dtype))
  assert (blocks.num_warps, blocks.num_stages) == (8, 2 if dtype == 'bfloat16' else 1)
  configs = re.findall(r'num_stages = (\d+) : i32, num_warps = (\d+) : i32', text)
  assert configs == [(str(blocks.num_stages), str(blocks.num_warps))] * 2
  kernels = lowering.kernel_ir(step)
  assert [t for t, _ in kernels] == ['__gpu$xla.gpu.triton'] * 2
  for _, ir in kernels:
    dots = [line for line in ir.splitlines() if 'tt.dot ' in line]
    assert len(dots) == 2, dots  # q.k and p.v
    assert not any('inputPrecision' in d for d in dots), dots  # IEEE is the elided default
    elem = 'bf16' if dtype == 'bfloat16' else 'f32'
    assert all(f'x{elem}> *' in d and '-> tensor<' in d and 'xf32>' in d for d in dots), dots


def test_spec_engine_dots_lower_to_the_spec_dot_kernel_for_cuda():
  """The spec engine with dot_library='pallas' for cuda (how a GPU follows the written
  arithmetic): no dot is left for XLA:GPU's libraries to order; every one is the spec dot
  kernel, a loop over the terms with one `fma.rn.ftz.f32` per term and no Triton dot."""
  engine_config = EngineConfig(mode='spec', dot_library='pallas', cache_len=1024)
  try:
    lowered = lowering.lower_engine_functions(CONFIGS['gemma3_270m'], engine_config, 'cuda')
  except lowering.MissingComponent as e:
    pytest.xfail(f'missing component: {e.component} ({e})')
  for name, low in lowered.items():
    text = low.as_text()
    assert 'stablehlo.dot' not in text, name  # dot and dot_general
    assert lowering.custom_call_targets(text) == ['__gpu$xla.gpu.triton'], name
    kernels = lowering.kernel_ir(low)
    assert kernels, name
    for _, ir in kernels:
      assert ir.count(spec_dot.FMA_PTX.split()[0]) == 1 and 'scf.for' in ir, ir[:2000]
      assert 'tt.dot' not in ir
  # q, k/v, o, gate/up, down and the per-tile scores and values in the step; the output table's
  # chunks in the logits.
  assert len(lowering.kernel_ir(lowered['step'])) > 5
  assert len(lowering.kernel_ir(lowered['logits'])) >= 1


def test_triton_precision_marker_means_what_we_think():
  """Control for the check above: a float32 dot at default precision does show TF32."""
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import triton as pltriton

  def kernel(a_ref, b_ref, o_ref):
    o_ref[...] = jnp.dot(a_ref[...], b_ref[...])

  x = jax.ShapeDtypeStruct((64, 64), jnp.float32)
  f = pl.pallas_call(kernel, out_shape=x, compiler_params=pltriton.CompilerParams())
  try:
    [(_, ir)] = lowering.kernel_ir(jax.jit(f).trace(x, x).lower(lowering_platforms=('cuda',)))
  except RuntimeError as e:
    missing = lowering._classify(e, 'cuda')
    if missing is None:
      raise
    pytest.xfail(f'missing component: {missing.component}')
  assert 'inputPrecision = tf32' in ir


@pytest.mark.parametrize('dtype', ['float32', 'bfloat16'])
def test_mosaic_kernel_ir(dtype):
  """The 270M's kernel for tpu: a Mosaic module with the tile axis last and 'arbitrary',
  float32-precision matmuls, the call's 256 rows in 8 query blocks, and the cache walked in
  512-slot tiles (2 on the local ring of 1024 slots, 8 on the 4096-slot global cache)."""
  step = _get('gemma3_270m', 'tpu', 'pallas', dtype)['step']
  text = step.as_text()
  assert 'kernel_name = "gemma_pallas_attention"' in text
  assert '\\22needs_layout_passes\\22: true' in text  # layout passes run in the TPU compiler
  kernels = lowering.kernel_ir(step)
  assert [t for t, _ in kernels] == ['tpu_custom_call'] * 2
  bounds = set()
  for _, ir in kernels:
    assert 'stable_mosaic.version' in ir
    assert ('dimension_semantics = [#tpu.dimension_semantics<parallel>, '
            '#tpu.dimension_semantics<parallel>, #tpu.dimension_semantics<parallel>, '
            '#tpu.dimension_semantics<arbitrary>]') in ir
    matmuls = [line for line in ir.splitlines() if 'tpu.matmul' in line]
    assert len(matmuls) == 2 and all('#tpu.contract_precision<fp32>' in m for m in matmuls)
    bounds.update(re.findall(r'iteration_bounds = array<i64: ([\d, ]+)>', ir))
  assert bounds == {'1, 1, 8, 2', '1, 1, 8, 8'}


def test_tiny_head_dim_refused_by_mosaic_not_by_triton():
  """tiny_gemma3 (head dim 16): Triton takes it; the tpu driver refuses it by its own check
  (Mosaic blocks need H % 128 == 0) before lowering."""
  config = gcfg.get_config('tiny_gemma3')
  try:
    texts = lowering.lower_engine(config, _pinned(), 'cuda', 'pallas')
  except lowering.MissingComponent as e:
    pytest.xfail(f'missing component: {e.component}')
  assert lowering.kernel_calls(texts['step'], 'cuda') == ['__gpu$xla.gpu.triton']
  with pytest.raises(ValueError, match=r'Mosaic needs .*H=16'):
    lowering.lower_engine(config, _pinned(), 'tpu', 'pallas')
  texts = lowering.lower_engine(config, _pinned(), 'tpu', 'xla')
  assert lowering.custom_call_targets(texts['step']) == []


@pytest.mark.parametrize('platform', PLATFORMS)
def test_export(platform):
  """jax.export, which refuses custom calls without a compatibility guarantee: XLA attention
  exports for both platforms; the Mosaic call is guaranteed; the Triton call is not (an
  exported Triton kernel is tied to this jax version) and needs an explicit exemption."""
  config = CONFIGS['tiny_gemma3_h128']
  for attention in ATTENTIONS:
    if platform == 'cuda' and attention == 'pallas':
      with pytest.raises(ValueError, match='no compatibility guarantees'):
        lowering.export_engine(config, _pinned(), platform, attention)
      checks = [jax.export.DisabledSafetyCheck.custom_call('__gpu$xla.gpu.triton')]
    else:
      checks = []
    try:
      exported = lowering.export_engine(config, _pinned(), platform, attention,
                                        disabled_checks=checks)
    except lowering.MissingComponent as e:
      pytest.xfail(f'missing component: {e.component}')
    for name in lowering.FUNCTIONS:
      assert exported[name].platforms == (platform,)
      assert exported[name].mlir_module_serialized


def test_pallas_engine_uses_target_platform_blocks():
  """Cross-lowering builds the kernel for the target: the engine's fingerprinted blocks and
  its local ring (rounded to whole tiles) are the target's, not the host's."""
  config = CONFIGS['gemma3_270m']
  pinned = _pinned(attention='pallas')
  for platform, kernel_platform, ring in (('tpu', 'tpu', 1024), ('cuda', 'gpu', 768)):
    engine = lowering.abstract_engine(config, pinned, platform)
    assert engine._attention_fn.platform == kernel_platform
    assert not engine._attention_fn.interpret
    assert engine._kernel_blocks['256']['platform'] == kernel_platform
    assert engine._local_slots == ring  # 512 + 256 - 1 = 767 rounded up to the tile


def test_mosaic_gpu_lowering_available():
  """Mosaic GPU (the other Pallas GPU backend; not the one the kernel uses) lowers here too:
  a trivial kernel becomes a `mosaic_gpu_v2` call. The attention kernel's loop driver does not
  fit it as written: its [S, H] K/V blocks would sit in shared memory (measured: 594,952 bytes
  for S = 512, H = 128 float32, over the 232,448 available), so it stays on Triton."""
  from jax.experimental import pallas as pl
  try:
    from jax.experimental.pallas import mosaic_gpu as plmgpu
  except ImportError as e:
    pytest.xfail(f'missing component: jax.experimental.pallas.mosaic_gpu ({e})')

  def kernel(x_ref, o_ref):
    o_ref[...] = x_ref[...] + 1.0

  x = jax.ShapeDtypeStruct((128, 128), jnp.float32)
  f = pl.pallas_call(kernel, out_shape=x, compiler_params=plmgpu.CompilerParams())
  try:
    text = jax.jit(f).trace(x).lower(lowering_platforms=('cuda',)).as_text()
  except (ValueError, RuntimeError, ImportError) as e:
    missing = lowering._classify(e, 'cuda')
    if missing is None:
      raise
    pytest.xfail(f'missing component: {missing.component}')
  assert lowering.custom_call_targets(text) == ['mosaic_gpu_v2']


def test_lower_engine_names_unknown_platform():
  with pytest.raises(ValueError, match='unknown platform'):
    lowering.lower_engine(CONFIGS['tiny_gemma3_h128'], _pinned(), 'metal', 'xla')


def test_missing_component_is_named():
  """The messages JAX raises for absent lowering components map to a named component."""
  cases = {
      'Platform CUDA does not have a Triton compilation handler': 'Triton compilation handler',
      'Cannot lower pallas_call on platform: tpu. To use Pallas on TPU, install jaxlib TPU':
          'jax._src.pallas.mosaic',
      "No module named 'jax_triton'": 'jax_triton',
  }
  for message, component in cases.items():
    missing = lowering._classify(RuntimeError(message), 'cuda')
    assert missing is not None and component in missing.component, (message, missing)
  assert lowering._classify(ValueError('shapes do not match'), 'cuda') is None
