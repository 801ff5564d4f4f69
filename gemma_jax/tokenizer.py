"""SentencePiece tokenizer, as the official Gemma tokenizer is.

`Tokenizer.from_gguf` builds the SentencePiece model from the vocabulary a GGUF file carries
(pieces, scores, token types); `Tokenizer.from_file` reads an official `tokenizer.model`.

Settings that reproduce the Gemma tokenizer from a GGUF vocabulary: BPE with byte fallback, the
identity normalizer, no dummy prefix, no whitespace splitting, whitespace-only pieces allowed,
digits split. One trap: llama.cpp stores user-defined pieces (newlines, tabs, runs of spaces) with
literal spaces, while SentencePiece matches them against text whose spaces are already escaped to
U+2581, so they are stored here with U+2581.
"""

from __future__ import annotations

from typing import Any, Iterable

import sentencepiece as spm
from sentencepiece import sentencepiece_model_pb2 as sp_pb2

from gemma_jax.config import BOS_ID, EOS_ID, PAD_ID, UNK_ID

SPACE_ESCAPE = '\u2581'  # SentencePiece's visible space

# GGUF token types (llama.cpp's llama_token_type) -> SentencePiece piece types.
_GGUF_TO_SP_TYPE = {
    1: sp_pb2.ModelProto.SentencePiece.NORMAL,
    2: sp_pb2.ModelProto.SentencePiece.UNKNOWN,
    3: sp_pb2.ModelProto.SentencePiece.CONTROL,
    4: sp_pb2.ModelProto.SentencePiece.USER_DEFINED,
    5: sp_pb2.ModelProto.SentencePiece.UNUSED,
    6: sp_pb2.ModelProto.SentencePiece.BYTE,
}


def model_proto_from_vocab(pieces: list[str], scores: list[float], types: list[int], *,
                           unk_id: int, bos_id: int, eos_id: int, pad_id: int) -> bytes:
  """A serialized SentencePiece BPE model with the given vocabulary."""
  proto = sp_pb2.ModelProto()
  user_defined = _GGUF_TO_SP_TYPE[4]
  for piece, score, kind in zip(pieces, scores, types):
    sp_type = _GGUF_TO_SP_TYPE.get(int(kind), sp_pb2.ModelProto.SentencePiece.NORMAL)
    if sp_type == user_defined:
      piece = piece.replace(' ', SPACE_ESCAPE)
    proto.pieces.add(piece=piece, score=float(score), type=sp_type)
  trainer = proto.trainer_spec
  trainer.model_type = sp_pb2.TrainerSpec.BPE
  trainer.vocab_size = len(pieces)
  trainer.byte_fallback = True
  trainer.split_by_whitespace = False
  trainer.allow_whitespace_only_pieces = True
  trainer.split_digits = True
  trainer.unk_id, trainer.bos_id, trainer.eos_id, trainer.pad_id = unk_id, bos_id, eos_id, pad_id
  normalizer = proto.normalizer_spec
  normalizer.name = 'identity'
  normalizer.add_dummy_prefix = False
  normalizer.remove_extra_whitespaces = False
  normalizer.escape_whitespaces = True
  return proto.SerializeToString()


class Tokenizer:
  """Text <-> token ids. `encode` prepends BOS by default, as Gemma expects."""

  def __init__(self, processor: spm.SentencePieceProcessor):
    self._sp = processor

  @classmethod
  def from_model_proto(cls, model_proto: bytes) -> 'Tokenizer':
    """From a serialized SentencePiece model."""
    return cls(spm.SentencePieceProcessor(model_proto=model_proto))

  @classmethod
  def from_file(cls, path: str) -> 'Tokenizer':
    """From a SentencePiece .model file."""
    with open(path, 'rb') as f:
      return cls.from_model_proto(f.read())

  @classmethod
  def from_gguf(cls, reader: Any) -> 'Tokenizer':
    """From a `gguf.GGUFReader` (the file's tokenizer.ggml.* fields)."""
    def field(name):
      if name not in reader.fields:
        raise ValueError(f'the GGUF file has no {name} field, so no tokenizer can be built')
      return reader.fields[name].contents()

    return cls.from_model_proto(model_proto_from_vocab(
        field('tokenizer.ggml.tokens'), field('tokenizer.ggml.scores'),
        field('tokenizer.ggml.token_type'),
        unk_id=int(field('tokenizer.ggml.unknown_token_id')),
        bos_id=int(field('tokenizer.ggml.bos_token_id')),
        eos_id=int(field('tokenizer.ggml.eos_token_id')),
        pad_id=int(field('tokenizer.ggml.padding_token_id'))))

  @property
  def vocab_size(self) -> int:
    """V, the pieces of the vocabulary."""
    return self._sp.get_piece_size()

  @property
  def model_proto(self) -> bytes:
    """The serialized SentencePiece model (what the model fingerprint hashes)."""
    return self._sp.serialized_model_proto()

  def encode(self, text: str, *, add_bos: bool = True) -> list[int]:
    """The token ids of `text`, BOS first unless add_bos is False."""
    ids = self._sp.encode(text)
    return [BOS_ID] + ids if add_bos else ids

  def decode(self, ids: Iterable[int]) -> str:
    """The text of token ids (BOS and EOS dropped)."""
    return self._sp.decode([int(i) for i in ids if int(i) not in (BOS_ID, EOS_ID)])

  def id_to_piece(self, token_id: int) -> str:
    """The vocabulary piece of one id."""
    return self._sp.id_to_piece(int(token_id))

  def gguf_vocab(self) -> tuple[list[str], list[float], list[int]]:
    """(pieces, scores, GGUF token types) as llama.cpp stores them: the inverse of
    `model_proto_from_vocab`."""
    proto = sp_pb2.ModelProto.FromString(self.model_proto)
    to_gguf = {v: k for k, v in _GGUF_TO_SP_TYPE.items()}
    pieces, scores, types = [], [], []
    for p in proto.pieces:
      user_defined = p.type == sp_pb2.ModelProto.SentencePiece.USER_DEFINED
      pieces.append(p.piece.replace(SPACE_ESCAPE, ' ') if user_defined else p.piece)
      scores.append(p.score)
      types.append(to_gguf[p.type])
    return pieces, scores, types


def synthetic_tokenizer(vocab_size: int) -> Tokenizer:
  """A byte-level tokenizer of `vocab_size` pieces for random-weight models whose vocabulary is
  not Gemma's: the 4 special tokens, the 256 byte pieces, then common English fragments."""
  if vocab_size < 4 + 256:
    raise ValueError(f'a synthetic tokenizer needs at least 260 pieces, not {vocab_size}')
  specials = [('<pad>', 3), ('<eos>', 3), ('<bos>', 3), ('<unk>', 2)]
  byte_pieces = [(f'<0x{b:02X}>', 6) for b in range(256)]
  letters = [SPACE_ESCAPE] + [chr(c) for c in range(ord('a'), ord('z') + 1)]
  bigrams = [a + b for a in letters for b in letters if a != SPACE_ESCAPE or b != SPACE_ESCAPE]
  normal = [(piece, 1) for piece in (letters + bigrams)[:vocab_size - len(specials) - 256]]
  vocab = specials + byte_pieces + normal
  scores = [0.0] * (len(specials) + 256) + [-float(i) for i in range(len(normal))]
  return Tokenizer.from_model_proto(model_proto_from_vocab(
      [p for p, _ in vocab], scores, [t for _, t in vocab],
      unk_id=UNK_ID, bos_id=BOS_ID, eos_id=EOS_ID, pad_id=PAD_ID))
