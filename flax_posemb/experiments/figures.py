"""The figures of a sweep's report, drawn by `flax_posemb.plots.experiments`
from the summary (docs/DESIGN.md § Experiments outputs)."""

from collections.abc import Mapping
import os
from typing import Any

import numpy as np

from flax_posemb.experiments import aggregate
from flax_posemb.experiments import attribution
from flax_posemb.experiments import measures
from flax_posemb.experiments import window_measures
from flax_posemb.plots import experiments as plots


def write_figures(
    summary: Mapping[str, Any], out_dir: str
) -> list[tuple[str, str]]:
  """Writes the report's figures.

  Args:
    summary: `aggregate.aggregate`'s summary.
    out_dir: the report directory.

  Returns:
    (title, file name) of each figure, in the report's order.
  """
  settings = summary['settings']
  n_seeds = aggregate.most_seeds(summary)
  identity = (
      f'{summary["experiment"]}: {settings.get("model", "?")}, context'
      f' {settings.get("seq_len", "?")},'
      f' {settings.get("num_train_steps", "?")} steps,'
      f' {n_seeds} seed(s) per arm'
  )
  made = []
  for i, profile in enumerate(summary['profiles']):
    name = f'profile_{i}_{profile["metric"]}.png'
    arms = {arm: summary['arms'][arm] for arm in profile['arms']}
    series = {
        arm: entry['vectors'][profile['metric']] for arm, entry in arms.items()
    }
    tokenizers = {entry['tokenizer'] for entry in arms.values()}
    tokenizer = tokenizers.pop() if len(tokenizers) == 1 else ''
    means = np.array(
        [
            interval['mean']
            for intervals in series.values()
            for interval in intervals
            if interval.get('mean') is not None
        ],
        np.float64,
    )
    # Exposure spans orders of magnitude: a log axis.
    log_y = bool(
        profile['metric'] == 'bucket_exposure'
        and means.size
        and means.min() > 0
        and means.max() > 100 * means.min()
    )
    title = profile['title']
    if 'bucket' not in title:
      title = f'{title} by position bucket'
    plots.experiment_profile(
        os.path.join(out_dir, name),
        [f'{start}-{end}' for start, end in summary['buckets']],
        series,
        differences=profile['differences'],
        baseline=profile['baseline'],
        n_seeds=n_seeds,
        log_y=log_y,
        title=f'{title}\n{identity}',
        ylabel=measures.label(profile['metric'], tokenizer),
    )
    made.append((profile['title'], name))
  made.append(bucket_profile_plot(summary, out_dir, identity, n_seeds))
  doses = summary['analyses'].get('doses')
  if doses:
    made.append(dose_plot(doses, out_dir, identity))
  if summary.get('claims'):
    plots.claims_forest(
        os.path.join(out_dir, 'claims.png'),
        summary['claims'],
        title=f'Claims, arm - baseline\n{identity}',
    )
    made.append(('Every claim, arm - baseline', 'claims.png'))
  # corpus panel -> {arm: final_loss interval}, and its axis label.
  panels: dict[str, dict[str, Any]] = {}
  ylabels: dict[str, str] = {}
  for arm, entry in summary['arms'].items():
    if not entry['seeds']:
      continue
    if entry['tokenizer'] in ('synthetic', ''):
      panel = entry['corpus']
    else:
      panel = f'{entry["corpus"]} ({entry["tokenizer"]} tokens)'
    panels.setdefault(panel, {})[arm] = entry['scalars'].get('final_loss', {})
    ylabels[panel] = measures.label('final_loss', entry['tokenizer'])
  plots.experiment_metric_bars(
      os.path.join(out_dir, 'final_loss.png'),
      panels,
      ylabels=ylabels,
      n_seeds=n_seeds,
      title=f'Final held-out loss per arm, one panel per corpus\n{identity}',
  )
  made.append(
      ('Final held-out loss per arm (one panel per corpus)', 'final_loss.png')
  )
  convergence = summary['analyses'].get('cosine_convergence')
  if convergence:
    plots.experiment_curve(
        os.path.join(out_dir, 'cosine_convergence.png'),
        convergence['steps'],
        convergence['agreement'],
        threshold=convergence['threshold'],
        xlabel='training step',
        n_seeds=n_seeds,
        ylabel=(
            "agreement of the inits' cosine structure\n(mean pairwise"
            ' Pearson r)'
        ),
        title=f'Do the inits converge to one similarity structure?\n{identity}',
    )
    made.append(
        (
            'Cross-init agreement of the cosine-similarity structure',
            'cosine_convergence.png',
        )
    )
  return made


