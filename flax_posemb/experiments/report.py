"""A sweep's summary.json, REPORT.md and figures (docs/DESIGN.md § Experiments
outputs)."""

from collections.abc import Iterable, Mapping
import math
import os
from typing import Any

import ml_collections
import numpy as np

from flax_posemb import buckets
from flax_posemb import eval_report
from flax_posemb import outputs
from flax_posemb import plots
from flax_posemb.experiments import inference
from flax_posemb.experiments import measures
from flax_posemb.experiments import paired
from flax_posemb.experiments import spec
from flax_posemb.experiments import sweep

# Per-arm scalars of the report's arm table (all of them are in summary.json).
TABLE_SCALARS = (
    'final_loss',
    'loss_late_minus_mid',
    'loss_late_minus_early',
    'excess_late',
    'recovered_late',
    'exposure_late_over_early',
    'update_late_over_early',
    'drift_late',
    'tokens_per_step',
    'train_seconds',
    'step_seconds',
)


def stated_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The settings every report states (token init, beta2, weight decay, corpus,
  shapes)."""
  data = config.data
  model = config.model
  optimizer = config.optimizer
  return {
      'token_init': model.token_init,
      'token_init_std': float(model.token_init_std),
      'beta2': float(optimizer.b2),
      'weight_decay': float(optimizer.weight_decay),
      'decay_position_table': bool(optimizer.decay_position_table),
      'corpus': data.source if data.source != 'tfds' else f'tfds:{data.name}',
      'tokenizer': (
          data.tokenizer if data.source != 'synthetic' else 'synthetic'
      ),
      'seq_len': int(data.seq_len),
      'num_train_steps': int(config.num_train_steps),
      'model': (
          f'{model.num_layers} layers, {model.num_heads} heads, width'
          f' {model.emb_dim}, table {model.max_len} rows'
      ),
  }


def _finite(x: Any) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)


def fmt(x: Any, nd: int = 4) -> str:
  """`x` with `nd` decimals (scientific when tiny or huge); `n/a` if not
  finite."""
  if not _finite(x):
    return 'n/a'
  if x != 0 and (abs(x) >= 1e4 or abs(x) < 10**-nd):
    return f'{x:.{max(nd - 1, 1)}e}'
  return f'{x:.{nd}f}'


def fmt_interval(iv: Mapping[str, Any], nd: int = 4) -> str:
  """An interval dict as `mean [low, high]` (`mean (n=N)` without bounds)."""
  if not _finite(iv.get('mean')):
    return 'n/a'
  if not _finite(iv.get('low')):
    return f"{fmt(iv['mean'], nd)} (n={iv['n']})"
  return f"{fmt(iv['mean'], nd)} [{fmt(iv['low'], nd)}, {fmt(iv['high'], nd)}]"


def _values(
    runs: Mapping[int, Mapping[str, Any]], metric: str
) -> dict[int, float]:
  """seed -> scalar ``metric`` (NaN where not measured)."""
  return {
      seed: float(run['scalars'].get(metric, np.nan))
      for seed, run in runs.items()
  }


def _vectors(
    runs: Mapping[int, Mapping[str, Any]], metric: str, seeds
) -> np.ndarray:
  """``[len(seeds), B]`` vector ``metric`` of those seeds (NaN where not
  measured)."""
  rows = []
  for seed in seeds:
    unmeasured = [np.nan] * len(runs[seed]['buckets'])
    rows.append(runs[seed]['vectors'].get(metric, unmeasured))
  return np.array(rows, np.float64).reshape(len(seeds), -1)


def _intervals(x: np.ndarray) -> list[dict[str, Any]]:
  """Interval over seeds (axis 0) of each column of ``x`` ``[n, B]``."""
  return [paired.t_interval(x[:, j]).as_dict() for j in range(x.shape[1])]


def _md_table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
  """Markdown table lines; a dict cell is an interval (``fmt_interval(cell,
  3)``)."""
  lines = []
  for row in [header, ['---'] * len(header), *rows]:
    cells = [
        fmt_interval(cell, 3) if isinstance(cell, dict) else str(cell)
        for cell in row
    ]
    lines.append('| ' + ' | '.join(cells) + ' |')
  return lines


# seed -> run dir of one arm's finished runs.
RunDirs = Mapping[int, str]


def aggregate(
    exp: ml_collections.ConfigDict, sweep_out: Mapping[str, Any]
) -> dict[str, Any]:
  """The JSON-ready summary of a sweep (``sweep.run_sweep`` output)."""
  rows = [row for row in sweep_out['runs'] if row['done']]
  # arm (grid order, unfinished arms included) -> {seed: measures}, seeds
  # ascending; and -> {seed: run dir} of the runs whose windows are on disk.
  by_arm: dict[str, dict[int, Any]] = {
      row['arm']: {} for row in sweep_out['runs']
  }
  dirs: dict[str, dict[int, str]] = {arm: {} for arm in by_arm}
  for row in sorted(rows, key=_seed):
    by_arm[row['arm']][_seed(row)] = row['measures']
    if inference.has_windows(row['run_dir']):
      dirs[row['arm']][_seed(row)] = row['run_dir']
  judge = _Judge(exp, by_arm, dirs, bool(sweep_out.get('quick')))
  claims = paired.with_holm(
      [judge.claim(claim) for claim in exp.claims if judge.has(claim)]
  )
  tested = [
      claim for claim in claims if claim['verdict'] != paired.NOT_MEASURED
  ]
  analyses: dict[str, Any] = {}
  if 'cosine_convergence' in exp.analyses:
    analyses['cosine_convergence'] = _convergence(exp, rows)
  windows = _window_groups(rows, judge)
  if windows:
    analyses['windows'] = windows
  mix = _mix(rows)
  if mix:
    analyses['mix'] = mix
  doses = [judge.dose(dose) for dose in exp.doses]
  if any(dose['arms'] for dose in doses):
    analyses['doses'] = doses
  overrides = {arm.name: dict(arm.overrides) for arm in exp.arms}
  return {
      'experiment': exp.name,
      'title': exp.title,
      'question': exp.question,
      'complete': sweep_out['complete'],
      'quick': bool(sweep_out.get('quick')),
      'buckets': rows[0]['measures']['buckets'] if rows else [],
      'mid_bucket': int(exp.mid_bucket),
      'settings': stated_settings(rows[0]['config']) if rows else {},
      'budget': sweep_out['budget'],
      'arms': _arms(by_arm, rows, judge),
      'claims': claims,
      'multiplicity': {
          'method': 'holm',
          'claims_tested': len(tested),
          'alpha': 0.05,
          'verdicts_changed': sum(
              claim['verdict_holm'] != claim['verdict'] for claim in tested
          ),
      },
      'profiles': _profiles(exp, by_arm, judge),
      'analyses': analyses,
      'runs': [
          {
              'arm': row['arm'],
              'seed': row['seed'],
              'key': row['key'],
              'done': row['done'],
              'overrides': overrides[row['arm']],
          }
          for row in sweep_out['runs']
      ],
  }


def _seed(row: Mapping[str, Any]) -> int:
  return int(row['seed'])


def _most_seeds(summary: Mapping[str, Any]) -> int:
  """The most seeds any arm finished."""
  arms = summary['arms'].values()
  return max((len(entry['seeds']) for entry in arms), default=0)


class _Judge:
  """Intervals of one experiment's measures: over seeds and documents for
  measures of the evaluation windows (when the runs kept them), over seeds for
  the rest (`inference`)."""

  def __init__(
      self,
      exp: ml_collections.ConfigDict,
      by_arm: Mapping[str, Mapping[int, Any]],
      dirs: Mapping[str, RunDirs],
      quick: bool,
  ):
    self.exp = exp
    self.by_arm = by_arm
    self.dirs = dirs
    self.offsets = spec.offsets(exp, quick)

  def has(self, claim: ml_collections.ConfigDict) -> bool:
    """Whether the claim's arms are in the sweep."""
    if claim.arm not in self.by_arm:
      return False
    return not claim.baseline or claim.baseline in self.by_arm

  def _on_windows(self, metric: str, *arms: str) -> bool:
    """Whether ``metric`` of ``arms`` is judged over seeds and documents."""
    if not inference.is_window_metric(metric):
      return False
    for arm in arms:
      runs = self.by_arm.get(arm, {}) if arm else {}
      if set(self.dirs.get(arm, {})) != set(runs):
        return False
      # A probe shift that a run shared with another experiment never ran.
      if metric.startswith(inference.OFFSET_PENALTY) and any(
          metric not in run['scalars'] for run in runs.values()
      ):
        return False
    return True

  def estimate(
      self, metric: str, arm: str, baseline: str = '', **kwargs: Any
  ) -> dict[str, Any]:
    """``inference.estimate`` of ``arm - baseline``."""
    return inference.estimate(
        metric,
        self.dirs[arm],
        self.dirs[baseline] if baseline else None,
        mid=int(self.exp.mid_bucket),
        **kwargs,
    )

  def judged(
      self,
      metric: str,
      arm: str,
      baseline: str,
      direction: str,
      margin: float = 0.0,
  ) -> dict[str, Any]:
    """`paired.judge`'s record of ``metric(arm) - metric(baseline)``."""
    if self._on_windows(metric, arm, baseline):
      estimate = self.estimate(metric, arm, baseline)
      return paired.judge_estimate(estimate, direction, margin)
    arm_values = _values(self.by_arm[arm], metric)
    if baseline:
      base_values = _values(self.by_arm[baseline], metric)
    else:
      base_values = dict.fromkeys(arm_values, 0.0)
    out = paired.judge(arm_values, base_values, direction, margin)
    out['interval']['method'] = paired.SEEDS
    return out

  def claim(self, claim: ml_collections.ConfigDict) -> dict[str, Any]:
    """The claim's record: interval of ``metric(arm) - metric(baseline)`` and
    verdict."""
    judged = self.judged(
        claim.metric, claim.arm, claim.baseline, claim.direction, claim.margin
    )
    return {
        'id': claim.id,
        'text': claim.text,
        'metric': claim.metric,
        'arm': claim.arm,
        'baseline': claim.baseline,
        'direction': claim.direction,
        'margin': claim.margin,
        **judged,
    }

  def scalar(self, arm: str, metric: str) -> dict[str, Any]:
    """The arm's interval of ``metric``."""
    if self._on_windows(metric, arm):
      return paired.estimate_interval(self.estimate(metric, arm))
    values = list(_values(self.by_arm[arm], metric).values())
    return dict(paired.t_interval(values).as_dict(), method=paired.SEEDS)

  def vector(
      self, arm: str, metric: str, baseline: str = ''
  ) -> list[dict[str, Any]]:
    """Per bucket, the interval of ``metric(arm) - metric(baseline)``."""
    if self._on_windows(metric, arm, baseline):
      num_buckets = len(next(iter(self.by_arm[arm].values()))['buckets'])
      return [
          paired.estimate_interval(
              self.estimate(metric, arm, baseline, bucket=i)
          )
          for i in range(num_buckets)
      ]
    runs = self.by_arm[arm]
    if not baseline:
      return _intervals(_vectors(runs, metric, list(runs)))
    base = self.by_arm[baseline]
    shared = sorted(set(runs) & set(base))
    return _intervals(
        _vectors(runs, metric, shared) - _vectors(base, metric, shared)
    )

  def _exposure(self, arm: str, bucket: int) -> float:
    """Mean over seeds of the cumulative training occurrences per row of
    ``bucket``."""
    runs = self.by_arm[arm].values()
    per_seed = [run['vectors']['bucket_exposure'][bucket] for run in runs]
    return float(np.nanmean(per_seed))

  def dose(self, dose: ml_collections.ConfigDict) -> dict[str, Any]:
    """A dose-response series: per arm its late rows' exposure and its paired
    differences to the series' baseline."""
    arms = []
    if self.by_arm.get(dose.baseline):
      arms = [arm for arm in dose.arms if self.by_arm.get(arm)]
    metrics = ['loss_late', 'loss_late_minus_mid']
    if self.offsets:
      metrics.append(f'offset_penalty_{self.offsets[-1]}')
    differences = {}
    for metric in metrics:
      differences[metric] = [
          self.judged(metric, arm, dose.baseline, 'greater')['interval']
          for arm in arms
      ]
    return {
        'name': dose.name,
        'baseline': dose.baseline,
        'arms': arms,
        'late_exposure': [self._exposure(arm, -1) for arm in arms],
        'early_exposure': [self._exposure(arm, 0) for arm in arms],
        'rare_exposure': float(self.exp.rare_exposure),
        'measures': differences,
    }


