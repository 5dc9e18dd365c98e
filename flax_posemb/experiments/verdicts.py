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


# Contrasts of the last bucket with another: metric -> (the bucket vector both
# buckets come from, the other bucket: 'mid' or 'early').
CONTRASTS = {
    f'{kind}_late_minus_{other}': (f'bucket_{kind}', other)
    for kind in ('loss', 'excess')
    for other in ('mid', 'early')
}


def bucket_contrast(metric: str) -> tuple[str, str] | None:
  """(bucket vector, 'mid' or 'early') of a late-minus-other ``metric``; None
  for a metric that is not such a contrast."""
  return CONTRASTS.get(metric)


def late_rows_rule(claim: Mapping[str, Any]) -> str:
  """The verdict of a claim declared about late rows (``about_late_rows``).

  A late-minus-other contrast can move because the *other* bucket moved (a
  model that gets better at short context scores late minus mid worse with
  unchanged late rows). So a claim about late rows is supported only if the
  late bucket's own paired difference ``arm - baseline`` is decisive in the
  predicted direction too: its interval excludes 0 on the predicted side. An
  unmeasured late-bucket difference (n/a) cannot show that either.

  Args:
    claim: the claim's record: ``verdict`` (of its own interval),
      ``direction``, ``about_late_rows`` and ``buckets['late']['difference']``
      (the late bucket's paired interval).

  Returns:
    The verdict: `INCONCLUSIVE` where the rule fails a `SUPPORTED` verdict,
    else the claim's own verdict.
  """
  if not claim.get('about_late_rows') or claim['verdict'] != SUPPORTED:
    return claim['verdict']
  late = claim.get('buckets', {}).get('late', {}).get('difference', {})
  low = late.get('low')
  high = late.get('high')
  if (
      low is None
      or high is None
      or not (math.isfinite(low) and math.isfinite(high))
  ):
    return INCONCLUSIVE
  if claim['direction'] == 'greater' and low > 0:
    return SUPPORTED
  if claim['direction'] == 'less' and high < 0:
    return SUPPORTED
  return INCONCLUSIVE


def with_suite_holm(
    summaries: Mapping[str, dict], suite: str, alpha: float = 0.05
) -> None:
  """Holm-Bonferroni over every measured claim of a suite's experiments, in
  place: each claim gets ``p_holm_suite`` and ``verdict_holm_suite``, each
  summary's ``multiplicity`` a ``suite`` record.

  Args:
    summaries: experiment name -> summary (`aggregate.aggregate`'s), the
      experiments of one suite run.
    suite: the suite's name (its config file).
    alpha: the family-wise error rate.
  """
  claims = [claim for s in summaries.values() for claim in s['claims']]
  adjusted = with_holm(claims, alpha)
  for claim, judged in zip(claims, adjusted):
    claim['p_holm_suite'] = judged['p_holm']
    claim['verdict_holm_suite'] = judged['verdict_holm']
  tested = [claim for claim in claims if claim['verdict'] != NOT_MEASURED]
  record = {
      'name': suite,
      'experiments': list(summaries),
      'claims_tested': len(tested),
      'verdicts_changed': sum(
          claim['verdict_holm_suite'] != claim['verdict'] for claim in tested
      ),
  }
  for s in summaries.values():
    s['multiplicity']['suite'] = record
