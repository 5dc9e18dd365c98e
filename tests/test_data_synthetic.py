"""Synthetic corpus: generator consistency, exact Bayes loss vs Monte-Carlo,
default gap."""

import numpy as np
import pytest

from configs import tiny
from flax_posemb import config as config_lib
from flax_posemb import data
from flax_posemb.data import lengths
from flax_posemb.data import synthetic


def _data():
  """The tiny config's data section, typed."""
  return config_lib.RunConfig.from_config_dict(tiny.get_config()).data


def _corpus():
  return synthetic.from_config(_data())


def test_vectorized_and_scalar_generation_give_identical_documents():
  src = data.make_source(_data(), 'train')
  idx = np.arange(200)
  starts = np.random.default_rng(0).integers(0, 128, 200)
  many = src.docs_many(idx, starts, 128)
  for i, s, doc in zip(idx, starts, many):
    np.testing.assert_array_equal(
        doc, src.doc(int(i), start=int(s), max_pairs=128)
    )


def test_document_prefix_does_not_depend_on_truncation():
  src = data.make_source(_data(), 'train')
  full = src.doc(7, max_pairs=64, num_pairs=64)
  short = src.doc(7, max_pairs=10, num_pairs=64)
  np.testing.assert_array_equal(full[:11], short)


def test_bayes_loss_matches_monte_carlo_of_the_pipeline_generator():
  corp = _corpus()
  length, n = 40, 3000
  src = data.make_source(_data(), 'validation')
  # [n, length+1]
  docs = np.stack(
      src.docs_many(np.arange(n), np.zeros(n, int), length, num_pairs=length)
  )
  assert docs.shape == (n, length + 1)
  p = np.arange(length)
  regimes = corp.regime(p + 1)
  # [n, length]
  nll = -np.log(corp.matrices[regimes[None, :], docs[:, :-1], docs[:, 1:]])
  mc, se = nll.mean(0), nll.std(0) / np.sqrt(n)
  exact = corp.bayes_loss(length)
  assert np.all(np.abs(mc - exact) < 5 * se + 1e-3), np.max(
      np.abs(mc - exact) / se
  )


def test_filter_loss_is_reproducible_and_matches_an_independent_estimate():
  corp = _corpus()
  a, se = corp.filter_loss(32, num_docs=2000, seed=1)
  b, _ = corp.filter_loss(32, num_docs=2000, seed=2)
  assert np.all(np.abs(a - b) < 6 * se * np.sqrt(2) + 1e-3)
  np.testing.assert_array_equal(
      a, corp.filter_loss(32, num_docs=2000, seed=1)[0]
  )


def test_default_corpus_has_gap_of_at_least_point_two_nats_in_every_bucket():
  cfg = config_lib.RunConfig.from_config_dict(tiny.get_config())
  ref = data.reference_losses(cfg.data, cfg.data.seq_len)
  assert set(ref) == {'bayes_loss', 'filter_loss'}
  assert (
      ref['bayes_loss'].shape == (cfg.data.seq_len,)
      and ref['bayes_loss'].dtype == np.float64
  )
  gap = (
      (ref['filter_loss'] - ref['bayes_loss'])
      .reshape(-1, cfg.eval.bucket_size)
      .mean(1)
  )
  assert np.all(gap >= 0.2), gap


def test_every_eval_bucket_carries_every_regime_equally_often():
  cfg = config_lib.RunConfig.from_config_dict(tiny.get_config())
  corp = synthetic.from_config(cfg.data)
  assert corp.period <= cfg.eval.bucket_size
  r = corp.regime(np.arange(1, cfg.data.seq_len + 1)).reshape(
      -1, cfg.eval.bucket_size
  )
  counts = np.stack([(r == k).sum(1) for k in range(corp.num_regimes)], 1)
  assert np.all(counts == counts[0, 0])


def test_reference_losses_none_for_real_text():
  stdlib = data.DataConfig(source='stdlib')
  assert data.reference_losses(stdlib, 16) is None


def test_wikipedia_length_distribution_reproduces_token_shares():
  dist = lengths.parse('wikipedia', 128)
  rng = np.random.default_rng(0)
  m = dist.sample_many(rng.random(200_000), rng.random(200_000))
  assert m.min() >= 1 and m.max() <= 128
  edges = np.asarray(dist.edges)
  shares = np.array(
      [m[(m > lo) & (m <= hi)].sum() for lo, hi in zip(edges[:-1], edges[1:])]
  )
  np.testing.assert_allclose(
      shares / shares.sum(), np.array(lengths.WIKIPEDIA_SHARES) / 100, atol=0.01
  )
  assert [dist.sample(a, b) for a, b in [(0.1, 0.3), (0.99, 0.5)]] == list(
      dist.sample_many(np.array([0.1, 0.99]), np.array([0.3, 0.5]))
  )


@pytest.mark.parametrize('spec', ['bogus', '1,-1', '0,0'])
def test_bad_length_distribution_is_a_clear_error(spec):
  with pytest.raises(ValueError, match='ength|hares'):
    lengths.parse(spec, 128)


@pytest.mark.parametrize('seq_len', [1, 2, 16, 32])
def test_short_contexts_merge_empty_length_buckets(seq_len):
  dist = lengths.parse('wikipedia', seq_len)
  assert dist.edges[-1] == seq_len and all(np.diff(dist.edges) > 0)
  np.testing.assert_allclose(sum(dist.token_shares), 1.0)
  m = dist.sample_many(np.linspace(0, 0.999, 50), np.linspace(0, 0.999, 50))
  assert m.min() >= 1 and m.max() <= seq_len
