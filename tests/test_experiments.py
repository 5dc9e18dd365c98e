"""Tests of the experiments runner: paired statistics, grid, budget, measures,
--quick."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import scipy.stats

from conftest import ROOT
from flax_posemb import inference
from flax_posemb import preemption
from flax_posemb.experiments import measures
from flax_posemb.experiments import spec
from flax_posemb.experiments import sweep
from flax_posemb.experiments import verdicts

CONFIGS = ('init_comparison', 'exposure', 'init_x_exposure')


def _load(name: str, scale: str = 'cpu'):
  return spec.load(os.path.join('configs', 'experiments', f'{name}.py:{scale}'))


# --- paired statistics and the verdict rule
# ---------------------------------------------------


# (sample, level) -> (low, high) of the hand-written Student-t interval that
# scipy replaced (mean +- t.ppf(0.5 + level / 2, n - 1) * std(ddof=1) /
# sqrt(n)), computed before the switch.
OLD_T_INTERVALS = [
    (
        [0.3, -0.1, 0.5, 0.2, 0.4],
        0.95,
        (-0.025852519098702342, 0.5458525190987022),
    ),
    (
        [0.3, -0.1, 0.5, 0.2, 0.4],
        0.9,
        (0.04051293970729067, 0.47948706029270927),
    ),
    ([1.0, 3.0], 0.95, (-10.706204736174694, 14.706204736174694)),
    ([1.0, 3.0], 0.9, (-4.313751514675037, 8.313751514675037)),
    (
        [1.0, float('nan'), 3.0, 2.5],
        0.95,
        (-0.4189058396044647, 4.752239172937798),
    ),
    (
        [1.0, float('nan'), 3.0, 2.5],
        0.9,
        (0.411973711069862, 3.921359622263471),
    ),
]


@pytest.mark.parametrize('sample, level, expected', OLD_T_INTERVALS)
def test_scipy_t_interval_equals_the_former_hand_written_one(
    sample, level, expected
):
  iv = inference.t_interval(sample, level)
  np.testing.assert_allclose((iv.low, iv.high), expected, rtol=0, atol=1e-12)


def test_committed_reports_recompute_to_the_same_intervals_and_verdicts():
  """Every claim of docs/experiments/*/summary.json, recomputed: intervals over
  seeds from its stored per-seed differences, intervals over seeds and
  documents from its stored stderr and degrees of freedom (to 1e-12), the same
  verdict of its interval and, after the late-rows rule, the same verdict."""
  paths = sorted((ROOT / 'docs' / 'experiments').glob('*/summary.json'))
  claims = [c for p in paths for c in json.loads(p.read_text())['claims']]
  if not claims:
    pytest.skip('no committed experiment reports')
  for c in claims:
    stored = {k: np.nan if v is None else v for k, v in c['interval'].items()}
    if stored.get('method') == inference.SEEDS_AND_DOCUMENTS:
      q = scipy.stats.t.ppf(0.975, stored['df'])
      mean, se = stored['mean'], stored['stderr']
      iv = inference.Interval(
          mean, mean - q * se, mean + q * se, stored['n'], se
      )
    else:
      d = [np.nan if x is None else x for x in c['differences']]
      iv = inference.t_interval(d)
    np.testing.assert_allclose(
        [iv.mean, iv.low, iv.high],
        [stored['mean'], stored['low'], stored['high']],
        rtol=0,
        atol=1e-12,
    )
    if c['verdict'] != verdicts.NOT_MEASURED:
      own = verdicts.verdict(iv, c['direction'], c['margin'])
      assert own == c['interval_verdict'], c['id']
      # The late-rows rule, on the claim's own verdict and late bucket.
      ruled = verdicts.late_rows_rule(dict(c, verdict=own))
      assert ruled == c['verdict'], c['id']


def test_identical_values_give_a_point_interval():
  iv = inference.t_interval([1.0, 1.0, 1.0])
  assert (iv.low, iv.high, iv.stderr) == (1.0, 1.0, 0.0)


