"""A sweep's runs -> the JSON-ready summary: per arm and per bucket, the
intervals of every measure and the claims' verdicts (docs/DESIGN.md §
Experiments outputs)."""

from collections.abc import Mapping
import math
import os
from typing import Any

import ml_collections
import numpy as np

from flax_posemb import buckets
from flax_posemb import eval_report
from flax_posemb import inference
from flax_posemb.experiments import attribution
from flax_posemb.experiments import measures
from flax_posemb.experiments import spec
from flax_posemb.experiments import sweep
from flax_posemb.experiments import verdicts
from flax_posemb.experiments import window_measures


def stated_settings(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The settings every report states (token init, beta2, weight decay, corpus,
  shapes)."""
  data = config.data
  model = config.model
  optimizer = config.optimizer
  return {
      'token_init': model.token_init,
      'token_init_std': model.token_init_std,
      'beta2': optimizer.b2,
      'weight_decay': optimizer.weight_decay,
      'decay_position_table': optimizer.decay_position_table,
      'corpus': data.source if data.source != 'tfds' else f'tfds:{data.name}',
      'tokenizer': (
          data.tokenizer if data.source != 'synthetic' else 'synthetic'
      ),
      'seq_len': data.seq_len,
      'num_train_steps': config.num_train_steps,
      'model': (
          f'{model.num_layers} layers, {model.num_heads} heads, width'
          f' {model.emb_dim}, table {model.max_len} rows'
      ),
  }


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
  return [inference.t_interval(x[:, j]).as_dict() for j in range(x.shape[1])]


# seed -> run dir of one arm's finished runs.
RunDirs = Mapping[int, str]


def aggregate(
    exp: ml_collections.ConfigDict, sweep_out: Mapping[str, Any]
) -> dict[str, Any]:
  """The JSON-ready summary of a sweep (docs/DESIGN.md § Experiments outputs).

  Args:
    exp: the experiment's spec.
    sweep_out: `sweep.run_sweep`'s output.

  Returns:
    The summary: per arm the intervals of every scalar and vector measure,
    the claims with their verdicts (Holm over the measured ones), the
    profiles' paired differences, the analyses and the runs.
  """
  rows = [row for row in sweep_out['runs'] if row['done']]
  # arm (grid order, unfinished arms included) -> {seed: measures}, seeds
  # ascending; and -> {seed: run dir} of the runs whose windows are on disk.
  by_arm: dict[str, dict[int, Any]] = {
      row['arm']: {} for row in sweep_out['runs']
  }
  dirs: dict[str, dict[int, str]] = {arm: {} for arm in by_arm}
  for row in sorted(rows, key=_seed):
    by_arm[row['arm']][_seed(row)] = row['measures']
    if window_measures.has_windows(row['run_dir']):
      dirs[row['arm']][_seed(row)] = row['run_dir']
  judge = _Judge(exp, by_arm, dirs, bool(sweep_out.get('quick')))
  claims = [judge.claim(claim) for claim in exp.claims if judge.has(claim)]
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
  summary = {
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
  attribution.attribute(summary, exp, judge.differences)
  return summary


def _seed(row: Mapping[str, Any]) -> int:
  return int(row['seed'])


def most_seeds(summary: Mapping[str, Any]) -> int:
  """The most seeds any arm finished."""
  arms = summary['arms'].values()
  return max((len(entry['seeds']) for entry in arms), default=0)


class _Judge:
  """Intervals of one experiment's measures: over seeds and documents for
  measures of the evaluation windows (when the runs kept them), over seeds for
  the rest (`window_measures`)."""

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
    if not window_measures.is_window_metric(metric):
      return False
    for arm in arms:
      runs = self.by_arm.get(arm, {}) if arm else {}
      if set(self.dirs.get(arm, {})) != set(runs):
        return False
      # A probe shift that a run shared with another experiment never ran.
      if metric.startswith(window_measures.OFFSET_PENALTY) and any(
          metric not in run['scalars'] for run in runs.values()
      ):
        return False
    return True

  def estimate(
      self, metric: str, arm: str, baseline: str = '', **kwargs: Any
  ) -> dict[str, Any]:
    """``window_measures.estimate`` of ``arm - baseline``."""
    return window_measures.estimate(
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
    """`verdicts.judge`'s record of ``metric(arm) - metric(baseline)``."""
    if self._on_windows(metric, arm, baseline):
      estimate = self.estimate(metric, arm, baseline)
      return verdicts.judge_estimate(estimate, direction, margin)
    arm_values = _values(self.by_arm[arm], metric)
    if baseline:
      base_values = _values(self.by_arm[baseline], metric)
    else:
      base_values = dict.fromkeys(arm_values, 0.0)
    out = verdicts.judge(arm_values, base_values, direction, margin)
    out['interval']['method'] = inference.SEEDS
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
      return verdicts.contrast_interval(self.estimate(metric, arm))
    values = list(_values(self.by_arm[arm], metric).values())
    return dict(inference.t_interval(values).as_dict(), method=inference.SEEDS)

  def vector(
      self, arm: str, metric: str, baseline: str = ''
  ) -> list[dict[str, Any]]:
    """Per bucket, the interval of ``metric(arm) - metric(baseline)``."""
    if self._on_windows(metric, arm, baseline):
      num_buckets = len(next(iter(self.by_arm[arm].values()))['buckets'])
      return [
          verdicts.contrast_interval(
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

  def differences(
      self, metric: str, arm: str, baseline: str
  ) -> list[dict[str, Any]] | None:
    """`attribution.Differences`: per bucket, ``metric(arm) -
    metric(baseline)`` (None unless both arms finished)."""
    if not self.by_arm.get(arm) or not self.by_arm.get(baseline):
      return None
    return self.vector(arm, metric, baseline)

  def _exposure(
      self, arm: str, bucket: int, vector: str = 'bucket_exposure'
  ) -> float:
    """Mean over seeds of the cumulative training occurrences per row of
    ``bucket`` (``vector``: all of them, or `bucket_full_context_exposure`;
    NaN where no run counted them)."""
    runs = self.by_arm[arm].values()
    per_seed = [
        run['vectors'].get(vector, [np.nan] * (abs(bucket) + 1))[bucket]
        for run in runs
    ]
    if not np.isfinite(per_seed).any():
      return float('nan')
    return float(np.nanmean(per_seed))

  def _baseline_exposure(self, baseline: str) -> dict[str, float] | None:
    """A dose series' baseline's own exposure (None: not in the sweep): a
    control whose rows are cut inside documents sees its late rows at full
    context less often than at all."""
    if not self.by_arm.get(baseline):
      return None
    return {
        'late': self._exposure(baseline, -1),
        'late_full_context': self._exposure(
            baseline, -1, 'bucket_full_context_exposure'
        ),
        'early': self._exposure(baseline, 0),
    }

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
        'late_full_context_exposure': [
            self._exposure(arm, -1, 'bucket_full_context_exposure')
            for arm in arms
        ],
        'early_exposure': [self._exposure(arm, 0) for arm in arms],
        'baseline_exposure': self._baseline_exposure(dose.baseline),
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
  first = window_measures.load(ready[0]['run_dir'])
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
        rise_of_group = window_measures.estimate(
            'loss_late_minus_mid',
            judge.dirs[arm],
            mid=before_last,
            select=_group_mask(name, group['group'], window_len),
        )
        arms[arm].append(verdicts.contrast_interval(rise_of_group))
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
  with_windows = [
      row for row in rows if window_measures.has_windows(row['run_dir'])
  ]
  if with_windows:
    windows = window_measures.load(with_windows[0]['run_dir']).passes['eval']
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
      'converged_step': (
          inference.t_interval(list(converged.values())).as_dict()
      ),
      'never_converged_seeds': [
          seed for seed, step in converged.items() if not math.isfinite(step)
      ],
  }
