"""Every interval of the project (docs/DESIGN.md § Intervals and verdicts):
document-clustered bucket means, paired differences, seed x document contrasts
(Satterthwaite), Student-t intervals over seeds, decision p values and Holm.
Evaluation, comparisons and experiments all build their intervals here."""

from collections.abc import Mapping, Sequence
import dataclasses
import math
from typing import Any
import warnings

import numpy as np
import scipy.stats

# How an interval was made (an interval record's ``method``): Student-t over
# seeds, or over seeds and documents (`seed_document_contrast`).
SEEDS = 'seeds'
SEEDS_AND_DOCUMENTS = 'seeds x documents'


def finite_or_none(x: float) -> float | None:
  """``x`` as a float, None if NaN or infinite (what JSON can hold).

  Args:
    x: a number.

  Returns:
    ``float(x)``, or None.
  """
  x = float(x)
  return x if math.isfinite(x) else None


def t_quantile(level: float, df: Any) -> Any:
  """The two-sided Student-t quantile of an interval of coverage ``level``.

  Args:
    level: the coverage, e.g. 0.95.
    df: degrees of freedom, a number or an array of any shape.

  Returns:
    ``t_{df}^{-1}(0.5 + level / 2)``, shaped like ``df`` (NaN where df <= 0).
  """
  return scipy.stats.t.ppf(0.5 + level / 2, df)


def clusters(per_window: Mapping[str, np.ndarray]) -> np.ndarray:
  """The cluster of every window: its document, else the window itself.

  Args:
    per_window: ``windows.npz`` contents: ``win_sum`` ``[W, nb]`` and, if the
      documents were recorded, ``doc`` ``[W]``.

  Returns:
    int ``[W]``, cluster indices ``0..G-1``.
  """
  num_windows = len(per_window['win_sum'])
  doc = per_window.get('doc')
  if doc is None:
    keys = np.arange(num_windows)
  else:
    keys = np.asarray(doc, np.int64)
  return np.unique(keys, return_inverse=True)[1].reshape(num_windows)


def cluster_sums(x: np.ndarray, cluster: np.ndarray) -> np.ndarray:
  """Per-window rows summed per cluster.

  Args:
    x: ``[W, ...]`` per-window values.
    cluster: int ``[W]``, each window's cluster (`clusters`).

  Returns:
    ``[G, ...]``, G the number of clusters.
  """
  out = np.zeros((int(cluster.max(initial=-1)) + 1,) + x.shape[1:])
  np.add.at(out, cluster, x)
  return out


