"""Per-position learning-signal statistics: one pytree type and the function that fills it.

Everything here is a function of one backward pass: ``g[b, t]``, the gradient of the
**sum-reduced** token loss with respect to the token+position embedding sum (``[B, T, D]``;
the gradient with respect to the model's ``embed_delta`` input, which is added to that sum),
the per-token loss, the batch, and the position table before and after the optimizer
update. Nothing loops over positions: every vector is a scatter-add over ``positions``
(``jax.ops.segment_sum``).

``PositionStats`` holds vectors over table rows ``p`` (all ``[num_positions]``), per step or
summed over a logging window (and over microbatches under gradient accumulation):

* ``count``      (int32)   real input tokens (``segment_ids > 0``) at position id ``p``.
* ``loss_sum``   (float32) sum of the loss of targets scored (``loss_mask``) at input ``p``.
* ``loss_count`` (int32)   number of targets scored at input position ``p``.
* ``occ_norm``   (float32) sum over occurrences at ``p`` of ``||g(b, t)||``.
* ``occ_sq``     (float32) sum over occurrences at ``p`` of ``||g(b, t)||**2``.
* ``row_sq``     (float32) ``||sum over occurrences at p of g(b, t)||**2`` over one optimizer
  step's whole global batch (microbatch sums are added before squaring): the squared norm
  of row ``p`` of the table gradient of the sum-reduced loss; summed over a window's steps.
* ``downstream`` (float32) sum over occurrences at ``p`` of the number of loss-bearing
  targets at or after ``t`` in the same segment (the losses ``g(b, t)`` aggregates in a
  causal model).
* ``update_sq``  (float32) ``||new_table[p] - old_table[p]||**2``: the change the optimizer
  made to row ``p`` (Adam rescaling, weight decay and clipping included).

With statistics off (``collect=False``) only ``LOSS_FIELDS`` are kept (they need no
gradient); the other fields are ``None``. A ``PositionStats`` reads like a dict of its
present fields (``stats['count']``, ``dict(stats)``), so ``np.savez(path, **stats)`` works.

Derived quantities (``derived``): ``coherence = row_sq / (count * occ_sq)`` (1/count for
random directions, 1 for perfectly aligned ones; over a window a ratio of window sums),
``signal_per_occurrence = occ_norm / count``, ``signal_per_downstream = occ_norm /
downstream``, ``mean_loss = loss_sum / loss_count``. Undefined entries are NaN.

Segments are assumed contiguous within a row (as every position policy produces them):
``downstream`` resets where ``segment_ids`` changes.

Window files (``PositionStats.save``) are plain ``.npz``: ``np.load(path)`` gives the present
fields plus ``step`` (last step of the window), ``first_step``, ``num_steps`` and
``cumulative_count`` (int64 exact count of each position since step 0).
"""

from __future__ import annotations

import collections.abc
import dataclasses
import os
from typing import Any, Callable, Iterator, Mapping

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from flax_posemb import outputs
from flax_posemb import sharding

FIELDS = ('count', 'loss_sum', 'loss_count', 'occ_norm', 'occ_sq', 'row_sq',
          'downstream', 'update_sq')
INT_FIELDS = ('count', 'loss_count')
LOSS_FIELDS = ('count', 'loss_sum', 'loss_count')  # Kept with statistics off (no gradient).

Array = jax.Array
PyTree = Any


