"""Tests for flax_posemb.nnx: parity with the linen model, parameter loading,
the guard, embed_delta gradients, dropout and remat, and the linen model under
nnx.bridge."""

import inspect

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from flax_posemb import embeddings
from flax_posemb import initializers
from flax_posemb import model as linen_model
from flax_posemb import nnx as posemb_nnx
from flax_posemb.model import ModelConfig

T, V, D = 12, 16, 16
SMALL = dict(
    vocab_size=V, num_layers=2, num_heads=2, emb_dim=D, mlp_dim=32, max_len=T
)


def _batch(b, seed=0, offset=0):
  rng = np.random.default_rng(seed)
  inputs = jnp.asarray(rng.integers(0, V, (b, T)), jnp.int32)
  positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (b, T)) + offset
  return inputs, positions


def _packed(b):
  """Rows of two documents each (positions restart at the boundary), last row
  padded."""
  inputs, _ = _batch(b, seed=b)
  cut = 5
  positions = jnp.asarray(
      [list(range(cut)) + list(range(T - cut))] * b, jnp.int32
  )
  segs = np.asarray([[1] * cut + [2] * (T - cut)] * b, np.int32)
  segs[-1, -3:] = 0
  return inputs, positions, jnp.asarray(segs)


def _linen_params(cfg, b=2):
  inputs, positions = _batch(b)
  return linen_model.TransformerLM(cfg).init(
      jax.random.key(0), inputs, positions
  )['params']


def _pair(cfg):
  """A linen params dict and an NNX model (other init seed) loaded with it."""
  params = _linen_params(cfg)
  model = posemb_nnx.TransformerLM(cfg, rngs=nnx.Rngs(1))
  return params, posemb_nnx.load_linen_params(model, params)


def _linen_logits(cfg, params, *args, **kw):
  return linen_model.TransformerLM(cfg).apply({'params': params}, *args, **kw)


@pytest.mark.parametrize('b', [2, 5])
def test_logits_match_linen_with_packed_segments_at_two_batch_sizes(b):
  cfg = ModelConfig(**SMALL)
  params, model = _pair(cfg)  # Params initialized at batch 2.
  inputs, positions, segs = _packed(b)
  want = _linen_logits(cfg, params, inputs, positions, segs)
  got = nnx.jit(lambda m, *a: m(*a))(model, inputs, positions, segs)
  assert got.shape == (b, T, V) and got.dtype == jnp.float32
  np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
  # The segment mask matters here: without it the logits differ.
  assert not np.allclose(model(inputs, positions), want, atol=1e-5)


@pytest.mark.parametrize('kind', ['learned', 'sinusoidal', 'rope', 'none'])
def test_logits_match_linen_for_each_position_embedding(kind):
  cfg = ModelConfig(**SMALL, position_embedding=kind)
  params, model = _pair(cfg)
  inputs, positions = _batch(3, offset=-1 if kind == 'learned' else 7)
  positions = jnp.maximum(positions, 0)
  delta = 0.05 * jax.random.normal(jax.random.key(2), (3, T, D))
  want = _linen_logits(cfg, params, inputs, positions, embed_delta=delta)
  np.testing.assert_allclose(
      model(inputs, positions, embed_delta=delta), want, atol=1e-5, rtol=0
  )
  # embed_delta is used (the comparison above would not notice it dropped in
  # both).
  assert not np.allclose(model(inputs, positions), want, atol=1e-5)


def test_bfloat16_compute_matches_linen():
  cfg = ModelConfig(**SMALL, dtype='bfloat16')
  params, model = _pair(cfg)
  inputs, positions, segs = _packed(2)
  want = _linen_logits(cfg, params, inputs, positions, segs)
  np.testing.assert_allclose(
      model(inputs, positions, segs), want, atol=1e-5, rtol=0
  )


def test_parameter_tree_mirrors_linen_paths_and_initializers():
  cfg = ModelConfig(
      **SMALL,
      position_init='sinusoidal',
      token_init='normal',
      token_init_std=0.5,
  )
  model = posemb_nnx.TransformerLM(cfg, rngs=nnx.Rngs(0))
  tree = posemb_nnx.to_linen_params(model)
  assert jax.tree.map(jnp.shape, tree) == jax.tree.map(
      jnp.shape, _linen_params(cfg)
  )
  assert model.blocks[1] is model.block_1 and len(model.blocks) == 2
  table = posemb_nnx.position_table(model)
  np.testing.assert_array_equal(table, tree['pos_embed']['embedding'])
  # The learnable sinusoid is deterministic: the same table as the linen model's
  # init.
  np.testing.assert_allclose(
      table, linen_model.position_table(_linen_params(cfg)), atol=1e-7
  )
  assert abs(float(jnp.std(model.token_embed.embedding[...])) - 0.5) < 0.1
  assert model.block_0.qkv.kernel.shape == (3 * D, D)  # (out, in), as linen.
  with pytest.raises(KeyError, match='not .learned'):
    posemb_nnx.position_table(
        posemb_nnx.TransformerLM(
            ModelConfig(**SMALL, position_embedding='rope'), rngs=nnx.Rngs(0)
        )
    )


