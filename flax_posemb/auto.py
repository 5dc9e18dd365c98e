"""What `attention_impl='auto'` and `grad_accum_steps=0` become
(docs/DESIGN.md § Config): set once where a run starts (`resolve_config`,
recorded in `config.json`), else at trace time."""

from collections.abc import Mapping
from typing import Any

from flax import traverse_util
import jax

AUTO_ATTENTION = 'auto'
AUTO_ACCUM = 0  # grad_accum_steps value that means "choose".
# Tokens per microbatch on CPU (rows x seq_len), at most.
CPU_MICROBATCH_TOKENS = 1024


def attention_impl(
    impl: str,
    *,
    platform: str,
    dtype: str,
    head_dim: int,
    seq_len: int,
    compute_capability: tuple[int, ...] | None = None,
) -> str:
  """`impl`, or for 'auto' 'blocked' (CPU), 'cudnn' where it applies
  (docs/DESIGN.md § Config; also an even `seq_len`) or 'xla';
  `compute_capability` None reads the first device's."""
  if impl != AUTO_ATTENTION:
    return impl
  if platform == 'cpu':
    return 'blocked'
  if platform in ('gpu', 'cuda') and str(dtype) in ('bfloat16', 'float16'):
    if compute_capability is None:
      cc = str(getattr(jax.devices()[0], 'compute_capability', '0')).split('.')
      compute_capability = tuple(int(x) for x in cc if x.isdigit())
    if (
        compute_capability >= (8, 0)
        and head_dim % 8 == 0
        and head_dim <= 128
        and seq_len % 2 == 0
    ):
      return 'cudnn'
  return 'xla'


def grad_accum_steps(
    steps: int,
    *,
    platform: str,
    batch_size: int,
    seq_len: int,
    num_devices: int,
) -> int:
  """Microbatches per optimizer step that `steps` stands for (unchanged unless
  0): 1 on accelerators; on CPU the smallest divisor K of the per-device rows
  (global `batch_size` over `num_devices`) with `rows / K * seq_len <=
  CPU_MICROBATCH_TOKENS`, else one row each."""
  if steps != AUTO_ACCUM:
    return steps
  rows = batch_size // max(num_devices, 1)
  if platform != 'cpu' or rows < 1 or batch_size % max(num_devices, 1):
    # An uneven batch is reported by sharding.check_batch_layout with K = 1.
    return 1
  for k in range(1, rows + 1):
    if rows % k == 0 and rows // k * seq_len <= CPU_MICROBATCH_TOKENS:
      return k
  return rows


def resolve_config(
    config: Any,
    *,
    saved: Mapping[str, Any] | None = None,
    platform: str | None = None,
    num_devices: int | None = None,
) -> dict:
  """Replaces the auto values of `config` in place; returns `{field: (auto,
  resolved)}`. On a resume (`saved`: the run's `config.json`) an auto field
  keeps its recorded value (ibid.)."""
  platform = platform or jax.default_backend()
  num_devices = num_devices or jax.device_count()
  old = traverse_util.flatten_dict(dict(saved or {}), sep='.')
  m = config.model
  seq_len = int(config.data.seq_len)
  done: dict[str, tuple[Any, Any]] = {}
  if m.attention_impl == AUTO_ATTENTION:
    m.attention_impl = old.get('model.attention_impl') or attention_impl(
        AUTO_ATTENTION,
        platform=platform,
        dtype=m.dtype,
        seq_len=seq_len,
        head_dim=int(m.emb_dim) // max(int(m.num_heads), 1),
    )
    done['model.attention_impl'] = (AUTO_ATTENTION, m.attention_impl)
  if int(config.grad_accum_steps) == AUTO_ACCUM:
    # A resume keeps the recorded microbatches while the batch is the same.
    same_batch = old.get('batch_size') == int(config.batch_size) and (
        old.get('data.seq_len') == seq_len
    )
    recorded = old.get('grad_accum_steps') if same_batch else None
    if recorded:
      config.grad_accum_steps = int(recorded)
    else:
      config.grad_accum_steps = grad_accum_steps(
          AUTO_ACCUM,
          platform=platform,
          batch_size=int(config.batch_size),
          seq_len=seq_len,
          num_devices=num_devices,
      )
    done['grad_accum_steps'] = (AUTO_ACCUM, config.grad_accum_steps)
  return done
