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
  """GPT-2 init std of the residual projections (`attn_out`, `mlp_out`): 0.02 /
  sqrt(2 L)."""
  return DENSE_STD / math.sqrt(2 * num_layers)


def dense(x: Array, kernel: Array, bias: Array, dtype: Dtype) -> Array:
  """`x` `[..., in]` @ `kernel` `[out, in]` (stored (out, in)) + `bias` `[out]`,
  in `dtype`."""
  y = jnp.einsum('...i,oi->...o', x.astype(dtype), kernel.astype(dtype))
  return y + bias.astype(dtype)


def segment_mask(segment_ids: Array | None) -> Array | None:
  """bool `[B, 1, T, T]` (query may attend key) keeping tokens inside their
  packed document, from `segment_ids` `[B, T]` (0 = padding); None (causal only)
  for None."""
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
  """Causal multi-head self-attention `qkv` `[B, T, 3 * D]` (q, k, v blocks) ->
  `[B, T, D]` at int `positions` `[B, T]` (for `rope`), `mask` bool `[B, 1, T,
  T]` or None; `implementation`: 'xla' | 'cudnn' | 'blocked'
  (`blocked_causal_attention`) | 'auto' (`auto.attention_impl`)."""
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
  """Causal attention `q, k, v` `[B, T, N, H]` -> `[B, T, N, H]`, `mask` bool
  `[B, 1, T, T]` or None: 'xla' attention up to float32 rounding, each `block`
  of query rows against its key prefix only (~half the score work; for CPUs)."""
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
  """Pre-LN block `[B, T, D] -> [B, T, D]` of the framework's layers and `cfg`
  (a ModelConfig)."""
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
  """float32 `[B, T, D]` token + position rows + `embed_delta` (float32, so is
  its gradient); zeros at padding (`segment_ids` `[B, T]` == 0).

  A padding token's rows are never used: its id or position may lie outside
  the tables, whose rows are then NaN (`embeddings.lookup_positions`), and a
  NaN value under a masked attention weight of 0 or a loss mask of 0 still
  makes the sum NaN. Selected away (not multiplied), they reach no real token,
  loss or gradient.
  """
  x = token_rows.astype(jnp.float32)
  if position_rows is not None:
    x = x + position_rows.astype(jnp.float32)
  if embed_delta is not None:
    x = x + embed_delta
  if segment_ids is not None:
    x = jnp.where((segment_ids > 0)[..., None], x, 0.0)
  return x
