"""Optimizer chain (flax_posemb.optim): schedule, decay mask, per-row scale
after Adam."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_posemb import config as config_lib
from flax_posemb import defaults
from flax_posemb import optim


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
    tx = optim.make_optimizer(c, p)
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
  tx = optim.make_optimizer(c, p)
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
