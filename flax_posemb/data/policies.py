"""Position policies: how documents become rows of ``T`` input/target pairs.

Every row is a dict of ``[T]`` arrays (see docs/DESIGN.md): ``inputs``, ``targets``,
``positions``, ``segment_ids`` (0 = padding) and ``loss_mask``. A document of ``n`` tokens
gives ``n - 1`` pairs ``(tok[i], tok[i+1])``; it is truncated to ``T`` pairs in every policy,
so all policies see the same documents.

* ``natural``: one document per row, padded; positions ``0..m-1``.
* ``packed``: documents' pairs concatenated and cut into full rows; positions ``0..T-1``
  continue across documents (GPT-2/nanoGPT); one segment per row (attention crosses
  documents); a document may continue in the next row.
* ``packed_reset``: the same rows as ``packed``; positions restart at each document (a
  fragment continuing from the previous row keeps its in-document positions) and segments
  ``1, 2, ...`` mask attention per document: the exposure of ``natural`` without padding.
  Real text: inputs/targets identical to ``packed``. Synthetic: same documents and layout,
  but tokens are generated for each policy's own position ids (the corpus' dynamics depend
  on the position id), so tokens differ where the two position ids differ.
* ``random_offset``: natural rows whose positions start at ``o ~ U[0, T - m]``.
* ``length_schedule``: natural rows of ``schedule_seq_len`` for the first
  ``schedule_fraction * num_train_steps`` batches, then ``T`` (a new shape: jit recompiles
  once at the switch).
* ``resampled``: each row's length is drawn from a target distribution; synthetic documents
  are generated at that length, real documents are cropped to ``min(length, doc length)``.
"""

from __future__ import annotations

from typing import Any, Callable

import grain
import numpy as np

POLICIES = ('natural', 'packed', 'packed_reset', 'random_offset', 'length_schedule',
            'resampled')
PACKED_POLICIES = ('packed', 'packed_reset')
KEYS = ('inputs', 'targets', 'positions', 'segment_ids', 'loss_mask')


def empty_row(seq_len: int) -> dict[str, np.ndarray]:
  """An all-padding row: every array ``[seq_len]``, zeros."""
  row = {k: np.zeros((seq_len,), np.int32) for k in KEYS[:4]}
  row['loss_mask'] = np.zeros((seq_len,), np.float32)
  return row


def natural_row(tokens: np.ndarray, seq_len: int, start: int = 0) -> dict[str, np.ndarray]:
  """One document in one row, truncated to `seq_len` pairs and padded.

  Args:
    tokens: ``[n]`` int token ids.
    seq_len: T.
    start: position id of the first token (`random_offset`); ``start + m <= T`` is the
      caller's job.

  Returns:
    Row dict of ``[T]`` arrays; ``m = min(n - 1, T)`` real pairs.
  """
  row = empty_row(seq_len)
  m = max(min(len(tokens) - 1, seq_len), 0)
  row['inputs'][:m] = tokens[:m]
  row['targets'][:m] = tokens[1:m + 1]
  row['positions'][:m] = np.arange(start, start + m, dtype=np.int32)
  row['segment_ids'][:m] = 1
  row['loss_mask'][:m] = 1.0
  return row


class PackIterDataset(grain.IterDataset):
  """Packs a stream of documents into full rows (`packed` or `packed_reset`).

  Args:
    parent: IterDataset whose elements are chunks (lists) of documents; chunks amortize
      Grain's per-element cost over many short documents.
    materialize: ``(chunk, column) -> list of token arrays``: the chunk's documents, the
      first placed at row column `column` (synthetic documents are generated for the
      position ids they will occupy; must be deterministic).
    seq_len: T.
    reset: True for `packed_reset` (positions restart per document, segments per doc).
    min_tokens: documents with fewer tokens are skipped.
  """

  def __init__(self, parent: grain.IterDataset,
               materialize: Callable[[Any, int], list[np.ndarray]],
               seq_len: int, reset: bool, min_tokens: int = 2):
    super().__init__(parent)
    self._args = (materialize, seq_len, reset, max(int(min_tokens), 2))

  def __iter__(self) -> '_PackIterator':
    return _PackIterator(self._parent.__iter__(), *self._args)

  def __str__(self) -> str:
    return f'PackIterDataset(seq_len={self._args[1]}, reset={self._args[2]})'


