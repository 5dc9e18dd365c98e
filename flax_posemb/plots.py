"""Every matplotlib figure of the project (Agg backend; no computation here).

Each function takes already-computed arrays / results dicts, writes one PNG and returns
its path. Functions are independent of one another.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

import matplotlib

matplotlib.use('Agg')
import matplotlib.pyplot as plt  # pylint: disable=g-import-not-at-top,wrong-import-position
import numpy as np  # pylint: disable=wrong-import-position


def _save(fig, path: str | os.PathLike[str]) -> str:
  path = os.fspath(path)
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def _bucket_arrays(results: dict[str, Any]) -> dict[str, np.ndarray]:
  rows = results['buckets']
  def col(k):
    return np.array([np.nan if r.get(k) is None else r[k] for r in rows], np.float64)
  out = {k: col(k) for k in ('start', 'end', 'loss', 'stderr', 'bayes_loss', 'filter_loss',
                             'recovered') if rows and k in rows[0]}
  if rows:
    out['mid'] = (out['start'] + out['end'] - 1) / 2
  return out


def loss_by_position(per_position: dict[str, np.ndarray], results: dict[str, Any],
                     path: str | os.PathLike[str], title: str = '') -> str:
  """Writes ``loss_by_position_figure`` to ``path`` (PNG) and returns the path."""
  return _save(loss_by_position_figure(per_position, results, title), path)


def _log_buckets(b: dict[str, np.ndarray]) -> bool:
  """Whether bucket widths grow geometrically (log2 buckets): then x is drawn on a log axis."""
  w = b['end'] - b['start'] if 'end' in b else np.array([])
  return len(w) >= 4 and w[-1] >= 4 * max(w[1], 1)


def _bucket_x(b: dict[str, np.ndarray], log: bool) -> np.ndarray:
  # On a log axis position 0 cannot be drawn: x is position + 1 there.
  return np.sqrt((b['start'] + 1) * b['end']) if log else b['mid']


def loss_by_position_figure(per_position: dict[str, np.ndarray], results: dict[str, Any],
                            title: str = ''):
  """Loss by position bucket with 95% intervals (and a thin line per document kind when the
  windows mix several); on the synthetic corpus the Bayes (position known) and filter
  (position unknown) bounds per bucket and, below, the share of the value of position
  information each bucket's rows recover, with its interval.

  Args:
    per_position: {'position' [L], 'loss' [L], optional 'bayes_loss' [L], 'filter_loss' [L]}.
    results: results.json dict (its 'buckets', 'step', optional 'by_kind').
    title: figure title (default names the step); callers name the run (policy, init, step).

  Returns:
    The matplotlib figure (TensorBoard takes it as an image).
  """
  b = _bucket_arrays(results)
  synth = 'recovered' in b
  log = _log_buckets(b)
  x = _bucket_x(b, log)
  fig, axes = plt.subplots(2 if synth else 1, 1, figsize=(10, 6.5 if synth else 4.2),
                           sharex=True, squeeze=False)
  ax = axes[0, 0]
  if not synth:  # On the synthetic corpus per-position loss is a regime sawtooth: buckets only.
    pos = np.asarray(per_position['position']) + (1 if log else 0)
    ax.plot(pos, per_position['loss'], lw=0.6, alpha=0.35, color='C0', label='per position')
  ax.errorbar(x, b['loss'], yerr=1.96 * b['stderr'], fmt='o-', color='C0', capsize=3,
              label='model, bucket mean (95% CI)')
  kinds = results.get('by_kind') or []
  for i, g in enumerate(kinds if len(kinds) > 1 else []):  # The source mix: a thin line each.
    loss = [np.nan if r['loss'] is None else r['loss'] for r in g['buckets']]
    ax.plot(x, loss, '.-', lw=0.8, ms=3, color=f'C{i + 3}',
            label=f"{g['group']} ({g['windows']} windows, {g['documents']} docs)")
  if synth:
    ax.plot(x, b['bayes_loss'], 'k.-', lw=1, label='Bayes (position known)')
    ax.plot(x, b['filter_loss'], '.--', color='gray', lw=1, label='filter (position unknown)')
  ax.set_ylabel('loss (nats / token)')
  _outside_legend(ax)
  ax.set_title(title or f"loss by position, step {results.get('step')}", fontsize=10)
  if synth:
    ax2 = axes[1, 0]
    gap = b['filter_loss'] - b['bayes_loss']
    with np.errstate(invalid='ignore', divide='ignore'):
      se = b['stderr'] / np.abs(gap)
    ax2.errorbar(x, b['recovered'], yerr=1.96 * se, fmt='o-', color='C2', capsize=3,
                 label='recovered (95% CI)')
    ax2.axhline(1.0, color='k', lw=0.8, label='1 = Bayes: all of the position value')
    ax2.axhline(0.0, color='gray', lw=0.8, ls='--', label='0 = position-blind filter')
    ax2.set_ylabel('share of the position value\nrecovered by the rows')
    _outside_legend(ax2)
  if log:
    axes[-1, 0].set_xscale('log')
  axes[-1, 0].set_xlabel('position + 1 (log scale; = context length)' if log
                         else 'position (= context length - 1)')
  return fig


def _outside_legend(ax) -> None:
  """The legend right of the axes, where it covers no data or error bar."""
  ax.legend(fontsize=8, loc='upper left', bbox_to_anchor=(1.01, 1.0), borderaxespad=0.0)


def _paired_panel(ax, paired: Sequence[tuple[str, Sequence[dict[str, Any]]]], log: bool,
                  first_color: int = 1) -> None:
  """Paired differences per bucket with their 95% t intervals (rows of
  `buckets.paired_difference`: start, end, diff, ci95), one series per (label, rows)."""
  for j, (label, rows) in enumerate(paired):
    rows = [r for r in rows if r['diff'] is not None]
    if not rows:
      continue
    b = {k: np.array([r[k] for r in rows], np.float64) for k in ('start', 'end')}
    b['mid'] = (b['start'] + b['end'] - 1) / 2
    diff = np.array([r['diff'] for r in rows])
    lo = diff - np.array([r['ci95'][0] for r in rows])
    hi = np.array([r['ci95'][1] for r in rows]) - diff
    ax.errorbar(_bucket_x(b, log), diff, yerr=[lo, hi], fmt='o-', capsize=3,
                color=f'C{j + first_color}', label=label)
  ax.axhline(0.0, color='k', lw=0.8)


def comparison(labels: Sequence[str], results: Sequence[dict[str, Any]],
               path: str | os.PathLike[str], paired: Sequence[dict[str, Any]] = ()) -> str:
  """Bucket loss (95% CI) of several runs; excess over Bayes if available; and, with
  ``paired`` differences (``eval_report.compare``), a panel of each run minus the first with
  its paired 95% interval."""
  arrays = [_bucket_arrays(r) for r in results]
  synth = all('bayes_loss' in a for a in arrays)
  log = _log_buckets(arrays[0])
  for a in arrays:
    a['x'] = _bucket_x(a, log)
  n = 1 + int(synth) + int(bool(paired))
  fig, axes = plt.subplots(n, 1, figsize=(8, 2.2 + 2.2 * n), sharex=True, squeeze=False)
  for i, (label, a) in enumerate(zip(labels, arrays)):
    axes[0, 0].errorbar(a['x'], a['loss'], yerr=1.96 * a['stderr'], fmt='o-', capsize=3,
                        color=f'C{i}', label=label)
    if synth:
      axes[1, 0].errorbar(a['x'], a['loss'] - a['bayes_loss'], yerr=1.96 * a['stderr'],
                          fmt='o-', capsize=3, color=f'C{i}')
  if synth:
    axes[0, 0].plot(arrays[0]['x'], arrays[0]['bayes_loss'], 'k-', lw=1, label='Bayes')
    axes[1, 0].axhline(0.0, color='k', lw=0.8)
    axes[1, 0].set_ylabel('excess loss over Bayes')
  if paired:
    ax = axes[-1, 0]
    _paired_panel(ax, [(f"{p['label']} - {p['minus']}", p['buckets']) for p in paired], log)
    ax.set_ylabel('paired difference (nats)')
    ax.legend(fontsize=8)
  axes[0, 0].set_ylabel('loss (nats / token)')
  axes[0, 0].legend(fontsize=8)
  axes[0, 0].set_title('loss by position bucket')
  if log:
    axes[-1, 0].set_xscale('log')
  axes[-1, 0].set_xlabel('position + 1 (log scale)' if log else 'position (bucket midpoint)')
  return _save(fig, path)


def offset_probe(probe: dict[str, Any], path: str | os.PathLike[str]) -> str:
  """Loss by context length for each position offset K (results['offset_probe']) and, below,
  the paired difference K - K0 per bucket with its 95% interval (what the console reports)."""
  paired = probe.get('paired_vs_first') or []
  fig, axes = plt.subplots(2 if paired else 1, 1, figsize=(8, 7 if paired else 4.2),
                           sharex=True, squeeze=False)
  ax = axes[0, 0]
  log = _log_buckets(_bucket_arrays(probe['by_offset'][0]))
  for i, r in enumerate(probe['by_offset']):
    a = _bucket_arrays(r)
    ax.errorbar(_bucket_x(a, log), a['loss'], yerr=1.96 * a['stderr'], fmt='o-', capsize=3,
                color=f'C{i}', label=f"K = {r['offset']}")
  ax.set_ylabel('loss (nats / token)')
  ax.set_title('offset probe: same texts, rows p + K')
  ax.legend(fontsize=8)
  if paired:
    ax2 = axes[1, 0]
    _paired_panel(ax2, [(f"K = {p['offset']} - K = {p['minus_offset']} (95% CI)", p['buckets'])
                        for p in paired], log)
    ax2.set_ylabel('paired difference\nK - K0 (nats / token)')
    ax2.legend(fontsize=8)
  if log:
    axes[-1, 0].set_xscale('log')
  axes[-1, 0].set_xlabel('context length' + (' (log scale)' if log else ' - 1') +
                         ' (position ids shifted by K)')
  return _save(fig, path)


def table_analysis(norms: np.ndarray, drift: np.ndarray | None, pca_ratio: np.ndarray,
                   probe_edges: np.ndarray, probe_error: np.ndarray,
                   path: str | os.PathLike[str], snapshot_drift: np.ndarray | None = None,
                   snapshot_steps: Sequence[int] = (), probe_r2: float | None = None) -> str:
  """Four panels: row norm [L], drift from init [L] (and per snapshot [S, L]), PCA, probe error.

  Args:
    norms: [L] L2 norm of each row.
    drift: [L] ||row - initial row|| or None.
    pca_ratio: [k] explained-variance ratio of each principal component.
    probe_edges: [nb + 1] bucket edges for `probe_error`.
    probe_error: [nb] mean absolute error of the held-out linear position probe per bucket.
    path: output PNG.
    snapshot_drift: optional [S, L] ||row(step_s) - initial row|| for saved snapshots.
    snapshot_steps: [S] steps of those snapshots.
    probe_r2: held-out R^2 of the probe, printed on its panel (a low R^2 means the rows barely
      encode position linearly, whatever the error profile looks like).
  """
  fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
  pos = np.arange(len(norms))
  axes[0, 0].plot(pos, norms)
  axes[0, 0].set(title='row norm', xlabel='position', ylabel='||row||')
  ax = axes[0, 1]
  if snapshot_drift is not None and len(snapshot_drift):
    # One colour per snapshot on a step colour bar: every line is identified, none twice.
    steps = np.asarray(snapshot_steps, np.float64)
    norm = matplotlib.colors.Normalize(steps.min(), max(steps.max(), steps.min() + 1))
    cmap = plt.get_cmap('viridis')
    for s, d in zip(steps, snapshot_drift):
      ax.plot(pos, d, lw=0.8, color=cmap(norm(s)))
    fig.colorbar(matplotlib.cm.ScalarMappable(norm=norm, cmap=cmap), ax=ax, label='step')
  elif drift is not None:
    ax.plot(pos, drift, 'k', lw=1.2, label='evaluated table')
  elif snapshot_drift is None or not len(snapshot_drift):
    # A table from elsewhere has no initial table: say so rather than show blank axes.
    ax.text(0.5, 0.5, 'no initial table\n(drift needs a training run)', ha='center',
            va='center', transform=ax.transAxes, color='gray')
  ax.set(title='drift from the initial table', xlabel='position', ylabel='||row - row_0||')
  if ax.get_legend_handles_labels()[0]:
    ax.legend(fontsize=8)
  k = np.arange(1, len(pca_ratio) + 1)
  axes[1, 0].bar(k, pca_ratio)
  axes[1, 0].plot(k, np.cumsum(pca_ratio), 'k.-', label='cumulative')
  axes[1, 0].set(title='PCA explained variance', xlabel='component', ylabel='ratio')
  axes[1, 0].legend(fontsize=8)
  mid = (probe_edges[:-1] + probe_edges[1:] - 1) / 2
  axes[1, 1].plot(mid, probe_error, 'o-')
  r2 = '' if probe_r2 is None else f' R^2 = {probe_r2:.2f}'
  axes[1, 1].set(title=f'linear position probe (held-out rows){r2}', xlabel='position',
                 ylabel='mean |predicted - true| position')
  if probe_r2 is not None and probe_r2 < 0.5:
    axes[1, 1].text(0.5, 0.9, 'low R^2: position is barely linearly decodable from these rows;\n'
                    'the error profile is not a ranking of positions', ha='center', va='top',
                    transform=axes[1, 1].transAxes, fontsize=7, color='C3')
  return _save(fig, path)


def cosine_heatmap(sim: np.ndarray, path: str | os.PathLike[str], title: str = '') -> str:
  """[L, L] cosine similarity between position rows."""
  fig, ax = plt.subplots(figsize=(6, 5))
  im = ax.imshow(sim, vmin=-1, vmax=1, cmap='RdBu_r', origin='lower', interpolation='nearest')
  fig.colorbar(im, ax=ax)
  ax.set(title=title or 'cosine similarity of position rows', xlabel='position', ylabel='position')
  return _save(fig, path)


def exposure_relation(exposure: np.ndarray, series: dict[str, np.ndarray],
                      path: str | os.PathLike[str], rho: dict[str, float | None] | None = None
                      ) -> str:
  """Per-position quantities against cumulative training exposure (log x), one panel each,
  with the Spearman rank correlation printed on each panel.

  Args:
    exposure: [L] cumulative number of training tokens seen at each position.
    series: name -> [L] values (e.g. 'loss', 'recovered', 'drift'); nan entries are skipped.
    path: output PNG.
    rho: name -> Spearman correlation of the series with exposure (None: not shown).
  """
  names = list(series)
  fig, axes = plt.subplots(1, len(names), figsize=(4.2 * len(names), 3.8), squeeze=False)
  pos = np.arange(len(exposure))
  for ax, name in zip(axes[0], names):
    y = np.asarray(series[name], np.float64)
    ok = np.isfinite(y) & (exposure > 0)
    sc = ax.scatter(exposure[ok], y[ok], c=pos[ok], s=10, cmap='viridis')
    ax.set_xscale('log')
    ax.set(xlabel='cumulative training exposure (tokens)', ylabel=name, title=f'{name} vs exposure')
    r = (rho or {}).get(name)
    if r is not None:
      ax.text(0.03, 0.95, f'Spearman rho = {r:+.2f}', transform=ax.transAxes, va='top',
              fontsize=8, bbox=dict(facecolor='white', alpha=0.7, lw=0))
  fig.colorbar(sc, ax=axes[0, -1], label='position')
  return _save(fig, path)


# --- Experiment report figures (flax_posemb.experiments.report) -------------------------------


def _interval_arrays(intervals: Sequence[dict[str, Any]]) -> tuple[np.ndarray, ...]:
  get = lambda k: np.array([np.nan if iv.get(k) is None else iv[k] for iv in intervals],
                           np.float64)
  return get('mean'), get('low'), get('high')


_MARKERS = ('o', 's', '^', 'D', 'v', 'P', 'X', '*', '<', '>')
_LINESTYLES = ('-', '--', ':', '-.')


def _arm_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
  """One colour, marker and line style per arm (two arms never look alike)."""
  cycle = plt.rcParams['axes.prop_cycle'].by_key()['color']
  return {n: {'color': cycle[i % len(cycle)], 'marker': _MARKERS[i % len(_MARKERS)],
              'ls': _LINESTYLES[i % len(_LINESTYLES)]} for i, n in enumerate(names)}


def _errorbars(ax, x: np.ndarray, intervals: Sequence[dict[str, Any]], style: dict[str, Any],
               label: str) -> Any:
  """Means with 95% error bars; entries without an interval (one seed) get no bar."""
  mean, low, high = _interval_arrays(intervals)
  err = np.stack([mean - low, high - mean])
  return ax.errorbar(x, mean, yerr=np.where(np.isfinite(err), err, 0.0), ms=4, capsize=2,
                     lw=1.2, elinewidth=0.9, label=label, **style)


def _seed_note(n: int) -> str:
  return ('n=1 seed: no interval' if n == 1 else f'95% CI over n={n} seeds' if n > 1
          else 'no finished run')


def _legend_axis(fig, gs, handles, labels) -> None:
  ax = fig.add_subplot(gs)
  ax.axis('off')
  ax.legend(handles, labels, loc='center left', fontsize=8, frameon=False)


def experiment_profile(path: str | os.PathLike[str], bucket_labels: Sequence[str],
                       series: dict[str, Sequence[dict[str, Any]]], *,
                       differences: dict[str, Sequence[dict[str, Any]]] | None = None,
                       baseline: str = '', title: str = '', ylabel: str = '',
                       n_seeds: int = 0, log_y: bool = False) -> str:
  """Per-bucket means over seeds with 95% error bars per arm; right: paired differences.

  Arms differ in colour, marker and line style and are shifted slightly along x, so equal
  curves stay visible; the legend has its own column.

  Args:
    path: PNG path.
    bucket_labels: one label per bucket, e.g. '0-8'.
    series: arm -> per-bucket intervals ({mean, low, high}).
    differences: arm -> per-bucket intervals of (arm - baseline), or None/empty.
    baseline: the baseline arm's name (panel title).
    title: figure title (what is compared and the run's identity).
    ylabel: y-axis label with units.
    n_seeds: seeds per arm (stated; 1 means no interval).
    log_y: logarithmic y axis for the left panel (e.g. exposure counts).
  """
  two = bool(differences)
  names = list(dict.fromkeys([*series, *(differences or {})]))
  style = _arm_styles(names)
  fig = plt.figure(figsize=(13 if two else 8, 4.4))
  gs = fig.add_gridspec(1, 3 if two else 2, width_ratios=[1, 1, 0.32] if two else [1, 0.4])
  x = np.arange(len(bucket_labels), dtype=np.float64)
  jitter = {n: 0.08 * (i - (len(names) - 1) / 2) for i, n in enumerate(names)}
  ax = fig.add_subplot(gs[0, 0])
  handles = {}
  for name, ivs in series.items():
    handles[name] = _errorbars(ax, x + jitter[name], ivs, style[name], name)
  if log_y:
    ax.set_yscale('log')
  ax.set_xticks(x, bucket_labels, rotation=45, fontsize=7)
  ax.set_xlabel('position bucket (rows of the table)')
  ax.set_ylabel(ylabel)
  ax.set_title(f'mean per arm ({_seed_note(n_seeds)})', fontsize=9)
  if two:
    ax = fig.add_subplot(gs[0, 1])
    for name, ivs in differences.items():
      handles.setdefault(name, _errorbars(ax, x + jitter[name], ivs, style[name], name))
    ax.axhline(0.0, color='k', lw=0.8)
    ax.set_xticks(x, bucket_labels, rotation=45, fontsize=7)
    ax.set_xlabel('position bucket (rows of the table)')
    ax.set_ylabel(f'difference: arm - {baseline}')
    ax.set_title(f'paired difference vs {baseline} ({_seed_note(n_seeds)})', fontsize=9)
  _legend_axis(fig, gs[0, -1], list(handles.values()), list(handles))
  fig.suptitle(title, fontsize=10)
  return _save(fig, path)


def experiment_metric_bars(path: str | os.PathLike[str],
                           panels: dict[str, dict[str, dict[str, Any]]], *,
                           ylabels: dict[str, str], title: str = '', n_seeds: int = 0) -> str:
  """One panel per group of arms measured in the same units (e.g. per corpus): each arm's
  mean over seeds with its 95% interval, as a point (no bar: the axis need not start at 0).

  Args:
    path: PNG path.
    panels: panel title -> {arm: interval ({mean, low, high, n})}.
    ylabels: panel title -> y-axis label with units.
    title: figure title.
    n_seeds: seeds per arm (stated; 1 means no interval).
  """
  widths = [max(2.0, 0.55 * len(arms) + 1.0) for arms in panels.values()] or [2.0]
  fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(max(sum(widths) + 1.2, 8.0), 4.2),
                           squeeze=False, gridspec_kw={'width_ratios': widths})
  for ax, (panel, intervals) in zip(axes[0], panels.items()):
    names = list(intervals)
    style = _arm_styles(names)
    x = np.arange(len(names), dtype=np.float64)
    for i, name in enumerate(names):
      _errorbars(ax, x[i:i + 1], [intervals[name]], {**style[name], 'ls': 'none'}, name)
    ax.set_xticks(x, names, rotation=45, ha='right', fontsize=7)
    ax.set_xlim(-0.6, len(names) - 0.4)
    ax.margins(y=0.15)
    ax.set_ylabel(ylabels.get(panel, ''))
    ax.set_title(f'{panel}\n({_seed_note(n_seeds)})', fontsize=9)
    ax.grid(axis='y', alpha=0.3)
  fig.suptitle(title, fontsize=10)
  return _save(fig, path)


def experiment_curve(path: str | os.PathLike[str], steps: Sequence[int],
                     intervals: Sequence[dict[str, Any]], *, threshold: float | None = None,
                     xlabel: str = '', ylabel: str = '', title: str = '',
                     n_seeds: int = 0) -> str:
  """A curve over training steps with its 95% band (and an optional threshold line)."""
  mean, low, high = _interval_arrays(intervals)
  fig, ax = plt.subplots(figsize=(7, 4))
  ax.plot(steps, mean, marker='o', ms=3, label=f'mean ({_seed_note(n_seeds)})')
  ax.fill_between(steps, low, high, alpha=0.2)
  if threshold is not None:
    ax.axhline(threshold, color='k', ls='--', lw=0.8, label=f'threshold {threshold}')
  ax.legend(fontsize=7, loc='lower right')
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title, fontsize=9)
  return _save(fig, path)


def data_exposure(report: dict[str, Any], path: str | os.PathLike[str]) -> str:
  """Real-token count per position and source document-length shares (data exposure report).

  Args:
    report: `flax_posemb.data.report.exposure` dict ('counts' [T], 'doc_lengths' buckets).
    path: output PNG.
  """
  counts = np.asarray(report['counts'], np.float64)
  fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
  a.plot(np.arange(len(counts)), counts, lw=1)
  a.set_xlabel('position id')
  a.set_ylabel('real tokens seen')
  a.set_ylim(bottom=0)
  a.set_title(f"{report['source']} / {report['policy']}: exposure per position")
  hist = report['doc_lengths']
  b.bar([h['bucket'] for h in hist], [100 * h['token_share'] for h in hist])
  b.set_xlabel('document length bucket ((input, target) pairs = tokens - 1)')
  b.set_ylabel('token share (%)')
  b.set_title('source document lengths')
  b.tick_params(axis='x', labelrotation=30)
  return _save(fig, path)
