"""One token stream per seed (data.shared_stream): arms of one seed recut the
same documents, offsets and order (docs/DESIGN.md § Data policies and
tokens)."""

import dataclasses

import numpy as np
import pytest
import text_corpus as text_corpus_lib

from flax_posemb import data
from flax_posemb.data import overlap

T = 64
B = 8
# Twenty batches of full rows.
RUN_TOKENS = 20 * B * T
ARMS = {
    'crops_skew': {'position_policy': 'crops', 'crop_lengths': 'skew:0.01'},
    'packed_reset': {'position_policy': 'packed_reset'},
    'crops_natural': {'position_policy': 'crops', 'crop_lengths': 'natural'},
    'natural': {'position_policy': 'natural'},
    'natural_chunked': {'position_policy': 'natural_chunked'},
    'packed': {'position_policy': 'packed'},
    'crops_skew_twin': {
        'position_policy': 'crops',
        'crop_lengths': 'skew:0.01',
        'offset_twin': True,
    },
}


@pytest.fixture(scope='module')
def text_corpus(tmp_path_factory):
  return text_corpus_lib.geometric_corpus(tmp_path_factory.mktemp('shared'), T)


def _config(arm, text_corpus, shared_stream=True):
  return data.DataConfig(
      **ARMS[arm], shared_stream=shared_stream, **text_corpus
  )


@pytest.mark.parametrize('arm', sorted(set(ARMS) - {'crops_skew'}))
def test_same_seed_arms_share_nine_tenths_of_their_token_instances(
    arm, text_corpus
):
  measured = overlap.stream_overlap(
      _config('crops_skew', text_corpus),
      _config(arm, text_corpus),
      batch_size=B,
      seed=0,
      num_tokens=RUN_TOKENS,
  )
  assert measured['overlap'] >= 0.9, measured


def test_without_a_shared_stream_same_seed_arms_share_little(text_corpus):
  """The fault the flag removes: a run shorter than the row shuffle's window
  (the default's 8192 rows) trains on its own part of that window."""
  unshared = dict(text_corpus, shuffle_rows=8192)
  measured = overlap.stream_overlap(
      _config('crops_skew', unshared, shared_stream=False),
      _config('packed_reset', unshared, shared_stream=False),
      batch_size=B,
      seed=0,
      num_tokens=RUN_TOKENS,
  )
  assert measured['overlap'] < 0.5, measured


def test_seeds_draw_different_streams(text_corpus):
  config = _config('packed_reset', text_corpus)
  seed_0 = overlap.token_instances(
      config, batch_size=B, seed=0, num_tokens=RUN_TOKENS
  )
  seed_1 = overlap.token_instances(
      config, batch_size=B, seed=1, num_tokens=RUN_TOKENS
  )
  shared = len(np.intersect1d(seed_0, seed_1)) / len(np.unique(seed_0))
  assert shared < 0.6


def _iterator(config, process_index=0, process_count=1):
  return data.make_train_iterator(
      config,
      batch_size=B,
      seed=0,
      num_train_steps=10,
      max_len=T,
      process_index=process_index,
      process_count=process_count,
      with_doc_ids=True,
      with_doc_offsets=True,
  )


@pytest.mark.parametrize('arm', ['crops_skew', 'packed_reset', 'natural'])
def test_a_shared_stream_iterator_resumes_exactly(arm, text_corpus):
  config = _config(arm, text_corpus)
  it = _iterator(config)
  for _ in range(3):
    next(it)
  state = it.get_state()
  expected = [next(it) for _ in range(3)]
  resumed = _iterator(config)
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(want[key], got[key])


def test_process_shards_are_slices_of_the_global_batch(text_corpus):
  config = _config('crops_skew', text_corpus)
  whole = next(_iterator(config))
  halves = [next(_iterator(config, i, 2)) for i in range(2)]
  for key in whole:
    np.testing.assert_array_equal(
        whole[key], np.concatenate([h[key] for h in halves])
    )


def test_each_row_slot_reads_its_own_documents_in_order(text_corpus):
  config = _config('packed_reset', text_corpus)
  it = _iterator(config)
  batches = [next(it) for _ in range(5)]
  for slot in range(B):
    docs = np.concatenate([b['doc_ids'][slot] for b in batches])
    offsets = np.concatenate([b['doc_offsets'][slot] for b in batches])
    # One slot's stream: within a document, offsets run on across batches.
    same = docs[1:] == docs[:-1]
    np.testing.assert_array_equal(offsets[1:][same], offsets[:-1][same] + 1)
  first_docs = {int(b) for b in batches[0]['doc_ids'][:, 0]}
  assert len(first_docs) == B


@pytest.mark.parametrize(
    'fields, message',
    [
        ({'position_policy': 'random_offset'}, 'cannot recut'),
        ({'position_policy': 'resampled'}, 'cannot recut'),
        (
            {'position_policy': 'crops', 'crop_weighting': 'document'},
            'cannot recut',
        ),
    ],
)
def test_a_policy_that_draws_its_own_documents_is_refused(
    fields, message, text_corpus
):
  with pytest.raises(ValueError, match=message):
    data.DataConfig(**fields, shared_stream=True, **text_corpus)


@pytest.mark.parametrize('arm', ['packed_reset', 'crops_natural', 'natural'])
def test_synthetic_arms_share_their_documents_and_keep_the_dynamics(arm):
  """Synthetic stretches are generated again where a policy places them:
  shared (document, offset) instances, every target from the matrix of its
  position."""
  from flax_posemb.data import synthetic

  fields = dict(seq_len=T, prefetch=0, shared_stream=True)
  skew = data.DataConfig(**ARMS['crops_skew'], **fields)
  config = data.DataConfig(**ARMS[arm], **fields)
  measured = overlap.stream_overlap(
      skew, config, batch_size=B, seed=0, num_tokens=RUN_TOKENS
  )
  assert measured['overlap'] >= 0.9, measured
  corpus = synthetic.from_config(config)
  it = _iterator(config)
  nll = []
  for _ in range(4):
    batch = next(it)
    m = batch['loss_mask'] > 0
    x, y, p = batch['inputs'][m], batch['targets'][m], batch['positions'][m]
    with np.errstate(divide='ignore'):
      nll.append(-np.log(corpus.matrices[corpus.regime(p + 1), x, y]))
  nll = np.concatenate(nll)
  assert np.isfinite(nll).all()
  assert abs(nll.mean() - corpus.bayes_loss(T).mean()) < 0.2


def test_the_default_keeps_the_row_shuffle(text_corpus):
  config = _config('packed_reset', text_corpus, shared_stream=False)
  shared = dataclasses.replace(config, shared_stream=True)
  a = next(_iterator(config))
  b = next(_iterator(shared))
  assert not np.array_equal(a['inputs'], b['inputs'])
