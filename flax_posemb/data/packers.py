"""Grain iterators that cut the document stream into rows: packing,
crops and the short phase of a length schedule (not Grain's packers: the row
order of docs/DESIGN.md § Data policies and tokens); each restores exactly
from its state."""

from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from flax_posemb.data import lengths as lengths_lib
from flax_posemb.data import rows as rows_lib

DOC_IDS = rows_lib.DOC_IDS
DOC_OFFSETS = rows_lib.DOC_OFFSETS


class _DocStream:
  """Reads the documents of a stream of chunks, pair by pair or whole.

  `parent` yields chunks ``{'doc': [n], 'stream_position': [n]}`` of document
  indices and their positions in the document order; ``materialize(chunk,
  column)`` gives their tokens (lazily), the first placed at row column
  `column`. Documents of fewer than `min_tokens` tokens are skipped. State: the
  parent's state before the current chunk, the chunk's start column, the
  document in the chunk and its next pair: exact on restore, whatever the
  lengths.
  """

  def __init__(
      self,
      parent: grain.DatasetIterator,
      materialize: rows_lib.Materialize,
      min_tokens: int,
  ):
    self._parent = parent
    self._materialize = materialize
    self._min_tokens = min_tokens
    # False until the first chunk is read (column 0).
    self._loaded = False
    self._chunk: dict[str, np.ndarray] = {}
    self._docs: Any = ()
    self._tokens: np.ndarray | None = None
    self._chunk_state: Any = None
    self._chunk_column = 0
    self._doc = 0
    self._pos = 0

  def _load_chunk(self, column: int) -> None:
    self._chunk_state = self._parent.get_state()
    self._chunk_column = column
    self._chunk = next(self._parent)
    self._docs = self._materialize(self._chunk, column)
    self._loaded = True
    self._doc = 0
    self._pos = 0
    self._load_doc()

  def _load_doc(self) -> None:
    """Tokens of document `_doc` (None if too short or past the chunk's end)."""
    self._tokens = None
    if self._doc < len(self._docs):
      tokens = np.asarray(self._docs[self._doc])
      if len(tokens) >= self._min_tokens:
        self._tokens = tokens

  def _next_doc(self) -> None:
    self._doc += 1
    self._pos = 0
    self._load_doc()

  def _current(self, column: int) -> np.ndarray:
    """Tokens of the document with pairs left to read, loading as needed."""
    while True:
      if not self._loaded or self._doc >= len(self._docs):
        self._load_chunk(column)
      elif self._tokens is None or self._pos >= len(self._tokens) - 1:
        self._next_doc()
      else:
        return self._tokens

  def pairs(self, need: int, column: int) -> tuple[np.ndarray, ...]:
    """(inputs, targets, in-document positions, document index), each ``[k]``,
    of the next ``k <= need`` pairs of one document."""
    tokens = self._current(column)
    first = self._pos
    take = min(need, len(tokens) - 1 - first)
    self._pos += take
    doc = self._chunk['doc'][self._doc]
    return (
        tokens[first : first + take],
        tokens[first + 1 : first + 1 + take],
        np.arange(first, first + take, dtype=np.int32),
        np.full(take, doc, np.int32),
    )

  def document(self, column: int) -> tuple[np.ndarray, int, int]:
    """(tokens, document index, stream position) of the next document, whole;
    the stream moves past it."""
    tokens = self._current(column)
    doc = int(self._chunk['doc'][self._doc])
    stream_position = int(self._chunk['stream_position'][self._doc])
    self._next_doc()
    return tokens, doc, stream_position

  def get_state(self) -> dict[str, Any]:
    if not self._loaded:
      return {
          'parent': self._parent.get_state(),
          'column': 0,
          'doc': -1,
          'pos': 0,
      }
    return {
        'parent': self._chunk_state,
        'column': self._chunk_column,
        'doc': self._doc,
        'pos': self._pos,
    }

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state['parent'])
    self._loaded = False
    if int(state['doc']) >= 0:
      self._load_chunk(int(state['column']))
      self._doc = int(state['doc'])
      self._load_doc()
      self._pos = int(state['pos'])


