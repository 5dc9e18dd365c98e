"""Loss by position bucket, document-clustered errors (docs/DESIGN.md
"Evaluation outputs")."""

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
    out = [
        int(x)
        for x in (edges.split(',') if isinstance(edges, str) else edges)
        if str(x).strip()
    ]
  except ValueError:
    out = None
  problem = next(
      (
          msg
          for bad, msg in (
              (
                  out is None,
                  (
                      'bucket edges must be comma-separated integers or'
                      f' "log2", got {edges!r}.'
                  ),
              ),
              (
                  out == [] and bucket_size < 1,
                  (
                      'bucket_size must be >= 1 (or give bucket edges), got'
                      f' {bucket_size}.'
                  ),
              ),
              (
                  bool(out) and out[0] != 0,
                  f'bucket edges must start at 0, got {out}. Fix: prepend 0.',
              ),
              (
                  bool(out) and any(b <= a for a, b in zip(out, out[1:])),
                  f'bucket edges must increase strictly, got {out}.',
              ),
              (
                  bool(out) and out[-1] > length,
                  (
                      f'bucket edge {out and out[-1]} exceeds the evaluation '
                      f'window length {length}. Fix: use edges <= {length}.'
                  ),
              ),
          )
          if bad
      ),
      None,
  )
  if problem:
    raise ValueError(problem)
  if not out:
    return np.asarray(list(range(0, length, bucket_size)) + [length], np.int64)
  return np.asarray(out + ([length] if out[-1] < length else []), np.int64)


def bucket_of_position(edges: np.ndarray) -> np.ndarray:
  """int32 [edges[-1]]: the bucket index of every position (``edges``: array [nb
  + 1])."""
  return (
      np.searchsorted(edges, np.arange(edges[-1]), side='right') - 1
  ).astype(np.int32)


def clusters(per_window: dict[str, np.ndarray]) -> np.ndarray:
  """[W] cluster index 0..G-1 of every window: its document ('doc'), else the
  window."""
  n, doc = len(per_window['win_sum']), per_window.get('doc')
  keys = np.arange(n) if doc is None else np.asarray(doc, np.int64)
  return np.unique(keys, return_inverse=True)[1].reshape(n)


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
  s = _cluster_sums(np.asarray(per_window['win_sum'], np.float64), cl)
  c = _cluster_sums(np.asarray(per_window['win_count'], np.float64), cl)
  present = (c > 0).astype(np.float64)
  nn = present.T @ present
  with np.errstate(invalid='ignore', divide='ignore'):
    loss = s.sum(0) / c.sum(0)
    r = s - np.where(c.sum(0) > 0, loss, 0.0) * c
    # Buckets that share no cluster have covariance 0 (every product r_i r_j is
    # 0).
    factor = np.where(
        nn > 1, nn / np.maximum(nn - 1, 1), np.where(nn == 0, 1.0, np.nan)
    )
    cov = factor * (r.T @ r) / np.outer(c.sum(0), c.sum(0))
  return loss, cov, nn


def _num(x: float) -> float | None:  # JSON: None instead of nan/inf
  x = float(x)
  return x if math.isfinite(x) else None