class _PackIterator(grain.DatasetIterator):
  """State: the parent state before the current chunk, the row column the chunk started
  at, and the cursor (next document) and offset (pairs emitted) within the chunk."""

  def __init__(self, parent, materialize, seq_len, reset, min_tokens):
    super().__init__(parent)
    self._materialize = materialize
    self._seq_len = seq_len
    self._reset = reset
    self._min_tokens = min_tokens
    self._docs = None  # Token arrays of the current chunk.
    self._chunk_state = None
    self._chunk_col = 0
    self._cursor = 0  # Index of the current document in the chunk.
    self._offset = 0  # Pairs of the current document already emitted.

  def _load_chunk(self, column: int) -> None:
    self._chunk_state = self._parent.get_state()
    self._chunk_col = column
    self._docs = self._materialize(next(self._parent), column)
    self._cursor, self._offset = 0, 0

  def __next__(self) -> dict[str, np.ndarray]:
    t = self._seq_len
    row = empty_row(t)
    filled, seg = 0, 0
    while filled < t:
      if self._docs is None or self._cursor >= len(self._docs):
        self._load_chunk(filled)
      tokens = self._docs[self._cursor]
      if len(tokens) < self._min_tokens:
        self._cursor += 1
        continue
      offset, n_pairs = self._offset, len(tokens) - 1
      take = min(t - filled, n_pairs - offset)
      sl = slice(filled, filled + take)
      row['inputs'][sl] = tokens[offset:offset + take]
      row['targets'][sl] = tokens[offset + 1:offset + take + 1]
      seg += 1
      if self._reset:
        row['positions'][sl] = np.arange(offset, offset + take)
        row['segment_ids'][sl] = seg
      else:
        row['positions'][sl] = np.arange(filled, filled + take)
        row['segment_ids'][sl] = 1
      row['loss_mask'][sl] = 1.0
      filled += take
      if offset + take < n_pairs:
        self._offset = offset + take
      else:
        self._cursor, self._offset = self._cursor + 1, 0
    return row

  def get_state(self) -> dict[str, Any]:
    if self._docs is None:
      return {'parent': self._parent.get_state(), 'column': 0, 'cursor': -1, 'offset': 0}
    return {'parent': self._chunk_state, 'column': self._chunk_col, 'cursor': self._cursor,
            'offset': self._offset}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state['parent'])
    self._docs = None
    if state['cursor'] < 0:
      return
    self._load_chunk(int(state['column']))
    self._cursor, self._offset = int(state['cursor']), int(state['offset'])

  def __str__(self) -> str:
    return 'PackIterator'


class ScheduleCropIterDataset(grain.IterDataset):
  """Crops batches ``[b, T] -> [b, short_len]`` for the first `num_short` batches.

  Rows are natural rows (positions from 0), so cropping equals truncating each document
  to `short_len` pairs.
  """

  def __init__(self, parent: grain.IterDataset, short_len: int, num_short: int):
    super().__init__(parent)
    self._short_len = short_len
    self._num_short = num_short

  def __iter__(self) -> '_ScheduleCropIterator':
    return _ScheduleCropIterator(self._parent.__iter__(), self._short_len, self._num_short)

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
      batch = {k: np.ascontiguousarray(v[:, :self._short_len]) for k, v in batch.items()}
    self._step += 1
    return batch

  def get_state(self):
    return {'parent': self._parent.get_state(), 'step': self._step}

  def set_state(self, state):
    self._parent.set_state(state['parent'])
    self._step = int(state['step'])

  def __str__(self) -> str:
    return 'ScheduleCropIterator'
