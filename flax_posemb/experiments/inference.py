"""Measures of the held-out windows, judged over seeds and documents
(docs/DESIGN.md § Experiments outputs).

Every run of an experiment is scored on the same windows, so a measure of those
windows (a bucket's loss, late minus mid, the offset penalty) has two sources of
error: the seeds (training) and the documents the windows come from. Measures of
training alone (exposure, gradients, updates, wall-clock) have only the first
and are judged over seeds (`paired.judge`).
"""

from collections.abc import Mapping, Sequence
import dataclasses
import functools
import os
from typing import Any

import numpy as np

from flax_posemb import buckets
from flax_posemb import outputs
from flax_posemb.experiments import measures
from flax_posemb.experiments import sweep

# Per-bucket vectors of the windows (the report's profiles).
WINDOW_VECTORS = ('bucket_loss', 'bucket_excess', 'bucket_recovered')
# Scalars of the windows; and 'offset_penalty_K'.
WINDOW_SCALARS = (
    'final_loss',
    'loss_early',
    'loss_mid',
    'loss_late',
    'loss_late_minus_early',
    'loss_late_minus_mid',
    'excess_early',
    'excess_late',
    'excess_late_minus_early',
    'excess_late_minus_mid',
    'recovered_early',
    'recovered_late',
)
OFFSET_PENALTY = 'offset_penalty_'


def is_window_metric(metric: str) -> bool:
  """Whether ``metric`` is a measure of the evaluation windows."""
  return (
      metric in WINDOW_SCALARS
      or metric in WINDOW_VECTORS
      or metric.startswith(OFFSET_PENALTY)
  )


@dataclasses.dataclass(frozen=True)
class Term:
  """``weight`` x the loss of ``bucket`` (None: all buckets) of the windows of
  pass ``scored`` ('eval', or 'offset_K' of the offset probe)."""

  scored: str
  bucket: int | None
  weight: float


@dataclasses.dataclass(frozen=True)
class Windows:
  """What a run's evaluation left for inference."""

  results: dict[str, Any]
  # 'eval' or 'offset_K' -> windows.npz contents of that pass.
  passes: dict[str, dict[str, np.ndarray]]


@functools.lru_cache(maxsize=512)
def load(run_dir: str) -> Windows:
  """The evaluation windows of a finished run (sweep.EVAL_DIR)."""
  eval_dir = os.path.join(run_dir, sweep.EVAL_DIR)
  results = measures.load_json(os.path.join(eval_dir, 'results.json'))
  passes = {'eval': outputs.load_npz(os.path.join(eval_dir, sweep.WINDOWS))}
  probe = results.get('offset_probe') or {}
  for k in probe.get('offsets', []):
    path = os.path.join(eval_dir, sweep.PROBE_WINDOWS.format(k))
    passes[f'offset_{k}'] = outputs.load_npz(path)
  return Windows(results, passes)


def has_windows(run_dir: str) -> bool:
  """Whether the run kept its evaluation windows
  (`experiment_eval/windows.npz`)."""
  return os.path.exists(os.path.join(run_dir, sweep.EVAL_DIR, sweep.WINDOWS))


def _bucket_constants(results: Mapping[str, Any], key: str) -> np.ndarray:
  return np.array(
      [np.nan if b.get(key) is None else b[key] for b in results['buckets']],
      np.float64,
  )


def terms(
    metric: str, results: Mapping[str, Any], mid: int, bucket: int = -1
) -> tuple[list[Term], float]:
  """``metric`` of a run as ``constant + sum(weight x bucket loss)``.

  Args:
    metric: a `WINDOW_SCALARS` or `WINDOW_VECTORS` name, or 'offset_penalty_K'
      (the probe's loss at shift K minus at its first shift, all buckets).
    results: the run's results.json (the synthetic corpus' Bayes and filter
      losses per bucket, which every run on the same windows shares).
    mid: the experiment's pre-registered mid bucket (``loss_mid``).
    bucket: the bucket of a vector metric.

  Returns:
    The terms and the constant.
  """
  last = len(results['buckets']) - 1
  if metric.startswith(OFFSET_PENALTY):
    first = (results.get('offset_probe') or {}).get('offsets', [0])[0]
    shift = metric.removeprefix(OFFSET_PENALTY)
    return [
        Term(f'offset_{shift}', None, 1.0),
        Term(f'offset_{first}', None, -1.0),
    ], 0.0
  if metric == 'final_loss':
    return [Term('eval', None, 1.0)], 0.0
  if metric in WINDOW_VECTORS:
    kind = metric.removeprefix('bucket_')
    i = bucket
  else:
    kind, _, where = metric.partition('_')
    index = {'early': 0, 'mid': mid, 'late': last}
    if where.startswith('late_minus_') and kind in ('loss', 'excess'):
      other = index[where.removeprefix('late_minus_')]
      pair = [Term('eval', last, 1.0), Term('eval', other, -1.0)]
      if kind == 'loss':
        return pair, 0.0
      bayes = _bucket_constants(results, 'bayes_loss')
      return pair, -float(bayes[last] - bayes[other])
    i = index[where]
  bayes_i = float(_bucket_constants(results, 'bayes_loss')[i])
  filt = float(_bucket_constants(results, 'filter_loss')[i])
  if kind == 'loss':
    return [Term('eval', i, 1.0)], 0.0
  if kind == 'excess':
    return [Term('eval', i, 1.0)], -bayes_i
  if kind == 'recovered':
    # (filter - loss) / (filter - bayes)
    gap = filt - bayes_i
    return [Term('eval', i, -1.0 / gap)], filt / gap
  raise ValueError(f'no window metric {metric!r}.')


