"""A sweep's summary.json, REPORT.md and figures (docs/DESIGN.md "Experiments
outputs")."""

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


def stated_settings(config: ml_collections.ConfigDict) -> dict[str, object]:
  """The settings every report states (token init, beta2, weight decay, corpus,
  shapes)."""
  d, m, o = config.data, config.model, config.optimizer
  return {
      'token_init': m.token_init,
      'token_init_std': float(m.token_init_std),
      'beta2': float(o.b2),
      'weight_decay': float(o.weight_decay),
      'decay_position_table': bool(o.decay_position_table),
      'corpus': d.source if d.source != 'tfds' else f'tfds:{d.name}',
      'tokenizer': d.tokenizer if d.source != 'synthetic' else 'synthetic',
      'seq_len': int(d.seq_len),
      'num_train_steps': int(config.num_train_steps),
      'model': (
          f'{m.num_layers} layers, {m.num_heads} heads, width {m.emb_dim},'
          f' table {m.max_len} rows'
      ),
  }


def _finite(x: Any) -> bool:
  return isinstance(x, (int, float)) and math.isfinite(x)


def fmt(x: Any, nd: int = 4) -> str:
  if not _finite(x):
    return 'n/a'
  if x != 0 and (abs(x) >= 1e4 or abs(x) < 10**-nd):
    return f'{x:.{max(nd - 1, 1)}e}'
  return f'{x:.{nd}f}'


def fmt_interval(iv: Mapping[str, Any], nd: int = 4) -> str:
  if not _finite(iv.get('mean')):
    return 'n/a'
  if not _finite(iv.get('low')):
    return f"{fmt(iv['mean'], nd)} (n={iv['n']})"
  return f"{fmt(iv['mean'], nd)} [{fmt(iv['low'], nd)}, {fmt(iv['high'], nd)}]"


def _values(
    runs: Mapping[int, Mapping[str, Any]], metric: str
) -> dict[int, float]:
  """seed -> scalar ``metric`` (NaN where not measured)."""
  return {s: float(m['scalars'].get(metric, np.nan)) for s, m in runs.items()}


def _vectors(
    runs: Mapping[int, Mapping[str, Any]], metric: str, seeds
) -> np.ndarray:
  """``[len(seeds), B]`` vector ``metric`` of those seeds (NaN where not
  measured)."""
  return np.array(
      [
          runs[s]['vectors'].get(metric, [np.nan] * len(runs[s]['buckets']))
          for s in seeds
      ],
      np.float64,
  ).reshape(len(seeds), -1)


def _intervals(x: np.ndarray) -> list[dict[str, Any]]:
  """Interval over seeds (axis 0) of each column of ``x`` ``[n, B]``."""
  return [paired.t_interval(x[:, j]).as_dict() for j in range(x.shape[1])]


def _md_table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
  """Markdown table lines; a dict cell is an interval (``fmt_interval(cell,
  3)``)."""
  return [
      '| '
      + ' | '.join(
          fmt_interval(c, 3) if isinstance(c, dict) else str(c) for c in r
      )
      + ' |'
      for r in [header, ['---'] * len(header), *rows]
  ]


# seed -> run dir of one arm's finished runs.
RunDirs = Mapping[int, str]