class PackIterDataset(grain.IterDataset):
  """Streams documents whole into full rows (packed, packed_reset) or
  rows of one document each (natural_chunked). `parent` and `materialize` as
  `_DocStream`'s."""

  def __init__(
      self,
      parent: grain.IterDataset,
      materialize: rows_lib.Materialize,
      seq_len: int,
      reset: bool,
      min_tokens: int = 2,
      max_len: int | None = None,
      chunked: bool = False,
  ):
    super().__init__(parent)
    self._materialize = materialize
    self._seq_len = seq_len
    self._reset = reset
    self._min_tokens = min_tokens
    self._max_len = max_len
    self._chunked = chunked

  def __iter__(self) -> '_PackIterator':
    parent = self._parent.__iter__()
    return _PackIterator(
        parent,
        _DocStream(parent, self._materialize, self._min_tokens),
        self._seq_len,
        self._reset,
        self._max_len,
        self._chunked,
    )

  def __str__(self) -> str:
    return (
        f'PackIterDataset(seq_len={self._seq_len}, reset={self._reset},'
        f' max_len={self._max_len}, chunked={self._chunked})'
    )


class _PackIterator(grain.DatasetIterator):
  """State: the `_DocStream`'s."""

  def __init__(self, parent, stream, seq_len, reset, max_len, chunked):
    super().__init__(parent)
    self._stream = stream
    self._seq_len = seq_len
    self._reset = reset
    self._max_len = max_len
    self._chunked = chunked

  def __next__(self) -> dict[str, np.ndarray]:
    t = self._seq_len
    if self._chunked:
      inputs, targets, offsets, docs = self._stream.pairs(t, 0)
      row = rows_lib.natural_row(np.append(inputs, targets[-1:]), t)
      return rows_lib.with_provenance(row, int(docs[0]), int(offsets[0]))
    pieces = []
    need = t
    while need:
      pieces.append(self._stream.pairs(need, t - need))
      need -= len(pieces[-1][0])

    def joined(field: int) -> np.ndarray:
      return np.concatenate([piece[field] for piece in pieces]).astype(np.int32)

    doc_pos = joined(2)
    row = {
        'inputs': joined(0),
        'targets': joined(1),
        DOC_IDS: joined(3),
        DOC_OFFSETS: doc_pos,
        'positions': np.arange(t, dtype=np.int32),
        'segment_ids': np.ones((t,), np.int32),
        'loss_mask': np.ones((t,), np.float32),
    }
    if self._reset:
      if self._max_len is not None:
        # Past the table: a new segment from position 0.
        doc_pos = doc_pos % self._max_len
      starts = doc_pos == 0
      starts[0] = True
      row['positions'] = doc_pos
      row['segment_ids'] = np.cumsum(starts, dtype=np.int32)
    return row

  def get_state(self) -> dict[str, Any]:
    return self._stream.get_state()

  def set_state(self, state: dict[str, Any]) -> None:
    self._stream.set_state(state)


class CropIterDataset(grain.IterDataset):
  """Rows of the `crops` policy: crops placed whole and in order into rows
  (docs/DESIGN.md § Data policies and tokens).

  A crop that does not fit the rest of a row starts the next one; the rest is
  padding. Each crop is its own segment at positions ``0 .. m - 1``.
  `whole_documents` False: crops are the next ``m`` pairs of the document
  stream (crossing documents, as `packed` rows do), ``m`` drawn from
  `lengths`, the i-th crop's length from ``(seed, i)``. True: each document of
  the stream gives one crop, ``crop(tokens, stream_position)``.
  """

  def __init__(
      self,
      parent: grain.IterDataset,
      materialize: rows_lib.Materialize,
      seq_len: int,
      *,
      min_tokens: int,
      seed: int,
      lengths: lengths_lib.PieceLengths | None = None,
      crop: Callable[[np.ndarray, int], tuple[np.ndarray, int]] | None = None,
  ):
    super().__init__(parent)
    self._materialize = materialize
    self._seq_len = seq_len
    self._min_tokens = min_tokens
    self._seed = seed
    self._lengths = lengths
    self._crop = crop

  def __iter__(self) -> '_CropIterator':
    parent = self._parent.__iter__()
    stream = _DocStream(parent, self._materialize, self._min_tokens)
    return _CropIterator(
        parent, stream, self._seq_len, self._seed, self._lengths, self._crop
    )

  def __str__(self) -> str:
    return f'CropIterDataset(seq_len={self._seq_len})'


