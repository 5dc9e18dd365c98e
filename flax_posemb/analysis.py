"""Numpy analysis of position tables ``[L, D]`` (row p = position p) and of
statistics window files (core: no files written; `analysis_report` writes them,
docs/DESIGN.md § Statistics)."""

from collections.abc import Sequence
import math
from typing import Any

import numpy as np
import scipy.stats

from flax_posemb import buckets as buckets_lib
from flax_posemb import outputs

# position_probe's relative strengths
RIDGE_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


def row_norms(table: np.ndarray) -> np.ndarray:
  """The L2 norm of each row of a table.

  Args:
    table: `[L, D]`, row `p` the embedding of position `p`.

  Returns:
    float64 `[L]`.
  """
  return np.linalg.norm(np.asarray(table, np.float64), axis=1)


def drift(table: np.ndarray, initial: np.ndarray) -> np.ndarray:
  """How far each row moved from its initial value, `||table[p] - initial[p]||`.

  Args:
    table: `[L, D]`.
    initial: `[L, D]`, the same table at initialization (or any earlier
      step).

  Returns:
    float64 `[L]`.
  """
  return np.linalg.norm(
      np.asarray(table, np.float64) - np.asarray(initial, np.float64), axis=1
  )


def _unit_rows(table: np.ndarray) -> np.ndarray:
  """[L, D] rows of `table` [L, D] scaled to norm 1 (zero rows stay 0)."""
  t = np.asarray(table, np.float64)
  n = np.linalg.norm(t, axis=1, keepdims=True)
  return np.divide(t, n, out=np.zeros_like(t), where=n > 0)


def cosine_similarity(table: np.ndarray) -> np.ndarray:
  """Cosine similarity between every pair of rows of a table.

  Args:
    table: `[L, D]`.

  Returns:
    float64 `[L, L]`; a zero row has similarity 0 with every row.
  """
  u = _unit_rows(table)
  return u @ u.T


def pca_explained_variance(table: np.ndarray) -> np.ndarray:
  """Explained-variance ratios of the principal components of a table's rows.

  Args:
    table: `[L, D]`; the rows are mean-centred first.

  Returns:
    float64 `[min(L, D)]`, largest first, summing to 1 (all 0 for a table of
    equal rows).
  """
  t = np.asarray(table, np.float64)
  var = np.linalg.svd(t - t.mean(0), compute_uv=False) ** 2
  return var / var.sum() if var.sum() > 0 else var


def cosine_by_offset(table: np.ndarray, offsets=None) -> dict[int, float]:
  """Mean cosine similarity of rows `k` positions apart, for each offset `k`.

  O(L * D) per offset, no `[L, L]` matrix.

  Args:
    table: `[L, D]`.
    offsets: the offsets `k` (each in `[1, L)`); None: 1, 2, 4, ... < L.

  Returns:
    A dict from each offset `k` to the mean over `p` of
    `cos(table[p], table[p + k])`; a zero row counts as cosine 0.
  """
  u = _unit_rows(table)
  if offsets is None:
    offsets = [2**i for i in range((len(u) - 1).bit_length())]
  return {
      int(k): float(np.mean(np.sum(u[:-k] * u[k:], axis=1))) for k in offsets
  }


def position_probe(
    table: np.ndarray,
    folds: int = 5,
    ridge: float | tuple[float, ...] = RIDGE_GRID,
) -> dict[str, Any]:
  """How well a linear probe recovers the position from its row, held out.

  Ridge regression of `p` on row `p`, cross-validated: fold `f` holds out the
  rows with `p % folds == f`. Of the `ridge` strengths the one with the lowest
  held-out squared error is reported.

  Args:
    table: `[L, D]`.
    folds: number of folds, `2 <= folds <= L`.
    ridge: one ridge strength or several to choose from, each relative to
      the mean eigenvalue of the training Gram matrix.

  Returns:
    A dict of held-out results, with keys `prediction` `[L]` (of each
    position), `abs_error` `[L]` (its absolute error), `r2` (float, R^2) and
    `ridge` (float, the chosen relative strength).
  """
  x = np.asarray(table, np.float64)
  num = x.shape[0]
  y = np.arange(num, dtype=np.float64)
  # Per fold, once for every ridge strength: the Gram matrix is the costly part.
  fits = []
  for f in range(folds):
    test = (np.arange(num) % folds) == f
    xt = x[~test]
    yt = y[~test]
    mx = xt.mean(0)
    my = yt.mean()
    xc = xt - mx
    fits.append((test, mx, my, xc.T @ xc, xc.T @ (yt - my)))
  tried = []  # (sse, ridge, prediction); the first of the lowest sse wins
  for lam_rel in np.atleast_1d(ridge):
    pred = np.zeros(num)
    for test, mx, my, gram, xty in fits:
      lam = float(lam_rel) * max(np.trace(gram) / gram.shape[0], 1e-12)
      w = np.linalg.solve(gram + lam * np.eye(gram.shape[0]), xty)
      pred[test] = (x[test] - mx) @ w + my
    tried.append((float(np.sum((pred - y) ** 2)), float(lam_rel), pred))
  sse, lam_rel, pred = min(tried, key=lambda t: t[0])
  r2 = 1.0 - sse / np.sum((y - y.mean()) ** 2)
  return {
      'prediction': pred,
      'abs_error': np.abs(pred - y),
      'r2': float(r2),
      'ridge': lam_rel,
  }