def bucket_profile_plot(
    summary: Mapping[str, Any], out_dir: str, identity: str, n_seeds: int
) -> tuple[str, str]:
  """Every arm's held-out loss by bucket and, right, each claimed pair's
  paired difference (pairs without a measured one left out): (title, file
  name).

  Args:
    summary: `aggregate.aggregate`'s summary (its ``attribution``).
    out_dir: the report directory.
    identity: the runs' description, the title's second line.
    n_seeds: the most seeds of an arm.

  Returns:
    (title, file name).
  """
  name = 'bucket_profile.png'
  series = {
      arm: entry['vectors'].get(attribution.PROFILE_METRIC, [])
      for arm, entry in summary['arms'].items()
      if entry['seeds']
  }
  differences = {}
  for pair in summary.get('attribution', []):
    means = [x.get('mean') for x in pair['differences']]
    if any(mean is not None and np.isfinite(mean) for mean in means):
      differences[f'{pair["arm"]} - {pair["baseline"]}'] = pair['differences']
  tokenizers = {
      entry.get('tokenizer', '') for entry in summary['arms'].values()
  }
  tokenizer = tokenizers.pop() if len(tokenizers) == 1 else ''
  plots.experiment_profile(
      os.path.join(out_dir, name),
      [f'{start}-{end}' for start, end in summary['buckets']],
      series,
      differences=differences,
      n_seeds=n_seeds,
      title=f'Per-bucket profile: held-out loss by position bucket\n{identity}',
      ylabel=measures.label(attribution.PROFILE_METRIC, tokenizer),
  )
  return 'Per-bucket profile of every arm (and its paired differences)', name


def dose_plot(
    doses: list[dict[str, Any]], out_dir: str, identity: str
) -> tuple[str, str]:
  """The dose-response figure: (title, file name).

  Series of several experiments share one column per measure; an offset
  penalty is one column whatever its shift K (experiments probe different
  shifts), and each panel's title names its own K.

  Args:
    doses: the summaries' dose series (``analyses['doses']``).
    out_dir: the report directory.
    identity: the runs' description, the title's second line.

  Returns:
    (title, file name).
  """
  name = 'dose_response.png'
  labels = {
      'loss_late': 'last-bucket loss: arm - baseline',
      'loss_late_minus_mid': '(last - mid bucket): arm - baseline',
  }
  panels = {}
  shifts = set()
  for dose in doses:
    if not dose['arms']:
      continue
    measures = {}
    panel_name = dose['name']
    for metric, intervals in dose['measures'].items():
      if metric.startswith(window_measures.OFFSET_PENALTY):
        shift = metric.removeprefix(window_measures.OFFSET_PENALTY)
        shifts.add(shift)
        panel_name = f'{panel_name} (offset +{shift})'
        metric = window_measures.OFFSET_PENALTY.rstrip('_')
      measures[metric] = intervals
    panels[panel_name] = {
        'x': dose['late_exposure'],
        'arms': dose['arms'],
        'baseline': dose['baseline'],
        'measures': measures,
    }
  # One column per measure of any panel; a panel without it (an experiment
  # with no offset probe) shows n/a there (`plots.dose_response`).
  columns = {}
  for panel in panels.values():
    columns.update(dict.fromkeys(panel['measures']))
  ylabels = {}
  for metric in columns:
    if metric in labels:
      ylabels[metric] = labels[metric]
    elif len(shifts) == 1:
      ylabels[metric] = (
          f'offset penalty (+{next(iter(shifts))}): arm - baseline'
      )
    else:
      ylabels[metric] = 'offset penalty (+K of the panel): arm - baseline'
  plots.dose_response(
      os.path.join(out_dir, name),
      panels,
      ylabels=ylabels,
      title=(
          'Late-row penalty against late-row exposure (95% over seeds and'
          f' documents)\n{identity}'
      ),
  )
  return 'Dose-response: late-row penalty against late-row exposure', name
