"""Procedural corpus with a known optimal loss per position: token ``x_p`` is
drawn from row ``x_{p-1}`` of ``M[(p // S) % K]`` (docs/DESIGN.md § Synthetic
corpus)."""

import bisect
import functools

import numpy as np
import numpy.typing as npt

SPLIT_IDS = {'train': 0, 'validation': 1, 'test': 2}
# SplitMix64's increment (2**64 / the golden ratio).
_GOLDEN = 0x9E3779B97F4A7C15


class SyntheticCorpus:
  """The K transition matrices over V tokens (S positions per regime, Dirichlet
  `concentration`, corpus `seed`) and the document generator."""

  def __init__(
      self,
      vocab_size: int,
      num_regimes: int,
      segment_len: int,
      concentration: float,
      seed: int,
  ):
    self.vocab_size = int(vocab_size)
    self.num_regimes = int(num_regimes)
    self.segment_len = int(segment_len)
    self.seed = int(seed)
    rng = np.random.default_rng([self.seed, 0x5EED])
    draws = rng.dirichlet(
        np.full(vocab_size, concentration), size=(num_regimes, vocab_size)
    )
    draws = np.nan_to_num(draws, nan=0.0)
    # [K, V, V] float64, rows sum to 1.
    self.matrices = draws / draws.sum(-1, keepdims=True)
    self.cdf = np.cumsum(self.matrices, axis=-1)  # [K, V, V]
    self.cdf[..., -1] = 1.0
    self._cdf_lists = [
        [row.tolist() for row in self.cdf[k]] for k in range(num_regimes)
    ]

  @property
  def period(self) -> int:
    """K * S: positions after which the regime sequence repeats."""
    return self.num_regimes * self.segment_len

  def regime(self, positions: npt.ArrayLike) -> np.ndarray:
    """Regime index of each position id (any shape, same shape out)."""
    return (np.asarray(positions) // self.segment_len) % self.num_regimes

  def doc_uniforms_many(
      self, split: str, indices: np.ndarray, count: int
  ) -> np.ndarray:
    """The first `count` uniforms of documents ``[n]`` -> ``[n, count]`` float64
    (SplitMix64 counter stream; 0 and 1 pick the length, 2.. the tokens)."""
    stream = self.seed * 0x100000001B3 + SPLIT_IDS[split]
    base = (stream * _GOLDEN + 1) % 2**64
    with np.errstate(over='ignore'):
      doc_ids = np.asarray(indices, np.uint64).ravel()
      keys = _mix64_np(doc_ids + np.uint64(base))
      counters = np.arange(1, count + 1, dtype=np.uint64) * np.uint64(_GOLDEN)
      bits = _mix64_np(counters[None, :] + keys[:, None])
    # The top 53 bits as a float64 in [0, 1).
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

  def generate_many(
      self, uniforms: np.ndarray, starts: np.ndarray, num_tokens: np.ndarray
  ) -> list[np.ndarray]:
    """Vectorized `generate`: uniforms ``[n, L]``, start ids ``[n]``, lengths
    ``[n]`` (<= L) -> n int32 arrays ``[num_tokens[j]]`` (identical tokens)."""
    num_tokens = np.asarray(num_tokens, np.int64)
    # Longest first: active docs = prefix.
    order = np.argsort(-num_tokens, kind='stable')
    lens = num_tokens[order]
    length = max(int(lens.max(initial=0)), 1)
    u = uniforms[order, :length]
    v = self.vocab_size
    steps = np.arange(length)
    positions = np.asarray(starts, np.int64)[order][:, None] + steps
    # Row index into the flattened [K*V, V] CDF is regime * V + previous token.
    regime_base = self.regime(positions) * v
    # [length] docs still generating.
    active = (lens[None, :] > steps[:, None]).sum(1)
    cdf = self.cdf.reshape(self.num_regimes * v, v)
    x = np.zeros((len(starts), length), np.int64)
    x[:, 0] = np.minimum((u[:, 0] * v).astype(np.int64), v - 1)
    for j in range(1, length):
      a = active[j]
      rows = cdf[regime_base[:a, j] + x[:a, j - 1]]
      # cdf[..., -1] == 1 > u, so the count is <= V - 1 (same rule as
      # `generate`).
      x[:a, j] = (rows <= u[:a, j, None]).sum(-1)
    # Input order.
    return [x[i, : lens[i]].astype(np.int32) for i in np.argsort(order)]

  def generate(self, uniforms: np.ndarray, start: int) -> np.ndarray:
    """One document ``[n]`` int32 at position ids ``start, ...`` from uniforms
    ``[n]``."""
    u = uniforms.tolist()
    if not u:
      return np.asarray([], np.int32)
    v = self.vocab_size
    out = [min(int(u[0] * v), v - 1)]
    for j in range(1, len(u)):
      regime = ((start + j) // self.segment_len) % self.num_regimes
      row = self._cdf_lists[regime][out[-1]]
      out.append(bisect.bisect_right(row, u[j]))  # <= V-1: row[-1] == 1 > u.
    return np.asarray(out, np.int32)

  def bayes_loss(self, length: int) -> np.ndarray:
    """Exact expected loss with the position known, ``[length]`` float64 (see
    module doc)."""
    with np.errstate(divide='ignore', invalid='ignore'):
      ent = -np.where(
          self.matrices > 0, self.matrices * np.log(self.matrices), 0.0
      ).sum(-1)
    pi = np.full(self.vocab_size, 1.0 / self.vocab_size)
    out = np.empty(length, np.float64)
    for p in range(length):
      r = self.regime(p + 1)
      out[p] = pi @ ent[r]
      pi = pi @ self.matrices[r]
    return out

  def filter_loss(
      self, length: int, num_docs: int = 4096, seed: int = 0
  ) -> tuple[np.ndarray, np.ndarray]:
    """Monte-Carlo loss of the position-blind regime filter over `length`
    positions: (mean ``[length]``, standard error ``[length]``) float64."""
    rng = np.random.default_rng([self.seed, 0xF1, seed])
    # Documents from position id 0.
    x = np.empty((num_docs, length + 1), np.int32)
    x[:, 0] = rng.integers(0, self.vocab_size, num_docs)
    for j in range(1, length + 1):
      c = self.cdf[self.regime(j), x[:, j - 1]]  # [N, V]
      x[:, j] = np.minimum(
          (c <= rng.random(num_docs)[:, None]).sum(-1), self.vocab_size - 1
      )
    k = self.num_regimes
    stay = 1.0 - 1.0 / self.segment_len
    # [K, K]: stay, or move on to the next regime.
    if k == 1:
      trans = np.ones((1, 1))
    else:
      trans = np.eye(k) * stay + np.roll(np.eye(k), 1, axis=1) * (1.0 - stay)
    belief = np.full((num_docs, k), 1.0 / k)
    losses = np.empty((num_docs, length))
    for p in range(length):
      # prior * lik [N, K]
      post = (belief @ trans) * self.matrices[:, x[:, p], x[:, p + 1]].T
      losses[:, p] = -np.log(np.maximum(post.sum(-1), 1e-300))
      belief = post / np.maximum(post.sum(-1, keepdims=True), 1e-300)
    return losses.mean(0), losses.std(0) / np.sqrt(num_docs)


def _mix64_np(z: np.ndarray) -> np.ndarray:
  """SplitMix64 finalizer of a uint64 array (wrapping arithmetic)."""
  z = z ^ (z >> np.uint64(30))
  z *= np.uint64(0xBF58476D1CE4E5B9)
  z ^= z >> np.uint64(27)
  z *= np.uint64(0x94D049BB133111EB)
  z ^= z >> np.uint64(31)
  return z


# One corpus per parameter set.
_corpus = functools.lru_cache(maxsize=16)(SyntheticCorpus)


def from_config(data_config) -> SyntheticCorpus:
  """The corpus named by ``data_config.synthetic``."""
  s = data_config.synthetic
  return _corpus(
      int(s.vocab_size),
      int(s.num_regimes),
      int(s.segment_len),
      float(s.concentration),
      int(s.seed),
  )


@functools.lru_cache(maxsize=16)
def _reference(
    corp: SyntheticCorpus, length: int
) -> tuple[np.ndarray, np.ndarray]:
  return corp.bayes_loss(length), corp.filter_loss(length)[0]


def reference_losses(
    corp: SyntheticCorpus, length: int
) -> dict[str, np.ndarray]:
  """{'bayes_loss': [length], 'filter_loss': [length]} float64 for a doc
  starting at 0."""
  bayes, filt = _reference(corp, int(length))
  return {'bayes_loss': bayes.copy(), 'filter_loss': filt.copy()}
