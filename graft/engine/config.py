"""EngineConfig: everything about an engine that can change the bits of its results, and the one
function that decides what a request leaves open.

    requested = EngineConfig(mode='spec', cache_len=2560)         # None: 'decide for me'
    engine_config = resolve_engine_config(model_config, requested) # every field decided
    engine = Engine(loaded, engine_config)

`resolve_engine_config` is the only place a default is chosen (from the mode's plan, the model
and the platform). Entry points call it with what their flags ask for; `Engine` calls it on
whatever it is given (a resolved config resolves to itself); plans read the resolved config and
decide nothing of it again.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from gemma_jax import attention as attention_lib
from gemma_jax import rope, sharding
from gemma_jax.config import TransformerConfig
from graft.engine import plans

# Older names of EngineConfig fields, as records made before a rename hold them. Retire in
# 0.2.0: by then every committed manifest and result will have been remade under the new names.
_RENAMED = {'engine': 'mode', 'block_size': 'rows_per_call', 'layout': 'mesh_layout'}


@dataclasses.dataclass(frozen=True)
class EngineConfig:
  """An engine configuration. `mode` names its plan (graft.engine.plans.PLANS): 'spec' (the
  written arithmetic, byte-exact on any machine that passes its self-check), 'pinned' (fixed
  reduction orders, byte-exact on one kind of machine), 'blocked' (the first pinned design),
  'default' (the plain fast path). Fields left None (rows_per_call, attention, dot_library,
  xla_flags) are decided by `resolve_engine_config`; an engine runs, records and fingerprints
  the resolved config."""

  mode: str = 'spec'
  rows_per_call: int | None = None  # pinned, spec: the most rows per call; blocked: exactly
  logits_rows: int = 1  # rows per logits call (pinned, spec, blocked)
  cache_len: int = 4096  # KV slots on global layers: the most tokens a context holds
  attention: str | None = None  # a name in gemma_jax.attention.IMPLEMENTATIONS
  attention_tile: int | None = None  # KV tile of the tiled / Pallas attention (None: default)
  matmul_precision: str = 'highest'  # jax.default_matmul_precision inside every call
  xla_flags: str | None = None  # the process's $XLA_FLAGS, which the engine must find
  # Fixed-order numerics: calls of 2 .. min_rows - 1 tokens are padded to min_rows rows (XLA:CPU
  # gives such small GEMMs kernels of their own); k_chunk: the contraction chunk of every
  # projection; dot_library (pinned and spec only): 'eigen' (YNNPACK dot fusion off), 'ynn'
  # (XLA's default) or, for mode spec, 'native' (the spec's contractions as our own CPU kernels)
  # or 'pallas' (the spec's dot as a Pallas kernel: how an accelerator follows it).
  min_rows: int = 8
  k_chunk: int = 256
  dot_library: str | None = None
  # Devices: '' (one) or a mesh ('model:4', 'model:2,data:2'; gemma_jax/sharding.py) and its
  # layout: 'gather' (no contraction ever split) or 'split' (Megatron).
  mesh: str = ''
  mesh_layout: str = 'gather'

  def __post_init__(self):
    """Refuses a value no engine can run (given fields only: None is decided later)."""
    plan = plans.plan_class(self.mode)
    if self.attention is not None and self.attention not in attention_lib.IMPLEMENTATIONS:
      raise ValueError(f'unknown attention {self.attention!r}; expected one of '
                       f'{tuple(attention_lib.IMPLEMENTATIONS)}')
    if self.dot_library is not None and self.dot_library not in plan.dot_libraries:
      raise ValueError(f'dot library {self.dot_library!r} is not one of mode {self.mode}\'s: '
                       f'{plan.dot_libraries or "none: XLA computes its dots"}')
    rows = self.rows_per_call if self.rows_per_call is not None else 1
    if (rows < 1 or self.logits_rows < 1 or self.cache_len < rows or self.min_rows < 1
        or self.k_chunk < 1):
      raise ValueError(f'invalid engine config {self}: need 1 <= rows_per_call <= cache_len and '
                       'logits_rows, min_rows, k_chunk >= 1')
    if self.mesh_layout not in sharding.LAYOUTS:
      raise ValueError(f'unknown mesh layout {self.mesh_layout!r}; expected one of '
                       f'{sharding.LAYOUTS}')
    if self.mesh:
      sharding.parse_mesh(self.mesh)  # raises on a malformed mesh
    plan.check(self)

  @property
  def resolved(self) -> bool:
    """Whether every field is decided (`resolve_engine_config` returns such configs)."""
    return None not in (self.rows_per_call, self.attention, self.xla_flags) and (
        self.dot_library is not None or not plans.plan_class(self.mode).dot_libraries)

  @classmethod
  def from_dict(cls, values: dict) -> 'EngineConfig':
    """From its JSON form. Also reads older records (until 0.2.0): fields under their old names,
    a 'pinned' record made before the fixed-order design (no k_chunk) describes the blocked
    engine, which is what made it, and a dot library recorded for a mode that has none (XLA's
    dots, which records of 'default' and 'blocked' named 'eigen') is dropped."""
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
    if not plans.plan_class(values['mode']).dot_libraries:
      values.pop('dot_library', None)
    return cls(**values)


def resolve_engine_config(model_config: TransformerConfig,
                          requested: EngineConfig | None = None, *,
                          platform: str | None = None,
                          fit: Literal['rows', 'cache'] | None = None) -> EngineConfig:
  """The configuration an engine of `model_config` runs under: `requested` (what the flags or
  the caller ask for; None: every default) with each field it leaves None decided, here and
  nowhere else.

  Args:
    model_config: the model's TransformerConfig (its RoPE mode decides which attention runs).
    requested: the asked-for EngineConfig; fields left None are decided.
    platform: the backend the engine's kernels run on ('cpu', 'gpu', 'tpu'; None: this
      process's default backend), which decides the spec engine's default dot library.
    fit: how an engine is sized for what it was asked rather than refused for it (None: it is
      refused, ValueError, where cache_len < rows_per_call): 'rows' (the cache was asked for:
      rows_per_call left None is at most cache_len) or 'cache' (cache_len is raised to
      rows_per_call); either way cache_len ends at least rows_per_call.

  Returns:
    The resolved EngineConfig: rows_per_call the plan's default; attention the plan's where the
    model's RoPE mode supports it, else 'xla'; dot_library the plan's default for the platform
    (None for plans that have no choice of them); xla_flags the process's $XLA_FLAGS. Raises
    ValueError, with the reason, where the model cannot run the attention asked for.
  """
  config = requested if requested is not None else EngineConfig()
  plan = plans.plan_class(config.mode)
  attention = config.attention
  if attention is None:
    supported = rope.get_mode(model_config.rope_mode).attention
    attention = plan.default_attention if plan.default_attention in supported else 'xla'
  rope.check_attention(model_config.rope_mode, attention)
  rows, cache_len = config.rows_per_call, config.cache_len
  if rows is None:
    rows = min(plan.default_rows, cache_len) if fit == 'rows' else plan.default_rows
  if fit is not None:
    cache_len = max(cache_len, rows)
  return dataclasses.replace(
      config, attention=attention, rows_per_call=rows, cache_len=cache_len,
      dot_library=(config.dot_library if config.dot_library is not None
                   else plan.default_dot_library(platform)),
      xla_flags=config.xla_flags if config.xla_flags is not None else sharding.xla_flags())
