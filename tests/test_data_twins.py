"""Random-offset twins (data.offset_twin): any policy's rows, tokens and
contexts kept, each segment moved to a uniform start (docs/DESIGN.md § Data
policies and tokens)."""

import dataclasses

import numpy as np
import pytest
import text_corpus as text_corpus_lib

from flax_posemb import data
from flax_posemb import segments
from flax_posemb.data import report
from flax_posemb.data import rows as rows_lib
from flax_posemb.data import synthetic
from flax_posemb.data.policies import exposure as exposure_lib
from flax_posemb.data.policies import twin

# Divisible by 10: equal deciles of positions (a twin's profile is a symmetric
# tent for short segments; unequal tenths would tilt it).
T = 80
B = 8
ARMS = [
    {'position_policy': 'crops', 'crop_lengths': 'skew:0.01'},
    {'position_policy': 'crops', 'crop_lengths': 'natural'},
    {'position_policy': 'packed_reset'},
    {'position_policy': 'natural'},
    {'position_policy': 'random_offset'},
]


@pytest.fixture(scope='module')
def text_corpus(tmp_path_factory):
  return text_corpus_lib.geometric_corpus(tmp_path_factory.mktemp('twins'), T)


def _iterator(config, seed=0, max_len=T):
  return data.make_train_iterator(
      config,
      batch_size=B,
      seed=seed,
      num_train_steps=10,
      max_len=max_len,
      with_doc_ids=True,
      with_doc_offsets=True,
  )


def _take(it, n):
  return [next(it) for _ in range(n)]


@pytest.mark.parametrize('arm', ARMS, ids=lambda a: '-'.join(a.values()))
def test_a_twin_keeps_tokens_segments_and_contexts_and_moves_only_positions(
    arm, text_corpus
):
  config = data.DataConfig(**arm, **text_corpus)
  twin_config = dataclasses.replace(config, offset_twin=True)
  max_len = 2 * T
  arm_batches = _take(_iterator(config, max_len=max_len), 6)
  twin_batches = _take(_iterator(twin_config, max_len=max_len), 6)
  moved = 0
  for want, got in zip(arm_batches, twin_batches):
    for key in set(want) - {'positions'}:
      np.testing.assert_array_equal(want[key], got[key])
    contexts = np.asarray(segments.context_lengths(want['segment_ids']))
    twin_contexts = np.asarray(segments.context_lengths(got['segment_ids']))
    np.testing.assert_array_equal(contexts, twin_contexts)
    real = got['segment_ids'] > 0
    # Each segment keeps its consecutive positions: position - context is the
    # segment's start, the same for all its tokens.
    start = got['positions'] - twin_contexts
    for row_start, row_ids, row_real in zip(start, got['segment_ids'], real):
      for segment in np.unique(row_ids[row_real]):
        assert len(np.unique(row_start[row_ids == segment])) == 1
    assert got['positions'][real].min() >= 0
    assert got['positions'][real].max() < max_len
    moved += int((got['positions'] != want['positions'])[real].sum())
  assert moved > 0


def _deciles(config, num_batches, max_len=T):
  counts = np.zeros(max_len)
  for batch in _take(_iterator(config, max_len=max_len), num_batches):
    real = batch['segment_ids'] > 0
    np.add.at(counts, batch['positions'][real], 1)
  return exposure_lib.deciles(counts)[1]


@pytest.mark.parametrize('arm', ARMS[:3], ids=lambda a: '-'.join(a.values()))
def test_a_twins_late_rows_are_not_rare(arm, text_corpus):
  config = data.DataConfig(**arm, **text_corpus)
  twin_config = dataclasses.replace(config, offset_twin=True)
  if arm.get('crop_lengths') == 'skew:0.01':
    assert _deciles(config, 300) < 0.1
  # 300 batches: about 20,000 segments of crops, 2,400 rows of packed_reset.
  assert _deciles(twin_config, 300) >= 0.9