@pytest.mark.parametrize(
    'direction, margin', [('greater', 0.0), ('less', 0.0), ('equivalent', 0.3)]
)
def test_decision_p_value_is_below_alpha_exactly_when_the_interval_is_decisive(
    direction, margin
):
  rng = np.random.default_rng(0)
  for _ in range(300):
    d = rng.normal(
        rng.normal(scale=0.5), rng.uniform(0.05, 1.0), size=rng.integers(2, 8)
    )
    p = inference.decision_p_value(d, direction, margin)
    for level in (0.8, 0.95, 0.99):
      decisive = (
          verdicts.verdict(inference.t_interval(d, level), direction, margin)
          != verdicts.INCONCLUSIVE
      )
      assert decisive == (p < 1 - level), (d, p, level)


def test_holm_adjusts_the_sorted_p_values_and_keeps_their_order():
  np.testing.assert_allclose(
      inference.holm([0.01, 0.04, 0.03, 0.5]), [0.04, 0.09, 0.09, 0.5]
  )
  assert inference.holm([]).size == 0


def test_holm_turns_a_marginal_verdict_inconclusive_and_keeps_the_primary_one():
  strong = verdicts.judge(
      {s: 1.0 + 0.01 * s for s in range(5)},
      dict.fromkeys(range(5), 0.0),
      'greater',
  )
  marginal = verdicts.judge(
      {0: 0.05, 1: 0.3, 2: 0.2, 3: 0.45, 4: 0.1},
      dict.fromkeys(range(5), 0.0),
      'greater',
  )
  assert (
      marginal['verdict'] == verdicts.SUPPORTED
      and 0.01 < marginal['p_value'] < 0.05
  )
  out = verdicts.with_holm([strong, marginal, marginal])
  # Primary verdicts kept.
  assert [j['verdict'] for j in out] == [verdicts.SUPPORTED] * 3
  assert out[0]['verdict_holm'] == verdicts.SUPPORTED
  assert (
      out[1]['verdict_holm'] == out[2]['verdict_holm'] == verdicts.INCONCLUSIVE
  )
  assert out[1]['p_holm'] == pytest.approx(2 * marginal['p_value'])


def test_t_interval_ignores_nan_and_is_undefined_below_two_values():
  iv = inference.t_interval([1.0, float('nan'), 3.0])
  assert iv.n == 2 and iv.mean == pytest.approx(2.0)
  single = inference.t_interval([1.0])
  assert single.n == 1 and math.isnan(single.low)
  assert verdicts.verdict(single, 'greater') == verdicts.INCONCLUSIVE


def test_paired_differences_use_only_shared_seeds_in_order():
  j = verdicts.judge(
      {0: 1.0, 1: 2.0, 3: 5.0}, {1: 1.5, 0: 0.0, 2: 9.0}, 'greater'
  )
  assert j['seeds'] == [0, 1]
  np.testing.assert_allclose(j['differences'], [1.0, 0.5])


@pytest.mark.parametrize(
    'low,high,direction,margin,expected',
    [
        (0.1, 0.3, 'greater', 0.0, verdicts.SUPPORTED),
        (-0.3, -0.1, 'greater', 0.0, verdicts.CONTRADICTED),
        (-0.1, 0.3, 'greater', 0.0, verdicts.INCONCLUSIVE),
        (-0.3, -0.1, 'less', 0.0, verdicts.SUPPORTED),
        (0.1, 0.3, 'less', 0.0, verdicts.CONTRADICTED),
        (-0.01, 0.01, 'equivalent', 0.02, verdicts.SUPPORTED),
        (0.03, 0.05, 'equivalent', 0.02, verdicts.CONTRADICTED),
        (-0.01, 0.05, 'equivalent', 0.02, verdicts.INCONCLUSIVE),
    ],
)
def test_verdict_rule_supports_contradicts_or_leaves_inconclusive(
    low, high, direction, margin, expected
):
  iv = inference.Interval((low + high) / 2, low, high, 5, 0.1)
  assert verdicts.verdict(iv, direction, margin) == expected


