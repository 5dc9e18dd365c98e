"""Training rows: the pieces every position policy builds its rows from
(docs/DESIGN.md § Data policies and tokens, its row order).

A row is a dict of ``[T]`` arrays, the batch contract's keys
(`flax_posemb.batch`) plus ``doc_ids`` (each token's document, -1: padding).
Policies (`flax_posemb.data.policies`) make their rows one document at a time
(`document_rows`) or by cutting the document stream (`document_chunks` fed to
a packer of `flax_posemb.data.packers`).
"""

from collections.abc import Callable, Sequence
import dataclasses
import functools
from typing import Any

import grain
import numpy as np
import numpy.typing as npt

from flax_posemb.batch import BATCH_KEYS as KEYS
from flax_posemb.data import sources

# Per-token document index (-1: padding), for the report's batch diversity.
DOC_IDS = 'doc_ids'
# Per-token index of its input token in its document (-1: padding): with
# DOC_IDS, a token instance's provenance (`flax_posemb.data.streams`).
DOC_OFFSETS = 'doc_offsets'
# The provenance keys a row carries beside the batch contract's.
PROVENANCE = (DOC_IDS, DOC_OFFSETS)
# "Infinite" number of rows (Grain datasets are indexed lazily).
_BIG = 2**62 // 64
_PACK_CHUNK = 256  # Documents per Grain element fed to the packer.
# (chunk of the document stream, row column of its first document) -> the
# chunk's documents' tokens ``[n_i]`` (lazily where possible).
Materialize = Callable[[Any, int], Sequence[np.ndarray]]


def empty_row(seq_len: int) -> dict[str, np.ndarray]:
  """An all-padding row: every array ``[seq_len]``, zeros."""
  return {
      k: np.zeros((seq_len,), np.float32 if k == 'loss_mask' else np.int32)
      for k in KEYS
  }


def with_provenance(
    row: dict[str, np.ndarray], doc: int, first_offset: int = 0
) -> dict[str, np.ndarray]:
  """``row`` of one document's consecutive pairs with its provenance keys.

  Args:
    row: a row whose real tokens (segment id > 0) are ``doc``'s pairs from
      its input token ``first_offset`` on, in order.
    doc: the document's index.
    first_offset: in-document index of the first real input token.

  Returns:
    ``row`` with `DOC_IDS` and `DOC_OFFSETS` ``[T]`` (-1: padding).
  """
  in_doc = row['segment_ids'] > 0
  offsets = np.cumsum(in_doc, dtype=np.int32) - 1 + first_offset
  row[DOC_IDS] = np.where(in_doc, doc, -1).astype(np.int32)
  row[DOC_OFFSETS] = np.where(in_doc, offsets, -1).astype(np.int32)
  return row


def natural_row(
    tokens: np.ndarray, seq_len: int, start: int = 0
) -> dict[str, np.ndarray]:
  """One document in one row.

  Args:
    tokens: ``[n]`` the document's tokens.
    seq_len: T, the row's length.
    start: position of its first pair (``start + pairs <= seq_len``).

  Returns:
    The row, every array ``[seq_len]``: the first ``min(n - 1, seq_len)``
    pairs at positions from `start`, then padding.
  """
  row = empty_row(seq_len)
  pairs = max(min(len(tokens) - 1, seq_len), 0)
  row['inputs'][:pairs] = tokens[:pairs]
  row['targets'][:pairs] = tokens[1 : pairs + 1]
  row['positions'][:pairs] = np.arange(start, start + pairs, dtype=np.int32)
  row['segment_ids'][:pairs] = 1
  row['loss_mask'][:pairs] = 1.0
  return row


class DocOrder:
  """Document of stream position ``g``: epoch ``g // n`` is a permutation drawn
  from ``(seed, epoch)`` (identity if not shuffled); not `MapDataset.shuffle`:
  the row order of docs/DESIGN.md § Data policies and tokens."""

  def __init__(self, n: int, seed: int, shuffle: bool = True):
    self.n = n
    self.seed = seed
    self.shuffle = shuffle

  def take(self, stream_positions: npt.ArrayLike) -> np.ndarray:
    """``[m]`` stream positions -> ``[m]`` document indices."""
    positions = np.asarray(stream_positions, np.int64)
    if not self.shuffle:
      return positions % self.n
    out = np.empty_like(positions)
    epochs = positions // self.n
    for epoch in np.unique(epochs):
      in_epoch = epochs == epoch
      permutation = _permutation(self.n, self.seed, int(epoch))
      out[in_epoch] = permutation[positions[in_epoch] % self.n]
    return out


@functools.lru_cache(maxsize=4)  # The current and the next epoch of two orders.
def _permutation(n: int, seed: int, epoch: int) -> np.ndarray:
  return np.random.default_rng([seed, epoch, 0x0D0C]).permutation(n)


