"""AdamW with warmup + cosine decay, clipping and a decay mask (optax), and the
position table's own optimizer options (row-sparse Adam, SGD with momentum);
the section's checks: `config.OptimizerConfig`."""

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
  """The learning-rate schedule.

  Args:
    config: the run's config (`optimizer`, `num_train_steps`).

  Returns:
    Step count (scalar int) -> scalar learning rate: linear warmup from 0 to
    `optimizer.learning_rate`, cosine decay to `end_lr_ratio` of it at
    `num_train_steps`.
  """
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
  """Which parameters get weight decay.

  Args:
    params: the parameters (arrays or ShapeDtypeStructs).
    config: the run's config (`optimizer.decay_position_table`,
      `decay_token_table`).

  Returns:
    A pytree of bools like ``params``: True for ndim >= 2, the tables unless
    their flag is off.
  """
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
  """`scale_position_rows`'s state."""

  # [max_len] float32 cumulative count of tokens at each position.
  exposure: jax.Array


def scale_position_rows(
    power: float, max_scale: float
) -> optax.GradientTransformationExtraArgs:
  """Scales each position row's update by its exposure.

  Args:
    power: row ``p``'s update is scaled by ``min((mean exposure /
      exposure[p]) ** power, max_scale)``.
    max_scale: the largest scale.

  Returns:
    The transformation; its ``update`` takes ``position_counts`` ``[max_len]``
    (the step's tokens per position), whose cumulative sum, the exposure, is
    its state.
  """

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


class LazyAdamState(NamedTuple):
  """`scale_by_lazy_adam`'s state, trees like the parameters'."""

  # [rows] int32 per leaf: the steps at which the row had a gradient.
  count: Any
  # Adam's first and second moments, like the parameters.
  mu: Any
  nu: Any


def _rows(active: jax.Array, like: jax.Array) -> jax.Array:
  """``[rows]`` ``active`` broadcastable against ``like`` ``[rows, ...]``."""
  return active.reshape(active.shape + (1,) * (like.ndim - 1))


def scale_by_lazy_adam(
    b1: float, b2: float, eps: float, weight_decay: float = 0.0
) -> optax.GradientTransformation:
  """Row-sparse ("lazy") Adam with decoupled weight decay, for tables.

  Each leaf's first axis is its rows. A row with a nonzero gradient this step
  takes Adam's step from its moments, bias-corrected by its own count of
  such steps, plus ``weight_decay`` times the row; a row whose gradient is 0
  gets an update of exactly 0 and keeps its moments and count bit for bit.
  On rows with a gradient at every step it is optax's ``scale_by_adam`` (the
  same operations in the same order).

  Args:
    b1: decay of the first moment.
    b2: decay of the second moment.
    eps: added to the root of the second moment.
    weight_decay: decoupled decay of rows with a gradient (0: none).

  Returns:
    The transformation; ``update`` needs ``params`` when ``weight_decay`` is
    not 0. Its updates are to be scaled by the (negative) learning rate.
  """

  def init_fn(params):
    return LazyAdamState(
        count=jax.tree.map(lambda p: jnp.zeros(p.shape[:1], jnp.int32), params),
        mu=optax.tree.zeros_like(params),
        nu=optax.tree.zeros_like(params),
    )

  def leaf(g, count, mu, nu, p):
    active = jnp.any(g != 0, axis=tuple(range(1, g.ndim)))
    rows = _rows(active, g)
    count = jnp.where(active, optax.safe_increment(count), count)
    mu = jnp.where(rows, (1 - b1) * g + b1 * mu, mu)
    nu = jnp.where(rows, (1 - b2) * (g * g) + b2 * nu, nu)
    steps = _rows(count, g)
    mu_hat = mu / (1 - b1**steps).astype(mu.dtype)
    nu_hat = nu / (1 - b2**steps).astype(nu.dtype)
    update = mu_hat / (jnp.sqrt(nu_hat) + eps)
    if weight_decay:
      update = update + weight_decay * p
    return jnp.where(rows, update, jnp.zeros_like(update)), count, mu, nu

  def update_fn(updates, state, params=None):
    if weight_decay and params is None:
      raise ValueError('scale_by_lazy_adam with weight decay needs params.')
    grads, treedef = jax.tree.flatten(updates)
    counts = treedef.flatten_up_to(state.count)
    mus = treedef.flatten_up_to(state.mu)
    nus = treedef.flatten_up_to(state.nu)
    rows = grads if params is None else treedef.flatten_up_to(params)
    out = [leaf(*args) for args in zip(grads, counts, mus, nus, rows)]
    new_updates, new_counts, new_mus, new_nus = (
        treedef.unflatten([o[i] for o in out]) for i in range(4)
    )
    return new_updates, LazyAdamState(new_counts, new_mus, new_nus)

  return optax.GradientTransformation(init_fn, update_fn)


