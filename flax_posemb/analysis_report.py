"""The files of a table or statistics analysis (runner side of `analysis`):
JSON, arrays and plots, as docs/DESIGN.md § Statistics lists them."""

import json
import os
from typing import Any

import numpy as np
import tqdm

from flax_posemb import analysis
from flax_posemb import outputs
from flax_posemb import plots
from flax_posemb import stats
from flax_posemb import tables
from flax_posemb import workdir as workdir_lib
from flax_posemb.eval_report import json_safe


def analyze_workdir(
    workdir: str,
    table: np.ndarray,
    output: str,
    *,
    step: int | None = None,
    initial: np.ndarray | None = None,
    per_position: dict[str, np.ndarray] | None = None,
    bucket_size: int = 16,
    bucket_edges: str = '',
    progress: bool = False,
) -> dict[str, Any]:
  """Analyses `table` [L, D] of the run in `workdir` at `step` (its snapshots
  and windows up to `step`); writes analysis.json, analysis.npz and plots into
  `output`.

  Args:
    workdir: the training workdir.
    table: the table analysed.
    output: directory of the files written.
    step: the step of ``table`` (None: every snapshot and window).
    initial: initial table [L, D]; default tables/table_0.npy if present.
    per_position: evaluation vectors ('loss' [L'], optional 'bayes_loss',
      'filter_loss'), related to cumulative exposure when the run has window
      files.
    bucket_size: width of the summaries' buckets (`buckets.make_edges`).
    bucket_edges: their explicit edges, if given.
    progress: a bar over the stages on stderr.
  """
  stats_dir = os.path.join(workdir, outputs.STATS_DIR)
  exposure = analysis.cumulative_exposure(stats_dir, step)
  bar = _stage_bar(4 if exposure is None else 5, progress)
  bar.set_postfix_str('table snapshots')
  snapshots = [
      (s, outputs.load_npy(p))
      for s, p in outputs.table_files(workdir)
      if step is None or s <= step
  ]
  if initial is None and snapshots and snapshots[0][0] == 0:
    initial = snapshots[0][1]
  bar.update()
  bar.set_postfix_str('probe, PCA, drift')
  summary, arrays = analysis.analyze_table(
      table,
      initial=initial,
      snapshots=snapshots,
      bucket_size=bucket_size,
      bucket_edges=bucket_edges,
  )
  summary['step'] = step
  # A run started from a smaller table (init_from): its rows and the new ones.
  record = workdir_lib.init_record(workdir)
  boundary = None
  if record is not None and 0 < record.get('rows', 0) < table.shape[0]:
    boundary = int(record['rows'])
  bar.update()
  files = _table_plots(table, summary, arrays, output, bar, boundary)
  if exposure is not None:
    bar.set_postfix_str('exposure_relation.png')
    num = min(len(exposure), table.shape[0])
    arrays['exposure'] = exposure
    series: dict[str, np.ndarray] = {}
    if per_position is not None:
      series.update(_evaluation_series(per_position, num))
    for key in ('drift', 'norm'):
      if key in arrays:
        series[key] = arrays[key][:num]
    summary['exposure'] = _exposure_relation(
        exposure[:num], series, output, files
    )
    bar.update()
  if boundary is not None and record is not None:
    summary['init_from_rows'] = _old_and_new_rows(
        arrays, boundary, record, per_position, stats_dir, step
    )
  bar.close()
  return _write(summary, arrays, files, output, 'analysis')


def _old_and_new_rows(
    arrays: dict[str, np.ndarray],
    boundary: int,
    record: dict[str, Any],
    per_position: dict[str, np.ndarray] | None,
    stats_dir: str,
    step: int | None,
) -> dict[str, Any]:
  """Means over the rows a run took from init_from (`0..boundary - 1`) and
  over the rows it added, of the table's norm and drift, the exposure, the
  evaluation's loss and the statistics' signal per occurrence and update."""
  rows = len(arrays['norm'])
  series: dict[str, np.ndarray] = {}
  for key in ('norm', 'drift', 'exposure'):
    if key in arrays:
      series[key] = arrays[key]
  if per_position is not None:
    series['loss'] = _evaluation_series(per_position, rows)['loss']
  windows = [
      outputs.load_npz(path)
      for _, path in analysis.window_files(stats_dir, step)
  ]
  if windows:
    sums = {}
    for key in stats.FIELDS:
      if key in windows[0]:
        sums[key] = analysis.sum_arrays(
            [np.asarray(w[key], np.float64) for w in windows]
        )
    derived = stats.derived(sums)
    series['signal_per_occurrence'] = derived['signal_per_occurrence']
    if 'update_sq' in sums:
      series['update_sq'] = sums['update_sq']
  groups: dict[str, dict[str, Any]] = {}
  for name, lo, hi in (('old', 0, boundary), ('new', boundary, rows)):
    means = {}
    for key, values in series.items():
      part = np.asarray(values[lo:hi], np.float64)
      part = part[np.isfinite(part)]
      means[key] = float(part.mean()) if part.size else None
    groups[name] = {'rows': [lo, hi], **means}
  return {
      'from': record.get('workdir'),
      'step': record.get('step'),
      'new_rows_rule': record.get('new_rows'),
      **groups,
  }


