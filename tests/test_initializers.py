"""Tests for flax_posemb.initializers: statistics, truncation, registry,
same_as_token."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from flax_posemb import initializers
from flax_posemb.model import ModelConfig
from flax_posemb.model import TransformerLM

SHAPE = (2048, 256)

# (name, overrides, realized std; RMS for the sinusoid) — literal figures from
# REFERENCES.md, not from the code.
EXPECTED_STD = [
    ('gpt2', {}, 0.02),
    ('gpt2_openai', {}, 0.01),
    # TF truncated normal(0.02): cut at 2 std, not rescaled.
    ('bert', {}, 0.0176),
    ('normal', {'std': 1.0}, 1.0),
    ('truncated_normal', {'std': 0.1}, 0.088),
    ('flax_default', {}, 1 / 16),  # 1/sqrt(256)
    ('word2vec', {}, 0.5 / 256 / math.sqrt(3)),
    ('small_uniform', {}, 1e-4 / math.sqrt(3)),
    ('sinusoidal', {'std': 0.02}, 0.02),
]


@pytest.mark.parametrize(
    'name,overrides,std', EXPECTED_STD, ids=[e[0] for e in EXPECTED_STD]
)
def test_realized_std_within_3_percent_on_2048x256(name, overrides, std):
  init = initializers.get(name, **overrides)
  x = np.asarray(init(jax.random.key(0), SHAPE, jnp.float32))
  assert x.shape == SHAPE and x.dtype == np.float32
  # = std for the zero-mean draws
  rms = np.sqrt(np.mean(x.astype(np.float64) ** 2))
  assert abs(rms - std) / std < 0.03, (name, rms, std)
  assert abs(init.expected_std(SHAPE[1]) - std) / std < 0.01
  if name != 'sinusoidal':
    assert abs(x.mean()) < 0.05 * std


def test_bert_truncated_at_two_std_and_not_rescaled():
  x = np.asarray(initializers.get('bert')(jax.random.key(1), SHAPE))
  assert np.abs(x).max() <= 0.04 + 1e-7
  # Not rescaled: values reach close to the 2-std cut (a rescaled draw would cut
  # at 0.0455 and have std 0.02).
  assert np.abs(x).max() > 0.039
  assert x.std() < 0.018


def test_truncated_normal_respects_bound_for_given_std():
  x = np.asarray(
      initializers.get('truncated_normal', std=0.5)(jax.random.key(2), SHAPE)
  )
  assert np.abs(x).max() <= 1.0 + 1e-6


def test_uniform_bounds():
  w = np.asarray(initializers.get('word2vec')(jax.random.key(3), SHAPE))
  assert np.abs(w).max() <= 0.5 / 256 and np.abs(w).max() > 0.49 / 256
  s = np.asarray(initializers.get('small_uniform')(jax.random.key(3), SHAPE))
  assert np.abs(s).max() <= 1e-4 and np.abs(s).max() > 0.99e-4


def test_zeros_are_zero():
  assert not np.any(
      np.asarray(initializers.get('zeros')(jax.random.key(0), (4, 8)))
  )


def test_sinusoidal_init_is_scaled_vaswani_table():
  x = np.asarray(
      initializers.get('sinusoidal', std=0.02)(jax.random.key(0), (50, 16))
  )
  p, i = 7, 3  # column 2i = sin(p / 10000**(2i/d)), 2i+1 = cos
  scale = 0.02 * math.sqrt(2)
  np.testing.assert_allclose(
      x[p, 2 * i], scale * math.sin(p / 10000 ** (2 * i / 16)), rtol=1e-5
  )
  np.testing.assert_allclose(
      x[p, 2 * i + 1], scale * math.cos(p / 10000 ** (2 * i / 16)), rtol=1e-5
  )
  np.testing.assert_allclose(np.sqrt((x**2).mean(axis=1)), 0.02, rtol=1e-5)


def test_dtype_is_respected():
  for name in ('gpt2', 'bert', 'word2vec', 'flax_default'):
    assert (
        initializers.get(name)(jax.random.key(0), (4, 8), jnp.bfloat16).dtype
        == jnp.bfloat16
    )


def test_unknown_name_lists_valid_names():
  with pytest.raises(ValueError, match='valid names') as e:
    initializers.get('gtp2')
  for n in initializers.NAMES:
    assert n in str(e.value)


@pytest.mark.parametrize('name', initializers.NAMES)
def test_every_registered_initializer_draws_the_std_it_reports(name):
  """Whatever the registry holds: a table of the asked shape and dtype, finite,
  whose realized RMS is its `expected_std` (the sinusoid's scale and
  same_as_token's source use it)."""
  std = 0.05 if name in initializers.STD_NAMES else None
  init = initializers.resolve(
      name, token_init=initializers.get('gpt2'), std=std
  )
  x = np.asarray(init(jax.random.key(0), SHAPE, jnp.float32), np.float64)
  assert x.shape == SHAPE and np.isfinite(x).all()
  rms = np.sqrt(np.mean(x**2))
  want = init.expected_std(SHAPE[1])
  if want == 0:
    assert rms == 0
  else:
    assert abs(rms - want) / want < 0.03, (name, rms, want)


def test_bad_overrides_and_missing_std_raise():
  with pytest.raises(ValueError, match='does not accept'):
    initializers.get('zeros', std=0.1)
  with pytest.raises(ValueError, match='needs a std'):
    initializers.get('normal')
  with pytest.raises(ValueError, match='>= 0'):
    initializers.get('gpt2', std=-1.0)
  with pytest.raises(ValueError, match='token_init'):
    initializers.get('same_as_token')
  with pytest.raises(ValueError, match='does not accept'):
    initializers.resolve(
        'word2vec', token_init=initializers.get('gpt2'), std=0.1
    )


def test_resolve_same_as_token_and_sinusoidal_follow_token_init():
  tok = initializers.get('flax_default')
  assert initializers.resolve('same_as_token', token_init=tok) is tok
  sin = initializers.resolve('sinusoidal', token_init=tok)
  x = np.asarray(sin(jax.random.key(0), (64, 256)))
  np.testing.assert_allclose(np.sqrt((x**2).mean()), 1 / 16, rtol=1e-4)


def _position_table_std(**cfg):
  cfg = ModelConfig(
      vocab_size=8,
      num_layers=1,
      num_heads=1,
      emb_dim=256,
      mlp_dim=8,
      max_len=2048,
      **cfg,
  )
  x = jnp.zeros((1, 4), jnp.int32)
  p = jnp.arange(4, dtype=jnp.int32)[None]
  params = jax.jit(TransformerLM(cfg).init)(jax.random.key(0), x, p)['params']
  table = np.asarray(params['pos_embed']['embedding'], np.float64)
  # RMS (the sinusoid is not zero-mean)
  return float(np.sqrt(np.mean(table**2)))


@pytest.mark.parametrize(
    'token_cfg,std',
    [
        ({'token_init': 'gpt2'}, 0.02),
        ({'token_init': 'flax_default'}, 1 / 16),
        ({'token_init': 'gpt2', 'token_init_std': 0.05}, 0.05),
        ({'token_init': 'bert'}, 0.0176),
    ],
)
def test_same_as_token_follows_the_model_token_init(token_cfg, std):
  got = _position_table_std(position_init='same_as_token', **token_cfg)
  assert abs(got - std) / std < 0.03, (token_cfg, got)


def test_model_sinusoidal_init_scales_to_token_std():
  got = _position_table_std(
      position_init='sinusoidal', token_init='flax_default'
  )
  assert abs(got - 1 / 16) / (1 / 16) < 0.03
