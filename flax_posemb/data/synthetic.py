"""Procedural position-dependent corpus with a known optimal loss per position.

Token ``x_p`` at absolute position id ``p >= 1`` is drawn from row ``x_{p-1}`` of transition
matrix ``M[regime(p)]`` with ``regime(p) = floor(p / S) mod K``; the first token of a document
is uniform. Rows of ``M`` are Dirichlet(concentration) draws from ``corpus seed``. The same
dynamics recur every ``K * S`` positions, so late positions are not harder than early ones:
only knowing the position (a good position-table row) tells a model which matrix applies.

A document is generated *for the position ids it occupies* (``start`` argument), so
`random_offset` and continuing `packed` rows stay consistent with their position ids. When
``K * S`` divides the context ``T``, the regime of position ``p`` equals that of ``p mod T``,
so a packed document that wraps into the next row (position ids restart at 0) keeps its
dynamics.

Reference losses (entry ``p`` is the expected loss of the target at input position ``p``,
i.e. of the token at position id ``p + 1`` given tokens at ids ``<= p``, for a document
starting at position 0):

* ``bayes_loss``: exact, position known: ``sum_a pi_p(a) H(M[regime(p+1)][a])`` where
  ``pi_p`` is the exact marginal of ``x_p``.
* ``filter_loss``: a content-only predictor that knows the K matrices but not the position:
  it filters the regime as a hidden sticky chain (stay with prob ``1 - 1/S``, else move to the
  next regime in the cycle), starting from a uniform regime. Monte-Carlo over documents drawn
  from the true process (fixed seed, so deterministic). A predictor that counts tokens from
  the document start could beat it, so it is the loss of position-blind *content* inference,
  not a lower bound for every model without position embeddings.

The gap ``filter_loss - bayes_loss`` is what a good position row is worth.
"""

from __future__ import annotations

import bisect
import functools

import numpy as np

SPLIT_IDS = {'train': 0, 'validation': 1, 'test': 2}


