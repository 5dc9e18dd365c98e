"""Position buckets and the statistics of loss by bucket (pure numpy).

The evaluation step returns, for every window (row) of a batch, the summed loss and the
number of scored tokens in each position bucket. `BucketAccumulator` keeps those per-window
sums (memory O(W nb)) with each window's provenance, and turns them into per-bucket means
with standard errors that respect the correlation of tokens within one document.

Standard errors use the ratio (cluster) estimator with documents as clusters (windows of
one document are one cluster; without provenance every window is its own): for bucket i
with per-cluster sums s_gi and counts c_gi, L_i = sum_g s_gi / sum_g c_gi and

  Var(L_i) = n_i / (n_i - 1) * sum_g (s_gi - L_i c_gi)^2 / (sum_g c_gi)^2,

n_i = clusters with tokens in bucket i; t intervals use n_i - 1 degrees of freedom. When
every cluster holds the same number of tokens in the bucket this is exactly the spread of
the per-cluster bucket means: std(m_gi, ddof=1) / sqrt(n_i). The same sums give the full
covariance between buckets (they share clusters), used for the standard errors of "last
minus best" and of the degradation slope.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import scipy.stats

def make_edges(length: int, bucket_size: int = 0, edges: str | list[int] = '') -> np.ndarray:
  """Bucket edges over positions [0, length).

  Args:
    length: window length T (number of positions).
    bucket_size: width of uniform buckets (the last may be shorter); used when `edges` is empty.
    edges: '' (uniform), 'log2' (0, 1, 2, 4, ..., T), or explicit increasing edges such as
      '0,128,256,512' or a list of ints. The first edge must be 0; if the last is below `length`
      the window's end is appended as a final edge.

  Returns:
    int64 array [num_buckets + 1] of strictly increasing edges, edges[0] = 0, edges[-1] = length.
  """
  if length < 1:
    raise ValueError(f'window length must be >= 1, got {length}.')
  if isinstance(edges, str):
    spec = edges.strip()
    if spec == 'log2':
      out = [0]
      e = 1
      while e < length:
        out.append(e)
        e *= 2
      out.append(length)
      return np.asarray(out, np.int64)
    if spec:
      try:
        edges = [int(x) for x in spec.split(',') if x.strip()]
      except ValueError:
        raise ValueError(f'bucket edges must be comma-separated integers or "log2", got {spec!r}.') from None
    else:
      edges = []
  if len(edges) > 0:
    out = [int(x) for x in edges]
    if out[0] != 0:
      raise ValueError(f'bucket edges must start at 0, got {out}. Fix: prepend 0.')
    if any(b <= a for a, b in zip(out, out[1:])):
      raise ValueError(f'bucket edges must increase strictly, got {out}.')
    if out[-1] > length:
      raise ValueError(
          f'bucket edge {out[-1]} exceeds the evaluation window length {length}. '
          f'Fix: use edges <= {length}.')
    if out[-1] < length:
      out.append(length)
    return np.asarray(out, np.int64)
  if bucket_size < 1:
    raise ValueError(f'bucket_size must be >= 1 (or give bucket edges), got {bucket_size}.')
  out = list(range(0, length, bucket_size)) + [length]
  return np.asarray(out, np.int64)


def bucket_of_position(edges: np.ndarray) -> np.ndarray:
  """int32 array [edges[-1]]: the bucket index of every position."""
  edges = np.asarray(edges)
  return (np.searchsorted(edges, np.arange(edges[-1]), side='right') - 1).astype(np.int32)


def clusters(per_window: dict[str, np.ndarray]) -> np.ndarray:
  """[W] cluster index 0..G-1 of every window: its document ('doc'), else the window."""
  n = len(per_window['win_sum'])
  doc = per_window.get('doc')
  keys = np.arange(n) if doc is None else np.asarray(doc, np.int64)
  return np.unique(keys, return_inverse=True)[1].reshape(n)


def _cluster_sums(x: np.ndarray, cl: np.ndarray) -> np.ndarray:
  """[W, k] per-window rows summed per cluster: [G, k]."""
  out = np.zeros((int(cl.max(initial=-1)) + 1,) + x.shape[1:])
  np.add.at(out, cl, x)
  return out


def bucket_stats(per_window: dict[str, np.ndarray]
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Per-bucket mean loss [nb], covariance of the means [nb, nb] (nan where undefined) and
  the clusters with tokens in both buckets [nb, nb] (diagonal: clusters per bucket)."""
  cl = clusters(per_window)
  s = _cluster_sums(np.asarray(per_window['win_sum'], np.float64), cl)
  c = _cluster_sums(np.asarray(per_window['win_count'], np.float64), cl)
  present = (c > 0).astype(np.float64)
  nn = present.T @ present
  with np.errstate(invalid='ignore', divide='ignore'):
    loss = s.sum(0) / c.sum(0)
    r = s - np.where(c.sum(0) > 0, loss, 0.0) * c
    # Buckets that share no cluster have covariance 0 (every product r_i r_j is 0).
    factor = np.where(nn > 1, nn / np.maximum(nn - 1, 1), np.where(nn == 0, 1.0, np.nan))
    cov = factor * (r.T @ r) / np.outer(c.sum(0), c.sum(0))
  return loss, cov, nn