def test_a_twin_of_synthetic_rows_keeps_the_dynamics_of_its_positions():
  """Synthetic tokens are generated for their positions: a moved segment is
  generated again there (same documents), and every target still follows
  the matrix of its position."""
  config = data.DataConfig(
      position_policy='crops',
      crop_lengths='skew:0.1',
      offset_twin=True,
      prefetch=0,
      shuffle_rows=64,
  )
  corpus = synthetic.from_config(config)
  nll = []
  for batch in _take(_iterator(config, max_len=config.seq_len), 4):
    m = batch['loss_mask'] > 0
    x, y, p = batch['inputs'][m], batch['targets'][m], batch['positions'][m]
    with np.errstate(divide='ignore'):
      nll.append(-np.log(corpus.matrices[corpus.regime(p + 1), x, y]))
  nll = np.concatenate(nll)
  assert np.isfinite(nll).all()
  bayes = corpus.bayes_loss(config.seq_len).mean()
  assert abs(nll.mean() - bayes) < 0.2


def test_a_shift_by_the_period_regenerates_the_same_tokens():
  config = data.DataConfig(prefetch=0)
  src = data.make_source(config, 'train')
  period = config.synthetic.period
  regenerate = twin.synthetic_regenerate(src, period)
  tokens = src.doc(3, max_pairs=40, num_pairs=40)
  np.testing.assert_array_equal(
      regenerate(3, 5, 20, 5 + 2 * period), tokens[5:26]
  )


@pytest.mark.parametrize('shared_stream', [False, True])
def test_a_twin_iterator_resumes_exactly(shared_stream, text_corpus):
  config = data.DataConfig(
      position_policy='crops',
      crop_lengths='skew:0.1',
      offset_twin=True,
      shared_stream=shared_stream,
      **text_corpus,
  )
  it = _iterator(config)
  _take(it, 3)
  state = it.get_state()
  expected = _take(it, 4)
  resumed = _iterator(config)
  resumed.set_state(state)
  for want, got in zip(expected, _take(resumed, 4)):
    for key in want:
      np.testing.assert_array_equal(want[key], got[key])


def test_a_twin_differs_by_seed_and_repeats_for_the_same_seed(text_corpus):
  config = data.DataConfig(
      position_policy='natural', offset_twin=True, **text_corpus
  )
  a = _take(_iterator(config, seed=1), 2)
  b = _take(_iterator(config, seed=1), 2)
  c = _take(_iterator(config, seed=2), 2)
  for x, y in zip(a, b):
    np.testing.assert_array_equal(x['positions'], y['positions'])
  assert any(not np.array_equal(x['inputs'], z['inputs']) for x, z in zip(a, c))


def test_a_twin_refuses_a_policy_with_a_short_phase():
  with pytest.raises(ValueError, match='offset_twin'):
    data.DataConfig(position_policy='length_schedule', offset_twin=True)


def test_moved_draws_each_segments_start_uniformly_inside_the_table():
  row = rows_lib.empty_row(8)
  row['segment_ids'][:] = [1, 1, 1, 2, 2, 0, 0, 0]
  row['positions'][:] = [0, 1, 2, 0, 1, 0, 0, 0]
  starts = {1: set(), 2: set()}
  for seed in range(200):
    out = twin.moved(row, np.random.default_rng(seed), table=6)
    starts[1].add(int(out['positions'][0]))
    starts[2].add(int(out['positions'][3]))
    np.testing.assert_array_equal(np.diff(out['positions'][:3]), [1, 1])
    np.testing.assert_array_equal(out['positions'][5:], 0)
  assert starts == {1: {0, 1, 2, 3}, 2: {0, 1, 2, 3, 4}}


def test_the_analytic_exposure_of_a_twin_is_flat():
  config = data.DataConfig(position_policy='crops', crop_lengths='skew:0.01')
  pairs = np.random.default_rng(0).integers(1, 400, 500)
  arm = report.policy_shares(pairs, config)['crops']
  twin_config = dataclasses.replace(config, offset_twin=True)
  twinned = twin_config.policy.exposure(
      twin_config, data.policies.CorpusLengths.of(pairs, config.seq_len, 2, 0)
  )
  assert arm['last_over_first'] < 0.1
  assert twinned['last_over_first'] == 1.0
  assert twinned['token_share'] == arm['token_share']
