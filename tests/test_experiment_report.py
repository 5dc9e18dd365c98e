"""The experiments' REPORT.md and figures say what their numbers are: the
committed reports are what the code renders, the methodology is linked (not
copied), counts agree with their nouns, and every figure says what its
intervals are over."""

import json
import os
import re
import shutil

import numpy as np
import pytest

from conftest import ROOT
from flax_posemb import experiments
from flax_posemb import inference
from flax_posemb.experiments import aggregate
from flax_posemb.experiments import attribution
from flax_posemb.experiments import markdown
from flax_posemb.experiments import measures
from flax_posemb.experiments import spec
from flax_posemb.experiments import verdicts
from flax_posemb.plots import common
from flax_posemb.plots import experiments as experiment_plots

REPORTS = sorted(
    name
    for name in os.listdir(ROOT / 'docs' / 'experiments')
    if (ROOT / 'docs' / 'experiments' / name / 'summary.json').exists()
)


@pytest.mark.parametrize('name', REPORTS)
def test_committed_reports_read_as_the_code_renders_their_summary(name):
  report_dir = ROOT / 'docs' / 'experiments' / name
  summary = json.loads((report_dir / 'summary.json').read_text())
  text = (report_dir / 'REPORT.md').read_text()
  exp = spec.load(str(ROOT / 'configs' / 'experiments' / f'{name}.py'))
  figures = re.findall(r'!\[(.*?)\]\((.*?)\)', text)
  assert markdown.markdown(exp, summary, figures, str(report_dir)) == text


def test_reports_link_the_one_methodology_section_instead_of_copying_it():
  design = (ROOT / 'docs' / 'DESIGN.md').read_text()
  assert '\n## Intervals and verdicts\n' in design
  assert markdown.DESIGN == str(ROOT / 'docs' / 'DESIGN.md')
  link = markdown.methodology_link(str(ROOT / 'docs' / 'experiments' / 'x'))
  assert link.endswith('(../../DESIGN.md#intervals-and-verdicts)')
  for name in REPORTS:
    text = (ROOT / 'docs' / 'experiments' / name / 'REPORT.md').read_text()
    assert "Satterthwaite's degrees of freedom" not in text
    assert '../../DESIGN.md#intervals-and-verdicts' in text


def _claim(claim_id, mean, low, high, verdict):
  return {
      'id': claim_id,
      'text': claim_id,
      'metric': 'loss_late',
      'arm': 'a',
      'baseline': 'b',
      'direction': 'greater',
      'margin': 0.0,
      'interval': {'mean': mean, 'low': low, 'high': high, 'n': 3},
      'verdict': verdict,
      'verdict_holm': verdict,
      'p_value': 0.01,
      'p_holm': 0.01,
  }


@pytest.mark.parametrize(
    'tested, words', [(1, '1 claim tested'), (2, '2 claims tested')]
)
def test_the_claim_count_agrees_with_its_noun(tested, words):
  claims = [
      _claim(f'c{i}', 0.1, 0.05, 0.15, 'supported') for i in range(tested)
  ]
  summary = {
      'multiplicity': {'claims_tested': tested, 'verdicts_changed': 0},
      'claims': claims,
  }
  text = '\n'.join(markdown._claims_lines(summary))
  assert f'\n{words}. ' in text


@pytest.fixture
def drawn(monkeypatch):
  """The figures drawn, instead of saved."""
  figures = []
  monkeypatch.setattr(
      common, 'save', lambda fig, path: figures.append(fig) or path
  )
  return figures


def test_claims_figure_marks_an_unmeasured_claim_instead_of_an_empty_row(
    drawn,
):
  claims = [
      _claim('measured', 0.1, 0.05, 0.15, 'supported'),
      _claim('unmeasured', None, None, None, 'not measured'),
  ]
  experiment_plots.claims_forest('unused.png', claims)
  (fig,) = drawn
  (ax,) = fig.axes
  texts = [text.get_text() for text in ax.texts]
  assert texts == ['not measured']
  # On the unmeasured claim's row (the rows are drawn top to bottom).
  assert ax.texts[0].get_position()[1] == 0


