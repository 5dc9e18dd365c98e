"""Position and token embeddings: pure functions and their Flax linen modules.

Pure functions (shared with the NNX modules in `flax_posemb.nnx`):

* `lookup_positions`: rows of a learned table, behind the range guard
  `check_position_range`;
* `lookup_tokens` / `attend`: token rows and the tied output head;
* `sinusoidal_encoding`: fixed Vaswani sinusoid at explicit positions;
* `apply_rope`: rotary embedding (RoPE) applied to queries and keys.

Linen modules:

* `LearnedPositionEmbedding`: a trainable `[num_positions, features]` table
  looked up at explicit integer positions, with an out-of-range guard.
* `TokenEmbedding`: token table with `attend` for a tied output head.
* `SinusoidalPositionEmbedding`: fixed Vaswani sinusoid, no parameters.
* `apply_rope`: rotary embedding (RoPE) applied to queries and keys.
* "none" (NoPE) needs no module: the model simply adds nothing.

Positions are always explicit (`positions[b, t]` is the row used for token
`(b, t)`) so packed rows, random offsets and shifted-position probes work.
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from flax_posemb import initializers

Array = jax.Array
Dtype = Any


def _range_message(num_positions: int, lo: int, hi: int, num_bad: int) -> str:
  if lo < 0:
    return (f"Position id {lo} is negative ({num_bad} ids outside the position table "
            f"[0, {num_positions}); min {lo}, max {hi}). Position ids index table rows and "
            f"must be >= 0: check how the data (or a position offset) produces them.")
  return (
      f"Position id {hi} is outside the position table [0, {num_positions}) "
      f"({num_bad} out-of-range ids; min {lo}, max {hi}). Positions must be "
      f"< num_positions (model.max_len = {num_positions}): raise model.max_len to "
      f"at least {hi + 1} or shorten data.seq_len / the position offsets.")


def check_position_range(positions, num_positions: int) -> None:
  """Raises if any position id is outside `[0, num_positions)`.

  Eagerly (concrete arrays) this raises `ValueError` at once. Under `jax.jit`
  it stages a `jax.debug.callback` that raises on the host; JAX surfaces it as
  `jax.errors.JaxRuntimeError` (a `RuntimeError`) whose message contains the
  `ValueError` text naming the bad id and the table size (on CPU at the call,
  on accelerators at the latest when the result is read).

  Args:
    positions: Integer array `[...]`.
    num_positions: Table rows.
  """
  if isinstance(positions, jax.core.Tracer):
    p = jnp.asarray(positions)
    bad = jnp.sum((p < 0) | (p >= num_positions))

    def _host_check(lo, hi, num_bad):
      if int(num_bad):
        raise ValueError(_range_message(num_positions, int(lo), int(hi), int(num_bad)))

    # The host round-trip happens only on the failing branch, so valid batches pay
    # just the device-side reduction.
    jax.lax.cond(bad > 0,
                 lambda: jax.debug.callback(_host_check, jnp.min(p), jnp.max(p), bad),
                 lambda: None)
    return
  p = np.asarray(positions)
  if p.size == 0:
    return
  num_bad = int(np.sum((p < 0) | (p >= num_positions)))
  if num_bad:
    raise ValueError(_range_message(num_positions, int(p.min()), int(p.max()), num_bad))


def _check_integer(name: str, x) -> None:
  dtype = x.dtype if hasattr(x, 'dtype') else np.asarray(x).dtype
  if not jnp.issubdtype(dtype, jnp.integer):
    raise TypeError(f"{name} must be an integer array (e.g. int32), got dtype {dtype}; "
                    f"cast with .astype(np.int32).")


def lookup_positions(table: Array, positions: Array, *, check_positions: bool = True,
                     dtype: Dtype | None = None) -> Array:
  """Rows of a learned position table at explicit positions, behind the range guard.

  Args:
    table: `[num_positions, features]`.
    positions: Integer array `[...]` (typically `[B, T]`) of row ids.
    check_positions: Raise on ids outside `[0, num_positions)` (see
      `check_position_range`); if False such ids read clamped rows.
    dtype: Output dtype (None = the table's).

  Returns:
    `[..., features]` in `dtype`.

  Raises:
    TypeError: `positions` is not an integer array.
    ValueError: (eagerly) an id is out of range; under `jax.jit` a
      `JaxRuntimeError` carrying the same message.
  """
  _check_integer('positions', positions)
  if check_positions:
    check_position_range(positions, table.shape[0])
  out = jnp.take(table, positions, axis=0, mode='clip')
  return out.astype(dtype or table.dtype)


def lookup_tokens(table: Array, ids: Array, dtype: Dtype | None = None) -> Array:
  """Token rows; ids past the table give NaN rows (a too-small vocabulary shows as NaN loss).

  Args:
    table: `[num_embeddings, features]`.
    ids: Integer array `[...]`.
    dtype: Output dtype (None = the table's).

  Returns:
    `[..., features]` in `dtype`.
  """
  _check_integer('token ids', ids)
  out = jnp.take(table, ids, axis=0, mode='fill', fill_value=jnp.nan)
  return out.astype(dtype or table.dtype)


def attend(x: Array, table: Array, dtype: Dtype | None = None) -> Array:
  """Tied output head: `x @ table.T` in `dtype`, accumulated and returned in float32.

  Args:
    x: `[..., features]`.
    table: Token table `[num_embeddings, features]`.
    dtype: Compute dtype (None = the table's).

  Returns:
    float32 logits `[..., num_embeddings]`.
  """
  dt = dtype or table.dtype
  return jnp.einsum('...d,vd->...v', x.astype(dt), table.astype(dt),
                    preferred_element_type=jnp.float32)


def sinusoidal_encoding(positions: Array, features: int, *, scale: float = 1.0,
                        max_wavelength: float = 10_000.0,
                        dtype: Dtype = jnp.float32) -> Array:
  """Fixed Vaswani sinusoid at explicit positions, scaled to RMS `scale`.

  Column `2i` is `sin(p / max_wavelength**(2i/features))`, column `2i+1` the cos.

  Args:
    positions: Integer array `[...]` (any non-negative value is valid).
    features: Encoding width.
    scale: RMS of the entries (the raw sinusoid's is ~0.71).
    max_wavelength: Base of the wavelength progression.
    dtype: Output dtype.

  Returns:
    `[..., features]` in `dtype`.
  """
  _check_integer('positions', positions)
  enc = initializers.sinusoid_at(jnp.asarray(positions), features, max_wavelength)
  # RMS over a full period of each column is 1/sqrt(2) (odd widths: per column).
  return (enc * (scale * np.sqrt(2.0))).astype(dtype)


class LearnedPositionEmbedding(nn.Module):
  """Learned absolute position table (GPT-2 `wpe`, BERT `position_embeddings`).

  Parameter: `embedding` `[num_positions, features]` (in a `TransformerLM` at
  `params['pos_embed']['embedding']`).

  `jnp.take`/`nn.Embed` return NaN past the table and wrap negative indices, and
  `table[p]` clamps; this module never lets that happen silently: with
  `check_positions=True` ids outside `[0, num_positions)` raise — eagerly a
  `ValueError`, under `jax.jit` a `JaxRuntimeError` carrying the same message
  (see `check_position_range`). The guard is a device-side count of bad ids; the
  host callback that raises runs only on the failing branch of a `lax.cond`.
  Measured cost on 2 shared CPU cores (JAX 0.10.2, heavily loaded by other
  jobs, so +-10% noise): the check alone adds ~0.3 ms CPU per jitted call
  (0.47-0.49 vs 0.19-0.28 ms for a bare lookup of 16x128 ids); in a jitted
  train-like forward+backward of the tiny config (2 layers, width 64, batch
  16 x 128 tokens), interleaved runs gave median CPU 108.8 vs 103.6 ms and
  115.7 vs 109.9 ms per step with vs without it (~5%), less for larger models.
  Turn it off (`check_positions=False`) only when the input pipeline has already
  checked positions on the host; out-of-range ids then read clamped rows.

  Attributes:
    num_positions: Table rows (largest position id + 1).
    features: Embedding width.
    embedding_init: Initializer `(key, shape, dtype) -> Array`, e.g.
      `initializers.get('gpt2')`.
    dtype: Output dtype (None = param dtype).
    param_dtype: Table storage dtype.
    check_positions: Raise on out-of-range ids (see above).
  """
  num_positions: int
  features: int
  embedding_init: initializers.InitFn = initializers.gpt2()
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32
  check_positions: bool = True

  @nn.compact
  def __call__(self, positions: Array) -> Array:
    """Looks up rows.

    Args:
      positions: Integer array `[...]` (typically `[B, T]`) of row ids.

    Returns:
      `[..., features]` in `dtype` (param dtype if None).
    """
    _check_integer('positions', positions)
    table = self.param('embedding', self.embedding_init,
                       (self.num_positions, self.features), self.param_dtype)
    return lookup_positions(table, positions, check_positions=self.check_positions,
                            dtype=self.dtype or self.param_dtype)


class TokenEmbedding(nn.Module):
  """Token table `embedding` `[num_embeddings, features]` with a tied output head.

  Token ids past the table give NaN (jnp.take's fill mode), so a vocabulary that
  is too small shows up as a NaN loss rather than as silently wrong rows.

  Attributes:
    num_embeddings: Vocabulary size.
    features: Embedding width.
    embedding_init: Initializer `(key, shape, dtype) -> Array`.
    dtype: Compute dtype of `attend` and of the looked-up rows (None = param dtype).
    param_dtype: Table storage dtype.
  """
  num_embeddings: int
  features: int
  embedding_init: initializers.InitFn = initializers.gpt2()
  dtype: Dtype | None = None
  param_dtype: Dtype = jnp.float32

  def setup(self):
    self.embedding = self.param('embedding', self.embedding_init,
                                (self.num_embeddings, self.features), self.param_dtype)

  def __call__(self, ids: Array) -> Array:
    """Looks up token rows.

    Args:
      ids: Integer array `[...]`.

    Returns:
      `[..., features]` in `dtype` (param dtype if None).
    """
    return lookup_tokens(self.embedding, ids, self.dtype or self.param_dtype)

  def attend(self, x: Array) -> Array:
    """Tied output head: `x @ embedding.T` in `dtype`, accumulated and returned in float32.

    Args:
      x: `[..., features]`.

    Returns:
      float32 logits `[..., num_embeddings]`.
    """
    return attend(x, self.embedding, self.dtype or self.param_dtype)


class SinusoidalPositionEmbedding(nn.Module):
  """Fixed sinusoidal encoding (Vaswani et al. 2017) at explicit positions; no parameters.

  Column `2i` is `sin(p / max_wavelength**(2i/features))`, column `2i+1` the cos,
  multiplied by `scale / rms` so the entries have RMS `scale` (TransformerLM
  uses the token init's std, like the learnable `sinusoidal` initializer, so the
  fixed and learnable variants start from the same table). Any non-negative
  position is valid (no table, no range limit).

  Attributes:
    features: Encoding width.
    scale: RMS of the entries (the raw sinusoid's is ~0.71).
    max_wavelength: Base of the wavelength progression.
    dtype: Output dtype.
  """
  features: int
  scale: float = 1.0
  max_wavelength: float = 10_000.0
  dtype: Dtype = jnp.float32

  def __call__(self, positions: Array) -> Array:
    """Encodes positions.

    Args:
      positions: Integer array `[...]`.

    Returns:
      `[..., features]` in `dtype`.
    """
    return sinusoidal_encoding(positions, self.features, scale=self.scale,
                               max_wavelength=self.max_wavelength, dtype=self.dtype)


def apply_rope(x: Array, positions: Array, max_wavelength: float = 10_000.0) -> Array:
  """Rotary position embedding (Su et al. 2021, RoFormer), rotate-half convention.

  Feature `i` and `i + H/2` of each head form a pair rotated by angle
  `p / max_wavelength**(2i/H)` (GPT-NeoX / Llama layout).

  Args:
    x: Queries or keys `[B, T, N, H]` (H even).
    positions: Integer positions `[B, T]`.
    max_wavelength: Base of the wavelength progression.

  Returns:
    Array like `x` (same dtype), rotated in float32.
  """
  head_dim = x.shape[-1]
  if head_dim % 2:
    raise ValueError(f"RoPE needs an even head dimension, got {head_dim} "
                     "(choose emb_dim / num_heads even).")
  half = head_dim // 2
  inv_freq = 1.0 / (max_wavelength ** (jnp.arange(half, dtype=jnp.float32) * 2.0 / head_dim))
  angle = positions.astype(jnp.float32)[..., None, None] * inv_freq  # [B, T, 1, H/2]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  xf = x.astype(jnp.float32)
  x1, x2 = xf[..., :half], xf[..., half:]
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x.dtype)
