"""Document sources: random access to tokenized documents of one split.

A `DocSource` returns a document's tokens by index. Synthetic documents are generated for
the position id they start at (``start``); real-text documents ignore it. Every source
truncates to ``max_pairs + 1`` tokens (``max_pairs`` input/target pairs);
``max_pairs=None`` returns the whole document (the streaming policies).

Real text is encoded as ``[SEP] + tokens(text)`` (see `tokenizers`), so the first real
token is predicted from the separator and, in `packed` rows, documents are visibly
delimited (as GPT-2's ``<|endoftext|>`` between documents).
"""

from __future__ import annotations

import abc
from typing import Any, Sequence

import numpy as np

from flax_posemb.data import lengths as lengths_lib
from flax_posemb.data import synthetic as synthetic_lib
from flax_posemb.data import tokenizers as tokenizers_lib

DECODE_ERROR_MODES = ('replace', 'skip', 'error')  # data.on_decode_error


def decode_mode(data_config) -> str:
  """``data.on_decode_error``; configs saved before the field existed mean 'replace'."""
  return data_config.get('on_decode_error', 'replace')


class DocSource(abc.ABC):
  """Random access to the documents of one split."""

  #: True when a document's tokens depend on the position id it starts at.
  positional: bool = False
  #: Kind of a document whose record names none: the source's name (`kind`).
  default_kind: str = ''

  def kind(self, index: int) -> str:
    """What kind of text document `index` is (provenance of evaluation windows)."""
    del index
    return self.default_kind

  @abc.abstractmethod
  def __len__(self) -> int:
    """Number of documents."""

  @abc.abstractmethod
  def doc(self, index: int, *, start: int = 0, max_pairs: int | None,
          num_pairs: int | None = None) -> np.ndarray:
    """Tokens of document `index`.

    Args:
      index: document index in ``[0, len(self))``.
      start: position id of the first token (synthetic only).
      max_pairs: truncate to ``max_pairs + 1`` tokens; None: the whole document.
      num_pairs: synthetic only: generate exactly this many pairs (ignore the length
        distribution); real text: crop to at most this many pairs.

    Returns:
      ``[n]`` int32 tokens, ``n <= max_pairs + 1`` (when given).
    """


class SyntheticSource(DocSource):
  """Documents of the synthetic corpus; lengths drawn from `length_dist` per document.

  Args:
    corpus: the `SyntheticCorpus`.
    split: 'train' | 'validation' | 'test' (independent document streams).
    num_docs: documents in the split.
    length_dist: distribution of document lengths (pairs).
    min_pairs: lengths are raised to at least this.
  """

  positional = True
  default_kind = 'synthetic'

  def __init__(self, corpus: synthetic_lib.SyntheticCorpus, split: str, num_docs: int,
               length_dist: lengths_lib.LengthDist, min_pairs: int = 1):
    if split not in synthetic_lib.SPLIT_IDS:
      raise ValueError(f'Unknown synthetic split {split!r}; use one of '
                       f'{sorted(synthetic_lib.SPLIT_IDS)}.')
    if num_docs < 1:
      raise ValueError(f'synthetic.num_docs must be >= 1, got {num_docs}.')
    self.corpus = corpus
    self.split = split
    self.num_docs = int(num_docs)
    self.length_dist = length_dist
    self.min_pairs = int(min_pairs)

  def __len__(self) -> int:
    return self.num_docs

  def doc(self, index, *, start=0, max_pairs, num_pairs=None):
    if num_pairs is None:
      num_pairs = self.num_pairs(index)
    m = int(num_pairs) if max_pairs is None else min(int(num_pairs), int(max_pairs))
    u = self.corpus.doc_uniforms(self.split, index, m + 3)
    return self.corpus.generate(u[2:], int(start))

  def num_pairs(self, index: int) -> int:
    """Length (pairs) of document `index` before truncation (cheap: no generation)."""
    u_bucket, u_len = self.corpus.doc_uniforms(self.split, index, 2).tolist()
    return max(self.length_dist.sample(u_bucket, u_len), self.min_pairs)

  def docs_many(self, indices: np.ndarray, starts: np.ndarray, max_pairs: int,
                num_pairs: int | None = None) -> list[np.ndarray]:
    """`doc` for many documents at once (vectorized; identical tokens).

    Args:
      indices: ``[n]`` document indices.
      starts: ``[n]`` start position ids.
      max_pairs: truncation.
      num_pairs: generate exactly this many pairs (before truncation) instead of each
        document's own length.

    Returns:
      List of n int32 token arrays.
    """
    if num_pairs is None:
      pairs = self.pairs_many(indices, max_pairs)
    else:
      pairs = np.full(len(indices), min(int(num_pairs), int(max_pairs)), np.int64)
    u = self.corpus.doc_uniforms_many(self.split, indices, int(pairs.max(initial=0)) + 3)
    return self.corpus.generate_many(u[:, 2:], starts, pairs + 1)

  def pairs_many(self, indices: np.ndarray, max_pairs: int | None) -> np.ndarray:
    """Pairs of many documents after truncation to `max_pairs` (None: none), ``[n]`` int64."""
    u = self.corpus.doc_uniforms_many(self.split, indices, 2)
    m = np.maximum(self.length_dist.sample_many(u[:, 0], u[:, 1]), self.min_pairs)
    return m if max_pairs is None else np.minimum(m, int(max_pairs))


