"""Loss by position bucket: exact bucket math, standard errors, offsets,
compatibility."""

import os

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import scipy.stats

from flax_posemb import buckets as buckets_lib
from flax_posemb import config as config_lib
from flax_posemb import defaults
from flax_posemb import eval_report
from flax_posemb import evaluation
from flax_posemb import inference
from flax_posemb.model import ModelConfig
from flax_posemb.model import TransformerLM

T = 16


def _model(max_len=T, **kw):
  cfg = ModelConfig(
      vocab_size=11,
      num_layers=1,
      num_heads=2,
      emb_dim=16,
      mlp_dim=32,
      max_len=max_len,
      **kw,
  )
  model = TransformerLM(cfg)
  x = jnp.zeros((1, 4), jnp.int32)
  params = model.init(jax.random.key(0), x, x)['params']
  return model, params


def _batches():
  """Two hand-built batches (5 and 2 rows): packed rows, padding and masked
  targets."""
  rng = np.random.default_rng(0)
  out = []
  for rows in (5, 2):
    inputs = rng.integers(0, 11, (rows, T)).astype(np.int32)
    targets = rng.integers(0, 11, (rows, T)).astype(np.int32)
    seg = np.ones((rows, T), np.int32)
    pos = np.tile(np.arange(T, dtype=np.int32), (rows, 1))
    seg[0, 10:] = 2  # second document in row 0: positions restart
    pos[0, 10:] = np.arange(T - 10)
    seg[1, 12:] = 0  # padding at the end of row 1
    pos[1, 12:] = 0
    mask = (seg > 0).astype(np.float32)
    mask[-1, [3, 7]] = 0.0  # unscored targets inside a document
    out.append(
        {
            'inputs': inputs,
            'targets': targets,
            'positions': pos,
            'segment_ids': seg,
            'loss_mask': mask,
        }
    )
  return out


@pytest.mark.smoke
def test_bucket_losses_equal_naive_recomputation_from_logits():
  model, params = _model()
  edges = np.array([0, 3, 8, 16])
  (acc,) = evaluation.accumulate(
      evaluation.model_apply_fn(model), params, _batches(), edges
  )
  res = evaluation.summarize(acc).results
  sums, counts = np.zeros(3), np.zeros(3)
  pos_sum = np.zeros(T)
  apply = jax.jit(
      lambda p, x, pos, seg: model.apply({'params': p}, x, pos, segment_ids=seg)
  )
  for b in _batches():
    logits = np.asarray(
        apply(params, b['inputs'], b['positions'], b['segment_ids']), np.float64
    )
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, b['targets'][..., None], -1)[..., 0]
    for r in range(nll.shape[0]):
      for t in range(T):
        if b['loss_mask'][r, t] > 0:
          p = b['positions'][r, t]
          k = 0 if p < 3 else (1 if p < 8 else 2)
          sums[k] += nll[r, t]
          counts[k] += 1
          pos_sum[p] += nll[r, t]
  assert [x['tokens'] for x in res['buckets']] == counts.astype(int).tolist()
  np.testing.assert_allclose(
      [x['loss'] for x in res['buckets']], sums / counts, rtol=1e-5
  )
  np.testing.assert_allclose(acc.loss_sum, pos_sum, rtol=1e-5)
  assert res['overall']['tokens'] == int(counts.sum())
  np.testing.assert_allclose(
      res['overall']['loss'], sums.sum() / counts.sum(), rtol=1e-5
  )
  assert res['buckets'][0]['windows'] == 7  # padded rows are not windows
  assert res['overall']['windows'] == 7


