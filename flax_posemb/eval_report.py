"""An evaluation's files and tables, comparison of runs (docs/DESIGN.md
§ Evaluation outputs)."""

from collections.abc import Sequence
import json
import math
import os
import textwrap
from typing import Any

import numpy as np

from flax_posemb import buckets as buckets_lib
from flax_posemb import defaults
from flax_posemb import outputs
from flax_posemb import plots
from flax_posemb import workdir as workdir_lib

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


# Console columns a printed table fits in; a wider one is split into blocks of
# columns.
TABLE_WIDTH = 100
# What the synthetic corpus's columns mean (printed under the bucket table).
REFERENCE_NOTE = (
    'bayes: the Bayes-optimal loss (position known); filter: the optimal'
    ' position-blind loss; excess = loss - bayes; recovered = (filter - loss) /'
    " (filter - bayes), the share of the position's value the model recovers"
    ' (1 = all of it, 0 = none).'
)
NA_NOTE = 'n/a: one document, no clustered standard error.'


def _fmt(x: float | None, nd: int = 4) -> str:
  return 'n/a' if x is None else f'{x:.{nd}f}'


def format_table(results: dict[str, Any]) -> str:
  """Plain-text bucket table of a results dict."""
  buckets = results['buckets']
  # (heading, results key, decimals)
  columns = [('loss', 'loss', 4), ('stderr', 'stderr', 4)]
  synthetic = bool(buckets) and 'bayes_loss' in buckets[0]
  if synthetic:
    columns += [
        ('bayes', 'bayes_loss', 4),
        ('filter', 'filter_loss', 4),
        ('excess', 'excess_loss', 4),
        ('recovered', 'recovered', 3),
    ]
  heads = ['tokens'] + [heading for heading, _, _ in columns]
  cells = [[str(b['tokens']) for b in buckets]]
  for _, key, decimals in columns:
    cells.append([_fmt(b[key], decimals) for b in buckets])
  overall = results['overall']
  degradation = results['degradation']
  documents = ''
  if 'documents' in overall:
    documents = f", {overall['documents']} documents"
  overall_line = (
      f"overall loss {_fmt(overall['loss'])} +- {_fmt(overall['stderr'])}"
      f" nats/token ({overall['tokens']} tokens, {overall['windows']}"
      f' windows{documents})'
  )
  degradation_line = (
      f"last - best bucket {_fmt(degradation['last_minus_best'])} +-"
      f" {_fmt(degradation['last_minus_best_stderr'])}; second-half slope"
      f" {_fmt(degradation['slope'], 6)} +-"
      f" {_fmt(degradation['slope_stderr'], 6)} per position"
  )
  lines = [
      _grid('bucket', buckets, heads, cells),
      overall_line,
      degradation_line,
      'losses in nats per token, +- one clustered standard error',
  ]
  if synthetic:
    lines.append(_wrap(REFERENCE_NOTE))
  return '\n'.join(lines)


def _wrap(text: str) -> str:
  """Prose under a table, in lines of at most `TABLE_WIDTH` characters."""
  return textwrap.fill(text, TABLE_WIDTH, break_on_hyphens=False)


def format_results(results: dict[str, Any]) -> str:
  """The bucket table, then the windows' provenance and loss per window group
  (each `GROUP_TABLES` entry with two groups or more), then the offset probe's
  loss by context-length bucket (rows) for each offset K (columns), where
  recorded."""
  text = [format_table(results)]
  if results.get('windows'):
    text.append(format_windows(results['windows']))
    tables = [t for t in GROUP_TABLES if len(results.get(t) or []) > 1]
    for table in tables:
      groups = results[table]
      heads = [str(g['group']) for g in groups]
      sizes = [f"{g['windows']}w/{g['documents']}d" for g in groups]
      cells = [_cells(g['buckets']) for g in groups]
      text.append(_grid(table, results['buckets'], heads, cells, sizes))
    if tables:
      text.append(
          _wrap(
              f'{PM_NOTE}; columns: group, then its windows w / documents d. '
              + NA_NOTE
          )
      )
  probe = results.get('offset_probe')
  if probe:
    by_offset = probe['by_offset']
    grid = _grid(
        'context',
        by_offset[0]['buckets'],
        [f"K={r['offset']}" for r in by_offset],
        [_cells(r['buckets']) for r in by_offset],
    )
    text.append(grid + '\n' + _wrap(f"{PM_NOTE}. {probe['note']}"))
  return '\n\n'.join(text)


