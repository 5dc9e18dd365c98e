"""The fast exact path by default: what `attention_impl='auto'` and `grad_accum_steps=0` become.

Both rules are small functions of the platform and the shapes, resolved once where a run
starts (`resolve_config`, called by `training.train_and_evaluate` before `config.json` is
written, so the run records what it ran) and also at trace time for library users who build
a model with `attention_impl='auto'` themselves (`attention_impl`):

* **attention** (`attention_impl`): ``'blocked'`` on CPU (`layers.blocked_causal_attention`:
  per-query-block key prefixes, ~0.8x of the XLA step's time at T=256; README, Benchmarks);
  ``'cudnn'`` (cuDNN flash attention) on an NVIDIA GPU of compute capability >= 8.0 with a
  bf16/fp16 compute dtype, a head dim that is a multiple of 8 and <= 128 and an even sequence
  length (the shapes `jax.nn.dot_product_attention(implementation='cudnn')` accepts with a
  mask); ``'xla'`` otherwise. All three compute the same function (tested to 1e-5).
* **microbatches** (`grad_accum_steps`): on CPU the smallest divisor ``K`` of the per-device
  batch whose microbatch holds at most `CPU_MICROBATCH_TOKENS` tokens (rows x sequence
  length), so a microbatch's activations stay near the last-level cache (1.3-1.4x faster
  steps at the small benchmark shape); 1 on accelerators. The optimizer step is the same:
  the loss is divided by the whole batch's target count and gradients and statistics are
  summed over microbatches (float32 rounding differs; tested).

Explicit values in a config are never changed. A resumed run whose config leaves a field on
auto takes the value its `config.json` recorded, so a run keeps what it started with.

Huge pages for glibc's malloc are the third part of the fast path; the tunable must be set
before the process starts, so the CLIs set it (`cli.start_on_huge_pages`).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import jax

AUTO_ATTENTION = 'auto'
AUTO_ACCUM = 0  # grad_accum_steps value that means "choose".
CPU_MICROBATCH_TOKENS = 1024  # Tokens per microbatch on CPU (rows x seq_len), at most.


def _compute_capability() -> tuple[int, ...]:
  """The first device's CUDA compute capability, e.g. (9, 0); () when unknown."""
  try:
    return tuple(int(x) for x in str(jax.devices()[0].compute_capability).split('.'))
  except (AttributeError, ValueError, RuntimeError):
    return ()


def attention_impl(impl: str, *, platform: str, dtype: str, head_dim: int, seq_len: int,
                   compute_capability: tuple[int, ...] | None = None) -> str:
  """The attention implementation that ``impl`` stands for (unchanged unless ``'auto'``).

  Args:
    impl: ``ModelConfig.attention_impl``: 'auto', 'xla', 'cudnn' or 'blocked'.
    platform: ``jax.default_backend()``: 'cpu', 'gpu' (or 'cuda'/'rocm'), 'tpu'.
    dtype: compute dtype name ('float32', 'bfloat16', 'float16').
    head_dim: features per head.
    seq_len: query (= key) length.
    compute_capability: CUDA compute capability; None reads it from the first device.

  Returns:
    'xla', 'cudnn' or 'blocked'.
  """
  if impl != AUTO_ATTENTION:
    return impl
  if platform == 'cpu':
    return 'blocked'
  if platform in ('gpu', 'cuda') and str(dtype) in ('bfloat16', 'float16'):
    cc = _compute_capability() if compute_capability is None else compute_capability
    if cc >= (8, 0) and head_dim % 8 == 0 and head_dim <= 128 and seq_len % 2 == 0:
      return 'cudnn'
  return 'xla'


def grad_accum_steps(steps: int, *, platform: str, batch_size: int, seq_len: int,
                     num_devices: int) -> int:
  """Microbatches per optimizer step that ``steps`` stands for (unchanged unless 0).

  Args:
    steps: the config's ``grad_accum_steps`` (0 = auto).
    platform: ``jax.default_backend()``.
    batch_size: global rows per optimizer step.
    seq_len: tokens per row.
    num_devices: devices the batch is split over (``mesh.size``).

  Returns:
    ``steps`` if it is not 0; on accelerators 1; on CPU the smallest divisor ``K`` of the
    per-device rows with ``rows / K * seq_len <= CPU_MICROBATCH_TOKENS`` (one row per
    microbatch when a row alone is longer).
  """
  if steps != AUTO_ACCUM:
    return steps
  rows = batch_size // max(num_devices, 1)
  if platform != 'cpu' or rows < 1 or batch_size % max(num_devices, 1):
    return 1  # An uneven batch is reported by sharding.check_batch_layout with K = 1.
  return next((k for k in range(1, rows + 1)
               if rows % k == 0 and rows // k * seq_len <= CPU_MICROBATCH_TOKENS), rows)


def _saved(saved: Mapping[str, Any] | None, *path: str) -> Any:
  node = saved or {}
  for key in path:
    node = node.get(key) if isinstance(node, Mapping) else None
  return node


def resolve_config(config: Any, *, saved: Mapping[str, Any] | None = None,
                   platform: str | None = None, num_devices: int | None = None) -> dict:
  """Replaces the auto values of ``config`` (in place) by concrete ones.

  Args:
    config: a training config (``model.attention_impl``, ``grad_accum_steps``,
      ``batch_size``, ``data.seq_len``, ``model.dtype``, ``model.emb_dim``,
      ``model.num_heads``); an ``ml_collections.ConfigDict`` or ``benchmarks.common.Cfg``.
    saved: the run's recorded ``config.json`` (a resume): an auto field takes its value there
      (``grad_accum_steps`` only while ``batch_size`` and ``data.seq_len`` are unchanged).
    platform: default ``jax.default_backend()``.
    num_devices: default ``jax.device_count()``.

  Returns:
    ``{field: (auto value, resolved value)}`` of the fields that were auto (for the log).
  """
  platform = platform or jax.default_backend()
  num_devices = num_devices or jax.device_count()
  m = config.model
  done = {}
  if m.attention_impl == AUTO_ATTENTION:
    m.attention_impl = _saved(saved, 'model', 'attention_impl') or attention_impl(
        AUTO_ATTENTION, platform=platform, dtype=m.dtype, seq_len=int(config.data.seq_len),
        head_dim=int(m.emb_dim) // max(int(m.num_heads), 1))
    done['model.attention_impl'] = (AUTO_ATTENTION, m.attention_impl)
  if int(config.grad_accum_steps) == AUTO_ACCUM:
    same_batch = (_saved(saved, 'batch_size') == int(config.batch_size)
                  and _saved(saved, 'data', 'seq_len') == int(config.data.seq_len))
    config.grad_accum_steps = int(same_batch and _saved(saved, 'grad_accum_steps') or grad_accum_steps(
        AUTO_ACCUM, platform=platform, batch_size=int(config.batch_size),
        seq_len=int(config.data.seq_len), num_devices=num_devices))
    done['grad_accum_steps'] = (AUTO_ACCUM, config.grad_accum_steps)
  return done
