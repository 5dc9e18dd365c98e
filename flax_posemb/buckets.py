"""Loss by position bucket, document-clustered errors (docs/DESIGN.md
§ Evaluation outputs)."""

import hashlib
import math
from typing import Any

import numpy as np
import scipy.stats

# Window groups of `provenance_tables` in window lengths T (start depth; tokens
# after the window to the document's end). Geometric: token-uniform windows in
# books sit tens of T deep.
DEPTH_BINS = (0, 1, 2, 4, 8, 32, 128)
END_BINS = (0, 1, 4, 32)
QUANTILES = {
    'min': 0.0,
    'p10': 0.1,
    'p25': 0.25,
    'median': 0.5,
    'p75': 0.75,
    'p90': 0.9,
    'max': 1.0,
}


def make_edges(
    length: int, bucket_size: int = 0, edges: str | list[int] = ''
) -> np.ndarray:
  """int64 [nb + 1] edges from 0 to ``length``: ``edges`` 'log2', increasing
  ints from 0 ('0,128,256' or a list), or '' (uniform buckets of
  ``bucket_size``)."""
  if isinstance(edges, str) and edges.strip() == 'log2':
    return np.asarray(
        [0]
        + [2**i for i in range(int(length).bit_length()) if 2**i < length]
        + [length],
        np.int64,
    )
  try:
    if isinstance(edges, str):
      given = [int(x) for x in edges.split(',') if x.strip()]
    else:
      given = [int(x) for x in edges]
  except ValueError:
    raise ValueError(
        'bucket edges must be comma-separated integers or'
        f' "log2", got {edges!r}.'
    ) from None
  if not given:
    if bucket_size < 1:
      raise ValueError(
          'bucket_size must be >= 1 (or give bucket edges), got'
          f' {bucket_size}.'
      )
    return np.asarray(list(range(0, length, bucket_size)) + [length], np.int64)
  if given[0] != 0:
    raise ValueError(
        f'bucket edges must start at 0, got {given}. Fix: prepend 0.'
    )
  if any(b <= a for a, b in zip(given, given[1:])):
    raise ValueError(f'bucket edges must increase strictly, got {given}.')
  if given[-1] > length:
    raise ValueError(
        f'bucket edge {given[-1]} exceeds the evaluation '
        f'window length {length}. Fix: use edges <= {length}.'
    )
  if given[-1] < length:
    given.append(length)
  return np.asarray(given, np.int64)


def bucket_of_position(edges: np.ndarray) -> np.ndarray:
  """int32 [edges[-1]]: the bucket index of every position (``edges``: array [nb
  + 1])."""
  return (
      np.searchsorted(edges, np.arange(edges[-1]), side='right') - 1
  ).astype(np.int32)


def clusters(per_window: dict[str, np.ndarray]) -> np.ndarray:
  """[W] cluster index 0..G-1 of every window: its document ('doc'), else the
  window."""
  num_windows = len(per_window['win_sum'])
  doc = per_window.get('doc')
  if doc is None:
    keys = np.arange(num_windows)
  else:
    keys = np.asarray(doc, np.int64)
  return np.unique(keys, return_inverse=True)[1].reshape(num_windows)


def _cluster_sums(x: np.ndarray, cl: np.ndarray) -> np.ndarray:
  """[W, k] per-window rows summed per cluster: [G, k]."""
  out = np.zeros((int(cl.max(initial=-1)) + 1,) + x.shape[1:])
  np.add.at(out, cl, x)
  return out


