"""What the figures share: saving, columns of result rows, arm styles."""

from collections.abc import Sequence
import os
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

MARKERS = ('o', 's', '^', 'D', 'v', 'P', 'X', '*', '<', '>')
LINESTYLES = ('-', '--', ':', '-.')


def save(fig, path: str) -> str:
  """Writes ``fig`` to ``path`` (a PNG; its directory made) and closes it.

  Args:
    fig: a matplotlib figure.
    path: where to write it.

  Returns:
    ``path``.
  """
  os.makedirs(os.path.dirname(path) or '.', exist_ok=True)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path


def column(rows: Sequence[dict[str, Any]], key: str) -> np.ndarray:
  """One field of result rows as floats.

  Args:
    rows: result rows (bucket rows, interval records).
    key: the field.

  Returns:
    float64 ``[len(rows)]``, NaN where the field is None or missing.
  """
  return np.array(
      [np.nan if r.get(key) is None else r[key] for r in rows], np.float64
  )


def arm_styles(names: Sequence[str]) -> dict[str, dict[str, Any]]:
  """One colour, marker and line style per arm."""
  cycle = plt.rcParams['axes.prop_cycle'].by_key()['color']
  return {
      n: {
          'color': cycle[i % len(cycle)],
          'marker': MARKERS[i % len(MARKERS)],
          'ls': LINESTYLES[i % len(LINESTYLES)],
      }
      for i, n in enumerate(names)
  }


def errorbars(
    ax,
    x: np.ndarray,
    intervals: Sequence[dict[str, Any]],
    style: dict[str, Any],
    label: str,
) -> Any:
  """Draws intervals as error bars (none where a bound is undefined).

  Args:
    ax: the axes.
    x: ``[n]`` x positions.
    intervals: ``n`` records with ``mean``, ``low`` and ``high``.
    style: the series' matplotlib style (`arm_styles`).
    label: the legend label.

  Returns:
    The errorbar container (a legend handle).
  """
  mean = column(intervals, 'mean')
  low = column(intervals, 'low')
  high = column(intervals, 'high')
  err = np.stack([mean - low, high - mean])
  return ax.errorbar(
      x,
      mean,
      yerr=np.where(np.isfinite(err), err, 0.0),
      ms=4,
      capsize=2,
      lw=1.2,
      elinewidth=0.9,
      label=label,
      **style,
  )
