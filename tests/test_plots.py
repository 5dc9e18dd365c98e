"""Figures show what the console reports and hide no data behind legends or
labels."""

import numpy as np

from flax_posemb.plots import common
from flax_posemb.plots import evaluation as evaluation_plots
from flax_posemb.plots import tables as table_plots


def _rows(losses, edges=(0, 4, 8, 12), synth=False, half=0.3):
  """Bucket rows as results.json holds them: stderr 0.05 with a t interval of
  few documents (half-width 0.3, far from 1.96 * 0.05)."""
  out = []
  for (a, b), loss in zip(zip(edges[:-1], edges[1:]), losses):
    r = dict(
        start=a,
        end=b,
        loss=loss,
        stderr=0.05,
        ci95=[loss - half, loss + half],
        tokens=10,
        windows=10,
    )
    if synth:
      r.update(
          bayes_loss=1.0,
          filter_loss=2.0,
          excess_loss=loss - 1.0,
          recovered=2.0 - loss,
      )
    out.append(r)
  return out


def test_loss_by_position_legends_and_labels_sit_outside_the_axes():
  results = {'step': 1, 'buckets': _rows([1.5, 1.4, 1.6], synth=True)}
  per_position = {'position': np.arange(12), 'loss': np.ones(12)}
  fig = evaluation_plots.loss_by_position_figure(per_position, results)
  fig.canvas.draw()
  for ax in fig.axes:
    box = ax.get_window_extent()
    legend = ax.get_legend().get_window_extent()
    assert legend.x0 >= box.x1, 'a legend inside the axes can cover error bars'
    assert not ax.texts, 'text labels inside the axes can cover error bars'


def test_offset_probe_figure_plots_the_paired_difference_the_console_reports(
    monkeypatch,
):
  figs = []
  monkeypatch.setattr(
      common, 'save', lambda fig, path: figs.append(fig) or path
  )
  paired = [
      dict(start=a, end=b, diff=d, ci95=[d - 0.01, d + 0.01])
      for (a, b), d in zip(((0, 4), (4, 8), (8, 12)), (0.02, 0.0, 0.18))
  ]
  probe = {
      'by_offset': [
          dict(offset=0, buckets=_rows([1.5, 1.4, 1.6])),
          dict(offset=4, buckets=_rows([1.52, 1.4, 1.78])),
      ],
      'paired_vs_first': [dict(offset=4, minus_offset=0, buckets=paired)],
  }
  evaluation_plots.offset_probe(probe, 'unused.png')
  (fig,) = figs
  assert len(fig.axes) == 2
  ax = fig.axes[1]
  assert 'K - K0' in ax.get_ylabel()
  line = ax.get_lines()[0]
  np.testing.assert_allclose(line.get_ydata(), [0.02, 0.0, 0.18])


def _bar_half_widths(ax):
  """Half the length of each vertical error bar of the axes' first errorbar
  series."""
  segments = ax.containers[0].lines[2][0].get_segments()
  return [abs(seg[1][1] - seg[0][1]) / 2 for seg in segments]


def test_error_bars_are_the_t_intervals_the_results_carry_not_1_96_stderr(
    monkeypatch,
):
  figs = []
  monkeypatch.setattr(
      common, 'save', lambda fig, path: figs.append(fig) or path
  )
  results = {'step': 1, 'buckets': _rows([1.5, 1.4, 1.6], synth=True)}
  fig = evaluation_plots.loss_by_position_figure(
      {'position': np.arange(12), 'loss': np.ones(12)}, results
  )
  np.testing.assert_allclose(_bar_half_widths(fig.axes[0]), 0.3)
  # recovered = (filter - loss) / (filter - bayes) with filter - bayes = 1: the
  # same interval.
  np.testing.assert_allclose(_bar_half_widths(fig.axes[1]), 0.3)
  evaluation_plots.comparison(['a', 'b'], [results, results], 'unused.png')
  for ax in figs[-1].axes:
    np.testing.assert_allclose(_bar_half_widths(ax), 0.3)
  evaluation_plots.offset_probe(
      {'by_offset': [dict(offset=0, buckets=_rows([1.5, 1.4, 1.6]))]},
      'unused.png',
  )
  np.testing.assert_allclose(_bar_half_widths(figs[-1].axes[0]), 0.3)


def _table_figure(monkeypatch, **kwargs):
  figs = []
  monkeypatch.setattr(
      common, 'save', lambda fig, path: figs.append(fig) or path
  )
  norms = np.sqrt(8.0) + 1e-7 * np.sin(np.arange(16))  # float noise only
  table_plots.table_analysis(
      norms,
      pca_ratio=np.array([0.6, 0.4]),
      probe_edges=np.array([0, 8, 16]),
      probe_error=np.array([0.1, 0.1]),
      path='unused.png',
      **kwargs,
  )
  (fig,) = figs
  fig.canvas.draw()
  return fig


def test_table_figure_has_no_empty_drift_panel_without_an_initial_table(
    monkeypatch,
):
  fig = _table_figure(monkeypatch, drift=None)
  titles = [ax.get_title() for ax in fig.axes]
  assert len(fig.axes) == 3 and not any('drift' in t for t in titles)
  with_drift = _table_figure(monkeypatch, drift=np.linspace(0, 1, 16))
  assert 'drift from the initial table' in [
      ax.get_title() for ax in with_drift.axes
  ]


def test_equal_row_norms_draw_a_flat_line_from_zero_not_float_noise(
    monkeypatch,
):
  ax = _table_figure(monkeypatch, drift=None).axes[0]
  low, high = ax.get_ylim()
  # The top a little above the line, whatever the noise.
  assert low == 0.0 and 2.9 < high < 3.0
  assert ax.yaxis.get_offset_text().get_text() == ''


def test_position_curve_images_redraw_each_window_over_every_position():
  draw = evaluation_plots.PositionCurveImages()
  first = draw('count', np.arange(16.0), 'steps 1-5')
  second = draw('count', np.r_[np.full(8, np.nan), np.ones(8)], 'steps 6-10')
  assert first.shape == second.shape and first.dtype == np.uint8
  assert first.shape[2] == 3 and not np.array_equal(first, second)
  _, ax, _ = draw._figures['count']
  # NaN positions are a gap, not a shorter axis; the label names the window.
  assert ax.get_xlim() == (0.0, 15.0)
  assert ax.get_xlabel() == 'position (steps 6-10)'
  assert ax.get_ylim()[0] < 1.0 < ax.get_ylim()[1]


def test_the_data_exposure_figure_draws_full_context_tokens_beside_all(
    monkeypatch,
):
  """The exposure panel has both series the report prints: every token per
  position, and those whose context is their position."""
  figs = []
  monkeypatch.setattr(
      common, 'save', lambda fig, path: figs.append(fig) or path
  )
  report = {
      'source': 'local_text',
      'policy': 'packed_reset',
      'counts': [8, 6, 4, 2],
      'full_context_counts': [8, 3, 1, 0],
      'doc_lengths': [dict(bucket='1-4', token_share=1.0)],
  }
  table_plots.data_exposure(report, 'unused.png')
  (fig,) = figs
  lines = fig.axes[0].get_lines()
  assert [line.get_label() for line in lines] == [
      'all tokens',
      'context = position',
  ]
  np.testing.assert_array_equal(lines[1].get_ydata(), [8, 3, 1, 0])
