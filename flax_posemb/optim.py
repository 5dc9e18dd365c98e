"""Optimizer: AdamW with linear warmup + cosine decay, clipping and a decay mask (optax).

The chain, in order (``make_optimizer``):

1. ``clip_by_global_norm(grad_clip_norm)`` (skipped when ``grad_clip_norm <= 0``);
2. ``scale_by_adam(b1, b2, eps)`` — ``b2`` is explicit because it sets how quickly the
   second moment of a rarely seen position row decays between its updates;
3. optional per-row scale of the position table's Adam direction (``row_lr_scale``):
   ``min((mean exposure / exposure[p]) ** row_lr_power, row_lr_max)``. It acts *after*
   Adam because scaling a row's gradient before Adam is almost cancelled by Adam's
   normalization. Exposure is the cumulative count of real input tokens at each position
   (passed each step as the extra argument ``position_counts``; kept in the optimizer state
   so it is checkpointed). Rows never seen get ``row_lr_max``. Weight decay is not scaled;
4. ``add_decayed_weights(weight_decay, mask)`` — decoupled decay on arrays with ndim >= 2,
   with explicit switches for the position table (nanoGPT decays it; minGPT did not) and the
   token table;
5. ``scale_by_learning_rate(schedule)``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
import optax

from flax_posemb.model import POSITION_TABLE_PATH

if TYPE_CHECKING:  # type hints only: the step runs without ml_collections (device image)
  import ml_collections

TOKEN_TABLE_PATH = ('token_embed', 'embedding')


def validate(config: ml_collections.ConfigDict) -> None:
  """Raises ValueError naming the field and the fix for a bad ``optimizer`` section.

  Runs before anything is built (``training.validate``): a NaN, infinite or negative value
  would otherwise surface as a non-finite loss a few steps into training, blamed on the
  learning rate, or (``grad_clip_norm=nan``) silently switch a feature off.
  """
  o = config.optimizer

  def num(key: str) -> float:
    try:
      v = float(o[key])
    except (TypeError, ValueError):
      raise ValueError(f'optimizer.{key} must be a number, got {o[key]!r}.') from None
    if not math.isfinite(v):
      raise ValueError(f'optimizer.{key} must be finite, got {o[key]}; set '
                       f'--config.optimizer.{key}=VALUE.')
    return v

  if not num('learning_rate') > 0:
    raise ValueError(f'optimizer.learning_rate must be > 0, got {o.learning_rate}.')
  if num('warmup_steps') < 0 or int(o.warmup_steps) != o.warmup_steps:
    raise ValueError(f'optimizer.warmup_steps must be an int >= 0, got {o.warmup_steps}.')
  if num('end_lr_ratio') < 0:
    raise ValueError(f'optimizer.end_lr_ratio must be >= 0 (a fraction of the peak learning '
                     f'rate), got {o.end_lr_ratio}.')
  for key in ('b1', 'b2'):
    if not 0.0 <= num(key) < 1.0:
      raise ValueError(f'optimizer.{key} must be in [0, 1), got {o[key]}.')
  for key in ('eps', 'weight_decay'):
    if num(key) < 0:
      raise ValueError(f'optimizer.{key} must be >= 0, got {o[key]}.')
  num('grad_clip_norm')  # <= 0 disables clipping; NaN must not do so silently.
  if o.row_lr_scale:
    num('row_lr_power')
    if not num('row_lr_max') > 0:
      raise ValueError(f'optimizer.row_lr_max must be > 0, got {o.row_lr_max}.')


def make_schedule(config: ml_collections.ConfigDict) -> optax.Schedule:
  """Linear warmup from 0 to ``optimizer.learning_rate``, cosine decay to the end ratio.

  Args:
    config: full config (uses ``num_train_steps`` and the ``optimizer`` section).

  Returns:
    A schedule mapping the step count (scalar int) to a scalar learning rate.
  """
  validate(config)
  o = config.optimizer
  decay_steps = max(int(config.num_train_steps), int(o.warmup_steps) + 1)
  return optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=o.learning_rate, warmup_steps=int(o.warmup_steps),
      decay_steps=decay_steps, end_value=o.learning_rate * o.end_lr_ratio)


def _path_names(path: Sequence[Any]) -> tuple[str, ...]:
  return tuple(str(getattr(k, 'key', getattr(k, 'name', k))) for k in path)


def _is_path(path: Sequence[Any], target: tuple[str, ...]) -> bool:
  names = _path_names(path)
  return names[-len(target):] == target


def decay_mask(params: Any, config: ml_collections.ConfigDict) -> Any:
  """Boolean pytree: which parameters get weight decay.

  Args:
    params: parameter pytree (arrays or ShapeDtypeStructs).
    config: full config (``optimizer.decay_position_table`` / ``decay_token_table``).

  Returns:
    Pytree of bools with the structure of ``params``: True for ndim >= 2 arrays, except the
    position / token tables when their flag is off. Biases and norms are never decayed.
  """
  o = config.optimizer

  def leaf(path, x):
    if len(x.shape) < 2:
      return False
    if _is_path(path, POSITION_TABLE_PATH):
      return bool(o.decay_position_table)
    if _is_path(path, TOKEN_TABLE_PATH):
      return bool(o.decay_token_table)
    return True

  return jax.tree_util.tree_map_with_path(leaf, params)


class RowScaleState(NamedTuple):
  exposure: jax.Array  # [max_len] float32 cumulative count of tokens at each position.


def scale_position_rows(power: float, max_scale: float) -> optax.GradientTransformationExtraArgs:
  """Scales each row of the position table's update by its inverse exposure.

  ``update(updates, state, params, *, position_counts)``: ``position_counts`` is
  ``[max_len]`` (this step's real input tokens per position). Leaves other than the
  position table pass through unchanged.

  Args:
    power: exponent of ``mean exposure / exposure[p]``.
    max_scale: upper bound of the scale (also used for never-seen rows).

  Returns:
    An optax transformation with extra-args support.
  """

  def find_table(tree):
    found = [x for p, x in jax.tree_util.tree_leaves_with_path(tree)
             if _is_path(p, POSITION_TABLE_PATH)]
    if len(found) != 1:
      raise ValueError('optimizer.row_lr_scale=True needs a learned position table at '
                       f'params{list(POSITION_TABLE_PATH)}; found {len(found)}. Set '
                       'optimizer.row_lr_scale=False or model.position_embedding=learned.')
    return found[0]

  def init_fn(params):
    table = find_table(params)
    return RowScaleState(exposure=jnp.zeros((table.shape[0],), jnp.float32))

  def update_fn(updates, state, params=None, *, position_counts=None, **unused):
    del params, unused
    if position_counts is None:
      raise ValueError('scale_position_rows needs the extra argument position_counts.')
    exposure = state.exposure + position_counts.astype(jnp.float32)
    mean = jnp.mean(exposure)
    ratio = jnp.where(exposure > 0, mean / jnp.maximum(exposure, 1e-30), jnp.inf)
    scale = jnp.minimum(ratio ** power, max_scale)

    def leaf(path, u):
      if _is_path(path, POSITION_TABLE_PATH):
        return u * scale[:, None].astype(u.dtype)
      return u

    return jax.tree_util.tree_map_with_path(leaf, updates), RowScaleState(exposure)

  return optax.GradientTransformationExtraArgs(init_fn, update_fn)


def make_optimizer(config: ml_collections.ConfigDict, params: Any
                   ) -> optax.GradientTransformationExtraArgs:
  """AdamW chain described in the module docstring.

  Args:
    config: full config (``num_train_steps`` and the ``optimizer`` section).
    params: parameter pytree (used for the weight-decay mask).

  Returns:
    An optax transformation; call ``update(grads, opt_state, params,
    position_counts=counts)`` with ``counts`` ``[max_len]`` when ``row_lr_scale`` is on
    (the argument is ignored otherwise).
  """
  validate(config)
  o = config.optimizer
  parts = []
  if o.grad_clip_norm > 0:
    parts.append(optax.clip_by_global_norm(o.grad_clip_norm))
  parts.append(optax.scale_by_adam(b1=o.b1, b2=o.b2, eps=o.eps))
  if o.row_lr_scale:
    parts.append(scale_position_rows(o.row_lr_power, o.row_lr_max))
  if o.weight_decay > 0:
    parts.append(optax.add_decayed_weights(o.weight_decay, decay_mask(params, config)))
  parts.append(optax.scale_by_learning_rate(make_schedule(config)))
  return optax.chain(*parts)