def window_files(
    stats_dir: str, upto_step: int | None = None
) -> list[tuple[int, str]]:
  """The statistics window files of a directory, in step order.

  Args:
    stats_dir: a directory of `window_STEP.npz` files (a run's `stats/`).
    upto_step: keep the files of steps <= it; None keeps all.

  Returns:
    `[(step, path), ...]`, ascending steps.
  """
  files = outputs.window_files_in(stats_dir)
  if upto_step is None:
    return files
  return [(step, path) for step, path in files if step <= upto_step]


def cumulative_exposure(
    stats_dir: str, upto_step: int | None = None
) -> np.ndarray | None:
  """Tokens trained on at each position up to a step.

  Args:
    stats_dir: a directory of window files (a run's `stats/`).
    upto_step: count up to this step's window; None: all of them.

  Returns:
    float64 `[L]`, the last window file's exact `cumulative_count` when it
    has one, else the sum of the files' `count` fields; None when there are
    no window files.
  """
  files = window_files(stats_dir, upto_step)
  if not files:
    return None
  last = outputs.load_npz(files[-1][1])
  if 'cumulative_count' in last:
    return np.asarray(last['cumulative_count'], np.float64)
  counts = [
      np.asarray(outputs.load_npz(p)['count'], np.float64) for _, p in files
  ]
  return sum_arrays(counts)


def sum_arrays(arrays: Sequence[np.ndarray]) -> np.ndarray:
  """The element-wise sum of equal-shape arrays, added in order.

  Args:
    arrays: one or more arrays of one shape.

  Returns:
    Their sum, of that shape.
  """
  total = arrays[0]
  for array in arrays[1:]:
    total = total + array
  return total


def analyze_table(
    table: np.ndarray,
    *,
    initial: np.ndarray | None = None,
    snapshots: Sequence[tuple[int, np.ndarray]] = (),
    bucket_size: int = 16,
    bucket_edges: str = '',
) -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Analysis of one position table: norms, probe, PCA, cosines and drift.

  Args:
    table: `[L, D]`.
    initial: the table at initialization, `[L, D]`, or None (no drift).
    snapshots: `[(step, table [L, D]), ...]` in step order, for drift over
      training.
    bucket_size: positions per bucket of the by-bucket summaries (with
      `bucket_edges=''`).
    bucket_edges: `'log2'`, comma-separated increasing edges from 0, or ''
      (uniform buckets of `bucket_size`; `buckets.make_edges`).

  Returns:
    A pair `(summary, arrays)`, a JSON-ready dict (rows, features, norms and
    probe errors by bucket, PCA ratios, cosine by offset, drift by bucket),
    and per-position float64 arrays: `norm`, `probe_prediction`,
    `probe_abs_error` `[L]`, `pca_ratio` `[min(L, D)]`; with `initial`,
    `drift` `[L]`, and with snapshots too `snapshot_steps` `[S]` and
    `snapshot_drift` `[S, L]`; with two or more snapshots
    `snapshot_step_change` `[S - 1, L]`.

  Raises:
    ValueError: bad `bucket_edges` (`buckets.make_edges`).
  """
  table = np.asarray(table, np.float64)
  num = table.shape[0]
  edges = buckets_lib.make_edges(num, bucket_size, bucket_edges)

  def by_bucket(values):
    return [float(values[a:b].mean()) for a, b in zip(edges[:-1], edges[1:])]

  probe = position_probe(table, folds=min(5, num))
  pca = pca_explained_variance(table)
  arrays = {
      'norm': row_norms(table),
      'probe_prediction': probe['prediction'],
      'probe_abs_error': probe['abs_error'],
      'pca_ratio': pca,
  }
  summary: dict[str, Any] = {
      'rows': num,
      'features': int(table.shape[1]),
      'norm_by_bucket': by_bucket(arrays['norm']),
      'pca_explained_variance': [float(v) for v in pca[:16]],
      'pca_components_for_90pct': int(np.searchsorted(np.cumsum(pca), 0.9) + 1),
      'probe': {
          'r2': probe['r2'],
          'ridge': probe['ridge'],
          'bucket_edges': edges.tolist(),
          'abs_error_by_bucket': by_bucket(probe['abs_error']),
      },
      'cosine_by_offset': {
          str(k): v for k, v in cosine_by_offset(table).items()
      },
  }
  if initial is not None:
    arrays['drift'] = drift(table, initial)
    summary['drift_by_bucket'] = by_bucket(arrays['drift'])
  if snapshots and initial is not None:
    arrays['snapshot_steps'] = np.array([s for s, _ in snapshots])
    arrays['snapshot_drift'] = np.stack(
        [drift(t, initial) for _, t in snapshots]
    )
    summary['snapshot_mean_drift'] = {
        str(s): float(d.mean())
        for s, d in zip(arrays['snapshot_steps'], arrays['snapshot_drift'])
    }
  if len(snapshots) > 1:
    arrays['snapshot_step_change'] = np.stack(
        [drift(b, a) for (_, a), (_, b) in zip(snapshots, snapshots[1:])]
    )
  return summary, arrays


def spearman(x: np.ndarray, y: np.ndarray) -> float | None:
  """Spearman rank correlation (ties get average ranks).

  Args:
    x: `[N]` values.
    y: `[N]` values paired with `x`.

  Returns:
    The correlation in `[-1, 1]`, or None where it is undefined (a constant
    series, or a non-finite result).
  """
  if np.ptp(x) == 0 or np.ptp(y) == 0:  # a constant series: no rank correlation
    return None
  c = scipy.stats.spearmanr(x, y).statistic
  return float(c) if math.isfinite(c) else None
