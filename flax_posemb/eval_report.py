"""An evaluation's files and tables, comparison of runs (docs/DESIGN.md
"Evaluation outputs")."""

from collections.abc import Sequence
import json
import math
import os
from typing import Any

import numpy as np

from flax_posemb import buckets as buckets_lib
from flax_posemb import outputs
from flax_posemb import plots

# Every file an evaluation directory can hold, the completion marker first.
OUTPUT_FILES = (
    'results.json',
    'per_position.npz',
    'windows.npz',
    'buckets.csv',
    'groups.csv',
    'loss_by_position.png',
    'offsets.csv',
    'offsets.png',
)
CSV_COLUMNS = (
    'start',
    'end',
    'tokens',
    'windows',
    'documents',
    'loss',
    'stderr',
    'ci95_lo',
    'ci95_hi',
    'bits_per_token',
    'bayes_loss',
    'filter_loss',
    'excess_loss',
    'recovered',
)
# results.json keys of the window groups
GROUP_TABLES = ('by_kind', 'by_depth', 'by_end')
PM_NOTE = 'loss in nats per token +- one clustered standard error'


def _fmt(x: float | None, nd: int = 4) -> str:
  return '-' if x is None else f'{x:.{nd}f}'


def format_table(results: dict[str, Any]) -> str:
  """Plain-text bucket table of a results dict."""
  bs, cols = results['buckets'], [
      ('loss', 'loss', 8, 4),
      ('stderr', 'stderr', 8, 4),
  ]
  if bs and 'bayes_loss' in bs[0]:  # synthetic references
    cols += [
        ('bayes', 'bayes_loss', 8, 4),
        ('filter', 'filter_loss', 8, 4),
        ('excess', 'excess_loss', 8, 4),
        ('recov', 'recovered', 7, 3),
    ]
  o, d = results['overall'], results['degradation']
  docs = f", {o['documents']} documents" if 'documents' in o else ''
  heads = ['tokens'] + [c[0] for c in cols]
  columns = [[b['tokens'] for b in bs]] + [
      [_fmt(b[k], nd) for b in bs] for _, k, _, nd in cols
  ]
  return '\n'.join(
      [
          _grid('bucket', bs, heads, columns, [8] + [c[2] for c in cols]),
          (
              f"overall loss {_fmt(o['loss'])} +- {_fmt(o['stderr'])}"
              f" nats/token ({o['tokens']} tokens, {o['windows']}"
              f' windows{docs}); losses in'
              ' nats per token, +- one clustered standard error'
          ),
          (
              f"last - best bucket {_fmt(d['last_minus_best'])} +-"
              f" {_fmt(d['last_minus_best_stderr'])}; second-half slope"
              f" {_fmt(d['slope'], 6)} +- {_fmt(d['slope_stderr'], 6)}"
              ' per position'
          ),
      ]
  )


def format_results(results: dict[str, Any]) -> str:
  """The bucket table, then the windows' provenance and loss per window group
  (each `GROUP_TABLES` entry with two groups or more), then the offset probe's
  loss by context-length bucket (rows) for each offset K (columns), where
  recorded."""
  text = [format_table(results)]
  if results.get('windows'):
    text.append(format_windows(results['windows']))
    groups = [t for t in GROUP_TABLES if len(results.get(t) or []) > 1]
    for t in groups:
      heads = [
          f"{g['group']} ({g['windows']}w/{g['documents']}d)"
          for g in results[t]
      ]
      text.append(
          _grid(
              t,
              results['buckets'],
              heads,
              [_cells(g['buckets']) for g in results[t]],
              max([17] + [len(h) + 1 for h in heads]),
          )
      )
    text += (
        [PM_NOTE + '; columns: group (windows w / documents d)']
        if groups
        else []
    )
  if probe := results.get('offset_probe'):
    by = probe['by_offset']
    text.append(
        _grid(
            'context',
            by[0]['buckets'],
            [f"K={r['offset']}" for r in by],
            [_cells(r['buckets']) for r in by],
            16,
        )
        + f"\n{PM_NOTE}. {probe['note']}"
    )
  return '\n\n'.join(text)


def json_safe(x: Any) -> Any:
  """Replaces nan/inf floats by None and numpy scalars by Python numbers,
  recursively."""
  if isinstance(x, dict):
    return {k: json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_safe(v) for v in x]
  x = x.item() if isinstance(x, np.generic) else x
  return None if isinstance(x, float) and not math.isfinite(x) else x


