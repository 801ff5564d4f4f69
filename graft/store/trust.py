"""Trust: which verified blocks a graft may use when only some writers are trusted (signatures
by their keys, graft/store/signing.py), and blocks recorded as computed on a given parent.
"""

from __future__ import annotations

from gemma_jax import digest
from graft.store import signing
from graft.store.shared import Match


class Trust:
  """The trust room of graft.store.Store (a mixin: the Store holds the state)."""

  def _trusted_prefix(self, match: Match) -> Match:
    """The match cut before its first block no trusted key signed (all of it without a trust
    list)."""
    if self.trusted_keys is None or not match.entries:
      return match
    wanted = [(e, f'signatures/{e["key"]}/{k.id}') for e in match.entries
              if e['header_sha256'] not in self._trusted for k in self.trusted_keys]
    for (entry, _), record in zip(wanted, self.backing.read_many([(n, None) for _, n in wanted])):
      digest = entry['header_sha256']
      self._trusted[digest] = self._trusted.get(digest, False) or signing.signed_by(
          None if isinstance(record, Exception) else record, digest, self.trusted_keys)
    for i, entry in enumerate(match.entries):
      if not self._trusted[entry['header_sha256']]:
        self._report(entry['key'], f'objects/{entry["object"]}',
                     'not signed by a trusted key (a miss: recomputed)')
        if i == 0:
          return Match(tokens=0, entries=(), rows=0)
        return Match(tokens=sum(len(e['tokens']) for e in match.entries[:i]),
                     entries=match.entries[:i], rows=len(match.entries[i - 1]['tokens']))
    return match

  def _sign(self, key: str, header_sha256: str) -> None:
    """Records this writer's signature of a block it computed (and found identical)."""
    if self.signing_key is not None:
      self.backing.write(f'signatures/{key}/{self.signing_key.public.id}',
                         self.signing_key.sign(header_sha256))

  def _on_parent(self, entry: dict, parent_header: str) -> bool:
    """Whether the block was computed on the parent stored now (its recorded parent header is
    that parent's). One computed on another version (a forgery since replaced, say) is as wrong
    as its parent was: it is a miss, reported, and the next put of its text replaces it (a
    conflict). It is not deleted here: the parent's own entry may be the damaged one."""
    if entry['parent_header_sha256'] == parent_header:
      return True
    self._report(entry['key'], f'objects/{entry["object"]}',
                 'computed on another version of its parent (its recorded parent header is not '
                 'the stored parent\'s): a miss')
    return False
