"""Document-length distributions over ``[1, seq_len]`` pairs: ``'wikipedia'``
(token shares per bucket 1/32, 1/16, ..., 1 of the context: Pouransari et al.,
arXiv 2405.13226), ``'uniform'``, ``'full'`` or token shares ``'a,b,c,...'`` of
buckets with upper edges ``seq_len / 2**(n-1), ..., seq_len``; lengths are
uniform within a bucket."""

from collections.abc import Sequence
import dataclasses

import numpy as np

WIKIPEDIA_SHARES = (15.3, 21.5, 23.0, 19.1, 13.1, 8.0)


@dataclasses.dataclass(frozen=True)
class LengthDist:
  """Bucket ``b`` is ``(edges[b], edges[b+1]]`` (document probability
  ``doc_probs[b]``)."""

  edges: tuple[int, ...]
  doc_probs: tuple[float, ...]
  token_shares: tuple[float, ...]

  def sample(self, u_bucket: float, u_len: float) -> int:
    """Maps two uniforms in [0, 1) to a length in ``[1, edges[-1]]``."""
    return int(self.sample_many(np.array([u_bucket]), np.array([u_len]))[0])

  def sample_many(self, u_bucket: np.ndarray, u_len: np.ndarray) -> np.ndarray:
    """Uniforms ``[n]``, ``[n]`` -> lengths ``[n]`` int64."""
    cum = np.cumsum(np.asarray(self.doc_probs, np.float64))
    bucket = np.searchsorted(cum, u_bucket, side='right')
    bucket = np.minimum(bucket, len(cum) - 1)
    edges = np.asarray(self.edges, np.int64)
    lo = edges[bucket]
    width = edges[bucket + 1] - lo
    return lo + 1 + np.minimum((u_len * width).astype(np.int64), width - 1)


def parse(spec: str, seq_len: int) -> LengthDist:
  """The `LengthDist` of `spec` (see the module docstring) for rows of `seq_len`
  pairs."""
  spec = str(spec).strip()
  if spec == 'full':
    return LengthDist((seq_len - 1, seq_len), (1.0,), (1.0,))
  if spec == 'wikipedia':
    shares: Sequence[float] = WIKIPEDIA_SHARES
  elif spec == 'uniform':
    # One bucket, (0, seq_len].
    shares = [1.0]
  else:
    try:
      shares = [float(x) for x in spec.split(',')]
    except ValueError:
      shares = [-1.0]
  if any(share < 0 for share in shares) or sum(shares) <= 0:
    raise ValueError(
        f'Unknown length distribution {spec!r}: use wikipedia | uniform | full'
        ' | comma-separated token shares per bucket (>= 0, not all zero), e.g.'
        ' "15,22,23,19,13,8".'
    )
  n = len(shares)
  raw = np.array(
      [0] + [max(1, int(round(seq_len / 2 ** (n - 1 - i)))) for i in range(n)]
  )
  # Short contexts: empty buckets merge into the next.
  kept = np.flatnonzero(raw[1:] > raw[:-1])
  into = np.minimum(np.searchsorted(kept, np.arange(n)), len(kept) - 1)
  merged = np.bincount(
      into, weights=np.asarray(shares, np.float64), minlength=len(kept)
  )
  edges = np.concatenate([[0], raw[1:][kept]])
  shares_arr = merged / sum(merged)
  probs = shares_arr / ((edges[:-1] + 1 + edges[1:]) / 2)
  probs /= probs.sum()
  return LengthDist(
      tuple(int(e) for e in edges),
      tuple(float(p) for p in probs),
      tuple(float(s) for s in shares_arr),
  )


@dataclasses.dataclass(frozen=True)
class PieceLengths:
  """A distribution of crop lengths in pairs over ``[1, T]`` (the `crops`
  policy: docs/DESIGN.md § Data policies and tokens).

  Attributes:
    probs: ``[T]`` float64, ``probs[l - 1]`` = P(a crop has ``l`` pairs).
  """

  probs: np.ndarray

  @property
  def seq_len(self) -> int:
    return len(self.probs)

  def survival(self) -> np.ndarray:
    """``[T]``: P(a crop reaches position ``p``), ``p = 0 .. T - 1``.

    Every crop is used whole, so position ``p`` is seen this often per crop:
    the expected exposure profile of the policy.
    """
    tail = np.cumsum(self.probs[::-1])[::-1]
    return np.minimum(tail, 1.0)

  def mean(self) -> float:
    """Expected pairs per crop."""
    return float(self.survival().sum())

  def sample(self, rng: np.random.Generator, count: int) -> np.ndarray:
    """``[count]`` int64 crop lengths drawn with ``rng``."""
    cdf = np.cumsum(self.probs)
    cdf /= cdf[-1]
    draws = np.searchsorted(cdf, rng.random(count), side='right')
    return np.minimum(draws, self.seq_len - 1).astype(np.int64) + 1


def skewed_pieces(ratio: float, seq_len: int) -> PieceLengths:
  """Geometric crop lengths whose exposure falls smoothly from row 0 to row
  ``T - 1``, where it is ``ratio`` times row 0's: ``S(p) = ratio ** (p / (T -
  1))``; ``ratio = 1`` is one full row per crop (the `packed` rows)."""
  t = int(seq_len)
  if not 0 < ratio <= 1:
    raise ValueError(f'skew ratio must be in (0, 1], got {ratio}.')
  if t == 1:
    return PieceLengths(np.ones(1))
  survival = float(ratio) ** (np.arange(t + 1) / (t - 1))
  survival[t] = 0.0
  return PieceLengths(survival[:-1] - survival[1:])


def empirical_pieces(pairs: np.ndarray, seq_len: int) -> PieceLengths:
  """Crop lengths distributed as ``min(pairs, T)`` of documents ``[n]``
  (document-uniform: the rows of `natural`)."""
  t = int(seq_len)
  lengths = np.minimum(np.asarray(pairs, np.int64), t)
  lengths = lengths[lengths >= 1]
  if not len(lengths):
    raise ValueError('no document has an (input, target) pair.')
  counts = np.bincount(lengths - 1, minlength=t).astype(np.float64)
  return PieceLengths(counts / counts.sum())


def dist_pieces(dist: LengthDist, min_pairs: int = 1) -> PieceLengths:
  """The crop lengths of a `LengthDist` (uniform within each bucket), raised
  to at least ``min_pairs``."""
  t = dist.edges[-1]
  probs = np.zeros(t)
  for b, p in enumerate(dist.doc_probs):
    lo = dist.edges[b]
    hi = dist.edges[b + 1]
    probs[lo:hi] += p / (hi - lo)
  floor = min(max(int(min_pairs), 1), t)
  probs[floor - 1] += probs[: floor - 1].sum()
  probs[: floor - 1] = 0.0
  return PieceLengths(probs / probs.sum())
