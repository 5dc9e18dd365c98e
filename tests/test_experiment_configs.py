"""The experiments of issue 36 (mechanism, init_rare, the dose twins,
gpt2_scale): they load and validate, their twins differ from their arms in the
offset only, their claims compare what their docstrings say, and two of them
run end to end on CPU with --quick."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

from flax_posemb import config as config_lib
from flax_posemb import experiments
from flax_posemb.experiments import spec

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXPERIMENTS = ROOT / 'configs' / 'experiments'
NEW = (
    'mechanism.py',
    'init_rare_synthetic.py',
    'init_rare_text.py',
    'long_text_doses.py',
    'gpt2_scale.py',
    'gpt2_scale.py:tiny',
)


def _load(name: str):
  return spec.load(str(EXPERIMENTS / name))


def _resolved(exp, quick: bool = False) -> dict:
  """arm name -> its resolved config (seed 0) as a flat dict."""
  return {
      run.arm: run.config.to_dict()
      for run in spec.expand(exp, quick=quick)
      if run.seed == exp.seeds[0]
  }


def _differences(a: dict, b: dict, prefix: str = '') -> set[str]:
  keys = set()
  for key in set(a) | set(b):
    if isinstance(a.get(key), dict) and isinstance(b.get(key), dict):
      keys |= _differences(a[key], b[key], f'{prefix}{key}.')
    elif a.get(key) != b.get(key):
      keys.add(f'{prefix}{key}')
  return keys


@pytest.mark.parametrize('name', NEW)
def test_every_run_of_a_new_experiment_is_a_valid_training_config(name):
  exp = _load(name)
  for quick in (False, True):
    for run in spec.expand(exp, quick=quick):
      config_lib.RunConfig.from_config_dict(run.config)


@pytest.mark.parametrize('name', NEW)
def test_every_twin_differs_from_its_arm_in_the_offset_only(name):
  exp = _load(name)
  configs = _resolved(exp)
  twins = [arm for arm in configs if arm.endswith('/twin')]
  assert twins
  for twin in twins:
    arm = twin.removesuffix('/twin')
    assert _differences(configs[arm], configs[twin]) == {'data.offset_twin'}
    assert configs[twin]['data']['offset_twin'] is True


def test_every_crops_arm_of_the_doses_has_a_twin_and_the_old_arms_remain():
  exp = _load('long_text_doses.py')
  names = {arm.name for arm in exp.arms}
  for name in names:
    if name.startswith('crops/') and not name.endswith('/twin'):
      assert f'{name}/twin' in names
  committed = ROOT / 'docs' / 'experiments' / 'long_text_doses'
  summary = committed / 'summary.json'
  if summary.exists():  # The committed report's arms stay identifiable.
    assert set(json.loads(summary.read_text())['arms']) <= names


def test_dose_claims_rows_are_arm_minus_twin_context_twin_minus_control():
  exp = _load('long_text_doses.py')
  claims = {claim.id: claim for claim in exp.claims}
  for claim_id, claim in claims.items():
    kind, _, dose = claim_id.partition(':')
    if kind == 'rows':
      assert (claim.arm, claim.baseline) == (
          f'crops/{dose}',
          f'crops/{dose}/twin',
      )
    if kind == 'context':
      assert (claim.arm, claim.baseline) == (
          f'crops/{dose}/twin',
          'packed_reset',
      )
    if kind in ('rows', 'context'):
      assert claim.metric == 'loss_late'
  assert 'rows:skew:0.003' in claims and 'context:skew:0.003' in claims


def test_mechanism_judges_each_mitigation_against_its_twin_with_a_margin():
  exp = _load('mechanism.py')
  claims = {claim.id: claim for claim in exp.claims}
  mitigations = (
      'adam_b2_0.999',
      'lazy_adam',
      'sgd',
      'no_table_decay',
      'row_lr_scale',
  )
  for name in mitigations:
    removed = claims[f'{name}:rows_removed']
    assert (removed.arm, removed.baseline) == (name, f'{name}/twin')
    assert removed.direction == 'equivalent' and removed.margin > 0
  configs = _resolved(exp)
  optimizer = {arm: configs[arm]['optimizer'] for arm in configs}
  assert optimizer['adam_b2_0.999']['b2'] == 0.999
  assert optimizer['lazy_adam']['position_optimizer'] == 'lazy_adam'
  assert optimizer['sgd']['position_optimizer'] == 'sgd'
  assert optimizer['no_table_decay']['decay_position_table'] is False
  assert optimizer['row_lr_scale']['row_lr_scale'] is True
  # Each mitigation differs from the baseline in its optimizer only.
  for name in mitigations:
    assert {
        key.split('.')[0]
        for key in _differences(configs['adam_b2_0.95'], configs[name])
    } == {'optimizer'}


def test_rarest_dose_runs_are_shared_by_the_doses_mechanism_and_init_rare():
  doses = spec.expand(_load('long_text_doses.py'))
  mechanism = spec.expand(_load('mechanism.py'))
  init_rare = spec.expand(_load('init_rare_text.py'))

  def key(runs, arm):
    return next(run.key for run in runs if run.arm == arm and run.seed == 0)

  for suffix in ('', '/twin'):
    rare = key(doses, f'crops/skew:0.003{suffix}')
    assert key(mechanism, f'adam_b2_0.95{suffix}') == rare
    assert key(init_rare, f'gpt2{suffix}') == rare


def test_new_experiments_are_in_the_rows_suite_not_in_all_or_doses():
  rows = spec.expand_paths([str(EXPERIMENTS / 'rows.py')])
  elsewhere = spec.expand_paths(
      [str(EXPERIMENTS / 'all.py'), str(EXPERIMENTS / 'doses.py')]
  )
  for name in ('mechanism', 'init_rare_synthetic', 'init_rare_text'):
    assert str(EXPERIMENTS / f'{name}.py') in rows
    assert str(EXPERIMENTS / f'{name}.py') not in elsewhere
  suite = spec.expand_paths([str(EXPERIMENTS / 'init_rare.py')])
  assert [os.path.basename(path) for path in suite] == [
      'init_rare_synthetic.py',
      'init_rare_text.py',
  ]


def test_gpt2_scale_has_three_sizes_at_gpt2_small_shape():
  exp = _load('gpt2_scale.py')
  assert exp.scale == 'accelerator'
  configs = _resolved(exp)
  widths = {c['model']['emb_dim'] for c in configs.values()}
  assert widths == {256, 512, 768}
  small = configs['d768/packed']
  assert (small['model']['num_layers'], small['data']['seq_len']) == (12, 1024)
  assert small['data']['name'] == 'pg19'


def test_gpt2_scale_refuses_an_unknown_argument():
  with pytest.raises(ValueError, match=':accelerator.*:tiny'):
    _load('gpt2_scale.py:gpu')


def _run_quick(argument: str, workdir):
  experiments.run_experiment(
      str(EXPERIMENTS / argument), str(workdir), quick=True
  )
  return json.loads((workdir / 'summary.json').read_text())


@pytest.mark.slow
def test_mechanism_quick_runs_a_mitigation_and_its_twin_end_to_end(tmp_path):
  summary = _run_quick('mechanism.py', tmp_path / 'mechanism')
  assert summary['quick'] is True
  done = {run['arm'] for run in summary['runs'] if run.get('done', True)}
  assert done == {'lazy_adam', 'lazy_adam/twin'}
  assert (tmp_path / 'mechanism' / 'REPORT.md').exists()


def _write_tiny_books(directory: pathlib.Path) -> None:
  """40 text files of ~3,000 bytes: long enough for deep windows of 128."""
  directory.mkdir()
  words = 'the a late row of text is seen rarely by position and context'
  vocabulary = words.split()
  for book in range(40):
    lines = []
    for line in range(60):
      picked = [
          vocabulary[(book * 7 + line * 3 + i * i) % len(vocabulary)]
          for i in range(9)
      ]
      lines.append(' '.join(picked) + '.')
    (directory / f'book_{book:02d}.txt').write_text('\n'.join(lines))


@pytest.mark.slow
def test_gpt2_scale_tiny_quick_trains_a_rare_arm_and_its_twin(
    tmp_path, monkeypatch
):
  _write_tiny_books(tmp_path / 'books')
  data_dir = tmp_path / 'data'
  subprocess.run(
      [
          sys.executable,
          '-m',
          'flax_posemb.commands.prepare',
          '--name',
          'gpt2_scale_tiny',
          '--input',
          str(tmp_path / 'books' / '*.txt'),
          '--data_dir',
          str(data_dir),
          '--val_percent',
          '25',
      ],
      check=True,
      capture_output=True,
  )
  monkeypatch.setenv('FLAX_POSEMB_DATA_DIR', str(data_dir))
  summary = _run_quick('gpt2_scale.py:tiny', tmp_path / 'gpt2_scale')
  done = {run['arm'] for run in summary['runs'] if run.get('done', True)}
  assert done == {'d256/crops/skew:3e-05', 'd256/crops/skew:3e-05/twin'}