def test_stderr_is_spread_of_window_means_over_sqrt_windows():
  edges = np.array([0, 4, 8])
  acc = buckets_lib.BucketAccumulator(edges)
  means = np.array([[1.0, 2.0], [1.5, 2.5], [0.5, 3.5], [2.0, 2.0]])
  acc.add(np.zeros(8), np.zeros(8), means * 4, np.full((4, 2), 4.0))
  loss, cov = inference.bucket_means(acc.per_window())[:2]
  np.testing.assert_allclose(loss, means.mean(0))
  np.testing.assert_allclose(np.sqrt(np.diag(cov)), means.std(0, ddof=1) / 2.0)
  rows = acc.buckets()
  np.testing.assert_allclose(rows[1]['stderr'], means[:, 1].std(ddof=1) / 2.0)
  lo, hi = rows[0]['ci95']
  # t, 3 df
  np.testing.assert_allclose(hi - lo, 2 * 3.182446305284263 * rows[0]['stderr'])
  # Last minus best uses the paired covariance: the per-window differences'
  # spread.
  d = inference.degradation(acc.per_window())
  diff = means[:, 1] - means[:, 0]
  np.testing.assert_allclose(d['last_minus_best'], diff.mean())
  np.testing.assert_allclose(
      d['last_minus_best_stderr'], diff.std(ddof=1) / 2.0
  )


def test_stderr_with_unequal_counts_is_the_ratio_estimator():
  acc = buckets_lib.BucketAccumulator(np.array([0, 8]))
  s = np.array([[3.0], [10.0], [1.0]])
  c = np.array([[2.0], [5.0], [1.0]])
  acc.add(np.zeros(8), np.zeros(8), s, c)
  # empty windows
  acc.add(np.zeros(8), np.zeros(8), np.zeros((2, 1)), np.zeros((2, 1)))
  loss, cov = inference.bucket_means(acc.per_window())[:2]
  ratio = s.sum() / c.sum()
  expect = 3 / 2 * np.sum((s - ratio * c) ** 2) / c.sum() ** 2
  np.testing.assert_allclose(loss[0], ratio)
  np.testing.assert_allclose(cov[0, 0], expect)
  assert acc.buckets()[0]['windows'] == 3


def test_degradation_slope_recovers_a_linear_trend():
  # 7 buckets of 10 over 70 positions (last ends at 70)
  edges = np.arange(0, 80, 10)
  acc = buckets_lib.BucketAccumulator(edges)
  mid = (edges[:-1] + edges[1:] - 1) / 2
  rng = np.random.default_rng(1)
  noise = rng.normal(0, 0.01, (50, 1))
  # common per-window shift: slope stays exact
  means = 2.0 + 0.003 * mid[None, :] + noise
  acc.add(np.zeros(70), np.zeros(70), means * 10, np.full(means.shape, 10.0))
  d = inference.degradation(acc.per_window())
  assert d['slope_buckets'] == [4, 5, 6]  # midpoints >= 35
  np.testing.assert_allclose(d['slope'], 0.003, rtol=1e-9)
  # a shift shared by all buckets does not blur the slope
  assert d['slope_stderr'] < 1e-9
  np.testing.assert_allclose(d['last_minus_best'], 0.003 * 60)
  assert d['best_bucket'] == 0


def test_make_edges_variants_and_errors():
  np.testing.assert_array_equal(buckets_lib.make_edges(40, 16), [0, 16, 32, 40])
  np.testing.assert_array_equal(
      buckets_lib.make_edges(12, 0, 'log2'), [0, 1, 2, 4, 8, 12]
  )
  np.testing.assert_array_equal(
      buckets_lib.make_edges(512, 0, '0,128,256'), [0, 128, 256, 512]
  )
  with pytest.raises(
      ValueError, match='exceeds the evaluation window length 128'
  ):
    buckets_lib.make_edges(128, 0, '0,64,256')
  with pytest.raises(ValueError, match='start at 0'):
    buckets_lib.make_edges(128, 0, '16,64')
  with pytest.raises(ValueError, match='increase strictly'):
    buckets_lib.make_edges(128, 0, '0,64,32')
  np.testing.assert_array_equal(
      buckets_lib.bucket_of_position(np.array([0, 2, 5])), [0, 0, 1, 1, 1]
  )


def test_offset_zero_equals_plain_and_offsets_shift_rows_only():
  model, params = _model(max_len=24)
  edges = np.array([0, 8, 16])
  fn = evaluation.model_apply_fn(model)
  (plain,) = evaluation.accumulate(fn, params, _batches(), edges)
  zero, four = evaluation.accumulate(
      fn, params, _batches(), edges, offsets=(0, 4)
  )
  np.testing.assert_array_equal(plain.loss_sum, zero.loss_sum)
  np.testing.assert_array_equal(
      plain.per_window()['win_sum'], zero.per_window()['win_sum']
  )
  # indexed by context, not by row
  np.testing.assert_array_equal(plain.count, four.count)
  assert not np.allclose(plain.loss_sum, four.loss_sum)


