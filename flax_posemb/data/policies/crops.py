"""The `crops` policy: crops placed whole into rows, each its own segment
from position 0 (docs/DESIGN.md § Data policies and tokens)."""

import grain
import numpy as np

from flax_posemb.data import config as config_lib
from flax_posemb.data import corpus as corpus_lib
from flax_posemb.data import lengths as lengths_lib
from flax_posemb.data import packers
from flax_posemb.data import rows as rows_lib
from flax_posemb.data import sources
from flax_posemb.data.policies import exposure as exposure_lib
from flax_posemb.data.policies import registry

DataConfig = config_lib.DataConfig
# data.crop_weighting.
CROP_WEIGHTINGS = ('token', 'document')


def skew_ratio(spec: str) -> float:
  """R of ``data.crop_lengths='skew:R'`` (ValueError unless 0 < R <= 1)."""
  try:
    ratio = float(spec.removeprefix('skew:'))
  except ValueError:
    ratio = -1.0
  if not 0 < ratio <= 1:
    raise ValueError(
        f'data.crop_lengths={spec!r}: R in skew:R is the exposure of the last'
        ' row relative to the first and must be a number in (0, 1], e.g.'
        ' --config.data.crop_lengths=skew:0.01.'
    )
  return ratio


def piece_lengths(data: DataConfig) -> lengths_lib.PieceLengths:
  """The crop lengths of token-weighted `crops`, on the train split."""
  seq_len = data.seq_len
  spec = data.crop_lengths
  if spec == 'schedule':
    return lengths_lib.skewed_pieces(1.0, seq_len)
  if spec.startswith('skew:'):
    return lengths_lib.skewed_pieces(skew_ratio(spec), seq_len)
  if spec != 'natural':
    return lengths_lib.dist_pieces(lengths_lib.parse(spec, seq_len))
  if data.source == 'synthetic':
    dist = lengths_lib.parse(data.length_dist, seq_len)
    return lengths_lib.dist_pieces(dist, data.min_doc_len - 1)
  pairs = corpus_lib.natural_pairs(data, data.train_split)
  return lengths_lib.empirical_pieces(pairs, seq_len)