def test_final_loss_figure_says_its_intervals_are_over_seeds_and_documents(
    drawn,
):
  over_documents = {
      'mean': 2.0,
      'low': 1.9,
      'high': 2.1,
      'n': 3,
      'method': inference.SEEDS_AND_DOCUMENTS,
  }
  over_seeds = dict(over_documents, method=inference.SEEDS)
  experiment_plots.experiment_metric_bars(
      'unused.png',
      {'windows': {'a': over_documents}, 'training': {'a': over_seeds}},
      ylabels={'windows': 'loss', 'training': 'loss'},
      n_seeds=3,
  )
  (fig,) = drawn
  titles = [ax.get_title() for ax in fig.axes]
  assert titles[0].endswith('(95% CI over n=3 seeds and the documents)')
  assert titles[1].endswith('(95% CI over n=3 seeds)')


# --- attribution by bucket, the late-rows rule, suite-wide Holm -------------


def _interval(mean, low, high):
  return {'mean': mean, 'low': low, 'high': high, 'n': 3}


def _contrast_claim(claim_id='late', verdict='supported'):
  return dict(
      _claim(claim_id, 0.02, 0.01, 0.03, verdict),
      metric='loss_late_minus_mid',
      arm='rare',
      baseline='control',
      interval_verdict=verdict,
  )


def _specs(*claim_ids, about_late_rows=True):
  return [
      spec.claim(
          claim_id,
          claim_id,
          'loss_late_minus_mid',
          'rare',
          'control',
          'greater',
          about_late_rows=about_late_rows,
      )
      for claim_id in claim_ids
  ]


EDGES = [[0, 8], [8, 16], [16, 24]]


def _differences(late):
  """`attribution.Differences` with the mid bucket moving and ``late``."""

  def differences_of(metric, arm, baseline):
    assert (metric, arm, baseline) == ('bucket_loss', 'rare', 'control')
    return [_interval(0.0, -0.1, 0.1), _interval(-0.02, -0.03, -0.01), late]

  return differences_of


def test_a_contrast_claim_lists_each_of_its_buckets_own_paired_difference():
  late = _interval(0.001, -0.004, 0.006)
  (claim,), _ = attribution.judge_claims(
      [_contrast_claim()], _specs('late'), EDGES, 1, _differences(late)
  )
  assert claim['buckets']['late'] == {
      'bucket': 2,
      'rows': [16, 24],
      'difference': late,
  }
  assert claim['buckets']['other']['bucket'] == 1
  assert claim['buckets']['other']['difference']['mean'] == -0.02
  text = '\n'.join(
      markdown._claims_lines({'claims': [claim], **_multiplicity()})
  )
  assert '16-24: 0.001 [-0.004, 0.006]' in text
  assert '8-16: -0.020 [-0.030, -0.010]' in text


def _multiplicity():
  return {'multiplicity': {'claims_tested': 1, 'verdicts_changed': 0}}


@pytest.mark.parametrize(
    'late, about_late_rows, expected',
    [
        # The contrast moved because mid improved; the late rows did not move.
        (_interval(0.001, -0.004, 0.006), True, verdicts.INCONCLUSIVE),
        (_interval(0.01, 0.004, 0.016), True, verdicts.SUPPORTED),
        # Not shown: not supported either.
        ({}, True, verdicts.INCONCLUSIVE),
        # A claim not declared about late rows keeps its interval's verdict.
        (_interval(0.001, -0.004, 0.006), False, verdicts.SUPPORTED),
    ],
)
def test_a_late_rows_claim_is_supported_only_if_the_late_bucket_moves(
    late, about_late_rows, expected
):
  specs = _specs('late', about_late_rows=about_late_rows)
  (claim,), multiplicity = attribution.judge_claims(
      [_contrast_claim()], specs, EDGES, 1, _differences(late)
  )
  assert claim['verdict'] == expected
  assert claim['interval_verdict'] == verdicts.SUPPORTED
  assert multiplicity['late_rule_changed'] == int(expected != 'supported')


