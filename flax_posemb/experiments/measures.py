"""Per-run measures from a finished run's files (docs/DESIGN.md § Experiments
outputs)."""

import collections
from collections.abc import Mapping
import itertools
import json
from typing import Any

import numpy as np
import scipy.stats

from flax_posemb import analysis
from flax_posemb import outputs
from flax_posemb import stats
from flax_posemb import workdir
from flax_posemb.data import corpus
from flax_posemb.data import pipeline

# Bucket vector -> the per-position vector it averages (``position_vectors``).
_SOURCES = {
    'bucket_exposure': 'exposure',
    'bucket_full_context_exposure': 'full_context_exposure',
    'bucket_row_grad': 'row_grad',
    'bucket_occ_signal': 'signal_per_occurrence',
    'bucket_downstream_signal': 'signal_per_downstream',
    'bucket_update_rss': 'update_rss',
    'bucket_drift': 'drift',
    'bucket_train_loss': 'mean_loss',
    'bucket_row_norm': 'row_norm',
}
VECTORS = ('bucket_loss', 'bucket_excess', 'bucket_recovered', *_SOURCES)
# name -> bucket vector whose last / first bucket it is.
_LATE_OVER_EARLY = {
    'update': 'bucket_update_rss',
    **{
        k: f'bucket_{k}'
        for k in (
            'exposure',
            'row_grad',
            'occ_signal',
            'downstream_signal',
            'drift',
            'row_norm',
        )
    },
}
_RARE = (
    'rare_row_fraction',
    'loss_rare_rows',
    'loss_common_late_rows',
    'excess_rare_rows',
    'excess_common_late_rows',
)
# Axis labels of the figures; '{loss}' is the corpus's loss unit (``label``).
LABELS = {
    'bucket_loss': 'held-out loss ({loss})',
    'bucket_excess': 'excess loss over Bayes ({loss})',
    'bucket_recovered': (
        'share of the position value recovered (0 = content only, 1 = Bayes)'
    ),
    'bucket_exposure': 'training tokens seen per row (cumulative)',
    'bucket_full_context_exposure': (
        'training tokens seen per row with context = position (cumulative)'
    ),
    'bucket_row_grad': 'table-gradient row norm (RMS per step, 2nd half)',
    'bucket_occ_signal': 'gradient norm per occurrence (2nd half)',
    'bucket_downstream_signal': (
        'gradient norm per downstream target (2nd half)'
    ),
    'bucket_update_rss': (
        'cumulative update norm of the row (root of summed squares)'
    ),
    'bucket_drift': 'drift from init ||row_end - row_0||',
    'bucket_train_loss': 'training loss, 2nd half ({loss})',
    'bucket_row_norm': 'norm of the final row',
    'final_loss': 'held-out loss ({loss})',
}


def label(metric: str, tokenizer: str = '') -> str:
  """Axis label of ``metric`` with its unit."""
  return LABELS.get(metric, metric).format(
      loss='nats/byte' if tokenizer == 'byte' else 'nats/token'
  )


def load_json(path: str) -> Any:
  """The JSON value of the file `path`."""
  with open(path) as f:
    return json.load(f)


def load_windows(run_dir: str) -> list[dict[str, np.ndarray]]:
  """The run's statistics windows in step order."""
  return [outputs.load_npz(path) for _, path in outputs.window_files(run_dir)]


def load_tables(run_dir: str) -> dict[int, np.ndarray]:
  """step -> position-table snapshot ``[max_len, emb_dim]``."""
  return {
      step: outputs.load_npy(path)
      for step, path in outputs.table_files(run_dir)
  }


