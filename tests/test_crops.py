"""The `crops` policy: content-matched position exposure (docs/DESIGN.md § Data
policies and tokens)."""

import collections

import numpy as np
import pytest

from conftest import stream_chunks
from flax_posemb import defaults
from flax_posemb.data import lengths as lengths_lib
from flax_posemb.data import pipeline
from flax_posemb.data import policies

HAND_DOCS = [
    np.array([10, 11, 12]),
    np.array([20, 21, 22, 23, 24, 25]),
    np.array([30]),
    np.array([40, 41]),
    np.array([50, 51, 52, 53]),
    np.array([60, 61, 62, 63, 64, 65, 66]),
] * 4


def _materialize(chunk, column):
  del column
  return [HAND_DOCS[i] for i in chunk['doc']]


def _fixed(length, seq_len):
  """Every crop ``length`` pairs."""
  probs = np.zeros(seq_len)
  probs[length - 1] = 1.0
  return lengths_lib.PieceLengths(probs)


def _crops(seq_len, lengths, **kwargs):
  return iter(
      policies.CropIterDataset(
          stream_chunks(len(HAND_DOCS)),
          _materialize,
          seq_len,
          min_tokens=2,
          seed=0,
          lengths=lengths,
          **kwargs,
      )
  )


def _real_pairs(rows):
  """(input, target) of every real slot, in row order."""
  out = []
  for r in rows:
    real = r['segment_ids'] > 0
    out += list(zip(r['inputs'][real].tolist(), r['targets'][real].tolist()))
  return out


def test_crops_place_whole_crops_and_pad_when_the_next_one_does_not_fit():
  row = next(_crops(8, _fixed(3, 8)))
  np.testing.assert_array_equal(row['positions'], [0, 1, 2, 0, 1, 2, 0, 0])
  np.testing.assert_array_equal(row['segment_ids'], [1, 1, 1, 2, 2, 2, 0, 0])
  np.testing.assert_array_equal(row['loss_mask'], [1, 1, 1, 1, 1, 1, 0, 0])
  # Crops run on across documents, as packed rows do: [10 11 12][20 21 ...].
  np.testing.assert_array_equal(row['inputs'][:6], [10, 11, 20, 21, 22, 23])
  np.testing.assert_array_equal(row['targets'][:6], [11, 12, 21, 22, 23, 24])
  np.testing.assert_array_equal(row['doc_ids'][:6], [0, 0, 1, 1, 1, 1])
  np.testing.assert_array_equal(row['doc_ids'][6:], [-1, -1])


def test_token_crops_hold_the_pairs_of_the_packed_stream_in_order():
  crops = _crops(8, lengths_lib.skewed_pieces(0.2, 8))
  packed = iter(
      policies.PackIterDataset(
          stream_chunks(len(HAND_DOCS)), _materialize, 8, reset=True
      )
  )
  crop_pairs = _real_pairs([next(crops) for _ in range(8)])
  packed_pairs = _real_pairs([next(packed) for _ in range(8)])
  assert len(crop_pairs) > 20
  assert crop_pairs == packed_pairs[: len(crop_pairs)]


def test_crops_resume_exactly_with_a_crop_left_for_the_next_row():
  lengths = lengths_lib.skewed_pieces(0.3, 8)
  it = _crops(8, lengths)
  # Until a crop is read but not placed: a row ended because it did not fit.
  for _ in range(20):
    next(it)
    if it._pending is not None:
      break
  assert it._pending is not None
  state = it.get_state()
  expected = [next(it) for _ in range(4)]
  resumed = _crops(8, lengths)
  resumed.set_state(state)
  for want, got in zip(expected, [next(resumed) for _ in range(4)]):
    for key in want:
      np.testing.assert_array_equal(want[key], got[key])


def _data(**overrides):
  config = defaults.data()
  config.update(overrides)
  return config