def test_about_late_rows_needs_a_contrast_of_the_last_bucket():
  exp = spec.load(str(ROOT / 'configs' / 'experiments' / 'scale.py'))
  exp.claims = (
      spec.claim(
          'x', 'x', 'final_loss', exp.arms[0].name, '', 'less', 0.0, True
      ),
  )
  with pytest.raises(ValueError, match="claim 'x': about_late_rows needs"):
    spec.validate(exp)


def test_suite_holm_adjusts_over_every_claim_of_the_suite():
  def summary(p_values):
    claims = [
        dict(_claim(f'c{i}', 0.1, 0.05, 0.15, 'supported'), p_value=p)
        for i, p in enumerate(p_values)
    ]
    return {'claims': verdicts.with_holm(claims), 'multiplicity': {}}

  summaries = {'a': summary([0.02]), 'b': summary([0.01, 0.04])}
  verdicts.with_suite_holm(summaries, 'suite.py')
  (alone,) = summaries['a']['claims']
  # Alone it passes; among the suite's three claims it does not.
  assert alone['verdict_holm'] == verdicts.SUPPORTED
  assert alone['p_holm_suite'] == pytest.approx(0.04)
  b = summaries['b']['claims']
  assert [c['p_holm_suite'] for c in b] == pytest.approx([0.03, 0.04])
  record = summaries['b']['multiplicity']['suite']
  assert record == summaries['a']['multiplicity']['suite']
  assert record['claims_tested'] == 3 and record['experiments'] == ['a', 'b']
  summaries['a']['multiplicity'].update(claims_tested=1, verdicts_changed=0)
  text = '\n'.join(markdown._claims_lines(summaries['a']))
  assert 'Holm over all 3 tested claims of the suite `suite.py`' in text


def _dose(full_context):
  return {
      'name': 'long_text',
      'baseline': 'control',
      'arms': ['packed', 'crops/skew:0.01', 'crops/skew:0.003'],
      'late_exposure': [1600.0, 102.0, 44.0],
      'early_exposure': [1600.0, 6600.0, 8200.0],
      'rare_exposure': 100.0,
      'measures': {'loss_late': [_interval(0.0, -0.01, 0.01)] * 3},
      **full_context,
  }


def test_dose_table_shows_full_context_occurrences_and_both_rare_regimes():
  counted = _dose({'late_full_context_exposure': [1600.0, 90.0, 40.0]})
  lines = markdown._dose_lines({'analyses': {'doses': [counted]}})
  rows = [line for line in lines if line.startswith('| crops/skew')]
  # all occurrences, context = position, first bucket, rare (all), rare (cp)
  assert rows[0].startswith(
      '| crops/skew:0.01 | 102.0 | 90.0 | 6600.0 | no | yes |'
  )
  assert rows[1].startswith(
      '| crops/skew:0.003 | 44.0 | 40.0 | 8200.0 | yes | yes |'
  )
  # The baseline's own row: its late rows at full context, no difference.
  counted['baseline_exposure'] = dict(
      late=1500.0, late_full_context=170.0, early=1750.0
  )
  lines = markdown._dose_lines({'analyses': {'doses': [counted]}})
  (row,) = [line for line in lines if line.startswith('| control')]
  assert row == '| control (baseline) | 1500.0 | 170.0 | 1750.0 | no | no |  |'
  # A summary written before the count existed: n/a, not a guess.
  lines = markdown._dose_lines({'analyses': {'doses': [_dose({})]}})
  row = next(line for line in lines if line.startswith('| packed'))
  assert row.startswith('| packed | 1600.0 | n/a | 1600.0 | no | n/a |')


def test_full_context_exposure_sums_every_windows_count():
  def window(step, full_context):
    count = np.array([4, 4, 4])
    return {
        'step': step,
        'count': count,
        'cumulative_count': count * step,
        'full_context_count': np.array(full_context),
    }

  windows = [window(1, [4, 2, 0]), window(2, [4, 1, 1])]
  vectors = measures.position_vectors(windows, 2, {})
  np.testing.assert_array_equal(vectors['full_context_exposure'], [8, 3, 1])
  # A window missing (its counts do not add up to the cumulative count): the
  # sum would be short, so it is not reported.
  vectors = measures.position_vectors(windows[1:], 2, {})
  assert np.isnan(vectors['full_context_exposure']).all()
  del windows[0]['full_context_count']
  vectors = measures.position_vectors(windows, 2, {})
  assert np.isnan(vectors['full_context_exposure']).all()


