"""GPT-2-style decoder-only LM, swappable position embedding (linen;
docs/DESIGN.md § Model)."""

from collections.abc import Mapping
import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from flax_posemb import embeddings
from flax_posemb import initializers
from flax_posemb import layers
from flax_posemb import tables

Array = jax.Array

POSITION_TABLE_PATH: tuple[str, str] = ('pos_embed', 'embedding')
POSITION_EMBEDDINGS: tuple[str, ...] = ('learned', 'sinusoidal', 'rope', 'none')
ATTENTION_IMPLS: tuple[str, ...] = ('auto', 'xla', 'cudnn', 'blocked')
_DTYPES = {
    'float32': jnp.float32,
    'bfloat16': jnp.bfloat16,
    'float16': jnp.float16,
}
# Fields of older versions that runs' config.json may still hold; they are
# ignored.
REMOVED_FIELDS: tuple[str, ...] = ('check_positions',)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """Model hyper-parameters, validated on construction.

  `defaults.model()` is built from them; each field is also the
  `--config.model.FIELD` flag of the same name.

  Args:
    vocab_size: token vocabulary; must cover the data's token ids.
    num_layers: transformer blocks.
    num_heads: attention heads per block; must divide `emb_dim`.
    emb_dim: model width D (token and position embedding features).
    mlp_dim: hidden width of each block's MLP.
    max_len: rows of the position table (the largest position id + 1).
    dropout_rate: dropout on the embeddings, attention and MLP outputs, in
      `[0, 1)`.
    position_embedding: `'learned'`, `'sinusoidal'`, `'rope'` or `'none'`.
    position_init: the learned table's initializer: a name of
      `initializers.NAMES` or a table file `'file:PATH[:KEY]'`.
    position_init_resize: rows rule of a file table whose rows differ from
      `max_len` (`initializers.RESIZE_RULES`).
    position_init_std: std override (`initializers.STD_NAMES`); < 0 keeps
      the initializer's own.
    token_init: the token table's initializer name.
    token_init_std: std override of the token initializer; < 0 keeps its own.
    dtype: compute dtype name (`'float32'`, `'bfloat16'`, `'float16'`);
      logits and loss stay float32.
    param_dtype: parameter storage dtype name.
    attention_impl: `'auto'`, `'xla'`, `'cudnn'` (bfloat16/float16 only) or
      `'blocked'` (`layers.attention`).
    remat: rematerialize each block in the backward pass (saves memory).

  Raises:
    ValueError: a field out of range, an unknown name, or a combination that
      cannot work (e.g. RoPE with an odd head width, a file table that does
      not fit); the message names the field and the fix.
  """

  vocab_size: int = 64  # Token vocabulary (must cover the data's token ids).
  num_layers: int = 2  # Transformer blocks.
  num_heads: int = 4  # Attention heads per block.
  emb_dim: int = 64  # Model width (token and position embedding features).
  mlp_dim: int = 256  # Hidden width of each block's MLP.
  max_len: int = 128  # Rows in the position table (largest position id + 1).
  # Dropout on embeddings, attention output and MLP output.
  dropout_rate: float = 0.0
  position_embedding: str = 'learned'  # learned | sinusoidal | rope | none
  # A learned table's: initializers.NAMES or 'file:...' (tables).
  position_init: str = 'gpt2'
  # File table rows != max_len: error | truncate | interpolate.
  position_init_resize: str = 'error'
  # Std override (initializers.STD_NAMES); <0 = default.
  position_init_std: float = -1.0
  token_init: str = 'gpt2'  # Initializer name for the token table.
  # Std override for the token initializer; <0 = default.
  token_init_std: float = -1.0
  # Compute dtype (bfloat16 on accelerators); logits and loss stay float32.
  dtype: str = 'float32'
  param_dtype: str = 'float32'  # Parameter storage dtype.
  # Same function: auto (flax_posemb.auto) | xla | cudnn | blocked.
  attention_impl: str = 'auto'
  # Rematerialize each block in the backward pass (saves memory).
  remat: bool = False

  def __post_init__(self):
    """Raises ValueError naming the field and the fix; each check may assume
    that the ones before it passed."""
    for name in (
        'vocab_size',
        'num_layers',
        'num_heads',
        'emb_dim',
        'mlp_dim',
        'max_len',
    ):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f'ModelConfig.{name} must be a positive int, got {value!r}.'
        )
    if self.emb_dim % self.num_heads:
      raise ValueError(
          f'emb_dim ({self.emb_dim}) must be divisible by num_heads'
          f' ({self.num_heads}).'
      )
    if not 0.0 <= self.dropout_rate < 1.0:
      raise ValueError(
          f'dropout_rate must be in [0, 1), got {self.dropout_rate}.'
      )
    for name, valid in (
        ('position_embedding', POSITION_EMBEDDINGS),
        ('dtype', _DTYPES),
        ('param_dtype', _DTYPES),
        ('attention_impl', ATTENTION_IMPLS),
    ):
      value = getattr(self, name)
      if value not in valid:
        raise ValueError(
            f'Unknown {name} {value!r}; valid: {", ".join(valid)}.'
        )
    if self.position_embedding == 'rope' and self.head_dim % 2:
      raise ValueError(
          f'rope needs an even head dim; emb_dim/num_heads = {self.head_dim}.'
      )
    if self.attention_impl == 'cudnn' and self.dtype == 'float32':
      raise ValueError(
          "attention_impl='cudnn' (cuDNN flash attention) needs dtype"
          " 'bfloat16' or 'float16'; set dtype='bfloat16' or use 'xla'."
      )
    _check_init_name('token', self.token_init, self.token_init_std)
    _check_init_name('position', self.position_init, self.position_init_std)
    if self.token_init == 'same_as_token':
      raise ValueError(
          "token_init cannot be 'same_as_token'; pick e.g. 'gpt2'."
      )
    initializers.check_resize(self.position_init_resize)
    learned = self.position_embedding == 'learned'
    if learned and tables.is_file_spec(self.position_init):
      # A bad file raises tables.TableError, naming it.
      shape = tables.load_table(self.position_init).shape
      problem = initializers.fit_problem(
          shape, (self.max_len, self.emb_dim), self.position_init_resize
      )
      if problem:
        raise ValueError(problem)
    sinusoid = self.position_embedding == 'sinusoidal' or (
        learned and self.position_init == 'sinusoidal'
    )
    if sinusoid and self.position_init_std < 0 and sinusoid_scale(self) == 0:
      raise ValueError(
          "The sinusoid scales to the token init's std, and"
          f' {self.token_init!r} has std 0; set position_init_std >= 0.'
      )
    # Building the initializers checks their stds.
    self.token_initializer()
    if learned:
      self.position_initializer()

  @classmethod
  def from_config(cls, cfg: Mapping[str, Any] | Any) -> 'ModelConfig':
    """Builds the config from `config.model`.

    Args:
      cfg: a ConfigDict or a mapping of field names to values; the fields of
        `REMOVED_FIELDS` (older runs' config.json) are ignored.

    Returns:
      The validated ModelConfig.

    Raises:
      ValueError: an unknown key, or a value the fields refuse.
    """
    if hasattr(cfg, 'to_dict'):
      values = cfg.to_dict()
    else:
      values = dict(cfg)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - names - set(REMOVED_FIELDS))
    if unknown:
      raise ValueError(
          f'Unknown model config keys {unknown}; valid keys: {sorted(names)}.'
      )
    return cls(**{k: v for k, v in values.items() if k in names})

  @property
  def compute_dtype(self) -> Any:
    """jnp dtype of activations."""
    return _DTYPES[self.dtype]

  @property
  def storage_dtype(self) -> Any:
    """jnp dtype of parameters."""
    return _DTYPES[self.param_dtype]

  @property
  def head_dim(self) -> int:
    """Features per head."""
    return self.emb_dim // self.num_heads

  def token_initializer(self) -> initializers.Initializer:
    """The token table's initializer (`token_init` with `token_init_std`)."""
    if self.token_init_std < 0:
      return initializers.get(self.token_init)
    return initializers.get(self.token_init, std=self.token_init_std)

  def position_initializer(self) -> initializers.Initializer:
    """The learned table's initializer (`initializers.resolve`)."""
    std = None
    if self.position_init_std >= 0:
      std = self.position_init_std
    return initializers.resolve(
        self.position_init,
        token_init=self.token_initializer(),
        resize=self.position_init_resize,
        std=std,
    )


