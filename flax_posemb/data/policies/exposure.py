"""The analytic exposure model the policies share: what one epoch of a corpus
gives each position (the data report's table of policies, docs/DESIGN.md §
Data policies and tokens)."""

import dataclasses
from typing import Any

import numpy as np
import numpy.typing as npt

# {'token_share': share of the corpus's pairs used, 'last_over_first': the
# last tenth of positions' exposure over the first's, 'full_context_last_over_
# first': the same of the tokens whose context is their position, the
# evaluation's situation (None: not modelled)}.
Exposure = dict[str, Any]
# Occurrences per row under which a row is rare (`rare_regime`).
RARE_OCCURRENCES = 100.0


def rare_regime(
    late: float, early: float, threshold: float = RARE_OCCURRENCES
) -> bool:
  """Whether a late bucket seen ``late`` times per row, against ``early``
  (the first bucket's), is in the regime of the claim (tens of occurrences
  against thousands): fewer than ``threshold`` and under a tenth of
  ``early``."""
  return late < threshold and late < 0.1 * early


def deciles(counts: np.ndarray) -> tuple[np.ndarray, float | None]:
  """Mean counts per tenth of positions.

  Args:
    counts: ``[T]`` real tokens (or expected rows) per position.

  Returns:
    The ``[10]`` means and the last over the first (None when the first is
    0).
  """
  tenths = np.array_split(counts.astype(np.float64), 10)
  means = np.array([tenth.mean() for tenth in tenths])
  if not means[0]:
    return means, None
  return means, float(means[-1] / means[0])


def exposure(
    token_share: float, counts: np.ndarray | None, full_context: bool = True
) -> Exposure:
  """A policy's row of the table.

  Args:
    token_share: share of the corpus's pairs its rows use.
    counts: ``[T]`` exposure per position (None: uniform offsets or lengths,
      not modelled).
    full_context: every token's context is its position (each segment starts
      at position 0), so the full-context exposure is ``counts``; False: not
      modelled.

  Returns:
    The row, an `Exposure`.
  """
  last_over_first = None
  if counts is not None:
    last_over_first = deciles(counts)[1]
  full_context_last_over_first = None
  if full_context:
    full_context_last_over_first = last_over_first
  return {
      'token_share': token_share,
      'last_over_first': last_over_first,
      'full_context_last_over_first': full_context_last_over_first,
  }


@dataclasses.dataclass(frozen=True)
class CorpusLengths:
  """Documents of a sample of the corpus, by their untruncated pairs."""

  # ``[n]`` pairs of the documents every policy keeps (>= data.min_doc_len
  # tokens).
  pairs: np.ndarray
  # Pairs of the whole sample, the kept and the skipped documents (>= 1).
  total: int
  # T, the rows' length.
  seq_len: int
  # The report's seed (policies that draw lengths draw from it).
  seed: int

  @classmethod
  def of(
      cls, doc_pairs: npt.ArrayLike, seq_len: int, min_doc_len: int, seed: int
  ) -> 'CorpusLengths':
    """The lengths of documents of ``doc_pairs`` ``[n]`` pairs each."""
    pairs = np.asarray(doc_pairs, np.int64)
    return cls(
        pairs=pairs[pairs + 1 >= min_doc_len],
        total=max(int(pairs.sum()), 1),
        seq_len=seq_len,
        seed=seed,
    )

  def used(self, cap: float) -> float:
    """Share of the corpus's pairs in rows that keep at most ``cap`` pairs of
    each document."""
    return float(np.minimum(self.pairs, cap).sum() / self.total)

  def alive(self, q: np.ndarray) -> np.ndarray:
    """How many documents have more than ``q`` pairs, for each of ``q``."""
    sorted_pairs = np.sort(self.pairs)
    return len(sorted_pairs) - np.searchsorted(sorted_pairs, q, side='right')

  def first_rows(self) -> np.ndarray:
    """``[T]`` documents reaching each position of a row holding a
    document's first ``T`` pairs (natural's rows)."""
    return self.alive(np.arange(self.seq_len))

  def every_row(self) -> np.ndarray:
    """``[T]`` exposure of each position when every pair of every document
    is placed at its in-document position modulo ``T``."""
    positions = np.arange(self.seq_len)
    counts = np.zeros(self.seq_len, np.int64)
    if not len(self.pairs):
      return counts
    rows_per_longest = int(self.pairs.max() // self.seq_len) + 1
    for k in range(rows_per_longest):
      counts += self.alive(positions + k * self.seq_len)
    return counts
