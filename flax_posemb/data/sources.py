"""Document sources: random access to the tokenized documents of one split (real
text as ``[SEP] + tokens(text)``: docs/DESIGN.md § Data policies and tokens)."""

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np

from flax_posemb.data import lengths as lengths_lib
from flax_posemb.data import synthetic as synthetic_lib
from flax_posemb.data import tokenizers as tokenizers_lib

DECODE_ERROR_MODES = ('replace', 'skip', 'error')  # data.on_decode_error


def decode_mode(data_config) -> str:
  """``data.on_decode_error``; configs saved before the field existed mean
  'replace'."""
  return data_config.get('on_decode_error', 'replace')


class DocSource(abc.ABC):
  """Random access to the documents of one split."""

  default_kind: str = ''  # `kind` of a document whose record names none.

  def kind(self, index: int) -> str:
    """What kind of text document `index` is (provenance of evaluation
    windows)."""
    del index
    return self.default_kind

  @abc.abstractmethod
  def __len__(self) -> int:
    """Number of documents."""

  @abc.abstractmethod
  def doc(
      self,
      index: int,
      *,
      start: int = 0,
      max_pairs: int | None,
      num_pairs: int | None = None,
  ) -> np.ndarray:
    """Tokens ``[n]`` int32 of document `index`, at most ``max_pairs + 1``
    (None: all); synthetic: from position id `start`, exactly `num_pairs` pairs
    if given."""


class SyntheticSource(DocSource):
  """Synthetic documents of one split, lengths from `length_dist` (>=
  `min_pairs`). A document's tokens depend on the position id it starts at,
  and its length is known without generating it (`num_pairs`)."""

  default_kind = 'synthetic'

  def __init__(
      self,
      corpus: synthetic_lib.SyntheticCorpus,
      split: str,
      num_docs: int,
      length_dist: lengths_lib.LengthDist,
      min_pairs: int = 1,
  ):
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
    pairs = int(num_pairs)
    if max_pairs is not None:
      pairs = min(pairs, int(max_pairs))
    # Two uniforms draw the length (`pairs_many`), the rest the tokens.
    uniforms = self.corpus.doc_uniforms_many(
        self.split, np.asarray([index]), pairs + 3
    )[0]
    return self.corpus.generate(uniforms[2:], int(start))

  def num_pairs(self, index: int) -> int:
    """Length (pairs) of document `index` before truncation (no generation)."""
    return int(self.pairs_many(np.asarray([index]), None)[0])

  def docs_many(
      self,
      indices: np.ndarray,
      starts: np.ndarray,
      max_pairs: int,
      num_pairs: int | np.ndarray | None = None,
  ) -> list[np.ndarray]:
    """Vectorized `doc` of documents ``[n]`` at position ids ``[n]`` (identical
    tokens); `num_pairs`: one count for all or ``[n]`` (None: their own)."""
    if num_pairs is None:
      pairs = self.pairs_many(indices, max_pairs)
    else:
      requested = np.broadcast_to(np.asarray(num_pairs, np.int64), len(indices))
      pairs = np.minimum(requested, int(max_pairs))
    uniforms = self.corpus.doc_uniforms_many(
        self.split, indices, int(pairs.max(initial=0)) + 3
    )
    return self.corpus.generate_many(uniforms[:, 2:], starts, pairs + 1)

  def pairs_many(
      self, indices: np.ndarray, max_pairs: int | None
  ) -> np.ndarray:
    """Pairs ``[n]`` int64 of documents ``[n]`` after truncation to `max_pairs`
    (None: none)."""
    uniforms = self.corpus.doc_uniforms_many(self.split, indices, 2)
    pairs = self.length_dist.sample_many(uniforms[:, 0], uniforms[:, 1])
    pairs = np.maximum(pairs, self.min_pairs)
    if max_pairs is None:
      return pairs
    return np.minimum(pairs, int(max_pairs))


class TextSource(DocSource):
  """Tokenized documents of random-access records: dicts with the text at
  `feature` (or the text itself, `feature` ''); `kind` of a record without
  one."""

  def __init__(
      self,
      records: Sequence[Any],
      tokenizer: tokenizers_lib.Tokenizer,
      feature: str = 'text',
      on_decode_error: str = 'replace',
      kind: str = 'text',
  ):
    self.records = records
    self.tokenizer = tokenizer
    self.feature = feature
    self.on_decode_error = on_decode_error
    self.default_kind = kind
    # Documents of invalid UTF-8 met by `text` in this process.
    self.decode_errors = 0
    # What the corpus build found.
    self.build_decode_errors: dict[str, Any] | None = None

  def __len__(self) -> int:
    return len(self.records)

  def text(self, index: int) -> str:
    """The raw text of document `index` (a skipped document is '')."""
    rec = self.records[int(index)]
    if self.feature and isinstance(rec, dict):
      rec = rec[self.feature]
    if isinstance(rec, np.ndarray):
      rec = rec.item()
    if not isinstance(rec, (bytes, np.bytes_)):
      return str(rec)
    try:
      return bytes(rec).decode('utf-8')
    except UnicodeDecodeError as e:
      if self.on_decode_error == 'error':
        raise ValueError(
            f'Document {index} is not valid UTF-8 ({e.reason} at byte'
            f' {e.start}); data.on_decode_error=error refuses it. Fix the data,'
            ' or set data.on_decode_error=replace (U+FFFD) or skip (drop the'
            ' document).'
        ) from None
      self.decode_errors += 1
      if self.on_decode_error == 'skip':
        return ''
      return bytes(rec).decode('utf-8', 'replace')

  def kind(self, index: int) -> str:
    """The record's 'kind' field (e.g. long_text's 'shakespeare'), else the
    source's."""
    rec = self.records[int(index)]
    kind = rec.get('kind') if isinstance(rec, dict) else None
    if isinstance(kind, np.ndarray):
      kind = kind.item()
    if isinstance(kind, (bytes, np.bytes_)):
      kind = bytes(kind).decode('utf-8', errors='replace')
    return str(kind) if kind else self.default_kind

  def doc(self, index, *, start=0, max_pairs, num_pairs=None):
    del start
    caps = [int(x) + 1 for x in (max_pairs, num_pairs) if x is not None]
    return np.asarray(
        self.tokenizer.encode_doc(self.text(index), min(caps, default=None)),
        np.int32,
    )
