"""Optimizer chain (flax_posemb.optim): schedule, decay mask, per-row scale
after Adam, the position table's own optimizers (row-sparse Adam, SGD with
momentum) and their exact resume."""

import os
import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import tiny_config
from flax_posemb import checkpointing
from flax_posemb import config as config_lib
from flax_posemb import defaults
from flax_posemb import optim
from flax_posemb import training


def params():
  return {
      'pos_embed': {'embedding': jnp.ones((4, 2))},
      'token_embed': {'embedding': jnp.ones((3, 2))},
      'dense': {'kernel': jnp.ones((2, 2)), 'bias': jnp.ones((2,))},
  }


def test_schedule_warms_up_then_decays_to_end_ratio():
  c = defaults.base()
  c.num_train_steps, c.optimizer.warmup_steps, c.optimizer.learning_rate = (
      100,
      10,
      1.0,
  )
  c.optimizer.end_lr_ratio = 0.1
  s = optim.make_schedule(c)
  assert float(s(0)) == 0.0
  assert float(s(5)) == pytest.approx(0.5)
  assert float(s(10)) == pytest.approx(1.0)
  assert float(s(100)) == pytest.approx(0.1)


@pytest.mark.parametrize(
    'decay_pos,decay_tok', [(True, True), (False, True), (True, False)]
)
def test_decay_mask_follows_table_flags(decay_pos, decay_tok):
  c = defaults.base()
  c.optimizer.decay_position_table = decay_pos
  c.optimizer.decay_token_table = decay_tok
  m = optim.decay_mask(params(), c)
  assert m['pos_embed']['embedding'] is decay_pos
  assert m['token_embed']['embedding'] is decay_tok
  assert m['dense']['kernel'] is True and m['dense']['bias'] is False


def test_undecayed_unseen_row_never_moves_and_decayed_one_shrinks():
  c = defaults.base()
  c.optimizer.warmup_steps = 0
  p = params()
  g = jax.tree.map(jnp.zeros_like, p)
  for flag, moved in [(False, False), (True, True)]:
    c.optimizer.decay_position_table = flag
    tx = optim.make_optimizer(config_lib.RunConfig.from_config_dict(c), p)
    upd, _ = tx.update(g, tx.init(p), p)
    assert bool(jnp.any(upd['pos_embed']['embedding'] != 0)) is moved


def test_row_scale_acts_after_adam():
  c = defaults.base()
  (
      c.optimizer.warmup_steps,
      c.optimizer.weight_decay,
      c.optimizer.grad_clip_norm,
  ) = (0, 0.0, 0)
  p = params()
  g = jax.tree.map(jnp.ones_like, p)
  g['pos_embed']['embedding'] = (
      jnp.array([[1.0, 1], [1, 1], [1, 1], [0, 0]]) * 1e-3
  )
  counts = jnp.array([6.0, 1.0, 1.0, 0.0])  # mean 2
  base_tx = optim.make_optimizer(c, p)
  u0, _ = base_tx.update(g, base_tx.init(p), p, position_counts=counts)
  c.optimizer.row_lr_scale, c.optimizer.row_lr_power, c.optimizer.row_lr_max = (
      True,
      1.0,
      10,
  )
  tx = optim.make_optimizer(config_lib.RunConfig.from_config_dict(c), p)
  u1, state = tx.update(g, tx.init(p), p, position_counts=counts)
  ratio = np.asarray(
      u1['pos_embed']['embedding'][:3, 0] / u0['pos_embed']['embedding'][:3, 0]
  )
  np.testing.assert_allclose(ratio, [2 / 6, 2.0, 2.0], rtol=1e-5)
  np.testing.assert_array_equal(u1['dense']['kernel'], u0['dense']['kernel'])
  # Exposure is cumulative optimizer state.
  _, state = tx.update(g, state, p, position_counts=counts)
  exposure = [
      s for s in jax.tree.leaves(state) if getattr(s, 'shape', None) == (4,)
  ]
  assert any(np.array_equal(e, 2 * counts) for e in exposure)