class TextSource(DocSource):
  """Tokenized documents of a random-access record source (e.g. a TFDS data source).

  Args:
    records: sequence-like; ``records[i]`` is a dict with `feature` (str or bytes) or the
      text itself.
    tokenizer: a `tokenizers.Tokenizer`.
    feature: key of the text in each record ('' = the record is the text).
    on_decode_error: see `DECODE_ERROR_MODES`.
    kind: kind of a document whose record has no 'kind' field: the source's name
      (`data.source`, or `data.name` for tfds).
  """

  def __init__(self, records: Sequence[Any], tokenizer: tokenizers_lib.Tokenizer,
               feature: str = 'text', on_decode_error: str = 'replace', kind: str = 'text'):
    if on_decode_error not in DECODE_ERROR_MODES:
      raise ValueError(f'on_decode_error must be one of {DECODE_ERROR_MODES}, got '
                       f'{on_decode_error!r}.')
    self.records = records
    self.tokenizer = tokenizer
    self.feature = feature
    self.on_decode_error = on_decode_error
    self.default_kind = kind
    #: Documents of invalid UTF-8 met by `text` in this process (replaced or skipped).
    self.decode_errors = 0
    #: What the corpus build found (`text_sources`: files, documents), or None.
    self.build_decode_errors: dict[str, Any] | None = None
    self._len = len(records)

  def _decode(self, raw: bytes, index: int) -> str:
    try:
      return raw.decode('utf-8')
    except UnicodeDecodeError as e:
      if self.on_decode_error == 'error':
        raise ValueError(
            f'Document {index} is not valid UTF-8 ({e.reason} at byte {e.start}); '
            'data.on_decode_error=error refuses it. Fix the data, or set '
            'data.on_decode_error=replace (U+FFFD) or skip (drop the document).') from None
      self.decode_errors += 1
      return '' if self.on_decode_error == 'skip' else raw.decode('utf-8', errors='replace')

  def __len__(self) -> int:
    return self._len

  def text(self, index: int) -> str:
    """The raw text of document `index`."""
    rec = self.records[int(index)]
    if self.feature and isinstance(rec, dict):
      if self.feature not in rec:
        raise KeyError(f'Text feature {self.feature!r} not in record keys {sorted(rec)}; '
                       'set data.text_feature.')
      rec = rec[self.feature]
    if isinstance(rec, np.ndarray):
      rec = rec.item()
    if isinstance(rec, (bytes, np.bytes_)):  # A skipped document is '' (dropped as too short).
      rec = self._decode(bytes(rec), int(index))
    return str(rec)

  def kind(self, index: int) -> str:
    """The record's 'kind' field (e.g. long_text's 'shakespeare', 'code'), else the source's."""
    rec = self.records[int(index)]
    kind = rec.get('kind') if isinstance(rec, dict) else None
    if isinstance(kind, np.ndarray):
      kind = kind.item()
    if isinstance(kind, (bytes, np.bytes_)):
      kind = bytes(kind).decode('utf-8', errors='replace')
    return str(kind) if kind else self.default_kind

  def doc(self, index, *, start=0, max_pairs, num_pairs=None):
    del start
    caps = [int(x) for x in (max_pairs, num_pairs) if x is not None]
    if not caps:
      return np.asarray(self.tokenizer.encode_doc(self.text(index)), np.int32)
    m = min(caps)
    tokens = self.tokenizer.encode_doc(self.text(index), max_tokens=m + 1)
    return np.asarray(tokens[:m + 1], np.int32)
