"""Outputs of an evaluation: results.json, per-position npz, CSV, plots, text tables, comparison.

File layout of one evaluation directory (default WORKDIR/eval/step_N/): results.json,
per_position.npz (full per-position vectors), windows.npz, buckets.csv, groups.csv (bucket
loss by window group, with window provenance), loss_by_position.png and, with an offset
probe, offsets.csv and offsets.png. A comparison of several runs writes
comparison.json, comparison.csv and comparison.png.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from flax_posemb import buckets as buckets_lib
from flax_posemb import outputs
from flax_posemb import plots


def format_table(results: dict[str, Any]) -> str:
  """Plain-text bucket table of a results dict."""
  def f(x, nd=4):
    return '-' if x is None else f'{x:.{nd}f}'
  synth = bool(results['buckets']) and 'bayes_loss' in results['buckets'][0]
  head = f'{"bucket":>13} {"tokens":>8} {"loss":>8} {"stderr":>8}'
  if synth:
    head += f' {"bayes":>8} {"filter":>8} {"excess":>8} {"recov":>7}'
  lines = [head]
  for b in results['buckets']:
    span = f"[{b['start']}, {b['end']})"
    line = f"{span:>13} {b['tokens']:>8} {f(b['loss']):>8} {f(b['stderr']):>8}"
    if synth:
      line += (f" {f(b['bayes_loss']):>8} {f(b['filter_loss']):>8} {f(b['excess_loss']):>8}"
               f" {f(b['recovered'], 3):>7}")
    lines.append(line)
  o, d = results['overall'], results['degradation']
  docs = f", {o['documents']} documents" if 'documents' in o else ''
  lines.append(f"overall loss {f(o['loss'])} +- {f(o['stderr'])} nats/token "
               f"({o['tokens']} tokens, {o['windows']} windows{docs}); losses in nats per "
               'token, +- one clustered standard error')
  lines.append(f"last - best bucket {f(d['last_minus_best'])} +- {f(d['last_minus_best_stderr'])}; "
               f"second-half slope {f(d['slope'], 6)} +- {f(d['slope_stderr'], 6)} per position")
  return '\n'.join(lines)


def json_safe(x: Any) -> Any:
  """Replaces nan/inf floats by None and numpy scalars by Python numbers, recursively."""
  if isinstance(x, dict):
    return {k: json_safe(v) for k, v in x.items()}
  if isinstance(x, (list, tuple)):
    return [json_safe(v) for v in x]
  if isinstance(x, (np.integer,)):
    return int(x)
  if isinstance(x, (float, np.floating)):
    return float(x) if math.isfinite(x) else None
  return x


# Every file an evaluation directory can hold, the completion marker first (all replaced
# together by a new evaluation there).
OUTPUT_FILES = ('results.json', 'per_position.npz', 'windows.npz', 'buckets.csv', 'groups.csv',
                'loss_by_position.png', 'offsets.csv', 'offsets.png')
CSV_COLUMNS = ('start', 'end', 'tokens', 'windows', 'documents', 'loss', 'stderr', 'ci95_lo',
               'ci95_hi', 'bits_per_token', 'bayes_loss', 'filter_loss', 'excess_loss',
               'recovered')
GROUP_TABLES = ('by_kind', 'by_depth', 'by_end')  # results.json keys of the window groups


def _csv_rows(rows: list[dict[str, Any]], prefix: dict[str, Any] | None = None) -> list[str]:
  out = []
  for r in rows:
    r = dict(r, ci95_lo=r['ci95'][0], ci95_hi=r['ci95'][1])
    vals = list((prefix or {}).values()) + ['' if r.get(k) is None else r[k] for k in CSV_COLUMNS]
    out.append(','.join(str(v) for v in vals))
  return out


def write_outputs(results: dict[str, Any], per_position: dict[str, np.ndarray], out_dir: str,
                  title: str = '', per_window: dict[str, np.ndarray] | None = None
                  ) -> dict[str, str]:
  """Writes results.json, per_position.npz, windows.npz, buckets.csv and loss_by_position.png
  (+ offsets) into ``out_dir``, replacing every file of an earlier evaluation there at once
  when all are written (``outputs.replace_files``): nothing stale is left beside them, and a
  killed re-run leaves the earlier complete results.

  Returns:
    Paths by kind: 'json', 'npz', 'windows', 'csv', 'plot', with window provenance
    'groups_csv' (columns table, group, then those of buckets.csv) and, with an offset
    probe, 'offsets_csv', 'offsets_plot'.
  """
  os.makedirs(out_dir, exist_ok=True)
  with outputs.replace_files(out_dir, OUTPUT_FILES) as stage:
    files = _write_files(results, per_position, stage, title, per_window)
  return {k: os.path.join(out_dir, os.path.basename(v)) for k, v in files.items()}


def _write_files(results, per_position, out_dir, title, per_window) -> dict[str, str]:
  files = {'json': os.path.join(out_dir, 'results.json'),
           'npz': os.path.join(out_dir, 'per_position.npz'),
           'csv': os.path.join(out_dir, 'buckets.csv')}
  with outputs.atomic_write(files['npz']) as f:
    np.savez(f, **per_position)
  if per_window is not None:
    files['windows'] = os.path.join(out_dir, 'windows.npz')
    with outputs.atomic_write(files['windows']) as f:
      np.savez(f, **per_window)
  with outputs.atomic_write(files['csv'], 'w') as f:
    f.write('\n'.join([','.join(CSV_COLUMNS)] + _csv_rows(results['buckets'])) + '\n')
  if results.get('by_depth') is not None:
    files['groups_csv'] = os.path.join(out_dir, 'groups.csv')
    lines = [','.join(('table', 'group') + CSV_COLUMNS)]
    for table in GROUP_TABLES:
      for g in results[table]:
        lines += _csv_rows(g['buckets'], {'table': table, 'group': g['group']})
    with outputs.atomic_write(files['groups_csv'], 'w') as f:
      f.write('\n'.join(lines) + '\n')
  files['plot'] = plots.loss_by_position(per_position, results,
                                         os.path.join(out_dir, 'loss_by_position.png'), title)
  probe = results.get('offset_probe')
  if probe:
    files['offsets_csv'] = os.path.join(out_dir, 'offsets.csv')
    lines = [','.join(('offset',) + CSV_COLUMNS)]
    for r in probe['by_offset']:
      lines += _csv_rows(r['buckets'], {'offset': r['offset']})
    with outputs.atomic_write(files['offsets_csv'], 'w') as f:
      f.write('\n'.join(lines) + '\n')
    files['offsets_plot'] = plots.offset_probe(probe, os.path.join(out_dir, 'offsets.png'))
  # Last, and atomically: a results.json on disk means the directory is complete.
  with outputs.atomic_write(files['json'], 'w') as f:
    json.dump(json_safe(results), f, indent=1)
  return files


def format_windows(summary: dict[str, Any]) -> str:
  """Markdown table of where the windows come from (results.json 'windows',
  `buckets.provenance_tables`): counts, source mix, start depth and distance to the end."""
  t = summary['window_len']
  share = summary['long_doc_share']
  lines = [f"{summary['windows']} windows of {t + 1} tokens from {summary['documents']} "
           f"documents; {'-' if share is None else f'{share:.0%}'} in documents of >= {4 * t} "
           f"tokens (4T); {summary['first_window_overlaps']} start before token {t} (T).", '',
           '| kind | windows | documents |', '|---|---:|---:|']
  lines += [f"| {k} | {v['windows']} | {v['documents']} |" for k, v in summary['kinds'].items()]
  names = list(buckets_lib.QUANTILES)
  lines += ['', '| tokens | ' + ' | '.join(names) + ' |', '|---' + '|---:' * len(names) + '|']
  for key, what in (('start', 'start in document'), ('to_end', 'after window to doc end')):
    if summary[key]:
      lines.append(f'| {what} | ' + ' | '.join(f'{summary[key][n]:.0f}' for n in names) + ' |')
  return '\n'.join(lines)


def format_groups(results: dict[str, Any]) -> str:
  """Text tables of bucket loss (+- clustered stderr) per window group: one per
  `GROUP_TABLES` entry with two groups or more, buckets as rows, groups (with
  windows/documents) as columns; '' when no table has two groups."""
  out = []
  for table in GROUP_TABLES:
    groups = results.get(table) or []
    if len(groups) < 2:  # One group repeats the bucket table.
      continue
    heads = [f"{g['group']} ({g['windows']}w/{g['documents']}d)" for g in groups]
    width = max([17] + [len(h) + 1 for h in heads])
    lines = [f'{table:>13} ' + ' '.join(f'{h:>{width}}' for h in heads)]
    for i, b in enumerate(results['buckets']):
      cells = ['-' if g['buckets'][i]['loss'] is None else
               f"{g['buckets'][i]['loss']:.4f}+-{_fmt(g['buckets'][i]['stderr'])}" for g in groups]
      span = f"[{b['start']}, {b['end']})"
      lines.append(f'{span:>13} ' + ' '.join(f'{c:>{width}}' for c in cells))
    out.append('\n'.join(lines))
  if not out:
    return ''
  return '\n\n'.join(out + ['loss in nats per token +- one clustered standard error; '
                             'columns: group (windows w / documents d)'])


def format_offsets(probe: dict[str, Any]) -> str:
  """Text table: loss by context-length bucket (rows) for each offset K (columns)."""
  ks = [r['offset'] for r in probe['by_offset']]
  lines = [f'{"context":>13} ' + ' '.join(f'{"K=" + str(k):>16}' for k in ks)]
  for i, b in enumerate(probe['by_offset'][0]['buckets']):
    cells = []
    for r in probe['by_offset']:
      x = r['buckets'][i]
      cells.append('-' if x['loss'] is None else f"{x['loss']:.4f}+-{x['stderr'] or 0:.4f}")
    span = f"[{b['start']}, {b['end']})"
    lines.append(f'{span:>13} ' + ' '.join(f'{c:>16}' for c in cells))
  lines.append('loss in nats per token +- one clustered standard error. ' + probe['note'])
  return '\n'.join(lines)


def compare(labels: Sequence[str], results: Sequence[dict[str, Any]], out_dir: str,
            per_window: Sequence[dict[str, np.ndarray]] | None = None) -> dict[str, Any]:
  """Comparison of several runs: each run's bucket losses, and with ``per_window`` the paired
  difference of every run minus the first over their shared windows.

  Args:
    labels: one name per run.
    results: results.json dicts evaluated with the same bucket edges.
    out_dir: output directory.
    per_window: each run's ``windows.npz`` contents (``BucketAccumulator.per_window``), or
      None (then no paired differences).

  Returns:
    {'files': {'json', 'csv', 'plot'}, 'table': text, 'paired': [{'label', 'minus', 'buckets'}]}.

  Raises:
    ValueError: different buckets, or (paired) different windows.
  """
  spans = [[(b['start'], b['end']) for b in r['buckets']] for r in results]
  for label, s in zip(labels[1:], spans[1:]):
    if s != spans[0]:
      raise ValueError(
          f'runs {labels[0]!r} and {label!r} were evaluated on different windows / buckets '
          f'(last bucket ends at {spans[0][-1][1]} vs {s[-1][1]}); compare runs of equal '
          'context length, or pass the same --bucket_edges covering the shorter window.')
  paired = []
  if per_window is not None:
    paired = [{'label': l, 'minus': labels[0], 'buckets': buckets_lib.paired_difference(
        w, per_window[0], (l, labels[0]))} for l, w in zip(labels[1:], per_window[1:])]
  os.makedirs(out_dir, exist_ok=True)
  files = {'json': os.path.join(out_dir, 'comparison.json'),
           'csv': os.path.join(out_dir, 'comparison.csv')}
  rows = []
  for i, (a, b) in enumerate(spans[0]):
    row = {'start': a, 'end': b}
    for label, r in zip(labels, results):
      row[label] = {k: r['buckets'][i].get(k) for k in ('loss', 'stderr', 'excess_loss', 'recovered')}
    rows.append(row)
  summary = {'runs': [{'label': l, 'step': r.get('step'), 'workdir': r.get('workdir'),
                       'overall': r['overall'], 'degradation': r['degradation']}
                      for l, r in zip(labels, results)], 'buckets': rows, 'paired': paired}
  with open(files['json'], 'w') as f:
    json.dump(json_safe(summary), f, indent=1)
  head = ['start', 'end'] + [f'{l}_{k}' for l in labels for k in ('loss', 'stderr')]
  head += [f'{p["label"]}_minus_{p["minus"]}_{k}' for p in paired for k in ('diff', 'stderr')]
  lines = [','.join(head)]
  for i, row in enumerate(rows):
    vals = [row['start'], row['end']] + [row[l][k] for l in labels for k in ('loss', 'stderr')]
    vals += [p['buckets'][i][k] for p in paired for k in ('diff', 'stderr')]
    lines.append(','.join('' if v is None else str(v) for v in vals))
  with open(files['csv'], 'w') as f:
    f.write('\n'.join(lines) + '\n')
  files['plot'] = plots.comparison(labels, results, os.path.join(out_dir, 'comparison.png'),
                                   paired=paired)
  return {'files': files, 'table': _comparison_table(labels, results, rows, paired),
          'paired': paired}


def _comparison_table(labels, results, rows, paired) -> str:
  width = max(16, max(len(l) for l in labels) + 1)
  diffs = [f'{p["label"]}-{p["minus"]}' for p in paired]
  text = [f'{"bucket":>13} ' + ' '.join(f'{l:>{width}}' for l in labels + diffs)]
  for i, row in enumerate(rows):
    span = f"[{row['start']}, {row['end']})"
    cells = ['-' if row[l]['loss'] is None else f"{row[l]['loss']:.4f}+-{row[l]['stderr'] or 0:.4f}"
             for l in labels]
    cells += ['-' if p['buckets'][i]['diff'] is None else
              f"{p['buckets'][i]['diff']:+.4f}+-{p['buckets'][i]['stderr']:.4f}" for p in paired]
    text.append(f'{span:>13} ' + ' '.join(f'{c:>{width}}' for c in cells))
  deg = [f"{l}: last-best {_fmt(r['degradation']['last_minus_best'])}"
         f" +- {_fmt(r['degradation']['last_minus_best_stderr'])}" for l, r in zip(labels, results)]
  text.append('; '.join(deg) + ' (losses in nats per token +- stderr)')
  if paired:
    text.append('differences: paired over the shared windows (+- stderr; 95% t intervals in '
                'comparison.json)')
  return '\n'.join(text)


def _fmt(x: float | None) -> str:
  return '-' if x is None else f'{x:.4f}'
