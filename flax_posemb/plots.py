"""Every figure of the project: each function draws arrays or results dicts into
one PNG."""

from collections.abc import Sequence
import os
from typing import Any

import matplotlib

matplotlib.use('Agg')
from matplotlib.backends.backend_agg import FigureCanvasAgg  # noqa: E402
import matplotlib.figure  # noqa: E402
import matplotlib.pyplot as plt  # noqa: E402
import matplotlib.ticker  # noqa: E402
import numpy as np  # noqa: E402

_MARKERS = ('o', 's', '^', 'D', 'v', 'P', 'X', '*', '<', '>')
_LINESTYLES = ('-', '--', ':', '-.')


def _save(fig, path: str) -> str:
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _col(rows: Sequence[dict[str, Any]], key: str) -> np.ndarray:
  return np.array(
      [np.nan if r.get(key) is None else r[key] for r in rows], np.float64
  )


def _bucket_arrays(
    rows: Sequence[dict[str, Any]], value: str = 'loss'
) -> dict[str, np.ndarray]:
  """The columns the rows have and ``half``: the half-width of each row's
  ``ci95``."""
  out = {
      k: _col(rows, k)
      for k in ('start', 'end', value, 'bayes_loss', 'filter_loss', 'recovered')
      if rows and k in rows[0]
  }
  ci = np.array(
      [[np.nan if x is None else x for x in r['ci95']] for r in rows],
      np.float64,
  )
  out['half'] = (ci[:, 1] - ci[:, 0]) / 2
  return out


def _log_buckets(b: dict[str, np.ndarray]) -> bool:
  """Whether bucket widths grow geometrically (log2 buckets): then x is drawn on
  a log axis."""
  w = b['end'] - b['start']
  return len(w) >= 4 and w[-1] >= 4 * max(w[1], 1)


def _bucket_x(b: dict[str, np.ndarray], log: bool) -> np.ndarray:
  # On a log axis position 0 cannot be drawn: x is position + 1 there; else the
  # bucket middle.
  return (
      np.sqrt((b['start'] + 1) * b['end'])
      if log
      else (b['start'] + b['end'] - 1) / 2
  )


def loss_by_position(
    per_position: dict[str, np.ndarray],
    results: dict[str, Any],
    path: str,
    title: str = '',
) -> str:
  """Saves `loss_by_position_figure` to `path`; returns `path`."""
  return _save(loss_by_position_figure(per_position, results, title), path)


def loss_by_position_figure(
    per_position: dict[str, np.ndarray],
    results: dict[str, Any],
    title: str = '',
):
  """Loss by position bucket (95% CI) of ``results`` (results.json), a line per
  document kind, ``per_position`` loss [L] or, on the synthetic corpus, the
  bounds and the share recovered."""
  b = _bucket_arrays(results['buckets'])
  synth = 'recovered' in b
  log = _log_buckets(b)
  x = _bucket_x(b, log)
  fig, axes = plt.subplots(
      2 if synth else 1,
      1,
      figsize=(10, 6.5 if synth else 4.2),
      sharex=True,
      squeeze=False,
  )
  ax = axes[0, 0]
  # On the synthetic corpus per-position loss is a regime sawtooth: buckets
  # only.
  if not synth:
    pos = np.asarray(per_position['position']) + (1 if log else 0)
    ax.plot(
        pos,
        per_position['loss'],
        lw=0.6,
        alpha=0.35,
        color='C0',
        label='per position',
    )
  ax.errorbar(
      x,
      b['loss'],
      yerr=b['half'],
      fmt='o-',
      color='C0',
      capsize=3,
      label='model, bucket mean (95% CI)',
  )
  kinds = results.get('by_kind') or []
  # The source mix: a thin line each.
  for i, g in enumerate(kinds if len(kinds) > 1 else []):
    ax.plot(
        x,
        _col(g['buckets'], 'loss'),
        '.-',
        lw=0.8,
        ms=3,
        color=f'C{i + 3}',
        label=f"{g['group']} ({g['windows']} windows, {g['documents']} docs)",
    )
  ax.set_ylabel('loss (nats / token)')
  ax.set_title(
      title or f"loss by position, step {results.get('step')}", fontsize=10
  )
  # recovered = (filter - loss) / (filter - bayes): the loss interval, rescaled.
  if synth:
    ax.plot(x, b['bayes_loss'], 'k.-', lw=1, label='Bayes (position known)')
    ax.plot(
        x,
        b['filter_loss'],
        '.--',
        color='gray',
        lw=1,
        label='filter (position unknown)',
    )
    ax2 = axes[1, 0]
    with np.errstate(invalid='ignore', divide='ignore'):
      half = b['half'] / np.abs(b['filter_loss'] - b['bayes_loss'])
    ax2.errorbar(
        x,
        b['recovered'],
        yerr=half,
        fmt='o-',
        color='C2',
        capsize=3,
        label='recovered (95% CI)',
    )
    ax2.axhline(
        1.0, color='k', lw=0.8, label='1 = Bayes: all of the position value'
    )
    ax2.axhline(
        0.0, color='gray', lw=0.8, ls='--', label='0 = position-blind filter'
    )
    ax2.set_ylabel('share of the position value\nrecovered by the rows')
  # Legends right of the axes, where they cover no data or error bar.
  for a in axes[:, 0]:
    a.legend(
        fontsize=8,
        loc='upper left',
        bbox_to_anchor=(1.01, 1.0),
        borderaxespad=0.0,
    )
  axes[-1, 0].set(
      xscale='log' if log else 'linear',
      xlabel='position + 1 (log scale; = context length)'
      if log
      else 'position (= context length - 1)',
  )
  return fig