def test_dose_figure_draws_arm_kinds_as_separate_series_without_empty_panels(
    drawn,
):
  panel = {
      'x': [1600.0, 102.0, 44.0, 1200.0],
      'arms': [
          'packed',
          'crops/skew:0.01',
          'crops/skew:0.003',
          'crops/natural',
      ],
      'baseline': 'control',
      'measures': {
          'loss_late': [_interval(0.01 * i, 0.0, 0.1) for i in range(4)]
      },
  }
  unprobed = dict(panel, measures={'loss_late': panel['measures']['loss_late']})
  probed = dict(
      panel,
      measures={
          **panel['measures'],
          'offset_penalty': [_interval(0.01, 0.0, 0.02)] * 4,
      },
  )
  experiment_plots.dose_response(
      'unused.png',
      {'a': probed, 'b': unprobed},
      ylabels={'loss_late': 'late', 'offset_penalty': 'offset', 'never': 'n'},
  )
  (fig,) = drawn
  # 'never' has no data anywhere: no column; b has no offset penalty: its
  # panel is left blank with a note.
  assert len(fig.axes) == 4
  blank = fig.axes[3]
  assert not blank.axison
  assert 'not measured' in blank.texts[0].get_text()
  legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
  assert legend == ['packed', 'crops/skew', 'crops/natural']
  # One line per kind: only the two skew doses are joined.
  doses = set(panel['x'])
  joined = [
      line
      for line in fig.axes[0].lines
      if line.get_linestyle() == '-' and set(line.get_xdata()) <= doses
  ]
  assert [sorted(line.get_xdata()) for line in joined] == [[44.0, 102.0]]


def test_every_report_has_the_per_bucket_profile_of_its_arms():
  arm = {
      'seeds': [0, 1],
      'vectors': {'bucket_loss': [_interval(2.0, 1.9, 2.1)]},
  }
  summary = {
      'buckets': [[0, 8]],
      'arms': {'control': arm, 'rare': arm, 'unfinished': {'seeds': []}},
      'attribution': [
          {'arm': 'rare', 'baseline': 'control', 'differences': []}
      ],
  }
  text = '\n'.join(markdown._profile_lines(summary))
  assert '| control | 2.000 [1.900, 2.100] |' in text
  assert 'unfinished' not in text
  assert '| rare - control | n/a |' in text


def test_rerendered_summary_takes_bucket_differences_from_its_profiles():
  late = _interval(0.01, 0.004, 0.016)
  summary = {
      'buckets': EDGES,
      'mid_bucket': 1,
      'claims': [_contrast_claim()],
      'analyses': {},
      'profiles': [
          {
              'metric': 'bucket_loss',
              'baseline': 'control',
              'differences': {'rare': [{}, {}, late]},
          }
      ],
  }
  exp = spec.load(str(ROOT / 'configs' / 'experiments' / 'scale.py'))
  exp.claims = tuple(_specs('late'))
  attribution.attribute(summary, exp, attribution.from_profiles(summary))
  (claim,) = summary['claims']
  assert claim['buckets']['late']['difference'] == late
  assert claim['verdict'] == verdicts.SUPPORTED
  assert summary['attribution'][0]['differences'][2] == late


