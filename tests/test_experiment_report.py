"""The experiments' REPORT.md and figures say what their numbers are: the
committed reports are what the code renders, the methodology is linked (not
copied), counts agree with their nouns, and every figure says what its
intervals are over."""

import json
import os
import re

import pytest

from conftest import ROOT
from flax_posemb import inference
from flax_posemb.experiments import markdown
from flax_posemb.experiments import spec
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
