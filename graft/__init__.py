"""Byte-exact grafting: the engine, verified persistence of KV, and the knowledge flywheel.

    from graft.engine import Engine, EngineConfig
    from graft.store import Store, artifact

    engine = Engine(gemma_jax.load('gemma3_270m'), EngineConfig())
    library, _ = engine.prefill(tokens, logits='none')               # a Context
    artifact.save('/tmp/library', engine, library)
    ctx = artifact.graft(engine, artifact.load('/tmp/library', engine))
    ctx, logits = engine.extend(ctx, query, logits='all')            # byte-equal to fresh

Rooms, one concern each:
  graft.engine     the runtime: Engine, EngineConfig, the plans of its modes, fingerprints,
                   lowering for GPU and TPU
  graft.store      persistence: artifacts, the block format, the kvstore, the Store
  graft.knowledge  the application: tasks, verifiers, the library, the flywheel loop
  graft.exactness  experiment support: the one fresh-versus-graft check
  graft.shift      experiment support: shifted grafts for the position experiments
  graft.faults     experiment support: the fault campaign over the store and artifacts
"""

from graft.engine import Context, Engine, EngineConfig

__all__ = ['Context', 'Engine', 'EngineConfig']
