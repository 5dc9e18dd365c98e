"""Tokenizers for real text: UTF-8 bytes, or SentencePiece (its BOS piece
separates documents)."""

import abc
from collections.abc import Iterable
import io

import numpy as np
import sentencepiece as spm

from flax_posemb import outputs


class Tokenizer(abc.ABC):
  """Text <-> token ids below `vocab_size`; `sep_id` separates documents."""

  vocab_size: int
  sep_id: int
  # `encode_doc`'s cheap pre-cut: a token covers at most this many chars.
  CHARS_PER_TOKEN = 1

  @abc.abstractmethod
  def encode(self, text: str) -> list[int]:
    """The token ids of `text`."""

  def encode_doc(self, text: str, max_tokens: int | None = None) -> list[int]:
    """``[sep_id] + encode(text)``, truncated to `max_tokens` tokens."""
    if max_tokens is None:
      return [self.sep_id] + self.encode(text)
    text = text[: max(int(max_tokens), 0) * self.CHARS_PER_TOKEN]
    ids = [self.sep_id] + self.encode(text)
    return ids[:max_tokens]


class ByteTokenizer(Tokenizer):
  """UTF-8 bytes 0..255 plus separator 256."""

  vocab_size = 257
  sep_id = 256

  def encode(self, text: str) -> list[int]:
    return list(text.encode('utf-8'))

  def decode(self, ids) -> str:
    """The text of byte ids (the separator and padding left out)."""
    raw = bytes(int(i) for i in np.asarray(ids).ravel() if 0 <= int(i) < 256)
    return raw.decode('utf-8', errors='replace')


class SentencePieceTokenizer(Tokenizer):
  """A SentencePiece model file."""

  CHARS_PER_TOKEN = 32  # Pieces rarely exceed 32 chars.

  def __init__(self, model_file: str):
    self._sp = spm.SentencePieceProcessor(model_file=model_file)
    self.vocab_size = int(self._sp.get_piece_size())
    # The BOS piece separates documents (EOS if it has none; models trained here
    # have both).
    if self._sp.bos_id() >= 0:
      self.sep_id = int(self._sp.bos_id())
    else:
      self.sep_id = int(self._sp.eos_id())
    if self.sep_id < 0:
      raise ValueError(
          f'SentencePiece model {model_file} has neither a BOS nor an EOS piece'
          ' to separate documents. Train it with --bos_id or --eos_id >= 0, or'
          " set data.spm_model='' to train one on the corpus."
      )

  def encode(self, text: str) -> list[int]:
    return list(self._sp.encode(text))

  def decode(self, ids) -> str:
    return self._sp.decode(
        [int(i) for i in np.asarray(ids).ravel() if int(i) != self.sep_id]
    )

  @classmethod
  def train(
      cls, texts: Iterable[str], vocab_size: int, save_path: str
  ) -> 'SentencePieceTokenizer':
    """Trains a unigram model with byte fallback on `texts` and saves it to
    `save_path`."""
    buf = io.BytesIO()
    try:
      spm.SentencePieceTrainer.train(
          sentence_iterator=(t for t in texts if t.strip()),
          model_writer=buf,
          vocab_size=int(vocab_size),
          model_type='unigram',
          byte_fallback=True,
          character_coverage=0.9995,
          unk_id=0,
          bos_id=1,
          eos_id=2,
          pad_id=-1,
          hard_vocab_limit=False,
          max_sentence_length=1 << 16,
          input_sentence_size=200_000,
          shuffle_input_sentence=True,
          minloglevel=2,
      )
    except RuntimeError as e:
      raise ValueError(
          f'SentencePiece training failed ({e}); the corpus may be empty or too'
          ' small for data.spm_vocab_size.'
      ) from e
    # Whole: another process may be loading it.
    with outputs.atomic_write(save_path) as f:
      f.write(buf.getvalue())
    return cls(model_file=save_path)
