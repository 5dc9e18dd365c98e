"""Framework-free transformer maths shared by the linen (`model`) and NNX
(`nnx`) models."""

from collections.abc import Callable
import math
from typing import Any, Literal, cast

import jax
import jax.numpy as jnp

from flax_posemb import auto
from flax_posemb import embeddings

Array = jax.Array
Dtype = Any
Layer = Callable[[Array], Array]

LAYER_NORM_EPSILON = 1e-5  # GPT-2's, for every LayerNorm of the model.
# GPT-2 init of every dense kernel except the residual projections.
DENSE_STD = 0.02
ATTENTION_BLOCK = 64  # Query rows per block of `blocked_causal_attention`.


def resid_std(num_layers: int) -> float:
  """GPT-2 init std of the residual projections (`attn_out`, `mlp_out`).

  Args:
    num_layers: transformer blocks L.

  Returns:
    `0.02 / sqrt(2 L)`.
  """
  return DENSE_STD / math.sqrt(2 * num_layers)


def dense(x: Array, kernel: Array, bias: Array, dtype: Dtype) -> Array:
  """Affine layer `x @ kernel.T + bias` with the kernel stored `(out, in)`.

  Args:
    x: inputs, `[..., in]`.
    kernel: `[out, in]`.
    bias: `[out]`.
    dtype: compute dtype (all three are cast to it).

  Returns:
    `[..., out]` in `dtype`.
  """
  y = jnp.einsum('...i,oi->...o', x.astype(dtype), kernel.astype(dtype))
  return y + bias.astype(dtype)


def segment_mask(segment_ids: Array | None) -> Array | None:
  """Attention mask keeping each token inside its packed document.

  Args:
    segment_ids: int `[B, T]`, the document of each token (0 = padding), or
      None (one document a row).

  Returns:
    bool `[B, 1, T, T]`, True where query `q` may attend key `k` (same
    segment; causality is applied by `attention`), or None for None.
  """
  if segment_ids is None:
    return None
  return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def attention(
    qkv: Array,
    positions: Array,
    mask: Array | None,
    *,
    num_heads: int,
    rope: bool,
    implementation: str,
) -> Array:
  """Causal multi-head self-attention of a fused q, k, v projection.

  Args:
    qkv: `[B, T, 3 * D]`: the queries, keys and values as three `D`-wide
      blocks, each `num_heads` heads of `D / num_heads` features.
    positions: int `[B, T]` position ids (used by `rope` only).
    mask: bool `[B, 1, T, T]` (`segment_mask`) or None; the causal mask is
      always applied.
    num_heads: attention heads N.
    rope: rotate queries and keys by `embeddings.apply_rope`.
    implementation: `'xla'`, `'cudnn'`, `'blocked'`
      (`blocked_causal_attention`) or `'auto'` (`auto.attention_impl` picks
      one for the backend, dtype and shapes).

  Returns:
    The attention output, `[B, T, D]` in `qkv`'s dtype.
  """
  b = qkv.shape[0]
  t = qkv.shape[1]
  d = qkv.shape[2] // 3
  implementation = auto.attention_impl(
      implementation,
      platform=jax.default_backend(),
      dtype=jnp.dtype(qkv.dtype).name,
      head_dim=d // num_heads,
      seq_len=t,
  )
  qkv = qkv.reshape(b, t, 3, num_heads, d // num_heads)
  if implementation == 'blocked' and not rope:
    # One transpose to heads-major [3, B, N, T, H]: its backward is one
    # concatenate+transpose.
    q, k, v = jnp.transpose(qkv, (2, 0, 3, 1, 4))
    return jnp.swapaxes(
        _blocked_heads_major(q, k, v, mask, ATTENTION_BLOCK), 1, 2
    ).reshape(b, t, d)
  q = qkv[:, :, 0]
  k = qkv[:, :, 1]
  v = qkv[:, :, 2]
  if rope:
    q = embeddings.apply_rope(q, positions)
    k = embeddings.apply_rope(k, positions)
  if implementation == 'blocked':
    a = blocked_causal_attention(q, k, v, mask)
  else:
    # 'xla' or 'cudnn' here (ModelConfig checks the name).
    jax_implementation = cast(Literal['xla', 'cudnn'], implementation)
    a = jax.nn.dot_product_attention(
        q, k, v, mask=mask, is_causal=True, implementation=jax_implementation
    )
  return a.reshape(b, t, d)


def blocked_causal_attention(
    q: Array,
    k: Array,
    v: Array,
    mask: Array | None,
    block: int = ATTENTION_BLOCK,
) -> Array:
  """Causal attention computed in blocks of query rows (for CPUs).

  Equals `'xla'` attention up to float32 rounding; each block of query rows
  is scored against its key prefix only (about half the score work).

  Args:
    q: queries, `[B, T, N, H]`.
    k: keys, `[B, T, N, H]`.
    v: values, `[B, T, N, H]`.
    mask: bool `[B, 1, T, T]` or None, on top of the causal mask.
    block: query rows per block.

  Returns:
    `[B, T, N, H]` in `v`'s dtype.
  """
  out = _blocked_heads_major(
      jnp.swapaxes(q, 1, 2),
      jnp.swapaxes(k, 1, 2),
      jnp.swapaxes(v, 1, 2),
      mask,
      block,
  )
  return jnp.swapaxes(out, 1, 2)


def _blocked_heads_major(
    q: Array, k: Array, v: Array, mask: Array | None, block: int
) -> Array:
  """`blocked_causal_attention` on heads-major `[B, N, T, H]`. Disallowed scores
  get float32 min added, not selected: exp underflows to 0 either way, and the
  backward needs no select pass."""
  t = q.shape[2]
  h = q.shape[-1]
  q = q * jnp.asarray(1.0 / math.sqrt(h), q.dtype)
  neg = jnp.finfo(jnp.float32).min
  outs = []
  for start in range(0, t, block):
    end = min(start + block, t)
    s = jnp.einsum(
        'bnqh,bnkh->bnqk',
        q[:, :, start:end],
        k[:, :, :end],
        preferred_element_type=jnp.float32,
    )
    allowed = (jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :])[
        None, None
    ]
    if mask is not None:
      allowed = allowed & mask[:, :, start:end, :end]
    p = jax.nn.softmax(s + jnp.where(allowed, 0.0, neg), axis=-1)
    outs.append(jnp.einsum('bnqk,bnkh->bnqh', p.astype(v.dtype), v[:, :, :end]))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)


