"""Persistence: verified KV on disk and in the content-addressed store.

    from graft.store import Store, artifact

    artifact.save('/tmp/library', engine, ctx)                       # an Orbax artifact
    ctx = artifact.graft(engine, artifact.load('/tmp/library', engine))
    store = Store('file:///data/kv/', engine)                        # any kvstore URL
    store.put(tokens); ctx, match = store.graft(tokens)              # longest stored prefix
    store.put_document(prefix, doc)                                  # once, placed anywhere
    composed = store.compose(prefix, [doc_a, doc_b], query)          # documents in any order

Public modules: artifact (save / load / graft, every hash re-checked), blocks (the block object
and index entry formats, chain keys), kvstore (TensorStore's kvstore, by URL), signing
(writers' Ed25519 keys) and compose (documents placed, re-rotated where asked, recomputed by a
strategy: what Store.compose runs). The Store's whole public API is in _store.py; it composes
private parts, each receiving its dependencies in its constructor: reads (object reads, decoding, the
host tier), trust (signatures, the parent a block was computed on), index (entries, rebuild,
quarantine), lookup (the longest stored prefix, graft), publish (the put protocol),
documents (documents stored after a prefix, in chains of their own) and maintenance (verify,
audit, gc), over shared (names, the codec, problems and their kinds).
"""

from graft.store import artifact, blocks, compose, kvstore, signing
from graft.store._store import Composition, Kind, Match, Problem, Store, StoreError
from graft.store.compose import ComposeError, Recompute
from graft.store.documents import Document, DocumentError
from graft.store.artifact import Artifact, ArtifactError

__all__ = ['Artifact', 'ArtifactError', 'ComposeError', 'Composition', 'Document',
           'DocumentError', 'Kind', 'Match', 'Problem', 'Recompute', 'Store', 'StoreError',
           'artifact', 'blocks', 'compose', 'kvstore', 'signing']
