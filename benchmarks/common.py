"""Shared benchmark helpers: shapes, synthetic batches, timing, FLOPs, matmul
peak, bootstrap.

Conventions used by every suite:
  * a step is timed from dispatch to `block_until_ready` of its outputs; the
    first `warmup` calls (compilation included) are discarded; median, min and
    max are reported;
  * FLOPs per token follow nanoGPT/PaLM: `6 * N + 12 * L * D * T` with `N` the
    parameters excluding the position table (the tied token table counts once,
    as the output head);
  * MFU = achieved FLOP/s / the peak of a large matmul measured in the same
    process.
"""

from __future__ import annotations

from collections.abc import Callable
import dataclasses
import functools
import os
import platform
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class Shape:
  """A benchmark model/batch shape."""

  name: str
  vocab_size: int
  num_layers: int
  num_heads: int
  emb_dim: int
  seq_len: int
  batch_size: int
  mlp_dim: int = 0  # 0 = 4 * emb_dim.
  dtype: str = 'float32'

  @property
  def mlp(self) -> int:
    return self.mlp_dim or 4 * self.emb_dim

  @property
  def tokens(self) -> int:
    return self.batch_size * self.seq_len

  def replace(self, **kw) -> Shape:
    return dataclasses.replace(self, **kw)


# The small CPU shape and the tiny config's shape (configs/tiny.py).
SMALL = Shape('small', 256, 4, 4, 256, 256, 16)
TINY = Shape('tiny', 64, 2, 4, 64, 128, 16, mlp_dim=256)
GPT2_SMALL = Shape('gpt2_small', 50257, 12, 12, 768, 1024, 16, dtype='bfloat16')
# Miniature shape for the smoke test (seconds on a shared CPU).
MINI = Shape('mini', 32, 1, 2, 32, 16, 4)


class Cfg(dict):
  """A nested dict with attribute access: what the train step reads from a
  config.

  The benchmarks build their configs with this instead of `flax_posemb.defaults`
  (`ml_collections.ConfigDict`), so they run where only
  jax/flax/optax/orbax/numpy are installed (the accelerator image).
  `StepConfig` holds its data and optimizer sections."""

  def __getattr__(self, k):
    try:
      return self[k]
    except KeyError:
      raise AttributeError(k) from None

  def __setattr__(self, k, v):
    if k not in self:
      raise AttributeError(f'unknown config field {k!r}')
    self[k] = v

  def to_dict(self) -> dict:
    return {
        k: v.to_dict() if isinstance(v, Cfg) else v for k, v in self.items()
    }


# The fields of `flax_posemb.defaults.base()` that the train step reads, with
# the same values (tests/test_benchmarks.py checks them against
# `defaults.base()`).
_OPTIMIZER_DEFAULTS = dict(
    learning_rate=3e-3,
    warmup_steps=20,
    end_lr_ratio=0.1,
    b1=0.9,
    b2=0.95,
    eps=1e-8,
    weight_decay=0.1,
    decay_position_table=True,
    decay_token_table=True,
    grad_clip_norm=1.0,
    row_lr_scale=False,
    row_lr_power=0.5,
    row_lr_max=10.0,
    position_optimizer='adam',
    position_momentum=0.9,
    position_lr_scale=1.0,
)


@dataclasses.dataclass(frozen=True)
class StepConfig:
  """What the train step reads of a `flax_posemb.config.RunConfig`, built
  without `flax_posemb.config`, whose checks import Grain (absent from the
  accelerator image); frozen, so that `auto.resolve_config` replaces it."""

  seed: int
  num_train_steps: int
  batch_size: int
  grad_accum_steps: int
  collect_stats: bool
  fsdp: bool
  data: Cfg
  model: Any
  optimizer: Cfg

  def to_dict(self) -> dict:
    return {
        f.name: _plain(getattr(self, f.name)) for f in dataclasses.fields(self)
    }


def _plain(value: Any) -> Any:
  """A section as a dict (`StepConfig.to_dict`)."""
  if isinstance(value, Cfg):
    return value.to_dict()
  if dataclasses.is_dataclass(value):
    return dataclasses.asdict(value)
  return value


def base_config() -> StepConfig:
  """Defaults of the train step's config without ml_collections or Grain
  (see `StepConfig`)."""
  from flax_posemb import model as model_lib

  return StepConfig(
      seed=0,
      num_train_steps=200,
      batch_size=32,
      grad_accum_steps=0,
      collect_stats=True,
      fsdp=False,
      data=Cfg(seq_len=128),
      model=model_lib.ModelConfig(),
      optimizer=Cfg(_OPTIMIZER_DEFAULTS),
  )


def model_config(shape: Shape, **overrides) -> StepConfig:
  """A train-step config (`StepConfig`) for `shape`; dotted `overrides` such
  as `model.remat=True`."""
  from flax_posemb import model as model_lib

  values = base_config().to_dict()
  values.update(batch_size=shape.batch_size, num_train_steps=1000)
  values['data']['seq_len'] = shape.seq_len
  values['model'].update(
      vocab_size=shape.vocab_size,
      num_layers=shape.num_layers,
      num_heads=shape.num_heads,
      emb_dim=shape.emb_dim,
      mlp_dim=shape.mlp,
      max_len=shape.seq_len,
      dtype=shape.dtype,
  )
  for k, v in overrides.items():
    node = values
    *path, last = k.split('.')
    for p in path:
      node = node[p]
    if last not in node:
      raise KeyError(f'unknown config field {k!r}')
    node[last] = v
  return StepConfig(
      **{
          k: v
          for k, v in values.items()
          if k not in ('data', 'model', 'optimizer')
      },
      data=Cfg(values['data']),
      model=model_lib.ModelConfig(**values['model']),
      optimizer=Cfg(values['optimizer']),
  )