def test_evaluation_settings_are_checked_once_against_the_position_table():
  c = _synthetic_config(max_len=20, window_len=16)
  assert evaluation.eval_settings(c, {'offsets': [4, 0]})['offsets'] == [0, 4]
  with pytest.raises(ValueError, match='largest valid offset is 15'):
    evaluation.eval_settings(c, {'offsets': [0, 16]})
  with pytest.raises(ValueError, match='exceeds the model context'):
    evaluation.eval_settings(c, {'window_len': 32})
  with pytest.raises(ValueError, match='eval.min_start must be >= 0'):
    evaluation.eval_settings(c, {'min_start': -1})


def test_format_table_lists_every_bucket():
  acc = buckets_lib.BucketAccumulator(np.array([0, 4, 8]))
  acc.add(
      np.zeros(8),
      np.zeros(8),
      np.array([[4.0, 8.0], [6.0, 8.0]]),
      np.full((2, 2), 4.0),
  )
  text = eval_report.format_table(evaluation.summarize(acc).results)
  assert '[0, 4)' in text and '[4, 8)' in text and 'overall loss 1.6250' in text


def _synthetic_config(max_len=32, **eval_fields):
  """The typed config of a tiny synthetic run, ``eval_fields`` set."""
  c = defaults.base()
  c.model.update(
      vocab_size=64,
      num_layers=1,
      num_heads=2,
      emb_dim=16,
      mlp_dim=32,
      max_len=max_len,
  )
  c.data.seq_len = max_len
  c.data.synthetic.num_docs = 64
  c.eval.update(num_windows=6, batch_size=4, bucket_size=8, **eval_fields)
  return config_lib.RunConfig.from_config_dict(c)


def test_run_evaluation_offsets_zero_equals_plain_on_synthetic_windows():
  c = _synthetic_config()
  model = TransformerLM(c.model)
  x = jnp.zeros((1, 4), jnp.int32)
  params = model.init(jax.random.key(1), x, x)['params']
  out = evaluation.run_evaluation(model, params, c, step=7, offsets=[0])
  plain = out.results
  probe = plain['offset_probe']['by_offset'][0]
  assert plain['step'] == 7 and plain['settings']['window_len'] == 32
  assert [b['loss'] for b in probe['buckets']] == [
      b['loss'] for b in plain['buckets']
  ]
  assert [b['stderr'] for b in probe['buckets']] == [
      b['stderr'] for b in plain['buckets']
  ]
  assert all(
      b['tokens'] == 6 * 8 and b['windows'] == 6 for b in plain['buckets']
  )
  b = plain['buckets'][0]
  assert b['bayes_loss'] <= b['filter_loss']
  np.testing.assert_allclose(
      b['recovered'],
      (b['filter_loss'] - b['loss']) / (b['filter_loss'] - b['bayes_loss']),
  )
  # Offsets: a shorter window of the same texts, every K scored on identical
  # tokens.
  out = evaluation.run_evaluation(model, params, c, offsets=[0, 8])
  probe = out.results['offset_probe']
  assert (
      probe['window_len'] == 24
      and 'off the training distribution' in probe['note']
  )
  np.testing.assert_array_equal(
      out.per_position['offset_count'][0], out.per_position['offset_count'][1]
  )
  np.testing.assert_allclose(
      out.per_position['offset_loss'][0],
      out.per_position['loss'][:24],
      # causal: first 24 tokens score the same in longer
      # windows
      rtol=1e-5,
  )
  # K - 0 per bucket, paired over the same windows.
  (k8,) = probe['paired_vs_first']
  assert (k8['offset'], k8['minus_offset']) == (8, 0)
  for d, b8, b0 in zip(
      k8['buckets'],
      probe['by_offset'][1]['buckets'],
      probe['by_offset'][0]['buckets'],
  ):
    assert d['diff'] == pytest.approx(b8['loss'] - b0['loss'], abs=1e-9)
    assert d['stderr'] > 0 and d['ci95'][0] < d['diff'] < d['ci95'][1]