def t95(n: float) -> float:
  """Two-sided 95% t quantile with n - 1 degrees of freedom (nan for n < 2)."""
  return float(scipy.stats.t.ppf(0.975, n - 1)) if n >= 2 else math.nan


def bucket_rows(per_window: dict[str, np.ndarray]) -> list[dict[str, Any]]:
  """Per-bucket rows: start, end, tokens, windows, documents (clusters), loss, stderr, ci95
  (t, documents - 1 degrees of freedom), bits_per_token."""
  loss, cov, nn = bucket_stats(per_window)
  edges, c = per_window['edges'], np.asarray(per_window['win_count'])
  rows = []
  for i in range(len(edges) - 1):
    se = math.sqrt(cov[i, i]) if np.isfinite(cov[i, i]) and cov[i, i] >= 0 else math.nan
    q = t95(nn[i, i])
    rows.append({
        'start': int(edges[i]), 'end': int(edges[i + 1]), 'tokens': int(round(c[:, i].sum())),
        'windows': int((c[:, i] > 0).sum()), 'documents': int(nn[i, i]),
        'loss': _num(loss[i]), 'stderr': _num(se),
        'ci95': [_num(loss[i] - q * se), _num(loss[i] + q * se)],
        'bits_per_token': _num(loss[i] / math.log(2))})
  return rows


def overall(per_window: dict[str, np.ndarray]) -> dict[str, Any]:
  """Loss over all scored tokens with its document-clustered standard error."""
  whole = dict(per_window, edges=np.array([0, 1]),
               win_sum=np.asarray(per_window['win_sum']).sum(1, keepdims=True),
               win_count=np.asarray(per_window['win_count']).sum(1, keepdims=True))
  row, = bucket_rows(whole)
  if not row['tokens']:
    return {'tokens': 0, 'windows': 0, 'documents': 0, 'loss': None, 'stderr': None,
            'bits_per_token': None}
  return {k: row[k] for k in ('tokens', 'windows', 'documents', 'loss', 'stderr',
                              'bits_per_token')}


