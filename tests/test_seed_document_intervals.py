"""Intervals that combine seeds and documents (seed_document_contrast)."""

import numpy as np
import pytest

from flax_posemb import buckets
from flax_posemb import inference


def _windows(values, docs):
  """One bucket, one scored token per window: ``[W]`` values and documents."""
  values = np.asarray(values, np.float64)
  return {
      'win_sum': values[:, None],
      'win_count': np.ones((len(values), 1)),
      'doc': np.asarray(docs),
      'edges': np.array([0, 1]),
  }


def _contrast(per_seed_values, docs):
  """The bucket's loss over seeds: per-seed window values ``[S, W]``."""
  documents = np.unique(docs)
  parts = [
      buckets.document_sums(_windows(v, docs), documents)
      for v in per_seed_values
  ]
  sums = np.stack([p[0] for p in parts])
  counts = np.stack([p[1] for p in parts])
  return inference.seed_document_contrast(sums, counts, np.ones(1))


def test_without_seed_spread_the_interval_is_the_document_clustered_one():
  rng = np.random.default_rng(0)
  values = rng.normal(2.0, 0.3, 40)
  docs = np.repeat(np.arange(10), 4)
  got = _contrast([values, values, values], docs)
  (row,) = buckets.bucket_rows(_windows(values, docs))
  assert got['mean'] == pytest.approx(row['loss'])
  assert got['stderr'] == pytest.approx(row['stderr'])
  assert got['seed_stderr'] == pytest.approx(0.0, abs=1e-12)
  assert got['df'] == pytest.approx(9)


def test_seed_spread_alone_gives_the_t_interval_over_seeds():
  base = np.full(12, 2.0)
  offsets = np.array([0.0, 0.1, -0.05, 0.2])
  got = _contrast([base + o for o in offsets], np.arange(12))
  assert got['stderr'] == pytest.approx(np.std(offsets, ddof=1) / 2)
  assert got['df'] == pytest.approx(3)
  assert got['document_stderr'] == pytest.approx(0.0)


def test_a_group_of_windows_from_fewer_documents_gets_a_wider_interval():
  rng = np.random.default_rng(1)
  # 24 windows: each document has its own level, seeds add a little noise.
  levels = np.repeat(rng.normal(2.0, 0.5, 6), 4)
  seeds = [levels + rng.normal(0, 0.02, 24) for _ in range(5)]
  as_windows = _contrast(seeds, np.arange(24))
  as_documents = _contrast(seeds, np.repeat(np.arange(6), 4))
  assert as_documents['high'] - as_documents['low'] > 1.5 * (
      as_windows['high'] - as_windows['low']
  )
  one_document = _contrast(seeds, np.zeros(24, np.int64))
  assert one_document['documents'] == 1
  assert np.isnan(one_document['low']) and np.isnan(one_document['high'])


def test_one_seed_gives_no_interval():
  got = _contrast([np.arange(10.0)], np.arange(10))
  assert np.isnan(got['low'])
  assert got['mean'] == pytest.approx(4.5)


def test_paired_contrast_cancels_what_the_arms_share():
  rng = np.random.default_rng(2)
  docs = np.repeat(np.arange(8), 3)
  shared = np.repeat(rng.normal(0, 1.0, 8), 3)
  documents = np.unique(docs)
  sums, counts = [], []
  for _ in range(4):
    arm_a = buckets.document_sums(_windows(shared + 0.1, docs), documents)
    arm_b = buckets.document_sums(_windows(shared, docs), documents)
    sums.append(np.stack([arm_a[0][:, 0], arm_b[0][:, 0]], -1))
    counts.append(np.stack([arm_a[1][:, 0], arm_b[1][:, 0]], -1))
  got = inference.seed_document_contrast(
      np.stack(sums), np.stack(counts), np.array([1.0, -1.0])
  )
  assert got['mean'] == pytest.approx(0.1)
  assert got['stderr'] == pytest.approx(0.0, abs=1e-12)


def test_intervals_cover_the_truth_under_crossed_seed_and_document_effects():
  rng = np.random.default_rng(3)
  num_seeds, num_docs, windows_per_doc = 5, 20, 3
  docs = np.repeat(np.arange(num_docs), windows_per_doc)
  covered = 0
  trials = 300
  for _ in range(trials):
    doc_effect = np.repeat(rng.normal(0, 0.3, num_docs), windows_per_doc)
    per_seed = [
        rng.normal(0, 0.2)
        + doc_effect
        + np.repeat(rng.normal(0, 0.1, num_docs), windows_per_doc)
        + rng.normal(0, 0.1, len(docs))
        for _ in range(num_seeds)
    ]
    got = _contrast(per_seed, docs)
    covered += got['low'] <= 0.0 <= got['high']
  # Conservative by construction: at least nominal coverage, within noise.
  assert covered / trials > 0.92