def test_experiment_validation_rejects_bad_direction_and_missing_margin():
  """The verdict rule is checked once, when the experiment config is loaded."""
  exp = _load('init_comparison')
  exp.claims = (
      spec.claim('a', 'a', 'final_loss', 'zeros', 'gpt2', 'bigger'),
      spec.claim('b', 'b', 'final_loss', 'zeros', 'gpt2', 'equivalent', 0.0),
  )
  with pytest.raises(
      ValueError, match=r"claim 'a': direction 'bigger'.*claim 'b'.*margin > 0"
  ):
    spec.validate(exp)


# --- experiment configs and the paired grid
# ---------------------------------------------------


@pytest.mark.parametrize('name', CONFIGS)
def test_grid_is_paired_across_arms(name):
  exp = _load(name)
  runs = spec.expand(exp)
  arms = [a.name for a in exp.arms]
  assert len(exp.seeds) >= 5
  assert len(runs) == len(arms) * len(exp.seeds)
  by_seed = {}
  for r in runs:
    assert r.config.seed == r.seed
    by_seed.setdefault(r.seed, []).append(r.arm)
  assert all(sorted(v) == sorted(arms) for v in by_seed.values())
  # No two runs are the same computation.
  assert len({r.key for r in runs}) == len(runs)
  # Within a seed, two arms differ only in the keys their overrides name.
  a, b = runs[0], runs[1]

  def flat(d, prefix=''):
    out = {}
    for k, v in d.items():
      out.update(
          flat(v, f'{prefix}{k}.')
          if isinstance(v, dict)
          else {f'{prefix}{k}': v}
      )
    return out

  fa, fb = flat(a.config.to_dict()), flat(b.config.to_dict())
  differing = {k for k in fa if fa[k] != fb[k]}
  named = {k for arm_cfg in exp.arms[:2] for k, _ in arm_cfg.overrides}
  assert differing <= named


def test_accelerator_scale_uses_gpt2_small_shapes():
  run = spec.expand(_load('init_comparison', 'accelerator'))[0]
  m = run.config.model
  assert (m.num_layers, m.num_heads, m.emb_dim, m.max_len) == (
      12,
      12,
      768,
      1024,
  )


def test_same_as_token_is_distinct_from_gpt2_init():
  run = spec.expand(_load('init_comparison'))[0]
  assert run.config.model.token_init_std != pytest.approx(0.02)


def test_quick_grid_is_two_arms_one_seed_and_shares_runs_across_experiments():
  quick = {n: spec.expand(_load(n), quick=True) for n in CONFIGS}
  assert all(
      len(r) == 2 and len({x.seed for x in r}) == 1 for r in quick.values()
  )
  # init_comparison's gpt2 (packed) is exposure's syn/packed: one run in a
  # shared store.
  assert quick['init_comparison'][0].key == quick['exposure'][0].key


def test_unknown_override_key_is_an_error_naming_the_arm_and_the_key():
  exp = _load('init_comparison')
  with pytest.raises(
      ValueError, match=r"arm x: override 'modle.num_layers' is not a config"
  ):
    spec.apply_overrides(
        spec.expand(exp)[0].config, (('modle.num_layers', 1),), 'arm x'
    )
  with pytest.raises(
      ValueError, match=r"arm x: override 'model.nope' is not a config"
  ):
    spec.apply_overrides(
        spec.expand(exp)[0].config, (('model.nope', 1),), 'arm x'
    )


def test_override_of_the_wrong_type_is_an_error_and_ints_widen_to_floats():
  config = spec.expand(_load('init_comparison'))[0].config
  with pytest.raises(
      ValueError,
      match=r"arm 'a': override model.num_layers='two' has the wrong",
  ):
    spec.apply_overrides(config, (('model.num_layers', 'two'),), "arm 'a'")
  out = spec.apply_overrides(
      config, (('optimizer.learning_rate', 1),), "arm 'a'"
  )
  assert isinstance(out.optimizer.learning_rate, float) and out.is_locked
  # The input config is not changed.
  assert config.optimizer.learning_rate != 1.0


