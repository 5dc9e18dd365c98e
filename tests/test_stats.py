"""Per-position statistics (flax_posemb.stats) against independent
computations."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_posemb import segments
from flax_posemb import stats
from flax_posemb import stats_window

B, T, D, V, L = 3, 8, 5, 7, 12  # batch, length, width, vocab, table rows


class StandIn(nn.Module):
  """Tiny causal model (not a TransformerLM) taking embed_delta;
  segment-restricted mixing."""

  @nn.compact
  def __call__(self, inputs, positions, segment_ids, embed_delta=None):
    x = nn.Embed(V, D, name='token_embed')(inputs)
    x = x + nn.Embed(L, D, name='pos_embed')(positions)
    if embed_delta is not None:
      x = x + embed_delta
    causal = jnp.tril(jnp.ones((T, T), bool))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    mix = (causal[None] & same).astype(jnp.float32)
    h = jnp.tanh(jnp.einsum('bts,bsd->btd', mix, x) + nn.Dense(D)(x))
    return nn.Dense(V)(h)


def make_batch(seed=0):
  rng = np.random.default_rng(seed)
  inputs = rng.integers(0, V, (B, T)).astype(np.int32)
  targets = rng.integers(0, V, (B, T)).astype(np.int32)
  # Row 0: one document + padding; row 1: two packed documents; row 2: random
  # offset.
  seg = np.array([[1] * 5 + [0] * 3, [1] * 3 + [2] * 5, [1] * 8], np.int32)
  pos = np.array(
      [list(range(5)) + [0] * 3, [0, 1, 2, 0, 1, 2, 3, 4], list(range(3, 11))],
      np.int32,
  )
  mask = (seg > 0).astype(np.float32)
  mask[1, 2] = 0.0  # last token of a document has no target
  mask[2, 5] = 0.0
  return dict(
      inputs=inputs,
      targets=targets,
      positions=pos,
      segment_ids=seg,
      loss_mask=mask,
  )


def brute_force_context(segment_row, t):
  """Tokens before column ``t`` of the row that column ``t`` attends to: the
  same segment, no break in between."""
  context = 0
  while t - context > 0 and segment_row[t - context - 1] == segment_row[t]:
    context += 1
  return context


def token_losses(logits, targets):
  return -jnp.take_along_axis(
      jax.nn.log_softmax(logits), targets[..., None], -1
  )[..., 0]


def test_downstream_counts_later_scored_targets_in_segment():
  batch = make_batch()
  got = np.asarray(
      segments.downstream_targets(batch['segment_ids'], batch['loss_mask'])
  )
  want = np.zeros((B, T))
  for b in range(B):
    for t in range(T):
      same = batch['segment_ids'][b] == batch['segment_ids'][b, t]
      want[b, t] = np.sum(batch['loss_mask'][b, t:] * same[t:])
  np.testing.assert_array_equal(got, want)


@pytest.fixture(scope='module')
def setup():
  batch = make_batch()
  model = StandIn()
  params = model.init(
      jax.random.key(0),
      batch['inputs'],
      batch['positions'],
      batch['segment_ids'],
  )['params']
  return model, params, batch


def per_example_oracle(sum_loss, params, batch):
  """Window fields from per-example gradients (vmap of grad), one example at a
  time.

  Args:
    sum_loss: ``(params, delta [b, T, D], batch) -> (sum-reduced loss, token
        losses)``.
  """

  def one(x):
    xb = jax.tree.map(lambda a: a[None], x)
    return jax.grad(lambda d: sum_loss(params, d, xb)[0])(jnp.zeros((1, T, D)))[
        0
    ]

  g = np.asarray(jax.vmap(one)(batch), np.float64)  # [B, T, D]
  tl = np.asarray(sum_loss(params, jnp.zeros((B, T, D)), batch)[1], np.float64)
  want = {k: np.zeros(L) for k in stats.FIELDS if k != 'update_sq'}
  want['context_count'] = np.zeros((L, segments.context_buckets(L)))
  gsum = np.zeros((L, D))
  for b in range(B):
    for t in range(T):
      p = batch['positions'][b, t]
      if batch['segment_ids'][b, t] > 0:
        n = np.linalg.norm(g[b, t])
        want['count'][p] += 1
        context = brute_force_context(batch['segment_ids'][b], t)
        want['full_context_count'][p] += context == p
        want['context_count'][p, int(context).bit_length()] += 1
        want['occ_norm'][p] += n
        want['occ_sq'][p] += n * n
        same = batch['segment_ids'][b] == batch['segment_ids'][b, t]
        want['downstream'][p] += np.sum(batch['loss_mask'][b, t:] * same[t:])
        gsum[p] += g[b, t]
      if batch['loss_mask'][b, t] > 0:
        want['loss_count'][p] += 1
        want['loss_sum'][p] += tl[b, t]
  want['row_sq'] = np.sum(gsum**2, -1)
  return want


def assert_stats_match(got, want):
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(
        np.asarray(got[k], np.float64), want[k], rtol=1e-5, atol=1e-7, err_msg=k
    )


@pytest.mark.smoke
def test_any_model_stats_match_per_example_gradients_linen(setup):
  model, params, batch = setup

  def token_loss_fn(p, embed_delta, b):
    logits = model.apply(
        {'params': p},
        b['inputs'],
        b['positions'],
        b['segment_ids'],
        embed_delta=embed_delta,
    )
    return token_losses(logits, b['targets'])

  f = jax.jit(stats.value_and_grad_with_position_stats(token_loss_fn, L, D))
  loss, grads, got = f(params, batch)

  def sum_loss(p, d, b):
    tl = token_loss_fn(p, d, b)
    return jnp.sum(tl * b['loss_mask']), tl

  assert_stats_match(got, per_example_oracle(sum_loss, params, batch))
  n = batch['loss_mask'].sum()
  np.testing.assert_allclose(
      float(loss), float(sum_loss(params, None, batch)[0]) / n, rtol=1e-6
  )
  # grads are of the mean loss; row_sq is the squared table-gradient row of the
  # sum loss.
  want_grads = jax.grad(lambda p: sum_loss(p, None, batch)[0] / n)(params)
  for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(
        np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-8
    )
  table_grad = np.asarray(grads['pos_embed']['embedding'], np.float64) * float(
      n
  )
  np.testing.assert_allclose(
      np.asarray(got['row_sq']), np.sum(table_grad**2, -1), rtol=1e-4, atol=1e-9
  )
  assert got['count'].dtype == jnp.int32 and 'update_sq' not in got


def test_any_model_stats_match_per_example_gradients_nnx():
  from flax import nnx

  class NNXStandIn(nnx.Module):

    def __init__(self, rngs):
      self.tok = nnx.Embed(V, D, rngs=rngs)
      self.pos = nnx.Embed(L, D, rngs=rngs)
      self.out = nnx.Linear(D, V, rngs=rngs)

    def __call__(self, b, embed_delta):
      x = self.tok(b['inputs']) + self.pos(b['positions']) + embed_delta
      same = b['segment_ids'][:, :, None] == b['segment_ids'][:, None, :]
      mix = (jnp.tril(jnp.ones((T, T), bool))[None] & same).astype(jnp.float32)
      return self.out(jnp.tanh(jnp.einsum('bts,bsd->btd', mix, x)))

  batch = make_batch(1)
  graphdef, state = nnx.split(NNXStandIn(nnx.Rngs(0)))

  def token_loss_fn(st, embed_delta, b):
    return token_losses(nnx.merge(graphdef, st)(b, embed_delta), b['targets'])

  loss, grads, got = jax.jit(
      stats.value_and_grad_with_position_stats(token_loss_fn, L, D)
  )(state, batch)

  def sum_loss(st, d, b):
    tl = token_loss_fn(st, d, b)
    return jnp.sum(tl * b['loss_mask']), tl

  assert_stats_match(got, per_example_oracle(sum_loss, state, batch))
  assert jax.tree.structure(grads) == jax.tree.structure(state)


def test_stats_off_keeps_loss_fields_and_identical_loss_and_grads(setup):
  model, params, batch = setup

  def token_loss_fn(p, embed_delta, b):
    return token_losses(
        model.apply(
            {'params': p},
            b['inputs'],
            b['positions'],
            b['segment_ids'],
            embed_delta=embed_delta,
        ),
        b['targets'],
    )

  on = jax.jit(stats.value_and_grad_with_position_stats(token_loss_fn, L, D))(
      params, batch
  )
  off = jax.jit(
      stats.value_and_grad_with_position_stats(
          token_loss_fn, L, D, collect=False
      )
  )(params, batch)
  assert list(off[2]) == list(stats.LOSS_FIELDS)
  assert float(on[0]) == float(off[0])
  for x, y in zip(jax.tree.leaves(on[1]), jax.tree.leaves(off[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for k in stats.LOSS_FIELDS:
    np.testing.assert_array_equal(np.asarray(on[2][k]), np.asarray(off[2][k]))


def test_absent_positions_get_exactly_zero_gradient(setup):
  model, params, batch = setup

  def loss(params):
    logits = model.apply(
        {'params': params},
        batch['inputs'],
        batch['positions'],
        batch['segment_ids'],
    )
    return jnp.sum(token_losses(logits, batch['targets']) * batch['loss_mask'])

  grad = np.asarray(jax.grad(loss)(params)['pos_embed']['embedding'])
  present = np.zeros(L, bool)
  present[batch['positions'][batch['segment_ids'] > 0]] = True
  assert not present[11] and present[10]
  assert np.all(grad[~present] == 0.0)
  assert np.all(np.abs(grad[present]).sum(-1) > 0)


def _standin_token_loss_fn(model):
  def token_loss_fn(p, embed_delta, b):
    logits = model.apply(
        {'params': p},
        b['inputs'],
        b['positions'],
        b['segment_ids'],
        embed_delta=embed_delta,
    )
    return token_losses(logits, b['targets'])

  return token_loss_fn


@pytest.mark.parametrize('bad', [L, -1])
def test_out_of_range_id_of_a_real_token_is_refused_eagerly(setup, bad):
  model, params, batch = setup
  batch = dict(batch, positions=batch['positions'].copy())
  batch['positions'][2, 7] = bad  # a real token (segment 1 of row 2)
  f = stats.value_and_grad_with_position_stats(
      _standin_token_loss_fn(model), L, D
  )
  with pytest.raises(ValueError, match=f'Position id {bad} is'):
    f(params, batch)


def test_position_refusals_speak_the_librarys_arguments(setup):
  model, params, batch = setup
  f = stats.value_and_grad_with_position_stats(
      _standin_token_loss_fn(model), L, D
  )
  for bad, fix in (
      (L, f'pass num_positions >= {L + 1}'),
      (-1, 'segment_ids 0'),
  ):
    bad_batch = dict(batch, positions=batch['positions'].copy())
    bad_batch['positions'][2, 7] = bad
    with pytest.raises(ValueError) as refused:
      f(params, bad_batch)
    assert fix in str(refused.value)
    for cli_word in ('model.max_len', 'data.seq_len', 'train.py', '--config'):
      assert cli_word not in str(refused.value)


@pytest.mark.smoke
def test_out_of_range_id_of_a_real_token_is_refused_under_jit(setup):
  model, params, batch = setup
  batch = dict(batch, positions=batch['positions'].copy())
  batch['positions'][1, 4] = L
  f = jax.jit(
      stats.value_and_grad_with_position_stats(
          _standin_token_loss_fn(model), L, D
      )
  )
  with pytest.raises(jax.errors.JaxRuntimeError, match=f'Position id {L} is'):
    jax.block_until_ready(f(params, batch))


def test_position_check_off_leaves_the_id_out_of_every_statistic(setup):
  """check_positions=False is for batches checked already: an unchecked bad
  id is then missing from the statistics while the loss counts it."""
  model, params, batch = setup
  batch = dict(batch, positions=batch['positions'].copy())
  batch['positions'][2, 7] = L
  f = stats.value_and_grad_with_position_stats(
      _standin_token_loss_fn(model), L, D, check_positions=False
  )
  got = f(params, batch)[2]
  real = int((batch['segment_ids'] > 0).sum())
  assert int(got['count'].sum()) == real - 1


@pytest.mark.smoke
def test_loss_fn_that_ignores_embed_delta_is_refused(setup):
  model, params, batch = setup

  def token_loss_fn(p, embed_delta, b):
    del embed_delta
    logits = model.apply(
        {'params': p}, b['inputs'], b['positions'], b['segment_ids']
    )
    return token_losses(logits, b['targets'])

  f = stats.value_and_grad_with_position_stats(token_loss_fn, L, D)
  with pytest.raises(ValueError, match='add it to the token\\+position'):
    jax.jit(f)(params, batch)
  # Loss fields alone need no embed_delta.
  off = stats.value_and_grad_with_position_stats(
      token_loss_fn, L, D, collect=False
  )
  assert np.isfinite(float(jax.jit(off)(params, batch)[0]))


def _delta_reaching(model, reach):
  """A token loss function whose embed_delta goes through ``reach(delta, b)``
  before the model adds it."""

  def token_loss_fn(p, embed_delta, b):
    logits = model.apply(
        {'params': p},
        b['inputs'],
        b['positions'],
        b['segment_ids'],
        embed_delta=reach(embed_delta, b),
    )
    return token_losses(logits, b['targets'])

  return token_loss_fn


def test_a_delta_behind_stop_gradient_is_refused_when_traced(setup):
  model, params, batch = setup
  f = stats.value_and_grad_with_position_stats(
      _delta_reaching(model, lambda d, b: jax.lax.stop_gradient(d)), L, D
  )
  with pytest.raises(ValueError, match='stop_gradient.*add it to the token'):
    jax.jit(f)(params, batch)


# A delta that reaches the loss in the jaxpr, with a gradient that is 0.
ZERO_GRADIENT_DELTAS = {
    'zero_factor': lambda d, b: 0.0 * d,
    'dead_branch': lambda d, b: jnp.where(
        (b['positions'] < 0)[..., None], d, jnp.zeros_like(d)
    ),
}


@pytest.mark.parametrize('name', list(ZERO_GRADIENT_DELTAS))
def test_a_delta_with_zero_gradient_is_refused_when_the_step_runs(setup, name):
  model, params, batch = setup
  reach = ZERO_GRADIENT_DELTAS[name]
  f = stats.value_and_grad_with_position_stats(
      _delta_reaching(model, reach), L, D
  )
  with pytest.raises(ValueError, match='exactly 0 at every token.*19 scored'):
    f(params, batch)
  with pytest.raises(jax.errors.JaxRuntimeError, match='exactly 0 at every'):
    jax.block_until_ready(jax.jit(f)(params, batch))
  # No scored target: nothing to measure, nothing refused.
  unscored = dict(batch, loss_mask=np.zeros_like(batch['loss_mask']))
  jax.block_until_ready(jax.jit(f)(params, unscored))
  off = stats.value_and_grad_with_position_stats(
      _delta_reaching(model, reach), L, D, check_signal=False
  )
  jax.block_until_ready(jax.jit(off)(params, batch))


def packed_reset_batch():
  """Two rows as `packed_reset` cuts a stream of documents: a row starts
  mid-document (its position ids continue the document's, its context starts
  at 0), a new segment starts where a document does (position id 0)."""
  # The in-document position of each pair, as the packer reads them.
  doc_positions = np.array(
      [[5, 6, 7, 0, 1, 2, 3, 0, 1, 2], [3, 4, 0, 1, 2, 3, 4, 5, 6, 7]]
  )
  starts = doc_positions == 0
  starts[:, 0] = True
  segment_ids = np.cumsum(starts, axis=1).astype(np.int32)
  return dict(
      positions=doc_positions.astype(np.int32),
      segment_ids=segment_ids,
      loss_mask=np.ones(doc_positions.shape, np.float32),
  )


def test_full_context_count_is_the_brute_force_count_of_a_packed_reset_batch():
  batch = packed_reset_batch()
  got = stats.loss_stats(jnp.zeros((2, 10)), batch, 12)
  want_full = np.zeros(12, np.int64)
  want_by_context = np.zeros((12, segments.context_buckets(12)), np.int64)
  for b in range(2):
    for t in range(10):
      p = batch['positions'][b, t]
      context = brute_force_context(batch['segment_ids'][b], t)
      want_full[p] += context == p
      want_by_context[p, int(context).bit_length()] += 1
  np.testing.assert_array_equal(got['full_context_count'], want_full)
  np.testing.assert_array_equal(got['context_count'], want_by_context)
  # The rows' first segments start mid-document: positions 5-7 and 3-4 are
  # never seen at full context; the documents starting in the rows are.
  assert int(got['full_context_count'].sum()) == 15 < int(got['count'].sum())
  np.testing.assert_array_equal(got['context_count'].sum(-1), got['count'])


def test_every_occurrence_of_a_natural_batch_is_full_context():
  # natural: one document a row from position 0, padded.
  segment_ids = np.array([[1] * 6 + [0] * 2, [1] * 8], np.int32)
  positions = np.where(segment_ids > 0, np.arange(8), 0).astype(np.int32)
  batch = dict(
      positions=positions,
      segment_ids=segment_ids,
      loss_mask=(segment_ids > 0).astype(np.float32),
  )
  got = stats.loss_stats(jnp.zeros((2, 8)), batch, 8)
  np.testing.assert_array_equal(got['full_context_count'], got['count'])
  assert int(got['count'].sum()) == 14


def test_exposure_summary_states_both_dimensions():
  window = {
      'count': np.array([4, 4, 2]),
      'full_context_count': np.array([4, 1, 0]),
      # contexts 0 | 1 | 2-3 (three buckets for 3 rows)
      'context_count': np.array([[4, 0, 0], [3, 1, 0], [1, 0, 1]]),
  }
  got = stats_window.exposure_summary(window)
  assert (got['tokens'], got['full_context_tokens']) == (10.0, 5.0)
  assert got['full_context_share'] == 0.5
  assert (got['min_row_full_context'], got['max_row_full_context']) == (0, 4)
  assert (got['last_row_full_context'], got['last_row_tokens']) == (0, 2)
  assert got['context_bucket_edges'] == [0, 1, 2, 4]
  assert got['context_bucket_share'] == [0.8, 0.1, 0.1]
  # Window files written before the context fields: rows only.
  assert set(stats_window.exposure_summary({'count': window['count']})) == {
      'tokens',
      'min_row_tokens',
      'max_row_tokens',
  }


def test_a_new_statistics_object_refuses_a_directory_of_another_runs_windows(
    tmp_path,
):
  first = stats.PositionStatistics(4, 2, log_every=2, directory=str(tmp_path))
  window = first.init()
  for i in range(1, 5):
    window = first.on_step(i, first.inside_step(window, _fake_step(i)))
  saved = first.state(window)
  before = (tmp_path / 'window_2.npz').read_bytes()
  second = stats.PositionStatistics(4, 2, log_every=2, directory=str(tmp_path))
  window = second.inside_step(second.init(), _fake_step(9))
  second.on_step(1, window)  # not a window end: nothing written yet
  with pytest.raises(ValueError) as refused:
    second.on_step(2, window)
  message = str(refused.value)
  assert str(tmp_path) in message and 'window_2.npz, window_4.npz' in message
  assert 'Pass a fresh directory=' in message
  assert (tmp_path / 'window_2.npz').read_bytes() == before
  # Restored from the first run's state, it continues that run there.
  third = stats.PositionStatistics(4, 2, log_every=2, directory=str(tmp_path))
  window = third.restore(saved)
  third.on_step(6, third.inside_step(window, _fake_step(5)))
  assert sorted(os.listdir(tmp_path)) == [
      'window_2.npz',
      'window_4.npz',
      'window_6.npz',
  ]


def test_microbatch_sums_square_after_summing():
  g = jnp.ones((2, 1, 3))
  b = dict(
      positions=jnp.zeros((2, 1), jnp.int32),
      segment_ids=jnp.ones((2, 1), jnp.int32),
      loss_mask=jnp.ones((2, 1)),
  )
  whole = stats.occurrence_stats(g, jnp.zeros((2, 1)), b, 2).finish()
  halves = [
      stats.occurrence_stats(
          g[i : i + 1],
          jnp.zeros((1, 1)),
          {k: v[i : i + 1] for k, v in b.items()},
          2,
      )
      for i in range(2)
  ]
  split = (halves[0] + halves[1]).finish()
  assert float(whole['row_sq'][0]) == float(split['row_sq'][0]) == 12.0
  assert float(split['occ_sq'][0]) == 6.0 and split.row_grad is None


def test_adding_statistics_with_different_fields_is_an_error():
  with pytest.raises((TypeError, ValueError)):
    stats.PositionStats.zeros(3) + stats.PositionStats.zeros(3, collect=False)


def test_update_sq_and_derived_ratios():
  old = jnp.zeros((3, 2))
  new = jnp.array([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])
  np.testing.assert_array_equal(stats.update_sq(old, new), [25.0, 0.0, 1.0])
  s = {k: np.zeros(2) for k in stats.FIELDS}
  s.update(
      count=np.array([2, 0]),
      occ_sq=np.array([2.0, 0]),
      row_sq=np.array([4.0, 0]),
      occ_norm=np.array([2.0, 0]),
      downstream=np.array([8.0, 0]),
  )
  d = stats.derived(s)
  assert d['coherence'][0] == 1.0 and np.isnan(d['coherence'][1])
  assert (
      d['signal_per_occurrence'][0] == 1.0
      and d['signal_per_downstream'][0] == 0.25
  )
  # statistics off: NaN ratios
  off = stats.derived({k: s[k] for k in stats.LOSS_FIELDS})
  assert np.all(np.isnan(off['coherence'])) and np.isnan(off['mean_loss'][0])


def test_position_stats_is_a_mapping_of_present_fields_and_a_pytree():
  s = stats.PositionStats.zeros(4, collect=False)
  assert dict(s).keys() == set(stats.LOSS_FIELDS) and 'occ_sq' not in s
  with pytest.raises(KeyError):
    s['occ_sq']
  doubled = jax.jit(lambda x: x + x)(s.replace(count=jnp.ones(4, jnp.int32)))
  assert (
      isinstance(doubled, stats.PositionStats) and int(doubled['count'][0]) == 2
  )


def _fake_step(i, collect=True):
  """Statistics of a made-up step ``i`` (deterministic, different per step)."""
  s = stats.PositionStats.zeros(4, collect=collect)

  def add(x):
    per_row = i * np.arange(1, 5).reshape((4,) + (1,) * (x.ndim - 1))
    return x + jnp.asarray(per_row, x.dtype)

  return jax.tree.map(add, s)


def test_windows_files_hold_the_window_sums_and_exact_cumulative_counts(
    tmp_path,
):
  st = stats.PositionStatistics(
      4, 2, log_every=2, last_step=5, directory=str(tmp_path)
  )
  window = st.init()
  old, new = jnp.zeros((4, 2)), jnp.ones((4, 2))
  for i in range(1, 6):
    window = jax.jit(st.inside_step)(window, _fake_step(i), old, new)
    window = st.on_step(i, window)
  assert sorted(os.listdir(tmp_path)) == [
      'window_2.npz',
      'window_4.npz',
      'window_5.npz',
  ]
  with np.load(tmp_path / 'window_4.npz') as f:
    assert set(stats.FIELDS) <= set(f.files) and f['count'].dtype == np.int64
    assert (int(f['step']), int(f['first_step']), int(f['num_steps'])) == (
        4,
        3,
        2,
    )
    np.testing.assert_array_equal(f['count'], 7 * np.arange(1, 5))
    # 2 steps x ||(1, 1)||^2
    np.testing.assert_array_equal(f['update_sq'], [4.0] * 4)
    np.testing.assert_array_equal(f['cumulative_count'], 10 * np.arange(1, 5))
    assert f['cumulative_count'].dtype == np.int64


@pytest.mark.parametrize('collect', [True, False])
def test_restored_statistics_continue_the_same_window(tmp_path, collect):
  def run(directory, stop_at=None):
    st = stats.PositionStatistics(
        4, 2, log_every=3, directory=str(directory), collect=collect
    )
    window = st.init()
    for i in range(1, 8):
      window = st.on_step(i, st.inside_step(window, _fake_step(i, collect)))
      if i == stop_at:  # a checkpoint, then a new process
        saved = jax.tree.map(np.asarray, st.state(window))
        st = stats.PositionStatistics(
            4, 2, log_every=3, directory=str(directory), collect=collect
        )
        window = st.restore(saved)
    return directory

  a, b = run(tmp_path / 'a'), run(tmp_path / 'b', stop_at=4)
  assert (
      sorted(os.listdir(a))
      == sorted(os.listdir(b))
      == ['window_3.npz', 'window_6.npz']
  )
  for name in os.listdir(a):
    with np.load(a / name) as x, np.load(b / name) as y:
      assert x.files == y.files
      for k in x.files:
        np.testing.assert_array_equal(x[k], y[k], err_msg=k)


class _Writer:
  """Records what a TensorBoard-like writer is given."""

  def __init__(self):
    self.scalars, self.images = {}, {}

  def add_scalar(self, tag, value, global_step):
    self.scalars[tag, global_step] = value

  def add_image(self, tag, img_tensor, global_step, dataformats):
    self.images[tag, global_step] = (img_tensor, dataformats)


@pytest.mark.smoke
def test_writer_gets_a_scalar_per_bucket_and_an_image_per_curve():
  w = _Writer()
  drawn = {}

  def curve_image(name, values, title):
    drawn[name] = (values, title)
    return np.zeros((2, 3, 3), np.uint8)

  st = stats.PositionStatistics(
      4,
      2,
      writer=w,
      initial_table=np.zeros((4, 2)),
      bucket_edges=[0, 1, 4],
      curve_image=curve_image,
  )
  window = st.inside_step(
      st.init(), _fake_step(1), jnp.zeros((4, 2)), jnp.ones((4, 2))
  )
  st.on_step(1, window, table=np.array([[3.0, 4.0]] * 4))
  # Every field of the fake step is [1, 2, 3, 4]; update_sq ||(1, 1)||^2 = 2.
  want = {
      'count': [1.0, 3.0],
      'loss': [1.0, 1.0],
      'full_context_count': [1.0, 3.0],
      'full_context_share': [1.0, 1.0],
      'signal_per_occurrence': [1.0, 1.0],
      'coherence': [1.0, 9 / 29],
      'update_sq': [2.0, 2.0],
      'row_sq': [1.0, 3.0],
      'occ_norm': [1.0, 3.0],
      'drift': [5.0, 5.0],
  }
  assert set(w.scalars) == {
      (f'positions_{name}/{span}', 1)
      for name in want
      for span in ('00000-00001', '00001-00004')
  }
  for name, (first, rest) in want.items():
    assert w.scalars[f'positions_{name}/00000-00001', 1] == pytest.approx(first)
    assert w.scalars[f'positions_{name}/00001-00004', 1] == pytest.approx(rest)
  assert set(drawn) == set(want)
  np.testing.assert_array_equal(drawn['count'][0], [1, 2, 3, 4])
  assert drawn['loss'][1] == 'steps 1-1'
  assert {t for t, _ in w.images} == {f'positions/{n}' for n in want}
  assert w.images['positions/coherence', 1][1] == 'HWC'
  st.report_table(
      1, np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 0.0], [0.0, 0.0]])
  )
  img, fmt = w.images['positions/cosine_similarity', 1]
  assert fmt == 'HWC' and img.shape == (4, 4, 3) and img.dtype == np.uint8
  # cos(row 0, row 0) = 1: red
  np.testing.assert_array_equal(img[-1, 0], [255, 0, 0])
  # cos(row 0, row 2) = -1: blue
  np.testing.assert_array_equal(img[-1, 2], [0, 0, 255])


# ---- a user's own loop (linen and NNX) against the project trainer
# -----------------------


def _trainer_config():
  from conftest import tiny_config

  c = tiny_config()
  c.num_train_steps, c.log_every_steps, c.eval_every_steps = 4, 2, 0
  c.checkpoint_every_steps, c.grad_accum_steps = 4, 1
  return c


@pytest.fixture(scope='module')
def trainer_run(tmp_path_factory):
  from flax_posemb import training

  workdir = str(tmp_path_factory.mktemp('trainer'))
  training.train_and_evaluate(_trainer_config(), workdir)
  return workdir


def _user_setup(config):
  """What a user has: the model, its init, an optimizer and batches (as the
  trainer's)."""
  import optax

  from flax_posemb import config as config_lib
  from flax_posemb import data
  from flax_posemb import model as model_lib
  from flax_posemb import optim

  # A user's loop converts the ConfigDict once, as train.py does.
  config = config_lib.RunConfig.from_config_dict(config)
  mcfg = config.model
  model = model_lib.TransformerLM(mcfg)
  seq = jnp.zeros((1, config.data.seq_len), jnp.int32)
  key = jax.random.split(jax.random.key(config.seed))[0]
  params = model.init(
      key, seq, jnp.arange(config.data.seq_len)[None], segment_ids=seq + 1
  )
  batches = data.make_train_iterator(
      config.data,
      batch_size=config.batch_size,
      seed=config.seed,
      num_train_steps=config.num_train_steps,
      max_len=mcfg.max_len,
  )
  return (
      mcfg,
      model,
      params['params'],
      optim.make_optimizer(config, params['params']),
      batches,
      optax,
  )


def linen_user_loop(config, directory):
  mcfg, model, params, tx, batches, optax = _user_setup(config)
  T, D = mcfg.max_len, mcfg.emb_dim

  def token_loss_fn(p, embed_delta, batch):
    logits = model.apply(
        {'params': p},
        batch['inputs'],
        batch['positions'],
        segment_ids=batch['segment_ids'],
        embed_delta=embed_delta,
    )
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch['targets']
    )

  # ---- the user loop: as in the README ----
  stats_obj = stats.PositionStatistics(
      num_positions=T, embed_dim=D, log_every=2, directory=directory
  )
  grad_fn = stats_obj.value_and_grad(token_loss_fn)

  @jax.jit
  def step(params, opt_state, window, batch):
    loss, grads, s = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    window = stats_obj.inside_step(
        window,
        s,
        params['pos_embed']['embedding'],
        new['pos_embed']['embedding'],
    )
    return new, opt_state, window, loss

  opt_state, window = tx.init(params), stats_obj.init()
  for i in range(1, config.num_train_steps + 1):
    params, opt_state, window, _ = step(
        params, opt_state, window, next(batches)
    )
    window = stats_obj.on_step(i, window)