def _write_csv(path: str, rows: list[Sequence[Any]]) -> str:
  """Writes ``rows`` comma-separated, one a line, None as an empty cell; returns
  ``path``."""
  with outputs.atomic_write(path, 'w') as f:
    f.writelines(
        ','.join('' if v is None else str(v) for v in row) + '\n'
        for row in rows
    )
  return path


def _bucket_csv(
    path: str, head: tuple[str, ...], tables: list[tuple[tuple, list]]
) -> str:
  """Writes ``head`` + `CSV_COLUMNS` and, per (prefix values, bucket rows), one
  line a row."""
  rows = [head + CSV_COLUMNS]
  for prefix, buckets in tables:
    for b in buckets:
      b = dict(b, ci95_lo=b['ci95'][0], ci95_hi=b['ci95'][1])
      rows.append([*prefix, *(b.get(k) for k in CSV_COLUMNS)])
  return _write_csv(path, rows)


def write_outputs(
    results: dict[str, Any],
    per_position: dict[str, np.ndarray],
    out_dir: str,
    title: str,
    per_window: dict[str, np.ndarray],
) -> dict[str, str]:
  """Writes an evaluation's files into ``out_dir`` at once; returns their paths
  by kind."""
  files, probe = {}, results.get('offset_probe')
  with outputs.replace_files(out_dir, OUTPUT_FILES) as stage:
    path = lambda name: os.path.join(stage, name)  # noqa: E731
    for key, name, arrays in (
        ('npz', 'per_position.npz', per_position),
        ('windows', 'windows.npz', per_window),
    ):
      with outputs.atomic_write(path(name)) as f:
        np.savez(f, **arrays)
      files[key] = path(name)
    files['csv'] = _bucket_csv(
        path('buckets.csv'), (), [((), results['buckets'])]
    )
    if results.get('by_depth') is not None:
      files['groups_csv'] = _bucket_csv(
          path('groups.csv'),
          ('table', 'group'),
          [
              ((t, g['group']), g['buckets'])
              for t in GROUP_TABLES
              for g in results[t]
          ],
      )
    files['plot'] = plots.loss_by_position(
        per_position, results, path('loss_by_position.png'), title
    )
    if probe:
      files['offsets_csv'] = _bucket_csv(
          path('offsets.csv'),
          ('offset',),
          [((r['offset'],), r['buckets']) for r in probe['by_offset']],
      )
      files['offsets_plot'] = plots.offset_probe(probe, path('offsets.png'))
    # last: its presence means the directory is complete
    files['json'] = path('results.json')
    with outputs.atomic_write(files['json'], 'w') as f:
      json.dump(json_safe(results), f, indent=1)
  return {
      k: os.path.join(out_dir, os.path.basename(v)) for k, v in files.items()
  }


def format_windows(summary: dict[str, Any]) -> str:
  """Markdown table of where the windows come from (results.json 'windows')."""
  t, share = summary['window_len'], summary['long_doc_share']
  lines = [
      (
          f"{summary['windows']} windows of {t + 1} tokens from"
          f" {summary['documents']} documents;"
          f" {'-' if share is None else f'{share:.0%}'} in documents of >="
          f" {4 * t} tokens (4T); {summary['first_window_overlaps']} start"
          f' before token {t} (T).'
      ),
      '',
      '| kind | windows | documents |',
      '|---|---:|---:|',
  ]
  lines += [
      f"| {k} | {v['windows']} | {v['documents']} |"
      for k, v in summary['kinds'].items()
  ]
  names = list(buckets_lib.QUANTILES)
  lines += [
      '',
      '| tokens | ' + ' | '.join(names) + ' |',
      '|---' + '|---:' * len(names) + '|',
  ]
  for key, what in (
      ('start', 'start in document'),
      ('to_end', 'after window to doc end'),
  ):
    if summary[key]:
      lines.append(
          f'| {what} | '
          + ' | '.join(f'{summary[key][n]:.0f}' for n in names)
          + ' |'
      )
  return '\n'.join(lines)


def _cells(
    rows: list[dict[str, Any]], key: str = 'loss', sign: str = ''
) -> list[str]:
  return [
      '-' if r[key] is None else f"{r[key]:{sign}.4f}+-{_fmt(r['stderr'])}"
      for r in rows
  ]