def _arms(
    by_arm: Mapping[str, Any], rows: list[Mapping[str, Any]], judge: _Judge
) -> dict[str, Any]:
  """arm -> {seeds[, scalars, vectors, corpus, tokenizer]} with intervals."""
  settings = {row['arm']: stated_settings(row['config']) for row in rows}

  def names(kind):
    return sorted({name for row in rows for name in row['measures'][kind]})

  out: dict[str, dict[str, Any]] = {}
  for arm, runs in by_arm.items():
    entry: dict[str, Any] = {'seeds': list(runs), 'scalars': {}, 'vectors': {}}
    out[arm] = entry
    if not runs:
      continue
    entry['scalars'] = {
        name: judge.scalar(arm, name) for name in names('scalars')
    }
    entry['vectors'] = {
        name: judge.vector(arm, name) for name in names('vectors')
    }
    entry['corpus'] = settings[arm]['corpus']
    entry['tokenizer'] = settings[arm]['tokenizer']
  return out


def _profiles(
    exp: ml_collections.ConfigDict,
    by_arm: Mapping[str, Any],
    judge: _Judge,
) -> list[dict[str, Any]]:
  """Each profile's finished arms and their per-bucket paired differences."""
  profiles = []
  for profile in exp.profiles:
    present = [arm for arm in profile.arms if by_arm.get(arm)]
    if not present:
      continue
    differences = {}
    baseline = profile.baseline
    if by_arm.get(baseline):
      for arm in present:
        if arm != baseline:
          differences[arm] = judge.vector(arm, profile.metric, baseline)
    profiles.append(
        {
            'metric': profile.metric,
            'title': profile.title,
            'arms': present,
            'baseline': baseline,
            'differences': differences,
        }
    )
  return profiles


