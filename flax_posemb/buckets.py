"""Position buckets and the streaming statistics of loss by bucket (pure numpy).

The evaluation step returns, for every window (row) of a batch, the summed loss and the
number of scored tokens in each position bucket. `BucketAccumulator` folds those into
float64 moment matrices, so memory does not grow with the number of windows, and turns
them into per-bucket means with standard errors that respect the correlation of tokens
within one window.

Standard errors use the ratio (cluster) estimator with windows as clusters: for bucket i
with per-window sums s_wi and counts c_wi, L_i = sum_w s_wi / sum_w c_wi and

  Var(L_i) = n_i / (n_i - 1) * sum_w (s_wi - L_i c_wi)^2 / (sum_w c_wi)^2,

n_i = windows with tokens in bucket i. When every window holds the same number of tokens
in the bucket (the default full-length windows) this is exactly the spread of the
per-window bucket means: std(m_wi, ddof=1) / sqrt(n_i). The same moments give the full
covariance between buckets (they share windows), used for the standard errors of
"last minus best" and of the degradation slope.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import numpy as np
import scipy.stats

Z95 = 1.959963984540054  # Two-sided 95% normal quantile.


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


class BucketAccumulator:
  """Streams per-window bucket sums into float64 moments (memory O(L + nb^2)).

  Attributes:
    edges: [nb + 1] bucket edges.
    loss_sum, count: float64 [L] per-position loss sums and scored-token counts.
  """

  def __init__(self, edges: np.ndarray):
    self.edges = np.asarray(edges, np.int64)
    nb = len(self.edges) - 1
    length = int(self.edges[-1])
    self.loss_sum = np.zeros(length, np.float64)
    self.count = np.zeros(length, np.float64)
    self.s = np.zeros(nb)  # sum_w s_wi
    self.c = np.zeros(nb)  # sum_w c_wi
    self.ss = np.zeros((nb, nb))  # sum_w s_wi s_wj
    self.sc = np.zeros((nb, nb))  # sum_w s_wi c_wj
    self.cc = np.zeros((nb, nb))  # sum_w c_wi c_wj
    self.nn = np.zeros((nb, nb))  # windows with tokens in both i and j
    self.windows = 0  # windows with any scored token
    # Per-window sums of the windows with a scored token (O(W nb)): saved with every
    # evaluation so that two runs on the same windows can be compared pairwise.
    self._ids: list[np.ndarray] = []
    self._sums: list[np.ndarray] = []
    self._counts: list[np.ndarray] = []

  def add(self, pos_loss_sum: np.ndarray, pos_count: np.ndarray, win_sum: np.ndarray,
          win_count: np.ndarray, window_ids: np.ndarray | None = None) -> None:
    """Adds one batch.

    Args:
      pos_loss_sum: [L] summed loss per position.
      pos_count: [L] scored tokens per position.
      win_sum: [B, nb] summed loss per window and bucket.
      win_count: [B, nb] scored tokens per window and bucket.
      window_ids: [B] uint64 identity of each window's text and positions (``window_ids``),
        or None (then windows are numbered in arrival order).
    """
    s = np.asarray(win_sum, np.float64)
    c = np.asarray(win_count, np.float64)
    real = c.sum(1) > 0
    if window_ids is None:
      window_ids = np.arange(self.windows, self.windows + len(c), dtype=np.uint64)
    self._ids.append(np.asarray(window_ids, np.uint64)[real])
    self._sums.append(s[real])
    self._counts.append(c[real])
    self.loss_sum += np.asarray(pos_loss_sum, np.float64)
    self.count += np.asarray(pos_count, np.float64)
    present = (c > 0).astype(np.float64)
    self.s += s.sum(0)
    self.c += c.sum(0)
    self.ss += s.T @ s
    self.sc += s.T @ c
    self.cc += c.T @ c
    self.nn += present.T @ present
    self.windows += int((c.sum(1) > 0).sum())

  def bucket_stats(self) -> tuple[np.ndarray, np.ndarray]:
    """Per-bucket mean loss [nb] and covariance of the means [nb, nb] (nan where undefined)."""
    with np.errstate(invalid='ignore', divide='ignore'):
      loss = self.s / self.c
      lz = np.where(self.c > 0, loss, 0.0)
      resid = (self.ss - lz[None, :] * self.sc - lz[:, None] * self.sc.T
               + lz[:, None] * lz[None, :] * self.cc)
      factor = np.where(self.nn > 1, self.nn / (self.nn - 1), np.nan)
      cov = factor * resid / np.outer(self.c, self.c)
    return loss, cov

  def overall(self) -> dict[str, Any]:
    """Loss over all scored tokens with its window-clustered standard error."""
    tokens = self.c.sum()
    n = self.windows
    if tokens <= 0:
      return {'tokens': 0, 'windows': 0, 'loss': None, 'stderr': None, 'bits_per_token': None}
    loss = self.s.sum() / tokens
    resid = self.ss.sum() - 2 * loss * self.sc.sum() + loss**2 * self.cc.sum()
    var = n / (n - 1) * resid / tokens**2 if n > 1 else math.nan
    se = math.sqrt(max(var, 0.0)) if np.isfinite(var) else math.nan
    return {'tokens': int(round(tokens)), 'windows': n, 'loss': float(loss),
            'stderr': _num(se), 'bits_per_token': float(loss / math.log(2))}

  def buckets(self, reference: dict[str, np.ndarray] | None = None) -> list[dict[str, Any]]:
    """Per-bucket rows of results.json.

    Args:
      reference: optional {'bayes_loss': [>=L], 'filter_loss': [>=L]} per-position optimal losses
        (synthetic corpus); each bucket then gets the token-weighted mean of both, `excess_loss`
        and `recovered` = (filter - loss) / (filter - bayes).
    """
    loss, cov = self.bucket_stats()
    rows = []
    for i in range(len(self.edges) - 1):
      a, b = int(self.edges[i]), int(self.edges[i + 1])
      se = math.sqrt(cov[i, i]) if np.isfinite(cov[i, i]) and cov[i, i] >= 0 else math.nan
      row: dict[str, Any] = {
          'start': a, 'end': b, 'tokens': int(round(self.c[i])), 'windows': int(self.nn[i, i]),
          'loss': _num(loss[i]), 'stderr': _num(se),
          'ci95': [_num(loss[i] - Z95 * se), _num(loss[i] + Z95 * se)],
          'bits_per_token': _num(loss[i] / math.log(2)),
      }
      if reference is not None:
        w = self.count[a:b]
        if w.sum() > 0:
          bayes = float(np.dot(w, reference['bayes_loss'][a:b]) / w.sum())
          filt = float(np.dot(w, reference['filter_loss'][a:b]) / w.sum())
        else:
          bayes = filt = math.nan
        gap = filt - bayes
        row['bayes_loss'] = _num(bayes)
        row['filter_loss'] = _num(filt)
        row['excess_loss'] = _num(loss[i] - bayes)
        row['recovered'] = _num((filt - loss[i]) / gap) if abs(gap) > 1e-9 else None
      rows.append(row)
    return rows

  def degradation(self) -> dict[str, Any]:
    """Last bucket minus best bucket, and a weighted least-squares slope over the second half.

    The slope fits loss against bucket midpoints for buckets whose midpoint lies in the second
    half of the window, weighted by 1 / stderr^2 (equal weights if a stderr is undefined). Its
    standard error is sqrt(a^T C a) with a the WLS coefficients and C the full covariance of the
    bucket means (buckets share windows, so they are correlated).
    """
    loss, cov = self.bucket_stats()
    valid = np.where(self.c > 0)[0]
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
    mid = (self.edges[:-1] + self.edges[1:] - 1) / 2.0
    half = self.edges[-1] / 2.0
    sel = np.array([i for i in valid if mid[i] >= half], np.int64)
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

  def per_window(self) -> dict[str, np.ndarray]:
    """``window_id`` [W] (uint64), ``win_sum`` and ``win_count`` [W, nb], ``edges`` [nb + 1]:
    what ``paired_difference`` needs (the contents of ``windows.npz``)."""
    nb = len(self.edges) - 1
    cat = lambda xs, shape: np.concatenate(xs) if xs else np.zeros(shape)  # noqa: E731
    return {'window_id': cat(self._ids, (0,)).astype(np.uint64),
            'win_sum': cat(self._sums, (0, nb)), 'win_count': cat(self._counts, (0, nb)),
            'edges': self.edges.copy()}

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
  paired (window-clustered) standard error and a t interval.

  With per-window sums s, counts c and bucket means L = sum s / sum c, each window
  contributes ``r_w = (s_A - L_A c_A) / C_A - (s_B - L_B c_B) / C_B`` (C = sum of counts), and
  ``Var(L_A - L_B) = n / (n - 1) * sum_w r_w^2``: the delta-method variance of a difference of
  ratio estimators on shared clusters. When every window has equal counts in both runs this is
  the spread of the per-window differences of means over sqrt(n). A - A gives 0 +- 0.

  Args:
    a, b: ``BucketAccumulator.per_window()`` dicts (``windows.npz`` contents).
    names: labels used in error messages.

  Returns:
    One dict per bucket: ``start``, ``end``, ``windows``, ``loss_a``, ``loss_b``, ``diff``,
    ``stderr``, ``ci95`` (t quantile, n - 1 degrees of freedom), ``unpaired_stderr``
    (``sqrt(se_A^2 + se_B^2)``, what the pairing saves).

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
        'length, --window_start, --num_windows and eval seed.')
  order = np.argsort(ib)[np.searchsorted(np.sort(ib), ia)]
  sa, ca = np.asarray(a['win_sum'], np.float64), np.asarray(a['win_count'], np.float64)
  sb, cb = np.asarray(b['win_sum'], np.float64)[order], np.asarray(b['win_count'], np.float64)[order]
  rows = []
  for i in range(len(a['edges']) - 1):
    present = (ca[:, i] > 0) | (cb[:, i] > 0)
    n, ta, tb = int(present.sum()), ca[:, i].sum(), cb[:, i].sum()
    row = {'start': int(a['edges'][i]), 'end': int(a['edges'][i + 1]), 'windows': n}
    if n < 2 or ta <= 0 or tb <= 0:
      rows.append(dict(row, loss_a=None, loss_b=None, diff=None, stderr=None,
                       ci95=[None, None], unpaired_stderr=None))
      continue
    la, lb = sa[:, i].sum() / ta, sb[:, i].sum() / tb
    ra, rb = (sa[:, i] - la * ca[:, i]) / ta, (sb[:, i] - lb * cb[:, i]) / tb
    factor = n / (n - 1)
    se = math.sqrt(factor * np.sum((ra - rb) ** 2))
    unpaired = math.sqrt(factor * (np.sum(ra ** 2) + np.sum(rb ** 2)))
    q = float(scipy.stats.t.ppf(0.975, n - 1))
    rows.append(dict(row, loss_a=float(la), loss_b=float(lb), diff=float(la - lb),
                     stderr=se, ci95=[float(la - lb - q * se), float(la - lb + q * se)],
                     unpaired_stderr=unpaired))
  return rows
