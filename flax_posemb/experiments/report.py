"""Aggregates a sweep into ``summary.json`` and writes ``REPORT.md`` with inline plots.

Every number in the report is a mean over seeds with its 95% Student-t interval (``paired``);
claims use the paired difference per seed and the verdict rule fixed in the experiment config.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import ml_collections
import numpy as np

from flax_posemb import eval_report
from flax_posemb.experiments import measures, paired, scales, sweep

# Per-arm scalars shown in the arm table of the report (others are in summary.json).
TABLE_SCALARS = ('final_loss', 'loss_late_minus_early', 'excess_late', 'recovered_late',
                 'exposure_late_over_early', 'update_late_over_early', 'drift_late',
                 'tokens_per_step', 'train_seconds', 'step_seconds')


def _finite(x: float) -> bool:
  return x is not None and isinstance(x, (int, float)) and math.isfinite(x)


def fmt(x: Any, nd: int = 4) -> str:
  if not _finite(x):
    return 'n/a'
  if x != 0 and (abs(x) >= 1e4 or abs(x) < 10 ** -nd):
    return f'{x:.{max(nd - 1, 1)}e}'
  return f'{x:.{nd}f}'


def fmt_interval(iv: Mapping[str, Any], nd: int = 4) -> str:
  if not _finite(iv.get('mean')):
    return 'n/a'
  if not _finite(iv.get('low')):
    return f"{fmt(iv['mean'], nd)} (n={iv['n']})"
  return f"{fmt(iv['mean'], nd)} [{fmt(iv['low'], nd)}, {fmt(iv['high'], nd)}]"


def aggregate(exp: ml_collections.ConfigDict, sweep_out: Mapping[str, Any]) -> dict[str, Any]:
  """The machine-readable summary of a sweep (JSON-ready).

  Args:
    exp: experiment config.
    sweep_out: ``sweep.run_sweep`` output.

  Returns:
    ``{experiment, arms: {arm: {scalars: {name: interval}, vectors: {name: [interval per
    bucket]}, seeds}}, claims: [...], profiles: [...], analyses: {...}, budget, settings}``.
  """
  rows = [r for r in sweep_out['runs'] if r['done']]
  arm_names = []
  for r in sweep_out['runs']:
    if r['arm'] not in arm_names:
      arm_names.append(r['arm'])
  per_arm: dict[str, dict[int, dict[str, Any]]] = {a: {} for a in arm_names}
  for r in rows:
    per_arm[r['arm']][r['seed']] = r['measures']
  arms_out = {}
  buckets = rows[0]['measures']['buckets'] if rows else []
  for a in arm_names:
    seeds = sorted(per_arm[a])
    ms = [per_arm[a][s] for s in seeds]
    scalar_names = sorted({k for m in ms for k in m['scalars']})
    scal = {k: paired.t_interval([m['scalars'].get(k, float('nan')) for m in ms]).as_dict()
            for k in scalar_names}
    vec_names = sorted({k for m in ms for k in m['vectors']})
    vecs = {}
    for k in vec_names:
      mat = np.array([m['vectors'][k] for m in ms], dtype=np.float64)
      vecs[k] = [paired.t_interval(mat[:, j]).as_dict() for j in range(mat.shape[1])]
    arms_out[a] = {'seeds': seeds, 'scalars': scal, 'vectors': vecs}

  def values(arm: str, metric: str) -> dict[int, float]:
    return {s: m['scalars'].get(metric, float('nan')) for s, m in per_arm.get(arm, {}).items()}

  claims = []
  for c in exp.claims:
    if c.arm not in per_arm or (c.baseline and c.baseline not in per_arm):
      continue
    av = values(c.arm, c.metric)
    bv = values(c.baseline, c.metric) if c.baseline else {s: 0.0 for s in av}  # '' = zero.
    j = paired.judge(av, bv, c.direction, c.margin)
    claims.append({'id': c.id, 'text': c.text, 'metric': c.metric, 'arm': c.arm,
                   'baseline': c.baseline, 'direction': c.direction, 'margin': c.margin, **j})
  profiles = []
  for p in exp.profiles:
    present = [a for a in p.arms if a in per_arm and per_arm[a]]
    if not present:
      continue
    prof = {'metric': p.metric, 'title': p.title, 'arms': present, 'baseline': p.baseline,
            'differences': {}}
    if p.baseline in per_arm and per_arm[p.baseline]:
      for a in present:
        if a == p.baseline:
          continue
        shared = sorted(set(per_arm[a]) & set(per_arm[p.baseline]))
        if not shared:
          continue
        d = np.array([np.array(per_arm[a][s]['vectors'][p.metric], np.float64)
                      - np.array(per_arm[p.baseline][s]['vectors'][p.metric], np.float64)
                      for s in shared])
        prof['differences'][a] = [paired.t_interval(d[:, j]).as_dict() for j in range(d.shape[1])]
    profiles.append(prof)
  analyses = {}
  if 'cosine_convergence' in exp.analyses:
    analyses['cosine_convergence'] = _convergence(exp, sweep_out)
  first = rows[0]['config'] if rows else None
  return {
      'experiment': exp.name, 'title': exp.title, 'question': exp.question,
      'complete': sweep_out['complete'], 'buckets': buckets,
      'settings': scales.stated_settings(first) if first is not None else {},
      'budget': sweep_out['budget'], 'arms': arms_out, 'claims': claims,
      'profiles': profiles, 'analyses': analyses,
      'runs': [{'arm': r['arm'], 'seed': r['seed'], 'key': r['key'], 'done': r['done'],
                'overrides': dict(_arm(exp, r['arm']).overrides)} for r in sweep_out['runs']],
  }


def _arm(exp: ml_collections.ConfigDict, name: str) -> ml_collections.ConfigDict:
  return next(a for a in exp.arms if a.name == name)


def _convergence(exp: ml_collections.ConfigDict, sweep_out: Mapping[str, Any]) -> dict[str, Any]:
  groups = sweep.seed_groups(sweep_out['runs'])
  per_seed = {s: measures.convergence_step(g, float(exp.convergence_threshold))
              for s, g in groups.items() if len(g) >= 2}
  if not per_seed:
    return {}
  steps = min((v['steps'] for v in per_seed.values()), key=len)
  curves = np.array([v['agreement'][:len(steps)] for v in per_seed.values()], np.float64)
  return {
      'threshold': float(exp.convergence_threshold), 'steps': steps,
      'agreement': [paired.t_interval(curves[:, j]).as_dict() for j in range(len(steps))],
      'converged_step': paired.t_interval([v['converged_step'] for v in per_seed.values()
                                           ]).as_dict(),
      'never_converged_seeds': [s for s, v in per_seed.items()
                                if not math.isfinite(v['converged_step'])],
  }


def _plots(summary: Mapping[str, Any], out_dir: str) -> list[tuple[str, str]]:
  from flax_posemb import plots  # pylint: disable=g-import-not-at-top
  made = []
  labels = [f'{a}-{b}' for a, b in summary['buckets']]
  for i, p in enumerate(summary['profiles']):
    name = f'profile_{i}_{p["metric"]}.png'
    series = {a: summary['arms'][a]['vectors'][p['metric']] for a in p['arms']}
    plots.experiment_profile(os.path.join(out_dir, name), labels, series,
                             differences=p['differences'], baseline=p['baseline'],
                             title=p['title'], ylabel=p['metric'])
    made.append((p['title'], name))
  arms = list(summary['arms'])
  name = 'final_loss.png'
  plots.experiment_metric_bars(os.path.join(out_dir, name),
                               {a: summary['arms'][a]['scalars'].get('final_loss', {})
                                for a in arms}, ylabel='held-out loss (nats/token)',
                               title=f'{summary["experiment"]}: final loss per arm')
  made.append(('Final held-out loss per arm', name))
  conv = summary['analyses'].get('cosine_convergence')
  if conv:
    name = 'cosine_convergence.png'
    plots.experiment_curve(os.path.join(out_dir, name), conv['steps'], conv['agreement'],
                           threshold=conv['threshold'], xlabel='training step',
                           ylabel='cross-init agreement of cosine structure',
                           title='Do the inits converge to one similarity structure?')
    made.append(('Cross-init agreement of the cosine-similarity structure', name))
  return made


def write(exp: ml_collections.ConfigDict, sweep_out: Mapping[str, Any], out_dir: str,
          command: str) -> dict[str, Any]:
  """Writes ``summary.json``, the plots and ``REPORT.md`` into ``out_dir``.

  Args:
    exp: experiment config.
    sweep_out: ``sweep.run_sweep`` output.
    out_dir: report directory (created).
    command: the exact command that produced the sweep.

  Returns:
    The summary dict.
  """
  os.makedirs(out_dir, exist_ok=True)
  summary = aggregate(exp, sweep_out)
  summary['command'] = command
  figures = _plots(summary, out_dir)
  summary['figures'] = [f for _, f in figures]
  with open(os.path.join(out_dir, 'summary.json'), 'w') as f:
    json.dump(eval_report.json_safe(summary), f, indent=1)
  with open(os.path.join(out_dir, 'REPORT.md'), 'w') as f:
    f.write(markdown(exp, summary, figures))
  return summary


def markdown(exp: ml_collections.ConfigDict, summary: Mapping[str, Any],
             figures: list[tuple[str, str]]) -> str:
  """The REPORT.md text."""
  s = summary['settings']
  b = summary['budget']
  n_seeds = max((len(v['seeds']) for v in summary['arms'].values()), default=0)
  lines = [f'# {summary["title"]}', '', summary['question'], '']
  if not summary['complete']:
    lines += ['**Partial sweep:** some runs have not finished; numbers use the finished '
              'seeds only.', '']
  lines += ['## Setup', '',
            f'- Command: `{summary["command"]}`',
            f'- Corpus: {s.get("corpus")} (tokenizer: {s.get("tokenizer")}), context '
            f'{s.get("seq_len")}; model: {s.get("model")}.',
            f'- Token-embedding init: `{s.get("token_init")}` (std {fmt(s.get("token_init_std"))}); '
            f'Adam beta2 = {s.get("beta2")}; weight decay {s.get("weight_decay")}, applied to the '
            f'position table: {s.get("decay_position_table")} (unless an arm overrides these).',
            f'- {n_seeds} seed(s) per arm, paired: seed s of every arm shares the model-init and '
            f'data-order seed. {s.get("num_train_steps")} optimizer steps for every arm.']
  if b['mode'] == 'real_tokens':
    lines.append(
        f'- Budget: same steps and same scored (unmasked) tokens per step. Each arm\'s rows '
        f'per step = round({fmt(b["target_tokens_per_step"], 1)} / its measured scored tokens '
        f'per row); reference arm `{b["reference"]}`. Rows per step: '
        + ', '.join(f'{a} {n} ({fmt(b["per_row"][a], 1)}/row)' for a, n in b['batch_size'].items())
        + '. Tokens actually scored per step are in the arm table.')
  else:
    lines.append('- Budget: same steps and rows per step for every arm (not token-equalized); '
                 'tokens actually scored per step are in the arm table.')
  lines += ['- Intervals: 95% Student-t over seeds (mean [low, high]). Verdict rule, fixed '
            'before running: a directional claim is *supported* when the interval of the paired '
            'difference (arm - baseline) excludes 0 in the predicted direction, *contradicted* '
            'when it excludes 0 the other way, else *inconclusive at this scale*; an '
            '"equivalent" claim is supported when the interval lies inside ±margin, '
            'contradicted when it lies wholly outside.', '']
  lines += ['## Claims', '', '| claim | metric | arm - baseline | predicted | difference '
            '[95% CI] | n | verdict |', '|---|---|---|---|---|---|---|']
  for c in summary['claims']:
    pred = (f'|d| < {c["margin"]}' if c['direction'] == 'equivalent'
            else '> 0' if c['direction'] == 'greater' else '< 0')
    lines.append(f'| {c["text"]} | `{c["metric"]}` | {c["arm"]} - {c["baseline"] or "0"} | {pred} | '
                 f'{fmt_interval(c["interval"])} | {c["interval"]["n"]} | **{c["verdict"]}** |')
  lines += ['', '## Arms', '', 'Wall-clock cost: `train_seconds` is the whole training of a '
            'run (compilation included; runs of a shape already compiled load it from the '
            'persistent cache), `step_seconds` the steady-state seconds per step (logging '
            'windows after the first). Both are wall-clock on the machine that ran the sweep.',
            '', '| arm | ' + ' | '.join(TABLE_SCALARS) + ' |',
            '|---|' + '---|' * len(TABLE_SCALARS)]
  for a, v in summary['arms'].items():
    cells = [fmt_interval(v['scalars'].get(k, {}), 3) for k in TABLE_SCALARS]
    lines.append(f'| {a} | ' + ' | '.join(cells) + ' |')
  lines.append('')
  extra = tuple(exp.report_scalars)
  if extra:
    lines += ['| arm | ' + ' | '.join(extra) + ' |', '|---|' + '---|' * len(extra)]
    for a, v in summary['arms'].items():
      lines.append(f'| {a} | ' + ' | '.join(fmt_interval(v['scalars'].get(k, {}), 3)
                                             for k in extra) + ' |')
    lines.append('')
  for p in summary['profiles']:
    lines += [f'### {p["title"]} (per position bucket)', '',
              '| arm | ' + ' | '.join(f'{x}-{y}' for x, y in summary['buckets']) + ' |',
              '|---|' + '---|' * len(summary['buckets'])]
    for a in p['arms']:
      lines.append(f'| {a} | ' + ' | '.join(fmt_interval(iv, 3) for iv in
                                             summary['arms'][a]['vectors'][p['metric']]) + ' |')
    for a, d in p['differences'].items():
      lines.append(f'| {a} - {p["baseline"]} | ' + ' | '.join(fmt_interval(iv, 3) for iv in d)
                   + ' |')
    lines.append('')
  conv = summary['analyses'].get('cosine_convergence')
  if conv:
    lines += ['### Convergence of the similarity structure across inits', '',
              f'First logged step from which the mean pairwise correlation of the inits\' '
              f'row cosine-similarity matrices stays >= {conv["threshold"]}: '
              f'{fmt_interval(conv["converged_step"], 0)} '
              f'(seeds that never converged: {conv["never_converged_seeds"] or "none"}).', '']
  lines += ['## Figures', '']
  for title, name in figures:
    lines += [f'![{title}]({name})', '']
  lines += ['## Configs', '', 'Arms (dotted overrides of the shared base config):', '']
  for a in exp.arms:
    if a.name in summary['arms']:
      lines.append(f'- `{a.name}`: ' + (', '.join(f'`{k}={v!r}`' for k, v in a.overrides)
                                         or 'base config'))
  lines += ['', 'Every run\'s full resolved config is in `config.json` / `run.json` of its run '
            'directory; `summary.json` holds every measure per arm.', '']
  return '\n'.join(lines)
