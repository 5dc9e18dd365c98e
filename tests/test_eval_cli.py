"""eval.py end to end on real Orbax checkpoints: table + plot path, comparison,
probe, analysis."""

import json
import os
import subprocess
import sys

os.environ.setdefault('JAX_PLATFORMS', 'cpu')

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from conftest import ROOT
from conftest import SUBPROCESS_ENV
from conftest import tiny_config
from flax_posemb import checkpointing
from flax_posemb import eval_workdir
from flax_posemb.model import ModelConfig
from flax_posemb.model import TransformerLM

MAX_LEN = 32  # tiny_config's table size


def _config():
  c = tiny_config()
  c.data.synthetic.num_docs = 64
  return c


def _make_run(workdir, config, params_config):
  """A workdir holding one checkpoint of a freshly initialized `params_config`
  model, saved with `config` (a deliberately mismatched pair)."""
  model = TransformerLM(ModelConfig.from_config(params_config.model))
  x = jnp.zeros((1, 4), jnp.int32)
  params = model.init(jax.random.key(0), x, x)['params']
  ckpt = checkpointing.Checkpointer(
      checkpointing.checkpoint_dir(workdir), max_to_keep=2, async_save=False
  )
  ckpt.save(
      3,
      params=params,
      opt_state=optax.adamw(1e-2).init(params),
      data_iter=None,
      stats=None,
      config=config,
  )
  ckpt.close()
  return workdir


@pytest.fixture(scope='module')
def runs(tiny_run, tiny_config_factory, tmp_path_factory):
  """Two tiny runs trained through the library: the shared one and a
  flax_default-init arm."""
  from flax_posemb import training

  config = tiny_config_factory()
  config.num_train_steps = 10
  config.eval_every_steps = 0
  config.model.position_init = 'flax_default'
  other = str(tmp_path_factory.mktemp('init_flax'))
  training.train_and_evaluate(config, other)
  return tiny_run[0], other