def _grid(
    corner: str,
    spans: list[dict],
    heads: list[str],
    columns: list[list[Any]],
    width: int | list[int],
) -> str:
  """Text table: bucket spans down, ``heads`` across, ``width`` wide (one, or
  one a column)."""
  widths = [13] + ([width] * len(heads) if isinstance(width, int) else width)
  rows = [[corner, *heads]] + [
      [f"[{b['start']}, {b['end']})"] + [c[i] for c in columns]
      for i, b in enumerate(spans)
  ]
  return '\n'.join(
      ' '.join(f'{v:>{w}}' for v, w in zip(row, widths)) for row in rows
  )


def compare(
    labels: Sequence[str],
    results: Sequence[dict[str, Any]],
    out_dir: str,
    per_window: Sequence[dict[str, np.ndarray]] | None = None,
) -> dict[str, Any]:
  """Each run's bucket losses and, with ``per_window`` (windows.npz), each run
  minus the first paired over their windows: {'files', 'table', 'paired'}."""
  spans = [[(b['start'], b['end']) for b in r['buckets']] for r in results]
  for label, s in zip(labels[1:], spans[1:]):
    if s != spans[0]:
      raise ValueError(
          f'runs {labels[0]!r} and {label!r} were evaluated on different'
          f' windows / buckets (last bucket ends at {spans[0][-1][1]} vs'
          f' {s[-1][1]}); compare runs of equal context length, or pass the'
          ' same --bucket_edges covering the shorter window.'
      )
  paired = [
      {
          'label': label,
          'minus': labels[0],
          'buckets': buckets_lib.paired_difference(
              w, per_window[0], (label, labels[0])
          ),
      }
      for label, w in zip(labels[1:], (per_window or [])[1:])
  ]
  rows = [
      dict(
          start=a,
          end=b,
          **{
              label: {
                  k: r['buckets'][i].get(k)
                  for k in ('loss', 'stderr', 'excess_loss', 'recovered')
              }
              for label, r in zip(labels, results)
          },
      )
      for i, (a, b) in enumerate(spans[0])
  ]
  summary = {
      'runs': [
          {
              'label': label,
              'step': r.get('step'),
              'workdir': r.get('workdir'),
              'overall': r['overall'],
              'degradation': r['degradation'],
          }
          for label, r in zip(labels, results)
      ],
      'buckets': rows,
      'paired': paired,
  }
  files = {k: os.path.join(out_dir, f'comparison.{k}') for k in ('json', 'csv')}
  with outputs.atomic_write(files['json'], 'w') as f:
    json.dump(json_safe(summary), f, indent=1)
  head = ['start', 'end'] + [
      f'{label}_{k}' for label in labels for k in ('loss', 'stderr')
  ]
  head += [
      f'{p["label"]}_minus_{p["minus"]}_{k}'
      for p in paired
      for k in ('diff', 'stderr')
  ]
  _write_csv(
      files['csv'],
      [head]
      + [
          [row['start'], row['end']]
          + [row[label][k] for label in labels for k in ('loss', 'stderr')]
          + [p['buckets'][i][k] for p in paired for k in ('diff', 'stderr')]
          for i, row in enumerate(rows)
      ],
  )
  files['plot'] = plots.comparison(
      labels, results, os.path.join(out_dir, 'comparison.png'), paired=paired
  )
  diffs = [_cells(p['buckets'], 'diff', '+') for p in paired]
  text = [
      _grid(
          'bucket',
          rows,
          list(labels) + [f'{p["label"]}-{p["minus"]}' for p in paired],
          [_cells([row[label] for row in rows]) for label in labels] + diffs,
          max(16, max(len(label) for label in labels) + 1),
      )
  ]
  text.append(
      '; '.join(
          f"{label}: last-best {_fmt(r['degradation']['last_minus_best'])} +- "
          f"{_fmt(r['degradation']['last_minus_best_stderr'])}"
          for label, r in zip(labels, results)
      )
      + ' (losses in nats per token +- stderr)'
  )
  if paired:
    text.append(
        'differences: paired over the shared windows (+- stderr; 95% t'
        ' intervals in comparison.json)'
    )
  return {'files': files, 'table': '\n'.join(text), 'paired': paired}
