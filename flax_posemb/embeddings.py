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
  """Checks on the host that every position id fits the position table.

  Args:
    positions: integer position ids of any shape (e.g. a batch's `[B, T]`
      int32 `positions`), a NumPy array or anything `np.asarray` takes.
    num_positions: rows of the position table (`model.max_len`).

  Raises:
    ValueError: some id is outside `[0, num_positions)`; the message names the
      smallest or largest bad id and the fix (`position_range_error`).
  """
  p = np.asarray(positions)
  num_bad = int(np.sum((p < 0) | (p >= num_positions)))
  if num_bad:
    raise position_range_error(
        int(p.min()), int(p.max()), num_bad, num_positions
    )


def position_range_error(
    lowest: int, highest: int, num_bad: int, num_positions: int
) -> ValueError:
  """The error for position ids outside the table, naming a bad id and the fix.

  Args:
    lowest: the smallest position id seen.
    highest: the largest position id seen.
    num_bad: how many ids are outside `[0, num_positions)`.
    num_positions: rows of the position table (`model.max_len`).

  Returns:
    The ValueError to raise (not raised here); a negative `lowest` is named
    first, else `highest` with the table size it needs.
  """
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
  """Looks up position rows; an id outside the table gives a NaN row.

  A bad id never reads a real row (as NumPy-style wrapping would), so the loss
  shows it; the ids are checked on the host by `check_position_range`.

  Args:
    table: the position table, `[num_positions, features]`.
    positions: integer position ids, `[...]` (e.g. `[B, T]` int32).
    dtype: dtype of the rows; None keeps the table's.

  Returns:
    The rows, `[..., features]` in `dtype`.
  """
  return _rows_or_nan(table, positions).astype(dtype or table.dtype)


def lookup_tokens(
    table: Array, ids: Array, dtype: Dtype | None = None
) -> Array:
  """Looks up token rows; an id outside the table gives a NaN row.

  A too-small vocabulary thus shows as a NaN loss, not as silently wrapped
  rows.

  Args:
    table: the token table, `[vocab, features]`.
    ids: integer token ids, `[...]` (e.g. `[B, T]` int32).
    dtype: dtype of the rows; None keeps the table's.

  Returns:
    The rows, `[..., features]` in `dtype`.
  """
  return _rows_or_nan(table, ids).astype(dtype or table.dtype)


def attend(x: Array, table: Array, dtype: Dtype | None = None) -> Array:
  """Tied output head: logits of `x` against the token table.

  Args:
    x: activations, `[..., features]`.
    table: the token table, `[vocab, features]`.
    dtype: dtype of the matmul's inputs; None keeps the table's.

  Returns:
    float32 logits `x @ table.T`, `[..., vocab]` (accumulated in float32).
  """
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
  """Fixed Vaswani sinusoid of root-mean-square `scale` at `positions`.

  Column `2i` is `sin(p / max_wavelength**(2i/features))`, column `2i+1` the
  cos, times `scale * sqrt(2)`.

  Args:
    positions: position ids >= 0, `[...]` (e.g. `[B, T]` int32).
    features: width of the encoding (even).
    scale: the encoding's root-mean-square over features.
    max_wavelength: the longest wavelength (10,000 in Vaswani et al.).
    dtype: dtype of the result.

  Returns:
    The encoding, `[..., features]` in `dtype`.
  """
  enc = initializers.sinusoid_at(
      jnp.asarray(positions), features, max_wavelength
  )
  return (enc * (scale * np.sqrt(2.0))).astype(dtype)


def apply_rope(
    x: Array, positions: Array, max_wavelength: float = 10_000.0
) -> Array:
  """Rotary position embedding (RoPE, Su et al. 2021) of queries or keys.

  Rotate-half (GPT-NeoX/Llama) layout, computed in float32: features `i` and
  `i + H/2` rotate by the angle `p / max_wavelength**(2i/H)` at position `p`.

  Args:
    x: queries or keys, `[B, T, N, H]` (N heads of even width H).
    positions: integer position ids, `[B, T]`.
    max_wavelength: the longest wavelength of the rotation.

  Returns:
    The rotated `x`, `[B, T, N, H]` in `x`'s dtype.
  """
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
  """Learned absolute position table (GPT-2's `wpe`), linen.

  Its parameter `embedding` is `[num_positions, features]`; an id outside the
  table gives a NaN row.

  Args:
    num_positions: rows of the table (`model.max_len`).
    features: width of each row (`model.emb_dim`).
    embedding_init: draws the table, `(key, shape, dtype) -> array`
      (`flax_posemb.initializers`).
    dtype: dtype of the rows looked up; None = `param_dtype`.
    param_dtype: dtype of the stored table.
  """

  num_positions: int
  features: int
  embedding_init: initializers.InitFn = initializers.gpt2()
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32

  @nn.compact
  def __call__(self, positions: Array) -> Array:
    """Looks up the rows of `positions`.

    Args:
      positions: integer position ids, `[...]` (e.g. `[B, T]` int32).

    Returns:
      The rows, `[..., features]` in `dtype`; NaN rows for ids outside the
      table.
    """
    table = self.param(
        'embedding',
        self.embedding_init,
        (self.num_positions, self.features),
        self.param_dtype,
    )
    return lookup_positions(table, positions, self.dtype or self.param_dtype)


class TokenEmbedding(nn.Module):
  """Token table with a tied output head (`attend`), linen.

  Its parameter `embedding` is `[num_embeddings, features]`.

  Args:
    num_embeddings: rows of the table (the vocabulary size).
    features: width of each row (`model.emb_dim`).
    embedding_init: draws the table, `(key, shape, dtype) -> array`.
    dtype: compute dtype of the rows and of `attend`; None = `param_dtype`.
    param_dtype: dtype of the stored table.
  """

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
    """Looks up the rows of token `ids`.

    Args:
      ids: integer token ids, `[...]` (e.g. `[B, T]` int32).

    Returns:
      The rows, `[..., features]` in `dtype`; NaN rows for ids outside the
      table.
    """
    return lookup_tokens(self.embedding, ids, self.dtype or self.param_dtype)

  def attend(self, x: Array) -> Array:
    """Logits of `x` against the token table (the tied output head).

    Args:
      x: activations, `[..., features]`.

    Returns:
      float32 logits, `[..., num_embeddings]`.
    """
    return attend(x, self.embedding, self.dtype or self.param_dtype)


class SinusoidalPositionEmbedding(nn.Module):
  """Fixed sinusoid position encoding (Vaswani et al. 2017), no parameters.

  `sinusoidal_encoding` as a linen module; `TransformerLM` sets `scale` to the
  token init's std, like the learnable `sinusoidal` init.

  Args:
    features: width of the encoding (even).
    scale: the encoding's root-mean-square over features.
    max_wavelength: the longest wavelength.
    dtype: dtype of the result.
  """

  features: int
  scale: float = 1.0
  max_wavelength: float = 10_000.0
  dtype: Dtype = jnp.float32

  def __call__(self, positions: Array) -> Array:
    """The encoding at `positions`.

    Args:
      positions: position ids >= 0, `[...]` (e.g. `[B, T]` int32).

    Returns:
      The encoding, `[..., features]` in `dtype`.
    """
    return sinusoidal_encoding(
        positions,
        self.features,
        scale=self.scale,
        max_wavelength=self.max_wavelength,
        dtype=self.dtype,
    )
