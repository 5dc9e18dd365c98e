"""Figures of an experiment's report: per-bucket profiles, metric bars,
curves, dose-response and the claims' intervals."""

from collections.abc import Sequence
import re
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from flax_posemb import inference
from flax_posemb.plots import common


def _over_documents(intervals: Any) -> bool:
  """Whether any of ``intervals`` (records, or sequences of them) combines
  seeds and documents (its ``method``)."""
  for entry in intervals:
    records = [entry] if isinstance(entry, dict) else entry
    for record in records:
      if record.get('method') == inference.SEEDS_AND_DOCUMENTS:
        return True
  return False


def _seed_note(n: int, documents: bool = False) -> str:
  """What the error bars are over: ``n`` seeds, and the documents."""
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
) -> str:
  """Per-bucket intervals per arm and, right, paired differences to
  ``baseline``; each panel says what its intervals are over (their
  ``method``)."""
  two = bool(differences)
  names = list(dict.fromkeys([*series, *(differences or {})]))
  style = common.arm_styles(names)
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
            f'difference: arm - {baseline or "its baseline"}',
            f'paired difference vs {baseline or "each baseline"}',
        )
    )
  handles: dict[str, Any] = {}
  for i, (intervals, panel_ylabel, what) in enumerate(panels):
    ax = fig.add_subplot(gs[0, i])
    for n, ivs in intervals.items():
      handles.setdefault(
          n, common.errorbars(ax, x + jitter[n], ivs, style[n], n)
      )
    if i:
      ax.axhline(0.0, color='k', lw=0.8)
    ax.set_xticks(x, bucket_labels, rotation=45, fontsize=7)
    ax.set(
        yscale='log' if log_y and not i else 'linear',
        ylabel=panel_ylabel,
        xlabel='position bucket (rows of the table)',
    )
    note = _seed_note(n_seeds, _over_documents(intervals.values()))
    ax.set_title(f'{what} ({note})', fontsize=9)
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
  return common.save(fig, path)


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
    style = common.arm_styles(list(intervals))
    for i, (name, interval) in enumerate(intervals.items()):
      common.errorbars(
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
    note = _seed_note(n_seeds, _over_documents(intervals.values()))
    ax.set_title(f'{panel}\n({note})', fontsize=9)
    ax.grid(axis='y', alpha=0.3)
  fig.suptitle(title, fontsize=10)
  return common.save(fig, path)


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
      common.column(intervals, 'mean'),
      marker='o',
      ms=3,
      label=f'mean ({_seed_note(n_seeds)})',
  )
  ax.fill_between(
      steps,
      common.column(intervals, 'low'),
      common.column(intervals, 'high'),
      alpha=0.2,
  )
  ax.axhline(
      threshold, color='k', ls='--', lw=0.8, label=f'threshold {threshold}'
  )
  ax.legend(fontsize=7, loc='lower right')
  ax.set(xlabel=xlabel, ylabel=ylabel)
  ax.set_title(title, fontsize=9)
  return common.save(fig, path)


def arm_kind(arm: str) -> tuple[str, str]:
  """(kind, dose) of a dose arm's name: 'crops/skew:0.01' -> ('crops/skew',
  '0.01'); an arm without a ':' value is a kind of its own, dose ''."""
  kind = re.sub(r':[^/]*', '', arm)
  doses = re.findall(r':([^/]*)', arm)
  return kind, ','.join(doses)


def _has_data(panel: dict[str, Any], measure: str) -> bool:
  """Whether ``panel`` has a finite mean of ``measure``."""
  intervals = panel['measures'].get(measure) or []
  return bool(np.isfinite(common.column(intervals, 'mean')).any())


def _dose_series(ax, x, arms, intervals, style) -> None:
  """One series per arm kind (`arm_kind`; ``style``: kind -> its style),
  joined only within the kind and in order of exposure; each point of a
  multi-point kind labelled by its dose."""
  kinds = list(dict.fromkeys(arm_kind(arm)[0] for arm in arms))
  for kind in kinds:
    members = [i for i, arm in enumerate(arms) if arm_kind(arm)[0] == kind]
    members.sort(key=lambda i: x[i])
    line = {**style[kind], 'ls': '-' if len(members) > 1 else 'none'}
    common.errorbars(
        ax, x[members], [intervals[i] for i in members], line, kind
    )
    if len(members) < 2:
      continue
    for j, i in enumerate(members):
      mean = intervals[i].get('mean')
      if mean is None or not np.isfinite(mean):
        continue
      # Alternate above and below: neighbouring doses do not overlap.
      ax.annotate(
          arm_kind(arms[i])[1],
          (x[i], mean),
          textcoords='offset points',
          xytext=(5, 7 if j % 2 == 0 else -12),
          fontsize=7,
          color=style[kind].get('color'),
      )