def bucket_means(
    per_window: Mapping[str, np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Token-weighted bucket losses with their document-clustered covariance.

  Each bucket's loss is a ratio of sums; its (delta-method) variance treats
  the documents as independent clusters.

  Args:
    per_window: ``windows.npz`` contents: ``win_sum``, ``win_count``
      ``[W, nb]`` and optionally ``doc`` ``[W]``.

  Returns:
    ``(loss, cov, shared)``: the bucket losses ``[nb]`` (NaN where unscored),
    their covariance ``[nb, nb]`` (NaN for a bucket of one cluster) and the
    number of clusters scored in both buckets ``[nb, nb]``.
  """
  cluster = clusters(per_window)
  # [G, nb] per cluster.
  sums = cluster_sums(np.asarray(per_window['win_sum'], np.float64), cluster)
  counts = cluster_sums(
      np.asarray(per_window['win_count'], np.float64), cluster
  )
  tokens = counts.sum(0)
  present = (counts > 0).astype(np.float64)
  shared = present.T @ present
  with np.errstate(invalid='ignore', divide='ignore'):
    loss = sums.sum(0) / tokens
    residuals = sums - np.where(tokens > 0, loss, 0.0) * counts
    # Buckets that share no cluster have covariance 0 (every product r_i r_j is
    # 0).
    factor = np.where(
        shared > 1,
        shared / np.maximum(shared - 1, 1),
        np.where(shared == 0, 1.0, np.nan),
    )
    cov = factor * (residuals.T @ residuals) / np.outer(tokens, tokens)
  return loss, cov, shared


def bucket_intervals(
    per_window: Mapping[str, np.ndarray], level: float = 0.95
) -> dict[str, np.ndarray]:
  """The document-clustered Student-t interval of every bucket's loss.

  Args:
    per_window: ``windows.npz`` contents (see `bucket_means`).
    level: the intervals' coverage.

  Returns:
    ``{'loss', 'stderr', 'low', 'high', 'documents'}``, each ``[nb]``: the
    loss, its standard error and bounds (clusters - 1 degrees of freedom; NaN
    below two clusters) and the clusters scored in the bucket.
  """
  loss, cov, shared = bucket_means(per_window)
  var = np.diag(cov)
  stderr = np.sqrt(np.where(var >= 0, var, np.nan))
  documents = np.diag(shared)
  q = t_quantile(level, documents - 1)
  return {
      'loss': loss,
      'stderr': stderr,
      'low': loss - q * stderr,
      'high': loss + q * stderr,
      'documents': documents,
  }


def _stderr_or_none(var: float) -> float | None:
  if not np.isfinite(var):
    return None
  return finite_or_none(math.sqrt(max(var, 0.0)))


def degradation(per_window: Mapping[str, np.ndarray]) -> dict[str, Any]:
  """Late-context degradation with document-clustered standard errors.

  Args:
    per_window: ``windows.npz`` contents with ``edges`` ``[nb + 1]`` (see
      `bucket_means`).

  Returns:
    ``{'last_minus_best', 'last_minus_best_stderr', 'best_bucket', 'slope',
    'slope_stderr', 'slope_buckets'}``: the last scored bucket's loss minus
    the lowest one, and the 1/stderr^2-weighted least-squares slope of the
    loss over the scored buckets of the second half (per position), each with
    its standard error (None where undefined).
  """
  loss, cov, _ = bucket_means(per_window)
  edges = np.asarray(per_window['edges'])
  valid = np.where(np.asarray(per_window['win_count']).sum(0) > 0)[0]
  keys = (
      'last_minus_best',
      'last_minus_best_stderr',
      'best_bucket',
      'slope',
      'slope_stderr',
  )
  out: dict[str, Any] = dict(dict.fromkeys(keys), slope_buckets=[])
  if len(valid) == 0:
    return out
  last = int(valid[-1])
  best = int(valid[np.argmin(loss[valid])])
  out.update(
      best_bucket=best,
      last_minus_best=float(loss[last] - loss[best]),
      last_minus_best_stderr=_stderr_or_none(
          cov[last, last] + cov[best, best] - 2 * cov[last, best]
      ),
  )
  mid = (edges[:-1] + edges[1:] - 1) / 2.0
  # The scored buckets of the second half.
  sel = np.array([i for i in valid if mid[i] >= edges[-1] / 2.0], np.int64)
  out['slope_buckets'] = [int(i) for i in sel]
  if len(sel) < 2:
    return out
  x = mid[sel]
  y = loss[sel]
  var = np.diag(cov)[sel]
  if np.all(np.isfinite(var)) and np.all(var > 0):
    w = 1.0 / var
  else:
    w = np.ones_like(x)
  x_mean = np.sum(w * x) / np.sum(w)
  # The slope is a @ y: weighted least squares as a linear map of the losses.
  a = w * (x - x_mean) / np.sum(w * (x - x_mean) ** 2)
  out['slope'] = float(a @ y)
  out['slope_stderr'] = _stderr_or_none(float(a @ cov[np.ix_(sel, sel)] @ a))
  return out


def _check_same_windows(
    a: Mapping[str, np.ndarray],
    b: Mapping[str, np.ndarray],
    names: tuple[str, str],
) -> None:
  """Refuses two evaluations of different windows or buckets."""
  ids_a = np.asarray(a['window_id'])
  ids_b = np.asarray(b['window_id'])
  set_a = set(ids_a.tolist())
  set_b = set(ids_b.tolist())
  if (
      not np.array_equal(a['edges'], b['edges'])
      or len(set_a) != len(ids_a)
      or len(set_b) != len(ids_b)
      or set_a != set_b
  ):
    raise ValueError(
        f'{names[0]} and {names[1]} were evaluated on different windows or'
        f' buckets ({len(set_a - set_b)} windows only in {names[0]},'
        f' {len(set_b - set_a)} only in {names[1]}, of {len(ids_a)} and'
        f' {len(ids_b)}; edges {list(a["edges"])} and {list(b["edges"])});'
        ' evaluate both with the same data, split, window and eval flags.'
    )


def paired_difference(
    a: Mapping[str, np.ndarray],
    b: Mapping[str, np.ndarray],
    names: tuple[str, str] = ('A', 'B'),
    level: float = 0.95,
) -> list[dict[str, Any]]:
  """Per bucket, loss A - B over the same windows, paired by document.

  Args:
    a: ``windows.npz`` contents of run A: ``window_id`` ``[W]``, ``edges``
      ``[nb + 1]``, ``win_sum`` and ``win_count`` ``[W, nb]``, optionally
      ``doc`` ``[W]``.
    b: the same of run B, the same windows in any order.
    names: the runs' names, for the refusal.
    level: the intervals' coverage.

  Returns:
    One row per bucket: ``start``, ``end``, ``windows``, ``documents``,
    ``loss_a``, ``loss_b``, ``diff``, its paired document-clustered
    ``stderr`` and Student-t ``ci95`` (documents - 1 degrees of freedom), and
    the ``unpaired_stderr`` (None below two documents).

  Raises:
    ValueError: A and B were evaluated on different windows or buckets.
  """
  _check_same_windows(a, b, names)
  ids_a = np.asarray(a['window_id'])
  ids_b = np.asarray(b['window_id'])
  # b's rows in a's window order.
  order = np.argsort(ids_b)[np.searchsorted(np.sort(ids_b), ids_a)]
  # The documents from whichever run recorded them: by window alone understates
  # the error.
  if 'doc' in a or 'doc' not in b:
    cluster = clusters(a)
  else:
    cluster = clusters(dict(a, doc=np.asarray(b['doc'])[order]))
  sums_a = np.asarray(a['win_sum'], np.float64)
  counts_a = np.asarray(a['win_count'], np.float64)
  sums_b = np.asarray(b['win_sum'], np.float64)[order]
  counts_b = np.asarray(b['win_count'], np.float64)[order]
  tokens_a = counts_a.sum(0)
  tokens_b = counts_b.sum(0)
  with np.errstate(invalid='ignore', divide='ignore'):
    loss_a = sums_a.sum(0) / tokens_a
    loss_b = sums_b.sum(0) / tokens_b
    # [G, nb] each cluster's share of the bucket loss, minus its mean.
    residuals_a = cluster_sums(
        (sums_a - np.nan_to_num(loss_a) * counts_a) / tokens_a, cluster
    )
    residuals_b = cluster_sums(
        (sums_b - np.nan_to_num(loss_b) * counts_b) / tokens_b, cluster
    )
  scored_a = counts_a > 0
  scored_b = counts_b > 0
  # [G, nb] whether the cluster has a scored token in the bucket in A or B.
  present = cluster_sums((scored_a | scored_b).astype(np.float64), cluster) > 0
  rows: list[dict[str, Any]] = []
  for i in range(len(a['edges']) - 1):
    g = int(present[:, i].sum())
    row = {
        'start': int(a['edges'][i]),
        'end': int(a['edges'][i + 1]),
        'windows': int((scored_a[:, i] | scored_b[:, i]).sum()),
        'documents': g,
    }
    if g < 2 or tokens_a[i] <= 0 or tokens_b[i] <= 0:
      unmeasured = dict.fromkeys(('loss_a', 'loss_b', 'diff', 'stderr'))
      rows.append(
          dict(row, **unmeasured, ci95=[None, None], unpaired_stderr=None)
      )
      continue
    factor = g / (g - 1)
    diff = float(loss_a[i] - loss_b[i])
    r_a = residuals_a[:, i]
    r_b = residuals_b[:, i]
    se = math.sqrt(factor * np.sum((r_a - r_b) ** 2))
    unpaired = math.sqrt(factor * (np.sum(r_a**2) + np.sum(r_b**2)))
    q = float(t_quantile(level, g - 1))
    rows.append(
        dict(
            row,
            loss_a=float(loss_a[i]),
            loss_b=float(loss_b[i]),
            diff=diff,
            stderr=se,
            ci95=[diff - q * se, diff + q * se],
            unpaired_stderr=unpaired,
        )
    )
  return rows


def overall_paired_difference(
    a: Mapping[str, np.ndarray],
    b: Mapping[str, np.ndarray],
    names: tuple[str, str] = ('A', 'B'),
) -> dict[str, Any]:
  """Loss A - B over all scored tokens of the same windows.

  Args:
    a: ``windows.npz`` contents of run A (see `paired_difference`).
    b: the same of run B.
    names: the runs' names, for the refusal.

  Returns:
    `paired_difference`'s row of one bucket spanning every position.
  """

  def whole(per_window):
    return dict(
        per_window,
        edges=np.array([0, int(np.asarray(per_window['edges'])[-1])]),
        **{
            k: np.asarray(per_window[k]).sum(1, keepdims=True)
            for k in ('win_sum', 'win_count')
        },
    )

  (row,) = paired_difference(whole(a), whole(b), names)
  return row


def _satterthwaite(
    seed_var: float, num_seeds: int, doc_var: float, num_docs: int
) -> float:
  """Degrees of freedom of a sum of a seed and a document variance."""
  denominator = seed_var**2 / (num_seeds - 1) + doc_var**2 / (num_docs - 1)
  if denominator > 0:
    return (seed_var + doc_var) ** 2 / denominator
  return float(min(num_seeds, num_docs) - 1)


def seed_document_contrast(
    sums: np.ndarray,
    counts: np.ndarray,
    weights: np.ndarray,
    level: float = 0.95,
) -> dict[str, Any]:
  """A contrast of ratio estimates averaged over seeds, with an interval that
  combines seeds and documents (docs/DESIGN.md § Experiments outputs).

  Component ``k`` of seed ``s`` is the ratio ``L_sk = sum_g sums[s, g, k] /
  sum_g counts[s, g, k]`` (a bucket's loss, say); the contrast is ``theta_s =
  sum_k weights[k] L_sk`` and the estimate its mean over seeds. Its variance
  adds the spread of ``theta_s`` over seeds (training randomness, documents
  held fixed) and the document-clustered variance of the seed-averaged
  per-document terms of ``theta`` (delta method, as `paired_difference`):
  documents are clusters, the same in every seed. Counting the seed x document
  interaction in both makes it conservative; the interval is Student-t with
  Satterthwaite's degrees of freedom.

  Args:
    sums: ``[S, G, K]`` loss sums per seed, document and component.
    counts: ``[S, G, K]`` scored targets, likewise.
    weights: ``[K]`` the contrast.
    level: the interval's coverage.

  Returns:
    ``{'mean', 'per_seed' (``theta_s``, ``[S]``), 'stderr', 'df', 'low',
    'high', 'seeds', 'documents', 'seed_stderr', 'document_stderr',
    'level'}``; NaN bounds below two seeds or two documents (a group from one
    document has no interval).
  """
  sums = np.asarray(sums, np.float64)
  counts = np.asarray(counts, np.float64)
  weights = np.asarray(weights, np.float64)
  used = weights != 0
  sums = sums[:, :, used]
  counts = counts[:, :, used]
  weights = weights[used]
  num_seeds = sums.shape[0]
  totals = counts.sum(1)
  with np.errstate(invalid='ignore', divide='ignore'):
    ratios = sums.sum(1) / totals
    per_seed = ratios @ weights
    terms = (sums - ratios[:, None, :] * counts) / totals[:, None, :]
  per_document = np.nan_to_num(terms) @ weights
  present = (counts > 0).any(axis=(0, 2))
  num_docs = int(present.sum())
  out = {
      'mean': float(np.mean(per_seed)) if num_seeds else math.nan,
      'per_seed': [float(x) for x in per_seed],
      'seeds': num_seeds,
      'documents': num_docs,
      'level': level,
  }
  nan = dict.fromkeys(
      ('stderr', 'df', 'low', 'high', 'seed_stderr', 'document_stderr'),
      math.nan,
  )
  if num_seeds < 2 or num_docs < 2 or not np.all(np.isfinite(per_seed)):
    return dict(out, **nan)
  seed_var = float(np.var(per_seed, ddof=1)) / num_seeds
  doc_terms = per_document.mean(0)[present]
  doc_var = num_docs / (num_docs - 1) * float(np.sum(doc_terms**2))
  df = _satterthwaite(seed_var, num_seeds, doc_var, num_docs)
  stderr = math.sqrt(seed_var + doc_var)
  q = float(t_quantile(level, df))
  return dict(
      out,
      stderr=stderr,
      df=df,
      low=out['mean'] - q * stderr,
      high=out['mean'] + q * stderr,
      seed_stderr=math.sqrt(seed_var),
      document_stderr=math.sqrt(doc_var),
  )


@dataclasses.dataclass(frozen=True)
class Interval:
  """A sample mean with its two-sided Student-t interval.

  Attributes:
    mean: the mean of the finite values.
    low: the lower bound (NaN below two values).
    high: the upper bound (NaN below two values).
    n: the number of finite values.
    stderr: the standard error of the mean (NaN below two values).
    level: the coverage.
  """

  mean: float
  low: float
  high: float
  n: int
  stderr: float
  level: float = 0.95

  def as_dict(self) -> dict[str, float | int]:
    """The fields as a dict.

    Returns:
      ``{'mean', 'low', 'high', 'n', 'stderr', 'level'}`` (``summary.json``).
    """
    return dataclasses.asdict(self)


def _finite(values: Sequence[float] | np.ndarray) -> np.ndarray:
  x = np.asarray(values, dtype=np.float64).reshape(-1)
  return x[np.isfinite(x)]


def t_interval(
    values: Sequence[float] | np.ndarray, level: float = 0.95
) -> Interval:
  """Student-t interval of the mean of the finite entries of ``values``.

  Args:
    values: ``[n]`` values (one per seed, say); NaN and infinite ones are
      dropped.
    level: the coverage.

  Returns:
    The `Interval` (n - 1 degrees of freedom; NaN bounds below two values).
  """
  x = _finite(values)
  nan = float('nan')
  if x.size < 2:
    mean = float(x.mean()) if x.size else nan
    return Interval(mean, nan, nan, int(x.size), nan, level)
  # Identical values (zero spread): a point interval, no warning.
  with warnings.catch_warnings():
    warnings.simplefilter('ignore', RuntimeWarning)
    ci = scipy.stats.ttest_1samp(x, 0.0).confidence_interval(level)
  return Interval(
      float(x.mean()),
      float(ci.low),
      float(ci.high),
      int(x.size),
      float(scipy.stats.sem(x)),
      level,
  )


def estimate_p_value(
    mean: float,
    stderr: float,
    df: float,
    direction: str,
    margin: float = 0.0,
) -> float:
  """The smallest alpha at which the (1 - alpha) t interval of an estimate is
  decisive.

  Decisive: for 'greater' and 'less', the interval excludes 0 on either side;
  for 'equivalent', it lies inside ``[-margin, margin]`` (TOST) or wholly
  outside it.

  Args:
    mean: the estimate.
    stderr: its standard error.
    df: its degrees of freedom.
    direction: 'greater', 'less' or 'equivalent'.
    margin: the equivalence band's half-width.

  Returns:
    The p value in [0, 1]; 1 where the standard error or df is undefined.
  """
  if not (math.isfinite(stderr) and math.isfinite(df) and df > 0):
    return 1.0

  def statistic(c):
    if stderr == 0:
      return math.copysign(math.inf, mean - c) if mean != c else math.nan
    return (mean - c) / stderr

  # alpha at which low > c
  def above(c):
    return 2.0 * float(scipy.stats.t.sf(statistic(c), df))

  # alpha at which high < c
  def below(c):
    return 2.0 * float(scipy.stats.t.cdf(statistic(c), df))

  if direction == 'equivalent':
    p = min(
        max(above(-margin), below(margin)), min(above(margin), below(-margin))
    )
  else:
    p = min(above(0.0), below(0.0))
  return min(1.0, p) if math.isfinite(p) else 1.0


def decision_p_value(
    values: Sequence[float] | np.ndarray, direction: str, margin: float = 0.0
) -> float:
  """`estimate_p_value` of the t interval of the mean of ``values``.

  Args:
    values: ``[n]`` values; NaN and infinite ones are dropped.
    direction: 'greater', 'less' or 'equivalent'.
    margin: the equivalence band's half-width.

  Returns:
    The p value; 1 below two values.
  """
  x = _finite(values)
  if x.size < 2:
    return 1.0
  stderr = float(np.std(x, ddof=1)) / math.sqrt(x.size)
  return estimate_p_value(
      float(x.mean()), stderr, float(x.size - 1), direction, margin
  )


def holm(p_values: Sequence[float]) -> np.ndarray:
  """Holm-Bonferroni adjusted p values (scipy has no Holm).

  Args:
    p_values: ``[m]`` p values.

  Returns:
    ``[m]`` adjusted p values, in the input order.
  """
  p = np.asarray(p_values, dtype=np.float64)
  m = p.size
  order = np.argsort(p, kind='stable')
  out = np.empty(m)
  out[order] = np.minimum(
      1.0, np.maximum.accumulate(p[order] * (m - np.arange(m)))
  )
  return out