def _series(
    ax,
    series: Sequence[tuple[str, Sequence[dict[str, Any]]]],
    log: bool,
    ylabel: str,
    value: str = 'loss',
    first_color: int = 0,
) -> None:
  """Bucket rows' ``value`` (95% CI), one series per (label, rows)."""
  for j, (label, all_rows) in enumerate(series):
    rows = [r for r in all_rows if r[value] is not None]
    if rows:
      b = _bucket_arrays(rows, value)
      ax.errorbar(
          _bucket_x(b, log),
          b[value],
          yerr=b['half'],
          fmt='o-',
          capsize=3,
          color=f'C{j + first_color}',
          label=label,
      )
  if value != 'loss':
    ax.axhline(0.0, color='k', lw=0.8)
  ax.set_ylabel(ylabel)
  ax.legend(fontsize=8)


def comparison(
    labels: Sequence[str],
    results: Sequence[dict[str, Any]],
    path: str,
    paired: Sequence[dict[str, Any]] = (),
) -> str:
  """Bucket loss (95% CI) of several runs, excess over Bayes, ``paired``
  differences."""
  first = _bucket_arrays(results[0]['buckets'])
  synth = all('bayes_loss' in r['buckets'][0] for r in results)
  log = _log_buckets(first)
  n = 1 + int(synth) + int(bool(paired))
  fig, axes = plt.subplots(
      n, 1, figsize=(8, 2.2 + 2.2 * n), sharex=True, squeeze=False
  )
  runs = [(label, r['buckets']) for label, r in zip(labels, results)]
  if synth:
    axes[0, 0].plot(
        _bucket_x(first, log), first['bayes_loss'], 'k-', lw=1, label='Bayes'
    )
    _series(axes[1, 0], runs, log, 'excess loss over Bayes', 'excess_loss')
  _series(axes[0, 0], runs, log, 'loss (nats / token)')
  axes[0, 0].set_title('loss by position bucket')
  if paired:
    _series(
        axes[-1, 0],
        [(f"{p['label']} - {p['minus']}", p['buckets']) for p in paired],
        log,
        'paired difference (nats)',
        'diff',
        1,
    )
  axes[-1, 0].set(
      xscale='log' if log else 'linear',
      xlabel='position + 1 (log scale)'
      if log
      else 'position (bucket midpoint)',
  )
  return _save(fig, path)


def offset_probe(probe: dict[str, Any], path: str) -> str:
  """Loss by context length per offset K (results['offset_probe']) and the
  paired K - K0."""
  paired = probe.get('paired_vs_first') or []
  fig, axes = plt.subplots(
      2 if paired else 1,
      1,
      figsize=(8, 7 if paired else 4.2),
      sharex=True,
      squeeze=False,
  )
  log = _log_buckets(_bucket_arrays(probe['by_offset'][0]['buckets']))
  _series(
      axes[0, 0],
      [(f"K = {r['offset']}", r['buckets']) for r in probe['by_offset']],
      log,
      'loss (nats / token)',
  )
  axes[0, 0].set_title('offset probe: same texts, rows p + K')
  if paired:
    _series(
        axes[1, 0],
        [
            (
                f"K = {p['offset']} - K = {p['minus_offset']} (95% CI)",
                p['buckets'],
            )
            for p in paired
        ],
        log,
        'paired difference\nK - K0 (nats / token)',
        'diff',
        1,
    )
  axes[-1, 0].set(
      xscale='log' if log else 'linear',
      xlabel='context length'
      + (' (log scale)' if log else ' - 1')
      + ' (position ids shifted by K)',
  )
  return _save(fig, path)