def _evaluation_series(
    per_position: dict[str, np.ndarray], num: int
) -> dict[str, np.ndarray]:
  """The evaluation's per-position loss (and on the synthetic corpus the share
  of the position value recovered) over the first ``num`` rows, NaN past the
  evaluated length."""
  padded = {}
  for key in ('loss', 'bayes_loss', 'filter_loss'):
    if key in per_position:
      values = np.asarray(per_position[key][:num], np.float64)
      padded[key] = np.pad(
          values, (0, num - len(values)), constant_values=np.nan
      )
  series = {'loss': padded['loss']}
  if 'bayes_loss' in padded:
    gap = padded['filter_loss'] - padded['bayes_loss']
    with np.errstate(invalid='ignore', divide='ignore'):
      recovered = (padded['filter_loss'] - padded['loss']) / gap
    series['recovered'] = np.where(np.abs(gap) > 1e-9, recovered, np.nan)
  return series


def _stage_bar(stages: int, progress: bool) -> Any:
  """A bar over an analysis's ``stages`` on stderr, its stage named after it
  (disabled unless ``progress``)."""
  return tqdm.tqdm(
      total=stages,
      desc='analysis',
      unit='stage',
      dynamic_ncols=True,
      disable=not progress,
  )


def _table_plots(
    table: np.ndarray,
    summary: dict[str, Any],
    arrays: dict[str, np.ndarray],
    output: str,
    bar: Any,
    boundary: int | None = None,
) -> dict[str, str]:
  """Writes table_analysis.png and cosine_similarity.png of `analyze_table`'s
  results (two stages of ``bar``; `boundary`: the first row a run added to
  init_from's table)."""
  probe = summary['probe']
  bar.set_postfix_str('table_analysis.png')
  files = {
      'table_plot': plots.table_analysis(
          arrays['norm'],
          arrays.get('drift'),
          arrays['pca_ratio'],
          np.asarray(probe['bucket_edges']),
          np.asarray(probe['abs_error_by_bucket']),
          os.path.join(output, 'table_analysis.png'),
          arrays.get('snapshot_drift'),
          arrays.get('snapshot_steps', ()),
          probe_r2=probe['r2'],
          boundary=boundary,
      )
  }
  bar.update()
  bar.set_postfix_str('cosine_similarity.png')
  files['cosine_plot'] = plots.cosine_heatmap(
      analysis.cosine_similarity(table),
      os.path.join(output, 'cosine_similarity.png'),
  )
  bar.update()
  return files


def _write(
    summary: dict[str, Any],
    arrays: dict[str, np.ndarray] | None,
    files: dict[str, str],
    output: str,
    name: str,
) -> dict[str, Any]:
  """Writes NAME.npz (`arrays`, unless None) and NAME.json (`summary` with
  `files`)."""
  if arrays is not None:
    files['arrays'] = outputs.save_npz(
        os.path.join(output, f'{name}.npz'), arrays
    )
  files['json'] = os.path.join(output, f'{name}.json')
  summary['files'] = files
  with outputs.atomic_write(files['json'], 'w') as f:
    json.dump(json_safe(summary), f, indent=1)
  return summary


def write_table_analysis(
    source: str,
    output: str,
    *,
    bucket_size: int = 16,
    bucket_edges: str = '',
    progress: bool = False,
) -> dict[str, Any]:
  """`analyze_workdir`'s analysis of any table, less drift and exposure (listed
  under 'skipped'); writes table_analysis.json and the plots into `output`.

  Args:
    source: a `tables.load_table` spec of a [L >= 2, D] position table (the
        JSON's 'source').
    bucket_size: width of the summaries' buckets (`buckets.make_edges`).
    bucket_edges: their explicit edges, if given.
    progress: a bar over the stages on stderr.
  """
  # 2-D: checked by load_table
  table = np.asarray(tables.load_table(source), np.float64)
  if table.shape[0] < 2 or table.shape[1] < 1:
    raise ValueError(
        'table analysis needs a [rows >= 2, features >= 1] table, got'
        f' {table.shape}.'
    )
  bar = _stage_bar(3, progress)
  bar.set_postfix_str('probe, PCA')
  summary, arrays = analysis.analyze_table(
      table, bucket_size=bucket_size, bucket_edges=bucket_edges
  )
  bar.update()
  files = _table_plots(table, summary, arrays, output, bar)
  bar.close()
  summary = {
      'source': source,
      **summary,
      'skipped': {
          'drift': 'needs the initial table and snapshots of a training run',
          'exposure': "needs a training run's per-position statistics",
      },
  }
  return _write(summary, None, files, output, 'table_analysis')