def test_run_evaluation_offset_leaving_no_window_is_a_clear_error():
  c = _synthetic_config()
  model = TransformerLM(c.model)
  x = jnp.zeros((1, 4), jnp.int32)
  params = model.init(jax.random.key(1), x, x)['params']
  with pytest.raises(ValueError, match='largest valid offset is 31'):
    evaluation.run_evaluation(model, params, c, offsets=[0, 32])


_SHARDED_SCRIPT = """
import json, sys
import jax
sys.path.insert(0, sys.argv[1])
import test_evaluation as te
from flax_posemb import evaluation
assert jax.device_count() == 4, jax.devices()
model, params = te._model()
(acc,) = evaluation.accumulate(
    evaluation.model_apply_fn(model), params, te._batches(), [0, 3, 8, 16])
print(json.dumps({'loss_sum': acc.loss_sum.tolist(), 'windows': acc.windows,
                  'win_sum': acc.per_window()['win_sum'].tolist()}))
"""


def test_sharded_over_four_devices_matches_one_device():
  import json
  import subprocess
  import sys

  here = os.path.dirname(os.path.abspath(__file__))
  env = dict(
      os.environ,
      JAX_PLATFORMS='cpu',
      XLA_FLAGS='--xla_force_host_platform_device_count=4',
  )
  proc = subprocess.run(
      [sys.executable, '-c', _SHARDED_SCRIPT, here],
      capture_output=True,
      text=True,
      env=env,
      timeout=300,
      cwd=os.path.dirname(here),
  )
  assert proc.returncode == 0, proc.stderr[-2000:]
  got = json.loads(proc.stdout.strip().splitlines()[-1])
  model, params = _model()
  (acc,) = evaluation.accumulate(
      evaluation.model_apply_fn(model),
      params,
      _batches(),
      np.array([0, 3, 8, 16]),
  )
  # 5- and 2-row batches padded to 8 rows
  assert got['windows'] == acc.windows == 7
  np.testing.assert_allclose(got['loss_sum'], acc.loss_sum, rtol=1e-5)
  np.testing.assert_allclose(
      got['win_sum'], acc.per_window()['win_sum'], rtol=1e-5
  )


@pytest.mark.parametrize(
    'where,value,match',
    [
        (
            'scored',
            -1,
            'Position id -1 is negative',
        ),  # not booked at position 0
        # past the table, masked
        ('unscored', 40, r'40 is outside the position table \[0, 16\)'),
    ],
)
def test_every_position_id_the_model_sees_is_checked_on_the_host(
    where, value, match
):
  model, params = _model()
  batch = _batches()[1]
  if where == 'scored':
    batch['positions'][0, 2] = value
  else:
    batch['positions'][1, 14] = value  # padding, loss_mask 0
    assert batch['loss_mask'][1, 14] == 0
  with pytest.raises(ValueError, match=match):
    evaluation.accumulate(
        evaluation.model_apply_fn(model), params, [batch], np.array([0, 8, 16])
    )


def _accumulate_windows(shift=0.0, seed=0, n=40, nb=3):
  """Synthetic per-window sums: a common per-window difficulty plus run-specific
  noise."""
  rng = np.random.default_rng(seed)
  edges = np.array([0, 4, 8, 12])
  acc = buckets_lib.BucketAccumulator(edges)
  difficulty = np.random.default_rng(99).normal(0, 1.0, (n, 1))
  counts = np.full((n, nb), 4.0)
  means = 2.0 + difficulty + shift + rng.normal(0, 0.05, (n, nb))
  acc.add(
      np.zeros(12),
      np.zeros(12),
      means * counts,
      counts,
      np.arange(n, dtype=np.uint64) + 1000,
  )
  return acc


def test_per_window_sums_give_exactly_the_bucket_means():
  acc = _accumulate_windows()
  w = acc.per_window()
  means = w['win_sum'].sum(0) / w['win_count'].sum(0)
  np.testing.assert_allclose(
      means, [b['loss'] for b in acc.buckets()], rtol=1e-12
  )