@dataclasses.dataclass(frozen=True)
class RowSetup:
  """What a policy's rows are drawn from, beyond the data config."""

  # The training split's documents.
  src: sources.DocSource
  # Which document each place of the document stream holds.
  order: DocOrder
  # The run's seed (row order, drawn offsets and lengths).
  seed: int
  # Global rows per batch.
  batch_size: int
  # This process and how many there are: each makes its share of the rows.
  process_index: int
  process_count: int
  # Rows of the position table (packed_reset restarts positions past it).
  table: int
  # How Grain reads the rows (`read_options`).
  read_options: grain.ReadOptions
  # data.shared_stream: (this row slot, slots) -- `document_chunks` reads the
  # slot's share of the document stream (every ``slots``-th document); None:
  # this process's share.
  substream: tuple[int, int] | None = None


def read_options(prefetch: int) -> grain.ReadOptions:
  """Grain's read options for `prefetch` batches (data.prefetch)."""
  # Rows are built in Python (GIL-bound): one reader thread; `num_workers`
  # scales.
  num_threads = 0
  if prefetch > 0:
    num_threads = 1
  return grain.ReadOptions(
      num_threads=num_threads,
      prefetch_buffer_size=max(prefetch, 1) * 16,
  )


# (document index, the row's index in the stream of global batches) ->
# (the document's tokens ``[n]``, position of its first pair in the row).
RowTokens = Callable[[int, int], tuple[np.ndarray, int]]


def document_rows(
    setup: RowSetup, row_tokens: RowTokens, seq_len: int, min_tokens: int
) -> grain.IterDataset:
  """Rows of one document each, this process's block of each global batch.

  Args:
    setup: the documents, their order and this process's share.
    row_tokens: the tokens a row holds and where they start.
    seq_len: T, the rows' length.
    min_tokens: text documents of fewer tokens give no row
      (data.min_doc_len; synthetic ones have enough by construction).

  Returns:
    The rows, each a dict of ``[seq_len]`` arrays.
  """
  per_process = setup.batch_size // setup.process_count

  def make_row(i: int) -> dict[str, np.ndarray]:
    # The row's index in the stream of global batches.
    row_index = (i // per_process) * setup.batch_size
    row_index += setup.process_index * per_process + i % per_process
    doc = int(setup.order.take([row_index])[0])
    tokens, start = row_tokens(doc, row_index)
    return with_provenance(natural_row(tokens, seq_len, start=start), doc)

  ds = (
      grain.MapDataset.range(_BIG)
      .map(make_row)
      .to_iter_dataset(setup.read_options)
  )
  if not isinstance(setup.src, sources.SyntheticSource):
    ds = ds.filter(lambda r: r['segment_ids'].sum() >= min_tokens - 1)
  return ds


def document_chunks(setup: RowSetup) -> grain.IterDataset:
  """The document stream in chunks ``{'doc': [n], 'stream_position': [n]}``:
  this process's every ``process_count``-th document (with
  ``setup.substream``: its row slot's every ``slots``-th)."""
  share, shares = setup.process_index, setup.process_count
  if setup.substream is not None:
    share, shares = setup.substream

  def chunk(i: int) -> dict[str, np.ndarray]:
    stream_positions = (
        np.arange(i * _PACK_CHUNK, (i + 1) * _PACK_CHUNK) * shares + share
    )
    return {
        'doc': setup.order.take(stream_positions),
        'stream_position': stream_positions,
    }

  ds = grain.MapDataset.range(_BIG).map(chunk)
  return ds.to_iter_dataset(setup.read_options)


def tokenized(src: sources.DocSource) -> Materialize:
  """The packers' ``materialize`` of a chunk's documents, whole; lazy: a
  document is tokenized when the packer reaches it."""

  def tokenize(chunk: dict[str, np.ndarray], column: int):
    del column
    return grain.MapDataset.source(chunk['doc']).map(
        lambda d: src.doc(int(d), max_pairs=None)
    )

  return tokenize


def generated(
    src: sources.SyntheticSource, seq_len: int, from_zero: bool
) -> Materialize:
  """The packers' ``materialize`` of synthetic documents, generated for their
  position ids: from 0 (``from_zero``) or from their row column."""

  def generate(chunk: dict[str, np.ndarray], column: int) -> list[np.ndarray]:
    pairs = src.pairs_many(chunk['doc'], seq_len)
    if from_zero:
      starts = np.zeros_like(pairs)
    else:
      starts = (column + np.cumsum(pairs) - pairs) % seq_len
    return src.docs_many(chunk['doc'], starts, seq_len)

  return generate


def shuffled(
    rows: grain.IterDataset, shuffle: bool, window: int, seed: int
) -> grain.IterDataset:
  """Rows cut from the stream, shuffled in windows of `window` rows
  (data.shuffle_rows: a long document does not fill consecutive batches);
  unchanged unless `shuffle` and ``window > 1``."""
  if shuffle and window > 1:
    return grain.experimental.WindowShuffleIterDataset(
        rows, window_size=window, seed=seed
    )
  return rows
