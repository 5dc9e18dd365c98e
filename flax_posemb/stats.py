"""Per-position learning-signal statistics of any model and training loop:
the maths inside the jitted step and the statistics object (fields, window
files, TensorBoard curves: docs/DESIGN.md § Statistics; the host side of a
window: `stats_window`)."""

import collections.abc
from collections.abc import Callable, Iterator, Mapping
import dataclasses
import functools
from typing import Any, Self

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from flax_posemb import analysis
from flax_posemb import buckets
from flax_posemb import segments
from flax_posemb import sharding
from flax_posemb import stats_checks
from flax_posemb import stats_window

# The host-side ratios and curves, named here too: `stats.derived` is how the
# docs and the experiments read a window.
from flax_posemb.stats_window import bucket_curves as bucket_curves
from flax_posemb.stats_window import derived as derived
from flax_posemb.stats_window import window_curves as window_curves

FIELDS = (
    'count',
    'loss_sum',
    'loss_count',
    'full_context_count',
    'context_count',
    'occ_norm',
    'occ_sq',
    'row_sq',
    'downstream',
    'update_sq',
)
INT_FIELDS = ('count', 'loss_count', 'full_context_count', 'context_count')
# Kept with statistics off: they need no gradient.
LOSS_FIELDS = (
    'count',
    'loss_sum',
    'loss_count',
    'full_context_count',
    'context_count',
)
# Fields [P, K] over the log2 context buckets of `segments.context_buckets`;
# the others are [P].
CONTEXT_FIELDS = ('context_count',)

# Positions per bucket of the writer's scalars without bucket_edges (the
# evaluation's default eval.bucket_size).
DEFAULT_BUCKET_SIZE = 16

Array = jax.Array
# A [P] vector: a jax array inside the step, a numpy array on the host.
Vector = jax.Array | np.ndarray


@flax.struct.dataclass
class PositionStats(collections.abc.Mapping):
  """The statistics of one step or window: a pytree and a read-only mapping of
  the present fields (others None).

  Every field is ``[P]`` but ``context_count`` ``[P, K]``
  (`segments.context_buckets`); ``row_grad`` ``[P, D]`` exists only between
  microbatches, until ``finish``.
  """

  count: Vector
  loss_sum: Vector
  loss_count: Vector
  full_context_count: Vector | None = None
  context_count: Vector | None = None
  occ_norm: Vector | None = None
  occ_sq: Vector | None = None
  row_sq: Vector | None = None
  downstream: Vector | None = None
  update_sq: Vector | None = None
  row_grad: Vector | None = None

  @classmethod
  def zeros(cls, num_positions: int, *, collect: bool = True) -> Self:
    """All-zero statistics of a table.

    Args:
      num_positions: rows ``P`` of the position table.
      collect: False: only ``LOSS_FIELDS``.

    Returns:
      Every field (or ``LOSS_FIELDS``) at zero: ints int32, others float32.
    """
    fields = {}
    for key in FIELDS if collect else LOSS_FIELDS:
      shape: tuple[int, ...] = (num_positions,)
      if key in CONTEXT_FIELDS:
        shape += (segments.context_buckets(num_positions),)
      dtype = jnp.int32 if key in INT_FIELDS else jnp.float32
      fields[key] = jnp.zeros(shape, dtype)
    return cls(**fields)

  def __getitem__(self, key: str) -> Vector:
    value = getattr(self, key) if key in FIELDS else None
    if value is None:
      raise KeyError(key)
    return value

  def __iter__(self) -> Iterator[str]:
    return (k for k in FIELDS if getattr(self, k) is not None)

  def __len__(self) -> int:
    return sum(1 for _ in self)

  def __add__(self, other: Self) -> Self:
    """Field-wise sum (both sides hold the same fields, else jax's tree mismatch
    error)."""
    return jax.tree.map(jnp.add, self, other)

  def finish(self) -> Self:
    """Squares the summed ``row_grad`` into ``row_sq``, after the step's last
    microbatch.

    Returns:
      These statistics with ``row_sq`` ``[P]`` and no ``row_grad``.
    """
    if self.row_grad is None:
      return self
    row_sq = jnp.sum(jnp.square(self.row_grad), axis=-1)
    return dataclasses.replace(self, row_sq=row_sq, row_grad=None)

  def to_numpy(self) -> dict[str, np.ndarray]:
    """Host copies of the present fields.

    Returns:
      Field name -> numpy array (counts exact int64, others float32).
    """
    host = {}
    for key, value in self.items():
      dtype = np.int64 if key in INT_FIELDS else np.float32
      host[key] = sharding.to_host(value).astype(dtype)
    return host