@flax.struct.dataclass
class PositionStats(collections.abc.Mapping):
  """Per-position statistics, ``[num_positions]`` each (see the module docstring).

  A pytree (jit, ``jax.device_put``, ``jax.tree.map`` and Orbax take it as is) and a read-only
  mapping of its present fields. ``row_grad`` (``[num_positions, D]``, the per-row sum of
  ``g``) exists only between microbatches, until ``finish`` squares it into ``row_sq``.
  """
  count: Array
  loss_sum: Array
  loss_count: Array
  occ_norm: Array | None = None
  occ_sq: Array | None = None
  row_sq: Array | None = None
  downstream: Array | None = None
  update_sq: Array | None = None
  row_grad: Array | None = None

  @classmethod
  def zeros(cls, num_positions: int, *, collect: bool = True) -> PositionStats:
    """All-zero statistics: every field, or only ``LOSS_FIELDS`` when ``collect`` is False."""
    fields = FIELDS if collect else LOSS_FIELDS
    return cls(**{k: jnp.zeros((num_positions,), jnp.int32 if k in INT_FIELDS else jnp.float32)
                  for k in fields})

  @classmethod
  def from_mapping(cls, fields: Mapping[str, Any]) -> PositionStats:
    """Statistics from a dict of fields (e.g. a restored checkpoint item or a window file)."""
    return cls(**{k: fields[k] for k in FIELDS if k in fields})

  @property
  def collects_gradients(self) -> bool:
    """Whether the gradient fields are present (``collect=True``)."""
    return self.occ_norm is not None

  def __getitem__(self, key: str) -> Array:
    if key not in FIELDS or getattr(self, key) is None:
      raise KeyError(key)
    return getattr(self, key)

  def __iter__(self) -> Iterator[str]:
    return (k for k in FIELDS if getattr(self, k) is not None)

  def __len__(self) -> int:
    return sum(1 for _ in self)

  def __add__(self, other: PositionStats) -> PositionStats:
    """Field-wise sum; both sides must hold the same fields."""
    mine = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
    theirs = [f.name for f in dataclasses.fields(other) if getattr(other, f.name) is not None]
    if mine != theirs:
      raise ValueError(f'Cannot add statistics with fields {mine} and {theirs}.')
    return jax.tree.map(jnp.add, self, other)

  def psum(self, axis_name: str) -> PositionStats:
    """Sum over a named mesh axis (inside ``shard_map``/``pmap``; under ``jax.jit`` on
    global arrays XLA inserts the reduction itself)."""
    return jax.lax.psum(self, axis_name)

  def finish(self) -> PositionStats:
    """Squares the accumulated ``row_grad`` into ``row_sq`` (after the step's last microbatch)."""
    if self.row_grad is None:
      return self
    return self.replace(row_sq=jnp.sum(jnp.square(self.row_grad), axis=-1), row_grad=None)

  def to_numpy(self) -> dict[str, np.ndarray]:
    """Host copies of the present fields; counts as exact int64."""
    out = {k: sharding.to_host(v) for k, v in self.items()}
    return {k: v.astype(np.int64) if k in INT_FIELDS else v for k, v in out.items()}

  def save(self, path: str, *, step: int, first_step: int,
           cumulative_count: np.ndarray) -> None:
    """Writes one window file (plain ``.npz``) atomically.

    The bytes go to a hidden temporary name that readers never list (``outputs``), and are
    renamed into place only when complete, so a kill or a full disk leaves no file that a
    reader could take for a result.

    Args:
      path: destination (``window_path``).
      step: last optimizer step of the window.
      first_step: first optimizer step of the window.
      cumulative_count: ``[num_positions]`` int64 exact count of each position up to ``step``.
    """
    with outputs.atomic_write(path) as f:
      np.savez(f, step=np.int64(step), first_step=np.int64(first_step),
               num_steps=np.int64(step - first_step + 1),
               cumulative_count=np.asarray(cumulative_count, np.int64), **self.to_numpy())


def window_path(workdir: str, step: int) -> str:
  """Path of the statistics window file ending at ``step``."""
  return os.path.join(workdir, 'stats', f'window_{step}.npz')


def update_sq(old_table: Array, new_table: Array) -> Array:
  """``[P]`` squared norm of each row's change between two ``[P, D]`` tables (float32)."""
  delta = new_table.astype(jnp.float32) - old_table.astype(jnp.float32)
  return jnp.sum(delta * delta, axis=-1)