def test_eval_cli_prints_table_and_plot_and_compares_two_runs(runs, tmp_path):
  out = str(tmp_path / 'out')
  names = [os.path.basename(r) for r in runs]
  cmd = [
      sys.executable,
      str(ROOT / 'eval.py'),
      '--workdir',
      runs[0],
      '--workdir',
      runs[1],
      '--output',
      out,
      '--offsets',
      '0,8',
      '--analyze',
  ]
  proc = subprocess.run(
      cmd,
      capture_output=True,
      text=True,
      cwd=ROOT,
      timeout=300,
      env=SUBPROCESS_ENV,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  text = proc.stdout
  assert '[0, 8)' in text and '[24, 32)' in text and 'overall loss' in text
  assert 'K=8' in text and 'off the training distribution' in text
  plot = os.path.join(out, names[0], 'loss_by_position.png')
  assert f'plot: {plot}' in text and os.path.getsize(plot) > 0
  res = json.load(open(os.path.join(out, names[0], 'results.json')))
  assert res['step'] == 20 and [b['start'] for b in res['buckets']] == [
      0,
      8,
      16,
      24,
  ]
  assert {
      'loss',
      'stderr',
      'ci95',
      'bits_per_token',
      'tokens',
      'windows',
      'bayes_loss',
      'filter_loss',
      'excess_loss',
      'recovered',
  } <= set(res['buckets'][0])
  assert res['offset_probe']['window_len'] == 24
  npz = np.load(os.path.join(out, names[0], 'per_position.npz'))
  assert npz['loss'].shape == (MAX_LEN,) and npz['offset_loss'].shape == (2, 24)
  comp = json.load(open(os.path.join(out, 'comparison.json')))
  assert [r['label'] for r in comp['runs']] == names
  assert comp['buckets'][0][names[1]]['loss'] is not None
  assert (
      comp['runs'][0]['overall']['loss'] != comp['runs'][1]['overall']['loss']
  )
  assert f"plot: {os.path.join(out, 'comparison.png')}" in text
  assert (
      comp['paired'][0]['label'] == names[1]
      and comp['paired'][0]['minus'] == names[0]
  )
  assert f'{names[1]}-{names[0]}' in text  # the difference column
  overall = comp['paired'][0]['overall']
  assert f"overall {names[1]} - {names[0]}: {overall['diff']:+.4f}" in text
  assert overall['diff'] == pytest.approx(
      comp['runs'][1]['overall']['loss'] - comp['runs'][0]['overall']['loss']
  )
  # How the two runs' configs differ (the second: flax_default init, 10 steps).
  differences = {d['field']: d['values'] for d in comp['config_differences']}
  assert differences['model.position_init'] == {
      names[0]: 'gpt2',
      names[1]: 'flax_default',
  }
  assert differences['num_train_steps'] == {names[0]: 20, names[1]: 10}
  assert 'configs differ: ' in text and "'gpt2' vs 'flax_default'" in text
  analysis = json.load(
      open(os.path.join(out, names[0], 'analysis', 'analysis.json'))
  )
  assert (
      analysis['step'] == 20
      and 'exposure' in analysis
      and analysis['drift_by_bucket'][0] > 0
  )
  assert (
      os.path.getsize(
          os.path.join(out, names[0], 'analysis', 'exposure_relation.png')
      )
      > 0
  )


def test_eval_default_output_dir_and_step_selection(runs):
  run = eval_workdir.evaluate_workdir(runs[1], step=0, bucket_edges='log2')
  assert run['out_dir'] == os.path.join(
      runs[1], 'eval', 'step_0_bucket_edges-log2'
  )
  assert run['results']['step'] == 0
  assert [b['end'] for b in run['results']['buckets']] == [1, 2, 4, 8, 16, 32]
  assert os.path.exists(os.path.join(run['out_dir'], 'buckets.csv'))


def test_each_variant_writes_its_own_directory_and_no_stale_files(runs):
  plain = eval_workdir.evaluate_workdir(runs[1], step=10)
  probe = eval_workdir.evaluate_workdir(runs[1], step=10, offsets=[0, 8])
  assert plain['out_dir'].endswith(os.path.join('eval', 'step_10'))
  assert probe['out_dir'].endswith(os.path.join('eval', 'step_10_offsets-0-8'))
  assert not os.path.exists(os.path.join(plain['out_dir'], 'offsets.csv'))
  # a stale file
  open(os.path.join(plain['out_dir'], 'offsets.png'), 'w').close()
  eval_workdir.evaluate_workdir(runs[1], step=10)
  assert not os.path.exists(os.path.join(plain['out_dir'], 'offsets.png'))
  # per-window sums
  with np.load(os.path.join(plain['out_dir'], 'windows.npz')) as w:
    means = w['win_sum'].sum(0) / w['win_count'].sum(0)
  np.testing.assert_allclose(
      means, [b['loss'] for b in plain['results']['buckets']], rtol=1e-12
  )


def test_paired_comparison_of_a_run_with_itself_is_zero_and_named(
    runs, tmp_path
):
  import shutil

  twin = str(tmp_path / 'twin')
  shutil.copytree(runs[1], twin)
  _, comp = eval_workdir.evaluate_and_compare([runs[1], twin], step=10)
  assert (
      os.path.basename(comp['out_dir'])
      == f'compare_{os.path.basename(runs[1])}_vs_twin_step_10'
  )
  for b in comp['paired'][0]['buckets']:
    assert b['diff'] == 0.0 and b['stderr'] == 0.0
  ((_, r0), (_, r1)), comp = eval_workdir.evaluate_and_compare(
      [runs[0], runs[1]], step=10
  )
  for d, b0, b1 in zip(
      comp['paired'][0]['buckets'],
      r0['results']['buckets'],
      r1['results']['buckets'],
  ):
    assert d['diff'] == pytest.approx(b1['loss'] - b0['loss'], abs=1e-9)


def test_checkpoint_of_a_different_context_length_is_a_clear_error(tmp_path):
  bigger = _config()
  bigger.model.max_len = 2 * MAX_LEN
  bigger.data.seq_len = 2 * MAX_LEN
  workdir = _make_run(str(tmp_path / 'mismatch'), bigger, _config())
  with pytest.raises(
      checkpointing.CheckpointMismatchError,
      match=r'another model: params/pos_embed/embedding has shape \(32, 32\)'
      r' in the checkpoint but \(64, 32\)',
  ):
    eval_workdir.evaluate_workdir(workdir)


def test_offset_past_the_table_via_workdir_is_a_clear_error(runs, tmp_path):
  with pytest.raises(
      ValueError, match=f'largest valid offset is {MAX_LEN - 1}'
  ):
    eval_workdir.evaluate_workdir(
        runs[1], offsets=[0, MAX_LEN], output=str(tmp_path)
    )


def test_comparison_of_different_windows_is_a_clear_error(runs, tmp_path):
  a = eval_workdir.evaluate_workdir(runs[1], output=str(tmp_path / 'a'))[
      'results'
  ]
  b = eval_workdir.evaluate_workdir(
      runs[1], window_len=16, output=str(tmp_path / 'b')
  )['results']
  from flax_posemb import eval_report

  with pytest.raises(ValueError, match='different windows'):
    eval_report.compare(['a', 'b'], [a, b], str(tmp_path / 'compare'))


def _copy_run(tiny_run, tmp_path):
  import shutil

  workdir = str(tmp_path / 'run')
  shutil.copytree(tiny_run[0], workdir, ignore=shutil.ignore_patterns('eval'))
  return workdir


def test_eval_reads_the_new_latest_when_the_step_is_deleted_mid_read(
    tiny_run, tmp_path, monkeypatch
):
  """A trainer (max_to_keep=1) replaces step 20 by step 30 between eval's
  listing and its read: eval evaluates step 30 and says so; it never falls back
  to step 0 or 10."""
  import shutil

  workdir = _copy_run(tiny_run, tmp_path)
  ckpt_dir = os.path.join(workdir, 'checkpoints')
  real = checkpointing.Checkpointer._read
  calls = []

  def racing(self, step, **kw):
    calls.append(step)
    if step == 20:
      shutil.copytree(
          os.path.join(ckpt_dir, '20'), os.path.join(ckpt_dir, '30')
      )
      shutil.rmtree(os.path.join(ckpt_dir, '20'))
    return real(self, step, **kw)

  monkeypatch.setattr(checkpointing.Checkpointer, '_read', racing)
  run = eval_workdir.evaluate_workdir(workdir, output=str(tmp_path / 'out'))
  assert calls == [20, 30]
  assert run['step'] == 30 and run['results']['step'] == 30
  ck = run['results']['checkpoint']
  assert ck['step'] == 30 and ck['requested'] is None and ck['vanished'] == [20]
  assert ck['fell_back_from'] == []
  saved = json.load(open(run['files']['json']))
  assert saved['step'] == 30 and saved['checkpoint']['vanished'] == [20]
  assert 'evaluated checkpoint step 30' in run['table']


def _truncate_data(step_dir):
  for base, _, files in os.walk(
      os.path.join(step_dir, 'params', 'ocdbt.process_0', 'd')
  ):
    for name in files:  # truncated data files: reads fail mid-restore
      path = os.path.join(base, name)
      data = open(path, 'rb').read()
      open(path, 'wb').write(data[: len(data) // 2])


def _garble(*parts):
  def damage(step_dir):
    path = os.path.join(step_dir, *parts)
    open(path, 'w').write(open(path).read()[:40])

  return damage


@pytest.mark.parametrize(
    'damage',
    [
        _truncate_data,
        _garble('_CHECKPOINT_METADATA'),
        _garble('params', '_METADATA'),
    ],
    ids=['truncated_data', 'garbled_step_metadata', 'garbled_params_metadata'],
)
def test_eval_cli_names_a_damaged_latest_and_the_step_it_evaluated(
    tiny_run, tmp_path, damage
):
  """Quietly: no 'Event loop is closed' from reads of the damaged step left in
  flight."""
  workdir = _copy_run(tiny_run, tmp_path)
  damage(os.path.join(workdir, 'checkpoints', '20'))
  out = str(tmp_path / 'out')
  r = subprocess.run(
      [
          sys.executable,
          str(ROOT / 'eval.py'),
          '--workdir',
          workdir,
          '--output',
          out,
      ],
      capture_output=True,
      text=True,
      env=SUBPROCESS_ENV,
      timeout=600,
  )
  assert r.returncode == 0, r.stderr[-2000:]
  assert '(step 10)' in r.stdout and 'skipped damaged step 20' in r.stdout
  assert 'Event loop is closed' not in r.stderr and 'Traceback' not in r.stderr
  assert 'Exception ignored' not in r.stderr
  # TensorStore's reason, not a repr
  assert '<bound method' not in r.stdout + r.stderr
  saved = json.load(open(os.path.join(out, 'results.json')))
  assert saved['step'] == 10
  assert [d['step'] for d in saved['checkpoint']['fell_back_from']] == [20]
  with pytest.raises(
      checkpointing.CheckpointDamagedError, match='checkpoints/20'
  ):
    eval_workdir.evaluate_workdir(workdir, step=20, output=out)


@pytest.mark.parametrize('config_json', ['present', 'missing'])
def test_checkpoint_of_another_model_in_a_runs_checkpoints_is_refused(
    tiny_run, tmp_path, config_json
):
  """A checkpoint of a wider model placed among a run's steps: eval checks it
  against the run (its config.json, else its oldest checkpoint's config), as a
  resume does, instead of evaluating it as the run's."""
  workdir = _copy_run(tiny_run, tmp_path)
  if config_json == 'missing':
    os.remove(os.path.join(workdir, 'config.json'))
  wider = tiny_config()
  wider.model.emb_dim, wider.model.mlp_dim = 64, 128
  # its step 3 becomes the run's 30
  other = _make_run(str(tmp_path / 'other'), wider, wider)
  os.rename(
      os.path.join(other, 'checkpoints', '3'),
      os.path.join(workdir, 'checkpoints', '30'),
  )
  step_dir = os.path.join(workdir, 'checkpoints', '30')
  with pytest.raises(
      checkpointing.CheckpointMismatchError, match=f'{step_dir}.*another model'
  ):
    eval_workdir.evaluate_workdir(workdir, output=str(tmp_path / 'out'))
  r = subprocess.run(
      [
          sys.executable,
          str(ROOT / 'eval.py'),
          '--workdir',
          workdir,
          '--output',
          str(tmp_path / 'out'),
      ],
      capture_output=True,
      text=True,
      env=SUBPROCESS_ENV,
      timeout=600,
  )
  assert r.returncode == 2 and 'Traceback' not in r.stderr, r.stderr[-2000:]
  assert not os.path.exists(tmp_path / 'out' / 'results.json')
  assert (
      eval_workdir.evaluate_workdir(
          workdir, step=20, output=str(tmp_path / 'ok')
      )['step']
      == 20
  )


def test_a_killed_eval_rerun_leaves_the_previous_complete_results(
    tiny_run, tmp_path, monkeypatch
):
  from flax_posemb import eval_report

  out = str(tmp_path / 'out')
  first = eval_workdir.evaluate_workdir(tiny_run[0], step=10, output=out)
  before = {n: open(os.path.join(out, n), 'rb').read() for n in os.listdir(out)}
  assert 'results.json' in before

  def killed(*args, **kwargs):
    raise KeyboardInterrupt  # the re-run dies half-way through writing

  monkeypatch.setattr(eval_report.evaluation_plots, 'loss_by_position', killed)
  with pytest.raises(KeyboardInterrupt):
    eval_workdir.evaluate_workdir(tiny_run[0], step=20, output=out)
  assert {
      n: open(os.path.join(out, n), 'rb').read() for n in os.listdir(out)
  } == before
  assert os.listdir(tmp_path) == ['out']  # no leftover beside it
  monkeypatch.undo()
  again = eval_workdir.evaluate_workdir(tiny_run[0], step=20, output=out)
  assert json.load(open(again['files']['json']))['step'] == 20 != first['step']
  assert os.listdir(tmp_path) == ['out']


def _text_run(tmp_path, **eval_config):
  """A workdir of a tiny local_text run (``eval_config``: its eval section's
  changes): 5 documents of 40, 40, 20, 1 and 1 windows of 32 tokens."""
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  rng = np.random.default_rng(0)
  # in T = 32 tokens; the last two give no window
  for i, n in enumerate((40, 40, 20, 1, 1)):
    (corpus / f'd{i}.txt').write_text(
        ''.join(chr(c) for c in rng.integers(97, 123, n * 32))
    )
  config = tiny_config()
  config.data.update(
      source='local_text',
      local_glob=str(corpus / '*.txt'),
      val_percent=0,
      eval_split='train',
      data_dir=str(tmp_path / 'data'),
  )
  config.model.vocab_size = 257
  config.eval.update(eval_config)
  return _make_run(str(tmp_path / 'run'), config, config)


def test_eval_cli_deep_windows_record_their_provenance(tmp_path):
  """eval.py --window_start deep on a text run: windows deep inside the long
  documents only, their provenance in windows.npz, the summary and the window
  groups in results.json; a bar over the batches while it runs."""
  workdir = _text_run(tmp_path)
  cmd = [
      sys.executable,
      str(ROOT / 'eval.py'),
      '--workdir',
      workdir,
      '--window_start',
      'deep',
      '--min_doc_len',
      '400',
      '--min_start',
      '64',
      '--num_windows',
      '40',
  ]
  proc = subprocess.run(
      cmd,
      capture_output=True,
      text=True,
      cwd=ROOT,
      timeout=300,
      env=SUBPROCESS_ENV,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  # 40 windows in batches of 8: the bar reaches 5 of 5, named after the run.
  assert 'run: eval (40 windows)' in proc.stderr
  assert '5/5 [' in proc.stderr
  out = os.path.join(
      workdir,
      'eval',
      'step_3_window_start-deep_min_doc_len-400_min_start-64_num_windows-40',
  )
  res = json.load(open(os.path.join(out, 'results.json')))
  assert (
      res['settings']['window_start'] == 'deep'
      and res['settings']['min_start'] == 64
  )
  with np.load(os.path.join(out, 'windows.npz')) as w:
    doc, start, doc_len, kind = w['doc'], w['start'], w['doc_len'], w['kind']
    assert len(w['window_id']) == len(doc) == 40
  assert set(doc_len) <= {40 * 32 + 1, 20 * 32 + 1} and len(set(doc)) == 3
  assert (
      start.min() >= 64
      and np.all(start + 33 <= doc_len)
      and set(kind) == {'local_text'}
  )
  summary = res['windows']
  assert (
      summary['windows'],
      summary['documents'],
      summary['first_window_overlaps'],
  ) == (40, 3, 0)
  assert summary['kinds'] == {'local_text': {'windows': 40, 'documents': 3}}
  assert (
      summary['start']['min'] == start.min()
      and summary['long_doc_share'] == 1.0
  )
  assert (
      res['overall']['documents'] == 3 and res['buckets'][0]['documents'] == 3
  )
  depth = res['by_depth']
  assert sum(g['windows'] for g in depth) == 40 and depth[0]['lo'] >= 32
  assert sum(g['windows'] for g in res['by_end']) == 40
  assert '40 windows of 33 tokens from 3 documents' in proc.stdout
  assert 'by_depth' in proc.stdout and 'by_end' in proc.stdout
  groups = open(os.path.join(out, 'groups.csv')).read().splitlines()
  assert groups[0].startswith('table,group,start,end') and len(
      groups
  ) == 1 + 4 * (len(depth) + len(res['by_end']) + 1)


def test_eval_cli_names_its_own_flag_when_a_split_has_too_few_windows(
    tmp_path,
):
  workdir = _text_run(tmp_path)
  proc = subprocess.run(
      [
          sys.executable,
          str(ROOT / 'eval.py'),
          '--workdir',
          workdir,
          '--num_windows',
          '500',
      ],
      capture_output=True,
      text=True,
      cwd=ROOT,
      timeout=300,
      env=SUBPROCESS_ENV,
  )
  assert proc.returncode == 2, proc.stderr[-3000:]
  line = proc.stderr.strip().splitlines()[-1]
  assert line.startswith('eval.py: ') and 'Traceback' not in proc.stderr
  assert 'has only 5 documents with >= 33 tokens' in line
  assert '500 windows were requested (--num_windows)' in line
  assert 'pass --num_windows 5 or fewer' in line
  assert 'eval.num_windows' not in line


def test_an_option_equal_to_the_configs_own_value_names_no_variant(tmp_path):
  workdir = _text_run(
      tmp_path, window_start='deep', min_doc_len=400, num_windows=40
  )
  plain = eval_workdir.evaluate_workdir(workdir)
  assert os.path.basename(plain['out_dir']) == 'step_3'
  # The config's values again (min_start 0 resolves to T, its own default).
  same = eval_workdir.evaluate_workdir(
      workdir, window_start='deep', num_windows=40, min_start=32
  )
  assert same['out_dir'] == plain['out_dir']
  other = eval_workdir.evaluate_workdir(
      workdir, window_start='first', num_windows=3
  )
  assert os.path.basename(other['out_dir']) == (
      'step_3_window_start-first_num_windows-3'
  )


def _eval_command(*args):
  return subprocess.run(
      [sys.executable, str(ROOT / 'eval.py'), *args],
      capture_output=True,
      text=True,
      cwd=ROOT,
      env=SUBPROCESS_ENV,
      timeout=600,
  )


def test_an_output_that_cannot_be_written_is_refused_before_evaluating(
    tiny_run, tmp_path
):
  """--output naming a file, or WORKDIR/eval that cannot be created: one line,
  exit 2, before any checkpoint is read (a workdir without checkpoints would
  otherwise be refused for that)."""
  no_checkpoints = tmp_path / 'empty_run'
  no_checkpoints.mkdir()
  taken = tmp_path / 'taken'
  taken.write_text('not a directory')
  proc = _eval_command(f'--workdir={no_checkpoints}', f'--output={taken}')
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert proc.stderr.strip().splitlines() == [
      f'eval.py: --output {taken} exists and is not a directory; give a'
      ' directory path. Nothing was evaluated; give --output DIR, a directory'
      ' that can be written.'
  ]
  (no_checkpoints / 'eval').write_text('a file where results would go')
  proc = _eval_command(f'--workdir={no_checkpoints}')
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert (
      f'the results directory {no_checkpoints}/eval exists and is not a'
      ' directory' in proc.stderr
  )
  run = _copy_run(tiny_run, tmp_path)
  proc = _eval_command(f'--workdir={run}', f'--output={taken}/out')
  assert proc.returncode == 2, proc.stderr[-2000:]
  assert f'{taken} is a file, not a directory' in proc.stderr
  assert not os.path.exists(os.path.join(run, 'eval'))


def test_results_that_cannot_be_written_are_kept_elsewhere(
    tiny_run, tmp_path, monkeypatch
):
  import errno

  from flax_posemb import eval_report

  write = eval_report.write_outputs
  out = str(tmp_path / 'out')

  def read_only(results, per_position, out_dir, **kwargs):
    if out_dir == out:
      raise PermissionError(errno.EACCES, 'Permission denied', out_dir)
    return write(results, per_position, out_dir, **kwargs)

  monkeypatch.setattr(eval_report, 'write_outputs', read_only)
  with pytest.raises(PermissionError, match='the results are kept in') as e:
    eval_workdir.evaluate_workdir(tiny_run[0], output=out)
  kept = str(e.value).rsplit(' ', 1)[-1].rstrip('.')
  results = json.load(open(os.path.join(kept, 'results.json')))
  assert results['step'] == 20 and results['buckets']


def test_eval_of_a_workdir_a_trainer_holds_names_the_step_and_the_trainer(
    tiny_run, tmp_path
):
  from flax_posemb import workdir as workdir_lib

  run = _copy_run(tiny_run, tmp_path)
  with workdir_lib.Lock(run):
    out = eval_workdir.evaluate_workdir(run, output=str(tmp_path / 'out'))
  first = out['table'].splitlines()[0]
  assert first.startswith(
      'evaluated step 20, the newest checkpoint so far: a training process'
      ' (host '
  )
  assert f'pid {os.getpid()}) holds {run} and writes later steps.' in first
  out = eval_workdir.evaluate_workdir(run, output=str(tmp_path / 'out'))
  assert 'a training process' not in out['table']