def _batches(config, num_batches, batch_size=8, seed=0, num_train_steps=100):
  it = pipeline.make_train_iterator(
      config,
      batch_size=batch_size,
      seed=seed,
      num_train_steps=num_train_steps,
      max_len=int(config.seq_len),
      with_doc_ids=True,
  )
  return it, [next(it) for _ in range(num_batches)]


def _exposure(batches, seq_len):
  counts = np.zeros(seq_len)
  for b in batches:
    real = b['segment_ids'] > 0
    np.add.at(counts, b['positions'][real], 1)
  return counts


@pytest.mark.parametrize('spec', ['skew:0.1', 'natural', 'uniform'])
def test_crops_have_the_requested_exposure_per_position(spec):
  t = 32
  config = _data(
      position_policy='crops', crop_lengths=spec, seq_len=t, shuffle_rows=64
  )
  config.synthetic.num_docs = 5000
  pipeline.validate_config(config, t)
  _, batches = _batches(config, 300)
  counts = _exposure(batches, t)
  crops = counts[0]  # Every crop has position 0.
  expected = pipeline.piece_lengths(config).survival() * crops
  # Within sampling error: each count is a binomial over the crops.
  sigma = np.sqrt(np.maximum(expected * (1 - expected / crops), 1.0))
  assert np.all(np.abs(counts - expected) < 5 * sigma)
  if spec == 'skew:0.1':
    assert counts[-4:].sum() / counts[:4].sum() == pytest.approx(0.13, abs=0.02)


def test_crops_of_skew_1_are_the_packed_batches():
  common = dict(seq_len=32, shuffle_rows=64)
  _, crops = _batches(
      _data(position_policy='crops', crop_lengths='skew:1', **common), 5
  )
  # Synthetic tokens depend on their position ids; both start crops at 0.
  _, packed = _batches(_data(position_policy='packed_reset', **common), 5)
  for a, b in zip(crops, packed):
    np.testing.assert_array_equal(
        a['positions'], np.tile(np.arange(32), (8, 1))
    )
    np.testing.assert_array_equal(a['segment_ids'], np.ones((8, 32)))
    assert a['inputs'].shape == b['inputs'].shape


def test_schedule_cuts_rows_into_short_pieces_then_keeps_full_rows():
  batch = {
      'positions': np.array([[0, 1, 2, 3, 4, 5], [3, 4, 0, 1, 2, 0]]),
      'segment_ids': np.array([[1, 1, 1, 1, 1, 1], [1, 1, 2, 2, 2, 0]]),
  }
  cut = policies.cut_rows(batch, 2)
  np.testing.assert_array_equal(cut['positions'][0], [0, 1, 0, 1, 0, 1])
  np.testing.assert_array_equal(cut['segment_ids'][0], [1, 1, 2, 2, 3, 3])
  np.testing.assert_array_equal(cut['positions'][1], [1, 0, 0, 1, 0, 0])
  np.testing.assert_array_equal(cut['segment_ids'][1], [1, 2, 3, 3, 4, 0])


@pytest.mark.parametrize(
    'overrides, message',
    [
        ({'crop_weighting': 'doc'}, 'crop_weighting'),
        ({'crop_lengths': 'skew:0'}, 'skew:R'),
        ({'crop_lengths': 'skew:x'}, 'skew:R'),
        ({'crop_lengths': 'bimodal'}, 'length distribution'),
        (
            {'crop_weighting': 'document', 'crop_lengths': 'skew:0.1'},
            "crop_lengths='natural'",
        ),
        ({'crop_lengths': 'schedule'}, 'length_schedule'),
        (
            {
                'source': 'long_text',
                'crop_lengths': 'schedule',
                'schedule_seq_len': 64,
            },
            'schedule_seq_len',
        ),
    ],
)
def test_crops_refuse_bad_settings_naming_the_field(overrides, message):
  config = _data(position_policy='crops', seq_len=32, **overrides)
  with pytest.raises(ValueError, match=message):
    pipeline.validate_config(config, 32)


