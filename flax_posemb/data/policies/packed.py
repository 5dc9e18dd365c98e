"""Policies that cut the document stream into rows: packed, packed_reset and
natural_chunked (docs/DESIGN.md § Data policies and tokens)."""

import grain
import numpy as np

from flax_posemb.data import config as config_lib
from flax_posemb.data import packers
from flax_posemb.data import rows as rows_lib
from flax_posemb.data import sources
from flax_posemb.data.policies import exposure as exposure_lib
from flax_posemb.data.policies import registry

DataConfig = config_lib.DataConfig


class _Stream(registry.Policy):
  """Every pair of every document, in stream order, cut into rows of T; rows
  are shuffled in windows of data.shuffle_rows."""

  # Positions restart at each document (and past the position table).
  reset = False
  # One document per row: a document of k contexts gives k rows.
  chunked = False

  def rows(
      self, data: DataConfig, setup: rows_lib.RowSetup
  ) -> grain.IterDataset:
    materialize = rows_lib.tokenized(setup.src)
    if isinstance(setup.src, sources.SyntheticSource):
      materialize = rows_lib.generated(
          setup.src, data.seq_len, from_zero=self.reset or self.chunked
      )
    max_len = None
    if self.reset:
      max_len = setup.table
    rows = packers.PackIterDataset(
        rows_lib.document_chunks(setup),
        materialize,
        data.seq_len,
        reset=self.reset,
        min_tokens=data.min_doc_len,
        max_len=max_len,
        chunked=self.chunked,
    )
    return rows_lib.shuffled(rows, data.shuffle, data.shuffle_rows, setup.seed)

  def recuts_stream(self, data: DataConfig) -> bool:
    return True

  def exposure(
      self, data: DataConfig, corpus: exposure_lib.CorpusLengths
  ) -> exposure_lib.Exposure:
    return exposure_lib.exposure(corpus.used(np.inf), corpus.every_row())

  def rows_per_document(
      self, data: DataConfig, pairs: np.ndarray
  ) -> np.ndarray:
    # Row-sized pieces of a document land in different rows.
    return pairs


class _Packed(_Stream):
  """Full rows: documents run on across row boundaries."""

  def check(self, data: DataConfig) -> None:
    period = data.synthetic.period
    if data.source == 'synthetic' and data.seq_len % period:
      raise ValueError(
          f'Policy {self.name!r} cannot be honoured on the synthetic source: a'
          ' document wrapping into the next row keeps its dynamics only if'
          f' num_regimes*segment_len={period} divides'
          f' seq_len={data.seq_len}; change --config.data.seq_len or'
          ' --config.data.synthetic.segment_len/num_regimes.'
      )


@registry.register
class Packed(_Packed):
  """Full rows, positions 0 .. T-1 whatever the documents: every position is
  trained equally, across document boundaries."""

  name = 'packed'

  def exposure(
      self, data: DataConfig, corpus: exposure_lib.CorpusLengths
  ) -> exposure_lib.Exposure:
    # One segment per row: every token's context is its position.
    return exposure_lib.exposure(
        corpus.used(np.inf), np.ones(data.seq_len), True
    )


@registry.register
class PackedReset(_Packed):
  """packed's rows with in-document positions: each document is its own
  segment from position 0 (past the position table, from 0 again)."""

  name = 'packed_reset'
  reset = True

  def position_count(self, data: DataConfig, max_len: int) -> int:
    # In-document positions run up to the table, past the row length.
    return max_len

  def exposure(
      self, data: DataConfig, corpus: exposure_lib.CorpusLengths
  ) -> exposure_lib.Exposure:
    # A document continued from the row before has context below its
    # positions: the full-context exposure is measured only.
    return exposure_lib.exposure(corpus.used(np.inf), corpus.every_row(), False)


@registry.register
class NaturalChunked(_Stream):
  """Each document cut into rows of T: natural's positions, every pair
  used."""

  name = 'natural_chunked'
  chunked = True

  def rows_per_document(
      self, data: DataConfig, pairs: np.ndarray
  ) -> np.ndarray:
    return np.ceil(pairs / data.seq_len)