def _same_windows(runs: Sequence[Windows]) -> np.ndarray:
  """The documents of the windows ``[G]``, checking that every run was scored
  on the same windows."""
  first = np.sort(runs[0].passes['eval']['window_id'])
  for run in runs[1:]:
    if not np.array_equal(np.sort(run.passes['eval']['window_id']), first):
      raise ValueError(
          'runs of one experiment were evaluated on different windows; '
          'evaluate them again with the same eval settings.'
      )
  return np.unique(np.asarray(runs[0].passes['eval']['doc'], np.int64))


def _components(
    run: Windows,
    metric_terms: list[Term],
    documents: np.ndarray,
    select: Any,
) -> tuple[np.ndarray, np.ndarray]:
  """Per-document sums and counts ``[G, len(metric_terms)]`` of one run."""
  keep = None if select is None else select(run.passes['eval'])
  sums = []
  counts = []
  for term in metric_terms:
    windows = run.passes[term.scored]
    if keep is not None:
      windows = {
          k: v if k == 'edges' else np.asarray(v)[keep]
          for k, v in windows.items()
      }
    per_doc_sums, per_doc_counts = buckets.document_sums(windows, documents)
    if term.bucket is None:
      sums.append(per_doc_sums.sum(1))
      counts.append(per_doc_counts.sum(1))
    else:
      sums.append(per_doc_sums[:, term.bucket])
      counts.append(per_doc_counts[:, term.bucket])
  return np.stack(sums, -1), np.stack(counts, -1)


def estimate(
    metric: str,
    arm: Mapping[int, str],
    baseline: Mapping[int, str] | None = None,
    *,
    mid: int = 0,
    bucket: int = -1,
    select: Any = None,
) -> dict[str, Any]:
  """``metric(arm) - metric(baseline)`` (no baseline: of the arm) over the seeds
  both have, with its seeds x documents interval.

  Args:
    metric: see `terms`.
    arm: seed -> run dir.
    baseline: seed -> run dir, or None.
    mid: the pre-registered mid bucket.
    bucket: the bucket of a vector metric.
    select: ``(windows.npz contents) -> [W] bool``, the windows to use (a
      window group); None: all.

  Returns:
    `buckets.seed_document_contrast`'s dict plus ``seed_ids``.
  """
  sides = [(arm, 1.0)]
  if baseline:
    sides.append((baseline, -1.0))
  seeds = sorted(set.intersection(*(set(side) for side, _ in sides)))
  runs = {
      (s, i): load(side[s]) for s in seeds for i, (side, _) in enumerate(sides)
  }
  if not seeds:
    empty = np.zeros((0, 0, 1))
    out = buckets.seed_document_contrast(empty, empty, np.ones(1))
    return dict(out, seed_ids=[])
  documents = _same_windows(list(runs.values()))
  weights = []
  constant = 0.0
  for i, (_, sign) in enumerate(sides):
    metric_terms, offset = terms(metric, runs[seeds[0], i].results, mid, bucket)
    weights += [sign * term.weight for term in metric_terms]
    constant += sign * offset
  sums = []
  counts = []
  for s in seeds:
    parts = [
        _components(
            runs[s, i],
            terms(metric, runs[s, i].results, mid, bucket)[0],
            documents,
            select,
        )
        for i in range(len(sides))
    ]
    sums.append(np.concatenate([p[0] for p in parts], -1))
    counts.append(np.concatenate([p[1] for p in parts], -1))
  out = buckets.seed_document_contrast(
      np.stack(sums), np.stack(counts), np.asarray(weights)
  )
  for key in ('mean', 'low', 'high'):
    out[key] += constant
  out['per_seed'] = [x + constant for x in out['per_seed']]
  out['seed_ids'] = seeds
  return out
