"""Analysis of a learned position table: norms, drift, similarity, PCA, a position probe.

Pure numpy functions of a table `[L, D]` (row p = position p), plus `analyze_workdir`,
which reads a run's snapshots (`tables/table_STEP.npy`) and per-position training
statistics (`stats/window_STEP.npz`, key `count`), writes `analysis.json` and plots, and
relates loss, recovered position value and drift to cumulative exposure; and
`write_table_analysis`, the same analysis (less drift and exposure) of any table, e.g. one
read by `flax_posemb.tables.load_table` (`eval.py --analyze --table`).
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import scipy.stats
from absl import logging

from flax_posemb import buckets as buckets_lib
from flax_posemb import outputs
from flax_posemb import plots
from flax_posemb import tables
from flax_posemb.eval_report import json_safe


def row_norms(table: np.ndarray) -> np.ndarray:
  """[L] L2 norm of each row of `table` [L, D]."""
  return np.linalg.norm(np.asarray(table, np.float64), axis=1)


def drift(table: np.ndarray, initial: np.ndarray) -> np.ndarray:
  """[L] ||table[p] - initial[p]|| for tables [L, D] of equal shape."""
  table, initial = np.asarray(table, np.float64), np.asarray(initial, np.float64)
  if table.shape != initial.shape:
    raise ValueError(f'tables differ in shape: {table.shape} vs initial {initial.shape}.')
  return np.linalg.norm(table - initial, axis=1)


def cosine_similarity(table: np.ndarray) -> np.ndarray:
  """[L, L] cosine similarity between rows of `table` [L, D] (0 for zero rows)."""
  t = np.asarray(table, np.float64)
  n = np.linalg.norm(t, axis=1, keepdims=True)
  u = np.divide(t, n, out=np.zeros_like(t), where=n > 0)
  return u @ u.T


def pca_explained_variance(table: np.ndarray) -> np.ndarray:
  """[min(L, D)] explained-variance ratios of the mean-centred rows of `table` [L, D]."""
  t = np.asarray(table, np.float64)
  s = np.linalg.svd(t - t.mean(0), compute_uv=False)
  var = s**2
  total = var.sum()
  return var / total if total > 0 else var


def cosine_by_offset(table: np.ndarray, offsets=None) -> dict[int, float]:
  """Mean cosine similarity of rows p and p + k, for each offset k.

  A trained table's neighbours are similar and the similarity decays with k; a random
  (untrained) one is ~0 at every k. O(L * D) per offset, unlike the [L, L] matrix.

  Args:
    table: [L, D] position table.
    offsets: offsets k (1 <= k < L); default 1, 2, 4, ... < L.

  Returns:
    {k: mean over p of cos(table[p], table[p + k])} (zero rows count as 0).
  """
  t = np.asarray(table, np.float64)
  num = t.shape[0]
  n = np.linalg.norm(t, axis=1, keepdims=True)
  u = np.divide(t, n, out=np.zeros_like(t), where=n > 0)
  if offsets is None:
    offsets = [2**i for i in range(max(num - 1, 1).bit_length()) if 2**i < num]
  return {int(k): float(np.mean(np.sum(u[:-k] * u[k:], axis=1))) for k in offsets}


RIDGE_GRID = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0)


def position_probe(table: np.ndarray, folds: int = 5,
                   ridge: float | tuple[float, ...] = RIDGE_GRID) -> dict[str, Any]:
  """Held-out linear regression of the position from its row.

  Rows are split into `folds` interleaved folds (p mod folds); each fold's positions are
  predicted by a ridge regression (with intercept) fitted on the other folds. With several
  ridge strengths, the one with the lowest held-out squared error is reported (one
  hyper-parameter chosen on the same folds: slightly optimistic).

  Args:
    table: [L, D] position table.
    folds: number of folds (>= 2, <= L).
    ridge: ridge strength(s) relative to the mean eigenvalue of the training Gram matrix.

  Returns:
    {'prediction': [L], 'abs_error': [L], 'r2': float, 'ridge': float} on held-out rows.
  """
  x = np.asarray(table, np.float64)
  num = x.shape[0]
  if not 2 <= folds <= num:
    raise ValueError(f'position probe needs 2 <= folds <= rows ({num}), got {folds}.')
  y = np.arange(num, dtype=np.float64)
  fits = []  # Per fold, once for every ridge strength: the Gram matrix is the costly part.
  for f in range(folds):
    test = (np.arange(num) % folds) == f
    xt, yt = x[~test], y[~test]
    mx, my = xt.mean(0), yt.mean()
    xc = xt - mx
    fits.append((test, mx, my, xc.T @ xc, xc.T @ (yt - my)))
  best = None
  for lam_rel in np.atleast_1d(ridge):
    pred = np.zeros(num)
    for test, mx, my, gram, xty in fits:
      lam = float(lam_rel) * max(np.trace(gram) / gram.shape[0], 1e-12)
      w = np.linalg.solve(gram + lam * np.eye(gram.shape[0]), xty)
      pred[test] = (x[test] - mx) @ w + my
    sse = float(np.sum((pred - y) ** 2))
    if best is None or sse < best[0]:
      best = (sse, float(lam_rel), pred)
  sse, lam_rel, pred = best
  r2 = 1.0 - sse / np.sum((y - y.mean()) ** 2)
  return {'prediction': pred, 'abs_error': np.abs(pred - y), 'r2': float(r2), 'ridge': lam_rel}


load_npz = outputs.load_npz  # ValueError naming a truncated / garbled file


def cumulative_exposure(workdir: str, upto_step: int | None = None) -> np.ndarray | None:
  """[L] tokens seen per position up to `upto_step` (None if the run has no statistics).

  Uses the exact `cumulative_count` of the last window file at or before `upto_step` when
  present (written by `stats.PositionStats.save`), else sums the windows' `count` vectors.
  """
  files = [(s, p) for s, p in outputs.window_files(workdir)
           if upto_step is None or s <= upto_step]
  if not files:
    return None
  last = load_npz(files[-1][1])
  if 'cumulative_count' in last:
    return np.asarray(last['cumulative_count'], np.float64)
  total = None
  for _, path in files:
    z = load_npz(path)
    if 'count' not in z:
      raise ValueError(f'{path} has no per-position "count" vector (keys: {sorted(z)}).')
    c = np.asarray(z['count'], np.float64)
    total = c if total is None else total + c
  return total


def analyze_table(table: np.ndarray, *, initial: np.ndarray | None = None,
                  snapshots: list[tuple[int, np.ndarray]] = (), bucket_size: int = 16,
                  bucket_edges: str = '') -> tuple[dict[str, Any], dict[str, np.ndarray]]:
  """Analysis of one table [L, D]; returns (JSON summary, per-position arrays)."""
  table = np.asarray(table, np.float64)
  num = table.shape[0]
  edges = buckets_lib.make_edges(num, bucket_size, bucket_edges)
  # Seconds for small tables; a minute or more for a GPT-2-sized one on a busy CPU.
  logging.info('Analysing a [%d, %d] position table: held-out position probe (%d ridge '
               'strengths x %d folds), PCA, cosine similarity, plots ...', num,
               table.shape[1], len(RIDGE_GRID), min(5, num))
  probe = position_probe(table, folds=min(5, num))
  pca = pca_explained_variance(table)
  arrays = {'norm': row_norms(table), 'probe_prediction': probe['prediction'],
            'probe_abs_error': probe['abs_error'], 'pca_ratio': pca}
  bucket_err = [float(probe['abs_error'][a:b].mean()) for a, b in zip(edges[:-1], edges[1:])]
  summary: dict[str, Any] = {
      'rows': num, 'features': int(table.shape[1]),
      'norm_by_bucket': [float(arrays['norm'][a:b].mean()) for a, b in zip(edges[:-1], edges[1:])],
      'pca_explained_variance': [float(v) for v in pca[:16]],
      'pca_components_for_90pct': int(np.searchsorted(np.cumsum(pca), 0.9) + 1),
      'probe': {'r2': probe['r2'], 'ridge': probe['ridge'], 'bucket_edges': edges.tolist(), 'abs_error_by_bucket': bucket_err},
      'cosine_by_offset': {str(k): v for k, v in cosine_by_offset(table).items()},
  }
  if initial is not None:
    arrays['drift'] = drift(table, initial)
    summary['drift_by_bucket'] = [float(arrays['drift'][a:b].mean())
                                  for a, b in zip(edges[:-1], edges[1:])]
  if snapshots and initial is not None:
    arrays['snapshot_steps'] = np.array([s for s, _ in snapshots])
    arrays['snapshot_drift'] = np.stack([drift(t, initial) for _, t in snapshots])
    summary['snapshot_mean_drift'] = {str(s): float(d.mean()) for s, d in
                                      zip(arrays['snapshot_steps'], arrays['snapshot_drift'])}
  if len(snapshots) > 1:
    steps = [np.linalg.norm(np.asarray(b, np.float64) - np.asarray(a, np.float64), axis=1)
             for (_, a), (_, b) in zip(snapshots, snapshots[1:])]
    arrays['snapshot_step_change'] = np.stack(steps)
  return summary, arrays


def analyze_workdir(workdir: str, table: np.ndarray, output: str, *, step: int | None = None,
                    initial: np.ndarray | None = None,
                    per_position: dict[str, np.ndarray] | None = None, bucket_size: int = 16,
                    bucket_edges: str = '') -> dict[str, Any]:
  """Analyses `table` [L, D] of a run and writes analysis.json, analysis.npz and plots.

  Args:
    workdir: training workdir (reads tables/table_STEP.npy and stats/window_STEP.npz).
    table: the position table to analyse [L, D].
    output: directory for the outputs.
    step: training step of `table` (limits snapshots and exposure to steps <= step).
    initial: initial table [L, D]; default tables/table_0.npy if present.
    per_position: evaluation vectors ('loss' [L'], optional 'bayes_loss', 'filter_loss'),
      related to cumulative exposure when training statistics exist.
    bucket_size: bucket width for summaries; bucket_edges: explicit edges or 'log2'.

  Returns:
    The analysis.json dict, with 'files' naming what was written.
  """
  snaps = [(s, p) for s, p in outputs.table_files(workdir)
           if step is None or s <= step]
  if initial is None and snaps and snaps[0][0] == 0:
    initial = outputs.load_npy(snaps[0][1])
  snapshots = [(s, outputs.load_npy(p)) for s, p in snaps]
  summary, arrays = analyze_table(table, initial=initial, snapshots=snapshots,
                                  bucket_size=bucket_size, bucket_edges=bucket_edges)
  summary['step'] = step
  files = _table_plots(table, summary, arrays, output)
  exposure = cumulative_exposure(workdir, step)
  if exposure is not None:
    num = min(len(exposure), table.shape[0])
    arrays['exposure'] = exposure
    series: dict[str, np.ndarray] = {}
    if per_position is not None:
      n = min(num, len(per_position['loss']))
      series['loss'] = _pad(per_position['loss'][:n], num)
      if 'bayes_loss' in per_position:
        gap = per_position['filter_loss'][:n] - per_position['bayes_loss'][:n]
        with np.errstate(invalid='ignore', divide='ignore'):
          rec = np.where(np.abs(gap) > 1e-9, (per_position['filter_loss'][:n]
                                              - per_position['loss'][:n]) / gap, np.nan)
        series['recovered'] = _pad(rec, num)
    if 'drift' in arrays:
      series['drift'] = arrays['drift'][:num]
    series['norm'] = arrays['norm'][:num]
    summary['exposure'] = {'total_tokens': float(exposure.sum()),
                           'min_position_exposure': float(exposure[:num].min()),
                           'max_position_exposure': float(exposure[:num].max())}
    rho = {}
    for name, y in series.items():
      ok = np.isfinite(y) & (exposure[:num] > 0)
      if ok.sum() > 2:
        rho[name] = _spearman(exposure[:num][ok], y[ok])
        summary['exposure'][f'spearman_{name}'] = rho[name]
    files['exposure_plot'] = plots.exposure_relation(
        exposure[:num], series, os.path.join(output, 'exposure_relation.png'), rho=rho)
  np.savez(os.path.join(output, 'analysis.npz'), **arrays)
  files['arrays'] = os.path.join(output, 'analysis.npz')
  files['json'] = os.path.join(output, 'analysis.json')
  summary['files'] = files
  with outputs.atomic_write(files['json'], 'w') as f:
    json.dump(json_safe(summary), f, indent=1)
  return summary


def _table_plots(table: np.ndarray, summary: dict[str, Any], arrays: dict[str, np.ndarray],
                 output: str) -> dict[str, str]:
  """Writes table_analysis.png and cosine_similarity.png of `analyze_table`'s results."""
  os.makedirs(output, exist_ok=True)
  return {
      'table_plot': plots.table_analysis(
          arrays['norm'], arrays.get('drift'), arrays['pca_ratio'],
          np.asarray(summary['probe']['bucket_edges']), np.asarray(summary['probe']['abs_error_by_bucket']),
          os.path.join(output, 'table_analysis.png'), arrays.get('snapshot_drift'),
          arrays.get('snapshot_steps', ()), probe_r2=summary['probe']['r2']),
      'cosine_plot': plots.cosine_heatmap(cosine_similarity(table),
                                          os.path.join(output, 'cosine_similarity.png')),
  }


def write_table_analysis(table: np.ndarray | str, output: str, *, source: str = '',
                         bucket_size: int = 16, bucket_edges: str = '') -> dict[str, Any]:
  """Analyses a table without a training run; writes table_analysis.json and plots.

  Norms, cosine structure, PCA and the held-out position probe, as `analyze_workdir`;
  drift and exposure need a run's snapshots and statistics, so they are omitted (listed
  under 'skipped').

  Args:
    table: [L, D] position table (any float dtype), or a file spec read with
      `tables.load_table` (`PATH.npy`, `PATH.npz[:KEY]`, `PATH.safetensors[:KEY]`).
    output: output directory (created).
    source: where the table came from (recorded in the JSON; default: the spec).
    bucket_size: bucket width for summaries; bucket_edges: explicit edges or 'log2'.

  Returns:
    The table_analysis.json dict: 'source', 'rows', 'features', 'norm_by_bucket',
    'cosine_by_offset', 'pca_explained_variance', 'pca_components_for_90pct', 'probe',
    'skipped', and 'files' (json, table_plot, cosine_plot paths).

  Raises:
    ValueError: `table` is not 2-D with at least 2 rows (the probe needs 2 folds), or
      the spec cannot be loaded (missing file or key, see `tables.load_table`).
  """
  if isinstance(table, str):
    source = source or table
    table = tables.load_table(table)
  table = np.asarray(table)
  if table.ndim != 2 or table.shape[0] < 2 or table.shape[1] < 1:
    raise ValueError(f'table analysis needs a [rows >= 2, features >= 1] table, got {table.shape}.')
  table = table.astype(np.float64)
  summary, arrays = analyze_table(table, bucket_size=bucket_size, bucket_edges=bucket_edges)
  summary = {'source': source, **summary,
             'skipped': {'drift': 'needs the initial table and snapshots of a training run',
                         'exposure': "needs a training run's per-position statistics"}}
  files = _table_plots(table, summary, arrays, output)
  files['json'] = os.path.join(output, 'table_analysis.json')
  summary['files'] = files
  with outputs.atomic_write(files['json'], 'w') as f:
    json.dump(json_safe(summary), f, indent=1)
  return summary


def _pad(x: np.ndarray, n: int) -> np.ndarray:
  out = np.full(n, np.nan)
  out[:len(x)] = x
  return out


def _spearman(x: np.ndarray, y: np.ndarray) -> float | None:
  """Spearman rank correlation (ties get average ranks), None where undefined."""
  c = scipy.stats.spearmanr(x, y).statistic
  return float(c) if math.isfinite(c) else None