@pytest.mark.parametrize(
    'key,value,match',
    [
        ('b2', 1.0, r'b2 must be in \[0, 1\)'),
        ('learning_rate', 0.0, '> 0'),
        ('grad_clip_norm', float('nan'), 'grad_clip_norm must be finite'),
        ('warmup_steps', -1, 'int >= 0'),
        ('row_lr_scale', True, None),
    ],
)
def test_bad_optimizer_values_are_rejected_at_startup(key, value, match):
  c = defaults.base()
  c.optimizer[key] = value
  if match is None:  # row_lr_scale needs a learned table
    config_lib.RunConfig.from_config_dict(c)
    c.model.position_embedding = 'rope'
    match = 'needs a learned position table'
  with pytest.raises(ValueError, match=match):
    config_lib.RunConfig.from_config_dict(c)


def _table_config(position_optimizer, **optimizer):
  c = defaults.base()
  c.optimizer.warmup_steps, c.optimizer.grad_clip_norm = 0, 0.0
  c.optimizer.position_optimizer = position_optimizer
  for key, value in optimizer.items():
    c.optimizer[key] = value
  return c


def _steps(c, grads):
  """Parameters and optimizer state after one update per gradient tree."""
  p = params()
  tx = optim.make_optimizer(config_lib.RunConfig.from_config_dict(c), p)
  state = tx.init(p)
  for g in grads:
    updates, state = tx.update(g, state, p)
    p = optax.apply_updates(p, updates)
  return p, state


def _grads(seed, zero_rows=()):
  g = jax.tree.map(
      lambda x: jax.random.normal(jax.random.key(seed), x.shape), params()
  )
  table = g['pos_embed']['embedding']
  for row in zero_rows:
    table = table.at[row].set(0.0)
  g['pos_embed']['embedding'] = table
  return g


def _table_rows(state, row):
  """Row ``row`` of every optimizer-state leaf shaped like the position table
  (moments ``[4, 2]``, per-row counts ``[4]``)."""
  leaves = [
      x for x in jax.tree.leaves(state) if getattr(x, 'shape', ())[:1] == (4,)
  ]
  assert leaves
  return [np.asarray(x[row]) for x in leaves]


def test_lazy_adam_leaves_rows_without_a_gradient_untouched():
  # Weight decay on the table: a plain AdamW step would shrink every row.
  c = _table_config('lazy_adam', weight_decay=0.1)
  first = [_grads(0)]
  p1, s1 = _steps(c, first)
  p2, s2 = _steps(c, first + [_grads(1, zero_rows=[1, 3])])
  t1, t2 = p1['pos_embed']['embedding'], p2['pos_embed']['embedding']
  for row in (1, 3):
    np.testing.assert_array_equal(t2[row], t1[row])
    for x, y in zip(_table_rows(s2, row), _table_rows(s1, row)):
      np.testing.assert_array_equal(x, y)
  for row in (0, 2):
    assert np.all(np.asarray(t2[row]) != np.asarray(t1[row]))
    assert not np.array_equal(_table_rows(s2, row)[0], _table_rows(s1, row)[0])
  # The other parameters keep the model's AdamW: as with the shared Adam.
  p_shared, _ = _steps(
      _table_config('adam', weight_decay=0.1),
      first + [_grads(1, zero_rows=[1, 3])],
  )
  np.testing.assert_array_equal(
      p2['dense']['kernel'], p_shared['dense']['kernel']
  )


def test_lazy_adam_on_rows_with_a_gradient_every_step_is_adamw():
  grads = [_grads(i) for i in range(3)]
  lazy, _ = _steps(_table_config('lazy_adam'), grads)
  shared, _ = _steps(_table_config('adam'), grads)
  for x, y in zip(jax.tree.leaves(lazy), jax.tree.leaves(shared)):
    np.testing.assert_array_equal(x, y)


