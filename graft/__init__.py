"""The pinned engine, artifacts and grafts.

    from graft import Engine, EngineConfig, artifact

    engine = Engine(gemma_jax.load('gemma3_270m'), EngineConfig())   # mode='pinned'
    library, _ = engine.prefill(tokens, logits='none')               # a Context
    artifact.save('/tmp/library', engine, library)
    ctx = artifact.graft(engine, artifact.load('/tmp/library', engine))
    ctx, logits = engine.extend(ctx, query, logits='all')            # byte-equal to fresh

Modules: engine (Engine, EngineConfig, Context), artifact (save / load / graft, verified),
shift (shifted grafts for the position experiments), exactness (fresh against graft, per
sample), fingerprint (what names a model and an engine).
"""

from graft import artifact, exactness, fingerprint, shift
from graft.artifact import Artifact, ArtifactError
from graft.engine import Context, Engine, EngineConfig

__all__ = ['Artifact', 'ArtifactError', 'Context', 'Engine', 'EngineConfig', 'artifact',
           'exactness', 'fingerprint', 'shift']