def bucket_rows(per_window: dict[str, np.ndarray]) -> list[dict[str, Any]]:
  """results.json bucket rows (docs/DESIGN.md) of ``per_window``."""
  loss, cov, nn = bucket_stats(per_window)
  edges, c, var = (
      per_window['edges'],
      np.asarray(per_window['win_count']),
      np.diag(cov),
  )
  # Two-sided 95% t quantiles with clusters - 1 degrees of freedom (nan below 2
  # clusters).
  se, q = np.sqrt(np.where(var >= 0, var, np.nan)), scipy.stats.t.ppf(
      0.975, np.diag(nn) - 1
  )
  return [
      {
          'start': int(edges[i]),
          'end': int(edges[i + 1]),
          'tokens': int(round(c[:, i].sum())),
          'windows': int((c[:, i] > 0).sum()),
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
      **{
          k: np.asarray(per_window[k]).sum(1, keepdims=True)
          for k in ('win_sum', 'win_count')
      },
  )
  (row,) = bucket_rows(whole)
  return {
      k: row[k]
      for k in (
          'tokens',
          'windows',
          'documents',
          'loss',
          'stderr',
          'bits_per_token',
      )
  }


def degradation(per_window: dict[str, np.ndarray]) -> dict[str, Any]:
  """Last minus best bucket and the 1/stderr^2-weighted second-half slope, with
  stderrs."""
  loss, cov, _ = bucket_stats(per_window)

  def se(var):
    return _num(math.sqrt(max(var, 0.0)) if np.isfinite(var) else math.nan)

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
  last, best = int(valid[-1]), int(valid[np.argmin(loss[valid])])
  out.update(
      best_bucket=best,
      last_minus_best=float(loss[last] - loss[best]),
      last_minus_best_stderr=se(
          cov[last, last] + cov[best, best] - 2 * cov[last, best]
      ),
  )
  mid = (edges[:-1] + edges[1:] - 1) / 2.0
  sel = np.array([i for i in valid if mid[i] >= edges[-1] / 2.0], np.int64)
  out['slope_buckets'] = [int(i) for i in sel]
  if len(sel) < 2:
    return out
  x, y, d = mid[sel], loss[sel], np.diag(cov)[sel]
  w = 1.0 / d if np.all(np.isfinite(d)) and np.all(d > 0) else np.ones_like(x)
  xw = np.sum(w * x) / np.sum(w)
  a = w * (x - xw) / np.sum(w * (x - xw) ** 2)
  out.update(
      slope=float(a @ y), slope_stderr=se(float(a @ cov[np.ix_(sel, sel)] @ a))
  )
  return out


def provenance_tables(
    per_window: dict[str, np.ndarray], window_len: int
) -> dict[str, Any]:
  """Where the windows come from and bucket loss by window group
  (docs/DESIGN.md)."""
  t = int(window_len)
  doc, start, doc_len = (
      np.asarray(per_window[k], np.int64) for k in ('doc', 'start', 'doc_len')
  )
  kind = np.asarray(per_window['kind']).astype(str)
  to_end = np.maximum(doc_len - start - (t + 1), 0)

  def dist(x):
    return (
        {k: float(np.quantile(x, q)) for k, q in QUANTILES.items()}
        if len(x)
        else None
    )

  kinds = sorted(set(kind.tolist()))
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
      'by_kind': _groups(per_window, kind, [(k, None, None) for k in kinds]),
      'by_depth': _binned(per_window, start, DEPTH_BINS, t),
      'by_end': _binned(per_window, to_end, END_BINS, t),
  }


