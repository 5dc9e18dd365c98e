"""Per-position learning-signal statistics of any model and training loop
(fields, window files, TensorBoard curves: docs/DESIGN.md § Statistics)."""

import collections.abc
from collections.abc import Callable, Iterator, Mapping
import dataclasses
import functools
import os
from typing import Any, Self

import flax.struct
import jax
from jax.extend import core as jax_core
import jax.numpy as jnp
import numpy as np

from flax_posemb import analysis
from flax_posemb import buckets
from flax_posemb import embeddings
from flax_posemb import outputs
from flax_posemb import sharding

FIELDS = (
    'count',
    'loss_sum',
    'loss_count',
    'occ_norm',
    'occ_sq',
    'row_sq',
    'downstream',
    'update_sq',
)
INT_FIELDS = ('count', 'loss_count')
# Kept with statistics off (no gradient).
LOSS_FIELDS = ('count', 'loss_sum', 'loss_count')

# Positions per bucket of the writer's scalars without bucket_edges (the
# evaluation's default eval.bucket_size).
DEFAULT_BUCKET_SIZE = 16

Array = jax.Array
# A [P] vector: a jax array inside the step, a numpy array on the host.
Vector = jax.Array | np.ndarray


@flax.struct.dataclass
class PositionStats(collections.abc.Mapping):
  """``[P]`` vectors of one step or window: a pytree and a read-only mapping of
  the present fields (others None); ``row_grad`` ``[P, D]`` only between
  microbatches, until ``finish``."""

  count: Vector
  loss_sum: Vector
  loss_count: Vector
  occ_norm: Vector | None = None
  occ_sq: Vector | None = None
  row_sq: Vector | None = None
  downstream: Vector | None = None
  update_sq: Vector | None = None
  row_grad: Vector | None = None

  @classmethod
  def zeros(cls, num_positions: int, *, collect: bool = True) -> Self:
    """All-zero statistics: every field, or only ``LOSS_FIELDS`` when
    ``collect`` is False."""
    return cls(
        **{
            k: jnp.zeros(
                (num_positions,), jnp.int32 if k in INT_FIELDS else jnp.float32
            )
            for k in (FIELDS if collect else LOSS_FIELDS)
        }
    )

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
    """Squares the summed ``row_grad`` into ``row_sq`` (after the step's last
    microbatch)."""
    if self.row_grad is None:
      return self
    row_sq = jnp.sum(jnp.square(self.row_grad), axis=-1)
    return dataclasses.replace(self, row_sq=row_sq, row_grad=None)

  def to_numpy(self) -> dict[str, np.ndarray]:
    """Host copies of the present fields; counts as exact int64."""
    host = {}
    for key, value in self.items():
      dtype = np.int64 if key in INT_FIELDS else np.float32
      host[key] = sharding.to_host(value).astype(dtype)
    return host


def update_sq(old_table: Array, new_table: Array) -> Array:
  """``[P]`` squared norm of each row's change between two ``[P, D]`` tables
  (float32)."""
  delta = new_table.astype(jnp.float32) - old_table.astype(jnp.float32)
  return jnp.sum(delta * delta, axis=-1)


def downstream_targets(segment_ids: Array, loss_mask: Array) -> Array:
  """``[B, T]`` float32 ``sum_{t' >= t, same segment} loss_mask[b, t']`` of
  ``[B, T]`` ``segment_ids`` (contiguous segments) and ``loss_mask``."""
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


def loss_stats(
    token_loss: Array, batch: Mapping[str, Array], num_positions: int
) -> PositionStats:
  """``LOSS_FIELDS`` (no gradient needed) of ``[B, T]`` token losses and a
  batch."""
  pos = batch['positions'].reshape(-1)
  mask = batch['loss_mask'].astype(jnp.float32).reshape(-1)
  loss = (
      jnp.where(mask > 0, token_loss.astype(jnp.float32).reshape(-1), 0.0)
      * mask
  )

  scatter = functools.partial(
      jax.ops.segment_sum, segment_ids=pos, num_segments=num_positions
  )
  return PositionStats(
      count=scatter((batch['segment_ids'] > 0).reshape(-1).astype(jnp.int32)),
      loss_sum=scatter(loss),
      loss_count=scatter((mask > 0).astype(jnp.int32)),
  )


