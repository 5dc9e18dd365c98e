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

from flax_posemb.batch import BATCH_KEYS

POLICIES = ('natural', 'packed', 'packed_reset', 'random_offset', 'length_schedule',
            'resampled')
PACKED_POLICIES = ('packed', 'packed_reset')
KEYS = BATCH_KEYS


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


def flatten_docs(docs: list[np.ndarray], min_tokens: int = 2) -> dict[str, np.ndarray]:
  """Concatenates documents' pairs into one stream.

  Args:
    docs: token arrays; those with fewer than ``max(min_tokens, 2)`` tokens are dropped.
    min_tokens: see above.

  Returns:
    {'inputs', 'targets', 'doc_pos'} int32 arrays ``[P]`` (P = total pairs); `doc_pos` is
    each pair's position within its document (0 where a document starts).
  """
  docs = [np.asarray(d) for d in docs if len(d) >= max(min_tokens, 2)]
  if not docs:
    z = np.zeros((0,), np.int32)
    return {'inputs': z, 'targets': z, 'doc_pos': z}
  pairs = np.array([len(d) - 1 for d in docs])
  starts = np.cumsum(pairs) - pairs
  return {'inputs': np.concatenate([d[:-1] for d in docs]).astype(np.int32),
          'targets': np.concatenate([d[1:] for d in docs]).astype(np.int32),
          'doc_pos': (np.arange(pairs.sum()) - np.repeat(starts, pairs)).astype(np.int32)}


class _PackIterator(grain.DatasetIterator):
  """Cuts rows from the stream of chunks. Stream pair ``i`` lands in row column
  ``i mod T``, so a chunk's first document starts at column ``(column of the previous chunk
  + its pairs) mod T``. State: the parent state before the current chunk, that chunk's
  column and the read position inside it."""

  def __init__(self, parent, materialize, seq_len, reset, min_tokens):
    super().__init__(parent)
    self._materialize = materialize
    self._seq_len = seq_len
    self._reset = reset
    self._min_tokens = min_tokens
    self._flat = None  # Flattened current chunk.
    self._chunk_state = None
    self._chunk_col = 0
    self._pos = 0  # Next pair of the current chunk.

  def _load_chunk(self, column: int) -> None:
    self._chunk_state = self._parent.get_state()
    self._chunk_col = column
    self._flat = flatten_docs(self._materialize(next(self._parent), column), self._min_tokens)
    self._pos = 0

  def __next__(self) -> dict[str, np.ndarray]:
    t = self._seq_len
    parts, need = [], t
    while need:
      if self._flat is None:
        self._load_chunk(0)
      n = len(self._flat['inputs'])
      if self._pos >= n:
        self._load_chunk((self._chunk_col + n) % t)
        continue
      take = min(need, n - self._pos)
      parts.append({k: v[self._pos:self._pos + take] for k, v in self._flat.items()})
      self._pos += take
      need -= take
    row = {k: np.concatenate([p[k] for p in parts]) if len(parts) > 1 else parts[0][k].copy()
           for k in parts[0]}
    doc_pos = row.pop('doc_pos')
    if self._reset:
      row['positions'] = doc_pos
      starts = doc_pos == 0
      starts[0] = True
      row['segment_ids'] = np.cumsum(starts, dtype=np.int32)
    else:
      row['positions'] = np.arange(t, dtype=np.int32)
      row['segment_ids'] = np.ones((t,), np.int32)
    row['loss_mask'] = np.ones((t,), np.float32)
    return row

  def get_state(self) -> dict[str, Any]:
    if self._flat is None:
      return {'parent': self._parent.get_state(), 'column': 0, 'pos': -1}
    return {'parent': self._chunk_state, 'column': self._chunk_col, 'pos': self._pos}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state['parent'])
    self._flat = None
    if state['pos'] >= 0:
      self._load_chunk(int(state['column']))
      self._pos = int(state['pos'])

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