# Per-position curves of a statistics window: y-axis label of each.
CURVE_LABELS = {
    'count': 'real tokens',
    'loss': 'training loss (nats / token)',
    'signal_per_occurrence': 'mean ||g|| per occurrence',
    'coherence': 'row_sq / (count * occ_sq)',
    'update_sq': '||row change||^2',
    'row_sq': '||table-gradient row||^2',
    'occ_norm': 'sum of ||g||',
    'drift': '||row - initial row||',
}


class PositionCurveImages:
  """``(name, values [P], window) -> [H, W, 3]`` uint8: a line plot of one
  per-position curve of a statistics window (``window``, e.g. 'steps 1-25';
  NaN: a gap), for TensorBoard's Images tab (which shows the tag and step
  above it). One figure per curve name, redrawn for each window: a new figure
  per image costs twice as much (laying out its text), and a training run
  draws eight per window."""

  def __init__(self) -> None:
    self._figures: dict[str, tuple[Any, Any, Any]] = {}

  def _figure(self, name: str, size: int) -> tuple[Any, Any, Any]:
    """(canvas, axes, line) of ``name``'s figure, made at its first use."""
    if name not in self._figures:
      fig = matplotlib.figure.Figure(figsize=(5.0, 2.5), dpi=80)
      canvas = FigureCanvasAgg(fig)
      ax = fig.add_subplot()
      (line,) = ax.plot(np.arange(size), np.zeros(size), lw=1.0)
      ax.set_xlim(0, max(size - 1, 1))
      ax.set_ylabel(CURVE_LABELS.get(name, name), fontsize=8)
      ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(5))
      ax.yaxis.set_major_locator(matplotlib.ticker.MaxNLocator(4))
      ax.tick_params(labelsize=7)
      fig.subplots_adjust(left=0.16, right=0.97, bottom=0.18, top=0.95)
      self._figures[name] = (canvas, ax, line)
    return self._figures[name]

  def __call__(
      self, name: str, values: np.ndarray, window: str = ''
  ) -> np.ndarray:
    values = np.asarray(values, np.float64)
    canvas, ax, line = self._figure(name, len(values))
    line.set_data(np.arange(len(values)), values)
    ax.relim()
    ax.autoscale_view(scalex=False)
    xlabel = f'position ({window})' if window else 'position'
    ax.set_xlabel(xlabel, fontsize=8)
    canvas.draw()
    return np.asarray(canvas.buffer_rgba())[..., :3].copy()


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
  return _save(fig, path)


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
  return _save(fig, path)


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
  return _save(fig, path)


def data_exposure(report: dict[str, Any], path: str) -> str:
  """Real tokens per position and document-length shares
  (``data.report.exposure``)."""
  counts = np.asarray(report['counts'], np.float64)
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
  a.plot(np.arange(len(counts)), counts, lw=1)
  a.set(
      xlabel='position id',
      ylabel='real tokens seen',
      ylim=(0, None),
      title=f"{report['source']} / {report['policy']}: exposure per position",
  )
  hist = report['doc_lengths']
  b.bar([h['bucket'] for h in hist], [100 * h['token_share'] for h in hist])
  b.set(
      xlabel='document length bucket ((input, target) pairs = tokens - 1)',
      ylabel='token share (%)',
      title='source document lengths',
  )
  b.tick_params(axis='x', labelrotation=30)
  return _save(fig, path)


def _arm_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
  """One colour, marker and line style per arm."""
  cycle = plt.rcParams['axes.prop_cycle'].by_key()['color']
  return {
      n: {
          'color': cycle[i % len(cycle)],
          'marker': _MARKERS[i % len(_MARKERS)],
          'ls': _LINESTYLES[i % len(_LINESTYLES)],
      }
      for i, n in enumerate(names)
  }


def _errorbars(
    ax,
    x: np.ndarray,
    intervals: Sequence[dict[str, Any]],
    style: dict[str, Any],
    label: str,
) -> Any:
  mean = _col(intervals, 'mean')
  low = _col(intervals, 'low')
  high = _col(intervals, 'high')
  err = np.stack([mean - low, high - mean])
  return ax.errorbar(
      x,
      mean,
      yerr=np.where(np.isfinite(err), err, 0.0),
      ms=4,
      capsize=2,
      lw=1.2,
      elinewidth=0.9,
      label=label,
      **style,
  )


