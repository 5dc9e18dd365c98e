"""Tests for flax_posemb.embeddings: lookups, the position guard, sinusoid, RoPE, tied head."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_posemb import embeddings
from flax_posemb import initializers


def _learned(check=True, n=8, d=4):
  mod = embeddings.LearnedPositionEmbedding(n, d, initializers.get('gpt2'),
                                            check_positions=check)
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


@pytest.mark.parametrize('bad,named', [(8, 'Position id 8'), (-1, 'Position id -1'),
                                        (1000, 'Position id 1000')])
def test_out_of_range_positions_raise_eagerly(bad, named):
  mod, params = _learned()
  with pytest.raises(ValueError, match=named) as e:
    mod.apply(params, jnp.array([[0, bad]], jnp.int32))
  assert '[0, 8)' in str(e.value)


@pytest.mark.parametrize('bad,named', [(8, 'Position id 8'), (-1, 'Position id -1')])
def test_out_of_range_positions_raise_under_jit(bad, named):
  mod, params = _learned()
  f = jax.jit(mod.apply)
  f(params, jnp.array([[0, 7]], jnp.int32)).block_until_ready()  # In range: fine.
  with pytest.raises(Exception, match=named) as e:
    jax.block_until_ready(f(params, jnp.array([[0, bad]], jnp.int32)))
  assert '[0, 8)' in str(e.value)


def test_out_of_range_positions_raise_under_jit_of_grad():
  mod, params = _learned()

  def loss(p, pos):
    return jnp.sum(mod.apply(p, pos) ** 2)

  g = jax.jit(jax.grad(loss))
  with pytest.raises(Exception, match='Position id -3'):
    jax.block_until_ready(g(params, jnp.array([[-3, 1]], jnp.int32)))


def test_out_of_range_positions_raise_under_vmap():
  mod, params = _learned()
  f = jax.jit(jax.vmap(lambda pos: mod.apply(params, pos)))
  assert f(jnp.array([[0, 1], [2, 7]], jnp.int32)).shape == (2, 2, 4)
  with pytest.raises(Exception, match='Position id 9'):
    jax.block_until_ready(f(jnp.array([[0, 1], [2, 9]], jnp.int32)))


def test_check_positions_false_does_not_raise():
  mod, params = _learned(check=False)
  out = jax.jit(mod.apply)(params, jnp.array([[0, 8]], jnp.int32))
  assert np.all(np.isfinite(out))


def test_float_positions_are_a_type_error():
  mod, params = _learned()
  with pytest.raises(TypeError, match='integer'):
    mod.apply(params, jnp.array([[0.0, 1.0]]))


def test_learned_dtypes():
  mod = embeddings.LearnedPositionEmbedding(8, 4, initializers.get('gpt2'),
                                            dtype=jnp.bfloat16, param_dtype=jnp.float32)
  params = mod.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
  assert params['params']['embedding'].dtype == jnp.float32
  assert mod.apply(params, jnp.zeros((1, 2), jnp.int32)).dtype == jnp.bfloat16


def test_token_embedding_attend_is_tied_and_float32():
  mod = embeddings.TokenEmbedding(10, 6, initializers.get('gpt2'), dtype=jnp.bfloat16)
  params = mod.init(jax.random.key(0), jnp.zeros((1, 2), jnp.int32))
  table = np.asarray(params['params']['embedding'], np.float32)
  ids = jnp.array([[1, 9]], jnp.int32)
  x = mod.apply(params, ids)
  assert x.dtype == jnp.bfloat16
  logits = mod.apply(params, x, method=mod.attend)
  assert logits.shape == (1, 2, 10) and logits.dtype == jnp.float32
  ref = np.asarray(x, np.float32) @ np.asarray(jnp.asarray(table, jnp.bfloat16), np.float32).T
  np.testing.assert_allclose(logits, ref, rtol=1e-2, atol=1e-5)


def test_sinusoidal_has_no_params_and_matches_formula():
  mod = embeddings.SinusoidalPositionEmbedding(8, scale=0.02)
  pos = jnp.array([[0, 5, 300]], jnp.int32)
  variables = mod.init(jax.random.key(0), pos)
  assert not variables
  out = np.asarray(mod.apply(variables, pos))
  assert out.shape == (1, 3, 8)
  s = 0.02 * math.sqrt(2)
  np.testing.assert_allclose(out[0, 2, 2], s * math.sin(300 / 10000 ** (2 / 8)), rtol=1e-4)
  np.testing.assert_allclose(out[0, 1, 5], s * math.cos(5 / 10000 ** (4 / 8)), rtol=1e-4)
  np.testing.assert_allclose(np.sqrt((out**2).mean(-1)), 0.02, rtol=1e-5)


def test_sinusoidal_module_matches_sinusoidal_initializer():
  mod = embeddings.SinusoidalPositionEmbedding(16, scale=0.05)
  fixed = np.asarray(mod.apply({}, jnp.arange(32, dtype=jnp.int32)))
  learned_init = np.asarray(initializers.get('sinusoidal', std=0.05)(jax.random.key(0),
                                                                       (32, 16)))
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
  np.testing.assert_allclose(jnp.linalg.norm(rq, axis=-1), jnp.linalg.norm(q, axis=-1),
                             rtol=1e-5)
  np.testing.assert_allclose(score(10, 3), score(110, 103), rtol=1e-4, atol=1e-5)
  assert not np.allclose(score(10, 3), score(10, 4), atol=1e-3)


def test_rope_rejects_odd_head_dim():
  with pytest.raises(ValueError, match='even head'):
    embeddings.apply_rope(jnp.zeros((1, 1, 1, 3)), jnp.zeros((1, 1), jnp.int32))
