"""Random-offset twins (data.offset_twin): any policy's rows with each
segment moved to a random start (docs/DESIGN.md § Data policies and tokens).

A twin keeps every row's tokens, segment ids and so each token's context
(`flax_posemb.segments.context_lengths`), and changes only the positions:
each segment of ``m`` tokens starts at a position drawn uniformly from
``0 .. L - m`` (L: the position table's rows), from the run's seed and the
row's index. Segments move one by one, not the row as a whole: a `crops`
row holds many short crops from position 0 and one longest crop; moved as a
block, by at most ``L - longest``, the short crops would still never reach
the last positions. Moved one by one, each segment covers position ``p`` and
position ``L - 1 - p`` equally often (the start ``s`` and ``L - m - s`` are
drawn alike), so the last rows are trained as often as the first whatever
the policy: claims about rare rows compare an arm with its twin, claims
about long-context training the twin with the control. On the synthetic
source, whose tokens are generated for their positions, a moved segment's
documents are generated again at their new positions (the same documents,
offsets and lengths; the same tokens where the shift is a multiple of the
regimes' period), which keeps the dynamics the reference losses assume.
"""

from collections.abc import Callable
from typing import Any

import grain
import numpy as np

from flax_posemb.data import rows as rows_lib
from flax_posemb.data import sources
from flax_posemb.data.policies import exposure as exposure_lib
from flax_posemb.data.policies import registry


def segment_starts(segment_ids: np.ndarray) -> np.ndarray:
  """``[T]`` whether each column starts a segment (padding never does)."""
  starts = np.ones_like(segment_ids, bool)
  starts[1:] = segment_ids[1:] != segment_ids[:-1]
  return starts & (segment_ids > 0)


# (document, in-document index of the first input, pairs k, position of the
# first input) -> the document's tokens ``[k + 1]`` there, generated for
# those positions (the synthetic source's tokens depend on them).
Regenerate = Callable[[int, int, int, int], np.ndarray]


def synthetic_regenerate(
    src: sources.SyntheticSource, period: int
) -> Regenerate:
  """`Regenerate` of synthetic documents: the same document's uniforms, so
  the same tokens wherever a shift is a multiple of the regimes' period."""

  def regenerate(doc: int, offset: int, pairs: int, position: int):
    # The dynamics depend on the position modulo the period only.
    start = (position - offset) % period
    tokens = src.doc(
        doc, start=start, max_pairs=offset + pairs, num_pairs=offset + pairs
    )
    return tokens[offset : offset + pairs + 1]

  return regenerate


def moved(
    row: dict[str, np.ndarray],
    rng: np.random.Generator,
    table: int,
    regenerate: Regenerate | None = None,
) -> dict[str, np.ndarray]:
  """``row`` with each segment at a uniformly drawn start.

  Args:
    row: a row (dict of ``[T]`` arrays with its provenance keys), positions
      increasing by one inside each segment and below ``table``.
    rng: draws the starts.
    table: L, rows of the position table (moved positions stay below it).
    regenerate: None: the tokens stay; else the tokens of each moved
      document's run are generated again for their new positions.

  Returns:
    A copy of ``row`` whose segment of ``m`` tokens starts at a position
    drawn uniformly from ``0 .. table - m``.
  """
  out = {key: value.copy() for key, value in row.items()}
  segment_ids = row['segment_ids']
  columns = np.flatnonzero(segment_starts(segment_ids))
  for first in columns.tolist():
    m = int(np.argmin(np.append(segment_ids[first:], -1) == segment_ids[first]))
    new_start = int(rng.integers(0, table - m + 1))
    shift = new_start - int(row['positions'][first])
    out['positions'][first : first + m] += shift
    if regenerate is not None and shift:
      _regenerate_runs(out, first, first + m, regenerate)
  return out


def in_phase(
    row: dict[str, np.ndarray], regenerate: Regenerate
) -> dict[str, np.ndarray]:
  """``row`` with every document run's tokens generated for the positions it
  holds (synthetic rows cut from a stream without regard to them).

  Args:
    row: a row (dict of ``[T]`` arrays with its provenance keys).
    regenerate: generates a document's tokens at given positions.

  Returns:
    A copy of ``row``; its tokens unchanged where they were generated for
    their positions already.
  """
  out = {key: value.copy() for key, value in row.items()}
  segment_ids = row['segment_ids']
  for first in np.flatnonzero(segment_starts(segment_ids)).tolist():
    m = int(np.argmin(np.append(segment_ids[first:], -1) == segment_ids[first]))
    _regenerate_runs(out, first, first + m, regenerate)
  return out


