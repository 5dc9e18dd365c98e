"""Per-position statistics (flax_posemb.stats) against independent computations."""

import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_posemb import stats

B, T, D, V, L = 3, 8, 5, 7, 12  # batch, length, width, vocab, table rows


class StandIn(nn.Module):
  """Tiny causal model (not a TransformerLM) taking embed_delta; segment-restricted mixing."""

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
  # Row 0: one document + padding; row 1: two packed documents; row 2: random offset.
  seg = np.array([[1] * 5 + [0] * 3, [1] * 3 + [2] * 5, [1] * 8], np.int32)
  pos = np.array([list(range(5)) + [0] * 3, [0, 1, 2, 0, 1, 2, 3, 4],
                  list(range(3, 11))], np.int32)
  mask = (seg > 0).astype(np.float32)
  mask[1, 2] = 0.0  # last token of a document has no target
  mask[2, 5] = 0.0
  return dict(inputs=inputs, targets=targets, positions=pos, segment_ids=seg,
              loss_mask=mask)


def token_losses(logits, targets):
  return -jnp.take_along_axis(jax.nn.log_softmax(logits), targets[..., None], -1)[..., 0]


def test_downstream_counts_later_scored_targets_in_segment():
  batch = make_batch()
  got = np.asarray(stats.downstream_targets(batch['segment_ids'], batch['loss_mask']))
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
  params = model.init(jax.random.key(0), batch['inputs'], batch['positions'],
                      batch['segment_ids'])['params']
  return model, params, batch


def per_example_oracle(sum_loss, params, batch):
  """Window fields from per-example gradients (vmap of grad), one example at a time.

  Args:
    sum_loss: ``(params, delta [b, T, D], batch) -> (sum-reduced loss, token losses)``.
  """
  def one(x):
    xb = jax.tree.map(lambda a: a[None], x)
    return jax.grad(lambda d: sum_loss(params, d, xb)[0])(jnp.zeros((1, T, D)))[0]

  g = np.asarray(jax.vmap(one)(batch), np.float64)  # [B, T, D]
  tl = np.asarray(sum_loss(params, jnp.zeros((B, T, D)), batch)[1], np.float64)
  want = {k: np.zeros(L) for k in stats.FIELDS if k != 'update_sq'}
  gsum = np.zeros((L, D))
  for b in range(B):
    for t in range(T):
      p = batch['positions'][b, t]
      if batch['segment_ids'][b, t] > 0:
        n = np.linalg.norm(g[b, t])
        want['count'][p] += 1
        want['occ_norm'][p] += n
        want['occ_sq'][p] += n * n
        same = batch['segment_ids'][b] == batch['segment_ids'][b, t]
        want['downstream'][p] += np.sum(batch['loss_mask'][b, t:] * same[t:])
        gsum[p] += g[b, t]
      if batch['loss_mask'][b, t] > 0:
        want['loss_count'][p] += 1
        want['loss_sum'][p] += tl[b, t]
  want['row_sq'] = np.sum(gsum ** 2, -1)
  return want


def assert_stats_match(got, want):
  assert set(got) == set(want)
  for k in want:
    np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=1e-5,
                               atol=1e-7, err_msg=k)


def test_any_model_stats_match_per_example_gradients_linen(setup):
  model, params, batch = setup

  def token_loss_fn(p, embed_delta, b):
    logits = model.apply({'params': p}, b['inputs'], b['positions'], b['segment_ids'],
                         embed_delta=embed_delta)
    return token_losses(logits, b['targets'])

  f = jax.jit(stats.value_and_grad_with_position_stats(token_loss_fn, L, D))
  loss, grads, got = f(params, batch)

  def sum_loss(p, d, b):
    tl = token_loss_fn(p, d, b)
    return jnp.sum(tl * b['loss_mask']), tl

  assert_stats_match(got, per_example_oracle(sum_loss, params, batch))
  n = batch['loss_mask'].sum()
  np.testing.assert_allclose(float(loss), float(sum_loss(params, None, batch)[0]) / n,
                             rtol=1e-6)
  # grads are of the mean loss; row_sq is the squared table-gradient row of the sum loss.
  want_grads = jax.grad(lambda p: sum_loss(p, None, batch)[0] / n)(params)
  for x, y in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5, atol=1e-8)
  table_grad = np.asarray(grads['pos_embed']['embedding'], np.float64) * float(n)
  np.testing.assert_allclose(np.asarray(got['row_sq']), np.sum(table_grad ** 2, -1),
                             rtol=1e-4, atol=1e-9)
  assert got['count'].dtype == jnp.int32 and 'update_sq' not in got


def test_any_model_stats_match_per_example_gradients_nnx():
  from flax import nnx  # pylint: disable=g-import-not-at-top

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

  # Width inferred from one abstract trace (no embed_dim given).
  loss, grads, got = jax.jit(stats.value_and_grad_with_position_stats(token_loss_fn, L, D))(
      state, batch)

  def sum_loss(st, d, b):
    tl = token_loss_fn(st, d, b)
    return jnp.sum(tl * b['loss_mask']), tl

  assert_stats_match(got, per_example_oracle(sum_loss, state, batch))
  assert jax.tree.structure(grads) == jax.tree.structure(state)