def analyze_stats(
    stats_dir: str, output: str, *, progress: bool = False
) -> dict[str, Any]:
  """Analyses any directory of window files (`PositionStatistics`'s, or a run's
  `stats/`) into `output`: stats_analysis.json/.npz and exposure_relation.png
  (docs/evaluation.md); ``progress``: a bar over the files read, on stderr."""
  files = analysis.window_files(stats_dir)
  if not files:
    raise ValueError(
        f'{stats_dir} holds no statistics window files (window_STEP.npz).'
    )
  reading = tqdm.tqdm(
      files,
      desc='window files',
      unit='file',
      dynamic_ncols=True,
      disable=not progress,
  )
  windows = [outputs.load_npz(p) for _, p in reading]
  arrays = {}
  for key in stats.FIELDS:
    if key in windows[0]:
      arrays[key] = analysis.sum_arrays(
          [np.asarray(w[key], np.float64) for w in windows]
      )
  arrays.update(stats.derived(arrays))
  exposure = analysis.cumulative_exposure(stats_dir)
  assert exposure is not None  # There are window files.
  arrays['exposure'] = exposure
  series: dict[str, np.ndarray] = {}
  for key in ('mean_loss', 'signal_per_occurrence', 'coherence', 'update_sq'):
    if key in arrays:
      series[key] = arrays[key]
  out: dict[str, str] = {}
  summary = {
      'source': stats_dir,
      'windows': len(files),
      'last_step': files[-1][0],
      'first_step': int(windows[0].get('first_step', files[0][0])),
      'exposure': _exposure_relation(exposure, series, output, out),
  }
  return _write(summary, arrays, out, output, 'stats_analysis')


def _first_last(values: list[float | None]) -> str:
  """'first bucket A, last bucket B' of per-bucket values."""
  first = '-' if values[0] is None else f'{values[0]:.4g}'
  last = '-' if values[-1] is None else f'{values[-1]:.4g}'
  return f'first bucket {first}, last bucket {last}'


def _spearman_line(exposure: dict[str, Any]) -> str:
  """Exposure totals and each series' Spearman rho with it (analysis.json's
  'exposure')."""
  rhos = []
  for key, value in exposure.items():
    if key.startswith('spearman_'):
      shown = '-' if value is None else f'{value:+.2f}'
      rhos.append(f"{key.removeprefix('spearman_')} {shown}")
  line = (
      f"exposure: {exposure['total_tokens']:.4g} tokens,"
      f" {exposure['min_position_exposure']:.4g} to"
      f" {exposure['max_position_exposure']:.4g} per position"
  )
  if rhos:
    line += '; Spearman rho with exposure: ' + ', '.join(rhos)
  return line


def summary_lines(summary: dict[str, Any]) -> list[str]:
  """What an analysis found, a few console lines: of a table
  (`analyze_workdir`, `write_table_analysis`) or of window files
  (`analyze_stats`)."""
  lines = []
  if 'rows' in summary:
    probe = summary['probe']
    offsets = ', '.join(
        f'{k}: {v:+.2f}' for k, v in summary['cosine_by_offset'].items()
    )
    lines += [
        f"table: {summary['rows']} rows x {summary['features']} features;"
        f" {summary['pca_components_for_90pct']} principal components"
        ' explain 90% of the variance',
        f"row norm: {_first_last(summary['norm_by_bucket'])}",
        f"position probe (held-out ridge): R^2 {probe['r2']:.3f}; mean"
        f" |error| in positions {_first_last(probe['abs_error_by_bucket'])}",
        f'mean cosine of rows k apart (k: cosine): {offsets}',
    ]
    if 'drift_by_bucket' in summary:
      lines.append(
          'drift from the initial table:'
          f" {_first_last(summary['drift_by_bucket'])}"
      )
  if 'windows' in summary:
    lines.append(
        f"{summary['windows']} statistics windows, steps"
        f" {summary['first_step']}-{summary['last_step']}"
    )
  if summary.get('exposure'):
    lines.append(_spearman_line(summary['exposure']))
  return lines


def figures(files: dict[str, str]) -> list[str]:
  """The paths of the figures (.png) among an output's ``files``."""
  return [path for path in files.values() if path.endswith('.png')]


def _exposure_relation(
    exposure: np.ndarray,
    series: dict[str, np.ndarray],
    output: str,
    files: dict[str, str],
) -> dict[str, Any]:
  """Exposure totals and each series' Spearman correlation with it; the plot
  into `files`."""
  out: dict[str, Any] = {
      'total_tokens': float(exposure.sum()),
      'min_position_exposure': float(exposure.min()),
      'max_position_exposure': float(exposure.max()),
  }
  rho: dict[str, float | None] = {}
  for name, y in series.items():
    ok = np.isfinite(y) & (exposure > 0)
    if ok.sum() > 2:
      rho[name] = analysis.spearman(exposure[ok], y[ok])
      out[f'spearman_{name}'] = rho[name]
  files['exposure_plot'] = plots.exposure_relation(
      exposure, series, os.path.join(output, 'exposure_relation.png'), rho=rho
  )
  return out