def update_sq(old_table: Array, new_table: Array) -> Array:
  """Squared norm of each row's change.

  Args:
    old_table: ``[P, D]`` table before the update.
    new_table: ``[P, D]`` table after it.

  Returns:
    ``[P]`` float32 ``‖new_table[p] - old_table[p]‖²``.
  """
  delta = new_table.astype(jnp.float32) - old_table.astype(jnp.float32)
  return jnp.sum(delta * delta, axis=-1)


def loss_stats(
    token_loss: Array, batch: Mapping[str, Array], num_positions: int
) -> PositionStats:
  """The fields that need no gradient: ``LOSS_FIELDS``.

  The context histogram is over log2 buckets: what separates training's
  situation from the evaluation's is the order of magnitude of a row's
  context (a late row trained at context 30 or at 500); the exact case that
  matters, context = position, is ``full_context_count``. It costs one more
  scatter-add of the ``B·T`` tokens, like ``count``, and ``K = log2 P + 1``
  ints per row in the window, its checkpoint and its file (an exact ``[P, P]``
  histogram would be 4 MB per window at 1024 rows).

  Args:
    token_loss: ``[B, T]`` token losses.
    batch: the batch (``flax_posemb.batch``) of ``[B, T]`` arrays.
    num_positions: rows ``P`` of the position table.

  Returns:
    ``PositionStats`` of ``LOSS_FIELDS``: ``count``, ``loss_sum``,
    ``loss_count``, ``full_context_count`` ``[P]``; ``context_count``
    ``[P, K]``.
  """
  pos = batch['positions'].reshape(-1)
  real = (batch['segment_ids'] > 0).reshape(-1).astype(jnp.int32)
  mask = batch['loss_mask'].astype(jnp.float32).reshape(-1)
  loss = (
      jnp.where(mask > 0, token_loss.astype(jnp.float32).reshape(-1), 0.0)
      * mask
  )
  context = segments.context_lengths(batch['segment_ids']).reshape(-1)
  num_buckets = segments.context_buckets(num_positions)
  # The bit length of the context: 0 for 0, k for [2**(k-1), 2**k).
  bucket = jnp.minimum(32 - jax.lax.clz(context), num_buckets - 1)

  scatter = functools.partial(
      jax.ops.segment_sum, segment_ids=pos, num_segments=num_positions
  )
  by_context = jax.ops.segment_sum(
      real,
      pos * num_buckets + bucket,
      num_segments=num_positions * num_buckets,
  )
  return PositionStats(
      count=scatter(real),
      loss_sum=scatter(loss),
      loss_count=scatter((mask > 0).astype(jnp.int32)),
      full_context_count=scatter(real * (context == pos).astype(jnp.int32)),
      context_count=by_context.reshape(num_positions, num_buckets),
  )


def occurrence_stats(
    g: Array, token_loss: Array, batch: Mapping[str, Array], num_positions: int
) -> PositionStats:
  """One (micro)batch's statistics, unfinished.

  Args:
    g: ``[B, T, D]`` gradient of the sum-reduced loss w.r.t. the embedding sum.
    token_loss: ``[B, T]`` token losses.
    batch: the batch of ``[B, T]`` arrays.
    num_positions: rows ``P`` of the position table.

  Returns:
    ``PositionStats`` with ``row_grad`` ``[P, D]``, no ``row_sq`` or
    ``update_sq``.
  """
  pos = batch['positions'].reshape(-1)
  real = (batch['segment_ids'] > 0).reshape(-1)
  g = jnp.where(
      real[:, None], g.astype(jnp.float32).reshape(pos.shape[0], -1), 0.0
  )
  sq = jnp.sum(g * g, axis=-1)
  down = segments.downstream_targets(
      batch['segment_ids'], batch['loss_mask']
  ).reshape(-1)

  scatter = functools.partial(
      jax.ops.segment_sum, segment_ids=pos, num_segments=num_positions
  )
  return dataclasses.replace(
      loss_stats(token_loss, batch, num_positions),
      occ_norm=scatter(jnp.sqrt(sq)),
      occ_sq=scatter(sq),
      downstream=scatter(down * real.astype(jnp.float32)),
      row_grad=scatter(g),
  )


