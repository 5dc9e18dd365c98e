"""NNX twins of the linen modules over the same functions: same logits, linen
parameter paths."""

from collections.abc import Mapping
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp

from flax_posemb import embeddings
from flax_posemb import initializers
from flax_posemb import layers
from flax_posemb import trees
from flax_posemb.model import ModelConfig
from flax_posemb.model import sinusoid_scale

Array = jax.Array
Dtype = Any
_GPT2_INIT = initializers.gpt2()


def _table_param(
    rows: int,
    features: int,
    embedding_init: initializers.InitFn,
    param_dtype: Dtype,
    rngs: nnx.Rngs,
) -> nnx.Param:
  """Parameter ``embedding`` [rows, features] drawn by ``embedding_init``."""
  return nnx.Param(embedding_init(rngs.params(), (rows, features), param_dtype))


class LearnedPositionEmbedding(nnx.Module):
  """Learned table ``embedding`` [num_positions, features] (the keywords of
  `embeddings.LearnedPositionEmbedding`); an id outside it gives a NaN row
  (ids are checked on the host)."""

  def __init__(
      self,
      num_positions: int,
      features: int,
      *,
      embedding_init: initializers.InitFn = _GPT2_INIT,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      rngs: nnx.Rngs,
  ):
    self.dtype = dtype or param_dtype
    self.embedding = _table_param(
        num_positions, features, embedding_init, param_dtype, rngs
    )

  def __call__(self, positions: Array) -> Array:
    return embeddings.lookup_positions(
        self.embedding[...], positions, self.dtype
    )


class TokenEmbedding(nnx.Module):
  """Token table ``embedding`` [num_embeddings, features] with the tied output
  head (the keywords of `embeddings.TokenEmbedding`)."""

  def __init__(
      self,
      num_embeddings: int,
      features: int,
      *,
      embedding_init: initializers.InitFn = _GPT2_INIT,
      dtype: Dtype | None = None,
      param_dtype: Dtype = jnp.float32,
      rngs: nnx.Rngs,
  ):
    self.dtype = dtype or param_dtype
    self.embedding = _table_param(
        num_embeddings, features, embedding_init, param_dtype, rngs
    )

  def __call__(self, ids: Array) -> Array:
    return embeddings.lookup_tokens(self.embedding[...], ids, self.dtype)

  def attend(self, x: Array) -> Array:
    """``[..., features]`` -> float32 logits ``[..., num_embeddings]``."""
    return embeddings.attend(x, self.embedding[...], self.dtype)


class SinusoidalPositionEmbedding(nnx.Module):
  """Fixed sinusoid of RMS ``scale`` at explicit positions; no parameters."""

  def __init__(
      self,
      features: int,
      *,
      scale: float = 1.0,
      max_wavelength: float = 10_000.0,
      dtype: Dtype = jnp.float32,
  ):
    self.features = features
    self.scale = scale
    self.max_wavelength = max_wavelength
    self.dtype = dtype

  def __call__(self, positions: Array) -> Array:
    return embeddings.sinusoidal_encoding(
        positions,
        self.features,
        scale=self.scale,
        max_wavelength=self.max_wavelength,
        dtype=self.dtype,
    )


class RotaryEmbedding(nnx.Module):
  """RoPE (`embeddings.apply_rope`) as a module (`TransformerLM` applies it in
  attention)."""

  def __init__(self, max_wavelength: float = 10_000.0):
    self.max_wavelength = max_wavelength

  def __call__(self, x: Array, positions: Array) -> Array:
    """Rotates queries or keys ``[B, T, N, H]`` (H even) by int ``positions``
    [B, T]."""
    return embeddings.apply_rope(x, positions, self.max_wavelength)


class Dense(nnx.Module):
  """``[..., in_features] -> [..., features]``; ``kernel`` [features,
  in_features] ~ normal(kernel_std), ``bias`` 0. The keywords of the linen
  model's dense layer, plus ``in_features`` (NNX builds the kernel at once)."""

  def __init__(
      self,
      in_features: int,
      features: int,
      *,
      kernel_std: float,
      dtype: Dtype,
      param_dtype: Dtype,
      rngs: nnx.Rngs,
  ):
    self.dtype = dtype
    self.kernel = nnx.Param(
        jax.nn.initializers.normal(kernel_std)(
            rngs.params(), (features, in_features), param_dtype
        )
    )
    self.bias = nnx.Param(jnp.zeros((features,), param_dtype))

  def __call__(self, x: Array) -> Array:
    return layers.dense(x, self.kernel[...], self.bias[...], self.dtype)


def _layer_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(
      cfg.emb_dim,
      epsilon=layers.LAYER_NORM_EPSILON,
      dtype=cfg.compute_dtype,
      param_dtype=cfg.storage_dtype,
      rngs=rngs,
  )