def _regenerate_runs(
    row: dict[str, np.ndarray], first: int, end: int, regenerate: Regenerate
) -> None:
  """Generates again, in place, each run of one document in columns
  ``first .. end - 1`` of ``row`` for its positions."""
  docs = row[rows_lib.DOC_IDS]
  offsets = row[rows_lib.DOC_OFFSETS]
  column = first
  while column < end:
    run_end = column + 1
    while (
        run_end < end
        and docs[run_end] == docs[column]
        and offsets[run_end] == offsets[run_end - 1] + 1
    ):
      run_end += 1
    tokens = regenerate(
        int(docs[column]),
        int(offsets[column]),
        run_end - column,
        int(row['positions'][column]),
    )
    row['inputs'][column:run_end] = tokens[:-1]
    row['targets'][column:run_end] = tokens[1:]
    column = run_end


class OffsetTwinIterDataset(grain.IterDataset):
  """Rows of `parent` moved by `moved`, the ``i``-th row's starts drawn from
  ``(seed, process_index, i)``."""

  def __init__(
      self,
      parent: grain.IterDataset,
      *,
      seed: int,
      process_index: int,
      table: int,
      regenerate: Regenerate | None,
  ):
    super().__init__(parent)
    self._seed = seed
    self._process_index = process_index
    self._table = table
    self._regenerate = regenerate

  def __iter__(self) -> '_OffsetTwinIterator':
    return _OffsetTwinIterator(self._parent.__iter__(), self)

  def __str__(self) -> str:
    return f'OffsetTwinIterDataset(table={self._table})'


class _OffsetTwinIterator(grain.DatasetIterator):
  """State: the parent's and the rows yielded."""

  def __init__(self, parent: grain.DatasetIterator, ds: OffsetTwinIterDataset):
    super().__init__(parent)
    self._ds = ds
    self._index = 0

  def __next__(self) -> dict[str, np.ndarray]:
    row = next(self._parent)
    ds = self._ds
    rng = np.random.default_rng(
        [ds._seed, ds._process_index, self._index, 0x7719]
    )
    self._index += 1
    return moved(row, rng, ds._table, ds._regenerate)

  def get_state(self) -> dict[str, Any]:
    return {'parent': self._parent.get_state(), 'index': self._index}

  def set_state(self, state: dict[str, Any]) -> None:
    self._parent.set_state(state['parent'])
    self._index = int(state['index'])


class OffsetTwin(registry.Policy):
  """The twin of a registered policy: its rows, `moved`; not registered
  itself (`DataConfig.policy` wraps the policy when data.offset_twin)."""

  def __init__(self, inner: registry.Policy):
    self.inner = inner

  def check(self, data: Any) -> None:
    self.inner.check(data)
    if self.inner.short_phase(data) is not None:
      raise ValueError(
          f'data.offset_twin with {data.position_policy!r} and a short phase'
          ' (a length schedule cuts rows by their positions after the twin'
          ' has moved them): set data.offset_twin=False, or use a policy'
          ' without a schedule.'
      )

  def rows(self, data: Any, setup: rows_lib.RowSetup) -> grain.IterDataset:
    regenerate = None
    if isinstance(setup.src, sources.SyntheticSource):
      regenerate = synthetic_regenerate(setup.src, data.synthetic.period)
    return OffsetTwinIterDataset(
        self.inner.rows(data, setup),
        seed=setup.seed,
        process_index=setup.process_index,
        table=setup.table,
        regenerate=regenerate,
    )

  def budget_phases(self, data: Any) -> tuple[tuple[float, dict], ...]:
    return self.inner.budget_phases(data)

  def position_count(self, data: Any, max_len: int) -> int:
    # Segments move anywhere in the table.
    return max_len

  def exposure(
      self, data: Any, corpus: exposure_lib.CorpusLengths
  ) -> exposure_lib.Exposure:
    # Each segment covers p and T - 1 - p equally often (the module's
    # docstring): the last tenth of rows is trained as often as the first.
    inner = self.inner.exposure(data, corpus)
    return {
        'token_share': inner['token_share'],
        'last_over_first': 1.0,
        'full_context_last_over_first': None,
    }

  def rows_per_document(self, data: Any, pairs: np.ndarray) -> np.ndarray:
    return self.inner.rows_per_document(data, pairs)
