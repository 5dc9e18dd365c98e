"""Paired statistics across seeds and the fixed verdict rule of an experiment.

Every experiment pairs its arms by seed: run ``(arm, seed)`` and run ``(baseline, seed)``
share the data-order and model-init seed, so the per-seed difference
``d_s = metric(arm, s) - metric(baseline, s)`` cancels whatever the seed contributes to
both. The claim is judged on the 95% Student-t interval of the mean of ``d_s``
(``n - 1`` degrees of freedom), with a rule fixed in the experiment config before running:

* directional claims (``direction`` 'greater' or 'less': the predicted sign of ``d``):
  'supported' when the interval excludes 0 on the predicted side, 'contradicted' when it
  excludes 0 on the other side, otherwise 'inconclusive at this scale';
* equivalence claims (``direction`` 'equivalent', with a ``margin`` > 0): 'supported' when
  the whole interval lies inside ``[-margin, margin]``, 'contradicted' when the whole
  interval lies outside it (it excludes the band on one side), otherwise inconclusive.

Fewer than two seeds give no interval and the verdict is always inconclusive.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Mapping, Sequence

import numpy as np
from scipy import stats as scipy_stats

SUPPORTED = 'supported'
CONTRADICTED = 'contradicted'
INCONCLUSIVE = 'inconclusive at this scale'
NOT_MEASURED = 'not measured'  # No seed has a finite value of the metric for both arms.
DIRECTIONS = ('greater', 'less', 'equivalent')


@dataclasses.dataclass(frozen=True)
class Interval:
  """Mean of a sample with its two-sided Student-t confidence interval.

  Attributes:
    mean: sample mean (NaN when the sample is empty).
    low: lower bound (NaN when fewer than two finite values).
    high: upper bound (NaN when fewer than two finite values).
    n: number of finite values used.
    stderr: standard error of the mean (NaN when n < 2).
    level: confidence level, e.g. 0.95.
  """
  mean: float
  low: float
  high: float
  n: int
  stderr: float
  level: float = 0.95

  def as_dict(self) -> dict[str, float | int]:
    return dataclasses.asdict(self)


def t_interval(values: Sequence[float] | np.ndarray, level: float = 0.95) -> Interval:
  """Student-t interval of the mean of ``values``, ignoring non-finite entries.

  Args:
    values: sample, shape ``[n]``.
    level: two-sided confidence level in (0, 1).

  Returns:
    The ``Interval`` (bounds NaN when fewer than two finite values).
  """
  if not 0.0 < level < 1.0:
    raise ValueError(f'confidence level must be in (0, 1), got {level}.')
  x = np.asarray(values, dtype=np.float64).reshape(-1)
  x = x[np.isfinite(x)]
  n = int(x.size)
  if n == 0:
    nan = float('nan')
    return Interval(nan, nan, nan, 0, nan, level)
  mean = float(x.mean())
  if n < 2:
    nan = float('nan')
    return Interval(mean, nan, nan, n, nan, level)
  stderr = float(x.std(ddof=1) / math.sqrt(n))
  half = float(scipy_stats.t.ppf(0.5 + level / 2.0, df=n - 1)) * stderr
  return Interval(mean, mean - half, mean + half, n, stderr, level)


def paired_differences(arm: Mapping[int, float], baseline: Mapping[int, float]
                       ) -> tuple[list[int], np.ndarray]:
  """Per-seed differences ``arm[s] - baseline[s]`` over the seeds both have.

  Args:
    arm: seed -> metric value of the arm.
    baseline: seed -> metric value of the baseline arm.

  Returns:
    ``(seeds, d)``: the shared seeds in ascending order and ``d`` of shape ``[len(seeds)]``.
  """
  seeds = sorted(set(arm) & set(baseline))
  d = np.array([float(arm[s]) - float(baseline[s]) for s in seeds], dtype=np.float64)
  return seeds, d


def verdict(interval: Interval, direction: str, margin: float = 0.0) -> str:
  """Applies the fixed verdict rule (module docstring) to a paired-difference interval.

  Args:
    interval: interval of the mean paired difference ``arm - baseline``.
    direction: 'greater' (predicts d > 0), 'less' (d < 0) or 'equivalent' (|d| < margin).
    margin: equivalence half-width; required > 0 for 'equivalent'.

  Returns:
    One of ``SUPPORTED``, ``CONTRADICTED``, ``INCONCLUSIVE``.
  """
  if direction not in DIRECTIONS:
    raise ValueError(f'unknown claim direction {direction!r}; use one of {DIRECTIONS}.')
  if direction == 'equivalent' and not margin > 0:
    raise ValueError('an "equivalent" claim needs margin > 0 (the largest difference that '
                     f'still counts as "similar"), got {margin}.')
  lo, hi = interval.low, interval.high
  if not (math.isfinite(lo) and math.isfinite(hi)):
    return INCONCLUSIVE
  if direction == 'greater':
    return SUPPORTED if lo > 0 else CONTRADICTED if hi < 0 else INCONCLUSIVE
  if direction == 'less':
    return SUPPORTED if hi < 0 else CONTRADICTED if lo > 0 else INCONCLUSIVE
  if -margin < lo and hi < margin:
    return SUPPORTED
  if lo > margin or hi < -margin:
    return CONTRADICTED
  return INCONCLUSIVE


def judge(arm: Mapping[int, float], baseline: Mapping[int, float], direction: str,
          margin: float = 0.0, level: float = 0.95) -> dict:
  """Paired difference, its interval and the verdict, as a JSON-ready dict.

  Args:
    arm: seed -> metric of the arm.
    baseline: seed -> metric of the baseline.
    direction: see ``verdict``.
    margin: see ``verdict``.
    level: confidence level.

  Returns:
    ``{'seeds', 'differences', 'interval': {...}, 'verdict'}``; the verdict is
    ``NOT_MEASURED`` when no seed has a finite difference.
  """
  seeds, d = paired_differences(arm, baseline)
  interval = t_interval(d, level)
  v = verdict(interval, direction, margin) if interval.n else NOT_MEASURED
  return {'seeds': seeds, 'differences': [float(x) for x in d],
          'interval': interval.as_dict(), 'verdict': v}
