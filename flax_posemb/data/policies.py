"""Position policies: how documents become rows (docs/DESIGN.md "Data policies
and tokens")."""

from collections.abc import Callable, Sequence
from typing import Any

import grain
import numpy as np

from flax_posemb.batch import BATCH_KEYS as KEYS

POLICIES = (
    'natural',
    'packed',
    'packed_reset',
    'random_offset',
    'length_schedule',
    'resampled',
    'natural_chunked',
)
# Full rows, documents cross row boundaries.
PACKED_POLICIES = ('packed', 'packed_reset')
# Every pair of every document.
STREAM_POLICIES = PACKED_POLICIES + ('natural_chunked',)
# Per-token document index (-1: padding), for the report's batch diversity.
DOC_IDS = 'doc_ids'


def empty_row(seq_len: int) -> dict[str, np.ndarray]:
  """An all-padding row: every array ``[seq_len]``, zeros."""
  return {
      k: np.zeros((seq_len,), np.float32 if k == 'loss_mask' else np.int32)
      for k in KEYS
  }


def natural_row(
    tokens: np.ndarray, seq_len: int, start: int = 0
) -> dict[str, np.ndarray]:
  """One document ``[n]`` in one row of ``[seq_len]`` arrays: its first ``min(n
  - 1, seq_len)`` pairs at positions from `start` (``start + pairs <=
  seq_len``), padded."""
  row = empty_row(seq_len)
  pairs = max(min(len(tokens) - 1, seq_len), 0)
  row['inputs'][:pairs] = tokens[:pairs]
  row['targets'][:pairs] = tokens[1 : pairs + 1]
  row['positions'][:pairs] = np.arange(start, start + pairs, dtype=np.int32)
  row['segment_ids'][:pairs] = 1
  row['loss_mask'][:pairs] = 1.0
  return row


class PackIterDataset(grain.IterDataset):
  """Streams documents whole into the rows of the `STREAM_POLICIES` (not Grain's
  packers: docs/DESIGN.md "Row order"). `parent` yields chunks of ``[n]``
  document indices; ``materialize(chunk, column)`` gives their tokens, the first
  placed at row column `column`."""

  def __init__(
      self,
      parent: grain.IterDataset,
      materialize: Callable[[Any, int], Sequence[np.ndarray]],
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
    return _PackIterator(
        self._parent.__iter__(),
        self._materialize,
        self._seq_len,
        self._reset,
        self._min_tokens,
        self._max_len,
        self._chunked,
    )

  def __str__(self) -> str:
    return (
        f'PackIterDataset({self._seq_len}, {self._reset}, {self._min_tokens},'
        f' {self._max_len}, {self._chunked})'
    )


class _PackIterator(grain.DatasetIterator):
  """State: the parent's before the current chunk, its start column, document
  and pair."""

  def __init__(
      self,
      parent: grain.DatasetIterator,
      materialize: Callable[[Any, int], Sequence[np.ndarray]],
      seq_len: int,
      reset: bool,
      min_tokens: int,
      max_len: int | None,
      chunked: bool,
  ):
    super().__init__(parent)
    self._materialize = materialize
    self._seq_len = seq_len
    self._reset = reset
    self._min_tokens = min_tokens
    self._max_len = max_len
    self._chunked = chunked
    # The current chunk: its document indices, their tokens, the parent's state
    # before it and the row column its first document was placed at.
    self._chunk: Any = None
    self._docs: Sequence[np.ndarray] | None = None
    self._chunk_state: Any = None
    self._chunk_col = 0
    # The current document (index in the chunk), its tokens (None: skipped)
    # and the next pair to take.
    self._doc = 0
    self._tok: np.ndarray | None = None
    self._pos = 0

  def _load_chunk(self, column: int) -> None:
    self._chunk_state = self._parent.get_state()
    self._chunk_col = column
    self._chunk = next(self._parent)
    self._docs = self._materialize(self._chunk, column)
    self._doc = 0
    self._pos = 0
    self._load_doc()

  def _load_doc(self) -> None:
    """Tokens of document `_doc` (None if too short or past the chunk's end)."""
    assert self._docs is not None  # _load_chunk ran first
    self._tok = None
    if self._doc < len(self._docs):
      tokens = np.asarray(self._docs[self._doc])
      if len(tokens) >= self._min_tokens:
        self._tok = tokens

  def _next_piece(self, need: int, column: int):
    """(inputs, targets, in-document positions, doc ids) of <= `need` pairs."""
    while True:
      # None: nothing read yet (column 0).
      if self._docs is None or self._doc >= len(self._docs):
        self._load_chunk(column)
      elif self._tok is None or self._pos >= len(self._tok) - 1:
        self._doc += 1
        self._pos = 0
        self._load_doc()
      else:
        tokens = self._tok
        first = self._pos
        take = min(need, len(tokens) - 1 - first)
        self._pos += take
        return (
            tokens[first : first + take],
            tokens[first + 1 : first + 1 + take],
            np.arange(first, first + take, dtype=np.int32),
            np.full(take, self._chunk[self._doc], np.int32),
        )

  def __next__(self) -> dict[str, np.ndarray]:
    t = self._seq_len
    if self._chunked:
      inputs, targets, _, docs = self._next_piece(t, 0)
      row = natural_row(np.append(inputs, targets[-1:]), t)
      in_doc = row['segment_ids'] > 0
      row[DOC_IDS] = np.where(in_doc, docs[0], -1).astype(np.int32)
      return row
    pieces = []
    need = t
    while need:
      pieces.append(self._next_piece(need, t - need))
      need -= len(pieces[-1][0])

    def joined(field: int) -> np.ndarray:
      return np.concatenate([piece[field] for piece in pieces]).astype(np.int32)

    doc_pos = joined(2)
    row = {
        'inputs': joined(0),
        'targets': joined(1),
        DOC_IDS: joined(3),
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
    if self._docs is None:
      return {
          'parent': self._parent.get_state(),
          'column': 0,
          'doc': -1,
          'pos': 0,
      }
    return {
        'parent': self._chunk_state,
        'column': self._chunk_col,
        'doc': self._doc,
        'pos': self._pos,
    }

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state['parent'])
    self._docs = None
    if int(state['doc']) >= 0:
      self._load_chunk(int(state['column']))
      self._doc = int(state['doc'])
      self._load_doc()
      self._pos = int(state['pos'])


class ScheduleCropIterDataset(grain.IterDataset):
  """Crops the first `num_short` batches ``[b, T] -> [b, short_len]``
  (`length_schedule`)."""

  def __init__(self, parent: grain.IterDataset, short_len: int, num_short: int):
    super().__init__(parent)
    self._short_len = short_len
    self._num_short = num_short

  def __iter__(self) -> '_ScheduleCropIterator':
    return _ScheduleCropIterator(
        self._parent.__iter__(), self._short_len, self._num_short
    )

  def __str__(self) -> str:
    return f'ScheduleCropIterDataset({self._short_len}, {self._num_short})'


class _ScheduleCropIterator(grain.DatasetIterator):

  def __init__(self, parent, short_len, num_short):
    super().__init__(parent)
    self._short_len = short_len
    self._num_short = num_short
    self._step = 0

  def __next__(self):
    batch = next(self._parent)
    if self._step < self._num_short:
      batch = {
          k: np.ascontiguousarray(v[:, : self._short_len])
          for k, v in batch.items()
      }
    self._step += 1
    return batch

  def get_state(self):
    return {'parent': self._parent.get_state(), 'step': self._step}

  def set_state(self, state):
    self._parent.set_state(state['parent'])
    self._step = int(state['step'])