def _binned(
    per_window, values: np.ndarray, bins: tuple[int, ...], t: int
) -> list[dict]:
  lo = [b * t for b in bins]
  groups = [(f'[{a}, {b})', a, b) for a, b in zip(lo, lo[1:])] + [
      (f'>= {lo[-1]}', lo[-1], None)
  ]
  labels = np.array([g[0] for g in groups])[
      np.searchsorted(lo, values, side='right') - 1
  ]
  return _groups(per_window, labels, groups)


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
    self.loss_sum, self.count = np.zeros((2, int(self.edges[-1])), np.float64)
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
    s, c = np.asarray(win_sum, np.float64), np.asarray(win_count, np.float64)
    real = c.sum(1) > 0
    if window_ids is None:
      window_ids = np.arange(
          self.windows, self.windows + len(c), dtype=np.uint64
      )
    part = {k: np.asarray(v)[real] for k, v in (provenance or {}).items()}
    self._parts.append(
        dict(
            part,
            window_id=np.asarray(window_ids, np.uint64)[real],
            win_sum=s[real],
            win_count=c[real],
        )
    )
    self.loss_sum += np.asarray(pos_loss_sum, np.float64)
    self.count += np.asarray(pos_count, np.float64)
    self.windows += int(real.sum())

  def per_window(self) -> dict[str, np.ndarray]:
    """The contents of windows.npz (docs/DESIGN.md)."""
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
    for row in rows if reference is not None else ():
      w = self.count[row['start'] : row['end']]
      bayes, filt = (
          float(np.dot(w, reference[k][row['start'] : row['end']]) / w.sum())
          if w.sum() > 0
          else math.nan
          for k in ('bayes_loss', 'filter_loss')
      )
      loss, gap = (
          math.nan if row['loss'] is None else row['loss']
      ), filt - bayes
      row.update(
          bayes_loss=_num(bayes),
          filter_loss=_num(filt),
          excess_loss=_num(loss - bayes),
          recovered=_num((filt - loss) / gap) if abs(gap) > 1e-9 else None,
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
  (docs/DESIGN.md)."""
  ia, ib = np.asarray(a['window_id']), np.asarray(b['window_id'])
  ids_a, ids_b = set(ia.tolist()), set(ib.tolist())
  if (
      not np.array_equal(a['edges'], b['edges'])
      or len(ids_a) != len(ia)
      or len(ids_b) != len(ib)
      or ids_a != ids_b
  ):
    raise ValueError(
        f'{names[0]} and {names[1]} were evaluated on different windows or'
        f' buckets ({len(ids_a - ids_b)} windows only in {names[0]},'
        f' {len(ids_b - ids_a)} only in {names[1]}, of {len(ia)} and {len(ib)};'
        f' edges {list(a["edges"])} and {list(b["edges"])}); evaluate both with'
        ' the same data, split, window and eval flags.'
    )
  order = np.argsort(ib)[np.searchsorted(np.sort(ib), ia)]
  # The documents from whichever run recorded them: by window alone understates
  # the error.
  cl = clusters(
      a
      if 'doc' in a or 'doc' not in b
      else dict(a, doc=np.asarray(b['doc'])[order])
  )
  sa, ca = (np.asarray(a[k], np.float64) for k in ('win_sum', 'win_count'))
  sb, cb = (
      np.asarray(b[k], np.float64)[order] for k in ('win_sum', 'win_count')
  )
  ta, tb = ca.sum(0), cb.sum(0)
  with np.errstate(invalid='ignore', divide='ignore'):
    la, lb = sa.sum(0) / ta, sb.sum(0) / tb
    ra = _cluster_sums((sa - np.nan_to_num(la) * ca) / ta, cl)
    rb = _cluster_sums((sb - np.nan_to_num(lb) * cb) / tb, cl)
  n = _cluster_sums(((ca > 0) | (cb > 0)).astype(np.float64), cl) > 0
  rows = []
  for i in range(len(a['edges']) - 1):
    g = int(n[:, i].sum())
    row = {
        'start': int(a['edges'][i]),
        'end': int(a['edges'][i + 1]),
        'windows': int(((ca[:, i] > 0) | (cb[:, i] > 0)).sum()),
        'documents': g,
    }
    if g < 2 or ta[i] <= 0 or tb[i] <= 0:
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
    factor, d = g / (g - 1), float(la[i] - lb[i])
    se = math.sqrt(factor * np.sum((ra[:, i] - rb[:, i]) ** 2))
    unpaired = math.sqrt(
        factor * (np.sum(ra[:, i] ** 2) + np.sum(rb[:, i] ** 2))
    )
    q = float(scipy.stats.t.ppf(0.975, g - 1))
    rows.append(
        dict(
            row,
            loss_a=float(la[i]),
            loss_b=float(lb[i]),
            diff=d,
            stderr=se,
            ci95=[d - q * se, d + q * se],
            unpaired_stderr=unpaired,
        )
    )
  return rows
