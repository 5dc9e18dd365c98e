"""What a batch's segments imply for each token, inside the jitted step: the
context it attends to and the scored targets downstream of it. A segment is a
contiguous run of one id in a row (docs/DESIGN.md § Batch); the model's
attention is causal within it."""

import jax
import jax.numpy as jnp

Array = jax.Array


def context_buckets(num_positions: int) -> int:
  """The number ``K`` of log2 context buckets of a ``num_positions``-row table.

  Bucket 0 holds context 0, bucket ``k >= 1`` contexts ``[2**(k-1), 2**k)``;
  the last one also any longer context.

  Args:
    num_positions: rows ``P`` of the position table.

  Returns:
    ``K = bit_length(P - 1) + 1`` (11 for 1024 rows): contexts ``0 .. P - 1``
    each in their own bucket.
  """
  return max(num_positions - 1, 1).bit_length() + 1


def downstream_targets(segment_ids: Array, loss_mask: Array) -> Array:
  """The scored targets at or after each token in its segment.

  Args:
    segment_ids: ``[B, T]`` int segment ids (contiguous segments).
    loss_mask: ``[B, T]`` scored targets.

  Returns:
    ``[B, T]`` float32 ``sum_{t' >= t, same segment} loss_mask[b, t']``.
  """
  # Scanned from the end, a segment "starts" at its last token: where the next
  # id differs.
  start = jnp.concatenate(
      [
          segment_ids[:, 1:] != segment_ids[:, :-1],
          jnp.ones_like(segment_ids[:, :1], bool),
      ],
      axis=1,
  )

  def combine(a, b):
    return jnp.where(b[1], b[0], a[0] + b[0]), a[1] | b[1]

  val = loss_mask.astype(jnp.float32)
  return jax.lax.associative_scan(combine, (val, start), reverse=True, axis=1)[
      0
  ]


def context_lengths(segment_ids: Array) -> Array:
  """How many earlier tokens of its own segment each token attends to.

  The model's attention is causal within a segment, and a segment is a
  contiguous run of one id in a row (docs/DESIGN.md § Batch), so a token's
  context is its column minus the column where its segment starts. A token
  at position ``p`` with context ``p`` is in the evaluation's situation: its
  document starts at position 0 of the row, with all of it visible.

  Args:
    segment_ids: ``[B, T]`` int segment ids.

  Returns:
    ``[B, T]`` int32 contexts (0 for a segment's first token).
  """
  columns = jnp.arange(segment_ids.shape[1], dtype=jnp.int32)
  starts = jnp.concatenate(
      [
          jnp.ones_like(segment_ids[:, :1], bool),
          segment_ids[:, 1:] != segment_ids[:, :-1],
      ],
      axis=1,
  )
  first_column = jax.lax.cummax(jnp.where(starts, columns, 0), axis=1)
  return columns - first_column