def test_claim_naming_a_missing_arm_is_a_clear_error():
  exp = _load('init_comparison')
  exp.claims = exp.claims + (
      spec.claim('x', 'x', 'final_loss', 'nope', 'gpt2', 'less'),
  )
  with pytest.raises(ValueError, match="'nope'"):
    spec.validate(exp)


# --- budget equalization (real data pipeline)
# ------------------------------------------------


def test_budget_gives_padded_policies_more_rows_and_equal_scored_tokens(
    tmp_path,
):
  exp = _load('exposure')
  runs, b = sweep.equalize(
      spec.expand(exp, quick=True),
      exp.budget,
      cache_path=str(tmp_path / 'budget.json'),
  )
  assert b.batch_size['syn/natural'] > b.batch_size['syn/packed']
  for arm, rows in b.batch_size.items():
    assert (
        abs(rows * b.per_row[arm] - b.target_tokens_per_step)
        <= b.per_row[arm] / 2 + 1e-9
    )
  assert {r.arm: r.config.batch_size for r in runs} == b.batch_size

  # The cache makes a resumed sweep reproduce the same sizes without measuring
  # again.
  def no_measuring(config, n):
    raise AssertionError('estimator called despite the cache')

  _, again = sweep.equalize(
      spec.expand(exp, quick=True),
      exp.budget,
      no_measuring,
      str(tmp_path / 'budget.json'),
  )
  assert again.batch_size == b.batch_size


# --- measures
# ------------------------------------------------------------------------------


def _write_tables(run_dir, tables):
  os.makedirs(run_dir / 'tables', exist_ok=True)
  for step, t in tables.items():
    np.save(run_dir / 'tables' / f'table_{step}.npy', t)


def test_cosine_convergence_step_is_first_step_of_lasting_agreement(tmp_path):
  rng = np.random.default_rng(0)
  final = rng.normal(size=(16, 8))
  dirs = {}
  for i, arm in enumerate(('a', 'b', 'c')):
    d = tmp_path / arm
    start = np.zeros((16, 8)) if arm == 'a' else rng.normal(size=(16, 8))
    mid = rng.normal(size=(16, 8))  # Still disagreeing at step 10.
    _write_tables(
        d, {0: start, 10: mid, 20: final * (1 + i), 30: final + 1e-3 * i}
    )
    dirs[arm] = str(d)
  out = measures.convergence_step(dirs, threshold=0.9)
  assert out['steps'] == [0, 10, 20, 30]
  assert out['agreement'][0] < 0.5 and out['agreement'][2] == pytest.approx(1.0)
  assert out['converged_step'] == 20


def test_bucket_means_and_late_over_early_from_windows(tmp_path):
  d = tmp_path / 'run'
  os.makedirs(d / 'stats')
  count = np.array([8, 8, 2, 0])
  np.savez(
      d / 'stats' / 'window_10.npz',
      step=10,
      num_steps=10,
      count=count,
      loss_sum=np.array([8.0, 8.0, 4.0, 0.0]),
      loss_count=count,
      occ_norm=np.array([8.0, 8.0, 6.0, 0.0]),
      occ_sq=np.ones(4),
      row_sq=np.array([40.0, 40.0, 10.0, 0.0]),
      downstream=np.array([16.0, 16.0, 4.0, 0.0]),
      update_sq=np.array([1.0, 1.0, 4.0, 0.0]),
      cumulative_count=count.astype(np.int64),
  )
  _write_tables(
      d, {0: np.zeros((4, 2)), 10: np.array([[1.0, 0], [1, 0], [0, 2], [0, 0]])}
  )
  results = {
      'buckets': [
          {'start': 0, 'end': 2, 'loss': 1.0},
          {'start': 2, 'end': 4, 'loss': 2.0},
      ],
      'overall': {'loss': 1.2},
      'degradation': {'last_minus_best': 1.0},
  }
  m = measures.run_measures(str(d), results, num_steps=10, train_seconds=2.0)
  v, s = m['vectors'], m['scalars']
  # Mean over the bucket's rows (2 and 0).
  assert v['bucket_exposure'] == [8.0, 1.0]
  # Position 3 (never seen) is left out.
  assert v['bucket_occ_signal'] == [1.0, 3.0]
  assert v['bucket_drift'] == [1.0, 1.0]
  assert s['occ_signal_late_over_early'] == pytest.approx(3.0)
  assert s['loss_late_minus_early'] == pytest.approx(1.0)
  assert s['tokens_per_step'] == pytest.approx(1.8)


