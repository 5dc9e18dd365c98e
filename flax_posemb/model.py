"""GPT-2-style decoder-only language model with a swappable position embedding.

`TransformerLM(ModelConfig(...))`: pre-LayerNorm blocks, causal self-attention
through `jax.nn.dot_product_attention` restricted to equal segment ids (packed
documents never see each other), GELU MLP, tied output head, dropout, and a
precision policy (compute `dtype`, storage `param_dtype`; logits float32).

Parameter paths (what the statistics and analysis code reads):
  * position table: `params['pos_embed']['embedding']` `[max_len, emb_dim]`
    (`POSITION_TABLE_PATH`, `position_table(params)`), present only for
    `position_embedding='learned'`;
  * token table: `params['token_embed']['embedding']` `[vocab_size, emb_dim]`;
  * blocks `block_0 ... block_{L-1}` (LayerNorms `ln_1`, `ln_2`; Dense layers
    `qkv`, `attn_out`, `mlp_in`, `mlp_out` with `kernel` stored (out, in), i.e.
    `[features_out, features_in]`, and `bias`), final LayerNorm `ln_f`.

`embed_delta` (optional, float32 `[B, T, emb_dim]`, normally zeros) is added to the
token+position sum before dropout. It is an explicit input rather than a Flax
`perturb` collection, so it works at any batch size, under `nnx.bridge` and in the
NNX model alike: the gradient of the loss with respect to it is the per-(b, t)
gradient of the embedding sum, taken in the same backward pass as the parameter
gradients (`flax_posemb.stats.value_and_grad_with_position_stats`). For a learned
table, `grad(table)[p] == sum over (b, t) with positions[b, t] == p of grad(embed_delta)[b, t]`.

The maths lives in pure functions (`flax_posemb.layers`, `flax_posemb.embeddings`)
that the NNX twin of this model (`flax_posemb.nnx.TransformerLM`) calls too; the
modules here only own the linen parameters.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flax_posemb import embeddings
from flax_posemb import initializers
from flax_posemb import layers

Array = jax.Array

POSITION_TABLE_PATH: tuple[str, str] = ('pos_embed', 'embedding')
POSITION_EMBEDDINGS: tuple[str, ...] = ('learned', 'sinusoidal', 'rope', 'none')
ATTENTION_IMPLS: tuple[str, ...] = ('auto', 'xla', 'cudnn', 'blocked')
_DTYPES = {'float32': jnp.float32, 'bfloat16': jnp.bfloat16, 'float16': jnp.float16}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Model hyper-parameters: the one source of the model's defaults.

  `defaults.model()` (the `config.model` section of every `configs/*.py`) is built from
  these fields, so each default is written once, here. Std fields: a value < 0 means
  "the initializer's default".
  """
  vocab_size: int = 64  # Token vocabulary (must cover the data's token ids).
  num_layers: int = 2  # Transformer blocks.
  num_heads: int = 4  # Attention heads per block.
  emb_dim: int = 64  # Model width (token and position embedding features).
  mlp_dim: int = 256  # Hidden width of each block's MLP.
  max_len: int = 128  # Rows in the position table (largest position id + 1).
  dropout_rate: float = 0.0  # Dropout on embeddings, attention output and MLP output.
  position_embedding: str = 'learned'  # learned | sinusoidal | rope | none
  # Initializer of a learned table: a name in initializers.NAMES, or a table file
  # 'file:PATH.npy' | 'file:PATH.npz[:KEY]' | 'file:PATH.safetensors:KEY' (see flax_posemb.tables).
  position_init: str = 'gpt2'
  position_init_resize: str = 'error'  # File table with rows != max_len: error | truncate | interpolate.
  position_init_std: float = -1.0  # Std override (normal/truncated_normal/sinusoidal); <0 = default.
  token_init: str = 'gpt2'  # Initializer name for the token table.
  token_init_std: float = -1.0  # Std override for the token initializer; <0 = default.
  dtype: str = 'float32'  # Compute dtype (bfloat16 on accelerators); logits and loss stay float32.
  param_dtype: str = 'float32'  # Parameter storage dtype.
  # Attention: auto (the fastest exact one for the platform: blocked on CPU, cudnn on a recent
  # NVIDIA GPU with bf16/fp16, else xla; flax_posemb.auto) | xla | cudnn
  # (jax.nn.dot_product_attention; cudnn needs bf16/fp16) | blocked
  # (layers.blocked_causal_attention: same function, per-query-block key prefixes, for CPUs).
  attention_impl: str = 'auto'
  remat: bool = False  # Rematerialize each block in the backward pass (saves memory).
  # In-graph guard on position ids, for library users. train.py/eval.py check every batch on
  # the host instead (sharding.global_batch) and turn it off (defaults.model()): it costs ~5-15%
  # of a small CPU step.
  check_positions: bool = True

  def __post_init__(self):
    for f in ('vocab_size', 'num_layers', 'num_heads', 'emb_dim', 'mlp_dim', 'max_len'):
      v = getattr(self, f)
      if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"ModelConfig.{f} must be a positive int, got {v!r}.")
    if self.emb_dim % self.num_heads:
      raise ValueError(f"emb_dim ({self.emb_dim}) must be divisible by num_heads "
                       f"({self.num_heads}).")
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(f"dropout_rate must be in [0, 1), got {self.dropout_rate}.")
    if self.position_embedding not in POSITION_EMBEDDINGS:
      raise ValueError(f"Unknown position_embedding {self.position_embedding!r}; valid: "
                       f"{', '.join(POSITION_EMBEDDINGS)}.")
    if self.position_embedding == 'rope' and (self.emb_dim // self.num_heads) % 2:
      raise ValueError(f"rope needs an even head dim; emb_dim/num_heads = "
                       f"{self.emb_dim // self.num_heads}.")
    for f in ('dtype', 'param_dtype'):
      if getattr(self, f) not in _DTYPES:
        raise ValueError(f"ModelConfig.{f} must be one of {', '.join(_DTYPES)}, "
                         f"got {getattr(self, f)!r}.")
    if self.attention_impl not in ATTENTION_IMPLS:
      raise ValueError(f"Unknown attention_impl {self.attention_impl!r}; valid: "
                       f"{', '.join(ATTENTION_IMPLS)} ('auto' picks one for the platform).")
    if self.attention_impl == 'cudnn' and self.dtype == 'float32':
      raise ValueError("attention_impl='cudnn' (cuDNN flash attention) needs dtype "
                       "'bfloat16' or 'float16'; set model.dtype='bfloat16' or use 'xla'.")
    if self.token_init == 'same_as_token':
      raise ValueError("token_init cannot be 'same_as_token'; pick e.g. 'gpt2'.")
    # Builds the initializers once so that bad names/overrides fail at config time
    # (the position initializer only matters for a learned table).
    self.token_initializer()
    if self.position_embedding == 'learned':
      self.position_initializer()
    elif self.position_init not in initializers.NAMES and not self.position_init.startswith('file:'):
      raise ValueError(f"Unknown position_init {self.position_init!r}; valid names: "
                       f"{', '.join(initializers.NAMES)}.")

  @classmethod
  def from_config(cls, cfg: Mapping[str, Any] | Any) -> 'ModelConfig':
    """Builds from `config.model` (a ConfigDict or mapping); unknown keys are an error.

    Args:
      cfg: Mapping (or `ml_collections.ConfigDict`) with a subset of the fields.

    Returns:
      A `ModelConfig`; missing fields take the defaults above.
    """
    d = cfg.to_dict() if hasattr(cfg, 'to_dict') else dict(cfg)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
      raise ValueError(f"Unknown model config keys {unknown}; valid keys: {sorted(names)}.")
    return cls(**d)

  @property
  def compute_dtype(self):
    """jnp dtype of activations."""
    return _DTYPES[self.dtype]

  @property
  def storage_dtype(self):
    """jnp dtype of parameters."""
    return _DTYPES[self.param_dtype]

  @property
  def head_dim(self) -> int:
    """Features per attention head."""
    return self.emb_dim // self.num_heads

  def token_initializer(self) -> initializers.Initializer:
    """The token table's initializer (`token_init` with `token_init_std`)."""
    std = None if self.token_init_std < 0 else self.token_init_std
    if std is not None and self.token_init not in initializers.STD_NAMES:
      raise ValueError(f"token_init {self.token_init!r} takes no std; set token_init_std=-1.")
    return initializers.get(self.token_init, **({} if std is None else {'std': std}))

  def position_initializer(self) -> initializers.Initializer:
    """The learned table's initializer, `same_as_token`/`sinusoidal` resolved."""
    std = None if self.position_init_std < 0 else self.position_init_std
    return initializers.resolve(self.position_init, token_init=self.token_initializer(),
                                std=std, resize=self.position_init_resize,
                                shape=(self.max_len, self.emb_dim))


def position_table(params: Mapping[str, Any]) -> Array:
  """Returns the learned position table `[max_len, emb_dim]` from `params`.

  Args:
    params: The model's `params` collection (not the full variables dict).

  Raises:
    KeyError: the model has no learned table (position_embedding != 'learned').
  """
  if 'params' in params and POSITION_TABLE_PATH[0] not in params:
    params = params['params']
  try:
    return params[POSITION_TABLE_PATH[0]][POSITION_TABLE_PATH[1]]
  except KeyError:
    raise KeyError("No learned position table at params['pos_embed']['embedding']; the "
                   "model's position_embedding is not 'learned'.") from None


def sinusoid_scale(cfg: ModelConfig) -> float:
  """RMS of the fixed sinusoid: `position_init_std`, or the token init's realized std."""
  return (cfg.position_init_std if cfg.position_init_std >= 0
          else cfg.token_initializer().expected_std(cfg.emb_dim))


def _dense_init(std: float):
  return nn.initializers.normal(std)


class _Dense(nn.Module):
  """Dense layer `[..., in] -> [..., features]`, kernel stored `[features, in]` (out, in).

  The (out, in) layout was timed against Flax's (in, out) on the jitted
  forward+backward of a 4-layer, width-256, 256-token, batch-16 model on 2 CPU
  cores shared with other jobs (interleaved in one process): median CPU time
  per step 1716 vs 1875 ms and 1876 vs 2069 ms (~9% less) in two runs; wall
  time was noisier (3389 vs 3747 ms, 2461 vs 2343 ms). A peer measured 13-15%.
  """
  features: int
  kernel_std: float
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = self.param('kernel', _dense_init(self.kernel_std), (self.features, x.shape[-1]),
                        self.param_dtype)
    bias = self.param('bias', nn.initializers.zeros, (self.features,), self.param_dtype)
    return layers.dense(x, kernel, bias, self.dtype)


class Block(nn.Module):
  """Pre-LN transformer block: `x + attn(ln(x))`, then `x + mlp(ln(x))`."""
  config: ModelConfig

  @nn.compact
  def __call__(self, x: Array, mask: Array | None, positions: Array,
               deterministic: bool) -> Array:
    """Applies the block.

    Args:
      x: `[B, T, D]` in the compute dtype.
      mask: bool `[B, 1, T, T]` (True = may attend), or None for causal only.
      positions: int `[B, T]` (used by RoPE).
      deterministic: Disables dropout.

    Returns:
      `[B, T, D]`.
    """
    cfg = self.config
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype
    d = x.shape[-1]
    resid_std = layers.resid_std(cfg.num_layers)

    def dense(features, std, name):
      return _Dense(features, std, dt, pdt, name=name)

    def layer_norm(name):
      return nn.LayerNorm(epsilon=layers.LAYER_NORM_EPSILON, dtype=dt, param_dtype=pdt,
                          name=name)

    # Created in this order so the dropout modules keep their names (Dropout_0 for the
    # attention output, Dropout_1 for the MLP) and hence their dropout masks.
    drop_attn, drop_mlp = nn.Dropout(cfg.dropout_rate), nn.Dropout(cfg.dropout_rate)
    return layers.block(
        x, mask, positions,
        ln_1=layer_norm('ln_1'), qkv=dense(3 * d, layers.DENSE_STD, 'qkv'),
        attn_out=dense(d, resid_std, 'attn_out'), ln_2=layer_norm('ln_2'),
        mlp_in=dense(cfg.mlp_dim, layers.DENSE_STD, 'mlp_in'),
        mlp_out=dense(d, resid_std, 'mlp_out'),
        drop_attn=lambda y: drop_attn(y, deterministic=deterministic),
        drop_mlp=lambda y: drop_mlp(y, deterministic=deterministic),
        num_heads=cfg.num_heads, rope=cfg.position_embedding == 'rope',
        implementation=cfg.attention_impl)


class TransformerLM(nn.Module):
  """GPT-2-style decoder-only LM (see the module docstring for parameter paths).

  Attributes:
    config: A `ModelConfig`.
  """
  config: ModelConfig

  @nn.compact
  def __call__(self, inputs: Array, positions: Array, segment_ids: Array | None = None,
               deterministic: bool = True, embed_delta: Array | None = None) -> Array:
    """Computes next-token logits.

    Args:
      inputs: int32 token ids `[B, T]`.
      positions: int32 position ids `[B, T]` (row of the position table per token).
      segment_ids: int32 `[B, T]` document ids (0 = padding) or None (one
        document per row). Attention is causal and restricted to equal ids.
      deterministic: False enables dropout (needs `rngs={'dropout': key}`).
      embed_delta: float32 `[B, T, emb_dim]` added to the token+position sum, or None.

    Returns:
      float32 logits `[B, T, vocab_size]`.
    """
    cfg = self.config
    if not isinstance(cfg, ModelConfig):
      raise TypeError(f"TransformerLM needs a ModelConfig, got {type(cfg).__name__}; use "
                      "ModelConfig.from_config(config.model).")
    layers.check_lm_inputs(inputs, positions, segment_ids)
    dt, pdt = cfg.compute_dtype, cfg.storage_dtype

    tok = embeddings.TokenEmbedding(cfg.vocab_size, cfg.emb_dim, cfg.token_initializer(),
                                    dtype=dt, param_dtype=pdt, name='token_embed')
    pos_rows = None
    if cfg.position_embedding == 'learned':
      pos_rows = embeddings.LearnedPositionEmbedding(
          cfg.max_len, cfg.emb_dim, cfg.position_initializer(), dtype=jnp.float32,
          param_dtype=pdt, check_positions=cfg.check_positions, name='pos_embed')(positions)
    elif cfg.position_embedding == 'sinusoidal':
      pos_rows = embeddings.SinusoidalPositionEmbedding(
          cfg.emb_dim, scale=sinusoid_scale(cfg), name='pos_embed')(positions)
    # The sum is formed in float32 so embed_delta gradients (statistics) are float32.
    x = layers.embedding_sum(tok(inputs), pos_rows, embed_delta)
    x = nn.Dropout(cfg.dropout_rate)(x.astype(dt), deterministic=deterministic)

    mask = layers.segment_mask(segment_ids)

    block = nn.remat(Block, static_argnums=(4,)) if cfg.remat else Block
    for i in range(cfg.num_layers):
      x = block(cfg, name=f'block_{i}')(x, mask, positions, deterministic)
    x = nn.LayerNorm(epsilon=layers.LAYER_NORM_EPSILON, dtype=dt, param_dtype=pdt,
                     name='ln_f')(x)
    return tok.attend(x)
