"""Policies of one document per row: natural, random_offset, resampled and
length_schedule (docs/DESIGN.md § Data policies and tokens)."""

import grain
import numpy as np

from flax_posemb.data import config as config_lib
from flax_posemb.data import lengths as lengths_lib
from flax_posemb.data import packers
from flax_posemb.data import rows as rows_lib
from flax_posemb.data import sources
from flax_posemb.data.policies import exposure as exposure_lib
from flax_posemb.data.policies import registry

DataConfig = config_lib.DataConfig
CorpusLengths = exposure_lib.CorpusLengths


@registry.register
class Natural(registry.Policy):
  """Each row holds one document's first ``min(pairs, T)`` pairs at positions
  0, 1, ...; the rest is padding. Late positions are trained only by long
  documents."""

  name = 'natural'

  def row_tokens(
      self, data: DataConfig, setup: rows_lib.RowSetup
  ) -> rows_lib.RowTokens:
    """The tokens of a row and the position of its first pair."""

    def first_pairs(doc: int, row_index: int) -> tuple[np.ndarray, int]:
      del row_index
      return setup.src.doc(doc, max_pairs=data.seq_len), 0

    return first_pairs

  def rows(
      self, data: DataConfig, setup: rows_lib.RowSetup
  ) -> grain.IterDataset:
    if setup.substream is not None:
      # data.shared_stream: every context of the slot's documents, each a
      # row of its own from position 0 (natural_chunked's rows), so that
      # natural draws every token of the stream the other policies recut.
      materialize = rows_lib.tokenized(setup.src)
      if isinstance(setup.src, sources.SyntheticSource):
        materialize = rows_lib.generated(
            setup.src, data.seq_len, from_zero=True
        )
      return packers.PackIterDataset(
          rows_lib.document_chunks(setup),
          materialize,
          data.seq_len,
          reset=False,
          min_tokens=data.min_doc_len,
          chunked=True,
      )
    return rows_lib.document_rows(
        setup, self.row_tokens(data, setup), data.seq_len, data.min_doc_len
    )

  def recuts_stream(self, data: DataConfig) -> bool:
    # Its subclasses draw their own offsets or lengths per row.
    return type(self) is Natural

  def exposure(
      self, data: DataConfig, corpus: CorpusLengths
  ) -> exposure_lib.Exposure:
    if data.shared_stream:
      return exposure_lib.exposure(corpus.used(np.inf), corpus.every_row())
    return exposure_lib.exposure(corpus.used(data.seq_len), corpus.first_rows())


@registry.register
class RandomOffset(Natural):
  """natural's rows placed at a uniform start that keeps the document's pairs
  in the row: every position is trained about equally."""

  name = 'random_offset'

  def row_tokens(
      self, data: DataConfig, setup: rows_lib.RowSetup
  ) -> rows_lib.RowTokens:
    seq_len = data.seq_len
    src = setup.src

    def offset_pairs(doc: int, row_index: int) -> tuple[np.ndarray, int]:
      rng = np.random.default_rng([setup.seed, row_index, 1])
      if isinstance(src, sources.SyntheticSource):
        # Synthetic tokens depend on their positions: draw the start first.
        room = seq_len - min(src.num_pairs(doc), seq_len)
        start = int(rng.integers(0, room + 1))
        return src.doc(doc, start=start, max_pairs=seq_len), start
      tokens = src.doc(doc, max_pairs=seq_len)
      room = seq_len - max(len(tokens) - 1, 0)
      return tokens, int(rng.integers(0, room + 1))

    return offset_pairs

  def exposure(
      self, data: DataConfig, corpus: CorpusLengths
  ) -> exposure_lib.Exposure:
    # Starts past 0: a token's context is its position only when drawn 0.
    return exposure_lib.exposure(corpus.used(data.seq_len), None, False)


@registry.register
class Resampled(Natural):
  """Each row holds one document cut to a length drawn from
  data.resample_dist (at most the document's own)."""

  name = 'resampled'

  def check(self, data: DataConfig) -> None:
    lengths_lib.parse(data.resample_dist, data.seq_len)

  def row_tokens(
      self, data: DataConfig, setup: rows_lib.RowSetup
  ) -> rows_lib.RowTokens:
    target = lengths_lib.parse(data.resample_dist, data.seq_len)

    def drawn_pairs(doc: int, row_index: int) -> tuple[np.ndarray, int]:
      uniforms = np.random.default_rng([setup.seed, row_index, 2]).random(2)
      num_pairs = target.sample(uniforms[0], uniforms[1])
      tokens = setup.src.doc(doc, max_pairs=data.seq_len, num_pairs=num_pairs)
      return tokens, 0

    return drawn_pairs

  def exposure(
      self, data: DataConfig, corpus: CorpusLengths
  ) -> exposure_lib.Exposure:
    # 16 draws per document.
    draws = 16
    rng = np.random.default_rng([corpus.seed, 0x5A])
    uniforms = rng.random((2, draws * len(corpus.pairs)))
    target = lengths_lib.parse(data.resample_dist, data.seq_len)
    drawn = target.sample_many(uniforms[0], uniforms[1])
    kept = np.minimum(np.repeat(corpus.pairs, draws), drawn)
    return exposure_lib.exposure(float(kept.sum() / draws / corpus.total), None)


@registry.register
class LengthSchedule(Natural):
  """BERT's schedule: natural's rows cut to data.schedule_seq_len columns for
  the first data.schedule_fraction of the steps, then whole."""

  name = 'length_schedule'

  def check(self, data: DataConfig) -> None:
    if not (
        1 <= data.schedule_seq_len <= data.seq_len
        and 0 <= data.schedule_fraction <= 1
    ):
      raise ValueError(
          f'data.schedule_seq_len={data.schedule_seq_len} must be in [1,'
          f' data.seq_len={data.seq_len}] and'
          f' data.schedule_fraction={data.schedule_fraction} in [0, 1]; set'
          ' --config.data.schedule_seq_len or'
          ' --config.data.schedule_fraction.'
      )

  def short_phase(self, data: DataConfig) -> registry.ShortPhase:
    return registry.ShortPhase(
        packers.crop_columns, data.schedule_seq_len, data.schedule_fraction
    )

  def budget_phases(self, data: DataConfig) -> tuple[tuple[float, dict], ...]:
    share = data.schedule_fraction
    if not 0 < share < 1:
      return ()
    # Every step short, then every step long.
    return (
        (share, {'schedule_fraction': 1.0}),
        (1.0 - share, {'schedule_fraction': 0.0}),
    )

  def exposure(
      self, data: DataConfig, corpus: CorpusLengths
  ) -> exposure_lib.Exposure:
    share = data.schedule_fraction
    token_share = share * corpus.used(data.schedule_seq_len)
    token_share += (1 - share) * corpus.used(data.seq_len)
    return exposure_lib.exposure(token_share, corpus.first_rows())