def degradation(per_window: dict[str, np.ndarray]) -> dict[str, Any]:
  """Last bucket minus best bucket, and a weighted least-squares slope over the second half.

  The slope fits loss against bucket midpoints for buckets whose midpoint lies in the second
  half of the window, weighted by 1 / stderr^2 (equal weights if a stderr is undefined). Its
  standard error is sqrt(a^T C a) with a the WLS coefficients and C the full covariance of the
  bucket means (buckets share documents, so they are correlated).
  """
  loss, cov, _ = bucket_stats(per_window)
  edges = np.asarray(per_window['edges'])
  valid = np.where(np.asarray(per_window['win_count']).sum(0) > 0)[0]
  out: dict[str, Any] = {'last_minus_best': None, 'last_minus_best_stderr': None,
                         'best_bucket': None, 'slope': None, 'slope_stderr': None,
                         'slope_buckets': []}
  if len(valid) == 0:
    return out
  last = int(valid[-1])
  best = int(valid[np.argmin(loss[valid])])
  out['best_bucket'] = best
  out['last_minus_best'] = float(loss[last] - loss[best])
  var = cov[last, last] + cov[best, best] - 2 * cov[last, best]
  out['last_minus_best_stderr'] = _num(math.sqrt(max(var, 0.0)) if np.isfinite(var) else math.nan)
  mid = (edges[:-1] + edges[1:] - 1) / 2.0
  sel = np.array([i for i in valid if mid[i] >= edges[-1] / 2.0], np.int64)
  out['slope_buckets'] = [int(i) for i in sel]
  if len(sel) < 2:
    return out
  x, y = mid[sel], loss[sel]
  d = np.diag(cov)[sel]
  w = 1.0 / d if np.all(np.isfinite(d)) and np.all(d > 0) else np.ones_like(x)
  xw = np.sum(w * x) / np.sum(w)
  a = w * (x - xw) / np.sum(w * (x - xw) ** 2)
  out['slope'] = float(a @ y)
  var = float(a @ cov[np.ix_(sel, sel)] @ a)
  out['slope_stderr'] = _num(math.sqrt(max(var, 0.0)) if np.isfinite(var) else math.nan)
  return out


# Window groups of `provenance_tables`, in window lengths T: start depth [0, T), [T, 2T),
# [2T, 4T), [4T, 8T), [8T, 32T), [32T, 128T), >= 128T; tokens after the window's end to the
# document's end < T, [T, 4T), [4T, 32T), >= 32T. Geometric, because token-uniform windows
# in books sit mostly tens of T deep, while 'first' windows all start at 0.
DEPTH_BINS = (0, 1, 2, 4, 8, 32, 128)
END_BINS = (0, 1, 4, 32)
QUANTILES = {'min': 0.0, 'p10': 0.1, 'p25': 0.25, 'median': 0.5, 'p75': 0.75, 'p90': 0.9,
             'max': 1.0}


def provenance_tables(per_window: dict[str, np.ndarray], window_len: int) -> dict[str, Any]:
  """Where the windows come from, and bucket loss by window group (docs/DESIGN.md).

  Args:
    per_window: ``BucketAccumulator.per_window()`` with provenance (``doc``, ``start``,
      ``doc_len``, ``kind`` [W]).
    window_len: T.

  Returns:
    {'windows': summary, 'by_kind', 'by_depth', 'by_end': [{'group', 'lo', 'hi',
    'windows', 'documents', 'buckets': `bucket_rows`}]}; the summary holds 'windows',
    'documents', 'window_len', 'kinds' {kind: {windows, documents}}, 'start' and 'to_end'
    (tokens after the window to the document end) as `QUANTILES`, 'long_doc_share' (windows
    in documents of >= 4T tokens) and 'first_window_overlaps' (windows starting before T).
  """
  t = int(window_len)
  doc, start, doc_len = (np.asarray(per_window[k], np.int64) for k in ('doc', 'start', 'doc_len'))
  kind = np.asarray(per_window['kind']).astype(str)
  to_end = np.maximum(doc_len - start - (t + 1), 0)
  def dist(x):
    return {k: float(np.quantile(x, q)) for k, q in QUANTILES.items()} if len(x) else None
  kinds = sorted(set(kind.tolist()))
  summary = {
      'windows': len(doc), 'documents': len(np.unique(doc)), 'window_len': t,
      'kinds': {k: {'windows': int((kind == k).sum()),
                    'documents': len(np.unique(doc[kind == k]))} for k in kinds},
      'start': dist(start), 'to_end': dist(to_end),
      'long_doc_share': float(np.mean(doc_len >= 4 * t)) if len(doc) else None,
      'first_window_overlaps': int((start < t).sum())}
  return {'windows': summary,
          'by_kind': _groups(per_window, kind, [(k, None, None) for k in kinds]),
          'by_depth': _binned(per_window, start, DEPTH_BINS, t),
          'by_end': _binned(per_window, to_end, END_BINS, t)}