def position_vectors(
    windows: list[dict[str, np.ndarray]],
    num_steps: int,
    tables: Mapping[int, np.ndarray],
) -> dict[str, np.ndarray]:
  """``[max_len]`` per-position vectors of a run (docs/DESIGN.md § Experiments
  outputs)."""
  out: dict[str, np.ndarray] = {}
  if windows:
    # The second half's windows, else the last one.
    late = [w for w in windows if int(w['step']) > num_steps // 2]
    if not late:
      late = windows[-1:]
    # A run with collect_stats=False has only stats.LOSS_FIELDS: its gradient
    # vectors are NaN.
    nan = np.full(np.shape(windows[0]['count']), np.nan)

    def total(some_windows, field):
      return sum(
          np.asarray(window.get(field, nan), np.float64)
          for window in some_windows
      )

    late_sums = {field: total(late, field) for field in stats.FIELDS}
    out.update(stats.derived(late_sums))
    late_steps = sum(int(window.get('num_steps', 1)) for window in late)
    out['exposure'] = np.asarray(windows[-1]['cumulative_count'], np.float64)
    # The evaluation's situation; NaN unless every window of the run is here
    # (their counts add up to the cumulative one) and counted it.
    full_context = total(windows, 'full_context_count')
    if not np.array_equal(total(windows, 'count'), out['exposure']):
      full_context = np.full_like(full_context, np.nan)
    out['full_context_exposure'] = full_context
    out['row_grad'] = np.sqrt(late_sums['row_sq'] / max(late_steps, 1))
    out['update_rss'] = np.sqrt(total(windows, 'update_sq'))
    out['scored_total'] = total(windows, 'loss_count')
  if tables:
    out['drift'] = analysis.drift(tables[max(tables)], tables[min(tables)])
    out['row_norm'] = analysis.row_norms(tables[max(tables)])
  return out


def training_mix(config) -> dict[str, float]:
  """Share of a run's training tokens (real inputs) per document kind.

  Replays the run's ``num_train_steps`` batches (the pipeline is
  deterministic), so it counts exactly what the run trained on.
  """
  data_config = config.data
  if data_config.source == 'synthetic':
    return {'synthetic': 1.0}
  src = corpus.make_source(data_config, data_config.train_split)
  it = pipeline.make_train_iterator(
      data_config,
      batch_size=config.batch_size,
      seed=config.seed,
      num_train_steps=config.num_train_steps,
      max_len=config.model.max_len,
      with_doc_ids=True,
  )
  tokens_per_doc: collections.Counter[int] = collections.Counter()
  for _ in range(config.num_train_steps):
    batch = next(it)
    docs = batch['doc_ids'][batch['segment_ids'] > 0]
    ids, counts = np.unique(docs, return_counts=True)
    tokens_per_doc.update(dict(zip(ids.tolist(), counts.tolist())))
  per_kind: collections.Counter[str] = collections.Counter()
  for doc, count in tokens_per_doc.items():
    per_kind[src.kind(doc)] += count
  total = sum(per_kind.values())
  return {kind: per_kind[kind] / total for kind in sorted(per_kind)}


def step_seconds(run_dir: str) -> float:
  """Steady-state seconds per step from ``metrics.jsonl`` (after the first row;
  NaN if none)."""
  metrics = workdir.metric_rows(run_dir)
  rows = [
      (int(row['step']), float(row['elapsed']))
      for _, row in metrics
      if 'elapsed' in row and 'eval' not in row
  ]
  if len(rows) < 2 or rows[-1][0] <= rows[0][0]:
    return float('nan')
  return (rows[-1][1] - rows[0][1]) / (rows[-1][0] - rows[0][0])


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
  """Pearson r over the entries finite in both; NaN below 3 of them or for a
  constant."""
  ok = np.isfinite(x) & np.isfinite(y)
  if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
    return float('nan')
  return float(scipy.stats.pearsonr(x[ok], y[ok]).statistic)


def run_measures(
    run_dir: str,
    eval_results: Mapping[str, Any],
    num_steps: int,
    train_seconds: float = float('nan'),
    per_position: Mapping[str, np.ndarray] | None = None,
    rare_exposure: float = 100.0,
    mid_bucket: int = -1,
) -> dict[str, Any]:
  """``{'scalars', 'vectors', 'buckets'}`` of a finished run (``per_position``:
  arrays [L]; ``mid_bucket``: the experiment's mid bucket, -1: none)."""
  buckets = eval_results['buckets']
  edges = [(int(row['start']), int(row['end'])) for row in buckets]

  def get(key):
    return np.array([float(row.get(key, float('nan'))) for row in buckets])

  pos = position_vectors(load_windows(run_dir), num_steps, load_tables(run_dir))
  vec = {
      'bucket_loss': get('loss'),
      'bucket_excess': get('excess_loss'),
      'bucket_recovered': get('recovered'),
  }
  for name, key in _SOURCES.items():
    vec[name] = np.array(
        [_finite_mean(pos.get(key, [])[start:end]) for start, end in edges]
    )
  scalars = _scalars(eval_results, vec, pos, num_steps, train_seconds)
  if 0 <= mid_bucket < len(edges):
    scalars['loss_mid'] = float(vec['bucket_loss'][mid_bucket])
    scalars['loss_late_minus_mid'] = scalars['loss_late'] - scalars['loss_mid']
    excess_mid = float(vec['bucket_excess'][mid_bucket])
    scalars['excess_late_minus_mid'] = scalars['excess_late'] - excess_mid
  scalars['step_seconds'] = step_seconds(run_dir)
  scalars.update(_rare_rows(pos, per_position, rare_exposure))
  return {
      'scalars': scalars,
      'vectors': {k: [float(x) for x in v] for k, v in vec.items()},
      'buckets': [list(e) for e in edges],
  }


def _finite_mean(values) -> float:
  """The mean of the finite entries (NaN if none)."""
  values = np.asarray(values, np.float64)
  finite = np.isfinite(values)
  if not finite.any():
    return np.nan
  return values[finite].mean()


def _scalars(
    eval_results: Mapping[str, Any],
    vec: Mapping[str, np.ndarray],
    pos: Mapping[str, np.ndarray],
    num_steps: int,
    train_seconds: float,
) -> dict[str, float]:
  nan = float('nan')
  overall = eval_results['overall']['loss']
  degradation = eval_results['degradation']['last_minus_best']
  s: dict[str, float] = {}
  if overall is None:
    s['final_loss'] = float(np.nanmean(vec['bucket_loss']))
  else:
    s['final_loss'] = float(overall)
  s['degradation'] = nan if degradation is None else float(degradation)
  s['update_rss_late'] = float(vec['bucket_update_rss'][-1])
  s['drift_late'] = float(vec['bucket_drift'][-1])
  if 'drift' in pos:
    s['drift_mean'] = float(np.nanmean(pos['drift']))
  else:
    s['drift_mean'] = nan
  s['train_seconds'] = float(train_seconds)
  for name in ('loss', 'excess', 'recovered'):
    s[f'{name}_early'] = float(vec[f'bucket_{name}'][0])
    s[f'{name}_late'] = float(vec[f'bucket_{name}'][-1])
  s['loss_late_minus_early'] = s['loss_late'] - s['loss_early']
  s['excess_late_minus_early'] = s['excess_late'] - s['excess_early']
  for name, vector in _LATE_OVER_EARLY.items():
    first = vec[vector][0]
    if first and np.isfinite(first):
      s[f'{name}_late_over_early'] = float(vec[vector][-1] / first)
    else:
      s[f'{name}_late_over_early'] = nan
  s['signal_loss_corr'] = _pearson(
      pos.get('signal_per_occurrence', np.array([])),
      pos.get('mean_loss', np.array([])),
  )
  scored = float(pos['scored_total'].sum()) if 'scored_total' in pos else nan
  s['tokens_per_step'] = scored / num_steps if num_steps else nan
  s['train_tokens_per_second'] = (
      scored / train_seconds if train_seconds else nan
  )
  probe = eval_results.get('offset_probe') or {}
  by_offset = {
      int(row['offset']): row['overall']['loss']
      for row in probe.get('by_offset', [])
  }
  for offset, loss in by_offset.items():
    if offset and by_offset.get(0) is not None and loss is not None:
      s[f'offset_penalty_{offset}'] = float(loss) - float(by_offset[0])
  return s


def _rare_rows(
    pos: Mapping[str, np.ndarray],
    per_position: Mapping[str, np.ndarray] | None,
    rare_exposure: float,
) -> dict[str, float]:
  """Held-out loss (and excess over Bayes) of rare vs common rows of the second
  half."""
  out = dict.fromkeys(_RARE, float('nan'))
  if (
      per_position is None
      or 'exposure' not in pos
      or 'loss' not in per_position
  ):
    return out
  loss = np.asarray(per_position['loss'], np.float64)
  n = len(loss)
  late = np.arange(n) >= n // 2
  rare = late & (np.asarray(pos['exposure'], np.float64)[:n] < rare_exposure)

  def mean(values, rows):
    return float(np.nanmean(values[rows])) if rows.any() else float('nan')

  out['rare_row_fraction'] = float(rare.sum() / max(late.sum(), 1))
  by_name = {'loss': loss}
  if 'bayes_loss' in per_position:
    bayes = np.asarray(per_position['bayes_loss'], np.float64)[:n]
    by_name['excess'] = loss - bayes
  for name, values in by_name.items():
    out[f'{name}_rare_rows'] = mean(values, rare)
    out[f'{name}_common_late_rows'] = mean(values, late & ~rare)
  return out


def convergence_step(
    run_dirs: Mapping[str, str], threshold: float
) -> dict[str, Any]:
  """When the tables of two or more arms (arm -> run dir) agree >= ``threshold``
  from then on: agreement is the mean pairwise Pearson r of their
  cosine-similarity structures (constant: 0)."""
  snapshots = [load_tables(run_dir) for run_dir in run_dirs.values()]
  common = sorted(set.intersection(*(set(tables) for tables in snapshots)))
  agreement = []
  for step in common:
    structures = []
    for tables in snapshots:
      table = tables[step]
      upper = np.triu_indices(len(table), k=1)
      structures.append(analysis.cosine_similarity(table)[upper])
    pearson = [
        _pearson(first, second)
        for first, second in itertools.combinations(structures, 2)
    ]
    agreement.append(float(np.mean(np.nan_to_num(pearson))))
  # The first step from which every agreement reaches the threshold.
  converged = float('nan')
  for i, step in enumerate(common):
    if all(value >= threshold for value in agreement[i:]):
      converged = float(step)
      break
  return {'steps': common, 'agreement': agreement, 'converged_step': converged}
