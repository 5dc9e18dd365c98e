"""Per-position statistics (flax_posemb.stats) against independent computations."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_posemb import stats

B, T, D, V, L = 3, 8, 5, 7, 12  # batch, length, width, vocab, table rows


class StandIn(nn.Module):
  """Tiny causal model with the contract's perturb hook (segment-restricted mixing)."""

  @nn.compact
  def __call__(self, inputs, positions, segment_ids):
    x = nn.Embed(V, D, name='token_embed')(inputs)
    x = x + nn.Embed(L, D, name='pos_embed')(positions)
    x = self.perturb('embed_sum', x)
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
  variables = model.init(jax.random.key(0), batch['inputs'], batch['positions'],
                         batch['segment_ids'])
  return model, variables, batch


def test_stats_match_per_example_gradients(setup):
  model, variables, batch = setup
  params, pert = variables['params'], variables['perturbations']

  def sum_loss(params, pert, b):
    logits = model.apply({'params': params, 'perturbations': pert}, b['inputs'],
                         b['positions'], b['segment_ids'])
    tl = token_losses(logits, b['targets'])
    return jnp.sum(tl * b['loss_mask']), tl

  # Library path: one backward pass w.r.t. params and perturbations together.
  (_, tl), (gp, gpert) = jax.value_and_grad(sum_loss, argnums=(0, 1), has_aux=True)(
      params, pert, batch)
  occ = stats.occurrence_stats(gpert['embed_sum'], tl, batch, L)
  got = stats.finish_step(occ, None, None)

  # Independent: per-example gradients, one example at a time (vmap of grad).
  def one(x):
    xb = jax.tree.map(lambda a: a[None], x)
    def f(p1):
      return sum_loss(params, {'embed_sum': p1}, xb)[0]
    return jax.grad(f)(jnp.zeros((1, T, D)))[0]

  g = np.asarray(jax.vmap(one)(batch), np.float64)  # [B, T, D]
  tl = np.asarray(tl, np.float64)
  want = {k: np.zeros(L) for k in stats.OCCURRENCE_FIELDS}
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
  for k in stats.OCCURRENCE_FIELDS + ('row_sq',):
    np.testing.assert_allclose(np.asarray(got[k], np.float64), want[k], rtol=1e-5,
                               atol=1e-7, err_msg=k)
  # row_sq is the squared table-gradient row of the sum-reduced loss.
  table_grad = np.asarray(gp['pos_embed']['embedding'], np.float64)
  np.testing.assert_allclose(np.asarray(got['row_sq']), np.sum(table_grad ** 2, -1),
                             rtol=1e-5, atol=1e-9)
  assert got['count'].dtype == jnp.int32


def test_absent_positions_get_exactly_zero_gradient(setup):
  model, variables, batch = setup

  def loss(params):
    logits = model.apply({'params': params, 'perturbations':
                          variables['perturbations']}, batch['inputs'],
                         batch['positions'], batch['segment_ids'])
    return jnp.sum(token_losses(logits, batch['targets']) * batch['loss_mask'])

  grad = np.asarray(jax.grad(loss)(variables['params'])['pos_embed']['embedding'])
  present = np.zeros(L, bool)
  present[batch['positions'][batch['segment_ids'] > 0]] = True
  assert not present[11] and present[10]
  assert np.all(grad[~present] == 0.0)
  assert np.all(np.abs(grad[present]).sum(-1) > 0)


def test_microbatch_sums_square_after_summing():
  g = jnp.ones((2, 1, 3))
  b = dict(positions=jnp.zeros((2, 1), jnp.int32), segment_ids=jnp.ones((2, 1), jnp.int32),
           loss_mask=jnp.ones((2, 1)))
  whole = stats.finish_step(stats.occurrence_stats(g, jnp.zeros((2, 1)), b, 2), None, None)
  halves = [stats.occurrence_stats(g[i:i + 1], jnp.zeros((1, 1)),
                                   {k: v[i:i + 1] for k, v in b.items()}, 2)
            for i in range(2)]
  split = stats.finish_step(stats.add(*halves), None, None)
  assert float(whole['row_sq'][0]) == float(split['row_sq'][0]) == 12.0
  assert float(split['occ_sq'][0]) == 6.0


def test_update_sq_and_derived_ratios():
  old = jnp.zeros((3, 2))
  new = jnp.array([[3.0, 4.0], [0.0, 0.0], [1.0, 0.0]])
  occ = {k: jnp.zeros(3) for k in stats.OCCURRENCE_FIELDS}
  occ['g_sum'] = jnp.zeros((3, 2))
  out = stats.finish_step(occ, old, new)
  np.testing.assert_array_equal(out['update_sq'], [25.0, 0.0, 1.0])
  s = {k: np.zeros(2) for k in stats.FIELDS}
  s.update(count=np.array([2, 0]), occ_sq=np.array([2.0, 0]), row_sq=np.array([4.0, 0]),
           occ_norm=np.array([2.0, 0]), downstream=np.array([8.0, 0]))
  d = stats.derived(s)
  assert d['coherence'][0] == 1.0 and np.isnan(d['coherence'][1])
  assert d['signal_per_occurrence'][0] == 1.0 and d['signal_per_downstream'][0] == 0.25


def test_window_file_loads_with_numpy_alone(tmp_path):
  s = {k: np.arange(4) for k in stats.FIELDS}
  path = stats.window_path(str(tmp_path), 50)
  stats.save_window(path, s, step=50, first_step=26, cumulative_count=np.arange(4) * 2)
  with np.load(path) as f:
    assert set(stats.FIELDS) <= set(f.files)
    assert int(f['num_steps']) == 25 and f['cumulative_count'].dtype == np.int64
    assert f['count'].dtype == np.int64
