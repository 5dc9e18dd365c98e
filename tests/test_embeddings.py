"""Tests for flax_posemb.embeddings: lookups, the host position check, sinusoid,
RoPE, tied head."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_posemb import embeddings
from flax_posemb import initializers


def _learned(n=8, d=4):
  mod = embeddings.LearnedPositionEmbedding(n, d, initializers.get('gpt2'))
  params = mod.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
  return mod, params


def test_learned_lookup_returns_table_rows():
  mod, params = _learned()
  table = params['params']['embedding']
  assert table.shape == (8, 4)
  pos = jnp.array([[0, 3, 7], [7, 7, 1]], jnp.int32)
  out = mod.apply(params, pos)
  assert out.shape == (2, 3, 4)
  np.testing.assert_array_equal(out, np.asarray(table)[np.asarray(pos)])


@pytest.mark.parametrize(
    'bad,named',
    [
        (8, 'Position id 8 is outside'),
        (-1, 'Position id -1 is negative'),
        (1000, 'Position id 1000 is outside'),
    ],
)
def test_position_range_check_names_the_id_and_the_table(bad, named):
  embeddings.check_position_range(np.array([[0, 7]]), 8)
  embeddings.check_position_range(np.zeros((0, 4), np.int32), 8)
  with pytest.raises(ValueError, match=named) as e:
    embeddings.check_position_range(np.array([[0, bad]]), 8)
  assert '[0, 8)' in str(e.value) and '1 ids outside' in str(e.value)


def test_position_range_message_names_the_library_argument_not_a_config():
  with pytest.raises(ValueError) as e:
    embeddings.check_position_range(np.array([[0, 9]]), 8)
  assert '>= 10 rows (num_positions' in str(e.value)
  assert 'model.max_len' not in str(e.value)
  assert 'data.seq_len' not in str(e.value)


def test_float_positions_are_an_error():
  mod, params = _learned()
  with pytest.raises(TypeError, match='integer'):
    mod.apply(params, jnp.array([[0.0, 1.0]]))


@pytest.mark.smoke
@pytest.mark.parametrize('bad', [8, -1, 1000])
@pytest.mark.parametrize('jit', [False, True])
def test_out_of_range_position_gives_nan_row_never_a_real_one(bad, jit):
  mod, params = _learned()
  table = np.asarray(params['params']['embedding'])
  apply = jax.jit(mod.apply) if jit else mod.apply
  out = np.asarray(apply(params, jnp.array([[0, bad, 7]], jnp.int32)))
  np.testing.assert_array_equal(out[0, 0], table[0])
  np.testing.assert_array_equal(out[0, 2], table[7])
  assert np.isnan(out[0, 1]).all()


def test_out_of_range_token_id_gives_nan_row():
  rows = embeddings.lookup_tokens(jnp.ones((5, 3)), jnp.array([-1, 5, 4]))
  assert np.isnan(rows[:2]).all() and not np.isnan(rows[2]).any()


def test_out_of_range_position_gives_no_table_gradient():
  mod, params = _learned()

  def total(p):
    rows = mod.apply(p, jnp.array([[1, 8, -1]], jnp.int32))
    return jnp.nansum(rows)

  grad = np.asarray(jax.grad(total)(params)['params']['embedding'])
  assert grad[1].sum() == grad.sum() == 4.0


def test_learned_dtypes():
  mod = embeddings.LearnedPositionEmbedding(
      8,
      4,
      initializers.get('gpt2'),
      dtype=jnp.bfloat16,
      param_dtype=jnp.float32,
  )
  params = mod.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
  assert params['params']['embedding'].dtype == jnp.float32
  assert mod.apply(params, jnp.zeros((1, 2), jnp.int32)).dtype == jnp.bfloat16


def test_token_embedding_attend_is_tied_and_float32():
  mod = embeddings.TokenEmbedding(
      10, 6, initializers.get('gpt2'), dtype=jnp.bfloat16
  )
  params = mod.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
  table = np.asarray(params['params']['embedding'], np.float32)
  ids = jnp.array([[1, 9]], jnp.int32)
  x = mod.apply(params, ids)
  assert x.dtype == jnp.bfloat16
  logits = mod.apply(params, x, method=mod.attend)
  assert logits.shape == (1, 2, 10) and logits.dtype == jnp.float32
  ref = (
      np.asarray(x, np.float32)
      @ np.asarray(jnp.asarray(table, jnp.bfloat16), np.float32).T
  )
  np.testing.assert_allclose(logits, ref, rtol=1e-2, atol=1e-5)


def test_sinusoidal_has_no_params_and_matches_formula():
  mod = embeddings.SinusoidalPositionEmbedding(8, scale=0.02)
  pos = jnp.array([[0, 5, 300]], jnp.int32)
  variables = mod.init(jax.random.key(0), pos)
  assert not variables
  out = np.asarray(mod.apply(variables, pos))
  assert out.shape == (1, 3, 8)
  s = 0.02 * math.sqrt(2)
  np.testing.assert_allclose(
      out[0, 2, 2], s * math.sin(300 / 10000 ** (2 / 8)), rtol=1e-4
  )
  np.testing.assert_allclose(
      out[0, 1, 5], s * math.cos(5 / 10000 ** (4 / 8)), rtol=1e-4
  )
  np.testing.assert_allclose(np.sqrt((out**2).mean(-1)), 0.02, rtol=1e-5)


def test_sinusoidal_module_matches_sinusoidal_initializer():
  mod = embeddings.SinusoidalPositionEmbedding(16, scale=0.05)
  fixed = np.asarray(mod.apply({}, jnp.arange(32, dtype=jnp.int32)))
  learned_init = np.asarray(
      initializers.get('sinusoidal', std=0.05)(jax.random.key(0), (32, 16))
  )
  np.testing.assert_allclose(fixed, learned_init, rtol=1e-4, atol=1e-6)


def test_rope_preserves_norm_and_depends_only_on_relative_position():
  rng = np.random.default_rng(0)
  q = jnp.asarray(rng.normal(size=(1, 1, 2, 8)), jnp.float32)
  k = jnp.asarray(rng.normal(size=(1, 1, 2, 8)), jnp.float32)

  def score(pq, pk):
    rq = embeddings.apply_rope(q, jnp.array([[pq]], jnp.int32))
    rk = embeddings.apply_rope(k, jnp.array([[pk]], jnp.int32))
    return np.asarray(jnp.sum(rq * rk, -1))

  rq = embeddings.apply_rope(q, jnp.array([[17]], jnp.int32))
  np.testing.assert_allclose(
      jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1), rtol=1e-5
  )
  np.testing.assert_allclose(
      score(10, 3), score(110, 103), rtol=1e-4, atol=1e-5
  )
  assert not np.allclose(score(10, 3), score(10, 4), atol=1e-3)


def test_lookup_takes_a_host_numpy_table_under_vmap():
  # Parameters read back with jax.device_get are numpy arrays.
  table = np.arange(8.0, dtype=np.float32).reshape(4, 2)
  rows = jax.vmap(lambda p: embeddings.lookup_positions(table, p))(
      jnp.array([[0, 3], [4, 1]])
  )
  np.testing.assert_array_equal(rows[0], table[[0, 3]])
  assert np.isnan(rows[1, 0]).all() and not np.isnan(rows[1, 1]).any()


def test_a_table_that_does_not_fit_names_the_library_arguments():
  """In your own loop: the fix names the module's arguments (and the
  ModelConfig field), not a command line's config path."""
  table = np.zeros((6, 4), np.float32)
  mod = embeddings.LearnedPositionEmbedding(
      num_positions=8, features=4, embedding_init=initializers.from_array(table)
  )
  with pytest.raises(ValueError) as e:
    mod.init(jax.random.key(0), jnp.zeros((1, 8), jnp.int32))
  assert 'num_positions=6' in str(e.value) and 'resize=' in str(e.value)
  assert 'model.max_len' not in str(e.value)
  assert 'model.position_init_resize' not in str(e.value)
