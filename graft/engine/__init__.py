"""The engine: a loaded model run under an EngineConfig, through the plan of its mode.

    from graft.engine import Engine, EngineConfig

    engine = Engine(gemma_jax.load('gemma3_270m'), EngineConfig())  # mode 'spec'
    ctx, logits = engine.prefill(tokens)                            # a Context
    ctx = engine.graft(rows, tokens)                                # verified KVRows -> Context

Modules: _engine (Engine), context (Context, Decoded, a call's rows, sampling), plans (PLANS:
one plan per mode), config (EngineConfig and `resolve_engine_config`, the one place a default
is decided), placement (where and in which form an engine holds
its weights), shared (what engines of one model share), fingerprint (what names a model and an
engine), canary and spec_check (the spec engine against the interpreter: at build, and whole),
lowering (the engine's functions for GPU and TPU without the hardware).
"""

from graft.engine import fingerprint, plans
from graft.engine._engine import Engine
from graft.engine.context import Context, Decoded, call_inputs, sample
from graft.engine.config import EngineConfig, resolve_engine_config
from graft.engine.plans import PLANS, SLOT_LAYOUT_VERSION

__all__ = ['PLANS', 'SLOT_LAYOUT_VERSION', 'Context', 'Decoded', 'Engine', 'EngineConfig',
           'call_inputs', 'fingerprint', 'plans', 'resolve_engine_config', 'sample']