def test_stats_off_keeps_loss_fields_and_identical_loss_and_grads(setup):
  model, params, batch = setup

  def token_loss_fn(p, embed_delta, b):
    return token_losses(model.apply({'params': p}, b['inputs'], b['positions'],
                                    b['segment_ids'], embed_delta=embed_delta), b['targets'])

  on = jax.jit(stats.value_and_grad_with_position_stats(token_loss_fn, L, D))(params, batch)
  off = jax.jit(stats.value_and_grad_with_position_stats(token_loss_fn, L, D, collect=False))(
      params, batch)
  assert list(off[2]) == list(stats.LOSS_FIELDS)
  assert float(on[0]) == float(off[0])
  for x, y in zip(jax.tree.leaves(on[1]), jax.tree.leaves(off[1])):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for k in stats.LOSS_FIELDS:
    np.testing.assert_array_equal(np.asarray(on[2][k]), np.asarray(off[2][k]))


def test_absent_positions_get_exactly_zero_gradient(setup):
  model, params, batch = setup

  def loss(params):
    logits = model.apply({'params': params}, batch['inputs'], batch['positions'],
                         batch['segment_ids'])
    return jnp.sum(token_losses(logits, batch['targets']) * batch['loss_mask'])

  grad = np.asarray(jax.grad(loss)(params)['pos_embed']['embedding'])
  present = np.zeros(L, bool)
  present[batch['positions'][batch['segment_ids'] > 0]] = True
  assert not present[11] and present[10]
  assert np.all(grad[~present] == 0.0)
  assert np.all(np.abs(grad[present]).sum(-1) > 0)


def test_microbatch_sums_square_after_summing():
  g = jnp.ones((2, 1, 3))
  b = dict(positions=jnp.zeros((2, 1), jnp.int32), segment_ids=jnp.ones((2, 1), jnp.int32),
           loss_mask=jnp.ones((2, 1)))
  whole = stats.occurrence_stats(g, jnp.zeros((2, 1)), b, 2).finish()
  halves = [stats.occurrence_stats(g[i:i + 1], jnp.zeros((1, 1)),
                                   {k: v[i:i + 1] for k, v in b.items()}, 2)
            for i in range(2)]
  split = (halves[0] + halves[1]).finish()
  assert float(whole['row_sq'][0]) == float(split['row_sq'][0]) == 12.0
  assert float(split['occ_sq'][0]) == 6.0 and split.row_grad is None


def test_adding_statistics_with_different_fields_is_an_error():
  with pytest.raises(ValueError, match='fields'):
    stats.PositionStats.zeros(3) + stats.PositionStats.zeros(3, collect=False)


def test_update_sq_and_derived_ratios():
  old = jnp.zeros((3, 2))
  new = jnp.array([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])
  np.testing.assert_array_equal(stats.update_sq(old, new), [25.0, 0.0, 1.0])
  s = {k: np.zeros(2) for k in stats.FIELDS}
  s.update(count=np.array([2, 0]), occ_sq=np.array([2.0, 0]), row_sq=np.array([4.0, 0]),
           occ_norm=np.array([2.0, 0]), downstream=np.array([8.0, 0]))
  d = stats.derived(s)
  assert d['coherence'][0] == 1.0 and np.isnan(d['coherence'][1])
  assert d['signal_per_occurrence'][0] == 1.0 and d['signal_per_downstream'][0] == 0.25
  off = stats.derived({k: s[k] for k in stats.LOSS_FIELDS})  # statistics off: NaN ratios
  assert np.all(np.isnan(off['coherence'])) and np.isnan(off['mean_loss'][0])


def test_window_file_loads_with_numpy_alone_and_leaves_no_temporary(tmp_path):
  s = stats.PositionStats.from_mapping({k: np.arange(4) for k in stats.FIELDS})
  path = stats.window_path(str(tmp_path), 50)
  s.save(path, step=50, first_step=26, cumulative_count=np.arange(4) * 2)
  with np.load(path) as f:
    assert set(stats.FIELDS) <= set(f.files)
    assert int(f['num_steps']) == 25 and f['cumulative_count'].dtype == np.int64
    assert f['count'].dtype == np.int64
  assert os.listdir(os.path.dirname(path)) == ['window_50.npz']


def test_position_stats_is_a_mapping_of_present_fields_and_a_pytree():
  s = stats.PositionStats.zeros(4, collect=False)
  assert dict(s).keys() == set(stats.LOSS_FIELDS) and 'occ_sq' not in s
  doubled = jax.jit(lambda x: x + x)(s.replace(count=jnp.ones(4, jnp.int32)))
  assert isinstance(doubled, stats.PositionStats) and int(doubled['count'][0]) == 2


def test_psum_reduces_statistics_over_a_named_axis():
  parts = jax.tree.map(lambda x: jnp.stack([x, x + 1]),
                       stats.PositionStats.zeros(3, collect=False))
  total = jax.vmap(lambda s: s.psum('devices'), axis_name='devices')(parts)
  np.testing.assert_array_equal(np.asarray(total['count']), [[1, 1, 1], [1, 1, 1]])
  assert isinstance(total, stats.PositionStats)