@pytest.mark.smoke
def test_a_minus_a_is_zero_with_zero_stderr_and_pairing_narrows_the_interval():
  a, b = _accumulate_windows(), _accumulate_windows(shift=0.1, seed=1)
  same = inference.paired_difference(a.per_window(), a.per_window())
  assert all(r['diff'] == 0.0 and r['stderr'] == 0.0 for r in same)
  diff = inference.paired_difference(b.per_window(), a.per_window())
  for r in diff:
    assert r['diff'] == pytest.approx(0.1, abs=0.05)
    # the shared difficulty cancels
    assert r['stderr'] < r['unpaired_stderr'] / 5
    assert r['ci95'][0] < r['diff'] < r['ci95'][1]
  # Window order does not matter: pairing is by window identity.
  pw = a.per_window()
  rev = {k: v[::-1] if k != 'edges' else v for k, v in pw.items()}
  assert (
      inference.paired_difference(b.per_window(), rev)[0]['diff']
      == diff[0]['diff']
  )


def test_overall_paired_difference_is_the_difference_of_the_overall_losses():
  a, b = _accumulate_windows(), _accumulate_windows(shift=0.1, seed=1)
  wa, wb = a.per_window(), b.per_window()
  row = inference.overall_paired_difference(wb, wa, ('b', 'a'))
  want = buckets_lib.overall(wb)['loss'] - buckets_lib.overall(wa)['loss']
  assert row['diff'] == pytest.approx(want, rel=1e-12)
  assert row['windows'] == 40 and row['documents'] == 40
  # The shared difficulty cancels: paired far tighter than unpaired.
  assert row['stderr'] < row['unpaired_stderr'] / 5
  same = inference.overall_paired_difference(wa, wa)
  assert same['diff'] == 0.0 and same['stderr'] == 0.0


def test_paired_difference_refuses_runs_on_different_windows():
  a = _accumulate_windows()
  w = a.per_window()
  other = dict(w, window_id=w['window_id'] + 1)
  with pytest.raises(ValueError, match='different windows'):
    inference.paired_difference(w, other, ('a', 'b'))


def test_window_ids_depend_on_text_positions_and_scoring():
  x = np.arange(8, dtype=np.int32).reshape(2, 4)
  pos = np.tile(np.arange(4, dtype=np.int32), (2, 1))
  mask = np.ones((2, 4), np.float32)
  ids = buckets_lib.window_ids(x, pos, mask)
  assert ids[0] != ids[1]
  assert buckets_lib.window_ids(x, pos + 1, mask)[0] != ids[0]
  assert (buckets_lib.window_ids(x, pos, mask) == ids).all()


def test_identical_texts_are_distinct_windows_and_still_pair_up():
  seen = {}
  ids = buckets_lib.unique_window_ids(np.array([7, 7, 9], np.uint64), seen)
  assert len(set(ids.tolist())) == 3 and ids[0] == 7 and ids[2] == 9
  again = buckets_lib.unique_window_ids(np.array([7, 7, 9], np.uint64), {})
  # the same evaluation gives the same ids
  np.testing.assert_array_equal(ids, again)
  model, params = _model()
  batch = _batches()[1]
  # every window twice
  batch = {k: np.concatenate([v, v]) for k, v in batch.items()}
  acc, k8 = evaluation.accumulate(
      evaluation.model_apply_fn(model),
      params,
      [batch],
      np.array([0, 8, 16]),
      offsets=(0, 0),
  )
  diff = inference.paired_difference(k8.per_window(), acc.per_window())
  assert all(d['diff'] == 0.0 for d in diff)


def _windows_of_documents(means, doc=None):
  """Accumulator of windows with per-bucket means [W, 2] (4 tokens each), in
  documents `doc`."""
  acc = buckets_lib.BucketAccumulator(np.array([0, 4, 8]))
  counts = np.full(means.shape, 4.0)
  prov = None if doc is None else {'doc': np.asarray(doc)}
  acc.add(np.zeros(8), np.zeros(8), means * counts, counts, provenance=prov)
  return acc


