"""Refusals of a batch or a loss function whose statistics would be wrong
(`stats.value_and_grad_with_position_stats` calls them): a real token outside
the table, a loss whose ``embed_delta`` gradient is zero."""

from collections.abc import Callable, Mapping
from typing import Any

import jax
from jax.extend import core as jax_core
import jax.numpy as jnp

Array = jax.Array


def _refuse_if(
    bad: Array, error: Callable[..., Exception], *operands: Array
) -> None:
  """Raises ``error(*operands)`` where ``bad`` (a bool scalar) holds: eagerly
  at once; under ``jax.jit`` on the host when the step runs (a
  ``JaxRuntimeError`` that contains its message), for one device-side
  reduction and no host round trip when it does not hold."""
  if not isinstance(bad, jax.core.Tracer):
    if bool(bad):
      raise error(*operands)
    return

  def refuse(*values):
    raise error(*values)

  jax.lax.cond(bad, lambda: jax.debug.callback(refuse, *operands), lambda: None)


def position_error(
    lowest: int, highest: int, num_bad: int, num_positions: int
) -> ValueError:
  """The refusal of real tokens whose position ids are outside the table, in
  the library's own terms (a user's loop has no config).

  Args:
    lowest: the smallest id of a real token.
    highest: the largest.
    num_bad: how many ids are outside ``[0, num_positions)``.
    num_positions: rows ``P`` the statistics were given.

  Returns:
    A ValueError naming a bad id and the fix.
  """
  span = f'[0, {num_positions})'
  if lowest < 0:
    where = f'Position id {lowest} is negative'
    fix = (
        'give every real token (segment_ids > 0) an id in that range, or mark'
        ' the token as padding (segment_ids 0)'
    )
  else:
    where = f'Position id {highest} is outside the position table {span}'
    fix = (
        f'pass num_positions >= {highest + 1} (the rows of your table) or keep'
        f' the real tokens (segment_ids > 0) below {num_positions}'
    )
  return ValueError(
      f'{where} ({num_bad} ids of real tokens outside {span}; min {lowest},'
      f' max {highest}): {fix}.'
  )


def check_real_positions(
    batch: Mapping[str, Array], num_positions: int
) -> None:
  """Refuses a real token whose position id is outside the table: the
  statistics would drop it while the loss counts it.

  Args:
    batch: the batch; its real tokens are ``segment_ids > 0``.
    num_positions: rows ``P`` of the position table.

  Raises:
    ValueError: `position_error`, eagerly; under ``jax.jit`` raised on the
      host when the step runs, surfacing as a ``jax.errors.JaxRuntimeError``
      that contains its message.
  """
  real = jnp.asarray(batch['segment_ids']) > 0
  positions = jnp.where(real, jnp.asarray(batch['positions']), 0)
  outside = (positions < 0) | (positions >= num_positions)

  def error(lowest, highest, num_bad):
    return position_error(
        int(lowest), int(highest), int(num_bad), num_positions
    )

  _refuse_if(
      jnp.any(outside),
      error,
      jnp.min(positions, initial=0),
      jnp.max(positions, initial=0),
      jnp.sum(outside),
  )


_HOW_TO_USE_DELTA = (
    ' embed_delta must reach the loss: add it to the token+position embedding'
    ' sum, e.g. `x = token_rows + position_rows + embed_delta` (float32 [B, T,'
    ' D] zeros), not behind jax.lax.stop_gradient, a zero factor or a branch'
    ' never taken; or pass collect=False for the loss fields only.'
)


def _depends_on_input(closed: Any) -> bool:
  """Whether an output of a traced one-input function is computed from its
  input (forward reachability over the jaxpr's equations; an equation that
  reads the input counts as depending on it)."""
  jaxpr = closed.jaxpr
  reached = set(jaxpr.invars)
  for eqn in jaxpr.eqns:
    read = [v for v in eqn.invars if not isinstance(v, jax_core.Literal)]
    if any(v in reached for v in read):
      reached.update(eqn.outvars)
  outputs_read = [
      v for v in jaxpr.outvars if not isinstance(v, jax_core.Literal)
  ]
  return any(v in reached for v in outputs_read)


def check_gradient_reaches_delta(
    token_loss_fn: Callable[..., Array], params: Any, delta: Array, batch, args
) -> None:
  """Refuses a ``token_loss_fn`` whose ``embed_delta`` gradient is zero by
  construction: it never reads ``embed_delta``, or only behind
  ``jax.lax.stop_gradient``. Traces its backward pass once more (no
  compilation): the gradient must be computed from the losses' cotangent.

  Args:
    token_loss_fn: as `value_and_grad_with_position_stats`'s.
    params: its parameters.
    delta: ``[B, T, D]`` float32 zeros.
    batch: the batch.
    args: its extra arguments.

  Raises:
    ValueError: saying where ``embed_delta`` must go.
  """

  def delta_gradient(cotangent):
    losses, vjp = jax.vjp(
        lambda d: token_loss_fn(params, d, batch, *args), delta
    )
    return vjp(cotangent.astype(losses.dtype))[0]

  cotangent = jnp.zeros(batch['positions'].shape, jnp.float32)
  if _depends_on_input(jax.make_jaxpr(delta_gradient)(cotangent)):
    return
  raise ValueError(
      "token_loss_fn's gradient with respect to embed_delta is 0 by"
      ' construction (it never reads embed_delta, or only behind'
      ' jax.lax.stop_gradient), so the statistics would all be 0.'
      + _HOW_TO_USE_DELTA
  )


def check_nonzero_signal(loss_count: Array, occ_sq: Array) -> None:
  """Refuses statistics whose every occurrence got an exactly zero gradient
  while the batch has scored targets: ``embed_delta`` does not reach the loss
  (``0 * embed_delta``, a branch never taken, a frozen path).

  Args:
    loss_count: ``[P]`` scored targets per position of a (micro)batch.
    occ_sq: ``[P]`` summed squared gradient norms of its occurrences.

  Raises:
    ValueError: eagerly; under ``jax.jit`` when the step runs, as a
      ``JaxRuntimeError`` that contains its message.
  """
  scored = jnp.sum(loss_count)
  signal = jnp.sum(occ_sq)

  def error(num_scored):
    return ValueError(
        "token_loss_fn's gradient with respect to embed_delta is exactly 0 at"
        f' every token although the batch has {int(num_scored)} scored'
        ' targets (loss_mask), so the statistics would all be 0.'
        + _HOW_TO_USE_DELTA
        + ' (A model whose gradient is truly 0 here, e.g. with a zero output'
        ' layer at step 0: pass check_signal=False.)'
    )

  _refuse_if((scored > 0) & (signal == 0), error, scored)
