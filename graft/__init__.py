"""Byte-exact grafting: the engine, verified persistence of KV, and the knowledge flywheel.

    from graft.engine import Engine, EngineConfig
    from graft.store import Store, artifact

    engine = Engine(gemma_jax.load('gemma3_270m'), EngineConfig())
    library, _ = engine.prefill(tokens, logits='none')               # a Context
    artifact.save('/tmp/library', engine, library)
    ctx = artifact.graft(engine, artifact.load('/tmp/library', engine))
    ctx, logits = engine.extend(ctx, query, logits='all')            # byte-equal to fresh

Rooms, one concern each (each imports only those listed after it; docs/architecture.md):
  graft.replay     recomputing a committed manifest's records and comparing their hashes
  graft.exactness  the one fresh-versus-graft check (shared by the experiments, the replay and
                   a user checking a graft)
  graft.shift      shifted grafts: a library's rows placed at other positions
  graft.knowledge  the application: tasks, verifiers, the library, the flywheel loop
  graft.store      persistence: artifacts, the block format, the kvstore, the Store
  graft.engine     the runtime: Engine, EngineConfig, the plans of its modes, fingerprints, the
                   canary and the spec check, lowering for GPU and TPU
The fault campaign over the store and artifacts, which no user calls, is experiment machinery
outside the library (experiments/fault_campaign).
"""

from graft.engine import Context, Engine, EngineConfig

__all__ = ['Context', 'Engine', 'EngineConfig']
