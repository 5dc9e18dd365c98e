"""Paired t intervals over seeds, the fixed verdict rule and Holm-Bonferroni
correction."""

from collections.abc import Mapping, Sequence
import dataclasses
import math
from typing import Any
import warnings

import numpy as np
from scipy import stats

SUPPORTED = 'supported'
CONTRADICTED = 'contradicted'
INCONCLUSIVE = 'inconclusive at this scale'
# No seed has a finite value of the metric for both arms.
NOT_MEASURED = 'not measured'
DIRECTIONS = ('greater', 'less', 'equivalent')
# How an interval was made: Student-t over seeds, or over seeds and documents
# (measures of the evaluation windows: buckets.seed_document_contrast).
SEEDS = 'seeds'
SEEDS_AND_DOCUMENTS = 'seeds x documents'


@dataclasses.dataclass(frozen=True)
class Interval:
  """Sample mean with its two-sided Student-t interval (bounds and stderr NaN if
  n < 2)."""

  mean: float
  low: float
  high: float
  n: int
  stderr: float
  level: float = 0.95

  def as_dict(self) -> dict[str, float | int]:
    """The fields as a dict (`summary.json`)."""
    return dataclasses.asdict(self)


def _finite(values: Sequence[float] | np.ndarray) -> np.ndarray:
  x = np.asarray(values, dtype=np.float64).reshape(-1)
  return x[np.isfinite(x)]


def _ttest(x: np.ndarray, popmean: float, alternative: str = 'two-sided'):
  # Identical values (zero spread): a point interval, no warning.
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)
    return stats.ttest_1samp(x, popmean, alternative=alternative)


def t_interval(
    values: Sequence[float] | np.ndarray, level: float = 0.95
) -> Interval:
  """Student-t interval of the mean of the finite entries of ``values`` (shape
  ``[n]``)."""
  x = _finite(values)
  nan = float('nan')
  if x.size < 2:
    return Interval(
        float(x.mean()) if x.size else nan, nan, nan, int(x.size), nan, level
    )
  ci = _ttest(x, 0.0).confidence_interval(level)
  return Interval(
      float(x.mean()),
      float(ci.low),
      float(ci.high),
      int(x.size),
      float(stats.sem(x)),
      level,
  )


def decision_p_value(
    values: Sequence[float] | np.ndarray, direction: str, margin: float = 0.0
) -> float:
  """Smallest alpha at which the (1 - alpha) interval of ``values`` ``[n]`` is
  decisive under ``verdict`` (equivalent: TOST, or the interval beyond one side
  of the band); 1 below two values."""
  x = _finite(values)
  if x.size < 2:
    return 1.0
  stderr = float(np.std(x, ddof=1)) / math.sqrt(x.size)
  return estimate_p_value(
      float(x.mean()), stderr, float(x.size - 1), direction, margin
  )


def holm(p_values: Sequence[float]) -> np.ndarray:
  """Holm-Bonferroni adjusted p-values, in the input order (scipy has no
  Holm)."""
  p = np.asarray(p_values, dtype=np.float64)
  m = p.size
  order = np.argsort(p, kind='stable')
  out = np.empty(m)
  out[order] = np.minimum(
      1.0, np.maximum.accumulate(p[order] * (m - np.arange(m)))
  )
  return out


def verdict(interval: Interval, direction: str, margin: float = 0.0) -> str:
  """The fixed rule on the interval of the mean paired difference ``arm -
  baseline``."""
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
  """Interval, verdict and p value of a paired claim (seed -> metric maps)."""
  seeds = sorted(set(arm) & set(baseline))
  differences = np.array(
      [float(arm[seed]) - float(baseline[seed]) for seed in seeds], np.float64
  )
  interval = t_interval(differences, level)
  if interval.n:
    judged = verdict(interval, direction, margin)
  else:
    judged = NOT_MEASURED
  return {
      'seeds': seeds,
      'differences': [float(x) for x in differences],
      'interval': interval.as_dict(),
      'verdict': judged,
      'p_value': decision_p_value(differences, direction, margin),
  }


def with_holm(judgements: Sequence[dict], alpha: float = 0.05) -> list[dict]:
  """``judge`` outputs plus ``p_holm`` and ``verdict_holm`` over the measured
  ones."""
  out = [
      dict(judgement, p_holm=float('nan'), verdict_holm=NOT_MEASURED)
      for judgement in judgements
  ]
  tested = [
      judgement for judgement in out if judgement['verdict'] != NOT_MEASURED
  ]
  adjusted = holm([judgement['p_value'] for judgement in tested])
  for judgement, p in zip(tested, adjusted):
    judgement['p_holm'] = float(p)
    if p < alpha:
      judgement['verdict_holm'] = judgement['verdict']
    else:
      judgement['verdict_holm'] = INCONCLUSIVE
  return out


def estimate_interval(estimate: Mapping[str, Any]) -> dict[str, Any]:
  """The interval dict of a `buckets.seed_document_contrast` estimate, with the
  keys of `Interval` (``n``: seeds) and how it was made."""
  return {
      'mean': estimate['mean'],
      'low': estimate['low'],
      'high': estimate['high'],
      'n': estimate['seeds'],
      'stderr': estimate['stderr'],
      'level': estimate['level'],
      'df': estimate['df'],
      'documents': estimate['documents'],
      'seed_stderr': estimate['seed_stderr'],
      'document_stderr': estimate['document_stderr'],
      'method': SEEDS_AND_DOCUMENTS,
  }


def estimate_p_value(
    mean: float,
    stderr: float,
    df: float,
    direction: str,
    margin: float = 0.0,
) -> float:
  """`decision_p_value` of a t estimate (``mean``, ``stderr``, ``df``)."""
  if not (math.isfinite(stderr) and math.isfinite(df) and df > 0):
    return 1.0

  def statistic(c):
    if stderr == 0:
      return math.copysign(math.inf, mean - c) if mean != c else math.nan
    return (mean - c) / stderr

  # alpha at which low > c
  def above(c):
    return 2.0 * float(stats.t.sf(statistic(c), df))

  # alpha at which high < c
  def below(c):
    return 2.0 * float(stats.t.cdf(statistic(c), df))

  if direction == 'equivalent':
    p = min(
        max(above(-margin), below(margin)), min(above(margin), below(-margin))
    )
  else:
    p = min(above(0.0), below(0.0))
  return min(1.0, p) if math.isfinite(p) else 1.0


def judge_estimate(
    estimate: Mapping[str, Any], direction: str, margin: float = 0.0
) -> dict:
  """`judge`'s output for a seeds x documents estimate of ``arm - baseline``."""
  interval = estimate_interval(estimate)
  bounds = Interval(
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
      'p_value': estimate_p_value(
          interval['mean'],
          interval['stderr'],
          interval['df'],
          direction,
          margin,
      ),
  }
