"""The host side of a statistics window: its per-position ratios and curves, its
window file in a directory of one run, and its writer's scalars and images
(docs/DESIGN.md § Statistics). `stats.PositionStatistics` calls these; the maths
inside the jitted step is `stats`'."""

from collections.abc import Callable, Mapping
import os
from typing import Any

import numpy as np

from flax_posemb import analysis
from flax_posemb import outputs

# A curve image: (name, values [P], window title) -> [H, W, 3] uint8.
CurveImage = Callable[[str, np.ndarray, str], np.ndarray]


def _ratio(numerator: Any, denominator: Any) -> np.ndarray:
  """``numerator / denominator`` in float64, NaN where the denominator is not
  > 0."""
  numerator = np.asarray(numerator, np.float64)
  denominator = np.asarray(denominator, np.float64)
  with np.errstate(divide='ignore', invalid='ignore'):
    return np.where(
        denominator > 0,
        numerator / np.where(denominator > 0, denominator, 1.0),
        np.nan,
    )


def derived(stats: Mapping[str, Any]) -> dict[str, np.ndarray]:
  """The ratios of a window (docs/DESIGN.md § Statistics).

  Args:
    stats: a mapping with (some of) ``stats.FIELDS``: a ``PositionStats``, a
      window file, sums over windows; ``count`` is required.

  Returns:
    ``[P]`` float64 ``coherence`` (``row_sq / (count · occ_sq)``),
    ``signal_per_occurrence`` (``occ_norm / count``), ``signal_per_downstream``
    (``occ_norm / downstream``), ``mean_loss`` (``loss_sum / loss_count``) and
    ``full_context_share`` (``full_context_count / count``), NaN where
    undefined or not collected.
  """
  size = len(np.asarray(stats['count']))

  def field(key):
    if key in stats:
      return np.asarray(stats[key], np.float64)
    return np.full(size, np.nan)

  count = field('count')
  return {
      'coherence': _ratio(field('row_sq'), count * field('occ_sq')),
      'signal_per_occurrence': _ratio(field('occ_norm'), count),
      'signal_per_downstream': _ratio(field('occ_norm'), field('downstream')),
      'mean_loss': _ratio(field('loss_sum'), field('loss_count')),
      'full_context_share': _ratio(field('full_context_count'), count),
  }


def window_curves(
    window: Mapping[str, Any], drift: np.ndarray | None = None
) -> dict[str, np.ndarray]:
  """The per-position curves of a window, as the writer gets them.

  Args:
    window: a ``PositionStats`` or a window file.
    drift: ``[P]`` distance of each row from its step-0 value, or None.

  Returns:
    ``[P]`` float64 curves: ``count``, ``loss`` (the training loss), with the
    context fields ``full_context_count`` and ``full_context_share``, with
    gradient statistics ``signal_per_occurrence``, ``coherence``,
    ``update_sq``, ``row_sq``, ``occ_norm``, and ``drift`` if given.
  """
  ratios = derived(window)
  curves = {
      'count': np.asarray(window['count'], np.float64),
      'loss': ratios['mean_loss'],
  }
  if 'full_context_count' in window:
    curves['full_context_count'] = np.asarray(
        window['full_context_count'], np.float64
    )
    curves['full_context_share'] = ratios['full_context_share']
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
  """Each `window_curves` curve per position bucket.

  The ratios (``loss``, ``full_context_share``, ``signal_per_occurrence``,
  ``coherence``) are the ratio of the bucket's sums, as if the bucket were one
  position; the others the mean over the bucket's positions.

  Args:
    window: a ``PositionStats`` or a window file.
    edges: ``[nb + 1]`` increasing bucket edges from 0 to ``P``.
    drift: ``[P]`` drift of each row, or None.

  Returns:
    ``[nb]`` float64 per curve, NaN where a ratio is undefined.
  """
  starts = np.asarray(edges[:-1])
  widths = np.diff(edges).astype(np.float64)

  def total(values):
    return np.add.reduceat(np.asarray(values, np.float64), starts)

  count = np.asarray(window['count'], np.float64)
  out = {
      'count': total(count) / widths,
      'loss': _ratio(total(window['loss_sum']), total(window['loss_count'])),
  }
  if 'full_context_count' in window:
    full = total(window['full_context_count'])
    out['full_context_count'] = full / widths
    out['full_context_share'] = _ratio(full, total(count))
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


def check_directory(directory: str) -> None:
  """Refuses a directory that holds window files for a run starting there.

  A statistics object that was not restored (``PositionStatistics.restore``)
  starts its run at step 1: a window file already in ``directory`` belongs to
  another run, which its files would overwrite (the same steps) or mix with
  (``eval.py --analyze`` reads a directory as one run).

  Args:
    directory: where the window files go.

  Raises:
    ValueError: naming the directory, its files and the fix.
  """
  existing = outputs.window_files_in(directory)
  if not existing:
    return
  names = ', '.join(os.path.basename(path) for _, path in existing[:3])
  if len(existing) > 3:
    names += f' and {len(existing) - 3} more'
  raise ValueError(
      f'{directory} already holds statistics window files of another run'
      f' ({names}); a new PositionStatistics would overwrite or mix with'
      ' them. Pass a fresh directory=, or continue that run by restoring its'
      ' PositionStatistics.state() with PositionStatistics.restore().'
  )