def downstream_targets(segment_ids: Array, loss_mask: Array) -> Array:
  """Loss-bearing targets at or after each token within its (contiguous) segment.

  Args:
    segment_ids: ``[B, T]`` int, 0 = padding.
    loss_mask: ``[B, T]`` float, 1.0 where the target at ``t`` is scored.

  Returns:
    ``[B, T]`` float32: ``sum_{t' >= t, same segment} loss_mask[b, t']``.
  """
  seg = segment_ids[:, ::-1]
  val = loss_mask.astype(jnp.float32)[:, ::-1]
  # In reversed order a segment "starts" where the id differs from its predecessor.
  start = jnp.concatenate(
      [jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)

  def combine(a, b):
    av, af = a
    bv, bf = b
    return jnp.where(bf, bv, av + bv), af | bf

  out, _ = jax.lax.associative_scan(combine, (val, start), axis=1)
  return out[:, ::-1]


def loss_stats(token_loss: Array, batch: Mapping[str, Array],
               num_positions: int) -> PositionStats:
  """Statistics that need no gradient: ``count``, ``loss_sum``, ``loss_count``.

  Args:
    token_loss: ``[B, T]`` per-token loss (any value where ``loss_mask`` is 0).
    batch: ``positions``, ``segment_ids`` (int ``[B, T]``) and ``loss_mask`` (float ``[B, T]``).
    num_positions: rows in the position table.
  """
  pos = batch['positions'].reshape(-1)
  mask = batch['loss_mask'].astype(jnp.float32).reshape(-1)
  loss = jnp.where(mask > 0, token_loss.astype(jnp.float32).reshape(-1), 0.0) * mask

  def scatter(x):
    return jax.ops.segment_sum(x, pos, num_segments=num_positions)

  return PositionStats(count=scatter((batch['segment_ids'] > 0).reshape(-1).astype(jnp.int32)),
                       loss_sum=scatter(loss), loss_count=scatter((mask > 0).astype(jnp.int32)))


def occurrence_stats(g: Array, token_loss: Array, batch: Mapping[str, Array],
                     num_positions: int) -> PositionStats:
  """Scatters one (micro)batch's per-occurrence quantities onto table rows.

  Args:
    g: ``[B, T, D]`` gradient of the sum-reduced loss w.r.t. the embedding sum.
    token_loss: ``[B, T]`` per-token loss (any value where ``loss_mask`` is 0).
    batch: ``positions``, ``segment_ids`` (int ``[B, T]``) and ``loss_mask`` (float ``[B, T]``).
    num_positions: rows in the position table.

  Returns:
    Statistics without ``row_sq``/``update_sq`` and with ``row_grad`` ``[num_positions, D]``
    (call ``finish`` once the step's microbatches are summed).
  """
  pos = batch['positions'].reshape(-1)
  real = (batch['segment_ids'] > 0).reshape(-1)
  g = jnp.where(real[:, None], g.astype(jnp.float32).reshape(pos.shape[0], -1), 0.0)
  sq = jnp.sum(g * g, axis=-1)
  down = downstream_targets(batch['segment_ids'], batch['loss_mask']).reshape(-1)

  def scatter(x):
    return jax.ops.segment_sum(x, pos, num_segments=num_positions)

  return loss_stats(token_loss, batch, num_positions).replace(
      occ_norm=scatter(jnp.sqrt(sq)), occ_sq=scatter(sq),
      downstream=scatter(down * real.astype(jnp.float32)), row_grad=scatter(g))


def value_and_grad_with_position_stats(
    token_loss_fn: Callable[..., Array], num_positions: int, embed_dim: int, *,
    collect: bool = True, finish: bool = True) -> Callable[..., tuple]:
  """Loss, parameter gradients and per-position statistics of any model, in one backward pass.

  Example (any model whose embedding sum takes ``embed_delta``)::

    def token_loss_fn(params, embed_delta, batch):
      x = params['wte'][batch['inputs']] + params['wpe'][batch['positions']] + embed_delta
      logits = my_model(params, x, batch['segment_ids'])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch['targets'])

    f = jax.jit(value_and_grad_with_position_stats(token_loss_fn, num_positions=1024,
                                                   embed_dim=768))
    loss, grads, stats = f(params, batch)

  Args:
    token_loss_fn: ``(params, embed_delta, batch, *args) -> [B, T]`` float32 token losses.
      ``embed_delta`` (float32 ``[B, T, D]``, zeros) must be added to the token+position
      embedding sum; ``batch`` holds ``positions``, ``segment_ids`` (int ``[B, T]``, 0 =
      padding), ``loss_mask`` (float ``[B, T]``) and whatever the model needs. ``params``
      is any pytree (linen params, or an NNX model's state from ``nnx.split``).
    num_positions: rows of the position table (every ``positions`` id is below it: the
      host checks batches, ``sharding.global_batch``).
    embed_dim: width ``D`` of the embedding sum, and so of ``embed_delta``.
    collect: False keeps only ``LOSS_FIELDS`` (loss, gradients and update are unchanged).
    finish: False leaves ``row_grad`` unsquared, for summing microbatches (then call
      ``stats.finish()``).

  Returns:
    ``f(params, batch, *args, denominator=None) -> (loss, grads, stats)``: ``loss`` the mean
    token loss over the ``loss_mask`` targets (or their sum divided by ``denominator``, e.g.
    a global batch's target count under gradient accumulation), ``grads`` its gradient with
    respect to ``params``, ``stats`` a ``PositionStats`` (a mapping of ``[num_positions]``
    arrays: ``count``, ``loss_sum``, ``loss_count``, and with ``collect`` also ``occ_norm``,
    ``occ_sq``, ``row_sq``, ``downstream``; ``update_sq`` needs the optimizer and is absent).
  """
  def f(params, batch, *args, denominator=None):
    mask = batch['loss_mask'].astype(jnp.float32)
    denom = jnp.maximum(jnp.sum(mask), 1.0) if denominator is None else denominator
    shape = batch['positions'].shape

    def mean_loss(p, delta):
      tl = token_loss_fn(p, delta, batch, *args)
      return jnp.sum(tl * mask) / denom, tl

    # The embed_delta gradient is taken in both modes so that the loss and the parameter
    # gradients compile identically whether or not statistics are collected.
    (loss, tl), (grads, g_delta) = jax.value_and_grad(mean_loss, argnums=(0, 1), has_aux=True)(
        params, jnp.zeros(shape + (embed_dim,), jnp.float32))
    if not collect:
      return loss, grads, loss_stats(tl, batch, num_positions)
    stats = occurrence_stats(g_delta * denom, tl, batch, num_positions)
    return loss, grads, stats.finish() if finish else stats

  return f


def derived(stats: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Ratios documented in the module docstring, NaN where undefined (or not collected).

  Args:
    stats: mapping with (some of) ``FIELDS``, each ``[P]``: a ``PositionStats``, or
      ``np.load`` of a window file.

  Returns:
    Dict ``coherence``, ``signal_per_occurrence``, ``signal_per_downstream``, ``mean_loss``,
    each ``[P]`` float64.
  """
  size = len(np.asarray(stats['count']))
  s = {k: np.asarray(stats[k], np.float64) if k in stats else np.full(size, np.nan)
       for k in FIELDS}

  def div(a, b):
    with np.errstate(divide='ignore', invalid='ignore'):
      return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)

  return {
      'coherence': div(s['row_sq'], s['count'] * s['occ_sq']),
      'signal_per_occurrence': div(s['occ_norm'], s['count']),
      'signal_per_downstream': div(s['occ_norm'], s['downstream']),
      'mean_loss': div(s['loss_sum'], s['loss_count']),
  }
