"""An independent plain-JAX GPT-2 written only as a speed reference (no Flax, no
statistics).

It mirrors what a user's own training loop would look like: parameters are a
plain dict of arrays, the forward pass is a few `jnp` functions, and the step is
`jax.value_and_grad` + the same optax AdamW chain as the library (clip, Adam,
decoupled weight decay, learning rate). It shares no code with
`flax_posemb.model`, so a difference in speed points at the library's model or
step, not at JAX.

Two layout choices are exposed because they measurably change CPU speed:
  * `kernel_layout='in_out'` stores Dense kernels `[in, out]` (`x @ W`, Flax
    style); `'out_in'` stores `[out, in]` (`x @ W.T`, PyTorch/HF-Flax GPT-2
    style);
  * `segment_mask=True` restricts attention to equal segment ids (what the
    library always does for packed rows); False is causal only (what GPT-2 peers
    do).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import optax

Params = dict[str, Any]


@dataclasses.dataclass(frozen=True)
class RefConfig:
  """Shape and precision of the reference GPT-2."""

  vocab_size: int = 256
  num_layers: int = 4
  num_heads: int = 4
  emb_dim: int = 256
  mlp_dim: int = 1024
  max_len: int = 256
  # Compute dtype; parameters stay float32, logits float32.
  dtype: Any = jnp.float32
  # 'in_out' ([in, out], x @ W) | 'out_in' ([out, in], x @ W.T)
  kernel_layout: str = 'in_out'
  segment_mask: bool = True  # Mask attention by segment id as well as causally.
  # 'where': scale and select on the scores; 'bias': q scaled first + additive
  # mask bias (HF/Flax style, ~6% fewer bytes).
  attention: str = 'where'

  def __post_init__(self):
    if self.kernel_layout not in ('in_out', 'out_in'):
      raise ValueError(
          "kernel_layout must be 'in_out' or 'out_in', got"
          f' {self.kernel_layout!r}.'
      )
    if self.attention not in ('bias', 'where'):
      raise ValueError(
          f"attention must be 'bias' or 'where', got {self.attention!r}."
      )
    if self.emb_dim % self.num_heads:
      raise ValueError(
          f'emb_dim {self.emb_dim} must be divisible by num_heads'
          f' {self.num_heads}.'
      )


def _kernel(
    key, fan_in: int, fan_out: int, std: float, layout: str
) -> jax.Array:
  shape = (fan_in, fan_out) if layout == 'in_out' else (fan_out, fan_in)
  return std * jax.random.normal(key, shape, jnp.float32)


def init(cfg: RefConfig, key: jax.Array) -> Params:
  """GPT-2 initial parameters (N(0, 0.02), residual projections / sqrt(2L)).

  Args:
    cfg: shape.
    key: PRNG key.

  Returns:
    Nested dict of float32 arrays: `wte` `[V, D]`, `wpe` `[max_len, D]`,
    `blocks` (list of per-layer dicts), `ln_f`.
  """
  d = cfg.emb_dim
  f = cfg.mlp_dim
  lay = cfg.kernel_layout
  keys = jax.random.split(key, 2 + 4 * cfg.num_layers)
  resid = 0.02 / math.sqrt(2 * cfg.num_layers)

  def ln():
    return {
        'scale': jnp.ones((d,), jnp.float32),
        'bias': jnp.zeros((d,), jnp.float32),
    }

  blocks = []
  for i in range(cfg.num_layers):
    k = keys[2 + 4 * i : 6 + 4 * i]
    blocks.append(
        {
            'ln_1': ln(),
            'ln_2': ln(),
            'qkv_w': _kernel(k[0], d, 3 * d, 0.02, lay),
            'qkv_b': jnp.zeros((3 * d,)),
            'proj_w': _kernel(k[1], d, d, resid, lay),
            'proj_b': jnp.zeros((d,)),
            'fc_w': _kernel(k[2], d, f, 0.02, lay),
            'fc_b': jnp.zeros((f,)),
            'out_w': _kernel(k[3], f, d, resid, lay),
            'out_b': jnp.zeros((d,)),
        }
    )
  return {
      'wte': (
          0.02 * jax.random.normal(keys[0], (cfg.vocab_size, d), jnp.float32)
      ),
      'wpe': 0.01 * jax.random.normal(keys[1], (cfg.max_len, d), jnp.float32),
      'blocks': blocks,
      'ln_f': ln(),
  }


def _layer_norm(x: jax.Array, p: Params) -> jax.Array:
  x32 = x.astype(jnp.float32)
  mean = jnp.mean(x32, -1, keepdims=True)
  var = jnp.mean(jnp.square(x32 - mean), -1, keepdims=True)
  y = (x32 - mean) * jax.lax.rsqrt(var + 1e-5) * p['scale'] + p['bias']
  return y.astype(x.dtype)


def _dense(x: jax.Array, w: jax.Array, b: jax.Array, layout: str) -> jax.Array:
  w = w.astype(x.dtype)
  y = x @ w if layout == 'in_out' else jnp.einsum('...i,oi->...o', x, w)
  return y + b.astype(x.dtype)


def forward(
    cfg: RefConfig,
    params: Params,
    inputs: jax.Array,
    positions: jax.Array,
    segment_ids: jax.Array | None = None,
) -> jax.Array:
  """Logits of the reference GPT-2.

  Args:
    cfg: shape.
    params: from `init`.
    inputs: int32 `[B, T]` token ids.
    positions: int32 `[B, T]` position ids.
    segment_ids: int32 `[B, T]` (used when `cfg.segment_mask`), or None.

  Returns:
    float32 logits `[B, T, V]`.
  """
  b, t = inputs.shape
  n = cfg.num_heads
  h = cfg.emb_dim // cfg.num_heads
  lay = cfg.kernel_layout
  x = (params['wte'][inputs] + params['wpe'][positions]).astype(cfg.dtype)
  allowed = jnp.tril(jnp.ones((t, t), bool))[None, None]
  if cfg.segment_mask and segment_ids is not None:
    allowed = allowed & (
        segment_ids[:, None, :, None] == segment_ids[:, None, None, :]
    )
  scale = 1.0 / math.sqrt(h)
  neg = jnp.finfo(jnp.float32).min
  bias = jnp.where(allowed, 0.0, neg).astype(jnp.float32)
  for blk in params['blocks']:
    y = _layer_norm(x, blk['ln_1'])
    qkv = _dense(y, blk['qkv_w'], blk['qkv_b'], lay).reshape(b, t, 3, n, h)
    q = qkv[:, :, 0]
    k = qkv[:, :, 1]
    v = qkv[:, :, 2]
    if cfg.attention == 'bias':
      s = jnp.einsum('bqnh,bknh->bnqk', q * scale, k).astype(jnp.float32) + bias
    else:
      s = jnp.einsum('bqnh,bknh->bnqk', q, k).astype(jnp.float32) * scale
      s = jnp.where(allowed, s, neg)
    a = jax.nn.softmax(s, axis=-1).astype(cfg.dtype)
    o = jnp.einsum('bnqk,bknh->bqnh', a, v).reshape(b, t, cfg.emb_dim)
    x = x + _dense(o, blk['proj_w'], blk['proj_b'], lay)
    y = _layer_norm(x, blk['ln_2'])
    y = jax.nn.gelu(_dense(y, blk['fc_w'], blk['fc_b'], lay), approximate=True)
    x = x + _dense(y, blk['out_w'], blk['out_b'], lay)
  x = _layer_norm(x, params['ln_f'])
  return jnp.einsum('btd,vd->btv', x, params['wte'].astype(x.dtype)).astype(
      jnp.float32
  )


def make_optimizer(
    learning_rate: float = 3e-4, weight_decay: float = 0.1
) -> optax.GradientTransformation:
  """Clip 1.0 + AdamW(b1=0.9, b2=0.95), decay on matrices only (the library's
  chain)."""

  def mask(p):
    return jax.tree.map(lambda x: x.ndim >= 2, p)

  return optax.chain(
      optax.clip_by_global_norm(1.0),
      optax.adamw(
          learning_rate, b1=0.9, b2=0.95, weight_decay=weight_decay, mask=mask
      ),
  )


def make_train_step(cfg: RefConfig, tx: optax.GradientTransformation):
  """Jitted `(params, opt_state, batch) -> (params, opt_state, loss)`, params
  donated.

  `batch` holds `inputs`, `targets`, `positions`, `segment_ids` (int32 `[B, T]`)
  and `loss_mask` (float32 `[B, T]`); the loss is the masked mean token cross
  entropy."""

  def loss_fn(params, batch):
    logits = forward(
        cfg, params, batch['inputs'], batch['positions'], batch['segment_ids']
    )
    tl = optax.softmax_cross_entropy_with_integer_labels(
        logits, batch['targets']
    )
    m = batch['loss_mask'].astype(jnp.float32)
    return jnp.sum(tl * m) / jnp.maximum(jnp.sum(m), 1.0)

  def step(params, opt_state, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return jax.jit(step, donate_argnums=(0, 1))


def num_params(params: Params) -> int:
  """Total parameter count."""
  return sum(int(x.size) for x in jax.tree.leaves(params))