def test_measures_of_a_run_without_gradient_statistics_are_nan_not_errors(
    tmp_path,
):
  d = tmp_path / 'run'
  os.makedirs(d / 'stats')
  count = np.array([8, 8, 2, 0])
  # LOSS_FIELDS
  np.savez(
      d / 'stats' / 'window_10.npz',
      step=10,
      num_steps=10,
      count=count,
      loss_sum=np.array([8.0, 8.0, 4.0, 0.0]),
      loss_count=count,
      cumulative_count=count.astype(np.int64),
  )
  _write_tables(d, {0: np.zeros((4, 2)), 10: np.ones((4, 2))})
  results = {
      'buckets': [
          {'start': 0, 'end': 2, 'loss': 1.0},
          {'start': 2, 'end': 4, 'loss': 2.0},
      ],
      'overall': {'loss': 1.2},
      'degradation': {'last_minus_best': 1.0},
  }
  v = measures.run_measures(str(d), results, num_steps=10, train_seconds=2.0)[
      'vectors'
  ]
  assert v['bucket_exposure'] == [8.0, 1.0] and v['bucket_train_loss'] == [
      1.0,
      2.0,
  ]
  assert all(np.isnan(x) for x in v['bucket_occ_signal'])


# --- aggregation and report
# -------------------------------------------------------------------


def test_report_judges_claims_on_paired_differences_and_writes_files(tmp_path):
  from flax_posemb.experiments import report

  exp = _load('exposure')
  runs = [r for r in spec.expand(exp) if r.arm in ('syn/packed', 'syn/natural')]
  rng = np.random.default_rng(1)
  # Large, shared by both arms.
  seed_effect = {s: rng.normal(scale=5.0) for s in exp.seeds}
  rows = []
  for r in runs:
    lift = (0.1 + 0.01 * r.seed) if r.arm == 'syn/natural' else 0.0
    late = 2.0 + seed_effect[r.seed] + lift
    scalars = {'excess_late': late, 'final_loss': 2.0 + seed_effect[r.seed]}
    vectors = {k: [1.0, late] for k in measures.VECTORS}
    rows.append(
        {
            'arm': r.arm,
            'seed': r.seed,
            'key': r.key,
            'run_dir': '',
            'done': True,
            'config': r.config,
            'measures': {
                'scalars': scalars,
                'vectors': vectors,
                'buckets': [[0, 8], [8, 16]],
            },
        }
    )
  sweep_out = {
      'runs': rows,
      'complete': True,
      'budget': {
          'mode': 'real_tokens',
          'reference': 'syn/packed',
          'target_tokens_per_step': 64.0,
          'per_row': {'syn/packed': 32.0, 'syn/natural': 2.0},
          'batch_size': {'syn/packed': 2, 'syn/natural': 32},
      },
  }
  summary = report.write(
      exp, sweep_out, str(tmp_path), 'python -m flax_posemb.experiments x'
  )
  claim = next(c for c in summary['claims'] if c['id'] == 'syn:excess_late')
  # The seed effect (std 5) cancels in the paired difference: 0.10..0.14,
  # clearly > 0.
  np.testing.assert_allclose(
      claim['differences'], [0.1 + 0.01 * s for s in exp.seeds]
  )
  assert claim['verdict'] == verdicts.SUPPORTED
  unpaired = inference.t_interval(
      [
          x['measures']['scalars']['excess_late']
          for x in rows
          if x['arm'] == 'syn/natural'
      ]
  )
  assert unpaired.high - unpaired.low > 10 * (
      claim['interval']['high'] - claim['interval']['low']
  )
  text = open(tmp_path / 'REPORT.md').read()
  assert '**supported**' in text and 'Token-embedding init' in text
  assert json.load(open(tmp_path / 'summary.json'))['claims']
  assert all((tmp_path / f).stat().st_size > 0 for f in summary['figures'])


