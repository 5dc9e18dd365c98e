"""Flax NNX twins of the linen embeddings and `TransformerLM`.

Import as `from flax_posemb import nnx as posemb_nnx` (this module imports
`flax.nnx` as `nnx`). The maths is the pure functions of `flax_posemb.layers` and
`flax_posemb.embeddings` that the linen modules call too, so with the same
parameters the NNX model gives the linen model's logits:

  >>> from flax import nnx
  >>> from flax_posemb import nnx as posemb_nnx
  >>> model = posemb_nnx.TransformerLM(cfg, rngs=nnx.Rngs(0))
  >>> posemb_nnx.load_linen_params(model, linen_variables['params'])
  >>> logits = model(inputs, positions, segment_ids)        # float32 [B, T, V]

Attribute paths mirror the linen parameter paths: `model.token_embed.embedding`,
`model.pos_embed.embedding` (learned tables only), `model.block_0 ...
model.block_{L-1}` (also `model.blocks`) with `ln_1`, `qkv`, `attn_out`, `ln_2`,
`mlp_in`, `mlp_out` (`kernel` stored (out, in), `bias`), and `model.ln_f`, so
`nnx.to_pure_dict(nnx.state(model, nnx.Param))` has exactly the linen `params` tree
(`to_linen_params`).

Dropout: every `nnx.Dropout` forks the `dropout` stream of the `rngs` given at
construction (falling back to `default`), so two models built from equal `Rngs`
draw equal masks; `rngs=` at call time overrides the stream with a fresh one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from flax import nnx
from flax import traverse_util
import jax
import jax.numpy as jnp

from flax_posemb import embeddings
from flax_posemb import initializers
from flax_posemb import layers
from flax_posemb.model import ModelConfig
from flax_posemb.model import sinusoid_scale

Array = jax.Array
Dtype = Any

apply_rope = embeddings.apply_rope

__all__ = [
    'Block',
    'Dense',
    'LearnedPositionEmbedding',
    'RotaryEmbedding',
    'SinusoidalPositionEmbedding',
    'TokenEmbedding',
    'TransformerLM',
    'apply_rope',
    'load_linen_params',
    'position_table',
    'to_linen_params',
]


class LearnedPositionEmbedding(nnx.Module):
  """Learned absolute position table (linen twin in embeddings).

  Parameter `embedding` `[num_positions, features]`; ids are assumed in range (checked on
  the host, `embeddings.check_position_range`).

  Args:
    num_positions: Table rows (largest position id + 1).
    features: Embedding width.
    embedding_init: Initializer `(key, shape, dtype) -> Array`.
    dtype: Output dtype (None = `param_dtype`).
    param_dtype: Table storage dtype.
    rngs: Draws the table from its `params` stream.
  """

  def __init__(self, num_positions: int, features: int, *,
               embedding_init: initializers.InitFn = initializers.gpt2(),
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               rngs: nnx.Rngs):
    self.num_positions, self.features = num_positions, features
    self.dtype, self.param_dtype = dtype, param_dtype
    self.embedding = nnx.Param(
        embedding_init(rngs.params(), (num_positions, features), param_dtype))

  def __call__(self, positions: Array) -> Array:
    """Looks up rows.

    Args:
      positions: Integer array `[...]` (typically `[B, T]`).

    Returns:
      `[..., features]` in `dtype` (`param_dtype` if None).
    """
    return embeddings.lookup_positions(self.embedding[...], positions,
                                       dtype=self.dtype or self.param_dtype)


class TokenEmbedding(nnx.Module):
  """Token table `embedding` `[num_embeddings, features]` with a tied output head.

  Token ids past the table give NaN rows (a too-small vocabulary shows as NaN loss).

  Args:
    num_embeddings: Vocabulary size.
    features: Embedding width.
    embedding_init: Initializer `(key, shape, dtype) -> Array`.
    dtype: Compute dtype of lookups and `attend` (None = `param_dtype`).
    param_dtype: Table storage dtype.
    rngs: Draws the table from its `params` stream.
  """

  def __init__(self, num_embeddings: int, features: int, *,
               embedding_init: initializers.InitFn = initializers.gpt2(),
               dtype: Dtype | None = None, param_dtype: Dtype = jnp.float32,
               rngs: nnx.Rngs):
    self.num_embeddings, self.features = num_embeddings, features
    self.dtype, self.param_dtype = dtype, param_dtype
    self.embedding = nnx.Param(
        embedding_init(rngs.params(), (num_embeddings, features), param_dtype))

  def __call__(self, ids: Array) -> Array:
    """Looks up token rows: int `[...]` -> `[..., features]` in `dtype`."""
    return embeddings.lookup_tokens(self.embedding[...], ids, self.dtype or self.param_dtype)

  def attend(self, x: Array) -> Array:
    """Tied output head: `[..., features]` -> float32 logits `[..., num_embeddings]`."""
    return embeddings.attend(x, self.embedding[...], self.dtype or self.param_dtype)


class SinusoidalPositionEmbedding(nnx.Module):
  """Fixed Vaswani sinusoid with RMS `scale` at explicit positions; no parameters.

  Args:
    features: Encoding width.
    scale: RMS of the entries (TransformerLM uses the token init's std).
    max_wavelength: Base of the wavelength progression.
    dtype: Output dtype.
  """

  def __init__(self, features: int, *, scale: float = 1.0, max_wavelength: float = 10_000.0,
               dtype: Dtype = jnp.float32):
    self.features, self.scale = features, scale
    self.max_wavelength, self.dtype = max_wavelength, dtype

  def __call__(self, positions: Array) -> Array:
    """Encodes integer positions `[...]` -> `[..., features]` in `dtype`."""
    return embeddings.sinusoidal_encoding(positions, self.features, scale=self.scale,
                                          max_wavelength=self.max_wavelength, dtype=self.dtype)


class RotaryEmbedding(nnx.Module):
  """Rotary position embedding (RoPE) as a parameter-free module over `apply_rope`.

  `TransformerLM` applies RoPE inside `layers.attention` (no module needed); this
  wrapper is for models assembled from these parts.

  Args:
    max_wavelength: Base of the wavelength progression.
  """

  def __init__(self, max_wavelength: float = 10_000.0):
    self.max_wavelength = max_wavelength

  def __call__(self, x: Array, positions: Array) -> Array:
    """Rotates queries or keys `[B, T, N, H]` (H even) by int `positions` `[B, T]`."""
    return embeddings.apply_rope(x, positions, self.max_wavelength)


class Dense(nnx.Module):
  """Dense layer `[..., in] -> [..., out]`, kernel stored `[out, in]` (as linen `_Dense`).

  Args:
    in_features: Input width.
    out_features: Output width.
    kernel_std: Std of the normal kernel init (bias starts at zero).
    dtype: Compute dtype.
    param_dtype: Storage dtype.
    rngs: Draws the kernel from its `params` stream.
  """

  def __init__(self, in_features: int, out_features: int, *, kernel_std: float, dtype: Dtype,
               param_dtype: Dtype, rngs: nnx.Rngs):
    self.dtype = dtype
    self.kernel = nnx.Param(jax.nn.initializers.normal(kernel_std)(
        rngs.params(), (out_features, in_features), param_dtype))
    self.bias = nnx.Param(jnp.zeros((out_features,), param_dtype))

  def __call__(self, x: Array) -> Array:
    """`[..., in]` -> `[..., out]` in `dtype`."""
    return layers.dense(x, self.kernel[...], self.bias[...], self.dtype)


def _layer_norm(cfg: ModelConfig, rngs: nnx.Rngs) -> nnx.LayerNorm:
  return nnx.LayerNorm(cfg.emb_dim, epsilon=layers.LAYER_NORM_EPSILON, dtype=cfg.compute_dtype,
                       param_dtype=cfg.storage_dtype, rngs=rngs)


class Block(nnx.Module):
  """Pre-LN transformer block (`layers.block`); attributes as the linen `block_i` params.

  Args:
    config: A `ModelConfig`.
    rngs: `params` stream for the dense kernels, `dropout` stream for the dropouts.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    cfg = self.config = config
    d, dt, pdt = cfg.emb_dim, cfg.compute_dtype, cfg.storage_dtype
    resid_std = layers.resid_std(cfg.num_layers)
    self.ln_1 = _layer_norm(cfg, rngs)
    self.qkv = Dense(d, 3 * d, kernel_std=layers.DENSE_STD, dtype=dt, param_dtype=pdt,
                     rngs=rngs)
    self.attn_out = Dense(d, d, kernel_std=resid_std, dtype=dt, param_dtype=pdt, rngs=rngs)
    self.ln_2 = _layer_norm(cfg, rngs)
    self.mlp_in = Dense(d, cfg.mlp_dim, kernel_std=layers.DENSE_STD, dtype=dt,
                        param_dtype=pdt, rngs=rngs)
    self.mlp_out = Dense(cfg.mlp_dim, d, kernel_std=resid_std, dtype=dt, param_dtype=pdt,
                         rngs=rngs)
    self.drop_attn = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
    self.drop_mlp = nnx.Dropout(cfg.dropout_rate, rngs=rngs)

  def __call__(self, x: Array, mask: Array | None, positions: Array, *,
               deterministic: bool = True, rngs: nnx.Rngs | None = None) -> Array:
    """Applies the block.

    Args:
      x: `[B, T, D]` in the compute dtype.
      mask: bool `[B, 1, T, T]` (True = may attend), or None for causal only.
      positions: int `[B, T]` (used by RoPE).
      deterministic: Disables dropout.
      rngs: Optional dropout streams overriding the block's own.

    Returns:
      `[B, T, D]`.
    """
    cfg = self.config
    return layers.block(
        x, mask, positions, ln_1=self.ln_1, qkv=self.qkv, attn_out=self.attn_out,
        ln_2=self.ln_2, mlp_in=self.mlp_in, mlp_out=self.mlp_out,
        drop_attn=lambda y: self.drop_attn(y, deterministic=deterministic, rngs=rngs),
        drop_mlp=lambda y: self.drop_mlp(y, deterministic=deterministic, rngs=rngs),
        num_heads=cfg.num_heads, rope=cfg.position_embedding == 'rope',
        implementation=cfg.attention_impl)


def _apply_block(block: Block, x: Array, mask: Array | None, positions: Array,
                 deterministic: bool, rngs: nnx.Rngs | None) -> Array:
  return block(x, mask, positions, deterministic=deterministic, rngs=rngs)


# `cfg.remat`: recompute each block's activations in the backward pass (static flag 4).
_remat_block = nnx.remat(_apply_block, static_argnums=(4,), graph_updates=False)


class TransformerLM(nnx.Module):
  """GPT-2-style decoder-only LM in NNX; same maths and parameters as `model.TransformerLM`.

  Args:
    config: A `ModelConfig` (same defaults and initializers as linen).
    rngs: `params` stream (or `default`) draws the parameters; the `dropout` stream
      (or `default`) seeds the dropout layers.

  Attributes:
    token_embed: `TokenEmbedding` (`embedding` `[vocab_size, emb_dim]`), also the head.
    pos_embed: `LearnedPositionEmbedding` (`embedding` `[max_len, emb_dim]`),
      `SinusoidalPositionEmbedding`, or None (rope / none).
    block_0 ... block_{L-1}: `Block`s (`blocks` lists them in order).
    ln_f: Final `nnx.LayerNorm`.
  """

  def __init__(self, config: ModelConfig, *, rngs: nnx.Rngs):
    if not isinstance(config, ModelConfig):
      raise TypeError(f"TransformerLM needs a ModelConfig, got {type(config).__name__}; use "
                      "ModelConfig.from_config(config.model).")
    cfg = self.config = config
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    self.token_embed = TokenEmbedding(cfg.vocab_size, cfg.emb_dim,
                                      embedding_init=cfg.token_initializer(), dtype=dt,
                                      param_dtype=pdt, rngs=rngs)
    if cfg.position_embedding == 'learned':
      self.pos_embed = LearnedPositionEmbedding(
          cfg.max_len, cfg.emb_dim, embedding_init=cfg.position_initializer(),
          dtype=jnp.float32, param_dtype=pdt, rngs=rngs)
    elif cfg.position_embedding == 'sinusoidal':
      self.pos_embed = SinusoidalPositionEmbedding(cfg.emb_dim, scale=sinusoid_scale(cfg))
    else:
      self.pos_embed = None
    self.drop_embed = nnx.Dropout(cfg.dropout_rate, rngs=rngs)
    for i in range(cfg.num_layers):
      setattr(self, f'block_{i}', Block(cfg, rngs=rngs))
    self.ln_f = _layer_norm(cfg, rngs)

  @property
  def blocks(self) -> tuple[Block, ...]:
    """The blocks `block_0 ... block_{L-1}` in order."""
    return tuple(getattr(self, f'block_{i}') for i in range(self.config.num_layers))

  def __call__(self, inputs: Array, positions: Array, segment_ids: Array | None = None, *,
               deterministic: bool = True, embed_delta: Array | None = None,
               rngs: nnx.Rngs | None = None) -> Array:
    """Computes next-token logits.

    Args:
      inputs: int32 token ids `[B, T]`.
      positions: int32 position ids `[B, T]` (row of the position table per token).
      segment_ids: int32 `[B, T]` document ids (0 = padding) or None (one document
        per row). Attention is causal and restricted to equal ids.
      deterministic: False enables dropout.
      embed_delta: float32 `[B, T, emb_dim]` added to the token+position sum (before
        dropout), or None. Its gradient is the per-token embedding-sum gradient.
      rngs: Optional `nnx.Rngs` whose `dropout` stream replaces the model's own.

    Returns:
      float32 logits `[B, T, vocab_size]`.
    """
    cfg = self.config
    pos_rows = None if self.pos_embed is None else self.pos_embed(positions)
    x = layers.embedding_sum(self.token_embed(inputs), pos_rows, embed_delta)
    x = self.drop_embed(x.astype(cfg.compute_dtype), deterministic=deterministic, rngs=rngs)
    mask = layers.segment_mask(segment_ids)
    apply = _remat_block if cfg.remat else _apply_block
    for block in self.blocks:
      x = apply(block, x, mask, positions, deterministic, rngs)
    return self.token_embed.attend(self.ln_f(x))


def to_linen_params(model: TransformerLM) -> dict[str, Any]:
  """The model's parameters as a linen `TransformerLM` `params` dict (same paths/shapes)."""
  return nnx.to_pure_dict(nnx.state(model, nnx.Param))


def _path_str(path) -> str:
  return '/'.join(str(k) for k in path)


def load_linen_params(model: TransformerLM, params: Mapping[str, Any]) -> TransformerLM:
  """Copies a linen `TransformerLM` params dict into `model` in place.

  Everything is checked before anything is written, so a mismatch leaves the model
  untouched. Values are cast to the model's parameter dtype.

  Args:
    model: An NNX `TransformerLM` built from the same `ModelConfig`.
    params: The linen `params` collection (or the full variables dict
      `{'params': ...}`), e.g. `linen_model.init(...)['params']` or a restored
      checkpoint.

  Returns:
    `model`, updated.

  Raises:
    ValueError: naming the path of a missing or unexpected parameter, a subtree
      where an array was expected (or the reverse), or a shape mismatch.
  """
  if isinstance(params, Mapping) and set(params) == {'params'}:
    params = params['params']
  if not isinstance(params, Mapping):
    raise ValueError(f"load_linen_params needs a params dict, got {type(params).__name__}.")
  target = {tuple(str(k) for k in path): var
            for path, var in nnx.to_flat_state(nnx.state(model, nnx.Param))}
  source = {}
  for path, value in traverse_util.flatten_dict(params).items():
    if not hasattr(value, 'shape'):
      raise ValueError(f"params/{_path_str(path)}: expected an array, got "
                       f"{type(value).__name__}.")
    source[tuple(str(k) for k in path)] = value
  nested_target = {p[:i] for p in target for i in range(1, len(p))}
  for path in sorted(source):
    if path in target:
      continue
    if path in nested_target:
      raise ValueError(f"params/{_path_str(path)}: expected a subtree of parameters, got an "
                       "array.")
    leaf = next((path[:i] for i in range(1, len(path)) if path[:i] in target), None)
    if leaf is not None:
      raise ValueError(f"params/{_path_str(leaf)}: expected an array, got a subtree.")
    raise ValueError(f"params/{_path_str(path)}: unexpected parameter (the NNX model has "
                     "none there; was the linen model built from a different ModelConfig?).")
  for path in sorted(target):
    if path not in source:
      prefix = next((path[:i] for i in range(1, len(path)) if path[:i] in source), None)
      if prefix is not None:
        raise ValueError(f"params/{_path_str(prefix)}: expected a subtree of parameters, got "
                         "an array.")
      raise ValueError(f"params/{_path_str(path)}: missing (the NNX model has a parameter "
                       "there; was the linen model built from a different ModelConfig?).")
    want, got = tuple(target[path].shape), tuple(source[path].shape)
    if want != got:
      raise ValueError(f"params/{_path_str(path)}: shape {list(got)} does not match the NNX "
                       f"model's {list(want)}.")
  updates = traverse_util.unflatten_dict(
      {path: jnp.asarray(source[path], target[path].dtype) for path in target})
  nnx.update(model, updates)
  return model


def position_table(model: TransformerLM) -> Array:
  """Returns the learned position table `[max_len, emb_dim]` of an NNX `TransformerLM`.

  Raises:
    KeyError: the model has no learned table (position_embedding != 'learned'), as
      `model.position_table` for linen params.
  """
  if not isinstance(getattr(model, 'pos_embed', None), LearnedPositionEmbedding):
    raise KeyError("No learned position table at model.pos_embed.embedding; the model's "
                   "position_embedding is not 'learned'.")
  return model.pos_embed.embedding[...]
