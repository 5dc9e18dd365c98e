"""Position buckets: their edges, the loss by bucket and the windows' groups
(docs/DESIGN.md § Evaluation outputs).

The intervals of these losses come from `flax_posemb.inference`.
"""

from collections.abc import Mapping
import hashlib
import math
from typing import Any

import numpy as np

from flax_posemb import inference

# Window groups of `provenance_tables` in window lengths T (start depth; tokens
# after the window to the document's end). Geometric: token-uniform windows in
# books sit tens of T deep.
DEPTH_BINS = (0, 1, 2, 4, 8, 32, 128)
END_BINS = (0, 1, 4, 32)
QUANTILES = {
    'min': 0.0,
    'p10': 0.1,
    'p25': 0.25,
    'median': 0.5,
    'p75': 0.75,
    'p90': 0.9,
    'max': 1.0,
}


def make_edges(
    length: int, bucket_size: int = 0, edges: str | list[int] = ''
) -> np.ndarray:
  """The bucket edges of positions ``0..length-1``.

  Args:
    length: the number of positions (the evaluation window length).
    bucket_size: the width of uniform buckets, used when ``edges`` is empty.
    edges: 'log2' (0, 1, 2, 4, ...), strictly increasing ints from 0
      ('0,128,256' or a list; ``length`` is appended if missing), or ''.

  Returns:
    int64 ``[nb + 1]``, from 0 to ``length``.

  Raises:
    ValueError: the edges are not integers, do not start at 0, do not
      increase, or pass ``length``; or neither edges nor a bucket size >= 1.
  """
  if isinstance(edges, str) and edges.strip() == 'log2':
    return np.asarray(
        [0]
        + [2**i for i in range(int(length).bit_length()) if 2**i < length]
        + [length],
        np.int64,
    )
  try:
    if isinstance(edges, str):
      given = [int(x) for x in edges.split(',') if x.strip()]
    else:
      given = [int(x) for x in edges]
  except ValueError:
    raise ValueError(
        'bucket edges must be comma-separated integers or'
        f' "log2", got {edges!r}.'
    ) from None
  if not given:
    if bucket_size < 1:
      raise ValueError(
          'bucket_size must be >= 1 (or give bucket edges), got'
          f' {bucket_size}.'
      )
    return np.asarray(list(range(0, length, bucket_size)) + [length], np.int64)
  if given[0] != 0:
    raise ValueError(
        f'bucket edges must start at 0, got {given}. Fix: prepend 0.'
    )
  if any(b <= a for a, b in zip(given, given[1:])):
    raise ValueError(f'bucket edges must increase strictly, got {given}.')
  if given[-1] > length:
    raise ValueError(
        f'bucket edge {given[-1]} exceeds the evaluation '
        f'window length {length}. Fix: use edges <= {length}.'
    )
  if given[-1] < length:
    given.append(length)
  return np.asarray(given, np.int64)


def bucket_of_position(edges: np.ndarray) -> np.ndarray:
  """The bucket of every position.

  Args:
    edges: int ``[nb + 1]`` bucket edges (`make_edges`).

  Returns:
    int32 ``[edges[-1]]``, each position's bucket index.
  """
  return (
      np.searchsorted(edges, np.arange(edges[-1]), side='right') - 1
  ).astype(np.int32)


def bucket_rows(per_window: Mapping[str, np.ndarray]) -> list[dict[str, Any]]:
  """The results.json bucket rows (docs/DESIGN.md § Evaluation outputs).

  Args:
    per_window: ``windows.npz`` contents: ``edges`` ``[nb + 1]``,
      ``win_sum`` and ``win_count`` ``[W, nb]``, optionally ``doc`` ``[W]``.

  Returns:
    One row per bucket: ``start``, ``end``, ``tokens``, ``windows``,
    ``documents``, ``loss``, its document-clustered ``stderr`` and ``ci95``
    (`inference.bucket_intervals`) and ``bits_per_token``; None for what is
    undefined.
  """
  intervals = inference.bucket_intervals(per_window)
  edges = per_window['edges']
  counts = np.asarray(per_window['win_count'])
  finite_or_none = inference.finite_or_none
  rows = []
  for i in range(len(edges) - 1):
    loss = intervals['loss'][i]
    rows.append(
        {
            'start': int(edges[i]),
            'end': int(edges[i + 1]),
            'tokens': int(round(counts[:, i].sum())),
            'windows': int((counts[:, i] > 0).sum()),
            'documents': int(intervals['documents'][i]),
            'loss': finite_or_none(loss),
            'stderr': finite_or_none(intervals['stderr'][i]),
            'ci95': [
                finite_or_none(intervals['low'][i]),
                finite_or_none(intervals['high'][i]),
            ],
            'bits_per_token': finite_or_none(loss / math.log(2)),
        }
    )
  return rows