def test_clustered_stderr_is_the_window_stderr_for_one_window_per_doc():
  means = np.random.default_rng(3).normal(2.0, 1.0, (12, 2))
  own, none = _windows_of_documents(
      means, np.arange(12) * 7
  ), _windows_of_documents(means)
  a, b = own.per_window(), none.per_window()
  assert own.buckets() == none.buckets() and buckets_lib.overall(
      a
  ) == buckets_lib.overall(b)
  assert inference.degradation(a) == inference.degradation(b)
  assert own.buckets()[0]['documents'] == own.buckets()[0]['windows'] == 12
  np.testing.assert_allclose(
      own.buckets()[1]['stderr'], means[:, 1].std(ddof=1) / np.sqrt(12)
  )


@pytest.mark.smoke
def test_clustered_stderr_is_larger_when_windows_of_one_document_agree():
  # 20 windows in 4 documents, identical within each
  doc = np.repeat(np.arange(4), 5)
  per_doc = np.random.default_rng(4).normal(2.0, 1.0, (4, 2))
  clustered, naive = _windows_of_documents(
      per_doc[doc], doc
  ), _windows_of_documents(per_doc[doc])
  row, naive_row = clustered.buckets()[0], naive.buckets()[0]
  # 4 clusters
  np.testing.assert_allclose(row['stderr'], per_doc[:, 0].std(ddof=1) / 2.0)
  np.testing.assert_allclose(
      naive_row['stderr'], per_doc[doc, 0].std(ddof=1) / np.sqrt(20)
  )
  assert row['stderr'] > 1.5 * naive_row['stderr']
  whole = buckets_lib.overall(clustered.per_window())
  naive_whole = buckets_lib.overall(naive.per_window())
  assert (row['windows'], row['documents'], whole['documents']) == (20, 4, 4)
  lo, hi = row['ci95']
  np.testing.assert_allclose(
      hi - lo, 2 * scipy.stats.t.ppf(0.975, 3) * row['stderr']
  )
  assert whole['stderr'] > 1.5 * naive_whole['stderr']


def test_paired_difference_clusters_by_document():
  doc = np.repeat(np.arange(5), 4)  # 20 windows in 5 documents
  rng = np.random.default_rng(5)
  means = rng.normal(2.0, 1.0, (20, 2))
  effect = rng.normal(0.1, 0.05, 5)  # A - B differs by document, not by window
  a = _windows_of_documents(means + effect[doc, None], doc).per_window()
  b = _windows_of_documents(means, doc).per_window()
  rows = inference.paired_difference(a, b)
  unclustered = inference.paired_difference(
      *({k: v for k, v in w.items() if k != 'doc'} for w in (a, b))
  )
  for r, u in zip(rows, unclustered):
    assert (r['windows'], r['documents'], u['documents']) == (20, 5, 20)
    np.testing.assert_allclose(r['diff'], effect.mean())
    np.testing.assert_allclose(r['stderr'], effect.std(ddof=1) / np.sqrt(5))
    np.testing.assert_allclose(
        u['stderr'], effect[doc].std(ddof=1) / np.sqrt(20)
    )
    np.testing.assert_allclose(
        r['ci95'][1] - r['diff'], scipy.stats.t.ppf(0.975, 4) * r['stderr']
    )


def test_window_groups_split_buckets_by_kind_depth_and_distance_to_end():
  # windows of 11 tokens; depth bins [0, 10), [10, 20), [20, 40), ..., >= 1280
  t = 10
  start = np.array([0, 15, 16, 25, 2000, 2500])
  # after the window: 0, 14, 13, 1964, 0, 489
  doc_len = np.array([11, 40, 40, 2000, 2011, 3000])
  acc = _windows_of_documents(np.arange(12.0).reshape(6, 2), [0, 1, 1, 2, 3, 4])
  pw = dict(
      acc.per_window(),
      start=start,
      doc_len=doc_len,
      kind=np.array(['code', 'bible', 'bible', 'code', 'bible', 'bible']),
  )
  tables = buckets_lib.provenance_tables(pw, t)
  s = tables['windows']
  assert (s['windows'], s['documents'], s['first_window_overlaps']) == (6, 5, 1)
  assert s['kinds'] == {
      'bible': {'windows': 4, 'documents': 3},
      'code': {'windows': 2, 'documents': 2},
  }
  assert (s['start']['min'], s['start']['max'], s['to_end']['min']) == (
      0,
      2500,
      0,
  )
  # documents of >= 40 tokens
  assert s['long_doc_share'] == pytest.approx(5 / 6)
  depth = {
      g['group']: (g['windows'], g['documents']) for g in tables['by_depth']
  }
  assert depth == {
      '[0, 10)': (1, 1),
      '[10, 20)': (2, 1),
      '[20, 40)': (1, 1),
      '>= 1280': (2, 2),
  }
  end = {g['group']: g for g in tables['by_end']}
  assert {k: g['windows'] for k, g in end.items()} == {
      '[0, 10)': 2,
      '[10, 40)': 2,
      '>= 320': 2,
  }
  near = end['[0, 10)']  # windows 0 and 4, bucket means (0, 1) and (8, 9)
  assert (
      near['buckets'][1]['loss'] == pytest.approx(5.0)
      and near['documents'] == 2
  )
  bible = next(g for g in tables['by_kind'] if g['group'] == 'bible')
  assert bible['buckets'][0]['loss'] == pytest.approx(np.mean([2, 4, 8, 10]))


