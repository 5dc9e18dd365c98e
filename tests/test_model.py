"""Tests for flax_posemb.model: config, shapes/dtypes, causality, packing,
embed_delta."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_posemb import defaults
from flax_posemb import stats as stats_lib
from flax_posemb.model import POSITION_TABLE_PATH
from flax_posemb.model import ModelConfig
from flax_posemb.model import TransformerLM
from flax_posemb.model import position_table

B, T = 2, 12
SMALL = dict(
    vocab_size=16, num_layers=1, num_heads=2, emb_dim=16, mlp_dim=32, max_len=T
)


def _batch(seed=0, b=B, t=T):
  rng = np.random.default_rng(seed)
  inputs = jnp.asarray(rng.integers(0, 16, (b, t)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
  return inputs, positions


def _init(cfg, inputs, positions, segment_ids=None):
  model = TransformerLM(cfg)
  variables = jax.jit(model.init)(
      jax.random.key(0), inputs, positions, segment_ids
  )
  return model, variables


def test_config_model_section_is_built_from_model_config():
  # Nothing may differ, and an override on the command line reaches the model.
  assert ModelConfig.from_config(defaults.model()) == ModelConfig()
  section = defaults.model()
  section.num_layers = 3
  assert ModelConfig.from_config(section).num_layers == 3


def test_from_config_rejects_unknown_keys():
  with pytest.raises(ValueError, match='num_layer'):
    ModelConfig.from_config({'num_layer': 2})


def test_an_old_run_with_the_removed_check_positions_field_loads_and_resumes():
  # Runs saved before the in-model position guard was removed record
  # model.check_positions.
  from flax_posemb import workdir

  old = defaults.base().to_dict()
  old['model']['check_positions'] = False
  assert ModelConfig.from_config(old['model']) == ModelConfig()
  assert workdir.config_changes(old, defaults.base()) == {}


@pytest.mark.parametrize(
    'bad,match',
    [
        ({'emb_dim': 30, 'num_heads': 4}, 'divisible'),
        ({'position_embedding': 'alibi'}, 'valid: learned'),
        ({'position_init': 'nope'}, 'valid names'),
        ({'dtype': 'fp16'}, 'bfloat16'),
        ({'attention_impl': 'flash'}, 'xla'),
        ({'attention_impl': 'cudnn', 'dtype': 'float32'}, 'bfloat16'),
        ({'position_init': 'normal'}, 'position_init_std'),
        ({'token_init': 'same_as_token'}, 'token_init'),
        ({'num_layers': 0}, 'positive'),
        (
            {'position_embedding': 'rope', 'emb_dim': 12, 'num_heads': 4},
            'even head dim',
        ),
        ({'token_init': 'zeros', 'token_init_std': 0.1}, 'takes no std'),
        (
            {'token_init': 'zeros', 'position_init': 'sinusoidal'},
            'position_init_std',
        ),
        (
            {'position_embedding': 'sinusoidal', 'token_init': 'zeros'},
            'position_init_std',
        ),
        (
            {'position_embedding': 'rope', 'position_init': 'nope'},
            'valid names',
        ),
    ],
)
def test_bad_config_values_raise_clear_errors(bad, match):
  with pytest.raises(ValueError, match=match):
    ModelConfig(**bad)


@pytest.mark.parametrize(
    'dtype,param_dtype',
    [('float32', 'float32'), ('bfloat16', 'float32'), ('bfloat16', 'bfloat16')],
)
def test_shapes_and_dtypes(dtype, param_dtype):
  cfg = ModelConfig(**SMALL, dtype=dtype, param_dtype=param_dtype)
  inputs, positions = _batch()
  model, variables = _init(cfg, inputs, positions)
  params = variables['params']
  table = position_table(params)
  assert table.shape == (T, 16) and table.dtype == jnp.dtype(param_dtype)
  assert table is params[POSITION_TABLE_PATH[0]][POSITION_TABLE_PATH[1]]
  assert params['token_embed']['embedding'].shape == (16, 16)
  # No perturbation collection: batch size is free.
  assert set(variables) == {'params'}
  logits = jax.jit(model.apply)({'params': params}, inputs, positions)
  assert logits.shape == (B, T, 16) and logits.dtype == jnp.float32
  assert np.all(np.isfinite(logits))


@pytest.mark.smoke
def test_causality_loss_at_t_has_zero_grad_for_later_rows():
  # Two blocks: leaks could compound.
  cfg = ModelConfig(**dict(SMALL, num_layers=2))
  inputs, positions = _batch()
  model, variables = _init(cfg, inputs, positions)

  @jax.jit
  # weights [T]: one-hot selects the loss at token t.
  def table_grad(params, weights):
    def loss(p):
      logits = model.apply({'params': p}, inputs, positions)
      # [B, T]
      ce = optax.softmax_cross_entropy_with_integer_labels(
          logits, inputs[:, ::-1]
      )
      return jnp.sum(ce * weights)

    return position_table(jax.grad(loss)(params))

  for t in (0, 5, T - 1):
    g = table_grad(variables['params'], jax.nn.one_hot(t, T))
    row_norm = np.linalg.norm(np.asarray(g), axis=1)
    assert np.all(row_norm[t + 1 :] == 0.0), (t, row_norm)
    assert np.all(row_norm[: t + 1] > 0.0), (t, row_norm)


@pytest.mark.smoke
def test_packed_segments_do_not_attend_across_documents():
  cfg = ModelConfig(**SMALL)
  inputs, _ = _batch(b=1)
  segs = jnp.asarray([[1] * 5 + [2] * 7], jnp.int32)
  positions = jnp.asarray([list(range(5)) + list(range(7))], jnp.int32)
  model, variables = _init(cfg, inputs, positions, segs)
  f = jax.jit(model.apply)
  base = f({'params': variables['params']}, inputs, positions, segs)
  changed = inputs.at[0, :5].set((inputs[0, :5] + 3) % 16)
  out = f({'params': variables['params']}, changed, positions, segs)
  # Document 2 sees nothing of 1.
  np.testing.assert_array_equal(out[0, 5:], base[0, 5:])
  assert not np.allclose(out[0, :5], base[0, :5])
  # Without segment ids the same change does leak (the test can fail).
  leak = f({'params': variables['params']}, changed, positions)
  assert not np.allclose(
      leak[0, 5:], f({'params': variables['params']}, inputs, positions)[0, 5:]
  )


def test_padding_segment_zero_keeps_outputs_finite():
  cfg = ModelConfig(**SMALL)
  inputs, positions = _batch(b=1)
  segs = jnp.asarray([[1] * 8 + [0] * 4], jnp.int32)
  model, variables = _init(cfg, inputs, positions, segs)
  out = jax.jit(model.apply)(
      {'params': variables['params']}, inputs, positions, segs
  )
  assert np.all(np.isfinite(out))


@pytest.mark.parametrize('padding_position', [T, T + 40, -1])
def test_padding_outside_the_table_changes_no_loss_or_statistic(
    padding_position,
):
  """Padding (segment 0, loss_mask 0) at a position id outside the table: its
  NaN row reaches no real token, so the loss, gradients and statistics are
  those of the same padding inside the table (they were all NaN)."""
  cfg = ModelConfig(**SMALL)
  inputs, positions = _batch(b=2)
  segs = jnp.asarray([[1] * 8 + [0] * 4, [1] * 6 + [2] * 6], jnp.int32)
  model, variables = _init(cfg, inputs, positions, segs)

  def token_loss_fn(params, embed_delta, batch):
    logits = model.apply(
        {'params': params},
        batch['inputs'],
        batch['positions'],
        batch['segment_ids'],
        embed_delta=embed_delta,
    )
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, batch['targets']
    )

  grad_fn = jax.jit(
      stats_lib.value_and_grad_with_position_stats(
          token_loss_fn, cfg.max_len, cfg.emb_dim
      )
  )
  batch = {
      'inputs': inputs,
      'targets': jnp.roll(inputs, -1, axis=1),
      'positions': positions,
      'segment_ids': segs,
      'loss_mask': (segs > 0).astype(jnp.float32),
  }
  inside = grad_fn(variables['params'], batch)
  outside = grad_fn(
      variables['params'],
      dict(batch, positions=positions.at[0, 9].set(padding_position)),
  )
  for got, want in zip(
      jax.tree.leaves(outside), jax.tree.leaves(inside), strict=True
  ):
    assert np.all(np.isfinite(got))
    np.testing.assert_array_equal(got, want)


@pytest.mark.smoke
def test_embed_delta_grads_summed_by_position_equal_table_grad():
  cfg = ModelConfig(**SMALL)
  inputs, _ = _batch(b=3)
  # Packed rows with reset positions and an offset row: each row id appears
  # several times.
  positions = jnp.asarray(
      [
          list(range(6)) + list(range(6)),
          list(range(T)),
          list(range(3, 9)) + list(range(6)),
      ],
      jnp.int32,
  )
  segs = jnp.asarray([[1] * 6 + [2] * 6, [1] * T, [1] * 6 + [2] * 6], jnp.int32)
  model, variables = _init(cfg, inputs, positions, segs)

  def loss(params, delta):
    logits = model.apply(
        {'params': params}, inputs, positions, segs, embed_delta=delta
    )
    return optax.softmax_cross_entropy_with_integer_labels(
        logits, inputs
    ).mean()

  g_params, g_delta = jax.jit(jax.grad(loss, argnums=(0, 1)))(
      variables['params'], jnp.zeros((3, T, 16), jnp.float32)
  )
  pert = np.asarray(g_delta, np.float64)  # [B, T, D]
  expected = np.zeros((T, 16))
  np.add.at(expected, np.asarray(positions), pert)
  table_grad = np.asarray(position_table(g_params))
  assert np.abs(table_grad).max() > 0
  np.testing.assert_allclose(table_grad, expected, rtol=1e-5, atol=1e-9)


@pytest.mark.parametrize('kind', ['rope', 'sinusoidal', 'none'])
def test_fixed_position_variants_run_without_a_table(kind):
  cfg = ModelConfig(**SMALL, position_embedding=kind)
  inputs, positions = _batch()
  model, variables = _init(cfg, inputs, positions)
  assert 'pos_embed' not in variables['params']
  out = jax.jit(model.apply)({'params': variables['params']}, inputs, positions)
  assert out.shape == (B, T, 16) and np.all(np.isfinite(out))
  shifted = jax.jit(model.apply)(
      {'params': variables['params']}, inputs, positions + 40
  )
  if kind == 'none':
    np.testing.assert_array_equal(out, shifted)
  # Relative: a common shift changes nothing (up to rounding).
  elif kind == 'rope':
    np.testing.assert_allclose(out, shifted, atol=2e-4)
  else:
    assert not np.allclose(out, shifted, atol=1e-5)


def test_rope_uses_positions():
  cfg = ModelConfig(**SMALL, position_embedding='rope')
  inputs, positions = _batch(b=1)
  model, variables = _init(cfg, inputs, positions)
  f = jax.jit(model.apply)
  a = f({'params': variables['params']}, inputs, positions)
  b = f({'params': variables['params']}, inputs, positions * 3)
  assert not np.allclose(a, b, atol=1e-5)


def test_remat_gives_same_grads_and_dropout_uses_rng():
  inputs, positions = _batch()
  results = {}
  for remat in (False, True):
    cfg = ModelConfig(**SMALL, remat=remat, dropout_rate=0.1)
    model, variables = _init(cfg, inputs, positions)

    @jax.jit
    def loss_and_grad(p, key, model=model):
      def loss(p):
        logits = model.apply(
            {'params': p},
            inputs,
            positions,
            deterministic=False,
            rngs={'dropout': key},
        )
        return optax.softmax_cross_entropy_with_integer_labels(
            logits, inputs
        ).mean()

      return jax.value_and_grad(loss)(p)

    results[remat] = (loss_and_grad, variables['params'])
  fn0, params = results[False]
  fn1, _ = results[True]
  (l0, g0), (l1, g1) = fn0(params, jax.random.key(3)), fn1(
      params, jax.random.key(3)
  )
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
  l2, _ = fn1(params, jax.random.key(4))
  assert l2 != l1  # A different dropout key gives a different loss.
