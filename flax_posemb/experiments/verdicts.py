"""Claims -> verdicts: the fixed verdict rule on a claim's paired interval and
Holm-Bonferroni over an experiment's claims (docs/DESIGN.md § Intervals and
verdicts). The intervals and p values come from `flax_posemb.inference`."""

from collections.abc import Mapping, Sequence
import math
from typing import Any

import numpy as np

from flax_posemb import inference

SUPPORTED = 'supported'
CONTRADICTED = 'contradicted'
INCONCLUSIVE = 'inconclusive at this scale'
# No seed has a finite value of the metric for both arms.
NOT_MEASURED = 'not measured'
DIRECTIONS = ('greater', 'less', 'equivalent')


def verdict(
    interval: inference.Interval, direction: str, margin: float = 0.0
) -> str:
  """The fixed rule on the interval of the mean paired difference ``arm -
  baseline`` (docs/DESIGN.md § Intervals and verdicts).

  Args:
    interval: the difference's interval (NaN bounds: inconclusive).
    direction: the prediction, one of `DIRECTIONS`.
    margin: the equivalence band's half-width.

  Returns:
    `SUPPORTED`, `CONTRADICTED` or `INCONCLUSIVE`.
  """
  # NaN bounds (n < 2) fail every test: inconclusive.
  low = interval.low
  high = interval.high
  if direction == 'greater':
    if low > 0:
      return SUPPORTED
    if high < 0:
      return CONTRADICTED
    return INCONCLUSIVE
  if direction == 'less':
    if high < 0:
      return SUPPORTED
    if low > 0:
      return CONTRADICTED
    return INCONCLUSIVE
  if -margin < low and high < margin:
    return SUPPORTED
  if low > margin or high < -margin:
    return CONTRADICTED
  return INCONCLUSIVE


def judge(
    arm: Mapping[int, float],
    baseline: Mapping[int, float],
    direction: str,
    margin: float = 0.0,
    level: float = 0.95,
) -> dict:
  """Interval, verdict and p value of a paired claim, over seeds.

  Args:
    arm: seed -> the arm's value of the metric.
    baseline: seed -> the baseline's value (the seeds both have pair).
    direction: the prediction, one of `DIRECTIONS`.
    margin: the equivalence band's half-width.
    level: the interval's coverage.

  Returns:
    ``{'seeds', 'differences', 'interval', 'verdict', 'p_value'}``
    (`NOT_MEASURED` when no seed has both values).
  """
  seeds = sorted(set(arm) & set(baseline))
  differences = np.array(
      [float(arm[seed]) - float(baseline[seed]) for seed in seeds], np.float64
  )
  interval = inference.t_interval(differences, level)
  if interval.n:
    judged = verdict(interval, direction, margin)
  else:
    judged = NOT_MEASURED
  return {
      'seeds': seeds,
      'differences': [float(x) for x in differences],
      'interval': interval.as_dict(),
      'verdict': judged,
      'p_value': inference.decision_p_value(differences, direction, margin),
  }


def with_holm(judgements: Sequence[dict], alpha: float = 0.05) -> list[dict]:
  """Holm-Bonferroni over the measured claims.

  Args:
    judgements: `judge` or `judge_estimate` outputs.
    alpha: the family-wise error rate.

  Returns:
    The judgements plus ``p_holm`` and ``verdict_holm`` (the verdict where
    ``p_holm < alpha``, else `INCONCLUSIVE`; `NOT_MEASURED` and NaN for the
    unmeasured).
  """
  out = [
      dict(judgement, p_holm=float('nan'), verdict_holm=NOT_MEASURED)
      for judgement in judgements
  ]
  tested = [
      judgement for judgement in out if judgement['verdict'] != NOT_MEASURED
  ]
  adjusted = inference.holm([judgement['p_value'] for judgement in tested])
  for judgement, p in zip(tested, adjusted):
    judgement['p_holm'] = float(p)
    if p < alpha:
      judgement['verdict_holm'] = judgement['verdict']
    else:
      judgement['verdict_holm'] = INCONCLUSIVE
  return out


def contrast_interval(contrast: Mapping[str, Any]) -> dict[str, Any]:
  """The interval record (``summary.json``) of a seeds x documents estimate.

  Args:
    contrast: `inference.seed_document_contrast`'s dict.

  Returns:
    The keys of `inference.Interval` (``n``: seeds) plus ``df``,
    ``documents``, ``seed_stderr``, ``document_stderr`` and ``method``
    (`inference.SEEDS_AND_DOCUMENTS`).
  """
  return {
      'mean': contrast['mean'],
      'low': contrast['low'],
      'high': contrast['high'],
      'n': contrast['seeds'],
      'stderr': contrast['stderr'],
      'level': contrast['level'],
      'df': contrast['df'],
      'documents': contrast['documents'],
      'seed_stderr': contrast['seed_stderr'],
      'document_stderr': contrast['document_stderr'],
      'method': inference.SEEDS_AND_DOCUMENTS,
  }


def judge_estimate(
    estimate: Mapping[str, Any], direction: str, margin: float = 0.0
) -> dict:
  """`judge`'s output for a seeds x documents estimate of ``arm - baseline``.

  Args:
    estimate: `window_measures.estimate`'s dict.
    direction: the prediction, one of `DIRECTIONS`.
    margin: the equivalence band's half-width.

  Returns:
    As `judge`, with the interval of `contrast_interval`.
  """
  interval = contrast_interval(estimate)
  bounds = inference.Interval(
      interval['mean'],
      interval['low'],
      interval['high'],
      interval['n'],
      interval['stderr'],
  )
  measured = interval['n'] > 0 and math.isfinite(interval['mean'])
  return {
      'seeds': estimate['seed_ids'],
      'differences': estimate['per_seed'],
      'interval': interval,
      'verdict': (
          verdict(bounds, direction, margin) if measured else NOT_MEASURED
      ),
      'p_value': inference.estimate_p_value(
          interval['mean'],
          interval['stderr'],
          interval['df'],
          direction,
          margin,
      ),
  }