LONG_TEXT = dict(source='long_text', seq_len=128, min_doc_len=2)


@pytest.fixture(scope='module')
def long_text_kinds():
  src = pipeline.make_source(_data(**LONG_TEXT), 'train')
  return np.array([src.kind(i) for i in range(len(src))])


def _kind_mix(batches, kinds):
  counts = collections.Counter()
  for b in batches:
    docs = b['doc_ids'][b['segment_ids'] > 0]
    counts.update(kinds[docs].tolist())
  total = sum(counts.values())
  return {k: n / total for k, n in counts.items()}


@pytest.mark.slow
def test_token_crops_train_on_the_mix_of_packed_reset_by_kind(long_text_kinds):
  common = dict(LONG_TEXT, shuffle_rows=8192)
  _, crops = _batches(
      _data(position_policy='crops', crop_lengths='natural', **common), 250
  )
  _, packed_reset = _batches(
      _data(position_policy='packed_reset', **common), 250
  )
  _, natural = _batches(_data(position_policy='natural', **common), 250)
  crops_mix = _kind_mix(crops, long_text_kinds)
  control_mix = _kind_mix(packed_reset, long_text_kinds)
  for kind in set(crops_mix) | set(control_mix):
    assert abs(crops_mix.get(kind, 0) - control_mix.get(kind, 0)) < 0.02
  # Natural's exposure, not its content: natural trains almost only on code.
  t = LONG_TEXT['seq_len']
  crops_profile = _exposure(crops, t)
  natural_profile = _exposure(natural, t)
  np.testing.assert_allclose(
      crops_profile[-16:].sum() / crops_profile[:16].sum(),
      natural_profile[-16:].sum() / natural_profile[:16].sum(),
      atol=0.05,
  )
  assert _kind_mix(natural, long_text_kinds)['code'] > 0.9


@pytest.mark.slow
def test_document_crops_do_not_start_at_the_openings_of_long_documents(
    long_text_kinds,
):
  del long_text_kinds
  t = LONG_TEXT['seq_len']
  config = _data(
      position_policy='crops',
      crop_weighting='document',
      shuffle_rows=0,
      **LONG_TEXT,
  )
  src = pipeline.make_source(config, 'train')
  lengths = np.array([len(src.doc(i, max_pairs=None)) for i in range(len(src))])
  _, batches = _batches(config, 40)
  openings = []
  for b in batches:
    starts = (b['positions'] == 0) & (b['segment_ids'] > 0)
    for doc, first in zip(b['doc_ids'][starts], b['inputs'][starts]):
      if lengths[doc] > 4 * t:
        openings.append(first == src.tokenizer.sep_id)
  assert len(openings) > 50
  # A uniform offset lands on the separator at token 0 about t / n of the time.
  assert np.mean(openings) < 0.1


@pytest.mark.slow
@pytest.mark.parametrize(
    'overrides',
    [
        {'crop_lengths': 'natural'},
        {'crop_lengths': 'natural', 'crop_weighting': 'document'},
        {
            'crop_lengths': 'schedule',
            'schedule_seq_len': 32,
            'schedule_fraction': 0.5,
        },
    ],
)
def test_crops_resume_exactly_from_the_pipeline_state(
    overrides, long_text_kinds
):
  del long_text_kinds
  config = _data(position_policy='crops', shuffle_rows=256, **LONG_TEXT)
  config.update(overrides)
  pipeline.validate_config(config, LONG_TEXT['seq_len'])
  it, _ = _batches(config, 4, num_train_steps=10)
  state = it.get_state()
  expected = [next(it) for _ in range(3)]
  resumed, _ = _batches(config, 0, num_train_steps=10)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(want[key], got[key])
  if overrides['crop_lengths'] == 'schedule':
    # Steps 0-4 cut at 32, from step 5 full rows.
    assert expected[0]['positions'].max() < 32
    assert expected[1]['positions'].max() == LONG_TEXT['seq_len'] - 1
