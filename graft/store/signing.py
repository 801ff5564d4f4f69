"""Writers named by Ed25519 keys; readers choose whom to trust.

    key = signing.generate('/keys/alice')            # /keys/alice (private), /keys/alice.pub
    store = Store(url, engine, signing_key=signing.load_private('/keys/alice'))
    reader = Store(url, engine, trusted_keys=signing.load_trusted(['/keys/alice.pub']))

A writer signs the SHA-256 of each block's header (which binds the block's every byte, its place
in the chain and its parent's header) and of each artifact's manifest. A signature is a small
record beside the object, `{"public_key", "signed", "signature"}`, so any number of writers that
computed the same block can each vouch for it. A reader with a trust list grafts only what a
listed key signed; the rest is a miss, recomputed and reported. The `cryptography` package does
the Ed25519 arithmetic; nothing here is hand-written crypto.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Iterable

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from gemma_jax.digest import canonical_json


class SigningKeyError(ValueError):
  """A key file that cannot be used; the message names it and says why."""


@dataclasses.dataclass(frozen=True)
class PublicKey:
  """An Ed25519 public key: a writer's name."""

  raw: bytes  # 32 bytes

  @property
  def hex(self) -> str:
    """The key as 64 hex digits (as a .pub file and a signature record hold it)."""
    return self.raw.hex()

  @property
  def id(self) -> str:
    """A short name for the key (the first 32 hex digits of its SHA-256): a signature's file
    name."""
    return hashlib.sha256(self.raw).hexdigest()[:32]

  def verifies(self, message: bytes, signature_hex: str) -> bool:
    """Whether `signature_hex` is this key's signature of `message`."""
    try:
      ed25519.Ed25519PublicKey.from_public_bytes(self.raw).verify(bytes.fromhex(signature_hex),
                                                                  message)
      return True
    except (InvalidSignature, ValueError):
      return False


@dataclasses.dataclass(frozen=True)
class SigningKey:
  """A writer's Ed25519 private key."""

  private: ed25519.Ed25519PrivateKey

  @property
  def public(self) -> PublicKey:
    """Its public key."""
    return PublicKey(self.private.public_key().public_bytes(serialization.Encoding.Raw,
                                                            serialization.PublicFormat.Raw))

  def sign(self, digest_hex: str) -> bytes:
    """The signature record of a SHA-256 (hex): canonical JSON bytes."""
    signature = self.private.sign(bytes.fromhex(digest_hex)).hex()
    return canonical_json({'public_key': self.public.hex, 'signed': digest_hex,
                       'signature': signature})


def generate(path: str) -> SigningKey:
  """A new key: `path` holds the private key (PEM, mode 0600), `path`.pub the public one (hex).
  Refuses to overwrite either."""
  for target in (path, path + '.pub'):
    if os.path.exists(target):
      raise SigningKeyError(f'{target} already exists; keys are never overwritten')
  key = SigningKey(ed25519.Ed25519PrivateKey.generate())
  pem = key.private.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption())
  fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
  with os.fdopen(fd, 'wb') as f:
    f.write(pem)
  with open(path + '.pub', 'w') as f:
    f.write(key.public.hex + '\n')
  return key


def load_private(path: str) -> SigningKey:
  """The private key `generate` wrote at `path` (SigningKeyError naming it and why if not)."""
  try:
    with open(path, 'rb') as f:
      private = serialization.load_pem_private_key(f.read(), password=None)
  except OSError as e:
    raise SigningKeyError(f'signing key {path}: cannot be read ({e.strerror})') from None
  except (ValueError, TypeError) as e:
    raise SigningKeyError(f'signing key {path}: not a PEM private key ({e})') from None
  if not isinstance(private, ed25519.Ed25519PrivateKey):
    raise SigningKeyError(f'signing key {path}: not an Ed25519 key')
  return SigningKey(private)


def load_public(path: str) -> PublicKey:
  """The public key in a .pub file (SigningKeyError naming it and why if not)."""
  try:
    with open(path) as f:
      text = f.read().strip()
    raw = bytes.fromhex(text)
  except OSError as e:
    raise SigningKeyError(f'public key {path}: cannot be read ({e.strerror})') from None
  except ValueError:
    raise SigningKeyError(f'public key {path}: not a hex Ed25519 public key') from None
  if len(raw) != 32:
    raise SigningKeyError(f'public key {path}: {len(raw)} bytes, an Ed25519 public key has 32')
  return PublicKey(raw)


def load_trusted(paths: Iterable[str]) -> tuple[PublicKey, ...]:
  """The public keys in the .pub files `paths`: a reader's trust list."""
  return tuple(load_public(p) for p in paths)


def signed_by(record: bytes | None, digest_hex: str, trusted: tuple[PublicKey, ...]) -> bool:
  """Whether a signature record signs `digest_hex` with one of the trusted keys."""
  if not record:
    return False
  try:
    value = json.loads(record)
    public, signed, signature = value['public_key'], value['signed'], value['signature']
  except (ValueError, TypeError, KeyError):
    return False
  if signed != digest_hex or not isinstance(signature, str):
    return False
  return any(key.hex == public and key.verifies(bytes.fromhex(digest_hex), signature)
             for key in trusted)
