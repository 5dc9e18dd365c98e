"""Grain pipeline and position policies on the synthetic corpus (and hand-made
documents)."""

import dataclasses
import hashlib
import json

import numpy as np
import pytest

from configs import tiny
from conftest import stream_chunks
from flax_posemb import config as config_lib
from flax_posemb import data
from flax_posemb.data import packers
from flax_posemb.data import rows as rows_lib

POLICIES = data.policies.names()

B = 8


def _cfg(policy='natural', max_len=None, **kw):
  """The tiny config with these data fields, typed (`RunConfig`)."""
  cfg = tiny.get_config()
  cfg.data.position_policy = policy
  cfg.data.prefetch = 0
  # The row shuffle's window fills before the first batch; 64 rows keep the
  # restores below inside a window at a fraction of the default's cost.
  cfg.data.shuffle_rows = 64
  for k, v in kw.items():
    setattr(cfg.data, k, v)
  if max_len is not None:
    cfg.model.max_len = max_len
  return config_lib.RunConfig.from_config_dict(cfg)


def _with_data(cfg, **fields):
  """``cfg`` with these data fields replaced (checked again)."""
  return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, **fields))


def _take(it, n):
  return [next(it) for _ in range(n)]


def _equal(a, b):
  return all(np.array_equal(a[k], b[k]) for k in rows_lib.KEYS)


@pytest.mark.smoke
@pytest.mark.parametrize('policy', POLICIES)
def test_batches_follow_the_contract_and_positions_stay_in_range(policy):
  cfg = _cfg(policy)
  it = data.make_train_iterator(
      cfg.data, batch_size=B, seed=0, num_train_steps=4
  )
  for batch in _take(it, 6):
    assert set(batch) == set(rows_lib.KEYS)
    t = batch['inputs'].shape[1]
    for k in rows_lib.KEYS:
      assert batch[k].shape == (B, t)
    assert (
        batch['loss_mask'].dtype == np.float32
        and batch['inputs'].dtype == np.int32
    )
    assert batch['positions'].min() >= 0 and batch['positions'].max() < t
    assert batch['inputs'].max() < data.vocab_size(cfg.data)
    np.testing.assert_array_equal(
        batch['loss_mask'] > 0, batch['segment_ids'] > 0
    )
    real = batch['segment_ids'] > 0
    # Shifted targets: wherever the next input is the same document, target =
    # next input.
    same = real[:, :-1] & (
        batch['segment_ids'][:, 1:] == batch['segment_ids'][:, :-1]
    )
    # packed has one segment per row, spanning documents.
    if policy != 'packed':
      np.testing.assert_array_equal(
          batch['targets'][:, :-1][same], batch['inputs'][:, 1:][same]
      )


@pytest.mark.parametrize('policy', POLICIES)
def test_same_seed_same_batches_and_different_seed_different(policy):
  cfg = _cfg(policy)

  def mk(s):
    return data.make_train_iterator(
        cfg.data, batch_size=B, seed=s, num_train_steps=4
    )

  a, b, c = _take(mk(0), 3), _take(mk(0), 3), _take(mk(1), 3)
  assert all(_equal(x, y) for x, y in zip(a, b))
  assert not all(_equal(x, y) for x, y in zip(a, c))


@pytest.mark.parametrize('policy', POLICIES)
def test_restored_iterator_continues_exactly(policy):
  cfg = _cfg(policy)

  def mk():
    return data.make_train_iterator(
        cfg.data, batch_size=B, seed=3, num_train_steps=4
    )

  it = mk()
  for skip in (0, 1, 3):  # Crosses the length_schedule switch at step 3.
    _take(it, skip)
    state = json.loads(json.dumps(it.get_state()))  # Orbax stores it as JSON.
    expected = _take(it, 3)
    it2 = mk()
    it2.set_state(state)
    assert all(_equal(x, y) for x, y in zip(expected, _take(it2, 3)))


@pytest.mark.parametrize('policy', ['natural', 'random_offset', 'resampled'])
def test_process_shards_are_slices_of_the_global_batch(policy):
  cfg = _cfg(policy)
  full = _take(
      data.make_train_iterator(
          cfg.data, batch_size=B, seed=0, num_train_steps=4
      ),
      2,
  )
  parts = [
      _take(
          data.make_train_iterator(
              cfg.data,
              batch_size=B,
              seed=0,
              num_train_steps=4,
              process_index=k,
              process_count=2,
          ),
          2,
      )
      for k in range(2)
  ]
  for step in range(2):
    for key in rows_lib.KEYS:
      np.testing.assert_array_equal(
          full[step][key],
          np.concatenate([parts[0][step][key], parts[1][step][key]]),
      )