def occurrence_stats(
    g: Array, token_loss: Array, batch: Mapping[str, Array], num_positions: int
) -> PositionStats:
  """One (micro)batch's statistics from ``g`` ``[B, T, D]``, the gradient of the
  sum-reduced loss w.r.t. the embedding sum: unfinished (``row_grad``, no
  ``row_sq``/``update_sq``)."""
  pos = batch['positions'].reshape(-1)
  real = (batch['segment_ids'] > 0).reshape(-1)
  g = jnp.where(
      real[:, None], g.astype(jnp.float32).reshape(pos.shape[0], -1), 0.0
  )
  sq = jnp.sum(g * g, axis=-1)
  down = downstream_targets(batch['segment_ids'], batch['loss_mask']).reshape(
      -1
  )

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


def check_real_positions(
    batch: Mapping[str, Array], num_positions: int
) -> None:
  """Refuses a real token (``segment_ids > 0``) whose position id is outside
  ``[0, num_positions)``: the statistics would drop it while the loss counts
  it.

  Eagerly a ValueError (`embeddings.check_position_range`'s message); under
  ``jax.jit`` the same ValueError raised on the host when the step runs,
  surfacing as a ``jax.errors.JaxRuntimeError`` that contains its message. A
  valid batch costs one reduction on the device, no host round trip.
  """
  real = jnp.asarray(batch['segment_ids']) > 0
  positions = jnp.where(real, jnp.asarray(batch['positions']), 0)
  if not isinstance(positions, jax.core.Tracer):
    embeddings.check_position_range(np.asarray(positions), num_positions)
    return
  outside = (positions < 0) | (positions >= num_positions)
  lowest = jnp.min(positions, initial=0)
  highest = jnp.max(positions, initial=0)

  def refuse(lo, hi, num_bad):
    raise embeddings.position_range_error(
        int(lo), int(hi), int(num_bad), num_positions
    )

  jax.lax.cond(
      jnp.any(outside),
      lambda: jax.debug.callback(refuse, lowest, highest, jnp.sum(outside)),
      lambda: None,
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


def check_uses_embed_delta(
    token_loss_fn: Callable[..., Array], params: Any, delta: Array, batch, args
) -> None:
  """Refuses a ``token_loss_fn`` whose token losses do not depend on
  ``embed_delta``: every ``occ_*``, ``row_sq`` and ``downstream``-based ratio
  would be silently 0. Traces the function once more (no compilation)."""
  closed = jax.make_jaxpr(lambda d: token_loss_fn(params, d, batch, *args))(
      delta
  )
  if _depends_on_input(closed):
    return
  raise ValueError(
      'token_loss_fn never uses embed_delta, so the statistics would all be 0:'
      ' add it to the token+position embedding sum, e.g. `x ='
      ' token_rows + position_rows + embed_delta` (float32 [B, T, D] zeros),'
      ' or pass collect=False for the loss fields only.'
  )


def value_and_grad_with_position_stats(
    token_loss_fn: Callable[..., Array],
    num_positions: int,
    embed_dim: int,
    *,
    collect: bool = True,
    finish: bool = True,
    check_positions: bool = True,
) -> Callable[..., tuple]:
  """Loss, parameter gradients and per-position statistics of any model, in one
  backward pass.

  Args:
    token_loss_fn: ``(params, embed_delta, batch, *args) -> [B, T]`` float32
      token losses of any ``params`` pytree and batch (``flax_posemb.batch``);
      it adds ``embed_delta`` (zeros, float32 ``[B, T, D]``) to the
      token+position embedding sum. One that never uses ``embed_delta`` is
      refused (ValueError) when ``f`` is first traced.
    num_positions: rows ``P`` of the position table (ids of real tokens must be
      below it).
    embed_dim: width ``D`` of the embedding sum.
    collect: False keeps only ``LOSS_FIELDS`` (loss, gradients and update are
      unchanged).
    finish: False leaves ``row_grad`` unsquared, for summing microbatches
      (then ``finish()``).
    check_positions: refuse a real token whose position id is outside ``[0,
      P)`` (`check_real_positions`: eagerly a ValueError, under ``jax.jit`` a
      ``JaxRuntimeError`` with its message). False: the caller has checked
      the batch already (the training loop, at ``sharding.global_batch``).

  Returns:
    ``f(params, batch, *args, denominator=None) -> (loss, grads, stats)``: the
    mean token loss over ``loss_mask`` (or its sum / ``denominator``), its
    gradient, and ``PositionStats`` without ``update_sq`` (added by
    ``PositionStatistics.inside_step``).
  """
  # Whether token_loss_fn was seen to use embed_delta: the dependence is
  # structural, one trace shows it.
  checked_delta = False

  def f(params, batch, *args, denominator=None):
    nonlocal checked_delta
    if check_positions:
      check_real_positions(batch, num_positions)
    mask = batch['loss_mask'].astype(jnp.float32)
    denom = (
        jnp.maximum(jnp.sum(mask), 1.0) if denominator is None else denominator
    )
    delta = jnp.zeros(batch['positions'].shape + (embed_dim,), jnp.float32)
    if collect and not checked_delta:
      check_uses_embed_delta(token_loss_fn, params, delta, batch, args)
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
      (`flax_posemb.plots.PositionCurveImages()`; the core draws nothing).
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

  def value_and_grad(
      self,
      token_loss_fn: Callable[..., Array],
      *,
      finish: bool = True,
      check_positions: bool = True,
  ) -> Callable[..., tuple]:
    """``value_and_grad_with_position_stats`` for this table (same
    arguments)."""
    return value_and_grad_with_position_stats(
        token_loss_fn,
        self.num_positions,
        self.embed_dim,
        collect=self.collect,
        finish=finish,
        check_positions=check_positions,
    )

  def init(self) -> PositionStats:
    """An empty window (a new buffer each call: a jitted step may donate the
    last one)."""
    return PositionStats.zeros(self.num_positions, collect=self.collect)

  def inside_step(
      self,
      window: PositionStats,
      stats: PositionStats,
      old_table: Array | None = None,
      new_table: Array | None = None,
  ) -> PositionStats:
    """In the jitted step: ``window`` plus the step's ``stats``, whose
    ``update_sq`` comes from the ``[P, D]`` tables before and after the update
    (zeros without a table)."""
    stats = stats.finish()
    if stats.occ_norm is not None:
      if old_table is None or new_table is None:
        change = jnp.zeros((self.num_positions,), jnp.float32)
      else:
        change = update_sq(old_table, new_table)
      stats = dataclasses.replace(stats, update_sq=change)
    return window + stats

  def window_ends(self, step: int) -> bool:
    """Whether a window ends after ``step`` (the one rule; a loop asks it)."""
    return step % self.log_every == 0 or step == self.last_step

  def on_step(
      self, step: int, window: PositionStats, *, table: Any = None
  ) -> PositionStats:
    """On the host after ``step``: at a window end, writes and reports the
    window (``table``: the ``[P, D]`` table after ``step``, for drift) and
    returns a new one; else ``window``."""
    if not self.window_ends(step):
      return window
    host = window.to_numpy()
    self.cumulative_count = self.cumulative_count + host['count']
    if self.directory is not None:
      path = os.path.join(self.directory, outputs.WINDOW_FILE.format(step=step))
      window_file = {
          'step': np.int64(step),
          'first_step': np.int64(self.first_step),
          'num_steps': np.int64(step - self.first_step + 1),
          'cumulative_count': self.cumulative_count,
          **host,
      }
      outputs.save_npz(path, window_file)
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
    """Writes a window's curves: a scalar per position bucket and curve (NaN
    skipped), and with ``curve_image`` a line plot of each."""
    per_bucket = bucket_curves(window, self.bucket_edges, drift)
    for name, values in per_bucket.items():
      for start, end, value in zip(
          self.bucket_edges[:-1], self.bucket_edges[1:], values
      ):
        if np.isfinite(value):
          tag = f'positions_{name}/{start:05d}-{end:05d}'
          self.writer.add_scalar(tag, float(value), step)
    if self.curve_image is None:
      return
    steps = f'steps {self.first_step}-{step}'
    for name, values in window_curves(window, drift).items():
      self.writer.add_image(
          f'positions/{name}',
          self.curve_image(name, values, steps),
          global_step=step,
          dataformats='HWC',
      )

  def report_table(self, step: int, table: Any) -> None:
    """The ``[P, D]`` table's cosine similarity as an image (red 1, white 0,
    blue -1)."""
    if self.writer is None:
      return
    # row 0 at the bottom
    c = np.clip(analysis.cosine_similarity(table), -1.0, 1.0)[::-1]
    rgb = np.stack(
        [np.minimum(1 + c, 1), 1 - np.abs(c), np.minimum(1 - c, 1)], axis=-1
    )
    self.writer.add_image(
        'positions/cosine_similarity',
        (255 * rgb).astype(np.uint8),
        global_step=step,
        dataformats='HWC',
    )

  def state(self, window: PositionStats) -> dict[str, Any]:
    """This object's part of a checkpoint: host numpy arrays and scalars."""
    return dict(
        window=window.to_numpy(),
        cumulative_count=self.cumulative_count,
        window_first_step=self.first_step,
    )

  def restore(self, saved: Mapping[str, Any]) -> PositionStats:
    """Loads ``state``'s output; returns the window to continue (host arrays).
    Fields this object does not collect are dropped; ones it collects but
    ``saved`` lacks start at 0."""
    self.cumulative_count = np.asarray(saved['cumulative_count'], np.int64)
    self.first_step = int(saved['window_first_step'])
    window = {}
    for key, zeros in self.init().items():
      window[key] = np.asarray(saved['window'].get(key, zeros), zeros.dtype)
    return PositionStats(**window)


def window_curves(
    window: Mapping[str, Any], drift: np.ndarray | None = None
) -> dict[str, np.ndarray]:
  """``[P]`` float64 per-position curves of a window (a ``PositionStats``, a
  window file): ``count``, ``loss`` (``loss_sum / loss_count``, the training
  loss), with statistics ``signal_per_occurrence``, ``coherence``,
  ``update_sq``, ``row_sq``, ``occ_norm``, and ``drift`` if given."""
  ratios = derived(window)
  curves = {
      'count': np.asarray(window['count'], np.float64),
      'loss': ratios['mean_loss'],
  }
  if 'occ_norm' in window:
    curves['signal_per_occurrence'] = ratios['signal_per_occurrence']
    curves['coherence'] = ratios['coherence']
    for key in ('update_sq', 'row_sq', 'occ_norm'):
      curves[key] = np.asarray(window[key], np.float64)
  if drift is not None:
    curves['drift'] = np.asarray(drift, np.float64)
  return curves


def bucket_curves(
    window: Mapping[str, Any],
    edges: np.ndarray,
    drift: np.ndarray | None = None,
) -> dict[str, np.ndarray]:
  """``[nb]`` float64 per bucket of ``edges`` ``[nb + 1]`` (0 to ``P``) of each
  `window_curves` curve: the ratios (``loss``, ``signal_per_occurrence``,
  ``coherence``) as the ratio of the bucket's sums, as if the bucket were one
  position; the others as the mean over the bucket's positions. NaN where a
  ratio is undefined."""
  starts = np.asarray(edges[:-1])
  widths = np.diff(edges).astype(np.float64)

  def total(values):
    return np.add.reduceat(np.asarray(values, np.float64), starts)

  count = np.asarray(window['count'], np.float64)
  out = {
      'count': total(count) / widths,
      'loss': _ratio(total(window['loss_sum']), total(window['loss_count'])),
  }
  if 'occ_norm' in window:
    out['signal_per_occurrence'] = _ratio(
        total(window['occ_norm']), total(count)
    )
    out['coherence'] = _ratio(
        total(window['row_sq']), total(count * np.asarray(window['occ_sq']))
    )
    for key in ('update_sq', 'row_sq', 'occ_norm'):
      out[key] = total(window[key]) / widths
  if drift is not None:
    out['drift'] = total(drift) / widths
  return out


def _ratio(numerator: np.ndarray, denominator: np.ndarray) -> np.ndarray:
  """``numerator / denominator``, NaN where the denominator is not > 0."""
  with np.errstate(divide='ignore', invalid='ignore'):
    return np.where(
        denominator > 0,
        numerator / np.where(denominator > 0, denominator, 1.0),
        np.nan,
    )


def derived(stats: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """``[P]`` float64 ratios ``coherence``, ``signal_per_occurrence``,
  ``signal_per_downstream`` and ``mean_loss`` (docs/DESIGN.md § Statistics) of a
  mapping with (some of) ``FIELDS`` (a ``PositionStats``, a window file), NaN
  where undefined or not collected."""
  size = len(np.asarray(stats['count']))
  s = {}
  for key in FIELDS:
    if key in stats:
      s[key] = np.asarray(stats[key], np.float64)
    else:
      s[key] = np.full(size, np.nan)

  return {
      'coherence': _ratio(s['row_sq'], s['count'] * s['occ_sq']),
      'signal_per_occurrence': _ratio(s['occ_norm'], s['count']),
      'signal_per_downstream': _ratio(s['occ_norm'], s['downstream']),
      'mean_loss': _ratio(s['loss_sum'], s['loss_count']),
  }