def _window_groups(
    rows: list[Mapping[str, Any]], judge: _Judge
) -> dict[str, Any]:
  """The windows' provenance and, per window group and arm, the last bucket
  minus the one before it (descriptive: the groups were not pre-registered)."""
  ready = [row for row in rows if _seed(row) in judge.dirs[row['arm']]]
  if not ready:
    return {}
  first = inference.load(ready[0]['run_dir'])
  if 'windows' not in first.results:
    return {}
  window_len = first.results['windows']['window_len']
  before_last = len(first.results['buckets']) - 2
  rise = {}
  for name in eval_report.GROUP_TABLES:
    present = list(first.results.get(name) or [])
    arms: dict[str, list[dict[str, Any]]] = {}
    for arm in dict.fromkeys(row['arm'] for row in ready):
      arms[arm] = []
      for group in present:
        rise_of_group = inference.estimate(
            'loss_late_minus_mid',
            judge.dirs[arm],
            mid=before_last,
            select=_group_mask(name, group['group'], window_len),
        )
        arms[arm].append(paired.estimate_interval(rise_of_group))
    rise[name] = {
        'groups': [
            f"{group['group']} ({group['windows']} windows,"
            f" {group['documents']} docs)"
            for group in present
        ],
        'arms': arms,
    }
  return {'summary': first.results['windows'], 'rise': rise}


