"""Exposure report: the library dict and its command,
`python -m flax_posemb.commands.data_report`."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from configs import tiny
from flax_posemb import config as config_lib
from flax_posemb.data import report

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_exposure_counts_real_tokens_per_position():
  cfg = tiny.get_config()
  cfg.data.prefetch = 0
  cfg = config_lib.RunConfig.from_config_dict(cfg)
  rep = report.exposure(cfg, num_batches=5, num_source_docs=100)
  assert len(rep['counts']) == cfg.data.seq_len and len(rep['deciles']) == 10
  assert rep['real_tokens'] == sum(rep['counts']) > 0
  assert rep['token_slots'] == 5 * cfg.batch_size * cfg.data.seq_len
  assert sum(h['docs'] for h in rep['doc_lengths']) == 100
  np.testing.assert_allclose(
      sum(h['token_share'] for h in rep['segment_lengths']), 1.0
  )
  assert 'padding' in report.format_report(rep)


def test_exposure_of_packed_has_no_padding():
  cfg = tiny.get_config()
  cfg.data.position_policy = 'packed'
  cfg = config_lib.RunConfig.from_config_dict(cfg)
  rep = report.exposure(cfg, num_batches=2, num_source_docs=10)
  assert rep['padding_fraction'] == 0.0 and rep['last_over_first'] == 1.0


def test_cli_prints_and_writes_json_and_png(tmp_path):
  js, png = tmp_path / 'e.json', tmp_path / 'e.png'
  env = dict(os.environ, JAX_PLATFORMS='cpu')
  out = subprocess.run(
      [
          sys.executable,
          '-m',
          'flax_posemb.commands.data_report',
          '--config',
          'configs/tiny.py',
          '--num_batches',
          '3',
          '--json',
          str(js),
          '--png',
          str(png),
          '--config.data.position_policy=packed_reset',
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert out.returncode == 0, out.stderr[-2000:]
  assert 'policy=packed_reset' in out.stdout and 'decile' in out.stdout
  assert json.loads(js.read_text())['policy'] == 'packed_reset'
  assert png.stat().st_size > 1000


def test_policy_shares_count_what_window_policies_drop():
  cfg = tiny.get_config()
  t = cfg.data.seq_len
  cfg.data.schedule_seq_len, cfg.data.schedule_fraction = t // 4, 0.5
  data = config_lib.RunConfig.from_config_dict(cfg).data
  shares = report.policy_shares(np.array([10 * t, t // 2]), data)
  for p in ('packed', 'packed_reset', 'natural_chunked'):
    assert shares[p]['token_share'] == 1.0
  np.testing.assert_allclose(shares['natural']['token_share'], 1.5 / 10.5)
  np.testing.assert_allclose(shares['random_offset']['token_share'], 1.5 / 10.5)
  np.testing.assert_allclose(
      shares['length_schedule']['token_share'],
      0.5 * 0.5 / 10.5 + 0.5 * 1.5 / 10.5,
  )
  assert shares['packed']['last_over_first'] == 1.0
  # 1 of 2 docs.
  np.testing.assert_allclose(shares['natural']['last_over_first'], 0.5)
  # Wrapped at T: the 10T document fills every position 10 times, the short one
  # the first half.
  np.testing.assert_allclose(
      shares['natural_chunked']['last_over_first'], 10 / 11
  )
  st = report.length_stats(np.array([10 * t, t // 2]), t)
  assert st['docs_longer_than_context'] == 0.5 and st['max'] == 10 * t


def _long_text_arm(policy: str, shuffle_rows: int | None = None):
  """The long_text experiment's training config of `policy`, 4 rows per step
  (its packed budget: 2048 scored bytes)."""
  from flax_posemb.experiments import spec

  exp = spec.load(
      os.path.join(
          os.path.dirname(__file__),
          '..',
          'configs',
          'experiments',
          'long_text.py',
      )
  )
  run = next(r for r in spec.expand(exp) if r.arm == 'packed_reset')
  overrides = [('batch_size', 4), ('data.position_policy', policy)]
  if shuffle_rows is not None:
    overrides.append(('data.shuffle_rows', shuffle_rows))
  config = spec.apply_overrides(run.config, overrides)
  return config_lib.RunConfig.from_config_dict(config)


def test_long_text_streaming_batches_mix_documents_like_a_random_draw():
  for policy in ('packed', 'packed_reset', 'natural_chunked', 'crops'):
    rep = report.exposure(
        _long_text_arm(policy), num_batches=200, num_source_docs=0
    )
    div = rep['batch_diversity']
    # What the batches train on, beside what the deep windows score.
    assert sum(rep['kind_mix'].values()) == pytest.approx(1.0)
    assert rep['eval_kind_mix']['code'] < 0.2 < rep['kind_mix']['code']
    assert div['all_one_doc'] <= div['random_all_one_doc'] + 0.01, (policy, div)
    assert div['same_doc_pairs'] < 3 * div['random_same_doc_pairs'], (
        policy,
        div,
    )


def test_long_text_packed_rows_in_stream_order_fill_batches_from_one_document():
  div = report.exposure(
      _long_text_arm('packed', shuffle_rows=0),
      num_batches=50,
      num_source_docs=0,
  )['batch_diversity']
  assert div['all_one_doc'] > 0.3 and div['same_doc_pairs'] > 0.3, div
  assert div['random_all_one_doc'] < 0.01


def _brute_force_contexts(segment_ids):
  """Each token's context, walking back through its segment one column at a
  time."""
  contexts = np.zeros_like(segment_ids)
  for r, row in enumerate(segment_ids):
    for t in range(len(row)):
      k = t
      while k > 0 and row[k - 1] == row[t]:
        k -= 1
      contexts[r, t] = t - k
  return contexts


def test_full_context_counts_equal_a_brute_force_count_on_packed_reset():
  from flax_posemb import data

  cfg = tiny.get_config()
  cfg.data.position_policy = 'packed_reset'
  cfg.data.prefetch = 0
  cfg.data.seq_len = 32
  cfg = config_lib.RunConfig.from_config_dict(cfg)
  rep = report.exposure(cfg, num_batches=3, num_source_docs=10)
  it = data.make_train_iterator(
      cfg.data,
      batch_size=cfg.batch_size,
      seed=cfg.seed,
      num_train_steps=cfg.num_train_steps,
      max_len=cfg.model.max_len,
  )
  expected = np.zeros(len(rep['counts']), np.int64)
  context_sums = np.zeros(len(rep['counts']), np.int64)
  for _ in range(3):
    batch = next(it)
    contexts = _brute_force_contexts(batch['segment_ids'])
    real = batch['segment_ids'] > 0
    full = real & (contexts == batch['positions'])
    np.add.at(expected, batch['positions'][full], 1)
    np.add.at(context_sums, batch['positions'][real], contexts[real])
  assert 0 < expected.sum() < sum(rep['counts'])
  np.testing.assert_array_equal(rep['full_context_counts'], expected)
  first = rep['buckets'][0]
  assert first['bucket'] == '[0,16)'
  assert first['mean_context'] == pytest.approx(
      context_sums[:16].sum() / np.sum(rep['counts'][:16])
  )


def test_the_report_states_the_rare_regime_on_all_and_full_context_rows():
  cfg = tiny.get_config()
  cfg.data.prefetch = 0
  cfg.data.position_policy = 'crops'
  cfg.data.crop_lengths = 'skew:0.01'
  # A run of the report's 20 batches: the last rows are seen ~20 times.
  cfg.num_train_steps = 20
  arm = config_lib.RunConfig.from_config_dict(cfg)
  cfg.data.offset_twin = True
  twin = config_lib.RunConfig.from_config_dict(cfg)
  arm_report = report.exposure(arm, num_batches=20, num_source_docs=10)
  twin_report = report.exposure(twin, num_batches=20, num_source_docs=10)
  assert arm_report['rare_regime'] == {'all': True, 'full_context': True}
  # The twin's late rows are trained as often as its first ones, at every
  # context and at context = position.
  assert twin_report['rare_regime'] == {'all': False, 'full_context': False}
  first, last = twin_report['buckets'][0], twin_report['buckets'][-1]
  assert last['run_occurrences'] > 0.9 * first['run_occurrences']
  assert last['run_occurrences'] == last['occurrences']
  assert twin_report['policies']['crops']['last_over_first'] == 1.0
  text = report.format_report(twin_report)
  assert 'rare regime over the run' in text and 'context = position' in text


@pytest.mark.parametrize(
    'overrides, message',
    [
        (
            [
                '--config.data.position_policy=length_schedule',
                '--config.data.offset_twin=True',
            ],
            'data.offset_twin',
        ),
        (
            [
                '--config.data.position_policy=random_offset',
                '--config.data.shared_stream=True',
            ],
            'cannot recut the shared stream',
        ),
    ],
)
def test_cli_refuses_a_twin_or_shared_stream_it_cannot_honour(
    overrides, message
):
  out = subprocess.run(
      [
          sys.executable,
          '-m',
          'flax_posemb.commands.data_report',
          '--config',
          'configs/tiny.py',
          *overrides,
      ],
      cwd=ROOT,
      env=dict(os.environ, JAX_PLATFORMS='cpu'),
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert out.returncode == 2
  assert message in out.stderr and 'Traceback' not in out.stderr
