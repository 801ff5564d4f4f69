"""Lowering the engine's compiled functions for a platform this host does not have.

JAX lowers a jitted function for any platform it knows, whatever it runs on
(`jax.jit(f).trace(*args).lower(lowering_platforms=('tpu',))`, `jax.export`), and the Pallas
kernels lower too: the tpu driver to Mosaic (a `tpu_custom_call` carrying the serialized Mosaic
module), the gpu driver to Triton (a `__gpu$xla.gpu.triton` custom call carrying the Triton IR).
So a CPU-only machine can check that the engine's two functions, with either attention,
get through JAX's lowering for `cuda` and `tpu`, and that the kernel is in the module:

    texts = lower_engine(config, EngineConfig(attention='pallas'), 'tpu')
    texts['step'], texts['logits']      # StableHLO text

Everything is abstract (jax.ShapeDtypeStruct parameters, KV state and inputs), so no weights are
read and nothing big is allocated: the 270M lowers as cheaply as a tiny config.

What lowering does not check (it needs the device's compiler): Mosaic's layout passes and the
TPU compile (`needs_layout_passes: true` in the backend config: libtpu runs them), the Triton
compile to PTX (XLA:GPU runs it), and numerics. A device check runs the same functions.

Missing components raise `MissingComponent` naming the component, never a silent pass.

Why in graft.engine: it builds the engine's own functions (`Engine.step_function`,
`head_function`, with `kernel_platform` naming the target) and must follow every change to them;
no user calls it, tests/test_lowering.py and a device check do.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from typing import Any, Sequence

import jax
import jax.numpy as jnp
from jax._src.interpreters import mlir
from jaxlib.mlir import ir
from jaxlib.mlir.passmanager import PassManager

from gemma_jax import config as gcfg
from gemma_jax import model as gmodel
from gemma_jax.config import TransformerConfig
from gemma_jax.tokenizer import synthetic_tokenizer
from gemma_jax.weights import LoadedModel
from graft.engine import Engine, EngineConfig

# Lowering platform (jax's name) -> the Pallas kernel's platform (its block table and driver).
PLATFORMS = {'cuda': 'gpu', 'rocm': 'gpu', 'tpu': 'tpu', 'cpu': 'cpu'}
# The custom-call target of the Pallas kernel in the lowered module, per lowering platform.
# jaxlib <= 0.10.2 lowers Triton kernels to XLA's Triton fusion (`__gpu$xla.gpu.triton`, the IR
# in the backend config, compiled by XLA:GPU); later jaxlibs compile the IR to PTX at lowering
# (`triton_kernel_call_ffi`). Mosaic GPU kernels (not this project's driver) are `mosaic_gpu_v2`.
KERNEL_TARGETS = {
    'cuda': ('__gpu$xla.gpu.triton', 'triton_kernel_call', 'triton_kernel_call_ffi',
             'mosaic_gpu', 'mosaic_gpu_v2'),
    'rocm': ('__gpu$xla.gpu.triton', 'triton_kernel_call', 'triton_kernel_call_ffi'),
    'tpu': ('tpu_custom_call',),
    'cpu': (),
}
FUNCTIONS = ('step', 'logits')
KERNEL_NAME = 'gemma_pallas_attention'  # pl.pallas_call(name=...) in gemma_jax.kernels


class MissingComponent(RuntimeError):
  """A lowering needs a component this jax/jaxlib install lacks. `component` names it."""

  def __init__(self, component: str, platform: str, cause: BaseException):
    self.component = component
    self.platform = platform
    super().__init__(f'lowering for {platform} needs {component}, which this install '
                     f'(jax {jax.__version__}) lacks: {type(cause).__name__}: {cause}')


# (pattern of the error message, the component it means)
_MISSING = (
    (r'does not have a Triton compilation handler',
     "a Triton compilation handler (registered by jaxlib's CUDA/ROCm plugin, "
     'jax-cuda12-plugin / jax-cuda13-plugin / jax-rocm-plugin); jaxlib > 0.10.2 compiles '
     'Pallas Triton kernels to PTX while lowering'),
    (r'Cannot lower pallas_call on platform: gpu',
     'the Pallas GPU lowering (jax._src.pallas.triton or jax._src.pallas.mosaic_gpu, and '
     'jaxlib.triton / jaxlib.mosaic)'),
    (r'Cannot lower pallas_call on platform: tpu',
     'the Pallas TPU lowering (jax._src.pallas.mosaic and the jaxlib.mosaic TPU dialect)'),
    # A module of jax's, jaxlib's or a device plugin's: the module itself is the component (a
    # missing module of this project's is a bug, never a component: it is raised).
    (r'No module named [\'"]?((?:jax\w*|triton|libtpu)(?:\.[\w.]+)?)', None),
)


def _classify(error: BaseException, platform: str) -> MissingComponent | None:
  message = str(error)
  for pattern, component in _MISSING:
    match = re.search(pattern, message)
    if match:
      return MissingComponent(component or f'the Python module {match.group(1)}', platform, error)
  return None


def abstract_engine(config: TransformerConfig, engine_config: EngineConfig, platform: str, *,
                    dtype: str = 'float32') -> Engine:
  """An Engine over abstract parameters whose Pallas kernel (if any) is built for `platform`
  (a lowering platform: 'cuda', 'rocm', 'tpu', 'cpu'). Its functions lower; they do not run."""
  if platform not in PLATFORMS:
    raise ValueError(f'unknown platform {platform!r}; expected one of {sorted(PLATFORMS)}')
  dtype = jnp.dtype(dtype).name
  # (a synthetic tokenizer: lowering reads no token, and builds no model fingerprint)
  loaded = LoadedModel(config=config, params=gmodel.abstract_params(config, dtype),
                       tokenizer=synthetic_tokenizer(max(config.vocab_size, 260)),
                       weights='abstract', dtype=dtype)
  return Engine(loaded, engine_config, kernel_platform=PLATFORMS[platform])


def abstract_inputs(engine: Engine) -> dict[str, tuple]:
  """The abstract arguments of the step and logits functions for one call of each with the most
  rows a call has."""
  config, engine_config = engine.model_config, engine.engine_config
  i32 = jnp.int32
  kv = jax.eval_shape(engine.empty_kv)
  rows = engine.max_rows
  params = engine.params
  return {
      'step': (params, jax.ShapeDtypeStruct((1, rows), i32),
               jax.ShapeDtypeStruct((1, rows), i32), kv),
      'logits': (params, jax.ShapeDtypeStruct((1, rows, config.embed_dim), engine.dtype),
                 jax.ShapeDtypeStruct((engine_config.logits_rows,), i32),
                 jax.ShapeDtypeStruct((), i32)),
  }


def _functions(engine: Engine) -> dict:
  return {'step': engine.step_function(), 'logits': engine.head_function()}


def lower_engine_functions(config: TransformerConfig, engine_config: EngineConfig, platform: str,
                           attention: str | None = None, *,
                           dtype: str = 'float32') -> dict[str, jax.stages.Lowered]:
  """{'step', 'logits'} -> jax.stages.Lowered for `platform`. `attention` ('xla', 'pallas')
  overrides engine_config.attention. Raises MissingComponent when this install cannot lower it."""
  if attention is not None:
    engine_config = dataclasses.replace(engine_config, attention=attention)
  engine = abstract_engine(config, engine_config, platform, dtype=dtype)
  args = abstract_inputs(engine)
  lowered = {}
  for name, fn in _functions(engine).items():
    try:
      lowered[name] = fn.jitted.trace(*args[name]).lower(lowering_platforms=(platform,))
    except (ValueError, RuntimeError, ImportError, NotImplementedError) as e:
      missing = _classify(e, platform)
      if missing is not None:
        raise missing from e
      raise
  return lowered


def lower_engine(config: TransformerConfig, engine_config: EngineConfig, platform: str,
                 attention: str | None = None, *, dtype: str = 'float32') -> dict[str, str]:
  """{'step', 'logits'} -> the StableHLO text of the engine's function lowered for `platform`."""
  return {name: low.as_text() for name, low in
          lower_engine_functions(config, engine_config, platform, attention,
                                 dtype=dtype).items()}


