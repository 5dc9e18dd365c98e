"""Per-position learning-signal statistics of a position table (pure functions).

Everything here is a pure function of one backward pass: the gradient of the
**sum-reduced** token loss with respect to the token+position embedding sum,
``g[b, t] = d(sum of masked token losses) / d(embed_sum[b, t])`` (``[B, T, D]``, read from
the model's ``perturb('embed_sum', ...)`` hook), the per-token loss, the batch, and the
position table before and after the optimizer update. Nothing loops over positions:
every vector is a scatter-add over ``positions`` (``jax.ops.segment_sum``).

Vectors over table rows ``p`` (all ``[max_len]``), per step and summed over a logging
window (and over microbatches under gradient accumulation):

* ``count``      (int32)   real input tokens (``segment_ids > 0``) at position id ``p``.
* ``loss_sum``   (float32) sum of the loss of targets scored (``loss_mask``) at input ``p``.
* ``loss_count`` (int32)   number of targets scored at input position ``p``.
* ``occ_norm``   (float32) sum over occurrences at ``p`` of ``||g(b, t)||``.
* ``occ_sq``     (float32) sum over occurrences at ``p`` of ``||g(b, t)||**2``.
* ``row_sq``     (float32) ``||sum over occurrences at p of g(b, t)||**2``, over the whole
  global batch of one optimizer step (microbatch sums are added before squaring). This is
  the squared norm of row ``p`` of the table gradient of the sum-reduced loss; summed over
  the steps of a window.
* ``downstream`` (float32) sum over occurrences at ``p`` of the number of loss-bearing
  targets at or after ``t`` in the same segment (the losses ``g(b, t)`` aggregates in a
  causal model).
* ``update_sq``  (float32) ``||new_table[p] - old_table[p]||**2``: the change the
  optimizer made to row ``p`` (Adam rescaling, weight decay and clipping included).

Derived quantities (``derived``): ``coherence = row_sq / (count * occ_sq)`` (1/count for
random directions, 1 for perfectly aligned ones; over a window it is a ratio of window
sums), ``signal_per_occurrence = occ_norm / count``, ``signal_per_downstream =
occ_norm / downstream``, ``mean_loss = loss_sum / loss_count``. Undefined entries are NaN.

Segments are assumed contiguous within a row (as every position policy produces them):
``downstream`` resets where ``segment_ids`` changes.

Window files (``save_window``) are plain ``.npz``: ``np.load(path)`` gives the fields above
plus ``step`` (last step of the window), ``first_step``, ``num_steps`` and
``cumulative_count`` (int64 exact count of each position since step 0).
"""

from __future__ import annotations

import os
from typing import Any, Mapping

import jax
import jax.numpy as jnp
import numpy as np

FIELDS = ('count', 'loss_sum', 'loss_count', 'occ_norm', 'occ_sq', 'row_sq',
          'downstream', 'update_sq')
INT_FIELDS = ('count', 'loss_count')
# Fields produced per microbatch (before the step's row_sq / update_sq are known).
LOSS_FIELDS = ('loss_sum', 'loss_count')  # Kept even with collect_stats=False.
OCCURRENCE_FIELDS = ('count', 'loss_sum', 'loss_count', 'occ_norm', 'occ_sq',
                     'downstream')

Stats = dict[str, jax.Array]


def zeros(max_len: int) -> Stats:
  """All-zero statistics.

  Args:
    max_len: rows in the position table.

  Returns:
    Dict of ``FIELDS``, each ``[max_len]`` (int32 for counts, float32 otherwise).
  """
  return {k: jnp.zeros((max_len,), jnp.int32 if k in INT_FIELDS else jnp.float32)
          for k in FIELDS}


def downstream_targets(segment_ids: jax.Array, loss_mask: jax.Array) -> jax.Array:
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


def loss_stats(token_loss: jax.Array, batch: Mapping[str, jax.Array],
               max_len: int) -> Stats:
  """Loss of the scored targets by input position (no gradients needed).

  Args:
    token_loss: ``[B, T]`` per-token loss (any value where ``loss_mask`` is 0).
    batch: dict with ``positions`` (int ``[B, T]``) and ``loss_mask`` (float ``[B, T]``).
    max_len: rows in the position table.

  Returns:
    Dict ``loss_sum`` (float32 ``[max_len]``) and ``loss_count`` (int32 ``[max_len]``).
  """
  pos = batch['positions'].reshape(-1)
  mask = batch['loss_mask'].astype(jnp.float32).reshape(-1)
  loss = jnp.where(mask > 0, token_loss.astype(jnp.float32).reshape(-1), 0.0) * mask
  return {
      'loss_sum': jax.ops.segment_sum(loss, pos, num_segments=max_len),
      'loss_count': jax.ops.segment_sum((mask > 0).astype(jnp.int32), pos,
                                        num_segments=max_len),
  }