def write_window(
    directory: str,
    step: int,
    first_step: int,
    window: Mapping[str, np.ndarray],
    cumulative_count: np.ndarray,
) -> str:
  """Writes ``DIRECTORY/window_STEP.npz`` whole or not at all.

  Args:
    directory: the statistics directory.
    step: the window's last step.
    first_step: its first step.
    window: host arrays of the window's fields (``PositionStats.to_numpy``).
    cumulative_count: ``[P]`` int64 tokens per position since step 0.

  Returns:
    The path written.
  """
  path = os.path.join(directory, outputs.WINDOW_FILE.format(step=step))
  window_file = {
      'step': np.int64(step),
      'first_step': np.int64(first_step),
      'num_steps': np.int64(step - first_step + 1),
      'cumulative_count': cumulative_count,
      **window,
  }
  return outputs.save_npz(path, window_file)


def report_window(
    writer: Any,
    step: int,
    first_step: int,
    window: Mapping[str, np.ndarray],
    edges: np.ndarray,
    *,
    drift: np.ndarray | None = None,
    curve_image: CurveImage | None = None,
) -> None:
  """Writes a window's curves: a scalar per position bucket and curve (NaN
  skipped), and with ``curve_image`` a line plot of each.

  Args:
    writer: anything with tensorboardX ``SummaryWriter``'s ``add_scalar`` and
      ``add_image``.
    step: the window's last step (the scalars' step).
    first_step: its first step (the images' title).
    window: host arrays of the window's fields.
    edges: ``[nb + 1]`` bucket edges from 0 to ``P``.
    drift: ``[P]`` drift of each row, or None.
    curve_image: ``(name, values [P], title) -> [H, W, 3]`` uint8, or None.
  """
  per_bucket = bucket_curves(window, edges, drift)
  for name, values in per_bucket.items():
    for start, end, value in zip(edges[:-1], edges[1:], values):
      if np.isfinite(value):
        tag = f'positions_{name}/{start:05d}-{end:05d}'
        writer.add_scalar(tag, float(value), step)
  if curve_image is None:
    return
  title = f'steps {first_step}-{step}'
  for name, values in window_curves(window, drift).items():
    writer.add_image(
        f'positions/{name}',
        curve_image(name, values, title),
        global_step=step,
        dataformats='HWC',
    )


def report_table(writer: Any, step: int, table: Any) -> None:
  """Writes the table's cosine similarity as image
  ``positions/cosine_similarity`` (red 1, white 0, blue -1; row 0 at the
  bottom).

  Args:
    writer: as `report_window`'s.
    step: the image's step.
    table: the ``[P, D]`` position table.
  """
  c = np.clip(analysis.cosine_similarity(table), -1.0, 1.0)[::-1]
  rgb = np.stack(
      [np.minimum(1 + c, 1), 1 - np.abs(c), np.minimum(1 - c, 1)], axis=-1
  )
  writer.add_image(
      'positions/cosine_similarity',
      (255 * rgb).astype(np.uint8),
      global_step=step,
      dataformats='HWC',
  )


def exposure_summary(window: Mapping[str, Any]) -> dict[str, Any]:
  """Exposure in two dimensions of a window or of sums over windows.

  Args:
    window: a mapping with ``count`` ``[P]`` and, when recorded,
      ``full_context_count`` ``[P]`` and ``context_count`` ``[P, K]``.

  Returns:
    ``tokens`` and its least and most exposed rows; with the context fields
    ``full_context_tokens`` (occurrences with context = position, the
    evaluation's situation), their ``full_context_share``, their least and
    most exposed rows and the last row's, and ``context_bucket_share`` (share
    of all occurrences per log2 context bucket, ``context_bucket_edges``).
    Empty without ``count``.
  """
  if 'count' not in window:
    return {}
  count = np.asarray(window['count'], np.float64)
  out: dict[str, Any] = {
      'tokens': float(count.sum()),
      'min_row_tokens': float(count.min()),
      'max_row_tokens': float(count.max()),
  }
  if 'full_context_count' not in window:
    return out
  full = np.asarray(window['full_context_count'], np.float64)
  by_context = np.asarray(window['context_count'], np.float64).sum(axis=0)
  num_buckets = len(by_context)
  out.update(
      full_context_tokens=float(full.sum()),
      full_context_share=float(_ratio(full.sum(), count.sum())),
      min_row_full_context=float(full.min()),
      max_row_full_context=float(full.max()),
      last_row_full_context=float(full[-1]),
      last_row_tokens=float(count[-1]),
      context_bucket_edges=[0] + [2**k for k in range(num_buckets)],
      context_bucket_share=(by_context / max(by_context.sum(), 1.0)).tolist(),
  )
  return out