def test_figures_label_axes_with_units_and_split_final_loss_by_corpus(
    tmp_path, monkeypatch
):
  from flax_posemb.experiments import figures
  from flax_posemb.plots import experiments as experiment_plots

  calls = {}
  for name in (
      'experiment_profile',
      'experiment_metric_bars',
      'experiment_curve',
  ):
    monkeypatch.setattr(
        experiment_plots,
        name,
        lambda path, *a, _n=name, **k: calls.setdefault(_n, []).append((a, k)),
    )
  iv = {'mean': 1.0, 'low': None, 'high': None, 'n': 1}

  def arm(corpus, tok):
    return {
        'seeds': [0],
        'corpus': corpus,
        'tokenizer': tok,
        'scalars': {'final_loss': iv},
        'vectors': {'bucket_excess': [iv]},
    }

  summary = {
      'experiment': 'e',
      'buckets': [[0, 8]],
      'runs': [],
      'analyses': {},
      'settings': {'model': '1 layer', 'seq_len': 8, 'num_train_steps': 4},
      'arms': {
          'syn/a': arm('synthetic', 'synthetic'),
          'syn/b': arm('synthetic', 'synthetic'),
          'txt/a': arm('stdlib', 'byte'),
      },
      'profiles': [
          {
              'metric': 'bucket_excess',
              'title': 'excess',
              'arms': ['syn/a', 'syn/b'],
              'baseline': 'syn/a',
              'differences': {'syn/b': [iv]},
          }
      ],
  }
  figures.write_figures(summary, str(tmp_path))
  (_, profile), (_, bucket_profile) = calls['experiment_profile']
  assert profile['ylabel'] == 'excess loss over Bayes (nats/token)'
  assert bucket_profile['ylabel'] == 'held-out loss (nats/token)'
  assert profile['n_seeds'] == 1 and '4 steps' in profile['title']
  ((args, bars),) = calls['experiment_metric_bars']
  assert {p: list(a) for p, a in args[0].items()} == {
      'synthetic': ['syn/a', 'syn/b'],
      'stdlib (byte tokens)': ['txt/a'],
  }
  assert bars['ylabels']['stdlib (byte tokens)'] == 'held-out loss (nats/byte)'


def test_every_profile_metric_has_a_readable_label():
  for metric in measures.VECTORS:
    assert measures.label(metric) != metric and '{' not in measures.label(
        metric
    )


# --- run sharing across experiments
# -------------------------------------------------------


def test_coinciding_arms_of_different_experiments_are_one_run_after_budgeting(
    tmp_path,
):
  """Shared store: init_comparison gpt2 = exposure syn/packed; init_x_exposure
  gpt2/decay = exposure syn/packed_reset, at every seed, with batch sizes set by
  the real estimator."""

  def keys(name, arms):
    exp = _load(name)
    runs = [r for r in spec.expand(exp) if r.arm in arms]
    runs, _ = sweep.equalize(
        runs, exp.budget, cache_path=str(tmp_path / f'{name}.json')
    )
    return {(r.arm, r.seed): r.key for r in runs}

  ic = keys('init_comparison', ('gpt2', 'zeros'))
  ex = keys('exposure', ('syn/packed', 'syn/packed_reset'))
  ix = keys('init_x_exposure', ('gpt2/decay', 'gpt2/no_decay'))
  for s in _load('exposure').seeds:
    assert ic[('gpt2', s)] == ex[('syn/packed', s)]
    assert ix[('gpt2/decay', s)] == ex[('syn/packed_reset', s)]
    assert ic[('zeros', s)] != ex[('syn/packed', s)]
    assert ix[('gpt2/no_decay', s)] != ex[('syn/packed_reset', s)]