@registry.register
class Crops(registry.Policy):
  """Crops of the document stream (data.crop_weighting='token': lengths from
  data.crop_lengths, content-matched to packed) or one crop per document
  ('document': natural's weighting at a uniform offset), placed whole and in
  order into rows."""

  name = 'crops'

  def check(self, data: DataConfig) -> None:
    spec = data.crop_lengths
    if data.crop_weighting not in CROP_WEIGHTINGS:
      raise ValueError(
          f'Unknown data.crop_weighting {data.crop_weighting!r}; use one of'
          f' {CROP_WEIGHTINGS}.'
      )
    if data.crop_weighting == 'document' and spec != 'natural':
      raise ValueError(
          "data.crop_weighting='document' crops each document to its own"
          " length (at most data.seq_len); set data.crop_lengths='natural',"
          f' not {spec!r}.'
      )
    if data.source == 'synthetic' and (
        data.crop_weighting == 'document' or spec == 'schedule'
    ):
      raise ValueError(
          'Synthetic documents are generated for their position ids, so their'
          " content is matched already: use data.crop_weighting='token' with"
          " crop_lengths other than 'schedule' (BERT's schedule there:"
          " position_policy='length_schedule')."
      )
    if spec == 'schedule':
      self._check_schedule(data)
    elif spec.startswith('skew:'):
      skew_ratio(spec)
    elif spec != 'natural':
      lengths_lib.parse(spec, data.seq_len)

  def _check_schedule(self, data: DataConfig) -> None:
    short = data.schedule_seq_len
    fraction = data.schedule_fraction
    if not 1 <= short <= data.seq_len or not 0 <= fraction <= 1:
      raise ValueError(
          f'data.schedule_seq_len={short} must be in [1,'
          f' data.seq_len={data.seq_len}] and'
          f' data.schedule_fraction={fraction} in [0, 1].'
      )

  def rows(
      self, data: DataConfig, setup: rows_lib.RowSetup
  ) -> grain.IterDataset:
    chunks = rows_lib.document_chunks(setup)
    if data.crop_weighting == 'document':
      rows = self._document_crops(data, setup, chunks)
    elif (
        isinstance(setup.src, sources.SyntheticSource)
        and setup.substream is None
    ):
      rows = self._synthetic_crops(data, setup, chunks)
    else:
      # data.shared_stream on the synthetic source: stretches of documents
      # generated from position 0, generated again where the crops place
      # them (`policies.shared_stream`).
      materialize = rows_lib.tokenized(setup.src)
      if isinstance(setup.src, sources.SyntheticSource):
        materialize = rows_lib.generated(
            setup.src, data.seq_len, from_zero=True
        )
      rows = packers.CropIterDataset(
          chunks,
          materialize,
          data.seq_len,
          min_tokens=data.min_doc_len,
          seed=setup.seed,
          lengths=piece_lengths(data),
      )
    return rows_lib.shuffled(rows, data.shuffle, data.shuffle_rows, setup.seed)

  def _document_crops(
      self,
      data: DataConfig,
      setup: rows_lib.RowSetup,
      chunks: grain.IterDataset,
  ) -> grain.IterDataset:
    """One crop per document: its own length (natural's rows) at a uniform
    offset."""
    seq_len = data.seq_len
    seed = setup.seed

    def crop(
        tokens: np.ndarray, stream_position: int
    ) -> tuple[np.ndarray, int]:
      pairs = len(tokens) - 1
      m = min(pairs, seq_len)
      rng = np.random.default_rng([seed, stream_position, 0xC4])
      start = int(rng.integers(0, pairs - m + 1))
      return tokens[start : start + m + 1], start

    return packers.CropIterDataset(
        chunks,
        rows_lib.tokenized(setup.src),
        seq_len,
        min_tokens=data.min_doc_len,
        seed=seed,
        crop=crop,
    )

  def _synthetic_crops(
      self,
      data: DataConfig,
      setup: rows_lib.RowSetup,
      chunks: grain.IterDataset,
  ) -> grain.IterDataset:
    """One synthetic document per crop, generated for positions 0 .. m - 1
    with the crop's length, drawn from its place in the document order."""
    src = setup.src
    assert isinstance(src, sources.SyntheticSource)
    lengths = piece_lengths(data)
    seed = setup.seed

    def generate(chunk, column: int):
      del column
      pairs = np.array(
          [
              lengths.sample(np.random.default_rng([seed, int(g), 0xC21]), 1)[0]
              for g in chunk['stream_position']
          ],
          np.int64,
      )
      return src.docs_many(
          chunk['doc'], np.zeros_like(pairs), data.seq_len, pairs
      )

    return packers.CropIterDataset(
        chunks,
        generate,
        data.seq_len,
        min_tokens=2,
        seed=seed,
        crop=_whole_document,
    )

  def recuts_stream(self, data: DataConfig) -> bool:
    return data.crop_weighting == 'token'

  def short_phase(self, data: DataConfig) -> registry.ShortPhase | None:
    if data.crop_lengths != 'schedule':
      return None
    return registry.ShortPhase(
        packers.cut_rows, data.schedule_seq_len, data.schedule_fraction
    )

  def exposure(
      self, data: DataConfig, corpus: exposure_lib.CorpusLengths
  ) -> exposure_lib.Exposure:
    if data.crop_weighting == 'document':
      return exposure_lib.exposure(
          corpus.used(data.seq_len), corpus.first_rows()
      )
    if data.crop_lengths == 'schedule':
      fraction = data.schedule_fraction
      short = data.schedule_seq_len
      in_short = np.arange(data.seq_len) < short
      counts = fraction * (data.seq_len / short) * in_short + (1 - fraction)
    else:
      counts = piece_lengths(data).survival()
    return exposure_lib.exposure(corpus.used(np.inf), counts)

  def rows_per_document(
      self, data: DataConfig, pairs: np.ndarray
  ) -> np.ndarray:
    if data.crop_weighting == 'token':
      # Crops of a document's stretches land in different rows.
      return pairs
    return (pairs > 0).astype(np.float64)


def _whole_document(
    tokens: np.ndarray, stream_position: int
) -> tuple[np.ndarray, int]:
  del stream_position
  return tokens, 0