def nnx_user_loop(config, directory):
  from flax import nnx

  from flax_posemb import nnx as posemb_nnx

  mcfg, _, linen_params, tx, batches, optax = _user_setup(config)
  model = posemb_nnx.TransformerLM(mcfg, rngs=nnx.Rngs(0))

  # ---- the user loop: as in the README ----
  graphdef, param_state, rest = nnx.split(model, nnx.Param, ...)
  nnx.replace_by_pure_dict(param_state, linen_params)  # the trainer's init
  params = nnx.to_pure_dict(param_state)

  def token_loss_fn(p, embed_delta, batch):
    state = jax.tree.map(lambda x: x, param_state)
    nnx.replace_by_pure_dict(state, p)
    m = nnx.merge(graphdef, state, rest)
    logits = m(
        batch['inputs'],
        batch['positions'],
        batch['segment_ids'],
        embed_delta=embed_delta,
    )
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch['targets']
    )

  stats_obj = stats.PositionStatistics(
      num_positions=mcfg.max_len,
      embed_dim=mcfg.emb_dim,
      log_every=2,
      directory=directory,
  )
  grad_fn = stats_obj.value_and_grad(token_loss_fn)

  @jax.jit
  def step(params, opt_state, window, batch):
    loss, grads, s = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    new = optax.apply_updates(params, updates)
    window = stats_obj.inside_step(
        window,
        s,
        params['pos_embed']['embedding'],
        new['pos_embed']['embedding'],
    )
    return new, opt_state, window, loss

  opt_state, window = tx.init(params), stats_obj.init()
  for i in range(1, config.num_train_steps + 1):
    params, opt_state, window, _ = step(
        params, opt_state, window, next(batches)
    )
    window = stats_obj.on_step(i, window)