class Block(nnx.Module):
  """Pre-LN transformer block (`layers.block`); attributes as the linen
  ``block_i`` params."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    cfg = config
    d = cfg.emb_dim
    dense = {
        'dtype': cfg.compute_dtype,
        'param_dtype': cfg.storage_dtype,
        'rngs': rngs,
    }
    resid_std = layers.resid_std(cfg.num_layers)
    self.ln_1 = _layer_norm(cfg, rngs)
    self.qkv = Dense(d, 3 * d, kernel_std=layers.DENSE_STD, **dense)
    self.attn_out = Dense(d, d, kernel_std=resid_std, **dense)
    self.ln_2 = _layer_norm(cfg, rngs)
    self.mlp_in = Dense(d, cfg.mlp_dim, kernel_std=layers.DENSE_STD, **dense)
    self.mlp_out = Dense(cfg.mlp_dim, d, kernel_std=resid_std, **dense)
    self.drop_attn = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
    self.drop_mlp = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

  def __call__(
      self,
      x: Array,
      mask: Array | None,
      positions: Array,
      deterministic: bool = True,
      rngs: nnx.Rngs | None = None,
  ) -> Array:
    """``x`` [B, T, D], ``mask`` bool [B, 1, T, T] (None: causal), ``positions``
    [B, T]."""
    return layers.block(
        x,
        mask,
        positions,
        self.config,
        ln_1=self.ln_1,
        qkv=self.qkv,
        attn_out=self.attn_out,
        ln_2=self.ln_2,
        mlp_in=self.mlp_in,
        mlp_out=self.mlp_out,
        drop_attn=lambda y: self.drop_attn(
            y, deterministic=deterministic, rngs=rngs
        ),
        drop_mlp=lambda y: self.drop_mlp(
            y, deterministic=deterministic, rngs=rngs
        ),
    )


_remat_block = nnx.remat(
    Block.__call__, static_argnums=(4,), graph_updates=False
)


class TransformerLM(nnx.Module):
  """The NNX twin of `model.TransformerLM`."""

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    self.config = config
    cfg = config
    dt = cfg.compute_dtype
    pdt = cfg.storage_dtype
    self.token_embed = TokenEmbedding(
        cfg.vocab_size,
        cfg.emb_dim,
        dtype=dt,
        param_dtype=pdt,
        embedding_init=cfg.token_initializer(),
        rngs=rngs,
    )
    pos_embed: LearnedPositionEmbedding | SinusoidalPositionEmbedding | None
    if cfg.position_embedding == 'learned':
      pos_embed = LearnedPositionEmbedding(
          cfg.max_len,
          cfg.emb_dim,
          embedding_init=cfg.position_initializer(),
          dtype=jnp.float32,
          param_dtype=pdt,
          rngs=rngs,
      )
    elif cfg.position_embedding == 'sinusoidal':
      pos_embed = SinusoidalPositionEmbedding(
          cfg.emb_dim, scale=sinusoid_scale(cfg)
      )
    else:
      pos_embed = None  # rope / none
    self.pos_embed = pos_embed
    self.drop_embed = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
    for i in range(cfg.num_layers):
      setattr(self, f'block_{i}', Block(cfg, rngs=rngs))
    self.ln_f = _layer_norm(cfg, rngs)

  @property
  def blocks(self) -> tuple[Block, ...]:  # block_0 ... block_{L-1}
    return tuple(
        getattr(self, f'block_{i}') for i in range(self.config.num_layers)
    )

  def __call__(
      self,
      inputs: Array,
      positions: Array,
      segment_ids: Array | None = None,
      *,
      deterministic: bool = True,
      embed_delta: Array | None = None,
      rngs: nnx.Rngs | None = None,
  ) -> Array:
    """float32 logits [B, T, vocab_size], as `model.TransformerLM`'s."""
    cfg = self.config
    pos_rows = None if self.pos_embed is None else self.pos_embed(positions)
    x = layers.embedding_sum(
        self.token_embed(inputs), pos_rows, embed_delta, segment_ids
    )
    x = self.drop_embed(
        x.astype(cfg.compute_dtype), deterministic=deterministic, rngs=rngs
    )
    mask = layers.segment_mask(segment_ids)
    apply = _remat_block if cfg.remat else Block.__call__
    for block in self.blocks:
      x = apply(block, x, mask, positions, deterministic, rngs)
    return self.token_embed.attend(self.ln_f(x))


def to_linen_params(model: TransformerLM) -> dict[str, Any]:
  """The model's parameters as a linen `TransformerLM` `params` dict (same
  paths/shapes)."""
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def load_linen_params(
    model: TransformerLM, params: Mapping[str, Any]
) -> TransformerLM:
  """Copies linen params (or ``{'params': ...}``) into ``model`` in place, cast
  to its dtypes; a different tree raises `trees.TreeMismatchError` and writes
  nothing."""
  if set(params) == {'params'}:
    params = params['params']
  state = nnx.state(model, nnx.Param)
  trees.check_same_tree(
      'params',
      params,
      nnx.to_pure_dict(state),
      'linen params do not fit this NNX model',
      'Build both models from the same ModelConfig.',
      where='the linen params',
  )

  def cast(variable, value):
    return variable.replace(jnp.asarray(value, variable.dtype))

  nnx.replace_by_pure_dict(state, dict(params), cast)
  nnx.update(model, state)
  return model


def position_table(model: TransformerLM) -> Array:
  """The learned position table ``[max_len, emb_dim]`` (KeyError if none)."""
  pos_embed = getattr(model, 'pos_embed', None)
  if not isinstance(pos_embed, LearnedPositionEmbedding):
    raise KeyError(
        "No learned position table at model.pos_embed.embedding; the model's "
        "position_embedding is not 'learned'."
    )
  return pos_embed.embedding[...]