# Crop lengths are drawn this many at a time, from (seed, block).
_LENGTH_BLOCK = 4096


class _CropIterator(grain.DatasetIterator):
  """State: the `_DocStream`'s before the next crop, and the crops placed."""

  def __init__(self, parent, stream, seq_len, seed, lengths, crop):
    super().__init__(parent)
    self._stream = stream
    self._seq_len = seq_len
    self._seed = seed
    self._lengths = lengths
    self._crop = crop
    self._placed = 0
    # A crop read but left for the next row, with the stream state before it.
    self._pending: tuple[np.ndarray, ...] | None = None
    self._pending_state: dict[str, Any] | None = None
    self._block = -1
    self._block_lengths = np.zeros(0, np.int64)

  def _length(self, index: int) -> int:
    block = index // _LENGTH_BLOCK
    if block != self._block:
      rng = np.random.default_rng([self._seed, block, 0xC20])
      self._block_lengths = self._lengths.sample(rng, _LENGTH_BLOCK)
      self._block = block
    return int(self._block_lengths[index % _LENGTH_BLOCK])

  def _read_crop(self) -> tuple[np.ndarray, ...]:
    """(inputs, targets, document index, in-document offset) ``[m]`` of the
    next crop."""
    if self._crop is not None:
      tokens, doc, stream_position = self._stream.document(0)
      tokens, start = self._crop(tokens, stream_position)
      m = len(tokens) - 1
      offsets = np.arange(start, start + m, dtype=np.int32)
      return tokens[:-1], tokens[1:], np.full(m, doc, np.int32), offsets
    parts = []
    need = self._length(self._placed)
    while need:
      parts.append(self._stream.pairs(need, 0))
      need -= len(parts[-1][0])
    inputs, targets, offsets, docs = (
        np.concatenate([p[j] for p in parts]) for j in range(4)
    )
    return inputs, targets, docs, offsets

  def __next__(self) -> dict[str, np.ndarray]:
    t = self._seq_len
    row = rows_lib.empty_row(t)
    row[DOC_IDS] = np.full(t, -1, np.int32)
    row[DOC_OFFSETS] = np.full(t, -1, np.int32)
    column = 0
    segment = 0
    while column < t:
      if self._pending is None:
        self._pending_state = self._stream.get_state()
        self._pending = self._read_crop()
      inputs, targets, docs, offsets = self._pending
      m = len(inputs)
      if column + m > t:
        break
      end = column + m
      row['inputs'][column:end] = inputs
      row['targets'][column:end] = targets
      row[DOC_IDS][column:end] = docs
      row[DOC_OFFSETS][column:end] = offsets
      row['positions'][column:end] = np.arange(m, dtype=np.int32)
      segment += 1
      row['segment_ids'][column:end] = segment
      row['loss_mask'][column:end] = 1.0
      column = end
      self._pending = None
      self._placed += 1
    return row

  def get_state(self) -> dict[str, Any]:
    stream = self._stream.get_state()
    if self._pending is not None:
      stream = self._pending_state
    return {'stream': stream, 'placed': self._placed}

  def set_state(self, state: dict[str, Any]) -> None:
    self._stream.set_state(state['stream'])
    self._placed = int(state['placed'])
    self._pending = None


