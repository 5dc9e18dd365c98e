"""The REPORT.md text of a sweep's summary (docs/DESIGN.md § Experiments
outputs; the methodology is described there once, and the report links to
it)."""

from collections.abc import Iterable, Mapping
import math
import os
from typing import Any

import ml_collections

from flax_posemb import eval_report
from flax_posemb import inference
from flax_posemb.experiments import aggregate

# The one description of the intervals and the verdict rule, docs/DESIGN.md §
# Intervals and verdicts, and its anchor: reports link to it, never copy it.
DESIGN = os.path.join(
    os.path.dirname(
        os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ),
    'docs',
    'DESIGN.md',
)
METHODS = 'intervals-and-verdicts'
_RULE_LINK = 'docs/DESIGN.md § Intervals and verdicts'
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


def md_table(header: list[str], rows: Iterable[list[Any]]) -> list[str]:
  """Markdown table lines; a dict cell is an interval (``fmt_interval(cell,
  3)``); a "|" inside a cell is escaped (an equivalence's ``|d| < m`` would
  otherwise split its cell)."""
  lines = []
  for row in [header, ['---'] * len(header), *rows]:
    cells = [
        fmt_interval(cell, 3) if isinstance(cell, dict) else str(cell)
        for cell in row
    ]
    escaped = [cell.replace('|', '\\|') for cell in cells]
    lines.append('| ' + ' | '.join(escaped) + ' |')
  return lines


def markdown(
    exp: ml_collections.ConfigDict,
    summary: Mapping[str, Any],
    figures: list[tuple[str, str]],
    report_dir: str = '.',
) -> str:
  """The REPORT.md text.

  Args:
    exp: the experiment's spec.
    summary: `aggregate.aggregate`'s summary, with the ``command``.
    figures: (title, file name) of each figure, in ``report_dir``.
    report_dir: where REPORT.md is written (its link to docs/DESIGN.md §
      Intervals and verdicts is relative to it).

  Returns:
    The Markdown text.
  """
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
      _setup_lines(summary, report_dir)
      + _claims_lines(summary)
      + _arms_lines(exp, summary)
  )
  lines += _profile_lines(summary)
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


def _over_line(rows: Iterable[Iterable[Any]]) -> str:
  """What a table's intervals are over (those of its first measured cell)."""
  for row in rows:
    for cell in row:
      if isinstance(cell, dict) and _finite(cell.get('mean')):
        return f'Intervals: 95% over {_interval_over(cell)}.'
  return 'Intervals: none measured (n/a).'


def _profile_lines(summary: Mapping[str, Any]) -> list[str]:
  """Every arm's loss by bucket and each claimed pair's paired difference by
  bucket: where a contrast's change comes from."""
  arms = summary['arms']
  buckets = [f'{start}-{end}' for start, end in summary['buckets']]
  measured = [arm for arm, entry in arms.items() if entry['seeds']]
  own = [
      [arm, *arms[arm]['vectors'].get('bucket_loss', [{}] * len(buckets))]
      for arm in measured
  ]
  lines = [
      '## Per-bucket profile',
      '',
      (
          "Each arm's held-out loss by position bucket (the attribution of"
          ' every contrast of two buckets: which bucket moved).'
      ),
      '',
      *md_table(['arm', *buckets], own),
      '',
      _over_line(row[1:] for row in own),
      '',
  ]
  pairs = summary.get('attribution', [])
  if not pairs:
    return lines
  paired = [
      [
          f'{pair["arm"]} - {pair["baseline"]}',
          *(pair['differences'] or [{}] * len(buckets)),
      ]
      for pair in pairs
  ]
  lines += [
      (
          'Paired difference in held-out loss, arm - baseline, by bucket, for'
          ' every pair a claim or a dose series compares (n/a: the summary'
          ' holds no paired difference of that pair, e.g. a report written'
          ' before attribution existed).'
      ),
      '',
      *md_table(['arm - baseline', *buckets], paired),
      '',
      _over_line(row[1:] for row in paired),
      '',
  ]
  return lines


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
      *md_table(['arm', *kinds], rows),
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
    full = dose.get('late_full_context_exposure', [])
    rows = []
    for i, arm in enumerate(dose['arms']):
      late_full = full[i] if i < len(full) else float('nan')
      exposure = (
          dose['late_exposure'][i],
          late_full,
          dose['early_exposure'][i],
      )
      rows.append(
          [
              arm,
              *_exposure_cells(*exposure, dose['rare_exposure']),
              *(dose['measures'][metric][i] for metric in metrics),
          ]
      )
    table_rows = rows
    base = dose.get('baseline_exposure')
    if base:
      exposure = (base['late'], base['late_full_context'], base['early'])
      baseline_row = [
          f'{dose["baseline"]} (baseline)',
          *_exposure_cells(*exposure, dose['rare_exposure']),
          *('' for _ in metrics),
      ]
      table_rows = [baseline_row] + rows
    lines += [f'### {dose["name"]}: arm - {dose["baseline"]}', '']
    lines += md_table(
        [
            'arm',
            'late-row occurrences (all)',
            'late-row occurrences (context = position)',
            'first-bucket occurrences',
            'rare regime (all)',
            'rare regime (context = position)',
            *(f'`{metric}` [95% CI]' for metric in metrics),
        ],
        table_rows,
    )
    lines += [
        '',
        (
            f"*Rare regime*: the last bucket's rows were seen fewer than"
            f' {fmt(dose["rare_exposure"], 0)} times each and less than a tenth'
            " as often as the first bucket's (all occurrences), counted over"
            ' all occurrences and over those whose context equals their'
            " position (the evaluation's situation; n/a: runs that did not"
            ' count it). Where no arm reaches it, this experiment says nothing'
            ' about rare rows.'
        ),
        '',
        _over_line(row[6:] for row in rows),
        '',
    ]
  return lines