def export_engine(config: TransformerConfig, engine_config: EngineConfig, platform: str,
                  attention: str | None = None, *, dtype: str = 'float32',
                  disabled_checks: Sequence[Any] = ()) -> dict[str, jax.export.Exported]:
  """The same functions through jax.export (serializable; stricter: custom calls without a
  compatibility guarantee, such as the Triton one, need `disabled_checks`)."""
  if attention is not None:
    engine_config = dataclasses.replace(engine_config, attention=attention)
  engine = abstract_engine(config, engine_config, platform, dtype=dtype)
  args = abstract_inputs(engine)
  return {name: jax.export.export(fn.jitted, platforms=[platform],
                                  disabled_checks=list(disabled_checks))(*args[name])
          for name, fn in _functions(engine).items()}


# ---------------------------------------------------------------------------------------------
# Reading the lowered module.


def custom_call_targets(text: str) -> list[str]:
  """The custom-call targets of a StableHLO text, sorted, each once."""
  return sorted(set(re.findall(r'stablehlo\.custom_call @([\w$.]+)', text)))


def kernel_calls(text: str, platform: str) -> list[str]:
  """The custom-call targets in `text` that are Pallas kernels for `platform`."""
  return [t for t in custom_call_targets(text) if t in KERNEL_TARGETS[platform]]