class InterleavedIterDataset(grain.IterDataset):
  """Rows of the datasets `slots` in turn: row ``i`` from slot ``i % n``
  (data.shared_stream: slot ``r`` fills row ``r`` of every batch)."""

  def __init__(self, slots: list[grain.IterDataset]):
    super().__init__(slots)
    self._slots = slots

  def __iter__(self) -> '_InterleavedIterator':
    return _InterleavedIterator([slot.__iter__() for slot in self._slots])

  def __str__(self) -> str:
    return f'InterleavedIterDataset({len(self._slots)} slots)'


class _InterleavedIterator(grain.DatasetIterator):
  """State: each slot's and the next slot."""

  def __init__(self, slots: list[grain.DatasetIterator]):
    super().__init__(slots)
    self._slots = slots
    self._next = 0

  def __next__(self) -> dict[str, np.ndarray]:
    row = next(self._slots[self._next])
    self._next = (self._next + 1) % len(self._slots)
    return row

  def get_state(self) -> dict[str, Any]:
    return {
        'slots': [slot.get_state() for slot in self._slots],
        'next': self._next,
    }

  def set_state(self, state: dict[str, Any]) -> None:
    for slot, slot_state in zip(self._slots, state['slots']):
      slot.set_state(slot_state)
    self._next = int(state['next'])


# (batch ``[b, T]``, length) -> the batch of a schedule's short phase.
BatchTransform = Callable[[dict[str, np.ndarray], int], dict[str, Any]]


def crop_columns(batch: dict[str, np.ndarray], length: int) -> dict[str, Any]:
  """``[b, T]`` rows cut to their first ``length`` columns (`length_schedule`'s
  short phase)."""
  return {k: np.ascontiguousarray(v[:, :length]) for k, v in batch.items()}


def cut_rows(batch: dict[str, np.ndarray], piece_len: int) -> dict[str, Any]:
  """``[b, T]`` rows with every segment cut into pieces of ``piece_len`` pairs,
  each its own segment from position 0 (the tokens are unchanged: `crops` with
  ``data.crop_lengths='schedule'``)."""
  positions = batch['positions'] % piece_len
  segment_ids = batch['segment_ids']
  starts = positions == 0
  starts[:, 1:] |= segment_ids[:, 1:] != segment_ids[:, :-1]
  starts[:, 0] = True
  cut = np.cumsum(starts, axis=1, dtype=np.int32)
  out = dict(batch)
  out['positions'] = np.where(segment_ids > 0, positions, 0).astype(np.int32)
  out['segment_ids'] = np.where(segment_ids > 0, cut, 0).astype(np.int32)
  return out


class ScheduleIterDataset(grain.IterDataset):
  """``short(batch, short_len)`` on the first `num_short` batches: BERT's short
  phase (`crop_columns` or `cut_rows`)."""

  def __init__(
      self,
      parent: grain.IterDataset,
      short: BatchTransform,
      short_len: int,
      num_short: int,
  ):
    super().__init__(parent)
    self._short = short
    self._short_len = short_len
    self._num_short = num_short

  def __iter__(self) -> '_ScheduleIterator':
    return _ScheduleIterator(
        self._parent.__iter__(), self._short, self._short_len, self._num_short
    )

  def __str__(self) -> str:
    return (
        f'ScheduleIterDataset({self._short.__name__}, {self._short_len},'
        f' {self._num_short})'
    )


class _ScheduleIterator(grain.DatasetIterator):
  """State: the parent's and the number of batches taken."""

  def __init__(self, parent, short, short_len, num_short):
    super().__init__(parent)
    self._short = short
    self._short_len = short_len
    self._num_short = num_short
    self._step = 0

  def __next__(self):
    batch = next(self._parent)
    if self._step < self._num_short:
      batch = self._short(batch, self._short_len)
    self._step += 1
    return batch

  def get_state(self):
    return {'parent': self._parent.get_state(), 'step': self._step}

  def set_state(self, state):
    self._parent.set_state(state['parent'])
    self._step = int(state['step'])