def test_suite_file_expands_to_the_four_experiments_with_the_scale():
  paths = spec.expand_paths(['configs/experiments/all.py:accelerator'])
  assert [os.path.basename(p) for p in paths] == [
      f'{n}.py:accelerator'
      for n in ('init_comparison', 'exposure', 'init_x_exposure', 'long_text')
  ]
  assert spec.load(paths[0]).scale == 'accelerator'
  # long_text at GPT-2-small context
  assert spec.load(paths[3]).offsets == (0, 128)


# --- the whole pipeline: --quick
# ---------------------------------------------------------------


def test_quick_suite_runs_the_whole_pipeline_shares_runs_and_resumes(tmp_path):
  from flax_posemb import experiments

  trained = []

  def counting_train(config, run_dir):
    trained.append(run_dir)
    return sweep.default_train(config, run_dir)

  workdir, reports = str(tmp_path / 'exp'), str(tmp_path / 'docs')
  paths = [
      os.path.join('configs', 'experiments', f'{n}.py')
      for n in ('init_comparison', 'exposure')
  ]
  summaries = experiments.run_suite(
      paths,
      workdir,
      quick=True,
      report_dir=reports,
      train_fn=counting_train,
      command='test',
  )
  # init_comparison's gpt2 is exposure's syn/packed: 3 distinct runs for 4 arms.
  assert len(trained) == 3
  assert set(summaries) == {'init_comparison', 'exposure'}
  out = os.path.join(reports, 'exposure')
  report = open(os.path.join(out, 'REPORT.md')).read()
  for needle in (
      'Token-embedding init',
      'beta2',
      'position table',
      'Budget',
      'syn/natural',
      '.png',
      'claims tested',
      'Holm-Bonferroni',
  ):
    assert needle in report
  on_disk = json.load(open(os.path.join(out, 'summary.json')))
  # One seed: no interval, never a verdict either way.
  assert on_disk['claims'] and all(
      c['verdict'] in (verdicts.INCONCLUSIVE, verdicts.NOT_MEASURED)
      for c in on_disk['claims']
  )
  assert set(on_disk['arms']) == {'syn/packed', 'syn/natural'}
  assert math.isfinite(
      summaries['exposure']['arms']['syn/packed']['scalars']['final_loss'][
          'mean'
      ]
  )
  for fig in on_disk['figures']:
    assert os.path.getsize(os.path.join(out, fig)) > 0
  index = open(os.path.join(reports, 'README.md')).read()
  assert 'init_comparison/REPORT.md' in index and 'exposure/REPORT.md' in index
  # Resume: finished runs are skipped; a run without its marker is trained
  # again.
  os.remove(os.path.join(trained[-1], sweep.DONE))
  experiments.run_experiment(
      paths[1],
      os.path.join(workdir, 'exposure'),
      quick=True,
      run_store=os.path.join(workdir, 'store'),
      train_fn=counting_train,
      command='test',
  )
  assert trained[3:] == [trained[2]]


def test_a_preempted_run_is_not_marked_done(tmp_path, monkeypatch):
  from flax_posemb import training

  monkeypatch.setattr(
      training,
      'train_and_evaluate',
      lambda config, run_dir: {'preempted': True, 'step': 3},
  )
  run = spec.expand(_load('init_comparison'), quick=True)[0]
  with pytest.raises(preemption.Preempted, match='re-run the same command'):
    sweep.execute_run(
        run,
        str(tmp_path / 'r'),
        (),
        sweep.default_train,
        lambda *a: pytest.fail('a preempted run must not be evaluated'),
    )
  assert not os.path.exists(tmp_path / 'r' / sweep.DONE)