class SyntheticCorpus:
  """The transition matrices and the document generator.

  Args:
    vocab_size: V, tokens are ``0..V-1``.
    num_regimes: K transition matrices.
    segment_len: S positions per regime.
    concentration: Dirichlet concentration of every transition row.
    seed: corpus seed (matrices and document contents).
  """

  def __init__(self, vocab_size: int, num_regimes: int, segment_len: int,
               concentration: float, seed: int):
    if vocab_size < 2 or num_regimes < 1 or segment_len < 1 or concentration <= 0:
      raise ValueError(
          'Synthetic corpus needs vocab_size >= 2, num_regimes >= 1, segment_len >= 1 and '
          f'concentration > 0; got V={vocab_size}, K={num_regimes}, S={segment_len}, '
          f'concentration={concentration}.')
    self.vocab_size = int(vocab_size)
    self.num_regimes = int(num_regimes)
    self.segment_len = int(segment_len)
    self.concentration = float(concentration)
    self.seed = int(seed)
    rng = np.random.default_rng([self.seed, 0x5EED])
    m = rng.dirichlet(np.full(vocab_size, concentration), size=(num_regimes, vocab_size))
    m = np.nan_to_num(m, nan=0.0)
    m /= m.sum(-1, keepdims=True)
    self.matrices = m  # [K, V, V] float64, rows sum to 1.
    cdf = np.cumsum(m, axis=-1)
    cdf[..., -1] = 1.0
    self.cdf = cdf  # [K, V, V]
    self._cdf_lists = [[row.tolist() for row in cdf[k]] for k in range(num_regimes)]

  @property
  def period(self) -> int:
    """K * S: positions after which the regime sequence repeats."""
    return self.num_regimes * self.segment_len

  def regime(self, positions: np.ndarray) -> np.ndarray:
    """Regime index of each position id (any shape, same shape out)."""
    return (np.asarray(positions) // self.segment_len) % self.num_regimes

  def doc_uniforms(self, split: str, index: int, count: int) -> np.ndarray:
    """The first `count` uniforms of document `index` of `split`, ``[count]`` float64.

    A counter-based stream (SplitMix64 of a per-document key), so any prefix is cheap and
    independent of the policy: uniforms 0 and 1 pick the length, 2.. the tokens.
    """
    return self.doc_uniforms_many(split, np.asarray([index]), count)[0]

  def doc_uniforms_many(self, split: str, indices: np.ndarray, count: int) -> np.ndarray:
    """`doc_uniforms` for many documents: indices ``[n]`` -> ``[n, count]`` float64."""
    base = ((self.seed * 0x100000001B3 + SPLIT_IDS[split]) * 0x9E3779B97F4A7C15 + 1) & _M64
    with np.errstate(over='ignore'):
      keys = _mix64_np(np.asarray(indices, np.uint64).ravel() + np.uint64(base))
      z = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
      z = _mix64_np(z[None, :] + keys[:, None])
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

  def generate_many(self, uniforms: np.ndarray, starts: np.ndarray,
                    num_tokens: np.ndarray) -> list[np.ndarray]:
    """Vectorized `generate` of many documents (identical tokens).

    Args:
      uniforms: ``[n, L]`` floats in [0, 1), row j's first ``num_tokens[j]`` are used.
      starts: ``[n]`` start position ids.
      num_tokens: ``[n]`` document lengths in tokens (<= L).

    Returns:
      List of n int32 arrays, array j ``[num_tokens[j]]``.
    """
    n = len(starts)
    num_tokens = np.asarray(num_tokens, np.int64)
    order = np.argsort(-num_tokens, kind='stable')  # Longest first: active docs = prefix.
    lens = num_tokens[order]
    length = max(int(lens.max(initial=0)), 1)
    u = uniforms[order, :length]
    v, s, k = self.vocab_size, self.segment_len, self.num_regimes
    steps = np.arange(length)
    # Row index into the flattened [K*V, V] CDF is regime * V + previous token.
    regime_base = (((np.asarray(starts, np.int64)[order][:, None] + steps) // s) % k) * v
    active = (lens[None, :] > steps[:, None]).sum(1)  # [length] docs still generating.
    cdf = self.cdf.reshape(k * v, v)
    x = np.zeros((n, length), np.int64)
    x[:, 0] = np.minimum((u[:, 0] * v).astype(np.int64), v - 1)
    for j in range(1, length):
      a = active[j]
      # cdf[..., -1] == 1 > u, so the count is <= V - 1 (same rule as `generate`).
      x[:a, j] = (cdf[regime_base[:a, j] + x[:a, j - 1]] <= u[:a, j, None]).sum(-1)
    out = [None] * n
    for i, o in enumerate(order):
      out[o] = x[i, :lens[i]].astype(np.int32)
    return out

  def generate(self, uniforms: np.ndarray, start: int) -> np.ndarray:
    """Generates one document occupying position ids ``start, start+1, ...``.

    Args:
      uniforms: ``[n]`` floats in [0, 1); one per token.
      start: position id of the first token.

    Returns:
      ``[n]`` int32 tokens.
    """
    u = uniforms.tolist()
    n = len(u)
    if n == 0:
      return np.zeros((0,), np.int32)
    v, s, k = self.vocab_size, self.segment_len, self.num_regimes
    cdfs = self._cdf_lists
    x = min(int(u[0] * v), v - 1)
    out = [x]
    append = out.append
    br = bisect.bisect_right
    for j in range(1, n):
      x = br(cdfs[((start + j) // s) % k][x], u[j])  # <= V-1: cdf[-1] == 1 > u.
      append(x)
    return np.asarray(out, np.int32)

  def sample_batch(self, rng: np.random.Generator, num_docs: int, length: int,
                   start: int = 0) -> np.ndarray:
    """Vectorized sampling of `num_docs` documents of `length` tokens from `start`.

    Returns:
      ``[num_docs, length]`` int32 tokens.
    """
    x = np.empty((num_docs, length), np.int32)
    x[:, 0] = rng.integers(0, self.vocab_size, num_docs)
    for j in range(1, length):
      r = ((start + j) // self.segment_len) % self.num_regimes
      c = self.cdf[r, x[:, j - 1]]  # [N, V]
      u = rng.random(num_docs)[:, None]
      x[:, j] = np.minimum((c <= u).sum(-1), self.vocab_size - 1)
    return x

  def bayes_loss(self, length: int) -> np.ndarray:
    """Exact expected loss with the position known, ``[length]`` float64 (see module doc)."""
    k, s = self.num_regimes, self.segment_len
    with np.errstate(divide='ignore', invalid='ignore'):
      ent = -np.where(self.matrices > 0, self.matrices * np.log(self.matrices), 0.0).sum(-1)
    pi = np.full(self.vocab_size, 1.0 / self.vocab_size)
    out = np.empty(length, np.float64)
    for p in range(length):
      r = ((p + 1) // s) % k
      out[p] = pi @ ent[r]
      pi = pi @ self.matrices[r]
    return out

  def filter_loss(self, length: int, num_docs: int = 4096,
                  seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Monte-Carlo loss of the position-blind regime filter (see module doc).

    Args:
      length: number of input positions.
      num_docs: Monte-Carlo documents.
      seed: Monte-Carlo seed.

    Returns:
      (mean ``[length]``, standard error ``[length]``), float64.
    """
    rng = np.random.default_rng([self.seed, 0xF1, seed])
    x = self.sample_batch(rng, num_docs, length + 1, start=0)
    k, s = self.num_regimes, self.segment_len
    stay = 1.0 - 1.0 / s
    trans = np.eye(k) * stay + np.roll(np.eye(k), 1, axis=1) * (1.0 - stay)  # [K, K]
    if k == 1:
      trans = np.ones((1, 1))
    belief = np.full((num_docs, k), 1.0 / k)
    losses = np.empty((num_docs, length))
    for p in range(length):
      prior = belief @ trans  # [N, K]
      lik = self.matrices[:, x[:, p], x[:, p + 1]].T  # [N, K]
      q = (prior * lik).sum(-1)
      losses[:, p] = -np.log(np.maximum(q, 1e-300))
      post = prior * lik
      belief = post / np.maximum(post.sum(-1, keepdims=True), 1e-300)
    return losses.mean(0), losses.std(0) / np.sqrt(num_docs)


_M64 = (1 << 64) - 1


def _mix64(x: int) -> int:
  """SplitMix64 finalizer of a Python int (mod 2**64)."""
  x &= _M64
  x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
  x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
  return x ^ (x >> 31)


def _mix64_np(z: np.ndarray) -> np.ndarray:
  """SplitMix64 finalizer of a uint64 array (wrapping arithmetic)."""
  z = z ^ (z >> np.uint64(30))
  z *= np.uint64(0xBF58476D1CE4E5B9)
  z ^= z >> np.uint64(27)
  z *= np.uint64(0x94D049BB133111EB)
  z ^= z >> np.uint64(31)
  return z


@functools.lru_cache(maxsize=16)
def corpus(vocab_size: int, num_regimes: int, segment_len: int, concentration: float,
           seed: int) -> SyntheticCorpus:
  """Cached `SyntheticCorpus` for these parameters."""
  return SyntheticCorpus(vocab_size, num_regimes, segment_len, concentration, seed)


def from_config(data_config) -> SyntheticCorpus:
  """The corpus named by ``data_config.synthetic``."""
  s = data_config.synthetic
  return corpus(int(s.vocab_size), int(s.num_regimes), int(s.segment_len),
                float(s.concentration), int(s.seed))


@functools.lru_cache(maxsize=16)
def _reference(corp: SyntheticCorpus, length: int) -> tuple[np.ndarray, np.ndarray]:
  return corp.bayes_loss(length), corp.filter_loss(length)[0]


def reference_losses(corp: SyntheticCorpus, length: int) -> dict[str, np.ndarray]:
  """{'bayes_loss': [length], 'filter_loss': [length]} float64 for a doc starting at 0."""
  bayes, filt = _reference(corp, int(length))
  return {'bayes_loss': bayes.copy(), 'filter_loss': filt.copy()}
