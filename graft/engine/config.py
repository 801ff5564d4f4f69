"""EngineConfig: everything about an engine that can change the bits of its results."""

from __future__ import annotations

import dataclasses

from gemma_jax import attention as attention_lib
from gemma_jax import sharding
from graft.engine import plans

# Older names of EngineConfig fields, as records made before a rename hold them.
_RENAMED = {'engine': 'mode', 'block_size': 'rows_per_call', 'layout': 'mesh_layout'}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """An engine configuration. `mode` names its plan (graft.engine.plans.PLANS): 'spec' (the
  written arithmetic, byte-exact on any machine that passes its self-check), 'pinned' (fixed
  reduction orders, byte-exact on one kind of machine), 'blocked' (the first pinned design),
  'default' (the plain fast path). rows_per_call and attention left None take the plan's
  default (and the Engine records the value it used)."""

  mode: str = 'spec'
  rows_per_call: int | None = None  # pinned, spec: the most rows per call; blocked: exactly
  logits_rows: int = 1  # rows per logits call (pinned, spec, blocked)
  cache_len: int = 4096  # KV slots on global layers: the most tokens a context holds
  attention: str | None = None  # a name in gemma_jax.attention.IMPLEMENTATIONS
  attention_tile: int | None = None  # KV tile of the tiled / Pallas attention (None: default)
  matmul_precision: str = 'highest'  # jax.default_matmul_precision inside every call
  xla_flags: str | None = None  # None: the process's $XLA_FLAGS, which the engine must find
  # Fixed-order numerics: calls of 2 .. min_rows - 1 tokens are padded to min_rows rows (XLA:CPU
  # gives such small GEMMs kernels of their own); k_chunk: the contraction chunk of every
  # projection; dot_library: 'eigen' (YNNPACK dot fusion off), 'ynn' (XLA's default) or, for
  # mode spec, 'native' (the spec's contractions as our own CPU kernels) or 'pallas' (the spec's
  # dot as a Pallas kernel: how an accelerator follows it); None: the plan's default, which the
  # Engine records (spec: native on a CPU where a C++ compiler is found, pallas on an
  # accelerator, else eigen; the others: eigen).
  min_rows: int = 8
  k_chunk: int = 256
  dot_library: str | None = None
  # Devices: '' (one) or a mesh ('model:4', 'model:2,data:2'; gemma_jax/sharding.py) and its
  # layout: 'gather' (no contraction ever split) or 'split' (Megatron).
  mesh: str = ''
  mesh_layout: str = 'gather'

  def __post_init__(self):
    if self.xla_flags is None:
      object.__setattr__(self, 'xla_flags', sharding.xla_flags())
    plan = plans.plan_class(self.mode)
    if self.rows_per_call is None:
      object.__setattr__(self, 'rows_per_call', plan.default_rows)
    if self.attention is not None and self.attention not in attention_lib.IMPLEMENTATIONS:
      raise ValueError(f'unknown attention {self.attention!r}; expected one of '
                       f'{tuple(attention_lib.IMPLEMENTATIONS)}')
    if self.dot_library is not None and self.dot_library not in plan.dot_libraries:
      raise ValueError(f'dot library {self.dot_library!r} is not one of mode {self.mode}\'s: '
                       f'{plan.dot_libraries}')
    if (self.rows_per_call < 1 or self.logits_rows < 1 or self.cache_len < self.rows_per_call
        or self.min_rows < 1 or self.k_chunk < 1):
      raise ValueError(f'invalid engine config {self}: need 1 <= rows_per_call <= cache_len and '
                       'logits_rows, min_rows, k_chunk >= 1')
    if self.mesh_layout not in sharding.LAYOUTS:
      raise ValueError(f'unknown mesh layout {self.mesh_layout!r}; expected one of '
                       f'{sharding.LAYOUTS}')
    if self.mesh:
      sharding.parse_mesh(self.mesh)  # raises on a malformed mesh
    plan.check(self)

  @classmethod
  def from_dict(cls, values: dict) -> 'EngineConfig':
    """From its JSON form. Also reads older records: fields under their old names, and a
    'pinned' record made before the fixed-order design (no k_chunk) describes the blocked
    engine, which is what made it."""
    if not isinstance(values, dict):
      raise ValueError(f'an engine config must be a JSON object, not {type(values).__name__}')
    values = {_RENAMED.get(k, k): v for k, v in values.items()}
    if 'k_chunk' not in values and values.get('mode', 'pinned') == 'pinned':
      values['mode'] = 'blocked'
    values.setdefault('mode', 'pinned')  # records older than the spec plan
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f'unknown engine config fields {unknown}')
    return cls(**values)