def overall(per_window: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """The loss over all scored tokens with its document-clustered error.

  Args:
    per_window: ``windows.npz`` contents (see `bucket_rows`).

  Returns:
    ``{'tokens', 'windows', 'documents', 'loss', 'stderr',
    'bits_per_token'}`` of one bucket spanning every position.
  """
  whole = dict(
      per_window,
      edges=np.array([0, 1]),
      win_sum=np.asarray(per_window['win_sum']).sum(1, keepdims=True),
      win_count=np.asarray(per_window['win_count']).sum(1, keepdims=True),
  )
  (row,) = bucket_rows(whole)
  keys = ('tokens', 'windows', 'documents', 'loss', 'stderr', 'bits_per_token')
  return {k: row[k] for k in keys}


def _bins(
    bins: tuple[int, ...], t: int
) -> list[tuple[str, int | None, int | None]]:
  """(label, lo, hi) of each group of ``bins`` in window lengths ``t``."""
  lo = [b * t for b in bins]
  groups: list[tuple[str, int | None, int | None]] = [
      (f'[{a}, {b})', a, b) for a, b in zip(lo, lo[1:])
  ]
  return groups + [(f'>= {lo[-1]}', lo[-1], None)]


def _binned_labels(values: np.ndarray, bins: tuple[int, ...], t: int):
  groups = _bins(bins, t)
  lo = [b * t for b in bins]
  return np.array([g[0] for g in groups])[
      np.searchsorted(lo, values, side='right') - 1
  ]


def window_groups(
    per_window: Mapping[str, np.ndarray], window_len: int
) -> dict[str, tuple[np.ndarray, list[tuple[str, int | None, int | None]]]]:
  """The window groups of the tables `by_kind`, `by_depth` and `by_end`.

  Args:
    per_window: ``windows.npz`` contents with provenance: ``start``,
      ``doc_len`` and ``kind``, each ``[W]``.
    window_len: the window length T (groups are in multiples of T).

  Returns:
    table name -> (each window's group label ``[W]``, the groups as (label,
    lo, hi) in tokens; None: unbounded).
  """
  t = int(window_len)
  start = np.asarray(per_window['start'], np.int64)
  doc_len = np.asarray(per_window['doc_len'], np.int64)
  kind = np.asarray(per_window['kind']).astype(str)
  to_end = np.maximum(doc_len - start - (t + 1), 0)
  kinds = sorted(set(kind.tolist()))
  return {
      'by_kind': (kind, [(k, None, None) for k in kinds]),
      'by_depth': (_binned_labels(start, DEPTH_BINS, t), _bins(DEPTH_BINS, t)),
      'by_end': (_binned_labels(to_end, END_BINS, t), _bins(END_BINS, t)),
  }


def provenance_tables(
    per_window: Mapping[str, np.ndarray], window_len: int
) -> dict[str, Any]:
  """Where the windows come from and the loss by bucket of each window group
  (docs/DESIGN.md § Evaluation outputs).

  Args:
    per_window: ``windows.npz`` contents with provenance: ``doc``, ``start``,
      ``doc_len`` and ``kind`` ``[W]`` beside the bucket sums.
    window_len: the window length T.

  Returns:
    ``windows`` (counts and quantiles of the windows' provenance) and
    ``by_kind``, ``by_depth``, ``by_end`` (each group's `bucket_rows`).
  """
  t = int(window_len)
  doc = np.asarray(per_window['doc'], np.int64)
  start = np.asarray(per_window['start'], np.int64)
  doc_len = np.asarray(per_window['doc_len'], np.int64)
  kind = np.asarray(per_window['kind']).astype(str)
  to_end = np.maximum(doc_len - start - (t + 1), 0)

  def dist(x):
    if not len(x):
      return None
    return {k: float(np.quantile(x, q)) for k, q in QUANTILES.items()}

  kinds = sorted(set(kind.tolist()))
  tables = {
      name: _groups(per_window, labels, groups)
      for name, (labels, groups) in window_groups(per_window, t).items()
  }
  return {
      'windows': {
          'windows': len(doc),
          'documents': len(np.unique(doc)),
          'window_len': t,
          'kinds': {
              k: {
                  'windows': int((kind == k).sum()),
                  'documents': len(np.unique(doc[kind == k])),
              }
              for k in kinds
          },
          'start': dist(start),
          'to_end': dist(to_end),
          'long_doc_share': (
              float(np.mean(doc_len >= 4 * t)) if len(doc) else None
          ),
          'first_window_overlaps': int((start < t).sum()),
      },
      **tables,
  }


def _groups(
    per_window, labels: np.ndarray, groups: list[tuple]
) -> list[dict[str, Any]]:
  """Bucket rows of the windows of each non-empty group (label, lo, hi)."""
  out = []
  for label, lo, hi in groups:
    m = labels == label
    if m.any():
      sub = {
          k: v if k == 'edges' else np.asarray(v)[m]
          for k, v in per_window.items()
      }
      out.append(
          {
              'group': label,
              'lo': lo,
              'hi': hi,
              'windows': int(m.sum()),
              'documents': int(inference.clusters(sub).max()) + 1,
              'buckets': bucket_rows(sub),
          }
      )
  return out


class BucketAccumulator:
  """Per-position and per-window bucket sums of one evaluation pass.

  Args:
    edges: int ``[nb + 1]`` bucket edges; positions ``0..L-1`` with
      ``L = edges[-1]``.
  """

  def __init__(self, edges: np.ndarray):
    self.edges = np.asarray(edges, np.int64)
    length = int(self.edges[-1])
    self.loss_sum = np.zeros(length, np.float64)
    self.count = np.zeros(length, np.float64)
    self.windows = 0  # windows with any scored token
    # per batch: its windows' arrays
    self._parts: list[dict[str, np.ndarray]] = []

  def add(
      self,
      pos_loss_sum: np.ndarray,
      pos_count: np.ndarray,
      win_sum: np.ndarray,
      win_count: np.ndarray,
      window_ids: np.ndarray | None = None,
      provenance: dict[str, np.ndarray] | None = None,
  ) -> None:
    """Adds one batch of windows; windows without a scored token are dropped.

    Args:
      pos_loss_sum: ``[L]`` loss summed per position.
      pos_count: ``[L]`` scored targets per position.
      win_sum: ``[B, nb]`` loss summed per window and bucket.
      win_count: ``[B, nb]`` scored targets per window and bucket.
      window_ids: uint64 ``[B]`` (`window_ids`); None: arrival order.
      provenance: name -> ``[B]`` array (document, start, ...).
    """
    sums = np.asarray(win_sum, np.float64)
    counts = np.asarray(win_count, np.float64)
    real = counts.sum(1) > 0
    if window_ids is None:
      window_ids = np.arange(
          self.windows, self.windows + len(counts), dtype=np.uint64
      )
    part = {k: np.asarray(v)[real] for k, v in (provenance or {}).items()}
    self._parts.append(
        dict(
            part,
            window_id=np.asarray(window_ids, np.uint64)[real],
            win_sum=sums[real],
            win_count=counts[real],
        )
    )
    self.loss_sum += np.asarray(pos_loss_sum, np.float64)
    self.count += np.asarray(pos_count, np.float64)
    self.windows += int(real.sum())

  def per_window(self) -> dict[str, np.ndarray]:
    """The contents of windows.npz (docs/DESIGN.md § Evaluation outputs).

    Returns:
      ``window_id`` ``[W]``, ``win_sum`` and ``win_count`` ``[W, nb]``, the
      provenance arrays ``[W]`` and ``edges`` ``[nb + 1]``.
    """
    nb = len(self.edges) - 1
    parts = self._parts or [
        {
            'window_id': np.zeros(0, np.uint64),
            'win_sum': np.zeros((0, nb)),
            'win_count': np.zeros((0, nb)),
        }
    ]
    keys = sorted(set.intersection(*(set(p) for p in parts)))
    return dict(
        {k: np.concatenate([p[k] for p in parts]) for k in keys},
        edges=self.edges.copy(),
    )

  def buckets(
      self, reference: dict[str, np.ndarray] | None = None
  ) -> list[dict[str, Any]]:
    """The bucket rows of the pass.

    Args:
      reference: the synthetic corpus' ``bayes_loss`` and ``filter_loss``
        per position (``[>= L]`` each), or None.

    Returns:
      `bucket_rows`, with ``bayes_loss``, ``filter_loss``, ``excess_loss``
      and ``recovered`` per bucket when ``reference`` is given.
    """
    rows = bucket_rows(self.per_window())
    if reference is None:
      return rows
    for row in rows:
      start = row['start']
      end = row['end']
      # The references weighted by the bucket's scored tokens.
      weights = self.count[start:end]
      total = weights.sum()
      if total > 0:
        bayes_sum = np.dot(weights, reference['bayes_loss'][start:end])
        filter_sum = np.dot(weights, reference['filter_loss'][start:end])
        ref_bayes = float(bayes_sum / total)
        ref_filter = float(filter_sum / total)
      else:
        ref_bayes = math.nan
        ref_filter = math.nan
      loss = math.nan if row['loss'] is None else row['loss']
      gap = ref_filter - ref_bayes
      row.update(
          bayes_loss=inference.finite_or_none(ref_bayes),
          filter_loss=inference.finite_or_none(ref_filter),
          excess_loss=inference.finite_or_none(loss - ref_bayes),
          recovered=inference.finite_or_none((ref_filter - loss) / gap)
          if abs(gap) > 1e-9
          else None,
      )
    return rows

  def per_position(self) -> dict[str, np.ndarray]:
    """The per-position sums.

    Returns:
      ``position``, ``loss_sum``, ``count`` and ``loss`` (NaN: unscored), all
      ``[L]``.
    """
    with np.errstate(invalid='ignore', divide='ignore'):
      loss = np.where(self.count > 0, self.loss_sum / self.count, np.nan)
    return {
        'position': np.arange(len(self.count)),
        'loss_sum': self.loss_sum.copy(),
        'count': self.count.copy(),
        'loss': loss,
    }


def window_ids(
    inputs: np.ndarray, positions: np.ndarray, loss_mask: np.ndarray
) -> np.ndarray:
  """A hash of each row's tokens, positions and scored targets (what pairs
  two evaluations' windows).

  Args:
    inputs: ``[B, L]`` token ids.
    positions: ``[B, L]`` position ids.
    loss_mask: ``[B, L]`` the scored targets.

  Returns:
    uint64 ``[B]``.
  """
  rows = (
      b''.join(
          np.ascontiguousarray(a[i]).tobytes()
          for a in (inputs, positions, loss_mask)
      )
      for i in range(len(inputs))
  )
  return np.frombuffer(
      b''.join(hashlib.blake2b(r, digest_size=8).digest() for r in rows),
      np.uint64,
  ).copy()


def unique_window_ids(ids: np.ndarray, seen: dict[int, int]) -> np.ndarray:
  """Repeated window ids made unique by their occurrence number.

  Args:
    ids: uint64 ``[B]`` window ids.
    seen: id -> how often it was seen so far; updated in place.

  Returns:
    uint64 ``[B]``: the first occurrence of an id keeps it, later ones are
    mixed with their occurrence number.
  """
  out = np.array(ids, np.uint64)
  for i, w in enumerate(out.tolist()):
    k = seen.get(w, 0)
    seen[w] = k + 1
    # k = 0: w itself
    out[i] = w ^ ((k * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
  return out


def document_sums(
    per_window: Mapping[str, np.ndarray], documents: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """The bucket sums and counts of the windows, per document.

  Args:
    per_window: ``windows.npz`` contents: ``doc`` ``[W]``, ``win_sum`` and
      ``win_count`` ``[W, nb]``.
    documents: int ``[G]`` sorted document ids, a superset of ``doc``.

  Returns:
    ``(sums, counts)``, ``[G, nb]`` each (zeros for a document without
    windows).
  """
  docs = np.asarray(per_window['doc'], np.int64)
  index = np.searchsorted(documents, docs)
  shape = (len(documents), np.shape(per_window['win_sum'])[1])
  sums = np.zeros(shape)
  counts = np.zeros(shape)
  np.add.at(sums, index, np.asarray(per_window['win_sum'], np.float64))
  np.add.at(counts, index, np.asarray(per_window['win_count'], np.float64))
  return sums, counts
