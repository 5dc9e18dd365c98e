"""A sweep's summary.json, REPORT.md and figures (docs/DESIGN.md "Experiments
outputs")."""

from collections.abc import Iterable, Mapping
import math
import os
from typing import Any

import ml_collections
import numpy as np

from flax_posemb import eval_report
from flax_posemb import outputs
from flax_posemb import plots
from flax_posemb.experiments import measures
from flax_posemb.experiments import paired
from flax_posemb.experiments import sweep

# Per-arm scalars of the report's arm table (all of them are in summary.json).
TABLE_SCALARS = (
    'final_loss',
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


def aggregate(
    exp: ml_collections.ConfigDict, sweep_out: Mapping[str, Any]
) -> dict[str, Any]:
  """The JSON-ready summary of a sweep (``sweep.run_sweep`` output)."""
  rows = [row for row in sweep_out['runs'] if row['done']]
  # arm (grid order, unfinished arms included) -> {seed: measures}, seeds
  # ascending.
  by_arm: dict[str, dict[int, Any]] = {
      row['arm']: {} for row in sweep_out['runs']
  }
  for row in sorted(rows, key=_seed):
    by_arm[row['arm']][int(row['seed'])] = row['measures']
  claims = paired.with_holm(_claims(exp, by_arm))
  tested = [
      claim for claim in claims if claim['verdict'] != paired.NOT_MEASURED
  ]
  analyses = {}
  if 'cosine_convergence' in exp.analyses:
    analyses['cosine_convergence'] = _convergence(exp, rows)
  windows = _window_groups(rows, by_arm)
  if windows:
    analyses['windows'] = windows
  overrides = {arm.name: dict(arm.overrides) for arm in exp.arms}
  return {
      'experiment': exp.name,
      'title': exp.title,
      'question': exp.question,
      'complete': sweep_out['complete'],
      'quick': bool(sweep_out.get('quick')),
      'buckets': rows[0]['measures']['buckets'] if rows else [],
      'settings': stated_settings(rows[0]['config']) if rows else {},
      'budget': sweep_out['budget'],
      'arms': _arms(by_arm, rows),
      'claims': claims,
      'multiplicity': {
          'method': 'holm',
          'claims_tested': len(tested),
          'alpha': 0.05,
          'verdicts_changed': sum(
              claim['verdict_holm'] != claim['verdict'] for claim in tested
          ),
      },
      'profiles': _profiles(exp, by_arm),
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


def _arms(
    by_arm: Mapping[str, Any], rows: list[Mapping[str, Any]]
) -> dict[str, Any]:
  """arm -> {seeds[, scalars, vectors, corpus, tokenizer]} (intervals over
  seeds)."""
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
        name: paired.t_interval(list(_values(runs, name).values())).as_dict()
        for name in names('scalars')
    }
    entry['vectors'] = {
        name: _intervals(_vectors(runs, name, list(runs)))
        for name in names('vectors')
    }
    entry['corpus'] = settings[arm]['corpus']
    entry['tokenizer'] = settings[arm]['tokenizer']
  return out


def _claims(
    exp: ml_collections.ConfigDict, by_arm: Mapping[str, Any]
) -> list[dict[str, Any]]:
  claims = []
  for claim in exp.claims:
    if claim.arm not in by_arm:
      continue
    if claim.baseline and claim.baseline not in by_arm:
      continue
    arm_values = _values(by_arm[claim.arm], claim.metric)
    if claim.baseline:
      baseline_values = _values(by_arm[claim.baseline], claim.metric)
    else:
      baseline_values = dict.fromkeys(arm_values, 0.0)
    judged = paired.judge(
        arm_values, baseline_values, claim.direction, claim.margin
    )
    claims.append(
        {
            'id': claim.id,
            'text': claim.text,
            'metric': claim.metric,
            'arm': claim.arm,
            'baseline': claim.baseline,
            'direction': claim.direction,
            'margin': claim.margin,
            **judged,
        }
    )
  return claims


def _profiles(
    exp: ml_collections.ConfigDict, by_arm: Mapping[str, Any]
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
        shared = sorted(set(by_arm[arm]) & set(by_arm[baseline]))
        if arm != baseline and shared:
          differences[arm] = _intervals(
              _vectors(by_arm[arm], profile.metric, shared)
              - _vectors(by_arm[baseline], profile.metric, shared)
          )
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
    rows: list[Mapping[str, Any]], arms: Iterable[str]
) -> dict[str, Any]:
  """The windows' provenance and the last bucket's rise per window group and
  arm."""
  # (arm, results.json) of every finished run that has one.
  results = []
  for row in rows:
    path = os.path.join(row['run_dir'], sweep.EVAL_DIR, 'results.json')
    if os.path.exists(path):
      results.append((row['arm'], measures.load_json(path)))
  if not results or 'windows' not in results[0][1]:
    return {}
  first_results = results[0][1]
  rise = {}
  for name in eval_report.GROUP_TABLES[1:]:
    first = first_results.get(name) or []
    labels = [group['group'] for group in first]
    # arm -> group label -> the rise of each run.
    per_arm: dict[str, dict[str, list[float]]] = {
        arm: {label: [] for label in labels} for arm in arms
    }
    for arm, run_results in results:
      for group in run_results.get(name) or []:
        if group['group'] not in labels:
          continue
        losses = [row['loss'] for row in group['buckets'][-2:]]
        if len(losses) == 2 and None not in losses:
          per_arm[arm][group['group']].append(losses[1] - losses[0])
    rise[name] = {
        'groups': [
            f"{group['group']} ({group['windows']} windows,"
            f" {group['documents']} docs)"
            for group in first
        ],
        'arms': {
            arm: [
                paired.t_interval(by_label[label]).as_dict() for label in labels
            ]
            for arm, by_label in per_arm.items()
            if any(by_label.values())
        },
    }
  return {'summary': first_results['windows'], 'rise': rise}


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
    )
    made.append((profile['title'], name))
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


def _most_seeds(summary: Mapping[str, Any]) -> int:
  """The most seeds any arm finished."""
  arms = summary['arms'].values()
  return max((len(entry['seeds']) for entry in arms), default=0)


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
  windows = summary['analyses'].get('windows')
  if windows:
    lines += [
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
            'Last bucket minus the bucket before it, by window group (mean over'
            ' seeds [95% CI]): a rise at every depth and far from the document'
            ' end is a position effect; a rise only near the end comes from'
            " documents' endings."
        ),
        '',
    ]
    titles = {
        'by_depth': 'window start (tokens into the document)',
        'by_end': "tokens from the window's end to the document's end",
    }
    for name, table in windows['rise'].items():
      lines += [f'### By {titles.get(name, name)}', '']
      rows = ([arm, *rises] for arm, rises in table['arms'].items())
      lines += _md_table(['arm', *table['groups']], rows)
      lines += ['']
  lines += ['## Figures', '']
  for title, file_name in figures:
    lines += [f'![{title}]({file_name})', '']
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
  lines += [
      (
          '- Intervals: 95% Student-t over seeds (mean [low, high]). Verdict'
          ' rule, fixed before running: a directional claim is *supported* when'
          ' the interval of the paired difference (arm - baseline) excludes 0'
          ' in the predicted direction, *contradicted* when it excludes 0 the'
          ' other way, else *inconclusive at this scale*; an "equivalent" claim'
          ' is supported when the interval lies inside ±margin, contradicted'
          ' when it lies wholly outside.'
      ),
      '',
  ]
  return lines


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
            claim['interval']['n'],
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
          'n',
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