def json_safe(x: Any) -> Any:
  """Replaces nan/inf floats by None and numpy scalars by Python numbers,
  recursively."""
  if isinstance(x, dict):
    return {k: json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_safe(v) for v in x]
  if isinstance(x, np.generic):
    x = x.item()
  if isinstance(x, float) and not math.isfinite(x):
    return None
  return x


def _write_csv(path: str, rows: Sequence[Sequence[Any]]) -> str:
  """Writes ``rows`` comma-separated, one a line, None as an empty cell; returns
  ``path``."""
  with outputs.atomic_write(path, 'w') as f:
    for row in rows:
      f.write(','.join('' if v is None else str(v) for v in row) + '\n')
  return path


def _bucket_csv(
    path: str,
    head: tuple[str, ...],
    tables: Sequence[tuple[tuple[Any, ...], Sequence[dict[str, Any]]]],
) -> str:
  """Writes ``head`` + `CSV_COLUMNS` and, per (prefix values, bucket rows), one
  line a row."""
  rows: list[Sequence[Any]] = [head + CSV_COLUMNS]
  for prefix, buckets in tables:
    for bucket in buckets:
      low, high = bucket['ci95']
      bucket = dict(bucket, ci95_lo=low, ci95_hi=high)
      rows.append([*prefix, *(bucket.get(k) for k in CSV_COLUMNS)])
  return _write_csv(path, rows)


def write_outputs(
    results: dict[str, Any],
    per_position: dict[str, np.ndarray],
    out_dir: str,
    title: str,
    per_window: dict[str, np.ndarray] | None,
) -> dict[str, str]:
  """Writes an evaluation's files into ``out_dir`` at once; returns their paths
  by kind (``per_window``: windows.npz, unless None)."""
  files = {}
  with outputs.replace_files(out_dir, OUTPUT_FILES) as stage:
    files['npz'] = outputs.save_npz(
        os.path.join(stage, 'per_position.npz'), per_position
    )
    if per_window is not None:
      files['windows'] = outputs.save_npz(
          os.path.join(stage, 'windows.npz'), per_window
      )
    files['csv'] = _bucket_csv(
        os.path.join(stage, 'buckets.csv'), (), [((), results['buckets'])]
    )
    if results.get('by_depth') is not None:
      groups = [
          ((table, g['group']), g['buckets'])
          for table in GROUP_TABLES
          for g in results[table]
      ]
      files['groups_csv'] = _bucket_csv(
          os.path.join(stage, 'groups.csv'), ('table', 'group'), groups
      )
    files['plot'] = plots.loss_by_position(
        per_position,
        results,
        os.path.join(stage, 'loss_by_position.png'),
        title,
    )
    probe = results.get('offset_probe')
    if probe:
      by_offset = [((r['offset'],), r['buckets']) for r in probe['by_offset']]
      files['offsets_csv'] = _bucket_csv(
          os.path.join(stage, 'offsets.csv'), ('offset',), by_offset
      )
      files['offsets_plot'] = plots.offset_probe(
          probe, os.path.join(stage, 'offsets.png')
      )
    # Last: its presence means the directory is complete.
    files['json'] = os.path.join(stage, 'results.json')
    with outputs.atomic_write(files['json'], 'w') as f:
      json.dump(json_safe(results), f, indent=1)
  return {
      k: os.path.join(out_dir, os.path.basename(v)) for k, v in files.items()
  }


