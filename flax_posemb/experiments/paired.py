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

Multiplicity: an experiment tests several claims. The verdict above is the primary one (each
claim's own 95% interval, as fixed before running). ``with_holm`` adds the Holm-Bonferroni
correction over all measured claims of the experiment: each claim's ``decision_p_value`` (the
smallest alpha at which its interval is decisive) is adjusted, and ``verdict_holm`` is the
primary verdict when the adjusted p-value is < 0.05, else inconclusive. The report gives both
where they differ.
"""

from __future__ import annotations

import dataclasses
import math
import warnings
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
  """Student-t interval of the mean of ``values``, ignoring non-finite entries
  (``scipy.stats.ttest_1samp(...).confidence_interval``).

  Args:
    values: sample, shape ``[n]``.
    level: two-sided confidence level in (0, 1).

  Returns:
    The ``Interval`` (bounds NaN when fewer than two finite values).
  """
  if not 0.0 < level < 1.0:
    raise ValueError(f'confidence level must be in (0, 1), got {level}.')
  x = _finite(values)
  nan = float('nan')
  if x.size < 2:
    return Interval(float(x.mean()) if x.size else nan, nan, nan, int(x.size), nan, level)
  ci = _ttest(x, 0.0, 'two-sided').confidence_interval(level)
  return Interval(float(x.mean()), float(ci.low), float(ci.high), int(x.size),
                  float(scipy_stats.sem(x)), level)


def _finite(values: Sequence[float] | np.ndarray) -> np.ndarray:
  x = np.asarray(values, dtype=np.float64).reshape(-1)
  return x[np.isfinite(x)]


def _ttest(x: np.ndarray, popmean: float, alternative: str):
  with warnings.catch_warnings():  # Identical values (zero spread): a point interval, no warning.
    warnings.simplefilter('ignore', RuntimeWarning)
    return scipy_stats.ttest_1samp(x, popmean, alternative=alternative)


def decision_p_value(values: Sequence[float] | np.ndarray, direction: str,
                     margin: float = 0.0) -> float:
  """The smallest ``alpha`` at which the (1 - alpha) interval of ``values`` gives a verdict
  (supported or contradicted) under the rule of ``verdict``; 1 below two finite values.

  So ``verdict`` at level 0.95 is decisive exactly when this is < 0.05, and it is the p-value
  that a multiplicity correction (``holm``) adjusts. Directional claims: the two-sided
  one-sample t-test of mean 0. Equivalence claims: ``min(p_inside, p_outside)`` where
  ``p_inside = 2 max(p(mean > -margin), p(mean < margin))`` (both bounds inside the band; TOST)
  and ``p_outside = 2 min(p(mean > margin), p(mean < -margin))`` (the interval beyond one side).

  Args:
    values: paired differences, shape ``[n]``.
    direction: 'greater', 'less' or 'equivalent'.
    margin: equivalence half-width (for 'equivalent').

  Returns:
    The p-value in [0, 1].
  """
  x = _finite(values)
  if x.size < 2:
    return 1.0
  above = lambda c: 2.0 * float(_ttest(x, c, 'greater').pvalue)  # alpha at which low > c
  below = lambda c: 2.0 * float(_ttest(x, c, 'less').pvalue)  # alpha at which high < c
  if direction == 'equivalent':
    p = min(max(above(-margin), below(margin)), min(above(margin), below(-margin)))
  else:
    p = min(above(0.0), below(0.0))
  return min(1.0, p) if math.isfinite(p) else 1.0


def holm(p_values: Sequence[float]) -> np.ndarray:
  """Holm-Bonferroni adjusted p-values (family-wise error rate), in the input order.

  The ``i``-th smallest p-value is multiplied by ``m - i`` (``i`` from 0), then made
  monotone with a running maximum and capped at 1.
  """
  p = np.asarray(p_values, dtype=np.float64)
  m = p.size
  order = np.argsort(p, kind='stable')
  adjusted = np.minimum(1.0, np.maximum.accumulate(p[order] * (m - np.arange(m))))
  out = np.empty(m)
  out[order] = adjusted
  return out


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
  """Paired difference, its interval, the verdict and its p-value, as a JSON-ready dict.

  Args:
    arm: seed -> metric of the arm.
    baseline: seed -> metric of the baseline.
    direction: see ``verdict``.
    margin: see ``verdict``.
    level: confidence level.

  Returns:
    ``{'seeds', 'differences', 'interval': {...}, 'verdict', 'p_value'}``; the verdict is
    ``NOT_MEASURED`` when no seed has a finite difference; ``p_value`` is
    ``decision_p_value`` (what ``with_holm`` adjusts).
  """
  seeds, d = paired_differences(arm, baseline)
  interval = t_interval(d, level)
  v = verdict(interval, direction, margin) if interval.n else NOT_MEASURED
  return {'seeds': seeds, 'differences': [float(x) for x in d],
          'interval': interval.as_dict(), 'verdict': v,
          'p_value': decision_p_value(d, direction, margin)}


def with_holm(judgements: Sequence[dict], alpha: float = 0.05) -> list[dict]:
  """``judge`` outputs with the Holm-Bonferroni correction over all of them (one family).

  The primary verdict (``verdict``, the fixed rule on each claim's own 95% interval) is kept;
  each judgement gains ``p_holm`` (adjusted ``p_value``) and ``verdict_holm``: the primary
  verdict when ``p_holm < alpha``, else ``INCONCLUSIVE`` (``NOT_MEASURED`` stays). Claims
  not measured are not counted in the family.

  Args:
    judgements: ``judge`` outputs (with ``p_value`` and ``verdict``).
    alpha: family-wise error rate (1 - the intervals' level).

  Returns:
    New dicts, in the input order.
  """
  out = [dict(j) for j in judgements]
  tested = [j for j in out if j['verdict'] != NOT_MEASURED]
  for j, p in zip(tested, holm([j['p_value'] for j in tested])):
    j['p_holm'] = float(p)
    j['verdict_holm'] = j['verdict'] if p < alpha else INCONCLUSIVE
  for j in out:
    if j['verdict'] == NOT_MEASURED:
      j['p_holm'], j['verdict_holm'] = float('nan'), NOT_MEASURED
  return out
