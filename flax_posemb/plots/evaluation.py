"""Figures of an evaluation: loss by position, comparisons of runs, the offset
probe, and the statistics' curves as TensorBoard images."""

from collections.abc import Sequence
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
import matplotlib.figure
import matplotlib.pyplot as plt
import matplotlib.ticker
import numpy as np

from flax_posemb.plots import common


def _bucket_arrays(
    rows: Sequence[dict[str, Any]], value: str = 'loss'
) -> dict[str, np.ndarray]:
  """The columns the rows have and ``half``: the half-width of each row's
  ``ci95``."""
  out = {
      k: common.column(rows, k)
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
  return common.save(
      loss_by_position_figure(per_position, results, title), path
  )


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
        common.column(g['buckets'], 'loss'),
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
  return common.save(fig, path)


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
  return common.save(fig, path)


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
