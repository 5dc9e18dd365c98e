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
  """Learned absolute position table (GPT-2's `wpe`), NNX, with the keywords
  of `embeddings.LearnedPositionEmbedding` (plus `rngs`).

  Its parameter `embedding` is `[num_positions, features]`; an id outside the
  table gives a NaN row (ids are checked on the host,
  `embeddings.check_position_range`).

  Args:
    num_positions: rows of the table (`ModelConfig.max_len`).
    features: width of each row (`ModelConfig.emb_dim`).
    embedding_init: draws the table, `(key, shape, dtype) -> array`
      (`flax_posemb.initializers`; default GPT-2's normal(0.02)).
    dtype: dtype of the rows looked up; None = `param_dtype`.
    param_dtype: dtype of the stored table.
    rngs: `rngs.params()` draws the table.
  """

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
    """Looks up the rows of `positions`.

    Args:
      positions: integer position ids, `[...]` (e.g. `[B, T]` int32).

    Returns:
      The rows, `[..., features]` in `dtype`; NaN rows for ids outside the
      table.
    """
    return embeddings.lookup_positions(
        self.embedding[...], positions, self.dtype
    )


class TokenEmbedding(nnx.Module):
  """Token table with the tied output head (`attend`), NNX, with the keywords
  of `embeddings.TokenEmbedding` (plus `rngs`).

  Its parameter `embedding` is `[num_embeddings, features]`.

  Args:
    num_embeddings: rows of the table (the vocabulary size).
    features: width of each row (`ModelConfig.emb_dim`).
    embedding_init: draws the table, `(key, shape, dtype) -> array`
      (`flax_posemb.initializers`; default GPT-2's normal(0.02)).
    dtype: dtype of the rows and of `attend`; None = `param_dtype`.
    param_dtype: dtype of the stored table.
    rngs: `rngs.params()` draws the table.
  """

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
    """Looks up the rows of token `ids`.

    Args:
      ids: integer token ids, `[...]` (e.g. `[B, T]` int32).

    Returns:
      The rows, `[..., features]` in `dtype`; NaN rows for ids outside the
      table.
    """
    return embeddings.lookup_tokens(self.embedding[...], ids, self.dtype)

  def attend(self, x: Array) -> Array:
    """Logits of `x` against the token table (the tied output head).

    Args:
      x: activations, `[..., features]`.

    Returns:
      float32 logits, `[..., num_embeddings]`.
    """
    return embeddings.attend(x, self.embedding[...], self.dtype)


class SinusoidalPositionEmbedding(nnx.Module):
  """Fixed sinusoid position encoding at explicit positions; no parameters.

  Args:
    features: width of the encoding (even).
    scale: the encoding's root-mean-square over features.
    max_wavelength: the longest wavelength.
    dtype: dtype of the result.
  """

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
    """The encoding at `positions` (`embeddings.sinusoidal_encoding`).

    Args:
      positions: position ids >= 0, `[...]` (e.g. `[B, T]` int32).

    Returns:
      The encoding, `[..., features]` in `dtype`.
    """
    return embeddings.sinusoidal_encoding(
        positions,
        self.features,
        scale=self.scale,
        max_wavelength=self.max_wavelength,
        dtype=self.dtype,
    )


class RotaryEmbedding(nnx.Module):
  """RoPE (`embeddings.apply_rope`) as a module, for use in your own attention.

  `TransformerLM` does not hold one: it applies RoPE inside attention.

  Args:
    max_wavelength: the longest wavelength of the rotation.
  """

  def __init__(self, max_wavelength: float = 10_000.0):
    self.max_wavelength = max_wavelength

  def __call__(self, x: Array, positions: Array) -> Array:
    """Rotates queries or keys by their positions.

    Args:
      x: queries or keys, `[B, T, N, H]` (H even).
      positions: integer position ids, `[B, T]`.

    Returns:
      The rotated `x`, `[B, T, N, H]` in `x`'s dtype.
    """
    return embeddings.apply_rope(x, positions, self.max_wavelength)