def _exposure_cells(
    late: float, late_full: float, early: float, threshold: float
) -> list[str]:
  """A dose row's exposure cells: late-row occurrences (all, at context =
  position), first-bucket occurrences, and the rare regime on both counts."""
  return [
      fmt(late, 1),
      fmt(late_full, 1),
      fmt(early, 1),
      _rare_cell(late, early, threshold),
      _rare_cell(late_full, early, threshold),
  ]


def _rare_cell(late: float, early: float, threshold: float) -> str:
  """'yes' / 'no' of `_rare`; 'n/a' where ``late`` was not counted."""
  if not _finite(late):
    return 'n/a'
  return 'yes' if _rare(late, early, threshold) else 'no'


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
    lines += md_table(
        ['arm', *t['groups']], ([a, *v] for a, v in t['arms'].items())
    ) + ['']
  return lines


def methodology_link(report_dir: str) -> str:
  """The link to the one description of the intervals and the verdict rule.

  Args:
    report_dir: where the report is written.

  Returns:
    A Markdown link to docs/DESIGN.md § Intervals and verdicts, relative to
    ``report_dir``.
  """
  target = os.path.relpath(DESIGN, os.path.abspath(report_dir))
  return f'[docs/DESIGN.md § Intervals and verdicts]({target}#{METHODS})'


def _setup_lines(summary: Mapping[str, Any], report_dir: str) -> list[str]:
  s = summary['settings']
  budget = summary['budget']
  n_seeds = aggregate.most_seeds(summary)
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
          '- Intervals (mean [low, high], 95%) and the verdict rule, fixed'
          f' before running: {methodology_link(report_dir)}.'
      ),
      '',
  ]
  return lines


def _interval_over(interval: Mapping[str, Any]) -> str:
  """What an interval combines: 'n seeds' or 'n seeds x g docs'."""
  if interval.get('method') == inference.SEEDS_AND_DOCUMENTS:
    return f"{interval['n']} seeds x {interval['documents']} docs"
  return f"{interval['n']} seeds"


def _count(n: int, noun: str) -> str:
  """``n`` and ``noun``, plural unless n is 1 ('1 claim', '6 claims')."""
  return f'{n} {noun}' if n == 1 else f'{n} {noun}s'


def _bucket_cell(claim: Mapping[str, Any], which: str) -> str:
  """A contrast's bucket ``which`` ('late' or 'other'): its rows and its own
  paired difference; blank for a claim on no contrast."""
  buckets = claim.get('buckets')
  if not buckets:
    return ''
  bucket = buckets[which]
  rows = '-'.join(str(x) for x in bucket['rows'])
  return f"{rows}: {fmt_interval(bucket['difference'], 3)}"