def _seed_note(n: int, documents: bool = False) -> str:
  if n == 1:
    return 'n=1 seed: no interval'
  if n > 1 and documents:
    return f'95% CI over n={n} seeds and the documents'
  if n > 1:
    return f'95% CI over n={n} seeds'
  return 'no finished run'


def experiment_profile(
    path: str,
    bucket_labels: Sequence[str],
    series: dict[str, Sequence[dict[str, Any]]],
    *,
    differences: dict[str, Sequence[dict[str, Any]]] | None = None,
    baseline: str = '',
    title: str = '',
    ylabel: str = '',
    n_seeds: int = 0,
    log_y: bool = False,
    documents: bool = False,
) -> str:
  """Per-bucket intervals per arm (over seeds, and ``documents``) and, right,
  paired differences to ``baseline``."""
  two = bool(differences)
  names = list(dict.fromkeys([*series, *(differences or {})]))
  style = _arm_styles(names)
  fig = plt.figure(figsize=(13 if two else 8, 4.4))
  gs = fig.add_gridspec(
      1, 3 if two else 2, width_ratios=[1, 1, 0.32] if two else [1, 0.4]
  )
  x = np.arange(len(bucket_labels), dtype=np.float64)
  jitter = {n: 0.08 * (i - (len(names) - 1) / 2) for i, n in enumerate(names)}
  panels = [(series, ylabel, 'mean per arm')]
  if differences:
    panels.append(
        (
            differences,
            f'difference: arm - {baseline}',
            f'paired difference vs {baseline}',
        )
    )
  handles: dict[str, Any] = {}
  for i, (intervals, panel_ylabel, what) in enumerate(panels):
    ax = fig.add_subplot(gs[0, i])
    for n, ivs in intervals.items():
      handles.setdefault(n, _errorbars(ax, x + jitter[n], ivs, style[n], n))
    if i:
      ax.axhline(0.0, color='k', lw=0.8)
    ax.set_xticks(x, bucket_labels, rotation=45, fontsize=7)
    ax.set(
        yscale='log' if log_y and not i else 'linear',
        ylabel=panel_ylabel,
        xlabel='position bucket (rows of the table)',
    )
    ax.set_title(f'{what} ({_seed_note(n_seeds, documents)})', fontsize=9)
  legend_ax = fig.add_subplot(gs[0, -1])
  legend_ax.axis('off')
  legend_ax.legend(
      list(handles.values()),
      list(handles),
      loc='center left',
      fontsize=8,
      frameon=False,
  )
  fig.suptitle(title, fontsize=10)
  return _save(fig, path)


def experiment_metric_bars(
    path: str,
    panels: dict[str, dict[str, dict[str, Any]]],
    *,
    ylabels: dict[str, str],
    title: str = '',
    n_seeds: int = 0,
) -> str:
  """One panel per group of arms in the same units (panel -> {arm:
  interval})."""
  widths = [max(2.0, 0.55 * len(arms) + 1.0) for arms in panels.values()] or [
      2.0
  ]
  fig, axes = plt.subplots(
      1,
      max(len(panels), 1),
      figsize=(max(sum(widths) + 1.2, 8.0), 4.2),
      squeeze=False,
      gridspec_kw={'width_ratios': widths},
  )
  for ax, (panel, intervals) in zip(axes[0], panels.items()):
    style = _arm_styles(list(intervals))
    for i, (name, interval) in enumerate(intervals.items()):
      _errorbars(
          ax,
          np.array([float(i)]),
          [interval],
          {**style[name], 'ls': 'none'},
          name,
      )
    ax.set_xticks(
        np.arange(len(intervals)),
        list(intervals),
        rotation=45,
        ha='right',
        fontsize=7,
    )
    ax.margins(y=0.15)
    ax.set(xlim=(-0.6, len(intervals) - 0.4), ylabel=ylabels.get(panel, ''))
    ax.set_title(f'{panel}\n({_seed_note(n_seeds)})', fontsize=9)
    ax.grid(axis='y', alpha=0.3)
  fig.suptitle(title, fontsize=10)
  return _save(fig, path)