def test_the_evaluation_library_imports_no_runner_module():
  import subprocess
  import sys

  code = (
      'import sys, flax_posemb.evaluation; print(sorted(m for m in sys.modules'
      ' if m in {"flax_posemb.eval_workdir", "flax_posemb.eval_report",'
      ' "flax_posemb.checkpointing", "flax_posemb.workdir", "matplotlib"}))'
  )
  proc = subprocess.run(
      [sys.executable, '-c', code],
      capture_output=True,
      text=True,
      env=dict(os.environ, JAX_PLATFORMS='cpu'),
      timeout=120,
  )
  assert proc.returncode == 0 and proc.stdout.strip() == '[]', (
      proc.stdout + proc.stderr[-2000:]
  )


def _bucket(start, end, loss, stderr, **extra):
  return dict(start=start, end=end, tokens=8, loss=loss, stderr=stderr, **extra)


def _printed_results(num_groups):
  spans = [(0, 4), (4, 8)]
  synthetic = dict(
      bayes_loss=1.0, filter_loss=2.0, excess_loss=0.5, recovered=0.5
  )
  groups = [
      {
          'group': f'[{2**i * 1024}, {2**(i + 1) * 1024})',
          'windows': 100 + i,
          'documents': 1 if i == 0 else 20,
          # One document: no clustered standard error.
          'buckets': [
              _bucket(a, b, 1.5, None if i == 0 else 0.1) for a, b in spans
          ],
      }
      for i in range(num_groups)
  ]
  return {
      'buckets': [_bucket(a, b, 1.5, 0.1, **synthetic) for a, b in spans],
      'overall': dict(loss=1.5, stderr=0.1, tokens=16, windows=2, documents=2),
      'degradation': dict(
          last_minus_best=0.0,
          last_minus_best_stderr=0.1,
          slope=0.0,
          slope_stderr=0.0,
      ),
      'windows': dict(
          window_len=8,
          long_doc_share=1.0,
          windows=2,
          documents=2,
          first_window_overlaps=0,
          kinds={},
          start={},
          to_end={},
      ),
      'by_kind': [],
      'by_depth': groups,
      'by_end': [],
  }


def test_printed_tables_fit_100_columns_and_split_wide_group_tables():
  text = eval_report.format_results(_printed_results(num_groups=8))
  assert max(len(line) for line in text.splitlines()) <= 100
  # Eight groups do not fit one block of 100 columns: two blocks, every group.
  assert text.count('by_depth') == 2
  for i in range(8):
    assert f'[{2**i * 1024}, {2**(i + 1) * 1024})' in text
    assert f'{100 + i}w/' in text


def test_a_one_document_group_shows_n_a_not_a_dangling_sign():
  text = eval_report.format_results(_printed_results(num_groups=2))
  assert '1.5000+-n/a' in text and '+--' not in text
  assert 'n/a: one document, no clustered standard error' in text


def test_the_synthetic_columns_are_named_and_explained():
  text = eval_report.format_table(_printed_results(num_groups=0))
  header = text.splitlines()[0].split()
  assert header[-4:] == ['bayes', 'filter', 'excess', 'recovered']
  assert 'bayes: the Bayes-optimal loss' in text
  assert 'recovered = (filter - loss) / (filter - bayes)' in text