def _position_labels(params: Any) -> Any:
  """'position' for the position table, 'rest' for every other leaf."""

  def label(path, _):
    return 'position' if _is_path(path, POSITION_TABLE_PATH) else 'rest'

  return jax.tree_util.tree_map_with_path(label, params)


def _scaled(schedule: optax.Schedule, scale: float) -> optax.Schedule:
  """``schedule`` times ``scale``."""

  def scaled(step):
    return schedule(step) * scale

  return scaled


def _position_table_tx(
    config: config_lib.RunConfig,
) -> optax.GradientTransformationExtraArgs:
  """The table's own chain (`optimizer.position_optimizer` 'lazy_adam' or
  'sgd'), then `scale_position_rows` and its learning rate."""
  optimizer = config.optimizer
  decay = optimizer.weight_decay if optimizer.decay_position_table else 0.0
  schedule = make_schedule(config)
  parts = []
  if optimizer.position_optimizer == 'lazy_adam':
    # Decay inside: it too must skip rows without a gradient.
    parts.append(
        scale_by_lazy_adam(optimizer.b1, optimizer.b2, optimizer.eps, decay)
    )
  else:
    parts.append(optax.trace(decay=optimizer.position_momentum))
    if decay > 0:
      parts.append(optax.add_decayed_weights(decay))
    schedule = _scaled(schedule, optimizer.position_lr_scale)
  if optimizer.row_lr_scale:
    parts.append(
        scale_position_rows(optimizer.row_lr_power, optimizer.row_lr_max)
    )
  parts.append(optax.scale_by_learning_rate(schedule))
  return optax.chain(*parts)


def make_optimizer(
    config: config_lib.RunConfig, params: Any
) -> optax.GradientTransformationExtraArgs:
  """The run's optimizer.

  Clip, Adam, `scale_position_rows` (after Adam, whose normalization would
  cancel it), decay (`decay_mask`), schedule. With
  `optimizer.position_optimizer` other than 'adam' the position table has
  its own chain after the shared clip (``optax.multi_transform``):
  `scale_by_lazy_adam` or SGD with momentum (``optax.trace``) at
  `position_lr_scale` times the schedule.

  Args:
    config: the run's config (its `optimizer` section, `num_train_steps`).
    params: the parameters (arrays or ShapeDtypeStructs), for the decay mask.

  Returns:
    The transformation; its ``update`` takes ``position_counts`` ``[max_len]``
    (the step's tokens per position) when `optimizer.row_lr_scale` is set.
  """
  optimizer = config.optimizer
  parts = []
  if optimizer.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(optimizer.grad_clip_norm))
  if optimizer.position_optimizer == 'adam':
    # Today's flat chain: its state, and so every checkpoint, is unchanged.
    parts += _adamw_parts(config, decay_mask(params, config))
    return optax.chain(*parts)
  rest = optax.chain(*_adamw_parts(config, lambda p: decay_mask(p, config)))
  parts.append(
      optax.multi_transform(
          {'position': _position_table_tx(config), 'rest': rest},
          _position_labels,
      )
  )
  return optax.chain(*parts)


def _adamw_parts(
    config: config_lib.RunConfig, decay: Any
) -> list[optax.GradientTransformationExtraArgs]:
  """Adam, `scale_position_rows` (when the table shares Adam), decay where
  ``decay`` (a mask, or a function of the parameters giving one), schedule."""
  optimizer = config.optimizer
  parts = [
      optax.scale_by_adam(b1=optimizer.b1, b2=optimizer.b2, eps=optimizer.eps)
  ]
  if optimizer.row_lr_scale and optimizer.position_optimizer == 'adam':
    parts.append(
        scale_position_rows(optimizer.row_lr_power, optimizer.row_lr_max)
    )
  if optimizer.weight_decay > 0:
    parts.append(optax.add_decayed_weights(optimizer.weight_decay, decay))
  parts.append(optax.scale_by_learning_rate(make_schedule(config)))
  return parts