def synthetic_batch(
    shape: Shape, seed: int = 0, packed_docs: int = 1
) -> dict[str, np.ndarray]:
  """A full batch of random tokens (every position scored), laid out as
  docs/DESIGN.md § Batch says.

  Args:
    shape: batch shape (`batch_size`, `seq_len`, `vocab_size`).
    seed: numpy seed.
    packed_docs: documents per row (segment ids 1..packed_docs, equal lengths).

  Returns:
    dict of `[B, T]` arrays: inputs/targets/positions/segment_ids int32,
        loss_mask float32.
  """
  rng = np.random.default_rng(seed)
  b = shape.batch_size
  t = shape.seq_len
  toks = rng.integers(0, shape.vocab_size, (b, t + 1), dtype=np.int32)
  seg = (np.arange(t) * packed_docs // t + 1).astype(np.int32)
  return {
      'inputs': toks[:, :-1],
      'targets': toks[:, 1:],
      'positions': np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy(),
      'segment_ids': np.broadcast_to(seg, (b, t)).copy(),
      'loss_mask': np.ones((b, t), np.float32),
  }


def flops_per_token(shape: Shape, n_params_no_pos: int) -> float:
  """Training FLOPs per token: `6 N + 12 L D T` (forward + backward, PaLM
  appendix B)."""
  return (
      6.0 * n_params_no_pos
      + 12.0 * shape.num_layers * shape.emb_dim * shape.seq_len
  )


def block(x: Any) -> Any:
  """`block_until_ready` on every array leaf of `x`."""
  return jax.tree.map(
      lambda a: a.block_until_ready() if hasattr(a, 'block_until_ready') else a,
      x,
  )


def summarize(times: list[float]) -> dict[str, float]:
  """Median, min, max and count of a list of seconds."""
  a = np.asarray(times, np.float64)
  return {
      'median_s': float(np.median(a)),
      'min_s': float(a.min()),
      'max_s': float(a.max()),
      'n': int(a.size),
  }


def time_calls(fn: Callable[[], Any], steps: int, warmup: int) -> list[float]:
  """Times `steps` calls of `fn` after `warmup` untimed ones; each call is
  blocked on.

  Returns:
    Seconds per timed call, in order.
  """
  for _ in range(warmup):
    block(fn())
  out = []
  for _ in range(steps):
    t0 = time.perf_counter()
    block(fn())
    out.append(time.perf_counter() - t0)
  return out


def matmul_peak(
    dtype: str = 'float32',
    sizes: tuple[int, ...] = (1024, 2048),
    repeats: int = 5,
) -> dict[str, Any]:
  """Best achieved FLOP/s of a jitted square matmul `[n, n] @ [n, n]` on the
  default device.

  Args:
    dtype: operand dtype name.
    sizes: matrix sizes tried; the best median over sizes is the peak.
    repeats: timed calls per size (after one warm-up).

  Returns:
    {'flops_per_s': peak, 'by_size': {n: median FLOP/s}, 'dtype': dtype}.
  """
  by = {}
  f = jax.jit(lambda a, b: a @ b)
  for n in sizes:
    k1, k2 = jax.random.split(jax.random.key(n))
    a = jax.random.normal(k1, (n, n), jnp.float32).astype(dtype)
    b = jax.random.normal(k2, (n, n), jnp.float32).astype(dtype)
    ts = time_calls(functools.partial(f, a, b), repeats, 1)
    by[str(n)] = 2.0 * n**3 / float(np.median(ts))
  return {'flops_per_s': max(by.values()), 'by_size': by, 'dtype': dtype}


def bootstrap_ci(
    values: np.ndarray,
    stat: Callable[[np.ndarray], float] = np.median,
    n_boot: int = 2000,
    level: float = 0.95,
    seed: int = 0,
) -> tuple[float, float]:
  """Percentile bootstrap interval of `stat` over `values` `[n]` (resampled with
  replacement)."""
  v = np.asarray(values, np.float64)
  rng = np.random.default_rng(seed)
  idx = rng.integers(0, v.size, (n_boot, v.size))
  boots = np.array([stat(v[i]) for i in idx])
  lo, hi = np.quantile(boots, [(1 - level) / 2, 1 - (1 - level) / 2])
  return float(lo), float(hi)


def machine_info() -> dict[str, Any]:
  """Machine, backend and library versions for the results header."""
  cpu = platform.processor() or platform.machine()
  try:
    with open('/proc/cpuinfo') as f:
      for line in f:
        if line.startswith('model name'):
          cpu = line.split(':', 1)[1].strip()
          break
  except OSError:
    pass
  info = {
      'cpu': cpu,
      'cpu_count': os.cpu_count(),
      'python': platform.python_version(),
      'backend': jax.default_backend(),
      'devices': [str(d) for d in jax.devices()],
      'jax': jax.__version__,
  }
  for mod in ('jaxlib', 'flax', 'optax', 'grain', 'transformers', 'torch'):
    try:
      info[mod] = __import__(mod).__version__
    except Exception:
      info[mod] = None
  return info


def compiled_memory(compiled) -> dict[str, int] | None:
  """`compiled.memory_analysis()` as a dict of byte counts (None where
  unsupported)."""
  m = compiled.memory_analysis()
  if m is None:
    return None
  keys = (
      'argument_size_in_bytes',
      'output_size_in_bytes',
      'alias_size_in_bytes',
      'temp_size_in_bytes',
      'generated_code_size_in_bytes',
      'peak_memory_in_bytes',
  )
  return {
      k.replace('_size_in_bytes', '').replace('_in_bytes', ''): int(
          getattr(m, k, 0) or 0
      )
      for k in keys
  }