def test_packed_process_shards_differ_and_keep_local_batch_size():
  cfg = _cfg('packed')
  a, b = [
      next(
          data.make_train_iterator(
              cfg.data,
              batch_size=B,
              seed=0,
              num_train_steps=4,
              process_index=k,
              process_count=2,
          )
      )
      for k in range(2)
  ]
  assert a['inputs'].shape == (B // 2, cfg.data.seq_len)
  assert not np.array_equal(a['inputs'], b['inputs'])


def _exposure(policy, num_batches=150):
  cfg = _cfg(policy)
  it = data.make_train_iterator(
      cfg.data, batch_size=16, seed=0, num_train_steps=10
  )
  counts = np.zeros(cfg.data.seq_len)
  for _ in range(num_batches):
    b = next(it)
    np.add.at(counts, b['positions'][b['segment_ids'] > 0], 1)
  return np.array([c.mean() for c in np.array_split(counts, 10)])


@pytest.mark.parametrize('policy', ['natural', 'packed_reset'])
def test_natural_and_packed_reset_exposure_decreases(policy):
  dec = _exposure(policy)
  assert dec[-1] <= dec[0] / 4, dec
  assert np.all(np.diff(dec) <= 0.05 * dec[0]), dec


def test_packed_exposure_is_flat():
  dec = _exposure('packed', 20)
  assert dec.max() / dec.min() <= 1.1, dec


def test_random_offset_covers_late_positions():
  dec = _exposure('random_offset')
  assert dec[-1] >= 0.9 * dec[0], dec


def test_length_schedule_switches_length_after_fraction_of_steps():
  cfg = _cfg('length_schedule', schedule_seq_len=32, schedule_fraction=0.5)
  it = data.make_train_iterator(
      cfg.data, batch_size=B, seed=0, num_train_steps=6
  )
  shapes = [b['inputs'].shape[1] for b in _take(it, 6)]
  assert shapes == [32, 32, 32, 128, 128, 128]


def test_resampled_full_fills_every_row():
  cfg = _cfg('resampled', resample_dist='full')
  b = next(
      data.make_train_iterator(
          cfg.data, batch_size=B, seed=0, num_train_steps=4
      )
  )
  assert np.all(b['segment_ids'] == 1)
  np.testing.assert_array_equal(b['positions'], np.tile(np.arange(128), (B, 1)))


def test_resampled_with_given_shares_draws_lengths_from_those_buckets():
  # Only the (32, 64] bucket.
  cfg = _cfg('resampled', resample_dist='0,0,0,0,1,0')
  it = data.make_train_iterator(
      cfg.data, batch_size=B, seed=0, num_train_steps=4
  )
  lengths = np.concatenate(
      [(b['segment_ids'] > 0).sum(1) for b in _take(it, 4)]
  )
  assert lengths.min() > 32 and lengths.max() <= 64


def test_interleaved_iterators_do_not_interfere():
  cfg = _cfg()

  def mk(s):
    return data.make_train_iterator(
        cfg.data, batch_size=B, seed=s, num_train_steps=4
    )

  a, b, fresh = mk(0), mk(1), mk(0)
  for _ in range(3):
    next(a)
    next(b)
  _take(fresh, 3)
  assert _equal(next(a), next(fresh))


def test_packed_and_packed_reset_share_layout_and_differ_only_in_positions():
  a = next(
      data.make_train_iterator(
          _cfg('packed').data, batch_size=B, seed=0, num_train_steps=4
      )
  )
  r = next(
      data.make_train_iterator(
          _cfg('packed_reset').data, batch_size=B, seed=0, num_train_steps=4
      )
  )
  np.testing.assert_array_equal(a['positions'], np.tile(np.arange(128), (B, 1)))
  assert np.all(a['segment_ids'] == 1) and r['segment_ids'].max() > 1
  # Document boundaries of packed_reset are where its positions restart.
  starts = (r['positions'] == 0) & (r['segment_ids'] > 0)
  assert np.all(r['segment_ids'][:, 0] == 1)
  # Tokens agree at each document's first position (position-independent first
  # token).
  np.testing.assert_array_equal(a['inputs'][starts], r['inputs'][starts])


def _pack(docs, seq_len, reset, chunk=2):
  return iter(
      packers.PackIterDataset(
          stream_chunks(len(docs), chunk),
          lambda ch, col: [docs[i] for i in ch['doc']],
          seq_len,
          reset,
      )
  )


HAND_DOCS = [
    np.array([10, 11, 12]),
    np.array([20, 21, 22, 23, 24, 25]),
    np.array([30]),
    np.array([40, 41]),
    np.array([50, 51, 52, 53]),
]


def test_packed_reset_segment_ids_positions_and_masks_on_hand_made_documents():
  it = _pack(HAND_DOCS, 4, reset=True)
  r1, r2 = next(it), next(it)
  np.testing.assert_array_equal(r1['inputs'], [10, 11, 20, 21])
  np.testing.assert_array_equal(r1['targets'], [11, 12, 21, 22])
  np.testing.assert_array_equal(r1['positions'], [0, 1, 0, 1])
  np.testing.assert_array_equal(r1['segment_ids'], [1, 1, 2, 2])
  # Doc 2 continues with its in-document positions; doc [30] has no pair and is
  # skipped.
  np.testing.assert_array_equal(r2['inputs'], [22, 23, 24, 40])
  np.testing.assert_array_equal(r2['targets'], [23, 24, 25, 41])
  np.testing.assert_array_equal(r2['positions'], [2, 3, 4, 0])
  np.testing.assert_array_equal(r2['segment_ids'], [1, 1, 1, 2])
  # Index of each token's document.
  np.testing.assert_array_equal(r1['doc_ids'], [0, 0, 1, 1])
  np.testing.assert_array_equal(r2['doc_ids'], [1, 1, 1, 3])
  for r in (r1, r2):
    np.testing.assert_array_equal(r['loss_mask'], np.ones(4, np.float32))
  # 3 pairs left: no full row (packing never pads).
  with pytest.raises(StopIteration):
    next(it)


def test_packed_rows_equal_packed_reset_rows_except_positions_and_segments():
  for a, r in zip(
      _take(_pack(HAND_DOCS, 4, False), 2), _take(_pack(HAND_DOCS, 4, True), 2)
  ):
    np.testing.assert_array_equal(a['inputs'], r['inputs'])
    np.testing.assert_array_equal(a['targets'], r['targets'])
    np.testing.assert_array_equal(a['positions'], np.arange(4))
    np.testing.assert_array_equal(a['segment_ids'], np.ones(4))


def test_natural_row_truncates_and_pads():
  row = rows_lib.natural_row(np.array([5, 6, 7]), 4)
  np.testing.assert_array_equal(row['inputs'], [5, 6, 0, 0])
  np.testing.assert_array_equal(row['targets'], [6, 7, 0, 0])
  np.testing.assert_array_equal(row['segment_ids'], [1, 1, 0, 0])
  np.testing.assert_array_equal(row['loss_mask'], [1, 1, 0, 0])
  long = rows_lib.natural_row(np.arange(10), 4, start=0)
  np.testing.assert_array_equal(long['targets'], [1, 2, 3, 4])


def test_eval_windows_are_full_length_deterministic_and_seeded():
  cfg = _cfg()

  def mk(seed):
    return list(
        data.make_eval_batches(
            cfg.data,
            split='validation',
            window_len=64,
            num_windows=10,
            batch_size=4,
            seed=seed,
        )
    )

  a, b, c = mk(0), mk(0), mk(1)
  assert len(a) == 3 and all(x['inputs'].shape == (4, 64) for x in a)
  assert all(_equal(x, y) for x, y in zip(a, b))
  assert not _equal(a[0], c[0])
  np.testing.assert_array_equal(
      a[0]['positions'], np.tile(np.arange(64), (4, 1))
  )
  assert a[0]['loss_mask'].min() == 1.0
  # 10 windows: the last batch has 2 real rows.
  assert a[-1]['loss_mask'].sum() == 2 * 64
  # padding rows: no document
  np.testing.assert_array_equal(a[-1]['doc'][2:], [-1, -1])
  assert set(a[0]['start']) == {0} and set(a[0]['doc_len']) == {65}
  assert set(a[0]['kind']) == {'synthetic'}


def test_eval_natural_rows_and_too_few_documents_error():
  cfg = _cfg()
  b = next(
      data.make_eval_batches(
          cfg.data,
          split='validation',
          window_len=128,
          num_windows=8,
          batch_size=8,
          policy='natural',
      )
  )
  assert (b['segment_ids'] == 0).any()
  synthetic = dataclasses.replace(cfg.data.synthetic, num_docs=5)
  cfg = _with_data(cfg, synthetic=synthetic)
  with pytest.raises(ValueError, match='only 5'):
    list(
        data.make_eval_batches(
            cfg.data,
            split='validation',
            window_len=16,
            num_windows=6,
            batch_size=2,
        )
    )


@pytest.mark.parametrize(
    'field,value,match',
    [
        ('source', 'wikipedia', 'Unknown data.source'),
        ('position_policy', 'shuffled', 'Unknown data.position_policy'),
        ('seq_len', 256, 'longer than the position table'),
        ('min_doc_len', 1, 'min_doc_len'),
        ('length_dist', 'zipf', 'length distribution'),
    ],
)
def test_bad_config_is_a_clear_error(field, value, match):
  with pytest.raises(ValueError, match=match):
    cfg = _cfg(**{field: value})
    data.check_fits_model(cfg.data, max_len=128)


def test_data_config_owns_the_synthetic_parameters_and_the_text_splits():
  with pytest.raises(ValueError, match='num_docs >= 1'):
    data.SyntheticConfig(num_docs=0)
  with pytest.raises(ValueError, match="use 'train' or 'validation'"):
    _cfg(source='stdlib', eval_split='test')


def test_packed_on_synthetic_needs_period_dividing_context():
  with pytest.raises(ValueError, match='cannot be honoured'):
    _cfg('packed', seq_len=120)


@pytest.mark.parametrize('policy', POLICIES)
def test_synthetic_tokens_follow_the_dynamics_of_their_position_ids(policy):
  """Every target is drawn from the matrix of its position id (+1), in every
  policy."""
  from flax_posemb.data import synthetic

  cfg = _cfg(policy)
  corp = synthetic.from_config(cfg.data)
  it = data.make_train_iterator(
      cfg.data, batch_size=16, seed=0, num_train_steps=2
  )
  nll, nll_wrong = [], []
  for b in _take(it, 4):
    m = b['loss_mask'] > 0
    x, y, p = b['inputs'][m], b['targets'][m], b['positions'][m]
    with np.errstate(divide='ignore'):
      nll.append(-np.log(corp.matrices[corp.regime(p + 1), x, y]))
      nll_wrong.append(
          -np.log(corp.matrices[corp.regime(p + 1 + corp.segment_len), x, y])
      )
  nll, nll_wrong = np.concatenate(nll), np.concatenate(nll_wrong)
  bayes = corp.bayes_loss(cfg.data.seq_len).mean()
  assert np.isfinite(nll).all()
  assert abs(nll.mean() - bayes) < 0.2, (nll.mean(), bayes)
  assert np.mean(nll_wrong) > bayes + 1.0


def _long_doc_cfg(tmp_path, policy, t=16):
  """local_text corpus: one document of 10*T tokens and three short ones, no
  shuffling."""
  corpus = tmp_path / 'corpus'
  corpus.mkdir(exist_ok=True)
  rng = np.random.default_rng(0)
  (corpus / 'long.txt').write_text(
      ''.join(chr(c) for c in rng.integers(97, 123, 10 * t - 1))
  )
  for i, n in enumerate((3, 7, 11)):
    (corpus / f'short{i}.txt').write_text('ABCDEFGHIJKLMNOP'[:n])
  cfg = _cfg(
      policy,
      source='local_text',
      local_glob=str(corpus / '*.txt'),
      val_percent=0,
      data_dir=str(tmp_path / 'data'),
      seq_len=t,
      shuffle=False,
      max_len=t,
  )
  return cfg


def _corpus_docs(cfg):
  src = data.make_source(cfg.data, 'train')
  return [src.doc(i, max_pairs=None) for i in range(len(src))]


@pytest.mark.parametrize(
    'policy', ['packed', 'packed_reset', 'natural_chunked']
)
def test_a_document_of_ten_contexts_contributes_all_its_tokens(
    tmp_path, policy
):
  t = 16
  cfg = _long_doc_cfg(tmp_path, policy, t)
  docs = _corpus_docs(cfg)
  assert max(len(d) for d in docs) == 10 * t  # [SEP] + 10T - 1 bytes.
  stream_in = np.concatenate([d[:-1] for d in docs])
  stream_tg = np.concatenate([d[1:] for d in docs])
  doc_pos = np.concatenate([np.arange(len(d) - 1) for d in docs])
  total = len(stream_in)
  it = data.make_train_iterator(
      cfg.data,
      batch_size=2,
      seed=0,
      num_train_steps=4,
      max_len=4 * t if policy == 'packed_reset' else None,
  )
  rows = [
      r
      for b in _take(it, 20)
      for r in ({k: v[i] for k, v in b.items()} for i in range(2))
  ]

  def real(key):
    return np.concatenate([r[key][r['segment_ids'] > 0] for r in rows])

  got_in, got_tg, got_pos = real('inputs'), real('targets'), real('positions')
  # The first epoch of the stream is every pair of every document, in order.
  np.testing.assert_array_equal(got_in[:total], stream_in)
  np.testing.assert_array_equal(got_tg[:total], stream_tg)
  if policy == 'packed':
    np.testing.assert_array_equal(got_pos[:total], np.arange(total) % t)
  # In-document positions up to the table (4T), then restart.
  elif policy == 'packed_reset':
    np.testing.assert_array_equal(got_pos[:total], doc_pos % (4 * t))
    assert got_pos.max() == 4 * t - 1
  else:  # natural_chunked: every T-piece restarts at 0 and is its own row.
    np.testing.assert_array_equal(got_pos[:total], doc_pos % t)
    long_rows = [r for r in rows[: len(rows)] if r['segment_ids'].sum() == t]
    assert len(long_rows) >= 9


def test_packed_reset_without_max_len_restarts_positions_at_the_row_length(
    tmp_path,
):
  cfg = _long_doc_cfg(tmp_path, 'packed_reset')
  b = next(
      data.make_train_iterator(
          cfg.data, batch_size=8, seed=0, num_train_steps=4
      )
  )
  assert b['positions'].max() == 15
  with pytest.raises(ValueError, match='longer than the position table'):
    data.check_fits_model(cfg.data, max_len=8)


@pytest.mark.parametrize(
    'policy', ['packed', 'packed_reset', 'natural_chunked', 'natural']
)
def test_long_documents_resume_exactly_mid_document(tmp_path, policy):
  cfg = _long_doc_cfg(tmp_path, policy)
  # Restores land inside and across shuffle windows.
  cfg = _with_data(cfg, shuffle_rows=3)

  def mk():
    return data.make_train_iterator(
        cfg.data,
        batch_size=2,
        seed=0,
        num_train_steps=4,
        max_len=32 if policy == 'packed_reset' else None,
    )

  it = mk()
  for skip in (0, 1, 2, 5):  # Lands inside the 10T document and across epochs.
    _take(it, skip)
    state = json.loads(json.dumps(it.get_state()))
    expected = _take(it, 4)
    it2 = mk()
    it2.set_state(state)
    assert all(_equal(x, y) for x, y in zip(expected, _take(it2, 4)))


def _deep_cfg(tmp_path, t=16):
  """local_text corpus: documents of 20T, T+5 and 3 tokens (with the
  separator)."""
  corpus = tmp_path / 'deep'
  corpus.mkdir()
  rng = np.random.default_rng(1)
  for name, n in (('long', 20 * t - 1), ('mid', t + 4), ('short', 2)):
    (corpus / f'{name}.txt').write_text(
        ''.join(chr(c) for c in rng.integers(97, 123, n))
    )
  cfg = _cfg(
      'natural',
      source='local_text',
      local_glob=str(corpus / '*.txt'),
      val_percent=0,
      data_dir=str(tmp_path / 'data'),
      seq_len=t,
      shuffle=False,
      max_len=t,
  )
  return cfg


def test_deep_windows_tile_long_documents_past_their_opening_only(
    tmp_path,
):
  t = 16
  cfg = _deep_cfg(tmp_path, t)
  docs = _corpus_docs(cfg)
  long_doc = next(i for i, d in enumerate(docs) if len(d) == 20 * t)
  assert sorted(len(d) for d in docs) == [3, t + 5, 20 * t]
  kw = dict(
      split='train',
      window_len=t,
      batch_size=4,
      window_start='deep',
      min_doc_len=2,
      min_start=t,
  )

  def mk(n, seed=0):
    return list(
        data.make_eval_batches(cfg.data, num_windows=n, seed=seed, **kw)
    )

  batches = mk(17)  # (20T - T) // (T + 1) = 17 slots, all in the long document
  real = np.concatenate([b['doc'] for b in batches]) >= 0
  get = lambda k: np.concatenate([b[k] for b in batches])[real]  # noqa: E731
  # none from the T+5 document
  assert real.sum() == 17 and set(get('doc')) == {long_doc}
  assert set(get('doc_len')) == {20 * t} and set(get('kind')) == {'local_text'}
  starts = get('start')
  # inside, never in its first T
  assert starts.min() >= t and starts.max() + t + 1 <= 20 * t
  # several windows, none overlapping
  assert np.all(np.diff(np.sort(starts)) >= t + 1)
  doc = docs[long_doc]
  for x, y, a in zip(get('inputs'), get('targets'), starts):
    np.testing.assert_array_equal(x, doc[a : a + t])
    np.testing.assert_array_equal(y, doc[a + 1 : a + t + 1])
  # deterministic per seed
  assert all(_equal(x, y) for x, y in zip(mk(5, 3), mk(5, 3)))
  assert (
      len(
          {
              tuple(np.concatenate([b['start'] for b in mk(2, s)]))
              for s in range(4)
          }
      )
      > 1
  )
  with pytest.raises(
      ValueError, match='only 17 deep window slots.*lower eval.num_windows'
  ):
    mk(18)
  # From token 1 the T+5 document holds one slot (319 // 17 + 1); at >= 4T
  # tokens it holds none.
  every = list(
      data.make_eval_batches(cfg.data, num_windows=19, **dict(kw, min_start=1))
  )
  assert {len(docs[d]) for b in every for d in b['doc'] if d >= 0} == {
      t + 5,
      20 * t,
  }
  with pytest.raises(ValueError, match='only 18 deep window slots'):
    data.make_eval_batches(
        cfg.data, num_windows=19, **dict(kw, min_start=1, min_doc_len=4 * t)
    )
  # 0 means the defaults, documents of >= 4T tokens and no window in their first
  # T: 17 slots.
  default = list(
      data.make_eval_batches(
          cfg.data, num_windows=17, **dict(kw, min_start=0, min_doc_len=0)
      )
  )
  assert (
      min(a for b in default for a, d in zip(b['start'], b['doc']) if d >= 0)
      >= t
  )
  with pytest.raises(ValueError, match='only 17 deep window slots'):
    data.make_eval_batches(
        cfg.data, num_windows=18, **dict(kw, min_start=0, min_doc_len=0)
    )


@pytest.mark.parametrize(
    'start,match',
    [
        ('deep', 'needs a text source'),
        ('random', "'random' was retired.*'deep'"),
    ],
)
def test_deep_windows_on_the_synthetic_corpus_and_random_starts_are_refused(
    start, match
):
  cfg = _cfg('natural')
  with pytest.raises(ValueError, match=match):
    next(
        data.make_eval_batches(
            cfg.data,
            split='validation',
            window_len=16,
            num_windows=2,
            batch_size=2,
            window_start=start,
        )
    )


# sha256 (first 16 hex digits) of the first 5 batches (4 rows, seed 1, with
# doc_ids) of the tiny config per policy, recorded before the policies became
# registered classes: a refactor must not change a single row.
PINNED_BATCHES = [
    ('natural', {}, '5bb84691860fece5'),
    ('packed', {}, '6f2c308f41e45297'),
    ('packed_reset', {}, 'f5932e9b28f19133'),
    ('random_offset', {}, '737e889860a04d26'),
    ('length_schedule', {}, 'd631662d79d5d0cf'),
    ('resampled', {}, 'a92113befc8f56fe'),
    ('resampled', {'resample_dist': '0,0,1,1'}, 'a287a03f0b56bce1'),
    ('natural_chunked', {}, '216cee6f5e970db1'),
    ('crops', {}, '55e42ba7ba62d428'),
    ('crops', {'crop_lengths': 'skew:0.1'}, '8cb96f7d32713096'),
    ('crops', {'crop_lengths': '1,2,3'}, '688950a5ba0eae2b'),
]


@pytest.mark.parametrize('policy,fields,digest', PINNED_BATCHES)
def test_batches_are_the_pinned_ones(policy, fields, digest):
  cfg = _cfg(policy, **fields)
  it = data.make_train_iterator(
      cfg.data,
      batch_size=4,
      seed=1,
      num_train_steps=4,
      max_len=cfg.model.max_len,
      with_doc_ids=True,
  )
  sha = hashlib.sha256()
  for batch in _take(it, 5):
    for key in sorted(batch):
      sha.update(key.encode())
      sha.update(np.ascontiguousarray(batch[key]).tobytes())
  assert sha.hexdigest()[:16] == digest
