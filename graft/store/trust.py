"""Trust: which verified blocks a graft may use when only some writers are trusted (signatures
by their keys, graft/store/signing.py), and blocks recorded as computed on a given parent.
"""

from __future__ import annotations

from graft.store import signing
from graft.store.kvstore import KvStore
from graft.store.shared import Kind, Match, Problems


class Trust:
  """Signatures of blocks, and the blocks a graft may use.

  Args:
    backing: the store's storage (signatures/<key>/<public key id>).
    problems: where a block refused is reported.
    signing_key: this writer's key; every block it publishes or finds identical is signed.
    trusted_keys: when given, only blocks signed by one of them are used (the rest are
      misses, reported); when None, every verified block is.
  """

  def __init__(self, backing: KvStore, problems: Problems,
               signing_key: signing.SigningKey | None,
               trusted_keys: tuple[signing.PublicKey, ...] | None):
    self._backing, self._problems = backing, problems
    self._signing_key, self._trusted_keys = signing_key, trusted_keys
    self._trusted: dict[str, bool] = {}  # header SHA-256 -> signed by a trusted key

  def trusted_prefix(self, match: Match) -> Match:
    """The match cut before its first block no trusted key signed (all of it without a trust
    list)."""
    if self._trusted_keys is None or not match.entries:
      return match
    wanted = [(e, f'signatures/{e["key"]}/{k.id}') for e in match.entries
              if e['header_sha256'] not in self._trusted for k in self._trusted_keys]
    records = self._backing.read_many([(n, None) for _, n in wanted])
    for (entry, _), record in zip(wanted, records):
      digest = entry['header_sha256']
      self._trusted[digest] = self._trusted.get(digest, False) or signing.signed_by(
          None if isinstance(record, Exception) else record, digest, self._trusted_keys)
    for i, entry in enumerate(match.entries):
      if not self._trusted[entry['header_sha256']]:
        self._problems.report(Kind.UNTRUSTED, entry['key'], f'objects/{entry["object"]}',
                              'not signed by a trusted key (a miss: recomputed)')
        if i == 0:
          return Match(tokens=0, entries=(), rows=0)
        return Match(tokens=sum(len(e['tokens']) for e in match.entries[:i]),
                     entries=match.entries[:i], rows=len(match.entries[i - 1]['tokens']))
    return match

  def sign(self, key: str, header_sha256: str) -> None:
    """Records this writer's signature of a block it computed (and found identical); nothing
    without a signing key."""
    if self._signing_key is not None:
      self._backing.write(f'signatures/{key}/{self._signing_key.public.id}',
                          self._signing_key.sign(header_sha256))

  def on_parent(self, entry: dict, parent_header: str) -> bool:
    """Whether the block was computed on the parent stored now (its recorded parent header is
    that parent's). One computed on another version (a forgery since replaced, say) is as wrong
    as its parent was: it is a miss, reported, and the next put of its text replaces it (a
    conflict). It is not deleted here: the parent's own entry may be the damaged one."""
    if entry['parent_header_sha256'] == parent_header:
      return True
    self._problems.report(Kind.OTHER_PARENT, entry['key'], f'objects/{entry["object"]}',
                          'computed on another version of its parent (its recorded parent '
                          'header is not the stored parent\'s): a miss')
    return False