def value_and_grad_with_position_stats(
    token_loss_fn: Callable[..., Array],
    num_positions: int,
    embed_dim: int,
    *,
    collect: bool = True,
    finish: bool = True,
    check_positions: bool = True,
    check_signal: bool = True,
) -> Callable[..., tuple]:
  """Loss, parameter gradients and per-position statistics of any model, in one
  backward pass.

  Args:
    token_loss_fn: ``(params, embed_delta, batch, *args) -> [B, T]`` float32
      token losses of any ``params`` pytree and batch (``flax_posemb.batch``);
      it adds ``embed_delta`` (zeros, float32 ``[B, T, D]``) to the
      token+position embedding sum. One whose ``embed_delta`` gradient is 0 by
      construction is refused (ValueError) when ``f`` is first traced.
    num_positions: rows ``P`` of the position table (ids of real tokens must be
      below it).
    embed_dim: width ``D`` of the embedding sum.
    collect: False keeps only ``LOSS_FIELDS`` (loss, gradients and update are
      unchanged).
    finish: False leaves ``row_grad`` unsquared, for summing microbatches
      (then ``finish()``).
    check_positions: refuse a real token whose position id is outside ``[0,
      P)`` (`stats_checks.check_real_positions`: eagerly a ValueError, under
      ``jax.jit`` a ``JaxRuntimeError`` with its message). False: the caller
      has checked the batch already (the training loop, at
      ``sharding.global_batch``).
    check_signal: refuse, when the step runs, statistics that are all 0 while
      the batch has scored targets (`stats_checks.check_nonzero_signal`,
      raised the same way). False: the caller's model is known to add
      ``embed_delta`` (the training loop's).

  Returns:
    ``f(params, batch, *args, denominator=None) -> (loss, grads, stats)``: the
    mean token loss over ``loss_mask`` (or its sum / ``denominator``), its
    gradient, and ``PositionStats`` without ``update_sq`` (added by
    ``PositionStatistics.inside_step``).
  """
  # Whether token_loss_fn's gradient was seen to reach embed_delta: the
  # dependence is structural, one trace shows it.
  checked_delta = False

  def f(params, batch, *args, denominator=None):
    nonlocal checked_delta
    if check_positions:
      stats_checks.check_real_positions(batch, num_positions)
    mask = batch['loss_mask'].astype(jnp.float32)
    denom = (
        jnp.maximum(jnp.sum(mask), 1.0) if denominator is None else denominator
    )
    delta = jnp.zeros(batch['positions'].shape + (embed_dim,), jnp.float32)
    if collect and not checked_delta:
      stats_checks.check_gradient_reaches_delta(
          token_loss_fn, params, delta, batch, args
      )
      checked_delta = True

    def mean_loss(p, delta):
      tl = token_loss_fn(p, delta, batch, *args)
      return jnp.sum(tl * mask) / denom, tl

    # The embed_delta gradient is taken in both modes so that the loss and the
    # parameter gradients compile identically whether or not statistics are
    # collected.
    (loss, tl), (grads, g_delta) = jax.value_and_grad(
        mean_loss, argnums=(0, 1), has_aux=True
    )(params, delta)
    if not collect:
      return loss, grads, loss_stats(tl, batch, num_positions)
    stats = occurrence_stats(g_delta * denom, tl, batch, num_positions)
    if check_signal:
      stats_checks.check_nonzero_signal(stats.loss_count, stats.occ_sq)
    return loss, grads, stats.finish() if finish else stats

  return f