def aggregate(
    exp: ml_collections.ConfigDict, sweep_out: Mapping[str, Any]
) -> dict[str, Any]:
  """The JSON-ready summary of a sweep (``sweep.run_sweep`` output)."""
  rows = [r for r in sweep_out['runs'] if r['done']]
  # arm (grid order, unfinished arms included) -> {seed: measures}, seeds
  # ascending; and -> {seed: run dir} of the runs whose windows are on disk.
  by_arm: dict[str, dict[int, Any]] = {r['arm']: {} for r in sweep_out['runs']}
  dirs: dict[str, dict[int, str]] = {a: {} for a in by_arm}
  for r in sorted(rows, key=lambda r: int(r['seed'])):
    by_arm[r['arm']][int(r['seed'])] = r['measures']
    if inference.has_windows(r['run_dir']):
      dirs[r['arm']][int(r['seed'])] = r['run_dir']
  judge = _Judge(exp, by_arm, dirs, bool(sweep_out.get('quick')))
  claims = paired.with_holm(
      [judge.claim(c) for c in exp.claims if judge.has(c)]
  )
  tested = [c for c in claims if c['verdict'] != paired.NOT_MEASURED]
  analyses: dict[str, Any] = {}
  if 'cosine_convergence' in exp.analyses:
    analyses['cosine_convergence'] = _convergence(exp, rows)
  windows = _window_groups(rows, judge)
  if windows:
    analyses['windows'] = windows
  mix = _mix(rows)
  if mix:
    analyses['mix'] = mix
  doses = [judge.dose(d) for d in exp.doses]
  if any(d['arms'] for d in doses):
    analyses['doses'] = doses
  overrides = {a.name: dict(a.overrides) for a in exp.arms}
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
              c['verdict_holm'] != c['verdict'] for c in tested
          ),
      },
      'profiles': _profiles(exp, by_arm, judge),
      'analyses': analyses,
      'runs': [
          {
              'arm': r['arm'],
              'seed': r['seed'],
              'key': r['key'],
              'done': r['done'],
              'overrides': overrides[r['arm']],
          }
          for r in sweep_out['runs']
      ],
  }


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

  def has(self, c: ml_collections.ConfigDict) -> bool:
    """Whether claim ``c``'s arms are in the sweep."""
    return c.arm in self.by_arm and (
        not c.baseline or c.baseline in self.by_arm
    )

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
          metric not in m['scalars'] for m in runs.values()
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

  def claim(self, c: ml_collections.ConfigDict) -> dict[str, Any]:
    """The claim's record: interval of ``metric(arm) - metric(baseline)`` and
    verdict."""
    return {
        'id': c.id,
        'text': c.text,
        'metric': c.metric,
        'arm': c.arm,
        'baseline': c.baseline,
        'direction': c.direction,
        'margin': c.margin,
        **self.judged(c.metric, c.arm, c.baseline, c.direction, c.margin),
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
    return float(
        np.nanmean([m['vectors']['bucket_exposure'][bucket] for m in runs])
    )

  def dose(self, d: ml_collections.ConfigDict) -> dict[str, Any]:
    """A dose-response series: per arm its late rows' exposure and its paired
    differences to the series' baseline."""
    arms = [a for a in d.arms if self.by_arm.get(a)]
    if not self.by_arm.get(d.baseline):
      arms = []
    shift = self.offsets[-1] if self.offsets else 0
    metrics = ['loss_late', 'loss_late_minus_mid']
    if shift:
      metrics.append(f'offset_penalty_{shift}')
    return {
        'name': d.name,
        'baseline': d.baseline,
        'arms': arms,
        'late_exposure': [self._exposure(a, -1) for a in arms],
        'early_exposure': [self._exposure(a, 0) for a in arms],
        'rare_exposure': float(self.exp.rare_exposure),
        'measures': {
            m: [
                self.judged(m, a, d.baseline, 'greater')['interval']
                for a in arms
            ]
            for m in metrics
        },
    }


def _arms(
    by_arm: Mapping[str, Any], rows: list[Mapping[str, Any]], judge: _Judge
) -> dict[str, Any]:
  """arm -> {seeds[, scalars, vectors, corpus, tokenizer]} with intervals."""
  settings = {r['arm']: stated_settings(r['config']) for r in rows}

  def names(kind):
    return sorted({k for r in rows for k in r['measures'][kind]})

  out = {}
  for a, runs in by_arm.items():
    out[a] = {'seeds': list(runs), 'scalars': {}, 'vectors': {}}
    if runs:
      out[a]['scalars'] = {k: judge.scalar(a, k) for k in names('scalars')}
      out[a]['vectors'] = {k: judge.vector(a, k) for k in names('vectors')}
      out[a].update(
          corpus=settings[a]['corpus'], tokenizer=settings[a]['tokenizer']
      )
  return out


def _profiles(
    exp: ml_collections.ConfigDict,
    by_arm: Mapping[str, Any],
    judge: _Judge,
) -> list[dict[str, Any]]:
  """Each profile's finished arms and their per-bucket paired differences."""
  profiles = []
  for p in exp.profiles:
    present = [a for a in p.arms if by_arm.get(a)]
    if not present:
      continue
    prof = {
        'metric': p.metric,
        'title': p.title,
        'arms': present,
        'baseline': p.baseline,
        'differences': {},
    }
    if by_arm.get(p.baseline):
      for a in present:
        if a != p.baseline:
          prof['differences'][a] = judge.vector(a, p.metric, p.baseline)
    profiles.append(prof)
  return profiles


def _window_groups(
    rows: list[Mapping[str, Any]], judge: _Judge
) -> dict[str, Any]:
  """The windows' provenance and, per window group and arm, the last bucket
  minus the one before it (descriptive: the groups were not pre-registered)."""
  ready = [r for r in rows if judge.dirs[r['arm']].get(int(r['seed']))]
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
    arms = {}
    for arm in dict.fromkeys(r['arm'] for r in ready):
      arms[arm] = [
          paired.estimate_interval(
              inference.estimate(
                  'loss_late_minus_mid',
                  judge.dirs[arm],
                  mid=before_last,
                  select=_group_mask(name, g['group'], window_len),
              )
          )
          for g in present
      ]
    rise[name] = {
        'groups': [
            f"{g['group']} ({g['windows']} windows, {g['documents']} docs)"
            for g in present
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
  for r in rows:
    path = os.path.join(r['run_dir'], sweep.MIX)
    if os.path.exists(path):
      per_arm.setdefault(r['arm'], []).append(measures.load_json(path))
  if not per_arm:
    return {}
  kinds = sorted({k for mixes in per_arm.values() for m in mixes for k in m})
  training = {
      arm: {k: float(np.mean([m.get(k, 0.0) for m in mixes])) for k in kinds}
      for arm, mixes in per_arm.items()
  }
  evaluation = {}
  for r in rows:
    if inference.has_windows(r['run_dir']):
      windows = inference.load(r['run_dir']).passes['eval']
      kind = np.asarray(windows['kind']).astype(str)
      scored = np.asarray(windows['win_count'], np.float64).sum(1)
      total = max(scored.sum(), 1.0)
      evaluation = {
          k: float(scored[kind == k].sum() / total)
          for k in sorted(set(kind.tolist()) | set(kinds))
      }
      break
  return {'kinds': kinds, 'training': training, 'evaluation': evaluation}


def _convergence(
    exp: ml_collections.ConfigDict, rows: list[Mapping[str, Any]]
) -> dict[str, Any]:
  # seed -> {arm: run_dir} of the finished runs
  groups: dict[int, dict[str, str]] = {}
  for r in rows:
    groups.setdefault(r['seed'], {})[r['arm']] = r['run_dir']
  per_seed = {
      s: measures.convergence_step(g, float(exp.convergence_threshold))
      for s, g in groups.items()
      if len(g) >= 2
  }
  if not per_seed:
    return {}
  steps = min((v['steps'] for v in per_seed.values()), key=len)
  curves = np.array(
      [v['agreement'][: len(steps)] for v in per_seed.values()], np.float64
  )
  converged = {s: v['converged_step'] for s, v in per_seed.items()}
  return {
      'threshold': float(exp.convergence_threshold),
      'steps': steps,
      'agreement': _intervals(curves),
      'converged_step': paired.t_interval(list(converged.values())).as_dict(),
      'never_converged_seeds': [
          s for s, c in converged.items() if not math.isfinite(c)
      ],
  }


def _plots(summary: Mapping[str, Any], out_dir: str) -> list[tuple[str, str]]:
  """Writes the report's figures; returns (title, file name) of each."""
  s = summary['settings']
  n_seeds = max((len(v['seeds']) for v in summary['arms'].values()), default=0)
  identity = (
      f'{summary["experiment"]}: {s.get("model", "?")}, context'
      f' {s.get("seq_len", "?")}, {s.get("num_train_steps", "?")} steps,'
      f' {n_seeds} seed(s) per arm'
  )
  made = []
  for i, p in enumerate(summary['profiles']):
    name = f'profile_{i}_{p["metric"]}.png'
    series = {a: summary['arms'][a]['vectors'][p['metric']] for a in p['arms']}
    tokenizers = {summary['arms'][a]['tokenizer'] for a in p['arms']}
    means = np.array(
        [
            iv['mean']
            for ivs in series.values()
            for iv in ivs
            if iv.get('mean') is not None
        ],
        np.float64,
    )
    title = (
        p['title']
        if 'bucket' in p['title']
        else f'{p["title"]} by position bucket'
    )
    plots.experiment_profile(
        os.path.join(out_dir, name),
        [f'{a}-{b}' for a, b in summary['buckets']],
        series,
        differences=p['differences'],
        baseline=p['baseline'],
        n_seeds=n_seeds,
        log_y=bool(
            p['metric'] == 'bucket_exposure'
            and means.size
            and means.min() > 0
            and means.max() > 100 * means.min()
        ),
        title=f'{title}\n{identity}',
        ylabel=measures.label(
            p['metric'], tokenizers.pop() if len(tokenizers) == 1 else ''
        ),
        documents=inference.is_window_metric(p['metric']),
    )
    made.append((p['title'], name))
  doses = summary['analyses'].get('doses')
  if doses:
    made.append(dose_plot(doses, out_dir, identity))
  if summary['claims']:
    plots.claims_forest(
        os.path.join(out_dir, 'claims.png'),
        summary['claims'],
        title=f'Claims, arm - baseline\n{identity}',
    )
    made.append(('Every claim, arm - baseline', 'claims.png'))
  # corpus panel -> {arm: final_loss interval}, its axis label
  panels, ylabels = {}, {}
  for a, v in summary['arms'].items():
    if v['seeds']:
      panel = (
          v['corpus']
          if v['tokenizer'] in ('synthetic', '')
          else f'{v["corpus"]} ({v["tokenizer"]} tokens)'
      )
      panels.setdefault(panel, {})[a] = v['scalars'].get('final_loss', {})
      ylabels[panel] = measures.label('final_loss', v['tokenizer'])
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
  if conv := summary['analyses'].get('cosine_convergence'):
    plots.experiment_curve(
        os.path.join(out_dir, 'cosine_convergence.png'),
        conv['steps'],
        conv['agreement'],
        threshold=conv['threshold'],
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
  """The dose-response figure: (title, file name)."""
  name = 'dose_response.png'
  metrics = list(doses[0]['measures'])
  labels = {
      'loss_late': 'last-bucket loss: arm - baseline',
      'loss_late_minus_mid': '(last - mid bucket): arm - baseline',
  }
  ylabels = {
      m: labels.get(m, f'offset penalty (+{m.rsplit("_", 1)[-1]}): arm - base')
      for m in metrics
  }
  plots.dose_response(
      os.path.join(out_dir, name),
      {
          d['name']: {
              'x': d['late_exposure'],
              'arms': d['arms'],
              'baseline': d['baseline'],
              'measures': d['measures'],
          }
          for d in doses
          if d['arms']
      },
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
  summary['figures'] = [f for _, f in figures]
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
        *(f'- {n}' for n in exp.notes),
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
  lines += [
      f'- `{a.name}`: '
      + (', '.join(f'`{k}={v!r}`' for k, v in a.overrides) or 'base config')
      for a in exp.arms
      if a.name in summary['arms']
  ]
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
  rows = [
      [arm, *(f'{100 * shares.get(k, 0.0):.1f}%' for k in kinds)]
      for arm, shares in mix['training'].items()
  ]
  if mix['evaluation']:
    rows.append(
        [
            '*evaluation windows*',
            *(f'{100 * mix["evaluation"].get(k, 0.0):.1f}%' for k in kinds),
        ]
    )
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
  for d in doses:
    metrics = list(d['measures'])
    rows = []
    for i, arm in enumerate(d['arms']):
      late = d['late_exposure'][i]
      early = d['early_exposure'][i]
      rows.append(
          [
              arm,
              fmt(late, 1),
              fmt(early, 1),
              'yes' if _rare(late, early, d['rare_exposure']) else 'no',
              *(d['measures'][m][i] for m in metrics),
          ]
      )
    lines += [f'### {d["name"]}: arm - {d["baseline"]}', '']
    lines += _md_table(
        [
            'arm',
            'late-row occurrences',
            'first-bucket occurrences',
            'rare regime',
            *(f'`{m}`' for m in metrics),
        ],
        rows,
    )
    lines += [
        '',
        (
            f"*Rare regime*: the last bucket's rows were seen fewer than"
            f' {fmt(d["rare_exposure"], 0)} times each and less than a tenth'
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
  s, b = summary['settings'], summary['budget']
  n_seeds = max((len(v['seeds']) for v in summary['arms'].values()), default=0)
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
  if b['mode'] == 'real_tokens':
    lines.append(
        f'- Budget: same steps and same scored (unmasked) tokens per step. Each'
        f" arm's rows "
        f'per step = round({fmt(b["target_tokens_per_step"], 1)} / its measured'
        ' scored tokens '
        f'per row); reference arm `{b["reference"]}`. Rows per step: '
        + ', '.join(
            f'{a} {n} ({fmt(b["per_row"][a], 1)}/row)'
            for a, n in b['batch_size'].items()
        )
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
  m = summary['multiplicity']
  lines = [
      '## Claims',
      '',
      (
          f'{m["claims_tested"]} claims tested. The verdict is the fixed rule'
          " above, on each claim's own 95% interval. Multiplicity:"
          ' Holm-Bonferroni over all tested claims of this experiment'
          ' (family-wise error 5%); `p` is the smallest alpha at which the'
          " claim's interval is decisive, `p (Holm)` its adjusted value, and"
          ' the last column gives the verdict after the correction where it'
          f' differs ({m["verdicts_changed"]} do).'
      ),
      '',
  ]
  rows = []
  for c in summary['claims']:
    pred = {'equivalent': f'|d| < {c["margin"]}', 'greater': '> 0'}.get(
        c['direction'], '< 0'
    )
    rows.append(
        [
            c['text'],
            f'`{c["metric"]}`',
            f'{c["arm"]} - {c["baseline"] or "0"}',
            pred,
            fmt_interval(c['interval']),
            _interval_over(c['interval']),
            f'**{c["verdict"]}**',
            fmt(c['p_value'], 3),
            fmt(c['p_holm'], 3),
            '' if c['verdict_holm'] == c['verdict'] else c['verdict_holm'],
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
    if names:
      lines += _md_table(
          ['arm', *names],
          (
              [a, *(v['scalars'].get(k, {}) for k in names)]
              for a, v in arms.items()
          ),
      ) + ['']
  for p in summary['profiles']:
    rows = [[a, *arms[a]['vectors'][p['metric']]] for a in p['arms']]
    rows += [
        [f'{a} - {p["baseline"]}', *d] for a, d in p['differences'].items()
    ]
    lines += [f'### {p["title"]} (per position bucket)', '']
    lines += _md_table(
        ['arm', *(f'{x}-{y}' for x, y in summary['buckets'])], rows
    ) + ['']
  if conv := summary['analyses'].get('cosine_convergence'):
    lines += [
        '### Convergence of the similarity structure across inits',
        '',
        f'First logged step from which the mean pairwise correlation of the'
        f" inits' "
        f'row cosine-similarity matrices stays >= {conv["threshold"]}: '
        f'{fmt_interval(conv["converged_step"], 0)} '
        '(seeds that never converged:'
        f' {conv["never_converged_seeds"] or "none"}).',
        '',
    ]
  return lines
