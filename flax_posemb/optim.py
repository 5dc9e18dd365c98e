"""AdamW with warmup + cosine decay, clipping and a decay mask (optax); the
section's checks: `config.OptimizerConfig`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from flax_posemb.model import POSITION_TABLE_PATH

# Type hints only: the step runs without Grain or ml_collections (the device
# image), which the config's checks import.
if TYPE_CHECKING:
  from flax_posemb import config as config_lib

TOKEN_TABLE_PATH = ('token_embed', 'embedding')


def make_schedule(config: config_lib.RunConfig) -> optax.Schedule:
  """Linear warmup from 0 to `optimizer.learning_rate`, cosine decay to
  `end_lr_ratio` of it at `num_train_steps`: step count (scalar int) -> scalar
  learning rate."""
  optimizer = config.optimizer
  warmup_steps = optimizer.warmup_steps
  decay_steps = max(config.num_train_steps, warmup_steps + 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=optimizer.learning_rate,
      warmup_steps=warmup_steps,
      decay_steps=decay_steps,
      end_value=optimizer.learning_rate * optimizer.end_lr_ratio,
  )


def _is_path(path: Sequence[Any], target: tuple[str, ...]) -> bool:
  names = tuple(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)
  return names[-len(target) :] == target


def decay_mask(params: Any, config: config_lib.RunConfig) -> Any:
  """Pytree of bools like `params` (arrays or ShapeDtypeStructs): which get
  weight decay (ndim >= 2, the tables unless `optimizer.decay_position_table` /
  `decay_token_table` is off)."""
  optimizer = config.optimizer

  def leaf(path, x):
    if len(x.shape) < 2:
      return False
    if _is_path(path, POSITION_TABLE_PATH):
      return optimizer.decay_position_table
    if _is_path(path, TOKEN_TABLE_PATH):
      return optimizer.decay_token_table
    return True

  return jax.tree_util.tree_map_with_path(leaf, params)


class RowScaleState(NamedTuple):
  # [max_len] float32 cumulative count of tokens at each position.
  exposure: jax.Array


def scale_position_rows(
    power: float, max_scale: float
) -> optax.GradientTransformationExtraArgs:
  """Scales position row p's update by `min((mean exposure / exposure[p]) **
  power, max_scale)`; exposure, the cumulative `position_counts` `[max_len]`
  passed to `update`, is state."""

  def init_fn(params):
    table = next(
        x
        for p, x in jax.tree_util.tree_leaves_with_path(params)
        if _is_path(p, POSITION_TABLE_PATH)
    )
    return RowScaleState(exposure=jnp.zeros((table.shape[0],), jnp.float32))

  def update_fn(updates, state, params=None, *, position_counts, **unused):
    del params, unused
    exposure = state.exposure + position_counts.astype(jnp.float32)
    ratio = jnp.where(
        exposure > 0, jnp.mean(exposure) / jnp.maximum(exposure, 1e-30), jnp.inf
    )
    scale = jnp.minimum(ratio**power, max_scale)

    def leaf(path, u):
      if _is_path(path, POSITION_TABLE_PATH):
        return u * scale[:, None].astype(u.dtype)
      return u

    scaled = jax.tree_util.tree_map_with_path(leaf, updates)
    return scaled, RowScaleState(exposure)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def make_optimizer(
    config: config_lib.RunConfig, params: Any
) -> optax.GradientTransformationExtraArgs:
  """Clip, Adam, `scale_position_rows` (after Adam, whose normalization would
  cancel it), decay (`decay_mask` of `params`), schedule; `update` takes
  `position_counts` `[max_len]`."""
  optimizer = config.optimizer
  parts = []
  if optimizer.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(optimizer.grad_clip_norm))
  parts.append(
      optax.scale_by_adam(b1=optimizer.b1, b2=optimizer.b2, eps=optimizer.eps)
  )
  if optimizer.row_lr_scale:
    parts.append(
        scale_position_rows(optimizer.row_lr_power, optimizer.row_lr_max)
    )
  if optimizer.weight_decay > 0:
    decay = decay_mask(params, config)
    parts.append(optax.add_decayed_weights(optimizer.weight_decay, decay))
  parts.append(optax.scale_by_learning_rate(make_schedule(config)))
  return optax.chain(*parts)