def position_table(params: Mapping[str, Any]) -> Array:
  """The learned position table of a model's parameters.

  Args:
    params: the parameter tree of `TransformerLM` (or `{'params': tree}`, as
      `init` returns it).

  Returns:
    The table at `POSITION_TABLE_PATH`, `[max_len, emb_dim]` in the
    parameter dtype.
  """
  if 'params' in params and POSITION_TABLE_PATH[0] not in params:
    params = params['params']
  return params[POSITION_TABLE_PATH[0]][POSITION_TABLE_PATH[1]]


def _check_init_name(kind: str, name: str, std: float) -> None:
  """ValueError unless ``name`` is an initializer (position: or a table file)
  that takes ``std`` if one is given (>= 0)."""
  if name not in initializers.NAMES and not tables.is_file_spec(name):
    raise ValueError(
        f'Unknown {kind}_init {name!r}; valid names:'
        f' {", ".join(initializers.NAMES)} (position_init also'
        " 'file:PATH.npy|.npz[:KEY]|.safetensors[:KEY]')."
    )
  if math.isnan(std):
    raise ValueError(
        f"model.{kind}_init_std must be a number (< 0: the initializer's"
        ' own std), got nan.'
    )
  if std >= 0 and name not in initializers.STD_NAMES:
    raise ValueError(
        f'{kind}_init {name!r} takes no std (got {std}); std applies to '
        f'{", ".join(initializers.STD_NAMES)}. Set {kind}_init_std=-1.'
    )


