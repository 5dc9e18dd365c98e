"""Position and token embeddings: pure functions (shared with the NNX twins) and
linen modules."""

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_posemb import initializers

Array = jax.Array
Dtype = Any


def check_position_range(positions: np.ndarray, num_positions: int) -> None:
  """Raises ValueError naming a bad id and the fix unless host `positions` are
  in `[0, n)`."""
  p = np.asarray(positions)
  num_bad = int(np.sum((p < 0) | (p >= num_positions)))
  if num_bad:
    raise position_range_error(
        int(p.min()), int(p.max()), num_bad, num_positions
    )


def position_range_error(
    lowest: int, highest: int, num_bad: int, num_positions: int
) -> ValueError:
  """The error of `num_bad` position ids outside `[0, num_positions)`, the
  smallest `lowest` and the largest `highest`: it names a bad id and the
  fix."""
  n = num_positions
  if lowest < 0:
    where = f'Position id {lowest} is negative'
    fix = 'check how the data (or an offset) makes them'
  else:
    where = f'Position id {highest} is outside the position table [0, {n})'
    # The library's own argument: in a config, the table's rows are
    # ModelConfig.max_len.
    fix = (
        f'give the table >= {highest + 1} rows (num_positions;'
        ' ModelConfig.max_len for the model) or feed smaller position ids'
        ' (shorter sequences or offsets)'
    )
  return ValueError(
      f'{where} ({num_bad} ids outside [0, {n}); min {lowest}, max'
      f' {highest}): {fix}.'
  )


def _rows_or_nan(table: Array, ids: Array) -> Array:
  """Rows `[..., features]` of `table` `[rows, features]` at integer `ids`
  `[...]`; an id outside `[0, rows)`, -1 included, gives a NaN row (not the
  last row, as NumPy-style indexing would)."""
  return (
      jnp.asarray(table)
      .at[ids]
      .get(mode='fill', fill_value=jnp.nan, wrap_negative_indices=False)
  )


def lookup_positions(
    table: Array, positions: Array, dtype: Dtype | None = None
) -> Array:
  """Rows `[..., features]` (in `dtype`, default the table's) of `table`
  `[num_positions, features]` at integer `positions` `[...]`; an id outside
  the table gives a NaN row, never a real one, so the loss shows it (the ids
  are checked on the host, `check_position_range`)."""
  return _rows_or_nan(table, positions).astype(dtype or table.dtype)


def lookup_tokens(
    table: Array, ids: Array, dtype: Dtype | None = None
) -> Array:
  """Rows `[..., features]` of `table` `[vocab, features]` at integer `ids`
  `[...]`; ids outside the table give NaN rows, so a too-small vocabulary shows
  as a NaN loss."""
  return _rows_or_nan(table, ids).astype(dtype or table.dtype)


def attend(x: Array, table: Array, dtype: Dtype | None = None) -> Array:
  """Tied output head: `x` `[..., features]` @ `table.T` in `dtype` -> float32
  `[..., vocab]`."""
  dt = dtype or table.dtype
  return jnp.einsum(
      '...d,vd->...v',
      x.astype(dt),
      table.astype(dt),
      preferred_element_type=jnp.float32,
  )


def sinusoidal_encoding(
    positions: Array,
    features: int,
    *,
    scale: float = 1.0,
    max_wavelength: float = 10_000.0,
    dtype: Dtype = jnp.float32,
) -> Array:
  """Fixed Vaswani sinusoid `[..., features]` of RMS `scale` at `positions`
  `[...]` >= 0: column `2i` is `sin(p / max_wavelength**(2i/features))`, column
  `2i+1` the cos."""
  enc = initializers.sinusoid_at(
      jnp.asarray(positions), features, max_wavelength
  )
  return (enc * (scale * np.sqrt(2.0))).astype(dtype)


def apply_rope(
    x: Array, positions: Array, max_wavelength: float = 10_000.0
) -> Array:
  """RoPE (Su et al. 2021), rotate-half (GPT-NeoX/Llama) layout, in float32:
  features `i` and `i + H/2` of `x` `[B, T, N, H]` (H even) rotate by `p /
  max_wavelength**(2i/H)` at `positions` `[B, T]`."""
  half = x.shape[-1] // 2
  inv_freq = 1.0 / (
      max_wavelength ** (jnp.arange(half, dtype=jnp.float32) / half)
  )
  # [B, T, 1, H/2]
  angle = positions.astype(jnp.float32)[..., None, None] * inv_freq
  sin = jnp.sin(angle)
  cos = jnp.cos(angle)
  x1 = x[..., :half].astype(jnp.float32)
  x2 = x[..., half:].astype(jnp.float32)
  return jnp.concatenate(
      [x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1
  ).astype(x.dtype)


class LearnedPositionEmbedding(nn.Module):
  """Learned absolute position table `embedding` `[num_positions, features]`
  (GPT-2 `wpe`), drawn by `embedding_init` in `param_dtype`; rows come out in
  `dtype` (None = `param_dtype`), NaN for an id outside the table."""

  num_positions: int
  features: int
  embedding_init: initializers.InitFn = initializers.gpt2()
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, positions: Array) -> Array:
    table = self.param(
        'embedding',
        self.embedding_init,
        (self.num_positions, self.features),
        self.param_dtype,
    )
    return lookup_positions(table, positions, self.dtype or self.param_dtype)


class TokenEmbedding(nn.Module):
  """Token table `embedding` `[num_embeddings, features]` with a tied output
  head (`attend`); `dtype` (None = `param_dtype`) is the compute dtype of the
  rows and of `attend`."""

  num_embeddings: int
  features: int
  embedding_init: initializers.InitFn = initializers.gpt2()
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32

  def setup(self):
    """Creates the `[num_embeddings, features]` table."""
    self.embedding = self.param(
        'embedding',
        self.embedding_init,
        (self.num_embeddings, self.features),
        self.param_dtype,
    )

  def __call__(self, ids: Array) -> Array:
    return lookup_tokens(self.embedding, ids, self.dtype or self.param_dtype)

  def attend(self, x: Array) -> Array:
    """float32 logits `[..., num_embeddings]` of `x` `[..., features]`."""
    return attend(x, self.embedding, self.dtype or self.param_dtype)


class SinusoidalPositionEmbedding(nn.Module):
  """Fixed sinusoid (Vaswani et al. 2017) of RMS `scale`, no parameters
  (`sinusoidal_encoding`; `TransformerLM` scales it to the token init's std,
  like the learnable `sinusoidal` init)."""

  features: int
  scale: float = 1.0
  max_wavelength: float = 10_000.0
  dtype: Dtype = jnp.float32

  def __call__(self, positions: Array) -> Array:
    return sinusoidal_encoding(
        positions,
        self.features,
        scale=self.scale,
        max_wavelength=self.max_wavelength,
        dtype=self.dtype,
    )