def _group_mask(name: str, label: str, window_len: int):
  """``(windows.npz contents) -> [W] bool``: the windows of group ``label``."""

  def select(windows):
    labels, _ = buckets.window_groups(windows, window_len)[name]
    return labels == label

  return select


def _mix(rows: list[Mapping[str, Any]]) -> dict[str, Any]:
  """Share of training tokens per document kind per arm (mean over seeds)
  beside the evaluation windows' scored tokens per kind."""
  per_arm: dict[str, list[dict[str, float]]] = {}
  for row in rows:
    path = os.path.join(row['run_dir'], sweep.MIX)
    if os.path.exists(path):
      per_arm.setdefault(row['arm'], []).append(measures.load_json(path))
  if not per_arm:
    return {}
  kinds = sorted(
      {kind for mixes in per_arm.values() for mix in mixes for kind in mix}
  )
  training = {}
  for arm, mixes in per_arm.items():
    training[arm] = {
        kind: float(np.mean([mix.get(kind, 0.0) for mix in mixes]))
        for kind in kinds
    }
  evaluation = {}
  with_windows = [row for row in rows if inference.has_windows(row['run_dir'])]
  if with_windows:
    windows = inference.load(with_windows[0]['run_dir']).passes['eval']
    window_kind = np.asarray(windows['kind']).astype(str)
    scored = np.asarray(windows['win_count'], np.float64).sum(1)
    total = max(scored.sum(), 1.0)
    for kind in sorted(set(window_kind.tolist()) | set(kinds)):
      evaluation[kind] = float(scored[window_kind == kind].sum() / total)
  return {'kinds': kinds, 'training': training, 'evaluation': evaluation}