class PositionStatistics:
  """The statistics of a training loop: ``inside_step`` in the jitted step,
  ``on_step`` on the host (docs/DESIGN.md § Statistics; docs/own_loop.md).

  Args:
    num_positions: rows ``P`` of the position table.
    embed_dim: width ``D`` of the embedding sum.
    log_every: steps per window: one ends at every multiple of it
      (``window_ends``).
    last_step: a window also ends here (a run's last step; None: only
      ``log_every``).
    directory: where ``window_STEP.npz`` files are written (None: no files).
    writer: None, or anything with tensorboardX ``SummaryWriter``'s
      ``add_scalar`` and ``add_image`` (`flax_posemb.tensorboard.TensorBoard`):
      per window, each curve of ``window_curves`` as one scalar per position
      bucket (``positions_NAME/START-END``, `bucket_curves`).
    collect: False keeps only ``LOSS_FIELDS``.
    initial_table: ``[P, D]`` table at step 0, for the drift curve (None: no
      drift).
    bucket_edges: ``[nb + 1]`` increasing position edges from 0 to ``P`` of
      the writer's buckets (None: 16 positions a bucket, the evaluation's
      default).
    curve_image: None, or ``(name, values [P], window) -> [H, W, 3] uint8``
      (``window``: 'steps FIRST-LAST'): a line plot of one curve, written per
      window as image ``positions/NAME``
      (`flax_posemb.plots.evaluation.PositionCurveImages()`; the core draws
      nothing).
  """

  def __init__(
      self,
      num_positions: int,
      embed_dim: int,
      *,
      log_every: int = 1,
      last_step: int | None = None,
      directory: str | None = None,
      writer: Any = None,
      collect: bool = True,
      initial_table: Any = None,
      bucket_edges: Any = None,
      curve_image: Callable[[str, np.ndarray, str], np.ndarray] | None = None,
  ):
    self.num_positions = num_positions
    self.embed_dim = embed_dim
    self.log_every = log_every
    self.last_step = last_step
    self.directory = directory
    self.writer = writer
    self.collect = collect
    if bucket_edges is None:
      bucket_edges = buckets.make_edges(num_positions, DEFAULT_BUCKET_SIZE)
    self.bucket_edges = np.asarray(bucket_edges, np.int64)
    if self.bucket_edges[0] != 0 or self.bucket_edges[-1] != num_positions:
      raise ValueError(
          f'bucket_edges must run from 0 to num_positions={num_positions},'
          f' got {self.bucket_edges.tolist()}.'
      )
    self.curve_image = curve_image
    self.initial_table = (
        None if initial_table is None else np.asarray(initial_table, np.float64)
    )
    # exact, since step 0
    self.cumulative_count = np.zeros(num_positions, np.int64)
    self.first_step = 1  # of the current window
    # Whether the window files in `directory` are this run's: after its first
    # write, or once restored (it continues the run that wrote them).
    self.owns_directory = False

  def value_and_grad(
      self,
      token_loss_fn: Callable[..., Array],
      *,
      finish: bool = True,
      check_positions: bool = True,
      check_signal: bool = True,
  ) -> Callable[..., tuple]:
    """`value_and_grad_with_position_stats` for this table and ``collect``.

    Args:
      token_loss_fn: ``(params, embed_delta, batch, *args) -> [B, T]`` token
        losses.
      finish: False leaves ``row_grad`` unsquared (microbatches).
      check_positions: refuse a real token's id outside the table.
      check_signal: refuse all-zero statistics where targets are scored.

    Returns:
      ``f(params, batch, *args, denominator=None) -> (loss, grads, stats)``.
    """
    return value_and_grad_with_position_stats(
        token_loss_fn,
        self.num_positions,
        self.embed_dim,
        collect=self.collect,
        finish=finish,
        check_positions=check_positions,
        check_signal=check_signal,
    )

  def init(self) -> PositionStats:
    """An empty window.

    Returns:
      All-zero ``PositionStats`` of this table, a new buffer each call (a
      jitted step may donate the last one).
    """
    return PositionStats.zeros(self.num_positions, collect=self.collect)

  def inside_step(
      self,
      window: PositionStats,
      stats: PositionStats,
      old_table: Array | None = None,
      new_table: Array | None = None,
  ) -> PositionStats:
    """Adds a step's statistics to the window, in the jitted step.

    Args:
      window: the window so far.
      stats: the step's (finished or not) from ``value_and_grad``.
      old_table: the ``[P, D]`` table before the update (None: no table).
      new_table: the ``[P, D]`` table after it.

    Returns:
      ``window + stats``, ``update_sq`` of the two tables (zeros without).
    """
    stats = stats.finish()
    if stats.occ_norm is not None:
      if old_table is None or new_table is None:
        change = jnp.zeros((self.num_positions,), jnp.float32)
      else:
        change = update_sq(old_table, new_table)
      stats = dataclasses.replace(stats, update_sq=change)
    return window + stats

  def window_ends(self, step: int) -> bool:
    """Whether a window ends after ``step`` (the one rule; a loop asks it).

    Args:
      step: a step number (the first step is 1).

    Returns:
      True at multiples of ``log_every`` and at ``last_step``.
    """
    return step % self.log_every == 0 or step == self.last_step

  def on_step(
      self, step: int, window: PositionStats, *, table: Any = None
  ) -> PositionStats:
    """Ends the window on the host after ``step`` where ``window_ends`` says.

    Writes ``window_STEP.npz`` (the first write refuses a ``directory`` that
    holds another run's window files: `stats_window.check_directory`) and
    reports the window to the writer.

    Args:
      step: the step just done.
      window: the window (device or host arrays).
      table: the ``[P, D]`` table after ``step``, for drift (None: no drift).

    Returns:
      A new empty window at a window end, else ``window``.
    """
    if not self.window_ends(step):
      return window
    host = window.to_numpy()
    if self.directory is not None and not self.owns_directory:
      stats_window.check_directory(self.directory)
      self.owns_directory = True
    self.cumulative_count = self.cumulative_count + host['count']
    if self.directory is not None:
      stats_window.write_window(
          self.directory, step, self.first_step, host, self.cumulative_count
      )
    if self.writer is not None:
      drift = None
      if table is not None and self.initial_table is not None:
        drift = analysis.drift(table, self.initial_table)
      self.report_window(step, host, drift)
    self.first_step = step + 1
    return self.init()

  def report_window(
      self,
      step: int,
      window: Mapping[str, np.ndarray],
      drift: np.ndarray | None = None,
  ) -> None:
    """Writes a window's curves to the writer (`stats_window.report_window`).

    Args:
      step: the window's last step.
      window: host arrays of its fields.
      drift: ``[P]`` drift of each row, or None.
    """
    stats_window.report_window(
        self.writer,
        step,
        self.first_step,
        window,
        self.bucket_edges,
        drift=drift,
        curve_image=self.curve_image,
    )

  def report_table(self, step: int, table: Any) -> None:
    """The ``[P, D]`` table's cosine similarity as an image (red 1, white 0,
    blue -1), if there is a writer.

    Args:
      step: the image's step.
      table: the ``[P, D]`` position table.
    """
    if self.writer is not None:
      stats_window.report_table(self.writer, step, table)

  def state(self, window: PositionStats) -> dict[str, Any]:
    """This object's part of a checkpoint.

    Args:
      window: the current window.

    Returns:
      Host numpy arrays and ints: ``window`` (its fields),
      ``cumulative_count`` ``[P]`` int64, ``window_first_step``.
    """
    return dict(
        window=window.to_numpy(),
        cumulative_count=self.cumulative_count,
        window_first_step=self.first_step,
    )

  def restore(self, saved: Mapping[str, Any]) -> PositionStats:
    """Continues the run whose ``state`` is ``saved``; its window files in
    ``directory`` are then this object's.

    Args:
      saved: ``state``'s output, as saved.

    Returns:
      The window to continue (host arrays): fields this object does not
      collect dropped, ones ``saved`` lacks at 0.
    """
    self.cumulative_count = np.asarray(saved['cumulative_count'], np.int64)
    self.first_step = int(saved['window_first_step'])
    self.owns_directory = True
    window = {}
    for key, zeros in self.init().items():
      window[key] = np.asarray(saved['window'].get(key, zeros), zeros.dtype)
    return PositionStats(**window)