def bucket_stats(
    per_window: dict[str, np.ndarray],
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Bucket means [nb], their covariance [nb, nb] and the clusters in both
  buckets [nb, nb]."""
  cl = clusters(per_window)
  # [G, nb] per cluster.
  sums = _cluster_sums(np.asarray(per_window['win_sum'], np.float64), cl)
  counts = _cluster_sums(np.asarray(per_window['win_count'], np.float64), cl)
  tokens = counts.sum(0)
  present = (counts > 0).astype(np.float64)
  nn = present.T @ present
  with np.errstate(invalid='ignore', divide='ignore'):
    loss = sums.sum(0) / tokens
    residuals = sums - np.where(tokens > 0, loss, 0.0) * counts
    # Buckets that share no cluster have covariance 0 (every product r_i r_j is
    # 0).
    factor = np.where(
        nn > 1, nn / np.maximum(nn - 1, 1), np.where(nn == 0, 1.0, np.nan)
    )
    cov = factor * (residuals.T @ residuals) / np.outer(tokens, tokens)
  return loss, cov, nn


def _num(x: float) -> float | None:  # JSON: None instead of nan/inf
  x = float(x)
  return x if math.isfinite(x) else None


def bucket_rows(per_window: dict[str, np.ndarray]) -> list[dict[str, Any]]:
  """results.json bucket rows (docs/DESIGN.md § Evaluation outputs) of
  ``per_window``."""
  loss, cov, nn = bucket_stats(per_window)
  edges = per_window['edges']
  counts = np.asarray(per_window['win_count'])
  var = np.diag(cov)
  se = np.sqrt(np.where(var >= 0, var, np.nan))
  # Two-sided 95% t quantiles with clusters - 1 degrees of freedom (nan below 2
  # clusters).
  q = scipy.stats.t.ppf(0.975, np.diag(nn) - 1)
  return [
      {
          'start': int(edges[i]),
          'end': int(edges[i + 1]),
          'tokens': int(round(counts[:, i].sum())),
          'windows': int((counts[:, i] > 0).sum()),
          'documents': int(nn[i, i]),
          'loss': _num(loss[i]),
          'stderr': _num(se[i]),
          'ci95': [_num(loss[i] - q[i] * se[i]), _num(loss[i] + q[i] * se[i])],
          'bits_per_token': _num(loss[i] / math.log(2)),
      }
      for i in range(len(edges) - 1)
  ]


def overall(per_window: dict[str, np.ndarray]) -> dict[str, Any]:
  """Loss over all scored tokens with its document-clustered standard error."""
  whole = dict(
      per_window,
      edges=np.array([0, 1]),
      win_sum=np.asarray(per_window['win_sum']).sum(1, keepdims=True),
      win_count=np.asarray(per_window['win_count']).sum(1, keepdims=True),
  )
  (row,) = bucket_rows(whole)
  keys = ('tokens', 'windows', 'documents', 'loss', 'stderr', 'bits_per_token')
  return {k: row[k] for k in keys}


def degradation(per_window: dict[str, np.ndarray]) -> dict[str, Any]:
  """Last minus best bucket and the 1/stderr^2-weighted second-half slope, with
  stderrs."""
  loss, cov, _ = bucket_stats(per_window)

  def se(var):
    if not np.isfinite(var):
      return None
    return _num(math.sqrt(max(var, 0.0)))

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
      last_minus_best_stderr=se(
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
  out['slope_stderr'] = se(float(a @ cov[np.ix_(sel, sel)] @ a))
  return out


def _bins(
    bins: tuple[int, ...], t: int
) -> list[tuple[str, int | None, int | None]]:
  """(label, lo, hi) of each group of ``bins`` in window lengths ``t``."""
  lo = [b * t for b in bins]
  groups: list[tuple[str, int | None, int | None]] = [
      (f'[{a}, {b})', a, b) for a, b in zip(lo, lo[1:])
  ]
  return groups + [(f'>= {lo[-1]}', lo[-1], None)]


def _binned_labels(values: np.ndarray, bins: tuple[int, ...], t: int):
  groups = _bins(bins, t)
  lo = [b * t for b in bins]
  return np.array([g[0] for g in groups])[
      np.searchsorted(lo, values, side='right') - 1
  ]


def window_groups(
    per_window: dict[str, np.ndarray], window_len: int
) -> dict[str, tuple[np.ndarray, list[tuple[str, int | None, int | None]]]]:
  """Each window's group ``[W]`` and the groups (label, lo, hi) of the tables
  `by_kind`, `by_depth` and `by_end` (docs/DESIGN.md § Evaluation outputs)."""
  t = int(window_len)
  start = np.asarray(per_window['start'], np.int64)
  doc_len = np.asarray(per_window['doc_len'], np.int64)
  kind = np.asarray(per_window['kind']).astype(str)
  to_end = np.maximum(doc_len - start - (t + 1), 0)
  kinds = sorted(set(kind.tolist()))
  return {
      'by_kind': (kind, [(k, None, None) for k in kinds]),
      'by_depth': (_binned_labels(start, DEPTH_BINS, t), _bins(DEPTH_BINS, t)),
      'by_end': (_binned_labels(to_end, END_BINS, t), _bins(END_BINS, t)),
  }


def provenance_tables(
    per_window: dict[str, np.ndarray], window_len: int
) -> dict[str, Any]:
  """Where the windows come from and bucket loss by window group
  (docs/DESIGN.md § Evaluation outputs)."""
  t = int(window_len)
  doc = np.asarray(per_window['doc'], np.int64)
  start = np.asarray(per_window['start'], np.int64)
  doc_len = np.asarray(per_window['doc_len'], np.int64)
  kind = np.asarray(per_window['kind']).astype(str)
  to_end = np.maximum(doc_len - start - (t + 1), 0)

  def dist(x):
    if not len(x):
      return None
    return {k: float(np.quantile(x, q)) for k, q in QUANTILES.items()}

  kinds = sorted(set(kind.tolist()))
  tables = {
      name: _groups(per_window, labels, groups)
      for name, (labels, groups) in window_groups(per_window, t).items()
  }
  return {
      'windows': {
          'windows': len(doc),
          'documents': len(np.unique(doc)),
          'window_len': t,
          'kinds': {
              k: {
                  'windows': int((kind == k).sum()),
                  'documents': len(np.unique(doc[kind == k])),
              }
              for k in kinds
          },
          'start': dist(start),
          'to_end': dist(to_end),
          'long_doc_share': (
              float(np.mean(doc_len >= 4 * t)) if len(doc) else None
          ),
          'first_window_overlaps': int((start < t).sum()),
      },
      **tables,
  }


def _groups(
    per_window, labels: np.ndarray, groups: list[tuple]
) -> list[dict[str, Any]]:
  """Bucket rows of the windows of each non-empty group (label, lo, hi)."""
  out = []
  for label, lo, hi in groups:
    m = labels == label
    if m.any():
      sub = {
          k: v if k == 'edges' else np.asarray(v)[m]
          for k, v in per_window.items()
      }
      out.append(
          {
              'group': label,
              'lo': lo,
              'hi': hi,
              'windows': int(m.sum()),
              'documents': int(clusters(sub).max()) + 1,
              'buckets': bucket_rows(sub),
          }
      )
  return out


class BucketAccumulator:
  """Per-position [L] and per-window bucket sums of one evaluation pass."""

  def __init__(self, edges: np.ndarray):
    self.edges = np.asarray(edges, np.int64)
    length = int(self.edges[-1])
    self.loss_sum = np.zeros(length, np.float64)
    self.count = np.zeros(length, np.float64)
    self.windows = 0  # windows with any scored token
    # per batch: its windows' arrays
    self._parts: list[dict[str, np.ndarray]] = []

  def add(
      self,
      pos_loss_sum: np.ndarray,
      pos_count: np.ndarray,
      win_sum: np.ndarray,
      win_count: np.ndarray,
      window_ids: np.ndarray | None = None,
      provenance: dict[str, np.ndarray] | None = None,
  ) -> None:
    """Adds [L] and [B, nb] sums and counts, [B] ``window_ids`` (None: arrival
    order) and [B] provenance arrays."""
    sums = np.asarray(win_sum, np.float64)
    counts = np.asarray(win_count, np.float64)
    real = counts.sum(1) > 0
    if window_ids is None:
      window_ids = np.arange(
          self.windows, self.windows + len(counts), dtype=np.uint64
      )
    part = {k: np.asarray(v)[real] for k, v in (provenance or {}).items()}
    self._parts.append(
        dict(
            part,
            window_id=np.asarray(window_ids, np.uint64)[real],
            win_sum=sums[real],
            win_count=counts[real],
        )
    )
    self.loss_sum += np.asarray(pos_loss_sum, np.float64)
    self.count += np.asarray(pos_count, np.float64)
    self.windows += int(real.sum())

  def per_window(self) -> dict[str, np.ndarray]:
    """The contents of windows.npz (docs/DESIGN.md § Evaluation outputs)."""
    nb = len(self.edges) - 1
    parts = self._parts or [
        {
            'window_id': np.zeros(0, np.uint64),
            'win_sum': np.zeros((0, nb)),
            'win_count': np.zeros((0, nb)),
        }
    ]
    keys = sorted(set.intersection(*(set(p) for p in parts)))
    return dict(
        {k: np.concatenate([p[k] for p in parts]) for k in keys},
        edges=self.edges.copy(),
    )

  def buckets(
      self, reference: dict[str, np.ndarray] | None = None
  ) -> list[dict[str, Any]]:
    """`bucket_rows`, with the synthetic ``reference`` losses ([>= L]) if
    given."""
    rows = bucket_rows(self.per_window())
    if reference is None:
      return rows
    for row in rows:
      start = row['start']
      end = row['end']
      # The references weighted by the bucket's scored tokens.
      weights = self.count[start:end]
      total = weights.sum()
      if total > 0:
        bayes_sum = np.dot(weights, reference['bayes_loss'][start:end])
        filter_sum = np.dot(weights, reference['filter_loss'][start:end])
        ref_bayes = float(bayes_sum / total)
        ref_filter = float(filter_sum / total)
      else:
        ref_bayes = math.nan
        ref_filter = math.nan
      loss = math.nan if row['loss'] is None else row['loss']
      gap = ref_filter - ref_bayes
      row.update(
          bayes_loss=_num(ref_bayes),
          filter_loss=_num(ref_filter),
          excess_loss=_num(loss - ref_bayes),
          recovered=_num((ref_filter - loss) / gap)
          if abs(gap) > 1e-9
          else None,
      )
    return rows

  def per_position(self) -> dict[str, np.ndarray]:
    """position, loss_sum, count, loss (nan: unscored), all [L]."""
    with np.errstate(invalid='ignore', divide='ignore'):
      loss = np.where(self.count > 0, self.loss_sum / self.count, np.nan)
    return {
        'position': np.arange(len(self.count)),
        'loss_sum': self.loss_sum.copy(),
        'count': self.count.copy(),
        'loss': loss,
    }


def window_ids(
    inputs: np.ndarray, positions: np.ndarray, loss_mask: np.ndarray
) -> np.ndarray:
  """[B] uint64 hash of each row's tokens, positions and scored targets (what
  pairs)."""
  rows = (
      b''.join(
          np.ascontiguousarray(a[i]).tobytes()
          for a in (inputs, positions, loss_mask)
      )
      for i in range(len(inputs))
  )
  return np.frombuffer(
      b''.join(hashlib.blake2b(r, digest_size=8).digest() for r in rows),
      np.uint64,
  ).copy()


def unique_window_ids(ids: np.ndarray, seen: dict[int, int]) -> np.ndarray:
  """Repeated ids made unique by their occurrence number, counted in
  ``seen``."""
  out = np.array(ids, np.uint64)
  for i, w in enumerate(out.tolist()):
    k = seen.get(w, 0)
    seen[w] = k + 1
    # k = 0: w itself
    out[i] = w ^ ((k * 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF)
  return out


def overall_paired_difference(
    a: dict[str, np.ndarray],
    b: dict[str, np.ndarray],
    names: tuple[str, str] = ('A', 'B'),
) -> dict[str, Any]:
  """Loss A - B over all scored tokens of the same windows, with the paired
  document-clustered standard error: `paired_difference` of one bucket."""

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


def paired_difference(
    a: dict[str, np.ndarray],
    b: dict[str, np.ndarray],
    names: tuple[str, str] = ('A', 'B'),
) -> list[dict[str, Any]]:
  """Per bucket, loss A - B over the same windows (``windows.npz`` contents
  ``a``, ``b``) with the paired document-clustered standard error
  (docs/DESIGN.md § Evaluation outputs)."""
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
  # b's rows in a's window order.
  order = np.argsort(ids_b)[np.searchsorted(np.sort(ids_b), ids_a)]
  # The documents from whichever run recorded them: by window alone understates
  # the error.
  if 'doc' in a or 'doc' not in b:
    cl = clusters(a)
  else:
    cl = clusters(dict(a, doc=np.asarray(b['doc'])[order]))
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
    residuals_a = _cluster_sums(
        (sums_a - np.nan_to_num(loss_a) * counts_a) / tokens_a, cl
    )
    residuals_b = _cluster_sums(
        (sums_b - np.nan_to_num(loss_b) * counts_b) / tokens_b, cl
    )
  scored_a = counts_a > 0
  scored_b = counts_b > 0
  # [G, nb] whether the cluster has a scored token in the bucket in A or B.
  present = _cluster_sums((scored_a | scored_b).astype(np.float64), cl) > 0
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
      rows.append(
          dict(
              row,
              loss_a=None,
              loss_b=None,
              diff=None,
              stderr=None,
              ci95=[None, None],
              unpaired_stderr=None,
          )
      )
      continue
    factor = g / (g - 1)
    diff = float(loss_a[i] - loss_b[i])
    r_a = residuals_a[:, i]
    r_b = residuals_b[:, i]
    se = math.sqrt(factor * np.sum((r_a - r_b) ** 2))
    unpaired = math.sqrt(factor * (np.sum(r_a**2) + np.sum(r_b**2)))
    q = float(scipy.stats.t.ppf(0.975, g - 1))
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
    ``{'mean', 'per_seed' (``theta_s``), 'stderr', 'df', 'low', 'high',
    'seeds', 'documents', 'seed_stderr', 'document_stderr', 'level'}``; NaN
    bounds below two seeds or two documents (a group from one document has no
    interval).
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
  variance = seed_var + doc_var
  denominator = seed_var**2 / (num_seeds - 1) + doc_var**2 / (num_docs - 1)
  if denominator > 0:
    df = variance**2 / denominator
  else:
    df = float(min(num_seeds, num_docs) - 1)
  stderr = math.sqrt(variance)
  q = float(scipy.stats.t.ppf(0.5 + level / 2, df))
  return dict(
      out,
      stderr=stderr,
      df=df,
      low=out['mean'] - q * stderr,
      high=out['mean'] + q * stderr,
      seed_stderr=math.sqrt(seed_var),
      document_stderr=math.sqrt(doc_var),
  )


def document_sums(
    per_window: dict[str, np.ndarray], documents: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
  """Bucket sums and counts of ``windows.npz`` contents per document of
  ``documents`` ``[G]``: ``[G, nb]`` each (zeros for a document without
  windows)."""
  docs = np.asarray(per_window['doc'], np.int64)
  index = np.searchsorted(documents, docs)
  shape = (len(documents), np.shape(per_window['win_sum'])[1])
  sums = np.zeros(shape)
  counts = np.zeros(shape)
  np.add.at(sums, index, np.asarray(per_window['win_sum'], np.float64))
  np.add.at(counts, index, np.asarray(per_window['win_count'], np.float64))
  return sums, counts