def test_dose_series_reads_full_context_occurrences_of_the_late_rows():
  def run(full_context=None):
    vectors = {'bucket_exposure': [900.0, 50.0]}
    if full_context is not None:
      vectors['bucket_full_context_exposure'] = full_context
    return {'scalars': {}, 'vectors': vectors, 'buckets': [[0, 8], [8, 16]]}

  exp = spec.new('e', 'title', 'question')
  by_arm = {
      'control': {0: run([900.0, 40.0])},
      'counted': {0: run([900.0, 30.0]), 1: run([900.0, 20.0])},
      'uncounted': {0: run()},
  }
  judge = aggregate._Judge(exp, by_arm, {}, quick=False)
  dose = judge.dose(spec.dose('d', ['counted', 'uncounted'], 'control'))
  assert dose['late_exposure'] == [50.0, 50.0]
  assert dose['late_full_context_exposure'][0] == 25.0
  assert np.isnan(dose['late_full_context_exposure'][1])
  assert dose['baseline_exposure'] == dict(
      late=50.0, late_full_context=40.0, early=900.0
  )


def test_rerendering_the_committed_suites_leaves_their_summaries_as_committed(
    tmp_path,
):
  """The committed reports are current: rendering them again from their own
  summaries (--rerender) changes nothing, the suite-wide Holm included."""
  committed = ROOT / 'docs' / 'experiments'
  shutil.copytree(committed, tmp_path, dirs_exist_ok=True)
  for suite in ('all.py', 'doses.py'):
    experiments.rerender_suite(
        [str(ROOT / 'configs' / 'experiments' / suite)], str(tmp_path)
    )
  for name in REPORTS:
    again = json.loads((tmp_path / name / 'summary.json').read_text())
    assert again == json.loads((committed / name / 'summary.json').read_text())
  assert (tmp_path / 'README.md').read_text() == (
      committed / 'README.md'
  ).read_text()


def test_rerendering_where_no_sweep_wrote_a_report_names_the_fix(tmp_path):
  with pytest.raises(FileNotFoundError, match='pass the --report_dir'):
    experiments.rerender_suite(
        [str(ROOT / 'configs' / 'experiments' / 'scale.py')], str(tmp_path)
    )


def test_one_experiment_rendered_alone_has_no_stale_suite_holm(tmp_path):
  shutil.copytree(ROOT / 'docs' / 'experiments' / 'scale', tmp_path / 'scale')
  experiments.rerender_suite(
      [str(ROOT / 'configs' / 'experiments' / 'scale.py')],
      str(tmp_path / 'scale'),
  )
  summary = json.loads((tmp_path / 'scale' / 'summary.json').read_text())
  assert 'suite' not in summary['multiplicity']
  assert all('p_holm_suite' not in claim for claim in summary['claims'])
  text = (tmp_path / 'scale' / 'REPORT.md').read_text()
  assert 'Suite-wide Holm: n/a' in text


def test_a_pipe_inside_a_cell_does_not_split_the_table_row():
  """An equivalence claim's predicted cell, |d| < m, stays one cell."""
  header, row = markdown.md_table(
      ['claim', 'predicted'], [['a', '|d| < 0.02']]
  )[::2]
  cells = re.split(r'(?<!\\)\|', row)[1:-1]
  assert len(cells) == len(re.split(r'(?<!\\)\|', header)[1:-1]) == 2
  assert cells[1].strip() == r'\|d\| < 0.02'


def test_the_index_marks_a_suite_stale_when_a_member_was_rendered_alone(
    tmp_path,
):
  """One experiment of a suite run again alone: the index says the suite's
  Holm is out of date instead of failing on the verdicts the member lacks."""
  committed = ROOT / 'docs' / 'experiments'
  for name in ('long_text_doses', 'scale'):
    shutil.copytree(committed / name, tmp_path / name)
  experiments.rerender_suite(
      [str(ROOT / 'configs' / 'experiments' / 'doses.py')], str(tmp_path)
  )
  experiments.rerender_suite(
      [str(ROOT / 'configs' / 'experiments' / 'long_text_doses.py')],
      str(tmp_path / 'long_text_doses'),
  )
  summaries = {
      name: json.loads((tmp_path / name / 'summary.json').read_text())
      for name in ('long_text_doses', 'scale')
  }
  experiments.write_index({}, str(tmp_path), '')
  index = (tmp_path / 'README.md').read_text()
  assert 'suite-wide Holm is out of date (long_text_doses rendered' in index
  assert 'suite' in summaries['scale']['multiplicity']