def sinusoid_scale(cfg: ModelConfig) -> float:
  """Root-mean-square of the fixed sinusoid position embedding.

  Args:
    cfg: the model config.

  Returns:
    `cfg.position_init_std` if >= 0, else the token initializer's realized
    std at width `emb_dim`.
  """
  if cfg.position_init_std >= 0:
    return cfg.position_init_std
  return cfg.token_initializer().expected_std(cfg.emb_dim)


class _Dense(nn.Module):
  """Dense `[..., in] -> [..., features]`, kernel `[features, in]`: ~9% faster
  on CPU (measured)."""

  features: int
  kernel_std: float
  dtype: Any
  param_dtype: Any

  @nn.compact
  def __call__(self, x: Array) -> Array:
    kernel = self.param(
        'kernel',
        nn.initializers.normal(self.kernel_std),
        (self.features, x.shape[-1]),
        self.param_dtype,
    )
    bias = self.param(
        'bias', nn.initializers.zeros, (self.features,), self.param_dtype
    )
    return layers.dense(x, kernel, bias, self.dtype)


class Block(nn.Module):
  """Pre-LN transformer block (`layers.block`), linen.

  Args:
    config: the model config (widths, heads, dtypes, dropout).
  """

  config: ModelConfig

  @nn.compact
  def __call__(
      self, x: Array, mask: Array | None, positions: Array, deterministic: bool
  ) -> Array:
    """Applies the block.

    Args:
      x: the residual stream, `[B, T, D]`.
      mask: bool `[B, 1, T, T]` (`layers.segment_mask`) or None.
      positions: int `[B, T]` position ids (for RoPE).
      deterministic: no dropout; False needs `rngs={'dropout': key}`.

    Returns:
      `[B, T, D]`.
    """
    cfg = self.config
    d = x.shape[-1]
    dense = functools.partial(
        _Dense, dtype=cfg.compute_dtype, param_dtype=cfg.storage_dtype
    )
    layer_norm = functools.partial(
        nn.LayerNorm,
        epsilon=layers.LAYER_NORM_EPSILON,
        dtype=cfg.compute_dtype,
        param_dtype=cfg.storage_dtype,
    )
    resid_std = layers.resid_std(cfg.num_layers)
    # In this order, so that their names (and dropout masks) stay: Dropout_0
    # attention, 1 MLP.
    drop_attn = nn.Dropout(cfg.dropout_rate)
    drop_mlp = nn.Dropout(cfg.dropout_rate)
    return layers.block(
        x,
        mask,
        positions,
        cfg,
        ln_1=layer_norm(name='ln_1'),
        qkv=dense(3 * d, layers.DENSE_STD, name='qkv'),
        attn_out=dense(d, resid_std, name='attn_out'),
        ln_2=layer_norm(name='ln_2'),
        mlp_in=dense(cfg.mlp_dim, layers.DENSE_STD, name='mlp_in'),
        mlp_out=dense(d, resid_std, name='mlp_out'),
        drop_attn=lambda y: drop_attn(y, deterministic=deterministic),
        drop_mlp=lambda y: drop_mlp(y, deterministic=deterministic),
    )