def experiment_curve(
    path: str,
    steps: Sequence[int],
    intervals: Sequence[dict[str, Any]],
    *,
    threshold: float,
    xlabel: str = '',
    ylabel: str = '',
    title: str = '',
    n_seeds: int = 0,
) -> str:
  """A curve over training steps with its 95% band and a threshold line."""
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(
      steps,
      _col(intervals, 'mean'),
      marker='o',
      ms=3,
      label=f'mean ({_seed_note(n_seeds)})',
  )
  ax.fill_between(
      steps, _col(intervals, 'low'), _col(intervals, 'high'), alpha=0.2
  )
  ax.axhline(
      threshold, color='k', ls='--', lw=0.8, label=f'threshold {threshold}'
  )
  ax.legend(fontsize=7, loc='lower right')
  ax.set(xlabel=xlabel, ylabel=ylabel)
  ax.set_title(title, fontsize=9)
  return _save(fig, path)


def dose_response(
    path: str,
    panels: dict[str, dict[str, Any]],
    *,
    ylabels: dict[str, str],
    title: str = '',
    xlabel: str = 'training occurrences per row of the last bucket',
) -> str:
  """Paired differences against the exposure of the late rows, log x.

  Args:
    path: the PNG.
    panels: one row of panels each, ``{'x': [n] occurrences per late row,
      'arms': [n] names, 'baseline': name, 'measures': {measure: [n]
      intervals}}``; a measure a panel lacks, or whose means are all
      missing, is drawn as n/a.
    ylabels: measure -> its axis label (one column each).
    title: the figure's title.
    xlabel: the x axis' label.

  Returns:
    ``path``.
  """
  measures = list(ylabels)
  rows = max(len(panels), 1)
  fig, axes = plt.subplots(
      rows,
      len(measures),
      figsize=(4.6 * len(measures), 3.6 * rows),
      squeeze=False,
  )
  for row, (name, panel) in enumerate(panels.items()):
    # Joined in order of exposure, not of the arms' listing.
    order = np.argsort(np.asarray(panel['x'], np.float64))
    x = np.asarray(panel['x'], np.float64)[order]
    arms = [panel['arms'][i] for i in order]
    for col, measure in enumerate(measures):
      ax = axes[row, col]
      ax.set_title(f'{name}: arm - {panel["baseline"]}', fontsize=9)
      measured = panel['measures'].get(measure)
      intervals = []
      if measured is not None:
        intervals = [measured[i] for i in order]
      if not np.isfinite(_col(intervals, 'mean')).any():
        # A panel without the measure, or whose baseline was not probed: no
        # difference to draw.
        ax.text(0.5, 0.5, 'n/a', ha='center', transform=ax.transAxes)
        ax.set(xlabel=xlabel, ylabel=ylabels[measure])
        continue
      _errorbars(
          ax, x, intervals, {'color': 'C0', 'marker': 'o', 'ls': '-'}, ''
      )
      for xi, arm, iv in zip(x, arms, intervals):
        ax.annotate(
            arm,
            (xi, iv.get('mean') or 0.0),
            textcoords='offset points',
            xytext=(4, 4),
            fontsize=7,
        )
      ax.axhline(0.0, color='k', lw=0.8)
      ax.set(xscale='log', xlabel=xlabel, ylabel=ylabels[measure])
  fig.suptitle(title, fontsize=10)
  return _save(fig, path)


def claims_forest(
    path: str, claims: Sequence[dict[str, Any]], title: str = ''
) -> str:
  """Each claim's interval of ``arm - baseline``, one row each, coloured by its
  verdict (``claims``: the report's claim records)."""
  colors = {'supported': 'C2', 'contradicted': 'C3'}
  fig, ax = plt.subplots(figsize=(9, 0.42 * len(claims) + 1.2))
  y = np.arange(len(claims))[::-1]
  for yi, c in zip(y, claims):
    iv = c['interval']
    mean = np.nan if iv.get('mean') is None else iv['mean']
    low = np.nan if iv.get('low') is None else iv['low']
    high = np.nan if iv.get('high') is None else iv['high']
    color = colors.get(c['verdict'], 'C7')
    ax.plot([low, high], [yi, yi], color=color, lw=2)
    ax.plot([mean], [yi], 'o', color=color, ms=5)
  ax.axvline(0.0, color='k', lw=0.8)
  ax.set_yticks(y, [f"{c['id']} ({c['metric']})" for c in claims], fontsize=8)
  ax.set_xlabel(
      'arm - baseline (95% interval; green supported, red contradicted)'
  )
  ax.set_title(title, fontsize=9)
  return _save(fig, path)
