"""Per-run measures read from a finished run's files.

Inputs, per the workdir contract (docs/DESIGN.md): ``stats/window_STEP.npz`` (per-position
vectors of one logging window, plus ``cumulative_count``), ``tables/table_STEP.npy``
(position-table snapshots, step 0 included), and the evaluation results dict
(``buckets: [{start, end, loss, excess_loss?, recovered?}], overall, degradation``).

Bucket edges come from the evaluation buckets; "early" is the first bucket, "late" the last.
Gradient-signal measures use the windows of the second half of training (after the first
transient; ``windows_from``), exposure uses the exact cumulative counts at the end, and
update norms use all windows (every update moved the row).

Vectors (``VECTORS``, one value per bucket, each a mean over the bucket's positions):
``bucket_loss``, ``bucket_excess``, ``bucket_recovered`` (synthetic only), ``bucket_exposure``
(cumulative real tokens per row), ``bucket_row_grad`` (RMS over steps of the table-gradient
row norm), ``bucket_occ_signal`` (mean ``||g||`` per occurrence), ``bucket_downstream_signal``
(``||g||`` per downstream target), ``bucket_update_rss`` (root of the summed squared row
updates: the cumulative update norm), ``bucket_drift`` (``||table_end - table_0||`` per
row), ``bucket_train_loss`` (training loss of targets at those positions),
``bucket_row_norm`` (norm of the final table row). ``bucket_occ_signal``,
``bucket_downstream_signal`` and ``bucket_train_loss`` are ``stats.derived``'s
``signal_per_occurrence``, ``signal_per_downstream`` and ``mean_loss`` of the summed
second-half windows (``DERIVED``).
Scalars (``SCALARS``) are documented in ``_scalars``.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any, Mapping

import numpy as np
import scipy.stats

from flax_posemb import analysis, outputs, stats

VECTORS = ('bucket_loss', 'bucket_excess', 'bucket_recovered', 'bucket_exposure',
           'bucket_row_grad', 'bucket_occ_signal', 'bucket_downstream_signal',
           'bucket_update_rss', 'bucket_drift', 'bucket_train_loss', 'bucket_row_norm')
SCALARS = ('final_loss', 'loss_early', 'loss_late', 'loss_late_minus_early', 'degradation',
           'excess_early', 'excess_late', 'excess_late_minus_early', 'recovered_early',
           'recovered_late', 'exposure_late_over_early', 'row_grad_late_over_early',
           'occ_signal_late_over_early', 'downstream_signal_late_over_early',
           'update_late_over_early', 'drift_late_over_early', 'row_norm_late_over_early', 'update_rss_late', 'drift_late',
           'drift_mean', 'signal_loss_corr', 'train_seconds', 'step_seconds', 'tokens_per_step',
           'train_tokens_per_second', 'rare_row_fraction', 'loss_rare_rows',
           'loss_common_late_rows', 'excess_rare_rows', 'excess_common_late_rows')
# Plus 'offset_penalty_K' for each offset K > 0 of the probe: overall loss at shift K minus
# at shift 0 (same texts, same context; only the table rows differ).

# Axis labels of the measures in the figures; '{loss}' is the corpus's loss unit (``loss_unit``).
LABELS = {
    'bucket_loss': 'held-out loss ({loss})',
    'bucket_excess': 'excess loss over Bayes ({loss})',
    'bucket_recovered': 'share of the position value recovered (0 = content only, 1 = Bayes)',
    'bucket_exposure': 'training tokens seen per row (cumulative)',
    'bucket_row_grad': 'table-gradient row norm (RMS per step, 2nd half)',
    'bucket_occ_signal': 'gradient norm per occurrence (2nd half)',
    'bucket_downstream_signal': 'gradient norm per downstream target (2nd half)',
    'bucket_update_rss': 'cumulative update norm of the row (root of summed squares)',
    'bucket_drift': 'drift from init ||row_end - row_0||',
    'bucket_train_loss': 'training loss, 2nd half ({loss})',
    'bucket_row_norm': 'norm of the final row',
    'final_loss': 'held-out loss ({loss})',
}


def loss_unit(tokenizer: str) -> str:
  """Unit of a loss on a corpus tokenized by ``tokenizer`` ('byte' -> 'nats/byte')."""
  return 'nats/byte' if tokenizer == 'byte' else 'nats/token'


def label(metric: str, tokenizer: str = '') -> str:
  """Readable axis label of ``metric`` with its unit (the metric name if it has none)."""
  return LABELS.get(metric, metric).format(loss=loss_unit(tokenizer))


def load_windows(run_dir: str) -> list[dict[str, np.ndarray]]:
  """All statistics windows of a run, in step order (``[max_len]`` vectors plus ``step``).

  Raises:
    ValueError: a window file is truncated or garbled (named; see `flax_posemb.outputs.load_npz`).
  """
  return [outputs.load_npz(path)
          for _, path in outputs.window_files(run_dir)]


def load_tables(run_dir: str) -> dict[int, np.ndarray]:
  """Position-table snapshots of a run: step -> ``[max_len, emb_dim]`` array."""
  return {s: outputs.load_npy(p)
          for s, p in outputs.table_files(run_dir)}


def bucket_means(values: np.ndarray, edges: list[tuple[int, int]]) -> np.ndarray:
  """Mean of finite ``values[start:end]`` per bucket; ``[len(edges)]`` (NaN if none)."""
  out = []
  for start, end in edges:
    v = np.asarray(values[start:end], dtype=np.float64)
    v = v[np.isfinite(v)]
    out.append(float(v.mean()) if v.size else float('nan'))
  return np.array(out)


# Bucket vector -> the ``stats.derived`` ratio it averages (of the summed second-half windows).
DERIVED = {'bucket_occ_signal': 'signal_per_occurrence',
           'bucket_downstream_signal': 'signal_per_downstream',
           'bucket_train_loss': 'mean_loss'}


def position_vectors(windows: list[dict[str, np.ndarray]], num_steps: int,
                     tables: Mapping[int, np.ndarray]) -> dict[str, np.ndarray]:
  """Per-position vectors (``[max_len]`` each) from statistics windows and snapshots.

  Args:
    windows: ``load_windows`` output.
    num_steps: total optimizer steps of the run.
    tables: ``load_tables`` output.

  Returns:
    ``exposure``, ``row_grad``, ``update_rss``, ``scored_total``, ``drift``, ``row_norm``
    (named like the bucket vectors without ``bucket_``), plus ``stats.derived`` of the
    summed second-half windows (``signal_per_occurrence``, ``signal_per_downstream``,
    ``mean_loss``, ``coherence``).
  """
  out: dict[str, np.ndarray] = {}
  if windows:
    late = [w for w in windows if int(w['step']) > num_steps // 2] or windows[-1:]
    # A run with collect_stats=False has only stats.LOSS_FIELDS: its gradient vectors are NaN.
    nan = np.full(np.shape(windows[0]['count']), np.nan)
    total = lambda ws, k: sum(np.asarray(w.get(k, nan), np.float64) for w in ws)
    late_sums = {k: total(late, k) for k in stats.FIELDS}
    out.update(stats.derived(late_sums))
    late_steps = sum(int(w.get('num_steps', 1)) for w in late)
    out['exposure'] = np.asarray(windows[-1].get('cumulative_count', total(windows, 'count')),
                                 dtype=np.float64)
    out['row_grad'] = np.sqrt(late_sums['row_sq'] / max(late_steps, 1))
    out['update_rss'] = np.sqrt(total(windows, 'update_sq'))
    out['scored_total'] = total(windows, 'loss_count')
  if tables:
    steps = sorted(tables)
    out['drift'] = analysis.drift(tables[steps[-1]], tables[steps[0]])
    out['row_norm'] = analysis.row_norms(tables[steps[-1]])
  return out


def step_seconds(run_dir: str) -> float:
  """Steady-state wall-clock seconds per training step, from ``metrics.jsonl``.

  Uses the ``elapsed`` of the training rows after the first (the first logging window
  includes compilation): ``(elapsed_last - elapsed_first) / (step_last - step_first)``.
  NaN with fewer than two training rows. A run resumed mid-way adds its restart to
  ``elapsed``; sweeps rarely resume, and the value is wall-clock on a possibly shared
  machine, so treat it as indicative.
  """
  path = os.path.join(run_dir, 'metrics.jsonl')
  if not os.path.exists(path):
    return float('nan')
  rows = []
  with open(path) as f:
    for line in f:
      line = line.strip()
      if line:
        row = json.loads(line)
        if 'elapsed' in row and 'eval' not in row:
          rows.append((int(row['step']), float(row['elapsed'])))
  if len(rows) < 2 or rows[-1][0] <= rows[0][0]:
    return float('nan')
  return (rows[-1][1] - rows[0][1]) / (rows[-1][0] - rows[0][0])


def _pearson(x: np.ndarray, y: np.ndarray) -> float:
  """``scipy.stats.pearsonr`` over the entries finite in both; NaN below 3 of them or for a
  constant input."""
  ok = np.isfinite(x) & np.isfinite(y)
  if ok.sum() < 3 or np.ptp(x[ok]) == 0 or np.ptp(y[ok]) == 0:
    return float('nan')
  return float(scipy.stats.pearsonr(x[ok], y[ok]).statistic)


def run_measures(run_dir: str, eval_results: Mapping[str, Any], num_steps: int,
                 train_seconds: float = float('nan'),
                 per_position: Mapping[str, np.ndarray] | None = None,
                 rare_exposure: float = 100.0) -> dict[str, Any]:
  """All measures of one finished run.

  Args:
    run_dir: the run's workdir.
    eval_results: the evaluation results dict of the final step.
    num_steps: optimizer steps of the run.
    train_seconds: wall-clock seconds of training (from the sweep).
    per_position: the evaluation's per-position vectors (``loss``, ``bayes_loss``, each
      ``[L]``), for the rare-row measures.
    rare_exposure: rows with fewer cumulative training tokens than this are "rare".

  Returns:
    ``{'scalars': {name: float}, 'vectors': {name: [per bucket]}, 'buckets': [[start, end]]}``.
  """
  buckets = eval_results['buckets']
  edges = [(int(b['start']), int(b['end'])) for b in buckets]
  get = lambda key: np.array([float(b.get(key, float('nan'))) for b in buckets])
  vec: dict[str, np.ndarray] = {'bucket_loss': get('loss'), 'bucket_excess': get('excess_loss'),
                                'bucket_recovered': get('recovered')}
  pos = position_vectors(load_windows(run_dir), num_steps, load_tables(run_dir))
  for name in VECTORS[3:]:
    key = DERIVED.get(name, name[len('bucket_'):])
    vec[name] = (bucket_means(pos[key], edges) if key in pos
                 else np.full(len(edges), np.nan))
  overall = eval_results.get('overall', {})
  overall_loss = overall.get('loss') if isinstance(overall, Mapping) else overall
  deg = eval_results.get('degradation', {})
  deg = deg.get('last_minus_best', deg.get('value', float('nan'))) if isinstance(
      deg, Mapping) else deg
  late_over_early = lambda v: (float(v[-1] / v[0]) if v[0] and np.isfinite(v[0])
                               else float('nan'))
  s: dict[str, float] = {
      'final_loss': float(overall_loss if overall_loss is not None else np.nanmean(get('loss'))),
      'loss_early': float(vec['bucket_loss'][0]),
      'loss_late': float(vec['bucket_loss'][-1]),
      'degradation': float(deg) if deg is not None else float('nan'),
      'excess_early': float(vec['bucket_excess'][0]),
      'excess_late': float(vec['bucket_excess'][-1]),
      'recovered_early': float(vec['bucket_recovered'][0]),
      'recovered_late': float(vec['bucket_recovered'][-1]),
      'update_rss_late': float(vec['bucket_update_rss'][-1]),
      'drift_late': float(vec['bucket_drift'][-1]),
      'drift_mean': float(np.nanmean(pos['drift'])) if 'drift' in pos else float('nan'),
      'train_seconds': float(train_seconds),
      'step_seconds': step_seconds(run_dir),
  }
  s['loss_late_minus_early'] = s['loss_late'] - s['loss_early']
  s['excess_late_minus_early'] = s['excess_late'] - s['excess_early']
  for name, v in (('exposure', 'bucket_exposure'), ('row_grad', 'bucket_row_grad'),
                  ('occ_signal', 'bucket_occ_signal'),
                  ('downstream_signal', 'bucket_downstream_signal'),
                  ('update', 'bucket_update_rss'), ('drift', 'bucket_drift'),
                  ('row_norm', 'bucket_row_norm')):
    s[f'{name}_late_over_early'] = late_over_early(vec[v])
  s['signal_loss_corr'] = _pearson(pos.get('signal_per_occurrence', np.array([])),
                                   pos.get('mean_loss', np.array([])))
  scored = float(pos['scored_total'].sum()) if 'scored_total' in pos else float('nan')
  s['tokens_per_step'] = scored / num_steps if num_steps else float('nan')
  s['train_tokens_per_second'] = (scored / train_seconds if train_seconds and
                                  math.isfinite(train_seconds) else float('nan'))
  s.update(_rare_rows(pos, per_position, rare_exposure))
  probe = eval_results.get('offset_probe') or {}
  by_offset = {int(p['offset']): p['overall']['loss'] for p in probe.get('by_offset', [])}
  for k, loss in by_offset.items():
    if k and 0 in by_offset and loss is not None and by_offset[0] is not None:
      s[f'offset_penalty_{k}'] = float(loss) - float(by_offset[0])
  return {'scalars': s, 'vectors': {k: [float(x) for x in v] for k, v in vec.items()},
          'buckets': [list(e) for e in edges]}


def _rare_rows(pos: Mapping[str, np.ndarray], per_position: Mapping[str, np.ndarray] | None,
               rare_exposure: float) -> dict[str, float]:
  """Held-out loss (and excess over Bayes) of rare vs common rows of the second half.

  Where the late-position penalty sits: in every second-half row, or only in rows seen
  fewer than ``rare_exposure`` times. NaN where a group is empty.
  """
  out = {k: float('nan') for k in ('rare_row_fraction', 'loss_rare_rows', 'loss_common_late_rows',
                                   'excess_rare_rows', 'excess_common_late_rows')}
  if per_position is None or 'exposure' not in pos or 'loss' not in per_position:
    return out
  loss = np.asarray(per_position['loss'], np.float64)
  n = len(loss)
  exposure = np.asarray(pos['exposure'], np.float64)[:n]
  late = np.arange(n) >= n // 2
  rare = late & (exposure < rare_exposure)
  common = late & ~rare
  out['rare_row_fraction'] = float(rare.sum() / max(late.sum(), 1))
  mean = lambda v, m: float(np.nanmean(v[m])) if m.any() else float('nan')
  out['loss_rare_rows'] = mean(loss, rare)
  out['loss_common_late_rows'] = mean(loss, common)
  if 'bayes_loss' in per_position:
    excess = loss - np.asarray(per_position['bayes_loss'], np.float64)[:n]
    out['excess_rare_rows'] = mean(excess, rare)
    out['excess_common_late_rows'] = mean(excess, common)
  return out


def cosine_structure(table: np.ndarray) -> np.ndarray:
  """Upper-triangle entries of ``analysis.cosine_similarity(table)``; ``[P*(P-1)/2]``."""
  cos = analysis.cosine_similarity(table)
  return cos[np.triu_indices(cos.shape[0], k=1)]


def structure_agreement(tables: Mapping[str, np.ndarray]) -> float:
  """Mean pairwise Pearson correlation of cosine structures across arms (one step).

  Args:
    tables: arm -> ``[max_len, emb_dim]`` table at one step.

  Returns:
    Agreement in [-1, 1] (1: identical similarity structure); a structure with no variance
    (all-zero table) counts as 0 against every other.
  """
  structs = [cosine_structure(t) for t in tables.values()]
  vals = []
  for i in range(len(structs)):
    for j in range(i + 1, len(structs)):
      c = _pearson(structs[i], structs[j])
      vals.append(0.0 if not math.isfinite(c) else c)
  return float(np.mean(vals)) if vals else float('nan')


def convergence_step(run_dirs: Mapping[str, str], threshold: float) -> dict[str, Any]:
  """When the inits' tables reach a common cosine-similarity structure (one seed).

  Args:
    run_dirs: arm -> run directory (same seed, different inits).
    threshold: agreement (``structure_agreement``) counted as converged.

  Returns:
    ``{'steps': [...], 'agreement': [...], 'converged_step': first step from which the
    agreement stays >= threshold (NaN if never)}``.
  """
  snaps = {a: load_tables(d) for a, d in run_dirs.items()}
  common = sorted(set.intersection(*(set(s) for s in snaps.values()))) if snaps else []
  agreement = [structure_agreement({a: s[step] for a, s in snaps.items()}) for step in common]
  converged = float('nan')
  for i, step in enumerate(common):
    if all(a >= threshold for a in agreement[i:]):
      converged = float(step)
      break
  return {'steps': common, 'agreement': agreement, 'converged_step': converged}


def load_json(path: str) -> Any:
  with open(path) as f:
    return json.load(f)
