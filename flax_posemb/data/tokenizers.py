"""Tokenizers for real text: UTF-8 bytes, SentencePiece (its BOS piece
separates documents), or a Hugging Face checkpoint's own (`tokenizers`)."""

import abc
from collections.abc import Iterable
import io
import json
import os
from typing import Any

import numpy as np
import sentencepiece as spm
import tokenizers

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
    cut = max(int(max_tokens), 0) * self.CHARS_PER_TOKEN
    ids = [self.sep_id] + self.encode(text[:cut])
    if len(ids) < max_tokens and len(text) > cut:
      # Longer tokens than the pre-cut assumed: never a shorter document.
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
    if not os.path.isfile(model_file):
      raise ValueError(
          f'data.spm_model={model_file!r} is not a file; set'
          " --config.data.spm_model to an existing .model file or to '' to"
          ' train one on the corpus.'
      )
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
    """The text of `ids` (the separator left out)."""
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


# A Hugging Face tokenizer directory: tokenizer.json, or GPT-2's byte-level BPE.
HF_TOKENIZER_FILE = 'tokenizer.json'
HF_VOCAB_FILES = ('vocab.json', 'merges.txt')
# Where a Hugging Face directory names its special tokens, read in this order.
HF_SPECIAL_FILES = ('tokenizer_config.json', 'special_tokens_map.json')
HF_MODEL_CONFIG = 'config.json'


def hf_tokenizer_files(directory: str) -> tuple[str, ...] | None:
  """The tokenizer files of a Hugging Face directory (`tokenizer.json`, else
  `vocab.json` + `merges.txt`), or None if it has neither."""
  if os.path.isfile(os.path.join(directory, HF_TOKENIZER_FILE)):
    return (HF_TOKENIZER_FILE,)
  if all(os.path.isfile(os.path.join(directory, n)) for n in HF_VOCAB_FILES):
    return HF_VOCAB_FILES
  return None


class HFTokenizer(Tokenizer):
  """A Hugging Face checkpoint's tokenizer through the `tokenizers` library:
  `directory`/tokenizer.json, else GPT-2's byte-level BPE from vocab.json +
  merges.txt. Its BOS token separates documents (else EOS), as
  tokenizer_config.json / special_tokens_map.json name them, else config.json's
  ``bos_token_id`` / ``eos_token_id``; special tokens written in a document's
  text stay text. Raises ValueError naming the file and the problem."""

  def __init__(self, directory: str):
    if not os.path.isdir(directory):
      raise ValueError(
          "data.tokenizer='hf' needs data.hf_tokenizer, a Hugging Face"
          ' tokenizer directory (tokenizer.json, or vocab.json + merges.txt);'
          f' got {directory!r}.'
      )
    self.directory = directory
    files = hf_tokenizer_files(directory)
    if files is None:
      raise ValueError(
          f'{directory} holds no Hugging Face tokenizer: expected'
          f' {HF_TOKENIZER_FILE}, or {" + ".join(HF_VOCAB_FILES)}'
          ' (data.hf_tokenizer names the directory).'
      )
    paths = [os.path.join(directory, name) for name in files]
    try:
      if len(paths) == 1:
        self._tok = tokenizers.Tokenizer.from_file(paths[0])
      else:
        self._tok = _byte_level_bpe(*paths)
    except Exception as e:  # The library's reason, one line.
      reason = str(e).strip().splitlines()[0] if str(e).strip() else ''
      raise ValueError(
          f'Cannot read the tokenizer {" + ".join(paths)}:'
          f' {type(e).__name__}: {reason}'
      ) from None
    # A document's text never yields a separator id.
    self._tok.encode_special_tokens = True
    vocab = self._tok.get_vocab(with_added_tokens=True)
    self.vocab_size = max(vocab.values()) + 1
    # Longest token, in byte-level symbols (>= the characters it covers).
    self.CHARS_PER_TOKEN = max(8, max(len(token) for token in vocab))
    self.sep_id = self._separator(vocab)

  def _separator(self, vocab: dict[str, int]) -> int:
    """The id of the BOS token (else EOS) the directory's files name."""
    for name in HF_SPECIAL_FILES:
      special = _read_json(os.path.join(self.directory, name))
      for key in ('bos_token', 'eos_token'):
        token = special.get(key)
        if isinstance(token, dict):
          token = token.get('content')
        if not isinstance(token, str):
          continue
        if token not in vocab:
          raise ValueError(
              f'{os.path.join(self.directory, name)} names {key}'
              f' {token!r}, which the tokenizer does not have.'
          )
        return vocab[token]
    config_path = os.path.join(self.directory, HF_MODEL_CONFIG)
    config = _read_json(config_path)
    for key in ('bos_token_id', 'eos_token_id'):
      token_id = config.get(key)
      if isinstance(token_id, list) and token_id:
        token_id = token_id[0]
      if not isinstance(token_id, int):
        continue
      if not 0 <= token_id < self.vocab_size:
        raise ValueError(
            f'{config_path}: {key}={token_id} is not an id of the tokenizer'
            f' ({self.vocab_size} ids).'
        )
      return token_id
    raise ValueError(
        f'The tokenizer in {self.directory} names no BOS or EOS token to'
        f' separate documents: set bos_token in {HF_SPECIAL_FILES[0]} or'
        f' bos_token_id in {HF_MODEL_CONFIG}.'
    )

  def encode(self, text: str) -> list[int]:
    return self._tok.encode(text, add_special_tokens=False).ids

  def decode(self, ids) -> str:
    """The text of `ids` (the separator left out)."""
    return self._tok.decode(
        [int(i) for i in np.asarray(ids).ravel() if int(i) != self.sep_id]
    )


def _byte_level_bpe(vocab_path: str, merges_path: str) -> tokenizers.Tokenizer:
  """GPT-2's tokenizer from its vocab.json and merges.txt: byte-level BPE."""
  tok = tokenizers.Tokenizer(
      tokenizers.models.BPE.from_file(vocab_path, merges_path)
  )
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False
  )
  tok.decoder = tokenizers.decoders.ByteLevel()
  return tok


def _read_json(path: str) -> dict[str, Any]:
  """A JSON object file, {} if absent; ValueError naming it if unreadable."""
  if not os.path.isfile(path):
    return {}
  try:
    with open(path, encoding='utf-8') as f:
      value = json.load(f)
  except (OSError, ValueError) as e:
    raise ValueError(f'Cannot read {path}: {e}') from None
  if not isinstance(value, dict):
    raise ValueError(f'{path} is not a JSON object.')
  return value
