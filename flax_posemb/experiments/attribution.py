"""Attribution by bucket: the paired difference of each bucket a contrast
compares, the late-rows rule on the claims, and the per-bucket profile of the
claimed pairs (docs/DESIGN.md § Intervals and verdicts).

A contrast of two buckets (late minus mid) moves when either bucket moves; its
claim says which by listing each bucket's own difference ``arm - baseline``
beside it. The same records are made from the runs (`aggregate`) and, for a
summary written before they existed, from the summary's per-bucket profiles
(`from_profiles`; n/a where the summary has no paired difference of that
bucket).
"""

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import ml_collections

from flax_posemb.experiments import verdicts

# The per-bucket paired differences every report profiles.
PROFILE_METRIC = 'bucket_loss'
# (bucket vector, arm, baseline) -> per bucket the interval of arm - baseline,
# or None where it cannot be computed.
Differences = Callable[[str, str, str], Sequence[Mapping[str, Any]] | None]


def _bucket(index: int, edges: Sequence[Sequence[int]], differences) -> dict:
  """One bucket of a contrast: its index, its rows and its paired interval."""
  if 0 <= index < len(edges):
    rows = list(edges[index])
  else:
    rows = []
  difference = {}
  if differences is not None and 0 <= index < len(differences):
    difference = dict(differences[index])
  return {'bucket': index, 'rows': rows, 'difference': difference}


def contrast_buckets(
    claim: Mapping[str, Any],
    edges: Sequence[Sequence[int]],
    mid: int,
    differences_of: Differences,
) -> dict[str, Any] | None:
  """``{'metric', 'late', 'other'}``: each bucket of a claim's contrast with
  its own paired difference; None for a claim on no contrast.

  Args:
    claim: the claim (``metric``, ``arm``, ``baseline``).
    edges: ``[B]`` (start, end) rows of the buckets.
    mid: the experiment's mid bucket.
    differences_of: the paired per-bucket differences.

  Returns:
    The record (``difference``: {} where not measured).
  """
  contrast = verdicts.bucket_contrast(claim['metric'])
  if contrast is None or not claim['baseline']:
    return None
  vector, other = contrast
  differences = differences_of(vector, claim['arm'], claim['baseline'])
  other_index = mid if other == 'mid' else 0
  return {
      'metric': vector,
      'late': _bucket(len(edges) - 1, edges, differences),
      'other': _bucket(other_index, edges, differences),
  }


def judge_claims(
    claims: list[dict[str, Any]],
    specs: Sequence[ml_collections.ConfigDict],
    edges: Sequence[Sequence[int]],
    mid: int,
    differences_of: Differences,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
  """The claims with their buckets, the late-rows rule and Holm.

  Args:
    claims: the claims' records (`verdicts.judge`'s keys plus the claim's).
    specs: the experiment's claims (their ``about_late_rows``).
    edges: ``[B]`` (start, end) rows of the buckets.
    mid: the experiment's mid bucket.
    differences_of: the paired per-bucket differences.

  Returns:
    The claims (``buckets``, ``about_late_rows``, ``interval_verdict``: the
    verdict of the claim's own interval; ``verdict``: after the late-rows
    rule; Holm's keys) and the experiment's ``multiplicity`` record.
  """
  declared = {
      spec.id: bool(spec.get('about_late_rows', False)) for spec in specs
  }
  out = []
  for claim in claims:
    claim = dict(claim)
    # A suite's Holm is redone by the suite (`verdicts.with_suite_holm`).
    claim.pop('p_holm_suite', None)
    claim.pop('verdict_holm_suite', None)
    claim.setdefault('interval_verdict', claim['verdict'])
    claim['about_late_rows'] = declared.get(claim['id'], False)
    buckets = contrast_buckets(claim, edges, mid, differences_of)
    if buckets is not None:
      claim['buckets'] = buckets
    claim['verdict'] = verdicts.late_rows_rule(
        dict(claim, verdict=claim['interval_verdict'])
    )
    out.append(claim)
  out = verdicts.with_holm(out)
  tested = [claim for claim in out if claim['verdict'] != verdicts.NOT_MEASURED]
  multiplicity = {
      'method': 'holm',
      'claims_tested': len(tested),
      'alpha': 0.05,
      'verdicts_changed': sum(
          claim['verdict_holm'] != claim['verdict'] for claim in tested
      ),
      'late_rule_changed': sum(
          claim['verdict'] != claim['interval_verdict'] for claim in tested
      ),
  }
  return out, multiplicity


def profile_pairs(
    claims: Sequence[Mapping[str, Any]],
    doses: Sequence[Mapping[str, Any]],
    differences_of: Differences,
) -> list[dict[str, Any]]:
  """Per distinct (arm, baseline) of the claims and dose series, the paired
  `PROFILE_METRIC` difference in every bucket ({} each where not measured)."""
  pairs = [
      (claim['arm'], claim['baseline']) for claim in claims if claim['baseline']
  ]
  for dose in doses:
    pairs += [(arm, dose['baseline']) for arm in dose['arms']]
  out = []
  for arm, baseline in dict.fromkeys(pairs):
    differences = differences_of(PROFILE_METRIC, arm, baseline)
    out.append(
        {
            'arm': arm,
            'baseline': baseline,
            'differences': [dict(x) for x in differences or []],
        }
    )
  return out


def from_profiles(summary: Mapping[str, Any]) -> Differences:
  """`Differences` read from a summary's profiles and attribution (a summary
  written before attribution existed): None where it holds no such pair."""

  def differences_of(metric, arm, baseline):
    for profile in summary.get('profiles', []):
      if profile['metric'] == metric and profile['baseline'] == baseline:
        if arm in profile['differences']:
          return profile['differences'][arm]
    if metric == PROFILE_METRIC:
      for pair in summary.get('attribution', []):
        if (pair['arm'], pair['baseline']) == (arm, baseline):
          return pair['differences'] or None
    return None

  return differences_of


def attribute(
    summary: dict[str, Any],
    exp: ml_collections.ConfigDict,
    differences_of: Differences,
) -> None:
  """Adds the claims' buckets, the late-rows rule, Holm and the per-bucket
  profile of the claimed pairs to ``summary``, in place."""
  edges = summary['buckets']
  mid = int(summary.get('mid_bucket', -1))
  claims, multiplicity = judge_claims(
      summary['claims'], exp.claims, edges, mid, differences_of
  )
  summary['claims'] = claims
  summary['multiplicity'] = multiplicity
  doses = summary['analyses'].get('doses', [])
  summary['attribution'] = profile_pairs(claims, doses, differences_of)