def _binned(per_window, values: np.ndarray, bins: tuple[int, ...], t: int) -> list[dict]:
  lo = [b * t for b in bins]
  groups = [(f'[{a}, {b})', a, b) for a, b in zip(lo, lo[1:])] + [(f'>= {lo[-1]}', lo[-1], None)]
  labels = np.array([g[0] for g in groups])[np.searchsorted(lo, values, side='right') - 1]
  return _groups(per_window, labels, groups)


def _groups(per_window, labels: np.ndarray, groups: list[tuple]) -> list[dict[str, Any]]:
  """Bucket rows of the windows of each non-empty group (label, lo, hi)."""
  out = []
  for label, lo, hi in groups:
    m = labels == label
    if m.any():
      sub = {k: v if k == 'edges' else np.asarray(v)[m] for k, v in per_window.items()}
      out.append({'group': label, 'lo': lo, 'hi': hi, 'windows': int(m.sum()),
                  'documents': int(clusters(sub).max()) + 1, 'buckets': bucket_rows(sub)})
  return out


class BucketAccumulator:
  """Per-position sums and per-window bucket sums of one evaluation pass.

  Attributes:
    edges: [nb + 1] bucket edges.
    loss_sum, count: float64 [L] per-position loss sums and scored-token counts.
  """

  def __init__(self, edges: np.ndarray):
    self.edges = np.asarray(edges, np.int64)
    length = int(self.edges[-1])
    self.loss_sum = np.zeros(length, np.float64)
    self.count = np.zeros(length, np.float64)
    self.windows = 0  # windows with any scored token
    self._parts: list[dict[str, np.ndarray]] = []  # per batch: its windows' arrays

  def add(self, pos_loss_sum: np.ndarray, pos_count: np.ndarray, win_sum: np.ndarray,
          win_count: np.ndarray, window_ids: np.ndarray | None = None,
          provenance: dict[str, np.ndarray] | None = None) -> None:
    """Adds one batch.

    Args:
      pos_loss_sum: [L] summed loss per position.
      pos_count: [L] scored tokens per position.
      win_sum: [B, nb] summed loss per window and bucket.
      win_count: [B, nb] scored tokens per window and bucket.
      window_ids: [B] uint64 identity of each window's text and positions (``window_ids``),
        or None (then windows are numbered in arrival order).
      provenance: optional [B] arrays ``doc``, ``start``, ``doc_len``, ``kind``
        (``data.pipeline.PROVENANCE_KEYS``); windows of one ``doc`` form one cluster.
    """
    s = np.asarray(win_sum, np.float64)
    c = np.asarray(win_count, np.float64)
    real = c.sum(1) > 0
    if window_ids is None:
      window_ids = np.arange(self.windows, self.windows + len(c), dtype=np.uint64)
    part = {k: np.asarray(v)[real] for k, v in (provenance or {}).items()}
    part.update(window_id=np.asarray(window_ids, np.uint64)[real], win_sum=s[real],
                win_count=c[real])
    self._parts.append(part)
    self.loss_sum += np.asarray(pos_loss_sum, np.float64)
    self.count += np.asarray(pos_count, np.float64)
    self.windows += int(real.sum())

  def per_window(self) -> dict[str, np.ndarray]:
    """``window_id`` [W] (uint64), ``win_sum`` and ``win_count`` [W, nb], ``edges``
    [nb + 1] and, when every batch had them, the provenance arrays [W]: the contents of
    ``windows.npz`` (what ``paired_difference`` pairs)."""
    nb = len(self.edges) - 1
    keys = set.intersection(*(set(p) for p in self._parts)) if self._parts else set()
    out = {k: np.concatenate([p[k] for p in self._parts]) for k in sorted(keys)}
    if not self._parts:
      out = {'window_id': np.zeros(0, np.uint64), 'win_sum': np.zeros((0, nb)),
             'win_count': np.zeros((0, nb))}
    return dict(out, edges=self.edges.copy())

  def bucket_stats(self) -> tuple[np.ndarray, np.ndarray]:
    """Per-bucket mean loss [nb] and covariance of the means [nb, nb] (`bucket_stats`)."""
    return bucket_stats(self.per_window())[:2]

  def overall(self) -> dict[str, Any]:
    return overall(self.per_window())

  def degradation(self) -> dict[str, Any]:
    return degradation(self.per_window())

  def buckets(self, reference: dict[str, np.ndarray] | None = None) -> list[dict[str, Any]]:
    """Per-bucket rows of results.json (`bucket_rows`).

    Args:
      reference: optional {'bayes_loss': [>=L], 'filter_loss': [>=L]} per-position optimal losses
        (synthetic corpus); each bucket then gets the token-weighted mean of both, `excess_loss`
        and `recovered` = (filter - loss) / (filter - bayes).
    """
    rows = bucket_rows(self.per_window())
    for row in rows if reference is not None else ():
      w = self.count[row['start']:row['end']]
      bayes = filt = math.nan
      if w.sum() > 0:
        bayes = float(np.dot(w, reference['bayes_loss'][row['start']:row['end']]) / w.sum())
        filt = float(np.dot(w, reference['filter_loss'][row['start']:row['end']]) / w.sum())
      loss, gap = (math.nan if row['loss'] is None else row['loss']), filt - bayes
      row.update(bayes_loss=_num(bayes), filter_loss=_num(filt), excess_loss=_num(loss - bayes),
                 recovered=_num((filt - loss) / gap) if abs(gap) > 1e-9 else None)
    return rows

  def per_position(self) -> dict[str, np.ndarray]:
    """Per-position vectors: position, loss_sum, count, loss (nan where unscored), all [L]."""
    with np.errstate(invalid='ignore', divide='ignore'):
      loss = np.where(self.count > 0, self.loss_sum / self.count, np.nan)
    return {'position': np.arange(len(self.count)), 'loss_sum': self.loss_sum.copy(),
            'count': self.count.copy(), 'loss': loss}