class TransformerLM(nn.Module):
  """GPT-2-style decoder-only LM of a `ModelConfig`, linen.

  Parameter paths, dtypes and masks: docs/DESIGN.md § Model.

  Args:
    config: the model config.
  """

  config: ModelConfig

  @nn.compact
  def __call__(
      self,
      inputs: Array,
      positions: Array,
      segment_ids: Array | None = None,
      deterministic: bool = True,
      embed_delta: Array | None = None,
  ) -> Array:
    """Next-token logits of a batch.

    Args:
      inputs: int32 token ids, `[B, T]`.
      positions: int32 position ids in `[0, max_len)`, `[B, T]`; an id
        outside gives NaN logits (check on the host with
        `embeddings.check_position_range`), except at padding, whose rows
        are never used (`layers.embedding_sum`).
      segment_ids: int32 `[B, T]`, the packed document of each token (0 =
        padding), or None (one document a row).
      deterministic: no dropout; False needs `rngs={'dropout': key}`.
      embed_delta: float32 `[B, T, emb_dim]` added to the input embedding, or
        None (`layers.embedding_sum`).

    Returns:
      float32 logits, `[B, T, vocab_size]`.
    """
    cfg = self.config
    dt = cfg.compute_dtype
    pdt = cfg.storage_dtype
    tok = embeddings.TokenEmbedding(
        cfg.vocab_size,
        cfg.emb_dim,
        cfg.token_initializer(),
        dtype=dt,
        param_dtype=pdt,
        name='token_embed',
    )
    pos_rows = None
    if cfg.position_embedding == 'learned':
      pos_rows = embeddings.LearnedPositionEmbedding(
          cfg.max_len,
          cfg.emb_dim,
          cfg.position_initializer(),
          dtype=jnp.float32,
          param_dtype=pdt,
          name='pos_embed',
      )(positions)
    elif cfg.position_embedding == 'sinusoidal':
      pos_rows = embeddings.SinusoidalPositionEmbedding(
          cfg.emb_dim, scale=sinusoid_scale(cfg), name='pos_embed'
      )(positions)
    x = layers.embedding_sum(tok(inputs), pos_rows, embed_delta, segment_ids)
    x = nn.Dropout(cfg.dropout_rate)(x.astype(dt), deterministic=deterministic)
    mask = layers.segment_mask(segment_ids)
    block = nn.remat(Block, static_argnums=(4,)) if cfg.remat else Block
    for i in range(cfg.num_layers):
      x = block(cfg, name=f'block_{i}')(x, mask, positions, deterministic)
    return tok.attend(
        nn.LayerNorm(
            epsilon=layers.LAYER_NORM_EPSILON,
            dtype=dt,
            param_dtype=pdt,
            name='ln_f',
        )(x)
    )
