"""Paired t intervals over seeds, the fixed verdict rule and Holm-Bonferroni
correction."""

from collections.abc import Mapping, Sequence
import dataclasses
import math
import warnings

import numpy as np
from scipy import stats

SUPPORTED = 'supported'
CONTRADICTED = 'contradicted'
INCONCLUSIVE = 'inconclusive at this scale'
# No seed has a finite value of the metric for both arms.
NOT_MEASURED = 'not measured'
DIRECTIONS = ('greater', 'less', 'equivalent')


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
  of the band)."""
  x = _finite(values)

  # alpha at which low > c
  def above(c):
    return 2.0 * float(_ttest(x, c, 'greater').pvalue)

  # alpha at which high < c
  def below(c):
    return 2.0 * float(_ttest(x, c, 'less').pvalue)

  if direction == 'equivalent':
    p = min(
        max(above(-margin), below(margin)), min(above(margin), below(-margin))
    )
  else:
    p = min(above(0.0), below(0.0))
  # NaN below two values: never decisive.
  return min(1.0, p) if math.isfinite(p) else 1.0


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