def block(
    x: Array,
    mask: Array | None,
    positions: Array,
    cfg: Any,
    *,
    ln_1: Layer,
    qkv: Layer,
    attn_out: Layer,
    ln_2: Layer,
    mlp_in: Layer,
    mlp_out: Layer,
    drop_attn: Layer,
    drop_mlp: Layer,
) -> Array:
  """Pre-LN GPT-2 block out of the framework's layers (linen or NNX).

  `x + drop_attn(attn_out(attention(qkv(ln_1(x)))))`, then
  `x + drop_mlp(mlp_out(gelu(mlp_in(ln_2(x)))))`.

  Args:
    x: the residual stream, `[B, T, D]`.
    mask: bool `[B, 1, T, T]` (`segment_mask`) or None.
    positions: int `[B, T]` position ids (for RoPE).
    cfg: the `model.ModelConfig` (heads, position embedding, attention
      implementation).
    ln_1: LayerNorm before attention, `[B, T, D] -> [B, T, D]`.
    qkv: `[B, T, D] -> [B, T, 3 * D]`.
    attn_out: `[B, T, D] -> [B, T, D]`.
    ln_2: LayerNorm before the MLP, `[B, T, D] -> [B, T, D]`.
    mlp_in: `[B, T, D] -> [B, T, mlp_dim]`.
    mlp_out: `[B, T, mlp_dim] -> [B, T, D]`.
    drop_attn: dropout on the attention branch (identity when
      deterministic).
    drop_mlp: dropout on the MLP branch.

  Returns:
    The residual stream after the block, `[B, T, D]`.
  """
  a = attention(
      qkv(ln_1(x)),
      positions,
      mask,
      num_heads=cfg.num_heads,
      rope=cfg.position_embedding == 'rope',
      implementation=cfg.attention_impl,
  )
  x = x + drop_attn(attn_out(a))
  return x + drop_mlp(mlp_out(jax.nn.gelu(mlp_in(ln_2(x)), approximate=True)))


def embedding_sum(
    token_rows: Array,
    position_rows: Array | None = None,
    embed_delta: Array | None = None,
    segment_ids: Array | None = None,
) -> Array:
  """The input embedding: token rows plus position rows, in float32; zeros at
  padding.

  A padding token's rows are never used: its id or position may lie outside
  the tables, whose rows are then NaN (`embeddings.lookup_positions`), and a
  NaN value under a masked attention weight of 0 or a loss mask of 0 still
  makes the sum NaN. Selected away (not multiplied), they reach no real token,
  loss or gradient.

  Args:
    token_rows: `[B, T, D]`.
    position_rows: `[B, T, D]`, or None (RoPE or no position embedding).
    embed_delta: float32 `[B, T, D]` added to the sum, or None; passing zeros
      makes its gradient the gradient at the embedding sum (the statistics
      use it), and float32 keeps that gradient float32.
    segment_ids: int `[B, T]` (0 = padding), or None (no padding).

  Returns:
    float32 `[B, T, D]`, zeros where `segment_ids` is 0.
  """
  x = token_rows.astype(jnp.float32)
  if position_rows is not None:
    x = x + position_rows.astype(jnp.float32)
  if embed_delta is not None:
    x = x + embed_delta
  if segment_ids is not None:
    x = jnp.where((segment_ids > 0)[..., None], x, 0.0)
  return x
