"""AdamW with warmup + cosine decay, clipping and a decay mask (optax);
`validate` at startup."""

from __future__ import annotations

from collections.abc import Sequence
import math
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from flax_posemb.model import POSITION_TABLE_PATH

# Type hints only: the step runs without ml_collections (device image).
if TYPE_CHECKING:
  import ml_collections

TOKEN_TABLE_PATH = ('token_embed', 'embedding')


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field and the fix for a bad `optimizer`
  section."""
  o = config.optimizer
  keys = [
      'learning_rate',
      'warmup_steps',
      'end_lr_ratio',
      'b1',
      'b2',
      'eps',
      'weight_decay',
      'grad_clip_norm',
  ] + (['row_lr_power', 'row_lr_max'] if o.row_lr_scale else [])
  problems = [
      f'optimizer.{k} must be finite (a number), got {o[k]!r}; set '
      f'--config.optimizer.{k}=VALUE.'
      for k in keys
      if not isinstance(o[k], (int, float)) or not math.isfinite(o[k])
  ]
  if not problems:  # The range rules assume numbers.
    rules = [
        ('learning_rate', o.learning_rate > 0, '> 0'),
        (
            'warmup_steps',
            o.warmup_steps >= 0 and o.warmup_steps % 1 == 0,
            'an int >= 0',
        ),
        (
            'end_lr_ratio',
            o.end_lr_ratio >= 0,
            '>= 0 (a fraction of the peak learning rate)',
        ),
        ('b1', 0 <= o.b1 < 1, 'in [0, 1)'),
        ('b2', 0 <= o.b2 < 1, 'in [0, 1)'),
        ('eps', o.eps >= 0, '>= 0'),
        ('weight_decay', o.weight_decay >= 0, '>= 0'),
        ('row_lr_max', not o.row_lr_scale or o.row_lr_max > 0, '> 0'),
    ]
    problems = [
        f'optimizer.{k} must be {want}, got {o[k]}.'
        for k, ok, want in rules
        if not ok
    ]
  if o.row_lr_scale and config.model.position_embedding != 'learned':
    problems.append(
        'optimizer.row_lr_scale=True needs a learned position table; set '
        'optimizer.row_lr_scale=False or model.position_embedding=learned.'
    )
  if problems:
    raise ValueError(problems[0])


def make_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup from 0 to `optimizer.learning_rate`, cosine decay to
  `end_lr_ratio` of it at `num_train_steps`: step count (scalar int) -> scalar
  learning rate."""
  o = config.optimizer
  decay_steps = max(int(config.num_train_steps), int(o.warmup_steps) + 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0,
      peak_value=o.learning_rate,
      warmup_steps=int(o.warmup_steps),
      decay_steps=decay_steps,
      end_value=o.learning_rate * o.end_lr_ratio,
  )


def _is_path(path: Sequence[Any], target: tuple[str, ...]) -> bool:
  names = tuple(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)
  return names[-len(target) :] == target


def decay_mask(params: Any, config: ml_collections.ConfigDict) -> Any:
  """Pytree of bools like `params` (arrays or ShapeDtypeStructs): which get
  weight decay (ndim >= 2, the tables unless `optimizer.decay_position_table` /
  `decay_token_table` is off)."""
  o = config.optimizer

  def leaf(path, x):
    if len(x.shape) < 2:
      return False
    if _is_path(path, POSITION_TABLE_PATH):
      return bool(o.decay_position_table)
    return (
        bool(o.decay_token_table) if _is_path(path, TOKEN_TABLE_PATH) else True
    )

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
      return (
          u * scale[:, None].astype(u.dtype)
          if _is_path(path, POSITION_TABLE_PATH)
          else u
      )

    return jax.tree_util.tree_map_with_path(leaf, updates), RowScaleState(
        exposure
    )

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def make_optimizer(
    config: ml_collections.ConfigDict, params: Any
) -> optax.GradientTransformationExtraArgs:
  """Clip, Adam, `scale_position_rows` (after Adam, whose normalization would
  cancel it), decay (`decay_mask` of `params`), schedule; `update` takes
  `position_counts` `[max_len]`."""
  o = config.optimizer
  parts = (
      [optax.clip_by_global_norm(o.grad_clip_norm)]
      if o.grad_clip_norm > 0
      else []
  )
  parts.append(optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps))
  if o.row_lr_scale:
    parts.append(scale_position_rows(o.row_lr_power, o.row_lr_max))
  if o.weight_decay > 0:
    parts.append(
        optax.add_decayed_weights(o.weight_decay, decay_mask(params, config))
    )
  parts.append(optax.scale_by_learning_rate(make_schedule(config)))
  return optax.chain(*parts)