def format_windows(summary: dict[str, Any]) -> str:
  """Markdown table of where the windows come from (results.json 'windows')."""
  t = summary['window_len']
  share = summary['long_doc_share']
  share_text = '-' if share is None else f'{share:.0%}'
  lines = [
      _wrap(
          f"{summary['windows']} windows of {t + 1} tokens from"
          f" {summary['documents']} documents; {share_text} in documents of"
          f" >= {4 * t} tokens (4T); {summary['first_window_overlaps']} start"
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
      values = ' | '.join(f'{summary[key][n]:.0f}' for n in names)
      lines.append(f'| {what} | {values} |')
  return '\n'.join(lines)


def _cells(
    rows: Sequence[dict[str, Any]], key: str = 'loss', sign: str = ''
) -> list[str]:
  """'LOSS+-STDERR' per row ('n/a' for the stderr of one document, '-' for no
  value)."""
  return [
      '-' if r[key] is None else f"{r[key]:{sign}.4f}+-{_fmt(r['stderr'])}"
      for r in rows
  ]


def _grid(
    corner: str,
    spans: Sequence[dict[str, Any]],
    heads: Sequence[str],
    columns: Sequence[Sequence[str]],
    subheads: Sequence[str] | None = None,
) -> str:
  """Text table: bucket spans down, ``heads`` (and ``subheads``, a second
  heading line) across, each column as wide as its widest entry; split into
  blocks of columns where it would be wider than `TABLE_WIDTH`."""
  names = [corner] + [f"[{b['start']}, {b['end']})" for b in spans]
  first = max(len(n) for n in names)
  blocks: list[list[int]] = [[]]
  used = first
  widths = []
  for i, cells in enumerate(columns):
    entries = [heads[i], *(subheads[i : i + 1] if subheads else []), *cells]
    width = max(len(e) for e in entries)
    widths.append(width)
    if blocks[-1] and used + 2 + width > TABLE_WIDTH:
      blocks.append([])
      used = first
    blocks[-1].append(i)
    used += 2 + width
  text = []
  for block in blocks:
    rows = [[corner] + [heads[i] for i in block]]
    if subheads:
      rows.append([''] + [subheads[i] for i in block])
    for j, name in enumerate(names[1:]):
      rows.append([name] + [columns[i][j] for i in block])
    sizes = [first] + [widths[i] for i in block]
    text.append(
        '\n'.join(
            '  '.join(f'{v:>{w}}' for v, w in zip(row, sizes)) for row in rows
        )
    )
  return '\n\n'.join(text)


def config_differences(
    labels: Sequence[str], configs: Sequence[Any]
) -> list[dict[str, Any]]:
  """``[{'field', 'values': {label: value}}]`` of the config fields whose values
  differ between the runs (not `defaults.NON_SEMANTIC`; absent: None)."""
  flat = [workdir_lib.flat_config(c) for c in configs]
  fields = sorted(set().union(*flat))
  differences = []
  for field in fields:
    if field in defaults.NON_SEMANTIC:
      continue
    values = [f.get(field) for f in flat]
    if any(v != values[0] for v in values[1:]):
      differences.append({'field': field, 'values': dict(zip(labels, values))})
  return differences


def _differences_line(differences: Sequence[dict[str, Any]]) -> str:
  """How the runs' configs differ, a few fields (all in comparison.json)."""
  if not differences:
    return 'configs: the same (every field that changes what a run computes)'
  shown = [
      d['field'] + ' ' + ' vs '.join(repr(v) for v in d['values'].values())
      for d in differences[:6]
  ]
  more = ''
  if len(differences) > 6:
    more = f'; {len(differences) - 6} more in comparison.json'
  return _wrap('configs differ: ' + '; '.join(shown) + more)


def _overall_line(paired: dict[str, Any]) -> str:
  """The overall paired difference of one run minus the first."""
  overall = paired['overall']
  name = f"{paired['label']} - {paired['minus']}"
  if overall['diff'] is None:
    return f'overall {name}: n/a (fewer than two documents)'
  low, high = overall['ci95']
  return (
      f"overall {name}: {overall['diff']:+.4f} +- {_fmt(overall['stderr'])}"
      f' nats/token (95% CI [{low:+.4f}, {high:+.4f}]; paired over'
      f" {overall['windows']} windows, {overall['documents']} documents)"
  )


def compare(
    labels: Sequence[str],
    results: Sequence[dict[str, Any]],
    out_dir: str,
    per_window: Sequence[dict[str, np.ndarray]] | None = None,
    configs: Sequence[Any] | None = None,
) -> dict[str, Any]:
  """Each run's bucket losses and, with ``per_window`` (windows.npz), each run
  minus the first paired over their windows, per bucket and overall; with
  ``configs`` how they differ: {'files', 'table', 'paired'}."""
  spans = [[(b['start'], b['end']) for b in r['buckets']] for r in results]
  for label, s in zip(labels[1:], spans[1:]):
    if s != spans[0]:
      raise ValueError(
          f'runs {labels[0]!r} and {label!r} were evaluated on different'
          f' windows / buckets (last bucket ends at {spans[0][-1][1]} vs'
          f' {s[-1][1]}); compare runs of equal context length, or pass the'
          ' same --bucket_edges covering the shorter window.'
      )
  paired: list[dict[str, Any]] = []
  if per_window:
    for label, windows in zip(labels[1:], per_window[1:]):
      names = (label, labels[0])
      buckets = buckets_lib.paired_difference(windows, per_window[0], names)
      overall = buckets_lib.overall_paired_difference(
          windows, per_window[0], names
      )
      paired.append(
          {
              'label': label,
              'minus': labels[0],
              'overall': overall,
              'buckets': buckets,
          }
      )
  rows = []
  for i, (start, end) in enumerate(spans[0]):
    row: dict[str, Any] = {'start': start, 'end': end}
    for label, r in zip(labels, results):
      bucket = r['buckets'][i]
      row[label] = {
          k: bucket.get(k)
          for k in ('loss', 'stderr', 'excess_loss', 'recovered')
      }
    rows.append(row)
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
  differences = None
  if configs is not None:
    differences = config_differences(labels, configs)
    summary['config_differences'] = differences
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
  csv_rows: list[list[Any]] = [head]
  for i, row in enumerate(rows):
    cells = [row['start'], row['end']]
    cells += [row[label][k] for label in labels for k in ('loss', 'stderr')]
    cells += [p['buckets'][i][k] for p in paired for k in ('diff', 'stderr')]
    csv_rows.append(cells)
  _write_csv(files['csv'], csv_rows)
  files['plot'] = plots.comparison(
      labels, results, os.path.join(out_dir, 'comparison.png'), paired=paired
  )
  heads = list(labels) + [f'{p["label"]}-{p["minus"]}' for p in paired]
  columns = [_cells([row[label] for row in rows]) for label in labels]
  columns += [_cells(p['buckets'], 'diff', '+') for p in paired]
  degradations = '; '.join(
      f"{label}: last-best {_fmt(r['degradation']['last_minus_best'])} +- "
      f"{_fmt(r['degradation']['last_minus_best_stderr'])}"
      for label, r in zip(labels, results)
  )
  text = [
      _grid('bucket', rows, heads, columns),
      degradations + ' (losses in nats per token +- stderr)',
  ]
  if paired:
    text.append(
        'differences: paired over the shared windows (+- stderr; 95% t'
        ' intervals in comparison.json)'
    )
    text += [_overall_line(p) for p in paired]
  if differences is not None:
    text.append(_differences_line(differences))
  return {'files': files, 'table': '\n'.join(text), 'paired': paired}
