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

import ast
import functools
import hashlib
import json
import os
import platform
from typing import Any

import jax
import jaxlib

from gemma_jax import host as host_lib
from gemma_jax import sharding
from gemma_jax.digest import canonical_json

# CPU flags that can change which kernels XLA emits; the rest of /proc/cpuinfo does not matter.
_ISA_PREFIXES = ('sse', 'ssse', 'avx', 'fma', 'f16c', 'amx', 'bmi', 'vnni', 'neon', 'asimd', 'sve')


def digest(value: Any) -> str:
  """The SHA-256 (hex) of `value` as canonical JSON (gemma_jax.digest.canonical_json)."""
  return hashlib.sha256(canonical_json(value)).hexdigest()


def model_fingerprint(loaded: Any) -> dict:
  """Fingerprint of a `gemma_jax.weights.LoadedModel`: {'sha256', what went into it, and the
  model's name and weights spec (not hashed: two names of the same bytes are one model)}."""
  parts = {
      'config': json.loads(canonical_json(loaded.config)),
      'dtype': loaded.dtype,
      'params_sha256': loaded.params_sha256,
      'tokenizer_sha256': hashlib.sha256(loaded.tokenizer.model_proto).hexdigest(),
  }
  return {'sha256': digest(parts), **parts, 'model': loaded.config.name,
          'weights': loaded.weights}


# Fields of a fingerprint that are recorded beside what its sha256 covers (names, provenance).
_UNHASHED = ('sha256', 'model', 'weights', 'made_on')


def hashes_to_its_fields(record: Any) -> bool:
  """Whether a recorded fingerprint's sha256 is the digest of the fields recorded beside it
  (a record whose fields were changed and whose sha256 was kept, or resealed under the old
  one, does not)."""
  if not isinstance(record, dict) or not isinstance(record.get('sha256'), str):
    return False
  try:
    return digest({k: v for k, v in record.items() if k not in _UNHASHED}) == record['sha256']
  except (TypeError, ValueError):
    return False


# The fields of a spec engine's fingerprint that decide its bits -> what a record made before the
# field existed stands for (None: every record has it).
_SPEC_BITS = {'mode': None, 'numerics': None, 'attention': None, 'attention_tile': None,
              'rows_per_call': None, 'dtype': None, 'slot_layout_version': None, 'rope': 'float'}


def engine_differences(mine: dict, theirs: Any,
                       labels: tuple[str, str] = ('the record has', 'expected')) -> list[str]:
  """How KV computed under the recorded engine fingerprint `theirs` may differ from what the
  engine of fingerprint `mine` computes: [] when it is the same. Spec fingerprints compare what
  decides a spec engine's bits (a record made before a field existed is read with the value it
  stood for; one without a canary predates it, and its spec version vouches for it), so a
  release that moves no bit keeps every artifact and store; other fingerprints, which bind the
  source and the machine, compare whole."""
  if not isinstance(theirs, dict):
    return ['the record has no engine fingerprint']
  if mine.get('mode') == 'spec' and theirs.get('mode') == 'spec':
    version = lambda fp: (fp.get('numerics') or {}).get('version')
    if version(theirs) != version(mine):
      return [f'spec version: made under spec version {version(theirs)}, this engine computes '
              f'spec version {version(mine)} (each version names its own bits)']
    read = lambda fp: {k: fp.get(k, default) for k, default in _SPEC_BITS.items()}
    out = differences(read(mine), read(theirs), labels=labels)
    if theirs.get('canary') is not None and theirs['canary'] != mine.get('canary'):
      out.append(f'canary: {labels[0]} {theirs["canary"]!r}, {labels[1]} {mine.get("canary")!r}')
    return out
  if theirs.get('sha256') == mine.get('sha256'):
    return []
  return [d for d in differences(mine, theirs, labels=labels) if not d.startswith(('sha256', 'made_on'))
          ] or ['the fingerprints differ']