def _custom_call_ops(module) -> list:
  ops = []

  def walk(op):
    for region in op.regions:
      for block in region.blocks:
        for child in block.operations:
          if child.operation.name == 'stablehlo.custom_call':
            ops.append(child.operation)
          walk(child.operation)

  walk(module.operation)
  return ops


def kernel_ir(lowered: jax.stages.Lowered) -> list[tuple[str, str]]:
  """(target, kernel IR as text) for each Pallas kernel call in a lowered function: the Mosaic
  module of a `tpu_custom_call` (deserialized from its backend config) or the Triton module of
  a `__gpu$xla.gpu.triton` call. Lets a test check what the kernel compiles from (for example
  the dot precision) without the device."""

  out = []
  for op in _custom_call_ops(lowered.compiler_ir('stablehlo')):
    target = ir.StringAttr(op.attributes['call_target_name']).value
    if target == 'tpu_custom_call':
      from jax.experimental.mosaic.dialects import tpu  # Mosaic's dialect (heavy): TPU kernels only
      config = json.loads(ir.StringAttr(op.attributes['backend_config']).value)
      body = base64.b64decode(config['custom_call_config']['body'])
      ctx = mlir.make_ir_context()
      tpu.register_dialect(ctx)
      with ctx, ir.Location.unknown():
        ctx.allow_unregistered_dialects = True
        module = ir.Module.parse(body)
        PassManager.parse('builtin.module(mosaic-serde{serialize=false})').run(module.operation)
        out.append((target, str(module)))
    elif target == '__gpu$xla.gpu.triton':
      from jaxlib.triton import dialect as tt  # Triton's dialect: GPU kernels only
      body = op.attributes['mhlo.backend_config']['ir'].value_bytes
      ctx = mlir.make_ir_context()
      tt.register_dialect(ctx)
      with ctx, ir.Location.unknown():
        out.append((target, str(ir.Module.parse(body))))
  return out


def summary(config_names: Sequence[str] = ('tiny_gemma3', 'gemma3_270m'),
            platforms: Sequence[str] = ('cuda', 'tpu'), dtype: str = 'float32') -> list[dict]:
  """One row per (config, platform, attention, function): the custom-call targets of the
  lowered module, or the error / missing component. For a device check: compare with the
  host's own compile of the same functions."""
  rows = []
  engine_config = EngineConfig()  # the default engine (spec)
  for name in config_names:
    for platform in platforms:
      for attention in ('xla', 'pallas'):
        row: dict[str, Any] = dict(config=name, platform=platform, attention=attention,
                                   dtype=dtype)
        try:
          texts = lower_engine(gcfg.get_config(name), engine_config, platform, attention,
                               dtype=dtype)
        except MissingComponent as e:
          rows.append(dict(row, missing=e.component, error=str(e)))
          continue
        except ValueError as e:  # e.g. the tpu driver refusing a head dim
          rows.append(dict(row, error=f'{type(e).__name__}: {e}'))
          continue
        for function, text in texts.items():
          rows.append(dict(row, function=function, custom_calls=custom_call_targets(text),
                           chars=len(text)))
  return rows


if __name__ == '__main__':
  import sys
  names = tuple(sys.argv[1:]) or ('tiny_gemma3', 'gemma3_270m')
  print(json.dumps({'jax': jax.__version__, 'backend': jax.default_backend(),
                    'rows': summary(names)}, indent=1))