def test_load_then_export_round_trips_linen_params():
  cfg = ModelConfig(**SMALL)
  params, model = _pair(cfg)
  out = posemb_nnx.to_linen_params(model)
  assert jax.tree.structure(out) == jax.tree.structure(
      jax.tree.map(np.asarray, params)
  )
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


def _mutated(params, path, value=None, delete=False):
  params = jax.tree.map(lambda x: x, params)  # Copy of the nested dicts.
  node = params
  for k in path[:-1]:
    node = node[k]
  if delete:
    del node[path[-1]]
  else:
    node[path[-1]] = value
  return params


@pytest.mark.parametrize(
    'change,match',
    [
        (
            lambda p: _mutated(
                p, ('pos_embed', 'embedding'), jnp.zeros((T + 1, D))
            ),
            (
                r'params/pos_embed/embedding has shape \(13, 16\) in the linen'
                r' params but \(12, 16\)'
            ),
        ),
        (
            lambda p: _mutated(
                p, ('block_1', 'qkv', 'kernel'), jnp.zeros((D, 3 * D))
            ),
            r'params/block_1/qkv/kernel has shape',
        ),
        (
            lambda p: _mutated(p, ('block_0', 'ln_2'), delete=True),
            r'params/block_0/ln_2/\w+ has shape absent in the linen params',
        ),
        (
            lambda p: _mutated(
                p, ('block_2',), {'ln_1': {'scale': jnp.ones(D)}}
            ),
            (
                r'params/block_2/ln_1/scale has shape \(16,\) in the linen'
                r' params but absent'
            ),
        ),
        (
            lambda p: _mutated(p, ('ln_f',), jnp.ones(D)),
            r'params/ln_f has shape \(16,\) in',
        ),
        (
            lambda p: _mutated(
                p, ('token_embed', 'embedding'), {'w': jnp.ones((V, D))}
            ),
            r'params/token_embed/embedding has shape absent',
        ),
    ],
)
def test_load_linen_params_names_the_mismatched_path_and_writes_nothing(
    change, match
):
  cfg = ModelConfig(**SMALL)
  model = posemb_nnx.TransformerLM(cfg, rngs=nnx.Rngs(1))
  before = posemb_nnx.to_linen_params(model)
  with pytest.raises(ValueError, match=match):
    posemb_nnx.load_linen_params(model, change(_linen_params(cfg)))
  for a, b in zip(
      jax.tree.leaves(posemb_nnx.to_linen_params(model)),
      jax.tree.leaves(before),
  ):
    np.testing.assert_array_equal(a, b)


def test_embed_delta_grads_summed_by_position_equal_table_grad():
  cfg = ModelConfig(**SMALL)
  _, model = _pair(cfg)
  inputs, _ = _batch(3)
  positions = jnp.asarray(
      [list(range(6)) * 2, list(range(T)), list(range(3, 9)) + list(range(6))],
      jnp.int32,
  )
  segs = jnp.asarray([[1] * 6 + [2] * 6, [1] * T, [1] * 6 + [2] * 6], jnp.int32)
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)

  @jax.jit
  def grads(params, delta):
    def loss(params, delta):
      m = nnx.merge(graphdef, params, rest)
      logits = m(inputs, positions, segs, embed_delta=delta)
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, inputs
      ).mean()

    return jax.grad(loss, argnums=(0, 1))(params, delta)

  g_params, g_delta = grads(params, jnp.zeros((3, T, D), jnp.float32))
  assert g_delta.dtype == jnp.float32
  expected = np.zeros((T, D))
  np.add.at(expected, np.asarray(positions), np.asarray(g_delta, np.float64))
  table_grad = np.asarray(g_params['pos_embed']['embedding'][...])
  assert np.abs(table_grad).max() > 0
  np.testing.assert_allclose(table_grad, expected, rtol=1e-5, atol=1e-9)