def _convergence(
    exp: ml_collections.ConfigDict, rows: list[Mapping[str, Any]]
) -> dict[str, Any]:
  # seed -> {arm: run_dir} of the finished runs
  run_dirs: dict[int, dict[str, str]] = {}
  for row in rows:
    run_dirs.setdefault(row['seed'], {})[row['arm']] = row['run_dir']
  threshold = float(exp.convergence_threshold)
  per_seed = {
      seed: measures.convergence_step(by_arm, threshold)
      for seed, by_arm in run_dirs.items()
      if len(by_arm) >= 2
  }
  if not per_seed:
    return {}
  steps = min((result['steps'] for result in per_seed.values()), key=len)
  curves = np.array(
      [result['agreement'][: len(steps)] for result in per_seed.values()],
      np.float64,
  )
  converged = {
      seed: result['converged_step'] for seed, result in per_seed.items()
  }
  return {
      'threshold': threshold,
      'steps': steps,
      'agreement': _intervals(curves),
      'converged_step': paired.t_interval(list(converged.values())).as_dict(),
      'never_converged_seeds': [
          seed for seed, step in converged.items() if not math.isfinite(step)
      ],
  }


def _plots(summary: Mapping[str, Any], out_dir: str) -> list[tuple[str, str]]:
  """Writes the report's figures; returns (title, file name) of each."""
  settings = summary['settings']
  n_seeds = _most_seeds(summary)
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
        documents=inference.is_window_metric(profile['metric']),
    )
    made.append((profile['title'], name))
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