def occurrence_stats(g: jax.Array, token_loss: jax.Array,
                     batch: Mapping[str, jax.Array], max_len: int) -> Stats:
  """Scatter one (micro)batch's per-occurrence quantities onto table rows.

  Args:
    g: ``[B, T, D]`` gradient of the sum-reduced loss w.r.t. the embedding sum.
    token_loss: ``[B, T]`` per-token loss (any value where ``loss_mask`` is 0).
    batch: dict with ``positions``, ``segment_ids`` (int ``[B, T]``) and ``loss_mask``
      (float ``[B, T]``).
    max_len: rows in the position table.

  Returns:
    Dict of ``OCCURRENCE_FIELDS`` (each ``[max_len]``) plus ``g_sum`` ``[max_len, D]``
    float32 (sum of ``g`` over occurrences at each row, squared later into ``row_sq``).
  """
  pos = batch['positions'].reshape(-1)
  real = (batch['segment_ids'] > 0).reshape(-1)
  g = g.astype(jnp.float32).reshape(pos.shape[0], -1)
  g = jnp.where(real[:, None], g, 0.0)
  sq = jnp.sum(g * g, axis=-1)
  down = downstream_targets(batch['segment_ids'], batch['loss_mask']).reshape(-1)
  realf = real.astype(jnp.float32)

  def scatter(x):
    return jax.ops.segment_sum(x, pos, num_segments=max_len)

  return {
      'count': scatter(real.astype(jnp.int32)),
      **loss_stats(token_loss, batch, max_len),
      'occ_norm': scatter(jnp.sqrt(sq)),
      'occ_sq': scatter(sq),
      'downstream': scatter(down * realf),
      'g_sum': scatter(g),
  }


def add(a: Mapping[str, jax.Array], b: Mapping[str, jax.Array]) -> Stats:
  """Field-wise sum of two statistics dicts with the same keys (any shapes)."""
  return {k: a[k] + b[k] for k in a}


def finish_step(occ: Mapping[str, jax.Array], old_table: jax.Array | None,
                new_table: jax.Array | None) -> Stats:
  """Complete one optimizer step's statistics.

  Args:
    occ: ``occurrence_stats`` output summed over the step's microbatches (with ``g_sum``
      ``[max_len, D]``).
    old_table: ``[max_len, D]`` position table before the update, or None (no learned
      table: ``update_sq`` is zero).
    new_table: ``[max_len, D]`` position table after the update, or None.

  Returns:
    Dict of ``FIELDS``, each ``[max_len]``.
  """
  out = {k: occ[k] for k in OCCURRENCE_FIELDS}
  out['row_sq'] = jnp.sum(jnp.square(occ['g_sum']), axis=-1)
  if old_table is None:
    out['update_sq'] = jnp.zeros_like(out['row_sq'])
  else:
    delta = new_table.astype(jnp.float32) - old_table.astype(jnp.float32)
    out['update_sq'] = jnp.sum(delta * delta, axis=-1)
  return out


def derived(stats: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """Ratios documented in the module docstring, NaN where undefined.

  Args:
    stats: dict with ``FIELDS`` (each ``[max_len]``), e.g. ``np.load`` of a window file.

  Returns:
    Dict ``coherence``, ``signal_per_occurrence``, ``signal_per_downstream``,
    ``mean_loss``, each ``[max_len]`` float64.
  """
  s = {k: np.asarray(stats[k], np.float64) for k in FIELDS}

  def div(a, b):
    with np.errstate(divide='ignore', invalid='ignore'):
      return np.where(b > 0, a / np.where(b > 0, b, 1.0), np.nan)

  return {
      'coherence': div(s['row_sq'], s['count'] * s['occ_sq']),
      'signal_per_occurrence': div(s['occ_norm'], s['count']),
      'signal_per_downstream': div(s['occ_norm'], s['downstream']),
      'mean_loss': div(s['loss_sum'], s['loss_count']),
  }


def window_path(workdir: str, step: int) -> str:
  """Path of the statistics window file ending at ``step``."""
  return os.path.join(workdir, 'stats', f'window_{step}.npz')


def save_window(path: str, stats: Mapping[str, Any], *, step: int, first_step: int,
                cumulative_count: np.ndarray) -> None:
  """Write one window's statistics as a plain ``.npz`` (atomically).

  Args:
    path: destination file.
    stats: dict of ``FIELDS`` ``[max_len]`` summed over steps ``first_step..step``.
    step: last optimizer step of the window (1-based step count after the update).
    first_step: first optimizer step of the window.
    cumulative_count: ``[max_len]`` int64 exact count of each position up to ``step``.
  """
  os.makedirs(os.path.dirname(path), exist_ok=True)
  arrays = {k: np.asarray(stats[k]) for k in FIELDS}
  arrays['count'] = arrays['count'].astype(np.int64)
  arrays['loss_count'] = arrays['loss_count'].astype(np.int64)
  tmp = path + '.tmp.npz'
  np.savez(tmp, step=np.int64(step), first_step=np.int64(first_step),
           num_steps=np.int64(step - first_step + 1),
           cumulative_count=np.asarray(cumulative_count, np.int64), **arrays)
  os.replace(tmp, path)
