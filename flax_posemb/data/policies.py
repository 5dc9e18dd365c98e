"""Position policies: how documents become rows of ``T`` input/target pairs.

Every row is a dict of ``[T]`` arrays (see docs/DESIGN.md): ``inputs``, ``targets``,
``positions``, ``segment_ids`` (0 = padding) and ``loss_mask``. A document of ``n`` tokens
gives ``n - 1`` pairs ``(tok[i], tok[i+1])``. Two kinds of policy (docs/DESIGN.md "Data
policies" states each one's exposure):

Streaming policies use every pair of every document (nothing is cut):

* ``packed``: documents' pairs concatenated and cut into full rows; positions ``0..T-1``
  in every row (GPT-2/nanoGPT); one segment per row (attention crosses documents); a
  document longer than a row simply continues in the next rows.
* ``packed_reset``: the same rows as ``packed``; positions are in-document positions and
  segments ``1, 2, ...`` mask attention per document. A document continued in the next row
  keeps its in-document positions while they fit the position table (``max_len``, passed
  by the pipeline; default ``seq_len``); its pairs past the table continue as a new segment
  whose positions restart at 0 (position ``p`` of the document gets id ``p mod max_len``).
  Real text: inputs/targets identical to ``packed``. Synthetic: same documents and layout,
  tokens generated for each policy's own position ids.
* ``natural_chunked``: every document is cut into consecutive pieces of ``T`` pairs (the
  last one shorter), one piece per row, padded; every piece restarts at position 0 and is
  its own segment.

Window policies see one window of each document: its **first** ``T`` pairs (the pairs
past them are dropped and counted by the exposure report):

* ``natural``: one document per row, padded; positions ``0..m-1``.
* ``random_offset``: natural rows whose positions start at ``o ~ U[0, T - m]``.
* ``length_schedule``: natural rows of ``schedule_seq_len`` for the first
  ``schedule_fraction * num_train_steps`` batches (the first ``schedule_seq_len`` pairs),
  then ``T`` (a new shape: jit recompiles once at the switch).
* ``resampled``: each row's length is drawn from a target distribution; synthetic documents
  are generated at that length, real documents are cropped to ``min(length, doc length)``.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import grain
import numpy as np

from flax_posemb.batch import BATCH_KEYS

POLICIES = ('natural', 'packed', 'packed_reset', 'random_offset', 'length_schedule',
            'resampled', 'natural_chunked')
PACKED_POLICIES = ('packed', 'packed_reset')  # Full rows, documents cross row boundaries.
STREAM_POLICIES = PACKED_POLICIES + ('natural_chunked',)  # Every pair of every document.
WINDOW_POLICIES = ('natural', 'random_offset', 'length_schedule', 'resampled')  # First T.
KEYS = BATCH_KEYS
# Per-token index of the document a row's token comes from (-1: padding): carried by rows so
# that reports can measure batch diversity; `make_train_iterator` drops it unless asked.
DOC_IDS = 'doc_ids'


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
  """Streams documents into rows without truncation (`packed`, `packed_reset`,
  `natural_chunked`).

  Args:
    parent: IterDataset whose elements are chunks: ``[n]`` int document indices (each row
      records them as ``doc_ids``); chunks amortize Grain's per-element cost over many short
      documents.
    materialize: ``(chunk, column) -> sequence of token arrays``: the chunk's documents, the
      first placed at row column `column` (synthetic documents are generated for the
      position ids they will occupy; must be deterministic). The sequence may be lazy
      (real text: a document is tokenized when the packer reaches it), so a chunk of long
      books never sits in memory at once.
    seq_len: T.
    reset: True for `packed_reset` (positions restart per document, segments per doc).
    min_tokens: documents with fewer tokens are skipped.
    max_len: `packed_reset` only: a document's positions run ``0..max_len-1``; past the
      position table its remaining pairs continue as a new segment whose positions restart
      at 0 (again every `max_len` pairs). None: positions are never restarted.
    chunked: `natural_chunked`: every document is cut into consecutive pieces of at most
      T pairs, one piece per row (padded), positions ``0..`` and one segment per row.
  """

  def __init__(self, parent: grain.IterDataset,
               materialize: Callable[[Any, int], Sequence[np.ndarray]],
               seq_len: int, reset: bool, min_tokens: int = 2, max_len: int | None = None,
               chunked: bool = False):
    super().__init__(parent)
    self._args = (materialize, int(seq_len), bool(reset), max(int(min_tokens), 2),
                  None if max_len is None else int(max_len), bool(chunked))

  def __iter__(self) -> '_PackIterator':
    return _PackIterator(self._parent.__iter__(), *self._args)

  def __str__(self) -> str:
    return (f'PackIterDataset(seq_len={self._args[1]}, reset={self._args[2]}, '
            f'max_len={self._args[4]}, chunked={self._args[5]})')


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
  """Cuts rows from the stream of chunks, one document at a time.

  Packed: stream pair ``i`` lands in row column ``i mod T``, so a chunk's first document
  starts at the column where the previous chunk ended. State: the parent state before the
  current chunk, that chunk's start column, the document index inside the chunk and the
  next pair inside that document (all ints: JSON-serializable, exact on restore).
  """

  def __init__(self, parent, materialize, seq_len, reset, min_tokens, max_len, chunked):
    super().__init__(parent)
    self._materialize = materialize
    self._seq_len = seq_len
    self._reset = reset
    self._min_tokens = min_tokens
    self._max_len = max_len
    self._chunked = chunked
    self._chunk = None  # Document indices of the current chunk.
    self._docs = None  # Its documents (possibly lazy).
    self._chunk_state = None
    self._chunk_col = 0
    self._doc = 0  # Index of the current document in the chunk.
    self._tok = None  # Its tokens (None: not loaded / skipped).
    self._pos = 0  # Next pair of the current document.

  def _load_chunk(self, column: int) -> None:
    self._chunk_state = self._parent.get_state()
    self._chunk_col = column
    self._chunk = next(self._parent)
    self._docs = self._materialize(self._chunk, column)
    self._doc, self._pos = 0, 0
    self._load_doc()

  def _load_doc(self) -> None:
    """Tokens of document `_doc` (None if it is too short or past the chunk's end)."""
    self._tok = None
    if self._doc < len(self._docs):
      tok = np.asarray(self._docs[self._doc])
      if len(tok) >= self._min_tokens:
        self._tok = tok

  def _advance_doc(self) -> None:
    self._doc += 1
    self._pos = 0
    self._load_doc()

  def _next_piece(self, need: int, column: int):
    """Up to `need` pairs of the current document (loading chunks as needed)."""
    while True:
      if self._docs is None:
        self._load_chunk(0)
      if self._doc >= len(self._docs):
        self._load_chunk(column)
        continue
      if self._tok is None or self._pos >= len(self._tok) - 1:
        self._advance_doc()
        continue
      tok, k = self._tok, self._pos
      take = min(need, len(tok) - 1 - k)
      self._pos += take
      return (tok[k:k + take], tok[k + 1:k + 1 + take], np.arange(k, k + take, dtype=np.int32),
              np.full(take, self._chunk[self._doc], np.int32))

  def __next__(self) -> dict[str, np.ndarray]:
    t = self._seq_len
    if self._chunked:
      inp, tgt, _, docs = self._next_piece(t, 0)
      row = natural_row(np.append(inp, tgt[-1:]), t)
      row[DOC_IDS] = np.full(t, -1, np.int32)
      row[DOC_IDS][:len(docs)] = docs
      return row
    parts, need = [], t
    while need:
      piece = self._next_piece(need, t - need)
      parts.append(piece)
      need -= len(piece[0])
    inputs, targets, doc_pos, docs = (np.concatenate([p[j] for p in parts]).astype(np.int32)
                                      for j in range(4))
    row = {'inputs': inputs, 'targets': targets, DOC_IDS: docs}
    if self._reset:
      if self._max_len is not None:
        doc_pos = doc_pos % self._max_len  # Past the table: a new segment from position 0.
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
    if self._docs is None:
      return {'parent': self._parent.get_state(), 'column': 0, 'doc': -1, 'pos': 0}
    return {'parent': self._chunk_state, 'column': self._chunk_col, 'doc': self._doc,
            'pos': self._pos}

  def set_state(self, state: dict[str, Any]) -> None:
    if 'doc' not in state:
      raise ValueError('This iterator state was written by an older packer (documents were '
                       'truncated to seq_len then); it cannot be resumed exactly. Start a new '
                       'run.')
    self._parent.set_state(state['parent'])
    self._docs = None
    if int(state['doc']) >= 0:
      self._load_chunk(int(state['column']))
      self._doc = int(state['doc'])
      self._load_doc()
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
