"""Persistence: verified KV on disk and in the content-addressed store.

    from graft.store import Store, artifact

    artifact.save('/tmp/library', engine, ctx)                       # an Orbax artifact
    ctx = artifact.graft(engine, artifact.load('/tmp/library', engine))
    store = Store('file:///data/kv/', engine)                        # any kvstore URL
    store.put(tokens); ctx, match = store.graft(tokens)              # longest stored prefix

Modules: artifact (save / load / graft, every hash re-checked), blocks (the block object and
index entry formats, chain keys), kvstore (TensorStore's kvstore, by URL), and the Store.
"""

from graft.store import artifact, blocks, kvstore
from graft.store._store import Match, Problem, Store, StoreError
from graft.store.artifact import Artifact, ArtifactError

__all__ = ['Artifact', 'ArtifactError', 'Match', 'Problem', 'Store', 'StoreError', 'artifact',
           'blocks', 'kvstore']