@pytest.mark.parametrize('loop', [linen_user_loop, nnx_user_loop])
def test_a_user_loop_writes_the_trainers_windows_and_eval_analyzes_them(
    trainer_run, tmp_path, loop
):
  import json
  import subprocess
  import sys

  from conftest import ROOT
  from conftest import SUBPROCESS_ENV

  mine = tmp_path / 'stats'
  loop(_trainer_config(), str(mine))
  ref = os.path.join(trainer_run, 'stats')
  assert (
      sorted(os.listdir(mine))
      == sorted(os.listdir(ref))
      == ['window_2.npz', 'window_4.npz']
  )
  for name in os.listdir(ref):
    with np.load(os.path.join(ref, name)) as want, np.load(mine / name) as got:
      assert sorted(got.files) == sorted(want.files)
      for k in want.files:
        w = np.asarray(want[k], np.float64)
        np.testing.assert_allclose(
            got[k],
            w,
            rtol=2e-5,
            atol=1e-6 * np.abs(w).max(),
            err_msg=f'{name}: {k}',
        )
  if loop is nnx_user_loop:
    return  # one run of the command suffices
  out = tmp_path / 'out'
  proc = subprocess.run(
      [
          sys.executable,
          str(ROOT / 'eval.py'),
          '--analyze',
          '--stats',
          str(mine),
          '--output',
          str(out),
      ],
      cwd=str(ROOT),
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  summary = json.load(open(out / 'stats_analysis.json'))
  assert summary['windows'] == 2 and summary['last_step'] == 4
  with np.load(os.path.join(ref, 'window_4.npz')) as z:
    assert summary['exposure']['total_tokens'] == int(
        z['cumulative_count'].sum()
    )
  assert os.path.getsize(summary['files']['exposure_plot']) > 0
  assert f"plot: {summary['files']['exposure_plot']}" in proc.stdout
  rho = summary['exposure']['spearman_mean_loss']
  assert f'mean_loss {rho:+.2f}' in proc.stdout
  assert '2 statistics windows, steps' in proc.stdout
  by_context = summary['exposure_by_context']
  full = 0
  for name in ('window_2.npz', 'window_4.npz'):
    with np.load(os.path.join(ref, name)) as z:
      full += int(z['full_context_count'].sum())
  assert by_context['full_context_tokens'] == full > 0
  assert 'full-context exposure (context = position, as evaluated)' in (
      proc.stdout
  )
