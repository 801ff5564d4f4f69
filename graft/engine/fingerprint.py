"""Fingerprints: SHA-256 digests that name a model and an engine configuration.

An artifact records both; a restore that finds either different refuses to graft. The model
fingerprint covers every parameter's bytes (with name, dtype and shape), the config and the
tokenizer. The engine fingerprint covers everything else that can change bits: the pinned
configuration, the layout version, the jax/jaxlib versions, the backend and device kind, the CPU's vector extensions
and the XLA flags in effect. The thread count is deliberately not in it: the pinned engine is
invariant to it (tests/test_threads.py shows this), so artifacts move between machines with
different core counts.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import json
import platform

import jax
import jaxlib
import numpy as np

from gemma_jax import sharding
from gemma_jax.checkpoints import tree

# CPU flags that can change which kernels XLA emits; the rest of /proc/cpuinfo does not matter.
_ISA_PREFIXES = ('sse', 'ssse', 'avx', 'fma', 'f16c', 'amx', 'bmi', 'vnni', 'neon', 'asimd', 'sve')


def canonical_json(value) -> str:
  def default(obj):
    if dataclasses.is_dataclass(obj):
      return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if isinstance(obj, enum.Enum):
      return obj.value
    raise TypeError(f'cannot fingerprint {type(obj).__name__}')
  return json.dumps(value, sort_keys=True, separators=(',', ':'), default=default)


def digest(value) -> str:
  return hashlib.sha256(canonical_json(value).encode()).hexdigest()


def params_digest(params) -> str:
  """SHA-256 over every parameter: name, dtype, shape and raw bytes, in sorted name order."""
  h = hashlib.sha256()
  for name, leaf in tree.flatten(params).items():
    array = np.ascontiguousarray(np.asarray(leaf))
    h.update(f'{name}|{array.dtype.name}|{array.shape}|'.encode())
    h.update(array.tobytes())
  return h.hexdigest()


def model_fingerprint(loaded) -> dict:
  """Fingerprint of a `gemma_jax.weights.LoadedModel`: {'sha256', and what went into it}."""
  parts = {
      'config': loaded.config,
      'dtype': loaded.dtype,
      'params_sha256': params_digest(loaded.params),
      'tokenizer_sha256': hashlib.sha256(loaded.tokenizer.model_proto).hexdigest(),
  }
  return {'sha256': digest(parts), 'model': loaded.config.name, 'weights': loaded.weights,
          **{k: v for k, v in parts.items() if k != 'config'}}


def _cpuinfo() -> dict[str, str]:
  """The first processor's fields of /proc/cpuinfo ({} where there is none)."""
  fields = {}
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if not line.strip():
          break
        name, _, value = line.partition(':')
        fields[name.strip()] = value.strip()
  except OSError:
    pass
  return fields


def cpu_features() -> list[str]:
  flags = _cpuinfo().get('flags') or _cpuinfo().get('Features')
  if not flags:
    return [platform.machine()]
  return sorted({flag for flag in flags.split() if flag.startswith(_ISA_PREFIXES)})


def cpu_model() -> str:
  """Vendor, family and model: the same vector extensions on another CPU model can give other
  bits (XLA:CPU's rsqrt comes from a vendor-defined hardware estimate; docs/determinism.md), so
  the fingerprints of the machine-bound plans record it."""
  info = _cpuinfo()
  return '/'.join(info.get(k, '?') for k in ('vendor_id', 'cpu family', 'model'))


def environment() -> dict:
  """What besides the pinned config decides the bits of a computation on this machine."""
  device = jax.devices()[0]
  return {
      'jax': jax.__version__,
      'jaxlib': jaxlib.__version__,
      'backend': jax.default_backend(),
      'device_kind': device.device_kind,
      'device_count': jax.device_count(),
      'machine': platform.machine(),
      'cpu_features': cpu_features() if jax.default_backend() == 'cpu' else [],
      'cpu_model': cpu_model() if jax.default_backend() == 'cpu' else '',
      'xla_flags': sharding.xla_flags(),
  }


def engine_fingerprint(engine_config, dtype: str, *, slot_layout_version: int,
                       kernel_blocks: dict | None = None, plan: dict | None = None) -> dict:
  """Fingerprint of an engine: its config, dtype, slot layout version, kernel blocks, what its
  plan records (numerics) and the environment: {'sha256', and what went into it}."""
  parts = {'engine_config': engine_config, 'dtype': dtype,
           'slot_layout_version': slot_layout_version, 'environment': environment()}
  if kernel_blocks:
    parts['kernel_blocks'] = kernel_blocks
  if plan:
    parts['plan'] = plan
  return {'sha256': digest(parts), **json.loads(canonical_json(parts))}
