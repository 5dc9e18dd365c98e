"""Figures of a position table: its analysis, cosine similarity, and the
relation of its rows to their training exposure (the data report's too)."""

from collections.abc import Sequence
from typing import Any

import matplotlib.figure
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from flax_posemb.plots import common


def table_analysis(
    norms: np.ndarray,
    drift: np.ndarray | None,
    pca_ratio: np.ndarray,
    probe_edges: np.ndarray,
    probe_error: np.ndarray,
    path: str,
    snapshot_drift: np.ndarray | None = None,
    snapshot_steps: Sequence[int] | np.ndarray = (),
    probe_r2: float | None = None,
    boundary: int | None = None,
) -> str:
  """Row norms [L], drift from init ([L] or [S, L] at ``snapshot_steps``), PCA
  ratios [k] and the linear position probe's error [nb] per bucket of
  ``probe_edges`` [nb + 1]; ``boundary``: the first row a run added to the
  table it started from (init_from), marked."""
  has_drift = drift is not None or (
      snapshot_drift is not None and len(snapshot_drift) > 0
  )
  # A table from elsewhere has no initial table: no drift panel.
  if has_drift:
    fig, grid = plt.subplots(2, 2, figsize=(11, 7.5))
    axes = {'norm': grid[0, 0], 'drift': grid[0, 1], 'pca': grid[1, 0]}
    axes['probe'] = grid[1, 1]
  else:
    fig, row = plt.subplots(1, 3, figsize=(15, 4.2))
    axes = {'norm': row[0], 'pca': row[1], 'probe': row[2]}
  pos = np.arange(len(norms))
  ax = axes['norm']
  ax.plot(pos, norms)
  ax.set(title='row norm', xlabel='position', ylabel='||row||')
  _from_zero(ax, norms)
  if has_drift:
    _drift_panel(fig, axes['drift'], pos, drift, snapshot_drift, snapshot_steps)
  if boundary is not None:
    _mark_new_rows(axes, boundary)
  k = np.arange(1, len(pca_ratio) + 1)
  ax = axes['pca']
  ax.bar(k, pca_ratio)
  ax.plot(k, np.cumsum(pca_ratio), 'k.-', label='cumulative')
  ax.set(title='PCA explained variance', xlabel='component', ylabel='ratio')
  ax.legend(fontsize=8)
  ax = axes['probe']
  ax.plot((probe_edges[:-1] + probe_edges[1:] - 1) / 2, probe_error, 'o-')
  r2 = '' if probe_r2 is None else f' R^2 = {probe_r2:.2f}'
  ax.set(
      title=f'linear position probe (held-out rows){r2}',
      xlabel='position',
      ylabel='mean |predicted - true| position',
  )
  _from_zero(ax, probe_error)
  if probe_r2 is not None and probe_r2 < 0.5:
    ax.text(
        0.5,
        0.9,
        'low R^2: position is barely linearly decodable from these rows;\n'
        'the error profile is not a ranking of positions',
        ha='center',
        va='top',
        transform=ax.transAxes,
        fontsize=7,
        color='C3',
    )
  return common.save(fig, path)


def _mark_new_rows(axes: dict[str, Any], boundary: int) -> None:
  """A dashed line before ``boundary``, the first row a run added to the table
  it started from, on the panels over positions."""
  for name in ('norm', 'drift'):
    if name in axes:
      axes[name].axvline(boundary - 0.5, color='C3', ls='--', lw=1)
  axes['norm'].text(
      boundary,
      0.98,
      ' new rows',
      color='C3',
      va='top',
      fontsize=8,
      transform=axes['norm'].get_xaxis_transform(),
  )


def _from_zero(ax, values: np.ndarray) -> None:
  """A y axis from 0 to a little above the largest of non-negative ``values``,
  without an offset: rows of equal norm draw a flat line, not float noise
  magnified around an offset."""
  finite = np.asarray(values, np.float64)
  finite = finite[np.isfinite(finite)]
  top = float(finite.max()) if finite.size else 0.0
  ax.set_ylim(0.0, 1.05 * top if top > 0 else 1.0)
  ax.ticklabel_format(axis='y', useOffset=False)


