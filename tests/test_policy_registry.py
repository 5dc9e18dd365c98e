"""A position policy added from outside the package: one class, registered,
is checked by the data config, makes resumable rows, has its exposure in the
data report and trains a run (docs/data.md, "Adding a position policy")."""

import json

import numpy as np
import pytest

from conftest import tiny_config
from flax_posemb import config as config_lib
from flax_posemb import data
from flax_posemb import training
from flax_posemb.data import policies
from flax_posemb.data import report
from flax_posemb.data import rows as rows_lib
from flax_posemb.data import sources


@policies.register
class RightAligned(policies.Policy):
  """natural's rows placed to end at position T - 1: the late positions are
  trained by every document, the early ones by long documents only."""

  name = 'test_right_aligned'

  def check(self, data_config: data.DataConfig) -> None:
    if data_config.source != 'synthetic':
      raise ValueError(
          "data.position_policy='test_right_aligned' generates synthetic"
          " documents for their position ids; set data.source='synthetic'."
      )

  def rows(self, data_config, setup):
    seq_len = data_config.seq_len
    src = setup.src
    assert isinstance(src, sources.SyntheticSource)

    def right_aligned(doc: int, row_index: int):
      del row_index
      start = seq_len - min(src.num_pairs(doc), seq_len)
      return src.doc(doc, start=start, max_pairs=seq_len), start

    return rows_lib.document_rows(
        setup, right_aligned, seq_len, data_config.min_doc_len
    )

  def exposure(self, data_config, corpus):
    # natural's counts, mirrored.
    counts = corpus.first_rows()[::-1]
    return policies.exposure.exposure(corpus.used(data_config.seq_len), counts)


def _config(**data_fields):
  """The tests' tiny run with the toy policy (a ConfigDict, as users write
  it)."""
  config = tiny_config()
  config.data.position_policy = RightAligned.name
  config.data.prefetch = 0
  for key, value in data_fields.items():
    setattr(config.data, key, value)
  return config


def test_a_registered_policy_is_a_valid_data_position_policy():
  assert RightAligned.name in policies.names()
  assert isinstance(policies.get(RightAligned.name), RightAligned)
  typed = config_lib.RunConfig.from_config_dict(_config())
  assert typed.data.policy is policies.get(RightAligned.name)


def test_the_data_config_runs_the_policys_own_check():
  with pytest.raises(ValueError, match="set data.source='synthetic'"):
    data.DataConfig(position_policy=RightAligned.name, source='stdlib')


def test_a_taken_name_is_refused():
  class Again(RightAligned):
    name = RightAligned.name

  with pytest.raises(ValueError, match='registered already'):
    policies.register(Again)


def test_its_rows_end_at_the_last_position_and_resume_exactly():
  typed = config_lib.RunConfig.from_config_dict(_config())
  t = typed.data.seq_len

  def make():
    return data.make_train_iterator(
        typed.data, batch_size=4, seed=0, num_train_steps=10
    )

  it = make()
  first = [next(it) for _ in range(2)]
  for batch in first:
    assert np.all(batch['positions'].max(axis=1) == t - 1)
  state = json.loads(json.dumps(it.get_state()))
  expected = [next(it) for _ in range(3)]
  resumed = make()
  resumed.set_state(state)
  for want in expected:
    got = next(resumed)
    for key in want:
      np.testing.assert_array_equal(want[key], got[key])


def test_it_trains_a_run_and_has_its_exposure_report(tmp_path):
  config = _config()
  config.num_train_steps = 4
  config.log_every_steps = 2
  config.eval_every_steps = 4
  config.checkpoint_every_steps = 4
  result = training.train_and_evaluate(config, str(tmp_path / 'run'))
  assert result['step'] == 4 and np.isfinite(result['loss'])
  assert result['eval'] is not None

  typed = config_lib.RunConfig.from_config_dict(config)
  rep = report.exposure(typed, num_batches=3, num_source_docs=50)
  t = typed.data.seq_len
  assert rep['policy'] == RightAligned.name
  # Every row ends at position T - 1: it counts every row, and each earlier
  # position the rows long enough to reach back to it.
  assert rep['counts'][-1] == 3 * typed.batch_size
  assert np.all(np.diff(rep['counts']) >= 0)
  # Its analytic model: natural's tokens, late positions trained most (the
  # first tenth may see no document at all: no ratio then).
  mine = rep['policies'][RightAligned.name]
  assert mine['token_share'] == rep['policies']['natural']['token_share']
  assert mine['last_over_first'] is None or mine['last_over_first'] > 1
  assert rep['token_share'] == mine['token_share']
  text = report.format_report(rep)
  assert f'* {RightAligned.name}' in text
  assert len(rep['counts']) == t
