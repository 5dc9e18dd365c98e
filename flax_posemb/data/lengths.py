"""Document-length distributions over `[1, seq_len]` (lengths count input/target pairs).

A length distribution is named by a spec string:

* ``'wikipedia'``: token shares per length bucket 1/32, 1/16, 1/8, 1/4, 1/2, 1 of the
  context of 15.3/21.5/23.0/19.1/13.1/8.0 % (Pouransari et al., "Dataset Decomposition",
  NeurIPS 2024, arXiv 2405.13226, Wikipedia chunks of 256..8192 tokens), so short documents
  dominate;
* ``'uniform'``: lengths uniform on ``[1, seq_len]``;
* ``'full'``: every document is ``seq_len`` long;
* ``'a,b,c,...'``: token shares for ``n`` buckets whose upper edges are
  ``seq_len / 2**(n-1), ..., seq_len / 2, seq_len`` (shares are normalized; in a context
  too short for ``n`` distinct buckets, empty buckets merge into the next one).

Within a bucket ``(lo, hi]`` lengths are uniform integers. Token shares are turned into
document probabilities by dividing by the bucket's mean length.
"""

from __future__ import annotations

import dataclasses

import numpy as np

WIKIPEDIA_SHARES = (15.3, 21.5, 23.0, 19.1, 13.1, 8.0)


@dataclasses.dataclass(frozen=True)
class LengthDist:
  """Piecewise-uniform distribution of document lengths (pairs) on ``[1, seq_len]``.

  Attributes:
    edges: ``[n + 1]`` increasing ints, bucket ``b`` is ``(edges[b], edges[b+1]]``.
    doc_probs: ``[n]`` probability that a document falls in bucket ``b``.
    token_shares: ``[n]`` expected share of tokens in bucket ``b``.
  """
  edges: tuple[int, ...]
  doc_probs: tuple[float, ...]
  token_shares: tuple[float, ...]

  def sample(self, u_bucket: float, u_len: float) -> int:
    """Maps two uniforms in [0, 1) to a length (a scalar int in ``[1, edges[-1]]``)."""
    cum = 0.0
    b = len(self.doc_probs) - 1
    for i, p in enumerate(self.doc_probs):
      cum += p
      if u_bucket < cum:
        b = i
        break
    lo, hi = self.edges[b], self.edges[b + 1]
    return lo + 1 + min(int(u_len * (hi - lo)), hi - lo - 1)

  def sample_many(self, u_bucket: np.ndarray, u_len: np.ndarray) -> np.ndarray:
    """Vectorized `sample`: uniforms ``[n]``, ``[n]`` -> lengths ``[n]`` int64 (identical)."""
    cum = np.cumsum(np.asarray(self.doc_probs, np.float64))
    b = np.minimum(np.searchsorted(cum, u_bucket, side='right'), len(cum) - 1)
    e = np.asarray(self.edges, np.int64)
    lo, width = e[b], e[b + 1] - e[b]
    return lo + 1 + np.minimum((u_len * width).astype(np.int64), width - 1)

  def mean(self) -> float:
    """Expected length (pairs) of one document."""
    e = self.edges
    return float(sum(p * (e[b] + 1 + e[b + 1]) / 2 for b, p in enumerate(self.doc_probs)))


def parse(spec: str, seq_len: int) -> LengthDist:
  """Parses a length-distribution spec (see module docstring) for rows of `seq_len` pairs.

  Args:
    spec: 'wikipedia' | 'uniform' | 'full' | comma-separated token shares.
    seq_len: largest length (the context).

  Returns:
    The `LengthDist`.

  Raises:
    ValueError: unknown spec or bad shares.
  """
  spec = str(spec).strip()
  if seq_len < 1:
    raise ValueError(f'seq_len must be >= 1, got {seq_len}.')
  if spec == 'uniform':
    return LengthDist((0, seq_len), (1.0,), (1.0,))
  if spec == 'full':
    return LengthDist((seq_len - 1, seq_len), (1.0,), (1.0,))
  if spec == 'wikipedia':
    shares = list(WIKIPEDIA_SHARES)
  else:
    try:
      shares = [float(s) for s in spec.split(',')]
    except ValueError:
      raise ValueError(
          f'Unknown length distribution {spec!r}: use wikipedia | uniform | full | '
          'comma-separated token shares per bucket, e.g. "15,22,23,19,13,8".') from None
    if any(s < 0 for s in shares) or sum(shares) <= 0:
      raise ValueError(f'Length shares must be >= 0 and not all zero, got {spec!r}.')
  n = len(shares)
  raw = [0] + [max(1, int(round(seq_len / 2**(n - 1 - i)))) for i in range(n)]
  edges, merged, pending = [0], [], 0.0
  for b in range(n):  # Short contexts: empty buckets merge into the next one.
    pending += shares[b]
    if raw[b + 1] > edges[-1]:
      edges.append(raw[b + 1])
      merged.append(pending)
      pending = 0.0
  merged[-1] += pending
  shares = merged
  n = len(shares)
  shares_arr = np.asarray(shares, np.float64) / sum(shares)
  means = np.array([(edges[b] + 1 + edges[b + 1]) / 2 for b in range(n)])
  probs = shares_arr / means
  probs /= probs.sum()
  return LengthDist(tuple(edges), tuple(float(p) for p in probs),
                    tuple(float(s) for s in shares_arr))