def _drift_panel(fig, ax, pos, drift, snapshot_drift, snapshot_steps) -> None:
  """Drift from the initial table: the evaluated table's, or one line per
  snapshot on a step colour bar (every line identified, none twice)."""
  if snapshot_drift is not None and len(snapshot_drift):
    drawn = np.asarray(snapshot_drift)
    steps = np.asarray(snapshot_steps, np.float64)
    norm = matplotlib.colors.Normalize(
        steps.min(), max(steps.max(), steps.min() + 1)
    )
    cmap = plt.get_cmap('viridis')
    for s, d in zip(steps, snapshot_drift):
      ax.plot(pos, d, lw=0.8, color=cmap(norm(s)))
    fig.colorbar(
        matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label='step'
    )
  else:
    drawn = np.asarray(drift)
    ax.plot(pos, drift, 'k', lw=1.2, label='evaluated table')
    ax.legend(fontsize=8)
  ax.set(
      title='drift from the initial table',
      xlabel='position',
      ylabel='||row - row_0||',
  )
  _from_zero(ax, drawn)


def cosine_heatmap(sim: np.ndarray, path: str, title: str = '') -> str:
  """[L, L] cosine similarity between position rows."""
  fig, ax = plt.subplots(figsize=(6, 5))
  im = ax.imshow(
      sim,
      vmin=-1,
      vmax=1,
      cmap='RdBu_r',
      origin='lower',
      interpolation='nearest',
  )
  fig.colorbar(im, ax=ax)
  ax.set(
      title=title or 'cosine similarity of position rows',
      xlabel='position',
      ylabel='position',
  )
  return common.save(fig, path)


def exposure_relation(
    exposure: np.ndarray,
    series: dict[str, np.ndarray],
    path: str,
    rho: dict[str, float | None] | None = None,
) -> str:
  """Per-position quantities (name -> [L]) against training exposure [L], with
  ``rho``."""
  fig, axes = plt.subplots(
      1, len(series), figsize=(4.2 * len(series), 3.8), squeeze=False
  )
  pos = np.arange(len(exposure))
  for ax, (name, y) in zip(axes[0], series.items()):
    y = np.asarray(y, np.float64)
    ok = np.isfinite(y) & (exposure > 0)
    sc = ax.scatter(exposure[ok], y[ok], c=pos[ok], s=10, cmap='viridis')
    ax.set(
        xscale='log',
        xlabel='cumulative training exposure (tokens)',
        ylabel=name,
        title=f'{name} vs exposure',
    )
    correlation = (rho or {}).get(name)
    if correlation is not None:
      ax.text(
          0.03,
          0.95,
          f'Spearman rho = {correlation:+.2f}',
          transform=ax.transAxes,
          va='top',
          fontsize=8,
          bbox=dict(facecolor='white', alpha=0.7, lw=0),
      )
  fig.colorbar(sc, ax=axes[0, -1], label='position')
  return common.save(fig, path)


def data_exposure(report: dict[str, Any], path: str) -> str:
  """Real tokens per position, all and those whose context is their position
  (the evaluation's situation), and document-length shares; ``report`` is
  `data.report.exposure`'s."""
  counts = np.asarray(report['counts'], np.float64)
  full_context = np.asarray(report['full_context_counts'], np.float64)
  positions = np.arange(len(counts))
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
  a.plot(positions, counts, lw=1, label='all tokens')
  a.plot(positions, full_context, lw=1, label='context = position')
  a.set(
      xlabel='position id',
      ylabel='real tokens seen',
      ylim=(0, None),
      title=f"{report['source']} / {report['policy']}: exposure per position",
  )
  a.legend(fontsize=8)
  hist = report['doc_lengths']
  b.bar([h['bucket'] for h in hist], [100 * h['token_share'] for h in hist])
  b.set(
      xlabel='document length bucket ((input, target) pairs = tokens - 1)',
      ylabel='token share (%)',
      title='source document lengths',
  )
  b.tick_params(axis='x', labelrotation=30)
  return common.save(fig, path)