def _num(x: float) -> float | None:
  """A float for JSON: None instead of nan/inf."""
  x = float(x)
  return x if math.isfinite(x) else None


def window_ids(inputs: np.ndarray, positions: np.ndarray, loss_mask: np.ndarray) -> np.ndarray:
  """[B] uint64 identity of each window (row): a hash of its tokens, positions and scored
  targets, so two evaluations pair up exactly when they scored the same text at the same rows.
  """
  out = np.empty(len(inputs), np.uint64)
  for i in range(len(inputs)):
    h = hashlib.blake2b(digest_size=8)
    for a in (inputs[i], positions[i], loss_mask[i]):
      h.update(np.ascontiguousarray(a).tobytes())
    out[i] = np.frombuffer(h.digest(), np.uint64)[0]
  return out


def unique_window_ids(ids: np.ndarray, seen: dict[int, int]) -> np.ndarray:
  """Makes repeated window ids unique by their occurrence number (two identical texts in an
  evaluation are two windows); ``seen`` counts occurrences across the batches of one pass."""
  out = np.empty(len(ids), np.uint64)
  for i, w in enumerate(np.asarray(ids, np.uint64).tolist()):
    k = seen.get(w, 0)
    seen[w] = k + 1
    out[i] = w if k == 0 else (w ^ ((k * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF))
  return out


def paired_difference(a: dict[str, np.ndarray], b: dict[str, np.ndarray],
                      names: tuple[str, str] = ('A', 'B')) -> list[dict[str, Any]]:
  """Per-bucket loss difference A - B over the windows both evaluations scored, with the
  paired standard error clustered by document (A's ``doc``; else by window) and a t interval.

  With per-window sums s, counts c, bucket means L = sum s / sum c and C = sum c, the terms
  ``r_w = (s_A - L_A c_A) / C_A - (s_B - L_B c_B) / C_B`` summed per cluster give
  ``Var(L_A - L_B) = n / (n - 1) * sum_g r_g^2`` (n clusters with tokens in the bucket): the
  delta-method variance of a difference of ratio estimators on shared clusters.

  Args:
    a, b: ``BucketAccumulator.per_window()`` dicts (``windows.npz`` contents).
    names: labels used in error messages.
  Returns:
    One dict per bucket: ``start``, ``end``, ``windows``, ``documents`` (clusters),
    ``loss_a``, ``loss_b``, ``diff``, ``stderr``, ``ci95`` (t quantile, documents - 1 degrees
    of freedom), ``unpaired_stderr`` (``sqrt(se_A^2 + se_B^2)``, what the pairing saves).

  Raises:
    ValueError: different bucket edges or window sets (named, with the fix).
  """
  if not np.array_equal(a['edges'], b['edges']):
    raise ValueError(f'{names[0]} and {names[1]} were evaluated with different bucket edges '
                     f'({list(a["edges"])} vs {list(b["edges"])}); evaluate both with the same '
                     '--bucket_size/--bucket_edges.')
  ia, ib = np.asarray(a['window_id']), np.asarray(b['window_id'])
  if (len(np.unique(ia)) != len(ia) or len(np.unique(ib)) != len(ib)
      or set(ia.tolist()) != set(ib.tolist())):
    only_a, only_b = len(set(ia.tolist()) - set(ib.tolist())), len(set(ib.tolist()) - set(ia.tolist()))
    raise ValueError(
        f'{names[0]} and {names[1]} were evaluated on different windows ({only_a} only in '
        f'{names[0]}, {only_b} only in {names[1]}, of {len(ia)} and {len(ib)}); a paired '
        'comparison needs the same texts: evaluate both with the same data, split, window '
        'length, --window_start, --min_doc_len, --min_start, --num_windows and eval seed.')
  order = np.argsort(ib)[np.searchsorted(np.sort(ib), ia)]
  # The windows' documents from whichever run recorded them (a windows.npz written before
  # provenance existed has none): clustering by window alone would understate the error.
  cl = clusters(a if 'doc' in a or 'doc' not in b else dict(a, doc=np.asarray(b['doc'])[order]))
  sa, ca = np.asarray(a['win_sum'], np.float64), np.asarray(a['win_count'], np.float64)
  sb, cb = np.asarray(b['win_sum'], np.float64)[order], np.asarray(b['win_count'], np.float64)[order]
  ta, tb = ca.sum(0), cb.sum(0)
  with np.errstate(invalid='ignore', divide='ignore'):
    la, lb = sa.sum(0) / ta, sb.sum(0) / tb
    ra = _cluster_sums((sa - np.nan_to_num(la) * ca) / ta, cl)
    rb = _cluster_sums((sb - np.nan_to_num(lb) * cb) / tb, cl)
  n = _cluster_sums(((ca > 0) | (cb > 0)).astype(np.float64), cl) > 0
  rows = []
  for i in range(len(a['edges']) - 1):
    g = int(n[:, i].sum())
    row = {'start': int(a['edges'][i]), 'end': int(a['edges'][i + 1]),
           'windows': int(((ca[:, i] > 0) | (cb[:, i] > 0)).sum()), 'documents': g}
    if g < 2 or ta[i] <= 0 or tb[i] <= 0:
      rows.append(dict(row, loss_a=None, loss_b=None, diff=None, stderr=None,
                       ci95=[None, None], unpaired_stderr=None))
      continue
    factor, d = g / (g - 1), float(la[i] - lb[i])
    se = math.sqrt(factor * np.sum((ra[:, i] - rb[:, i]) ** 2))
    unpaired = math.sqrt(factor * (np.sum(ra[:, i] ** 2) + np.sum(rb[:, i] ** 2)))
    q = t95(g)
    rows.append(dict(row, loss_a=float(la[i]), loss_b=float(lb[i]), diff=d, stderr=se,
                     ci95=[d - q * se, d + q * se], unpaired_stderr=unpaired))
  return rows