def _suite_sentence(multiplicity: Mapping[str, Any]) -> str:
  """The suite-wide Holm's sentence ('' outside a suite)."""
  suite = multiplicity.get('suite')
  if not suite:
    return ' Suite-wide Holm: n/a (this report was not written by a suite run).'
  return (
      f' Suite-wide: Holm over all {suite["claims_tested"]} tested claims of'
      f' the suite `{suite["name"]}` ({", ".join(suite["experiments"])});'
      f' `p (Holm, suite)` and the verdict after it, where it differs'
      f' ({suite["verdicts_changed"]} of the suite\'s claims do).'
  )


def _claims_lines(summary: Mapping[str, Any]) -> list[str]:
  multiplicity = summary['multiplicity']
  lines = [
      '## Claims',
      '',
      (
          f'{_count(multiplicity["claims_tested"], "claim")} tested. The'
          ' verdict is'
          " the fixed rule above, on each claim's own 95% interval."
          ' Multiplicity:'
          ' Holm-Bonferroni over all tested claims of this experiment'
          ' (family-wise error 5%); `p` is the smallest alpha at which the'
          " claim's interval is decisive, `p (Holm)` its adjusted value, and"
          ' the column after it gives the verdict after the correction where'
          f' it differs ({multiplicity["verdicts_changed"]} do).'
          + _suite_sentence(multiplicity)
      ),
      '',
      (
          'Attribution by bucket: a claim on a contrast of two buckets lists'
          " each bucket's own paired difference (arm - baseline, 95% interval"
          ' over the same seeds and documents as the claim; n/a where the'
          ' summary holds none). A claim declared about late rows (†) is'
          ' supported only if its late bucket moves too (the late-rows rule,'
          f' {_RULE_LINK}); it changed'
          f' {multiplicity.get("late_rule_changed", 0)} verdict(s) here.'
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
    verdict = f'**{claim["verdict"]}**'
    if claim.get('about_late_rows'):
      verdict += ' †'
    if claim['verdict'] != claim.get('interval_verdict', claim['verdict']):
      verdict += f' (interval alone: {claim["interval_verdict"]})'
    rows.append(
        [
            claim['text'],
            f'`{claim["metric"]}`',
            f'{claim["arm"]} - {claim["baseline"] or "0"}',
            predicted,
            fmt_interval(claim['interval']),
            _interval_over(claim['interval']),
            _bucket_cell(claim, 'late'),
            _bucket_cell(claim, 'other'),
            verdict,
            fmt(claim['p_value'], 3),
            fmt(claim['p_holm'], 3),
            _if_changed(claim, 'verdict_holm'),
            fmt(claim.get('p_holm_suite'), 3),
            _if_changed(claim, 'verdict_holm_suite'),
        ]
    )
  return lines + md_table(
      [
          'claim',
          'metric',
          'arm - baseline',
          'predicted',
          'difference [95% CI]',
          'over',
          'late bucket: arm - baseline',
          'other bucket: arm - baseline',
          'verdict',
          'p',
          'p (Holm)',
          'after Holm (if different)',
          'p (Holm, suite)',
          'after suite Holm (if different)',
      ],
      rows,
  )


def _if_changed(claim: Mapping[str, Any], key: str) -> str:
  """The claim's verdict ``key`` where it differs from its verdict."""
  after = claim.get(key)
  if after is None:
    return 'n/a'
  return '' if after == claim['verdict'] else after


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
          ' the machine that ran the sweep. Intervals: 95%, over seeds and'
          ' documents for measures of the evaluation windows (loss, excess,'
          ' recovered, offset penalty), over seeds for the others.'
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
    lines += md_table(['arm', *names], rows)
    lines += ['']
  buckets = [f'{start}-{end}' for start, end in summary['buckets']]
  for profile in summary['profiles']:
    metric = profile['metric']
    rows = [[arm, *arms[arm]['vectors'][metric]] for arm in profile['arms']]
    for arm, differences in profile['differences'].items():
      rows.append([f'{arm} - {profile["baseline"]}', *differences])
    lines += [f'### {profile["title"]} (per position bucket)', '']
    lines += md_table(['arm', *buckets], rows)
    lines += ['', _over_line(row[1:] for row in rows), '']
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