def test_embedding_modules_match_linen_and_the_pure_functions():
  init = initializers.get('gpt2')
  pos = jnp.asarray([[0, 3, 7], [7, 7, 1]], jnp.int32)
  learned = posemb_nnx.LearnedPositionEmbedding(
      8, 4, embedding_init=init, rngs=nnx.Rngs(0)
  )
  table = learned.embedding[...]
  assert table.shape == (8, 4)
  np.testing.assert_array_equal(
      learned(pos), np.asarray(table)[np.asarray(pos)]
  )
  tok = posemb_nnx.TokenEmbedding(
      8, 4, embedding_init=init, dtype=jnp.bfloat16, rngs=nnx.Rngs(0)
  )
  linen_tok = embeddings.TokenEmbedding(8, 4, init, dtype=jnp.bfloat16)
  variables = {'params': {'embedding': tok.embedding[...]}}
  x = jax.random.normal(jax.random.key(1), (2, 3, 4))
  np.testing.assert_array_equal(tok(pos), linen_tok.apply(variables, pos))
  logits = tok.attend(x)
  assert logits.dtype == jnp.float32
  np.testing.assert_array_equal(
      logits, linen_tok.apply(variables, x, method='attend')
  )
  sin = posemb_nnx.SinusoidalPositionEmbedding(6, scale=0.3)
  np.testing.assert_array_equal(
      sin(pos),
      embeddings.SinusoidalPositionEmbedding(6, scale=0.3).apply({}, pos),
  )
  q = jax.random.normal(jax.random.key(2), (2, 3, 2, 4))
  rotated = posemb_nnx.RotaryEmbedding()(q, pos)
  np.testing.assert_array_equal(rotated, embeddings.apply_rope(q, pos))
  assert not np.allclose(rotated, q)


@pytest.mark.parametrize(
    'nnx_module, linen_module',
    [
        (
            posemb_nnx.LearnedPositionEmbedding,
            embeddings.LearnedPositionEmbedding,
        ),
        (posemb_nnx.TokenEmbedding, embeddings.TokenEmbedding),
        (
            posemb_nnx.SinusoidalPositionEmbedding,
            embeddings.SinusoidalPositionEmbedding,
        ),
        (posemb_nnx.Block, linen_model.Block),
        (posemb_nnx.TransformerLM, linen_model.TransformerLM),
        # NNX builds the kernel at once: it needs the input width too.
        (posemb_nnx.Dense, linen_model._Dense),
    ],
)
def test_nnx_modules_take_the_keywords_of_their_linen_twins(
    nnx_module, linen_module
):
  """The NNX constructor's keywords are the linen module's fields (plus
  ``rngs``, which NNX parameters need), and their calls take the same
  arguments (plus NNX's ``rngs``)."""
  own = set(inspect.signature(nnx_module.__init__).parameters)
  own -= {'self', 'rngs', 'in_features'}
  fields = set(linen_module.__dataclass_fields__) - {'parent', 'name'}
  assert own == fields
  nnx_call = set(inspect.signature(nnx_module.__call__).parameters)
  linen_call = set(inspect.signature(linen_module.__call__).parameters)
  assert nnx_call - {'rngs'} == linen_call


def test_nnx_tables_are_built_with_the_linen_keywords():
  init = initializers.get('gpt2')
  learned = posemb_nnx.LearnedPositionEmbedding(
      num_positions=8, features=4, embedding_init=init, rngs=nnx.Rngs(0)
  )
  tok = posemb_nnx.TokenEmbedding(
      num_embeddings=6, features=4, embedding_init=init, rngs=nnx.Rngs(0)
  )
  assert learned.embedding[...].shape == (8, 4)
  assert tok.embedding[...].shape == (6, 4)
  with pytest.raises(TypeError):
    posemb_nnx.LearnedPositionEmbedding(rows=8, features=4, rngs=nnx.Rngs(0))


def test_nnx_padding_outside_the_table_leaves_real_tokens_finite():
  cfg = ModelConfig(**SMALL)
  _, model = _pair(cfg)
  inputs, positions, segs = _packed(2)
  base = model(inputs, positions, segs)
  outside = model(inputs, positions.at[-1, -1].set(T + 5), segs)
  real = np.asarray(segs) > 0
  assert np.all(np.isfinite(outside))
  np.testing.assert_array_equal(
      np.asarray(outside)[real], np.asarray(base)[real]
  )


@pytest.mark.smoke
@pytest.mark.parametrize('jit', [False, True])
def test_nnx_out_of_range_position_gives_nan_row(jit):
  learned = posemb_nnx.LearnedPositionEmbedding(
      8, 4, embedding_init=initializers.get('gpt2'), rngs=nnx.Rngs(0)
  )
  table = np.asarray(learned.embedding[...])
  call = nnx.jit(lambda m, p: m(p)) if jit else (lambda m, p: m(p))
  out = np.asarray(call(learned, jnp.asarray([[8, -1, 3]], jnp.int32)))
  assert np.isnan(out[0, :2]).all()
  np.testing.assert_array_equal(out[0, 2], table[3])