def dose_plot(
    doses: list[dict[str, Any]], out_dir: str, identity: str
) -> tuple[str, str]:
  """The dose-response figure: (title, file name).

  Series of several experiments share one column per measure; an offset
  penalty is one column whatever its shift K (experiments probe different
  shifts), and each panel's title names its own K.
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
      if metric.startswith(inference.OFFSET_PENALTY):
        shift = metric.removeprefix(inference.OFFSET_PENALTY)
        shifts.add(shift)
        panel_name = f'{panel_name} (offset +{shift})'
        metric = inference.OFFSET_PENALTY.rstrip('_')
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


def write(
    exp: ml_collections.ConfigDict,
    sweep_out: Mapping[str, Any],
    out_dir: str,
    command: str,
) -> dict[str, Any]:
  """Writes ``summary.json``, the figures and ``REPORT.md``; returns the
  summary."""
  summary = dict(aggregate(exp, sweep_out), command=command)
  figures = _plots(summary, out_dir)
  summary['figures'] = [name for _, name in figures]
  sweep.write_json(
      os.path.join(out_dir, 'summary.json'), eval_report.json_safe(summary)
  )
  with outputs.atomic_write(os.path.join(out_dir, 'REPORT.md'), 'w') as f:
    f.write(markdown(exp, summary, figures))
  return summary


def markdown(
    exp: ml_collections.ConfigDict,
    summary: Mapping[str, Any],
    figures: list[tuple[str, str]],
) -> str:
  """The REPORT.md text."""
  lines = [f'# {summary["title"]}', '', summary['question'], '']
  if not summary['complete']:
    lines += [
        (
            '**Partial sweep:** some runs have not finished; numbers use the'
            ' finished seeds only.'
        ),
        '',
    ]
  # Notes cite full runs.
  if exp.notes and summary['complete'] and not summary['quick']:
    lines += [
        '## What changed since the previous report',
        '',
        *(f'- {note}' for note in exp.notes),
        '',
    ]
  lines += (
      _setup_lines(summary) + _claims_lines(summary) + _arms_lines(exp, summary)
  )
  lines += _mix_lines(summary) + _dose_lines(summary)
  windows = summary['analyses'].get('windows')
  if windows:
    lines += _window_lines(windows)
  lines += [
      '## Figures',
      '',
      *(x for t, n in figures for x in (f'![{t}]({n})', '')),
  ]
  lines += [
      '## Configs',
      '',
      'Arms (dotted overrides of the shared base config):',
      '',
  ]
  for arm in exp.arms:
    if arm.name in summary['arms']:
      overrides = ', '.join(f'`{k}={v!r}`' for k, v in arm.overrides)
      lines.append(f'- `{arm.name}`: ' + (overrides or 'base config'))
  lines += [
      '',
      (
          "Every run's full resolved config is in `config.json` / `run.json` of"
          ' its run directory; `summary.json` holds every measure per arm.'
      ),
      '',
  ]
  return '\n'.join(lines)


def _mix_lines(summary: Mapping[str, Any]) -> list[str]:
  mix = summary['analyses'].get('mix')
  if not mix:
    return []
  kinds = mix['kinds']

  def percent(shares: Mapping[str, float]) -> list[str]:
    return [f'{100 * shares.get(kind, 0.0):.1f}%' for kind in kinds]

  rows = [[arm, *percent(shares)] for arm, shares in mix['training'].items()]
  if mix['evaluation']:
    rows.append(['*evaluation windows*', *percent(mix['evaluation'])])
  return [
      '## What each arm trained on',
      '',
      (
          "Share of each arm's training tokens per document kind (every"
          ' batch of the run, replayed; mean over seeds), beside the share of'
          ' the scored tokens of the evaluation windows. Arms that differ here'
          ' differ in content, not only in position exposure.'
      ),
      '',
      *_md_table(['arm', *kinds], rows),
      '',
  ]


def _dose_lines(summary: Mapping[str, Any]) -> list[str]:
  doses = summary['analyses'].get('doses')
  if not doses:
    return []
  lines = [
      '## Dose-response',
      '',
      (
          'Content-matched arms against how often their last bucket of rows'
          ' was seen in training (cumulative occurrences per row, mean over'
          ' seeds): paired differences to the baseline, 95% intervals over'
          ' seeds and documents.'
      ),
      '',
  ]
  for dose in doses:
    metrics = list(dose['measures'])
    rows = []
    for i, arm in enumerate(dose['arms']):
      late = dose['late_exposure'][i]
      early = dose['early_exposure'][i]
      rare = _rare(late, early, dose['rare_exposure'])
      rows.append(
          [
              arm,
              fmt(late, 1),
              fmt(early, 1),
              'yes' if rare else 'no',
              *(dose['measures'][metric][i] for metric in metrics),
          ]
      )
    lines += [f'### {dose["name"]}: arm - {dose["baseline"]}', '']
    lines += _md_table(
        [
            'arm',
            'late-row occurrences',
            'first-bucket occurrences',
            'rare regime',
            *(f'`{metric}`' for metric in metrics),
        ],
        rows,
    )
    lines += [
        '',
        (
            f"*Rare regime*: the last bucket's rows were seen fewer than"
            f' {fmt(dose["rare_exposure"], 0)} times each and less than a tenth'
            " as often as the first bucket's. Where no arm reaches it, this"
            ' experiment says nothing about rare rows.'
        ),
        '',
    ]
  return lines


def _rare(late: float, early: float, threshold: float) -> bool:
  """Whether a late bucket seen ``late`` times per row, against ``early``, is
  in the regime of the claim (tens of occurrences against thousands)."""
  return late < threshold and late < 0.1 * early


def _window_lines(windows: Mapping[str, Any]) -> list[str]:
  lines = [
      '## Evaluation windows',
      '',
      (
          'Every run is scored on the same held-out windows (bucket intervals'
          ' inside a run are clustered by document; see docs/DESIGN.md).'
      ),
      '',
      eval_report.format_windows(windows['summary']),
      '',
      (
          'Last bucket minus the bucket before it, by window group: mean over'
          ' seeds [95% interval over seeds and the documents of the group].'
          ' **Descriptive**: these groups were chosen after the runs, so no'
          ' claim rests on them; a group from one document has no interval'
          ' (n/a).'
      ),
      '',
  ]
  titles = {
      'by_kind': 'document kind',
      'by_depth': 'window start (tokens into the document)',
      'by_end': "tokens from the window's end to the document's end",
  }
  for name, t in windows['rise'].items():
    lines += [f'### By {titles.get(name, name)}', '']
    lines += _md_table(
        ['arm', *t['groups']], ([a, *v] for a, v in t['arms'].items())
    ) + ['']
  return lines


def _setup_lines(summary: Mapping[str, Any]) -> list[str]:
  s = summary['settings']
  budget = summary['budget']
  n_seeds = _most_seeds(summary)
  lines = [
      '## Setup',
      '',
      f'- Command: `{summary["command"]}`',
      (
          f'- Corpus: {s.get("corpus")} (tokenizer: {s.get("tokenizer")}),'
          f' context {s.get("seq_len")}; model: {s.get("model")}.'
      ),
      (
          f'- Token-embedding init: `{s.get("token_init")}` (std'
          f' {fmt(s.get("token_init_std"))}); Adam beta2 = {s.get("beta2")};'
          f' weight decay {s.get("weight_decay")}, applied to the position'
          f' table: {s.get("decay_position_table")} (unless an arm overrides'
          ' these).'
      ),
      (
          f'- {n_seeds} seed(s) per arm, paired: seed s of every arm shares the'
          f' model-init and data-order seed. {s.get("num_train_steps")}'
          ' optimizer steps for every arm.'
      ),
  ]
  if budget['mode'] == 'real_tokens':
    rows_per_step = ', '.join(
        f'{arm} {rows} ({fmt(budget["per_row"][arm], 1)}/row)'
        for arm, rows in budget['batch_size'].items()
    )
    lines.append(
        '- Budget: same steps and same scored (unmasked) tokens per step. Each'
        " arm's rows per step ="
        f' round({fmt(budget["target_tokens_per_step"], 1)} / its measured'
        ' scored tokens per row); reference arm'
        f' `{budget["reference"]}`. Rows per step: '
        + rows_per_step
        + '. Tokens actually scored per step are in the arm table.'
    )
  else:
    lines.append(
        '- Budget: same steps and rows per step for every arm (not'
        ' token-equalized); tokens actually scored per step are in the arm'
        ' table.'
    )
  mid = summary.get('mid_bucket', -1)
  if 0 <= mid < len(summary['buckets']):
    a, b = summary['buckets'][mid]
    lines.append(
        f'- Late vs mid (pre-registered): the last bucket minus bucket {a}-{b},'
        ' not minus the first bucket, whose loss is dominated by short context'
        " (and, for natural exposure, by documents' openings)."
    )
  lines += [
      (
          '- Intervals (mean [low, high], 95%): measures of the held-out'
          ' windows (bucket losses, late minus mid, the offset penalty, and'
          ' their paired differences) combine seeds and documents: the spread'
          ' of the per-seed estimates plus the document-clustered variance of'
          ' the seed-averaged per-document terms, Student-t with'
          " Satterthwaite's degrees of freedom (docs/DESIGN.md, Experiments"
          ' outputs); measures of training alone (exposure, gradients,'
          ' updates, wall-clock) are Student-t over seeds. Verdict rule, fixed'
          ' before running: a directional claim is *supported* when the'
          ' interval of the paired difference (arm - baseline) excludes 0 in'
          ' the predicted direction, *contradicted* when it excludes 0 the'
          ' other way, else *inconclusive at this scale*; an "equivalent"'
          ' claim is supported when the interval lies inside ±margin,'
          ' contradicted when it lies wholly outside.'
      ),
      '',
  ]
  return lines


def _interval_over(interval: Mapping[str, Any]) -> str:
  """What an interval combines: 'n seeds' or 'n seeds x g docs'."""
  if interval.get('method') == paired.SEEDS_AND_DOCUMENTS:
    return f"{interval['n']} seeds x {interval['documents']} docs"
  return f"{interval['n']} seeds"


def _claims_lines(summary: Mapping[str, Any]) -> list[str]:
  multiplicity = summary['multiplicity']
  lines = [
      '## Claims',
      '',
      (
          f'{multiplicity["claims_tested"]} claims tested. The verdict is'
          " the fixed rule above, on each claim's own 95% interval."
          ' Multiplicity:'
          ' Holm-Bonferroni over all tested claims of this experiment'
          ' (family-wise error 5%); `p` is the smallest alpha at which the'
          " claim's interval is decisive, `p (Holm)` its adjusted value, and"
          ' the last column gives the verdict after the correction where it'
          f' differs ({multiplicity["verdicts_changed"]} do).'
      ),
      '',
  ]
  rows = []
  for claim in summary['claims']:
    if claim['direction'] == 'equivalent':
      predicted = f'|d| < {claim["margin"]}'
    elif claim['direction'] == 'greater':
      predicted = '> 0'
    else:
      predicted = '< 0'
    if claim['verdict_holm'] == claim['verdict']:
      after_holm = ''
    else:
      after_holm = claim['verdict_holm']
    rows.append(
        [
            claim['text'],
            f'`{claim["metric"]}`',
            f'{claim["arm"]} - {claim["baseline"] or "0"}',
            predicted,
            fmt_interval(claim['interval']),
            _interval_over(claim['interval']),
            f'**{claim["verdict"]}**',
            fmt(claim['p_value'], 3),
            fmt(claim['p_holm'], 3),
            after_holm,
        ]
    )
  return lines + _md_table(
      [
          'claim',
          'metric',
          'arm - baseline',
          'predicted',
          'difference [95% CI]',
          'over',
          'verdict',
          'p',
          'p (Holm)',
          'verdict after Holm (if different)',
      ],
      rows,
  )


def _arms_lines(
    exp: ml_collections.ConfigDict, summary: Mapping[str, Any]
) -> list[str]:
  lines = [
      '',
      '## Arms',
      '',
      (
          'Wall-clock cost: `train_seconds` is the whole training of a run'
          ' (compilation included; runs of a shape already compiled load it'
          ' from the persistent cache), `step_seconds` the steady-state seconds'
          ' per step (logging windows after the first). Both are wall-clock on'
          ' the machine that ran the sweep.'
      ),
      '',
  ]
  arms = summary['arms']
  for names in (TABLE_SCALARS, tuple(exp.report_scalars)):
    if not names:
      continue
    rows = [
        [arm, *(entry['scalars'].get(name, {}) for name in names)]
        for arm, entry in arms.items()
    ]
    lines += _md_table(['arm', *names], rows)
    lines += ['']
  buckets = [f'{start}-{end}' for start, end in summary['buckets']]
  for profile in summary['profiles']:
    metric = profile['metric']
    rows = [[arm, *arms[arm]['vectors'][metric]] for arm in profile['arms']]
    for arm, differences in profile['differences'].items():
      rows.append([f'{arm} - {profile["baseline"]}', *differences])
    lines += [f'### {profile["title"]} (per position bucket)', '']
    lines += _md_table(['arm', *buckets], rows)
    lines += ['']
  convergence = summary['analyses'].get('cosine_convergence')
  if convergence:
    lines += [
        '### Convergence of the similarity structure across inits',
        '',
        f'First logged step from which the mean pairwise correlation of the'
        f" inits' "
        f'row cosine-similarity matrices stays >= {convergence["threshold"]}: '
        f'{fmt_interval(convergence["converged_step"], 0)} '
        '(seeds that never converged:'
        f' {convergence["never_converged_seeds"] or "none"}).',
        '',
    ]
  return lines