def differences(expected: Any, actual: Any, prefix: str = '',
                labels: tuple[str, str] = ('the artifact has', 'expected')) -> list[str]:
  """Readable differences between two JSON-like values, e.g.
  ['engine_config.rows_per_call: the artifact has 8, expected 16']; `labels` name the actual
  and the expected side."""
  if isinstance(expected, dict) and isinstance(actual, dict):
    return [d for key in sorted(set(expected) | set(actual))
            for d in differences(expected.get(key), actual.get(key), f'{prefix}{key}.', labels)]
  if expected == actual:
    return []
  return [f'{prefix.rstrip(".")}: {labels[0]} {actual!r}, {labels[1]} {expected!r}']


@functools.lru_cache(maxsize=1)
def source_digest() -> str:
  """SHA-256 of the code of the source files that decide an engine's bits (the model, its
  numerics and the written arithmetic, the engine and its plans, the slot layout): bound into
  the fingerprints of the engines whose bits are the compiler's (pinned, blocked), so that
  changed code never reuses KV computed by the old (edited comments and docstrings do not
  count). The spec engine's fingerprint binds its spec version and canary instead
  (graft/engine/canary.py)."""
  root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
  h = hashlib.sha256()
  for relative in _SOURCES:
    with open(os.path.join(root, relative)) as f:
      h.update(relative.encode() + b'\0' + _code_only(f.read()).encode() + b'\0')
  return h.hexdigest()


def _code_only(source: str) -> str:
  """The program in `source` without its comments, docstrings and layout (its AST), so that
  editing prose does not change the digest."""
  tree = ast.parse(source)
  for node in ast.walk(tree):
    if not isinstance(node, _BLOCKS):
      continue
    body = node.body
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
        and isinstance(body[0].value.value, str)):
      node.body = body[1:] or [ast.Pass()]
  return ast.dump(tree, annotate_fields=False)


# The nodes whose `body` is a list of statements (a string first in one is prose).
_BLOCKS = (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.For, ast.AsyncFor,
           ast.While, ast.If, ast.With, ast.AsyncWith, ast.Try, ast.TryStar, ast.ExceptHandler,
           ast.match_case)


_SOURCES = tuple(f'gemma_jax/{m}.py' for m in (
    'model', 'modules', 'layers', 'attention', 'tiled_attention', 'rope', 'numerics', 'kv_state',
    'pytree', 'sizes', 'spec/functions', 'kernels/online_softmax', 'kernels/pallas_attention')) + (
    'graft/engine/_engine.py', 'graft/engine/context.py', 'graft/engine/placement.py',
    'graft/engine/plans.py')


_cpuinfo = host_lib.cpuinfo


def cpu_features() -> list[str]:
  """The CPU's vector-extension flags that can change which kernels XLA emits, sorted (the
  machine name where /proc/cpuinfo has none)."""
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


def host() -> dict:
  """The machine a result was made on, as its results record it (docs: results differ by CPU
  only where the arithmetic is a library's choice; this says which CPU made each one)."""
  info = _cpuinfo()
  return {'cpu_model': cpu_model(), 'cpu_name': info.get('model name', platform.processor()),
          'machine': platform.machine(), 'cores': os.cpu_count()}


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
      # Eigen's blocking of a contraction follows it (gemma_jax.host.intra_op_threads).
      'intra_op_threads': (host_lib.intra_op_threads() if jax.default_backend() == 'cpu'
                           else 0),
  }


def engine_fingerprint(engine_config: Any, dtype: str, *, slot_layout_version: int,
                       kernel_blocks: dict | None = None, plan: dict | None = None) -> dict:
  """Fingerprint of an engine: its config, dtype, slot layout version, kernel blocks, what its
  plan records (numerics) and the environment: {'sha256', and what went into it}."""
  parts = {'engine_config': engine_config, 'dtype': dtype,
           'slot_layout_version': slot_layout_version, 'source_sha256': source_digest(),
           'environment': environment()}
  if kernel_blocks:
    parts['kernel_blocks'] = kernel_blocks
  if plan:
    parts['plan'] = plan
  return {'sha256': digest(parts), **json.loads(canonical_json(parts))}