def test_a_rare_rows_lazy_bias_correction_counts_its_own_steps():
  """A row first seen at step 3 gets Adam's first step (a sign-sized step of
  one learning rate per coordinate), not a step of moments decayed for two
  steps."""
  c = _table_config('lazy_adam', weight_decay=0.0, learning_rate=1.0)
  c.optimizer.end_lr_ratio = 1.0
  grads = [_grads(0, zero_rows=[3]), _grads(1, zero_rows=[3]), _grads(2)]
  p, _ = _steps(c, grads)
  moved = np.asarray(p['pos_embed']['embedding'][3] - 1.0)
  want = -np.sign(np.asarray(grads[2]['pos_embed']['embedding'][3]))
  np.testing.assert_allclose(moved, want, rtol=1e-5)


def test_sgd_with_momentum_for_the_table_at_its_own_learning_rate():
  c = _table_config(
      'sgd',
      weight_decay=0.0,
      learning_rate=0.5,
      end_lr_ratio=1.0,
      position_momentum=0.9,
      position_lr_scale=0.1,
  )
  g0, g1 = _grads(0), _grads(1)
  p, _ = _steps(c, [g0, g1])
  table = [g['pos_embed']['embedding'] for g in (g0, g1)]
  momentum = table[0] * 0.9 + table[1]
  want = 1.0 - 0.05 * table[0] - 0.05 * momentum
  np.testing.assert_allclose(p['pos_embed']['embedding'], want, rtol=1e-6)
  shared, _ = _steps(
      _table_config(
          'adam', weight_decay=0.0, learning_rate=0.5, end_lr_ratio=1.0
      ),
      [g0, g1],
  )
  np.testing.assert_array_equal(p['dense']['kernel'], shared['dense']['kernel'])


@pytest.mark.parametrize(
    'key,value,match',
    [
        (
            'position_optimizer',
            'adagrad',
            'must be one of adam, lazy_adam, sgd',
        ),
        ('position_momentum', 1.0, r'position_momentum must be in \[0, 1\)'),
        ('position_lr_scale', 0.0, 'position_lr_scale must be > 0'),
        ('position_lr_scale', float('inf'), 'position_lr_scale must be finite'),
    ],
)
def test_bad_table_optimizer_values_are_rejected_at_startup(key, value, match):
  c = _table_config('sgd')
  c.optimizer[key] = value
  with pytest.raises(ValueError, match=match):
    config_lib.RunConfig.from_config_dict(c)


def test_a_table_optimizer_needs_a_learned_table():
  c = _table_config('lazy_adam')
  config_lib.RunConfig.from_config_dict(c)
  c.model.position_embedding = 'rope'
  with pytest.raises(ValueError, match='needs a learned position table'):
    config_lib.RunConfig.from_config_dict(c)


@pytest.mark.parametrize('position_optimizer', ['lazy_adam', 'sgd'])
def test_a_table_optimizer_resumes_exactly_from_its_checkpoint(
    tmp_path, position_optimizer
):
  """Its state is in the checkpoint's optimizer state: a run stopped by
  SIGTERM and resumed ends bit for bit where an uninterrupted one does."""

  def config():
    c = tiny_config()
    c.num_train_steps, c.eval_every_steps, c.checkpoint_every_steps = 6, 0, 3
    c.optimizer.position_optimizer = position_optimizer
    return c

  def stop_at_4(step, metrics):
    del metrics
    if step == 4:
      os.kill(os.getpid(), signal.SIGTERM)

  whole, stopped = str(tmp_path / 'whole'), str(tmp_path / 'stopped')
  training.train_and_evaluate(config(), whole)
  first = training.train_and_evaluate(config(), stopped, hooks=[stop_at_4])
  assert first['preempted'] and 3 < first['step'] < 6
  resumed = training.train_and_evaluate(config(), stopped)
  assert resumed['resumed_from'] == first['step'] and resumed['step'] == 6
  want, _, _ = checkpointing.restore_params(whole, step=6)
  got, _, _ = checkpointing.restore_params(stopped, step=6)
  for x, y in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