class Dense(nnx.Module):
  """Affine layer with the kernel stored `(out, in)`, as the linen model's,
  with its keywords (`features`) plus `in_features` (NNX builds the kernel at
  once).

  Its parameters are `kernel` `[features, in_features]`, drawn from
  normal(0, `kernel_std`), and `bias` `[features]`, zeros.

  Args:
    in_features: input width.
    features: output width.
    kernel_std: std of the kernel's normal init.
    dtype: compute dtype.
    param_dtype: dtype of the stored parameters.
    rngs: `rngs.params()` draws the kernel.
  """

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
    """Applies the layer (`layers.dense`).

    Args:
      x: inputs, `[..., in_features]`.

    Returns:
      `[..., out_features]` in `dtype`.
    """
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
  """Pre-LN transformer block (`layers.block`), NNX.

  Its attributes (`ln_1`, `qkv`, `attn_out`, `ln_2`, `mlp_in`, `mlp_out`) are
  the linen `block_i` parameters.

  Args:
    config: the model config (widths, heads, dtypes, dropout).
    rngs: draws the parameters, and the dropout masks unless a call passes
      its own.
  """

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
    """Applies the block.

    Args:
      x: the residual stream, `[B, T, D]`.
      mask: bool `[B, 1, T, T]` (`layers.segment_mask`) or None (causal
        only).
      positions: int `[B, T]` position ids (for RoPE).
      deterministic: no dropout.
      rngs: dropout randomness for this call; None uses the module's.

    Returns:
      `[B, T, D]`.
    """
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
  """The NNX twin of `model.TransformerLM`: same logits, linen parameter paths.

  `to_linen_params` and `load_linen_params` convert parameters between the
  two.

  Args:
    config: the model config.
    rngs: draws the parameters, and the dropout masks unless a call passes
      its own.
  """

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
    """Next-token logits of a batch, as `model.TransformerLM`'s.

    Args:
      inputs: int32 token ids, `[B, T]`.
      positions: int32 position ids in `[0, max_len)`, `[B, T]`; an id
        outside gives NaN logits, except at padding, whose rows are never used
        (`layers.embedding_sum`).
      segment_ids: int32 `[B, T]`, the packed document of each token (0 =
        padding), or None (one document a row).
      deterministic: no dropout.
      embed_delta: float32 `[B, T, emb_dim]` added to the input embedding, or
        None (`layers.embedding_sum`).
      rngs: dropout randomness for this call; None uses the module's.

    Returns:
      float32 logits, `[B, T, vocab_size]`.
    """
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
  """The model's parameters as a linen `model.TransformerLM` params dict.

  Args:
    model: the NNX model.

  Returns:
    A nested dict of arrays with the linen model's paths and shapes (what
    `model.TransformerLM.init(...)['params']` holds).
  """
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def load_linen_params(
    model: TransformerLM, params: Mapping[str, Any]
) -> TransformerLM:
  """Copies linen parameters into an NNX model in place.

  Args:
    model: the NNX model to write into.
    params: a linen `model.TransformerLM` params tree (or
      `{'params': tree}`); each array is cast to the dtype of the variable it
      fills.

  Returns:
    `model`, updated.

  Raises:
    trees.TreeMismatchError: `params` has other paths or shapes than the
      model's; nothing is written.
  """
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
  """The learned position table of an NNX model.

  Args:
    model: the NNX model.

  Returns:
    The table, `[max_len, emb_dim]` in the parameter dtype.

  Raises:
    KeyError: the model has no learned table (`position_embedding` is not
      `'learned'`).
  """
  pos_embed = getattr(model, 'pos_embed', None)
  if not isinstance(pos_embed, LearnedPositionEmbedding):
    raise KeyError(
        "No learned position table at model.pos_embed.embedding; the model's "
        "position_embedding is not 'learned'."
    )
  return pos_embed.embedding[...]