def test_long_text_quick_report_states_where_its_windows_come_from(tmp_path):
  from flax_posemb import experiments

  out = str(tmp_path / 'report')
  experiments.run_experiment(
      os.path.join('configs', 'experiments', 'long_text.py'),
      str(tmp_path / 'exp'),
      quick=True,
      report_dir=out,
      command='test',
  )
  report = open(os.path.join(out, 'REPORT.md')).read()
  windows = json.load(open(os.path.join(out, 'summary.json')))['analyses'][
      'windows'
  ]
  summary = windows['summary']
  assert (
      summary['first_window_overlaps'] == 0 and summary['long_doc_share'] == 1.0
  )
  assert {'shakespeare', 'bible'} & set(summary['kinds'])
  assert set(windows['rise']) == {'by_kind', 'by_depth', 'by_end'}
  assert set(windows['rise']['by_end']['arms']) == {
      'packed_reset',
      'crops/skew:0.01',
  }
  for needle in (
      '## Evaluation windows',
      'start in document',
      'By window start',
      '**Descriptive**',
      '## What each arm trained on',
      '*evaluation windows*',
      '## Dose-response',
      'dose_response.png',
      'Late vs mid (pre-registered)',
  ):
    assert needle in report
  claims = json.load(open(os.path.join(out, 'summary.json')))['claims']
  on_windows = next(c for c in claims if c['metric'] == 'loss_late_minus_mid')
  assert on_windows['interval']['method'] == inference.SEEDS_AND_DOCUMENTS
  assert on_windows['interval']['documents'] == summary['documents']
  on_training = next(c for c in claims if c['metric'].startswith('exposure'))
  assert on_training['interval']['method'] == inference.SEEDS
  # Notes cite the full runs.
  assert 'What changed since the previous report' not in report


def test_window_metrics_are_bucket_contrasts_with_the_corpus_constants():
  from flax_posemb.experiments import window_measures

  results = {
      'buckets': [
          {'bayes_loss': 1.0, 'filter_loss': 2.0},
          {'bayes_loss': 1.5, 'filter_loss': 2.5},
          {'bayes_loss': 1.2, 'filter_loss': 3.2},
      ]
  }
  terms, constant = window_measures.terms(
      'excess_late_minus_mid', results, mid=1
  )
  assert [(t.bucket, t.weight) for t in terms] == [(2, 1.0), (1, -1.0)]
  assert constant == pytest.approx(-(1.2 - 1.5))
  terms, constant = window_measures.terms('recovered_late', results, mid=1)
  # (filter - loss) / (filter - bayes) at loss = 2.2: 0.5
  assert constant + terms[0].weight * 2.2 == pytest.approx(0.5)
  terms, _ = window_measures.terms('offset_penalty_16', dict(results), mid=1)
  assert [(t.scored, t.bucket, t.weight) for t in terms] == [
      ('offset_16', None, 1.0),
      ('offset_0', None, -1.0),
  ]


def test_dose_series_of_experiments_probing_different_offsets_share_a_figure(
    tmp_path,
):
  """The suite index plots every experiment's dose series together; the
  synthetic exposure experiment probes +16 and long_text +128, and both land
  in the offset-penalty column (a KeyError on the other's shift before); a
  series without any offset difference leaves its panel n/a."""
  from flax_posemb.experiments import figures

  def series(name, shift):
    interval = {'mean': 0.01, 'low': 0.0, 'high': 0.02}
    return {
        'name': name,
        'late_exposure': [1000.0, 30.0],
        'arms': ['packed', 'crops/skew:0.01'],
        'baseline': 'packed_reset',
        'measures': {
            'loss_late_minus_mid': [interval, interval],
            f'offset_penalty_{shift}': [interval, interval],
        },
    }

  without_probe = series('synthetic', 16)
  # Its baseline was not probed: every offset difference is n/a.
  without_probe['measures']['offset_penalty_16'] = [
      {'mean': None, 'low': None, 'high': None}
  ] * 2
  unprobed = series('init', 16)
  # An experiment without the offset probe has no such column at all.
  del unprobed['measures']['offset_penalty_16']
  title, figure = figures.dose_plot(
      [
          series('exposure', 16),
          series('long_text', 128),
          without_probe,
          unprobed,
      ],
      str(tmp_path),
      'two experiments',
  )
  assert figure == 'dose_response.png' and 'Dose-response' in title
  assert os.path.getsize(tmp_path / figure) > 0
