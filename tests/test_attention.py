"""attention_impl='blocked' (layers.blocked_causal_attention) computes what
'xla' computes."""

from __future__ import annotations

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_posemb import layers
from flax_posemb import model as linen_model
from flax_posemb import nnx as posemb_nnx
from flax_posemb.model import ModelConfig

# packed docs + padding
_SEGMENTS = np.array(
    [[1] * 9 + [2] * 14 + [3] * 5 + [0] * 4, [1] * 32], np.int32
)


def _qkv(seed=0, b=2, t=32, n=2, h=8):
  k = jax.random.split(jax.random.key(seed), 3)
  return [jax.random.normal(x, (b, t, n, h), jnp.float32) for x in k]


@pytest.mark.parametrize('segments', [False, True])
@pytest.mark.parametrize('block', [8, 12, 32, 64])
def test_blocked_attention_matches_xla_values_and_gradients(segments, block):
  q, k, v = _qkv()
  mask = layers.segment_mask(jnp.asarray(_SEGMENTS)) if segments else None

  def xla(q, k, v):
    return jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, implementation='xla'
    )

  def blk(q, k, v):
    return layers.blocked_causal_attention(q, k, v, mask, block)

  np.testing.assert_allclose(blk(q, k, v), xla(q, k, v), atol=1e-5, rtol=1e-5)

  def loss(fn):
    return lambda *a: jnp.sum(jnp.sin(fn(*a)) * jnp.arange(8.0))

  g_xla = jax.grad(loss(xla), argnums=(0, 1, 2))(q, k, v)
  g_blk = jax.grad(loss(blk), argnums=(0, 1, 2))(q, k, v)
  for a, b in zip(g_blk, g_xla):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-5)


def test_blocked_attention_keeps_the_value_dtype():
  q, k, v = (x.astype(jnp.bfloat16) for x in _qkv())
  out = layers.blocked_causal_attention(q, k, v, None, 8)
  assert out.dtype == jnp.bfloat16 and out.shape == q.shape
  want = jax.nn.dot_product_attention(
      q, k, v, is_causal=True, implementation='xla'
  )
  np.testing.assert_allclose(
      out.astype(np.float32), want.astype(np.float32), atol=3e-2
  )


def _cfg(impl, **kw):
  return ModelConfig(
      vocab_size=32,
      num_layers=2,
      num_heads=2,
      emb_dim=16,
      mlp_dim=32,
      max_len=32,
      attention_impl=impl,
      **kw,
  )


def _batch():
  rng = np.random.default_rng(0)
  inputs = rng.integers(0, 32, _SEGMENTS.shape).astype(np.int32)
  positions = np.zeros_like(_SEGMENTS)
  # positions restart in each packed document
  for r, row in enumerate(_SEGMENTS):
    for i in range(1, row.size):
      positions[r, i] = positions[r, i - 1] + 1 if row[i] == row[i - 1] else 0
  return jnp.asarray(inputs), jnp.asarray(positions), jnp.asarray(_SEGMENTS)


@pytest.mark.parametrize(
    'extra', [{}, {'position_embedding': 'rope'}, {'remat': True}]
)
def test_linen_model_blocked_matches_xla_logits_and_gradients(extra):
  inputs, positions, seg = _batch()
  models = {
      i: linen_model.TransformerLM(_cfg(i, **extra)) for i in ('xla', 'blocked')
  }
  params = models['xla'].init(
      jax.random.key(0), inputs, positions, segment_ids=seg
  )['params']

  def loss(impl):
    def f(p):
      logits = models[impl].apply(
          {'params': p}, inputs, positions, segment_ids=seg
      )
      return jnp.mean(jax.nn.log_softmax(logits)[..., 0]), logits

    return jax.value_and_grad(f, has_aux=True)(params)

  (lx, logits_x), gx = loss('xla')
  (lb, logits_b), gb = loss('blocked')
  np.testing.assert_allclose(logits_b, logits_x, atol=1e-5, rtol=1e-5)
  np.testing.assert_allclose(lb, lx, atol=1e-6, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(gb), jax.tree.leaves(gx)):
    np.testing.assert_allclose(a, b, atol=1e-5, rtol=1e-4)


def test_nnx_model_blocked_matches_xla():
  inputs, positions, seg = _batch()
  ref = posemb_nnx.TransformerLM(_cfg('xla'), rngs=nnx.Rngs(1))
  blk = posemb_nnx.TransformerLM(_cfg('blocked'), rngs=nnx.Rngs(1))
  np.testing.assert_allclose(
      blk(inputs, positions, seg),
      ref(inputs, positions, seg),
      atol=1e-5,
      rtol=1e-5,
  )


def test_blocked_is_a_valid_attention_impl_and_others_are_not():
  assert 'blocked' in linen_model.ATTENTION_IMPLS
  _cfg('blocked', dtype='bfloat16')
  with pytest.raises(ValueError, match='Unknown attention_impl'):
    _cfg('flash')
