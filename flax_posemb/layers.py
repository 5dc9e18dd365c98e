"""Framework-free transformer maths shared by the linen and NNX models.

Both `flax_posemb.model` (linen) and `flax_posemb.nnx` (NNX) build their parameters
their own way and then call these pure functions, so the two frameworks compute the
same logits from the same parameters (one copy of the maths):

* `dense`: `[..., in] -> [..., out]` with the kernel stored (out, in);
* `segment_mask`: packed-document attention mask from segment ids;
* `attention`: qkv split, optional RoPE, causal + segment-masked
  `jax.nn.dot_product_attention` ('xla', 'cudnn') or `blocked_causal_attention`
  ('blocked', for CPUs);
* `mlp`: tanh-GELU MLP between two dense layers;
* `block`: the pre-LN residual wiring of one transformer block;
* `embedding_sum`: token rows + position rows + `embed_delta`, in float32;
* `check_lm_inputs`: shape checks of the language model's inputs.

Functions that need parameters take them either as arrays (`dense`) or as
callables built by the caller's framework (`block`, `mlp`), so that the parameter
paths stay each framework's business. Embedding lookups and the tied output head
live in `flax_posemb.embeddings`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from flax_posemb import auto
from flax_posemb import embeddings

Array = jax.Array
Dtype = Any
Layer = Callable[[Array], Array]

LAYER_NORM_EPSILON = 1e-5  # GPT-2's LayerNorm epsilon (every LayerNorm of the model).
DENSE_STD = 0.02  # GPT-2 init of every dense kernel ...


def resid_std(num_layers: int) -> float:
  """... except the residual projections (`attn_out`, `mlp_out`): 0.02 / sqrt(2 * layers)."""
  return DENSE_STD / math.sqrt(2 * num_layers)


def dense(x: Array, kernel: Array, bias: Array, dtype: Dtype) -> Array:
  """Dense layer with the kernel stored (out, in).

  Args:
    x: `[..., in]`.
    kernel: `[out, in]`.
    bias: `[out]`.
    dtype: Compute dtype (inputs and parameters are cast to it).

  Returns:
    `[..., out]` in `dtype`.
  """
  y = jnp.einsum('...i,oi->...o', x.astype(dtype), kernel.astype(dtype))
  return y + bias.astype(dtype)


def segment_mask(segment_ids: Array | None) -> Array | None:
  """Attention mask that keeps each token inside its own packed document.

  Args:
    segment_ids: int `[B, T]` document ids (0 = padding), or None.

  Returns:
    bool `[B, 1, T, T]` (True = query may attend to key), or None when
    `segment_ids` is None (causal attention only).
  """
  if segment_ids is None:
    return None
  return segment_ids[:, None, :, None] == segment_ids[:, None, None, :]


def attention(qkv: Array, positions: Array, mask: Array | None, *, num_heads: int,
              rope: bool, implementation: str) -> Array:
  """Causal multi-head self-attention core (no projections).

  Args:
    qkv: `[B, T, 3 * D]`, the output of the `qkv` projection (q, k, v blocks of D).
    positions: int `[B, T]` (used only by RoPE).
    mask: bool `[B, 1, T, T]` from `segment_mask`, or None.
    num_heads: Heads N (D must be divisible by N).
    rope: Rotate queries and keys by `embeddings.apply_rope`.
    implementation: 'xla' or 'cudnn' (`jax.nn.dot_product_attention`), 'blocked'
      (`blocked_causal_attention`: the same function, about half the score work), or 'auto'
      (`auto.attention_impl` of this platform, dtype and shape).

  Returns:
    `[B, T, D]` (heads concatenated) in the dtype of `qkv`.
  """
  b, t, three_d = qkv.shape
  d = three_d // 3
  if implementation == auto.AUTO_ATTENTION:  # Library use; training resolves it at startup.
    implementation = auto.attention_impl(
        implementation, platform=jax.default_backend(), dtype=jnp.dtype(qkv.dtype).name,
        head_dim=d // num_heads, seq_len=t)
  qkv = qkv.reshape(b, t, 3, num_heads, d // num_heads)
  if implementation == 'blocked' and not rope:
    # One transpose to heads-major [3, B, N, T, H] instead of three slices and three
    # swapaxes; its backward is one concatenate+transpose instead of pad, add and copy.
    q, k, v = jnp.transpose(qkv, (2, 0, 3, 1, 4))
    a = _blocked_heads_major(q, k, v, mask, ATTENTION_BLOCK)
    return jnp.swapaxes(a, 1, 2).reshape(b, t, d)
  q, k, v = qkv[:, :, 0], qkv[:, :, 1], qkv[:, :, 2]
  if rope:
    q = embeddings.apply_rope(q, positions)
    k = embeddings.apply_rope(k, positions)
  if implementation == 'blocked':
    a = blocked_causal_attention(q, k, v, mask)
  else:
    a = jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True,
                                     implementation=implementation)
  return a.reshape(b, t, d)


ATTENTION_BLOCK = 64  # Query rows per block of `blocked_causal_attention`.


def blocked_causal_attention(q: Array, k: Array, v: Array, mask: Array | None,
                             block: int = ATTENTION_BLOCK) -> Array:
  """Causal attention computed per query block against that block's key prefix only.

  The same function as `jax.nn.dot_product_attention(..., is_causal=True,
  implementation='xla')` up to float32 rounding: scores in float32 scaled by
  `1/sqrt(H)`, disallowed entries pushed to the float32 minimum, an exact (not online)
  softmax over the row, probabilities cast to the value dtype. Query block `i` (rows
  `[i*block, (i+1)*block)`) only multiplies against keys `[0, (i+1)*block)`, which the
  causal mask leaves as the only ones with non-zero weight, so the score, softmax and
  probability-times-value work and memory (forward and backward) shrink from `T^2` to
  about `T^2/2 + T*block/2`: at T=256, block 64, 62.5% of the square. The blocks are a
  static Python loop (T/block unrolled pieces), so XLA sees ordinary dots and fusions.
  Used on CPUs ('blocked'); accelerators have fused kernels ('cudnn').

  Args:
    q, k, v: `[B, T, N, H]`.
    mask: bool `[B, 1, T, T]` (True = may attend, e.g. `segment_mask`), or None.
    block: query rows per block (the last block may be shorter).

  Returns:
    `[B, T, N, H]` in the dtype of `v`.
  """
  out = _blocked_heads_major(jnp.swapaxes(q, 1, 2), jnp.swapaxes(k, 1, 2),
                             jnp.swapaxes(v, 1, 2), mask, block)
  return jnp.swapaxes(out, 1, 2)


def _blocked_heads_major(q: Array, k: Array, v: Array, mask: Array | None,
                         block: int) -> Array:
  """`blocked_causal_attention` on heads-major `[B, N, T, H]` inputs; returns `[B, N, T, H]`.

  Heads-major makes every block's dots contiguous batched matmuls. The scale goes on q (as
  many multiplies as q has elements, not T^2/2). Disallowed scores get the float32 minimum
  *added* rather than selected: after the max-subtraction their exponent underflows to
  exactly 0 either way (each row keeps its diagonal), so the probabilities are the same,
  and the backward needs no select pass over the scores.
  """
  t, h = q.shape[2], q.shape[-1]
  q = q * jnp.asarray(1.0 / math.sqrt(h), q.dtype)
  neg = jnp.finfo(jnp.float32).min
  outs = []
  for start in range(0, t, block):
    end = min(start + block, t)
    s = jnp.einsum('bnqh,bnkh->bnqk', q[:, :, start:end], k[:, :, :end],
                   preferred_element_type=jnp.float32)
    allowed = (jnp.arange(start, end)[:, None] >= jnp.arange(end)[None, :])[None, None]
    if mask is not None:
      allowed = allowed & mask[:, :, start:end, :end]
    p = jax.nn.softmax(s + jnp.where(allowed, 0.0, neg), axis=-1)
    outs.append(jnp.einsum('bnqk,bnkh->bnqh', p.astype(v.dtype), v[:, :, :end]))
  return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=2)


def mlp(x: Array, mlp_in: Layer, mlp_out: Layer) -> Array:
  """Transformer MLP: `mlp_out(gelu_tanh(mlp_in(x)))`.

  Args:
    x: `[B, T, D]`.
    mlp_in: Dense layer `[..., D] -> [..., mlp_dim]`.
    mlp_out: Dense layer `[..., mlp_dim] -> [..., D]`.

  Returns:
    `[B, T, D]`.
  """
  return mlp_out(jax.nn.gelu(mlp_in(x), approximate=True))


def block(x: Array, mask: Array | None, positions: Array, *, ln_1: Layer, qkv: Layer,
          attn_out: Layer, ln_2: Layer, mlp_in: Layer, mlp_out: Layer, drop_attn: Layer,
          drop_mlp: Layer, num_heads: int, rope: bool, implementation: str) -> Array:
  """Pre-LN transformer block: `x + drop(attn(ln_1(x)))`, then `x + drop(mlp(ln_2(x)))`.

  The layers are callables built by the caller's framework (linen or NNX modules,
  dropout with its `deterministic` flag already bound).

  Args:
    x: `[B, T, D]` in the compute dtype.
    mask: bool `[B, 1, T, T]` or None (causal only).
    positions: int `[B, T]` (RoPE).
    ln_1, ln_2: LayerNorms `[..., D] -> [..., D]`.
    qkv: Dense `[..., D] -> [..., 3D]`.
    attn_out: Dense `[..., D] -> [..., D]`.
    mlp_in, mlp_out: Dense layers of the MLP.
    drop_attn, drop_mlp: Dropout on the attention and MLP outputs.
    num_heads: Attention heads.
    rope: Apply RoPE to queries and keys.
    implementation: Attention implementation ('auto', 'xla', 'cudnn', 'blocked').

  Returns:
    `[B, T, D]`.
  """
  a = attention(qkv(ln_1(x)), positions, mask, num_heads=num_heads, rope=rope,
                implementation=implementation)
  x = x + drop_attn(attn_out(a))
  return x + drop_mlp(mlp(ln_2(x), mlp_in, mlp_out))


def embedding_sum(token_rows: Array, position_rows: Array | None = None,
                  embed_delta: Array | None = None) -> Array:
  """Input of the first block: token rows + position rows + `embed_delta`, in float32.

  The sum is formed in float32 whatever the compute dtype, so the gradient with
  respect to `embed_delta` (the per-token embedding gradient used for statistics)
  is float32; the caller casts to the compute dtype afterwards.

  Args:
    token_rows: `[B, T, D]` token embeddings.
    position_rows: `[B, T, D]` learned rows or sinusoid, or None (RoPE / NoPE).
    embed_delta: float32 `[B, T, D]` (normally zeros), or None; added last with `+`.

  Returns:
    float32 `[B, T, D]`.
  """
  x = token_rows.astype(jnp.float32)
  if position_rows is not None:
    x = x + position_rows.astype(jnp.float32)
  if embed_delta is not None:
    x = x + embed_delta
  return x


def check_lm_inputs(inputs: Array, positions: Array, segment_ids: Array | None) -> None:
  """Raises ValueError unless `inputs`, `positions` (and `segment_ids`) are all `[B, T]`.

  `embed_delta` is deliberately not checked: callers may pass any object that
  supports `x + embed_delta` (e.g. a probe that records the width of the sum).
  """
  if inputs.ndim != 2 or positions.shape != inputs.shape:
    raise ValueError(f"inputs and positions must both be [B, T]; got {inputs.shape} and "
                     f"{positions.shape}.")
  if segment_ids is not None and segment_ids.shape != inputs.shape:
    raise ValueError(f"segment_ids must be [B, T] = {inputs.shape}, got {segment_ids.shape}.")