def dose_response(
    path: str,
    panels: dict[str, dict[str, Any]],
    *,
    ylabels: dict[str, str],
    title: str = '',
    xlabel: str = 'training occurrences per row of the last bucket',
) -> str:
  """Paired differences against the exposure of the late rows, log x.

  Each kind of arm (`arm_kind`: 'crops/skew' at its doses, 'packed', ...) is
  its own series, in the legend; a line joins doses of one kind only. A
  measure no panel has is left out; a panel without a measure another has is
  left blank with a note saying so.

  Args:
    path: the PNG.
    panels: one row of panels each, ``{'x': [n] occurrences per late row,
      'arms': [n] names, 'baseline': name, 'measures': {measure: [n]
      intervals}}``.
    ylabels: measure -> its axis label (one column each).
    title: the figure's title.
    xlabel: the x axis' label.

  Returns:
    ``path``.
  """
  measures = [
      m for m in ylabels if any(_has_data(p, m) for p in panels.values())
  ]
  left_out = [m for m in ylabels if m not in measures]
  # One style per kind in every panel.
  style = common.arm_styles(
      list(
          dict.fromkeys(
              arm_kind(arm)[0] for p in panels.values() for arm in p['arms']
          )
      )
  )
  rows = max(len(panels), 1)
  fig, axes = plt.subplots(
      rows,
      max(len(measures), 1),
      figsize=(5.2 * max(len(measures), 1), 3.8 * rows),
      squeeze=False,
  )
  for row, (name, panel) in enumerate(panels.items()):
    x = np.asarray(panel['x'], np.float64)
    for col, measure in enumerate(measures):
      ax = axes[row, col]
      if not _has_data(panel, measure):
        ax.axis('off')
        ax.text(
            0.5,
            0.5,
            f'{name}:\nno {ylabels[measure]}\n(not measured in this'
            ' experiment)',
            ha='center',
            va='center',
            fontsize=8,
            transform=ax.transAxes,
        )
        continue
      ax.set_title(f'{name}: arm - {panel["baseline"]}', fontsize=9)
      _dose_series(ax, x, panel['arms'], panel['measures'][measure], style)
      ax.axhline(0.0, color='k', lw=0.8)
      ax.set(xscale='log', xlabel=xlabel, ylabel=ylabels[measure])
      ax.legend(fontsize=7, loc='best')
  if left_out:
    fig.text(
        0.01,
        0.005,
        'Left out (no experiment measured them): ' + ', '.join(left_out),
        fontsize=7,
    )
  fig.suptitle(title, fontsize=10)
  return common.save(fig, path)


def claims_forest(
    path: str, claims: Sequence[dict[str, Any]], title: str = ''
) -> str:
  """Each claim's interval of ``arm - baseline``, one row each, coloured by its
  verdict (``claims``: the report's claim records); a claim without a measured
  difference is marked 'not measured' on its row."""
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
    if not np.isfinite(mean):
      # An empty row reads as a drawing error: say why nothing is drawn.
      ax.text(
          0.5,
          yi,
          'not measured',
          color='C7',
          ha='center',
          va='center',
          fontsize=8,
          transform=ax.get_yaxis_transform(),
      )
  ax.axvline(0.0, color='k', lw=0.8)
  ax.set_yticks(y, [f"{c['id']} ({c['metric']})" for c in claims], fontsize=8)
  over = {
      inference.SEEDS_AND_DOCUMENTS: 'seeds and documents',
      inference.SEEDS: 'seeds',
  }
  methods = {c['interval'].get('method', inference.SEEDS) for c in claims}
  ax.set_xlabel(
      'arm - baseline (95% interval over '
      + ' or '.join(over.get(m, str(m)) for m in sorted(methods))
      + ', as the report says per claim; green supported, red contradicted)'
  )
  ax.set_title(title, fontsize=9)
  return common.save(fig, path)