def test_linen_model_under_nnx_bridge_runs_at_another_batch_size():
  cfg = ModelConfig(**SMALL)
  inputs2, positions2 = _batch(2)
  bridged = nnx.bridge.ToNNX(linen_model.TransformerLM(cfg), rngs=nnx.Rngs(0))
  bridged.lazy_init(inputs2, positions2)
  params = nnx.to_pure_dict(nnx.state(bridged, nnx.Param))
  inputs5, positions5, segs5 = _packed(5)
  delta = 0.05 * jax.random.normal(jax.random.key(3), (5, T, D))
  out = bridged(inputs5, positions5, segs5, embed_delta=delta)
  assert out.shape == (5, T, V)
  np.testing.assert_allclose(
      out,
      _linen_logits(cfg, params, inputs5, positions5, segs5, embed_delta=delta),
      atol=1e-6,
      rtol=0,
  )
  native = posemb_nnx.load_linen_params(
      posemb_nnx.TransformerLM(cfg, rngs=nnx.Rngs(1)), params
  )
  np.testing.assert_allclose(
      native(inputs5, positions5, segs5, embed_delta=delta),
      out,
      atol=1e-5,
      rtol=0,
  )


def test_dropout_differs_from_deterministic_and_is_reproducible_from_rngs():
  cfg = ModelConfig(**SMALL, dropout_rate=0.2)
  inputs, positions = _batch(2)
  m1 = posemb_nnx.TransformerLM(cfg, rngs=nnx.Rngs(0))
  m2 = posemb_nnx.TransformerLM(cfg, rngs=nnx.Rngs(0))
  det = m1(inputs, positions)
  np.testing.assert_array_equal(det, m1(inputs, positions, deterministic=True))
  a = m1(inputs, positions, deterministic=False)
  assert not np.allclose(a, det, atol=1e-3)
  # Same Rngs.
  np.testing.assert_array_equal(a, m2(inputs, positions, deterministic=False))
  # Stream advanced.
  assert not np.allclose(m1(inputs, positions, deterministic=False), a)
  # Call-time rngs override the model's streams: equal keys, equal masks.
  c = m1(inputs, positions, deterministic=False, rngs=nnx.Rngs(dropout=7))
  np.testing.assert_array_equal(
      c, m2(inputs, positions, deterministic=False, rngs=nnx.Rngs(dropout=7))
  )
  assert not np.allclose(
      c, m1(inputs, positions, deterministic=False, rngs=nnx.Rngs(dropout=8))
  )

  # Dropout acts on the embedding sum too: its dropped entries get exactly zero
  # gradient.
  def zero_grad_fraction(deterministic):
    g = jax.grad(
        lambda delta: m1(
            inputs,
            positions,
            deterministic=deterministic,
            rngs=nnx.Rngs(dropout=7),
            embed_delta=delta,
        ).sum()
    )(jnp.zeros((2, T, D)))
    return float(np.mean(np.asarray(g) == 0.0))

  assert zero_grad_fraction(True) == 0.0
  assert 0.1 < zero_grad_fraction(False) < 0.3  # rate 0.2 of 384 entries.


def test_remat_checkpoints_blocks_and_gives_the_same_loss_and_grads():
  inputs, positions = _batch(2)
  results, own_streams = {}, {}
  for remat in (False, True):
    cfg = ModelConfig(**SMALL, remat=remat, dropout_rate=0.1)
    model = posemb_nnx.TransformerLM(cfg, rngs=nnx.Rngs(0))
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def loss(params, key, graphdef=graphdef, rest=rest):
      m = nnx.merge(graphdef, params, rest)
      logits = m(
          inputs, positions, deterministic=False, rngs=nnx.Rngs(dropout=key)
      )
      return optax.softmax_cross_entropy_with_integer_labels(
          logits, inputs
      ).mean()

    jaxpr = str(jax.make_jaxpr(jax.grad(loss))(params, jax.random.key(3)))
    assert ('checkpoint' in jaxpr or 'remat' in jaxpr) == remat
    results[remat] = jax.jit(jax.value_and_grad(loss))(
        params, jax.random.key(3)
    )
    # The model's own dropout streams advance through the checkpointed blocks
    # too.
    own_streams[remat] = [
        model(inputs, positions, deterministic=False) for _ in range(2)
    ]
  (l0, g0), (l1, g1) = results[False], results[True]
  for a, b in zip(own_streams[False], own_streams[True]):
    np.testing.assert_array_equal(a, b)
  assert not np.allclose(*own_streams[True])
  np.testing.assert_allclose(l0, l1, rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1)):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-7)
