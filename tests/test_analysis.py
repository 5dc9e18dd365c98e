"""Table analysis: norms, drift, cosine similarity, PCA, the held-out position
probe."""

import json
import os

import numpy as np
import pytest

from flax_posemb import analysis
from flax_posemb import analysis_report


def _helix(num=64, dim=8, noise=0.0, seed=0):
  """A GPT-2-like table: low-rank helix plus a linear ramp (position is linearly
  decodable)."""
  p = np.arange(num)[:, None]
  freqs = np.array([[1, 2, 3]]) * 2 * np.pi / num
  t = np.concatenate(
      [np.sin(p * freqs), np.cos(p * freqs), p / num, np.zeros((num, dim - 7))],
      1,
  )
  return t + noise * np.random.default_rng(seed).normal(size=t.shape)


def test_norms_drift_and_cosine_similarity():
  t = np.array([[3.0, 4.0], [0.0, 0.0], [-3.0, -4.0]])
  np.testing.assert_allclose(analysis.row_norms(t), [5, 0, 5])
  np.testing.assert_allclose(analysis.drift(t, np.zeros_like(t)), [5, 0, 5])
  sim = analysis.cosine_similarity(t)
  np.testing.assert_allclose(sim[0], [1, 0, -1])


def test_pca_explained_variance_sees_the_rank():
  t = _helix()
  ratio = analysis.pca_explained_variance(t)
  np.testing.assert_allclose(ratio.sum(), 1.0)
  # seven non-zero directions
  assert ratio[:7].sum() > 0.999 and ratio[7] < 1e-12


def test_position_probe_decodes_structure_not_noise():
  good = analysis.position_probe(_helix())
  assert good['r2'] > 0.99 and good['abs_error'].mean() < 1.0
  noise = analysis.position_probe(np.random.default_rng(0).normal(size=(64, 8)))
  assert noise['r2'] < 0.5  # held-out prediction: random rows carry no position


def test_analyze_workdir_writes_plots_json_and_exposure_relation(tmp_path):
  workdir = str(tmp_path / 'run')
  os.makedirs(os.path.join(workdir, 'tables'))
  os.makedirs(os.path.join(workdir, 'stats'))
  init = _helix(noise=0.5, seed=1) * 0.1
  final = _helix(noise=0.05, seed=2)
  np.save(os.path.join(workdir, 'tables', 'table_0.npy'), init)
  np.save(os.path.join(workdir, 'tables', 'table_10.npy'), (init + final) / 2)
  np.save(os.path.join(workdir, 'tables', 'table_20.npy'), final)
  count = np.linspace(100, 1, 64)
  for step in (10, 20, 30):
    np.savez(
        os.path.join(workdir, 'stats', f'window_{step}.npz'),
        count=count,
        loss_sum=count * 2.0,
    )
  loss = np.linspace(2.0, 3.0, 64)
  per_position = {
      'loss': loss,
      'bayes_loss': np.full(64, 1.5),
      'filter_loss': np.full(64, 3.5),
  }
  out = str(tmp_path / 'out')
  summary = analysis_report.analyze_workdir(
      workdir, final, out, step=20, per_position=per_position, bucket_size=16
  )
  # step 30 excluded
  assert summary['exposure']['total_tokens'] == pytest.approx(2 * count.sum())
  np.savez(
      os.path.join(workdir, 'stats', 'window_00000025.npz'),
      count=count,
      cumulative_count=np.arange(64) * 7,
  )  # exact counts win when present
  np.testing.assert_array_equal(
      analysis.cumulative_exposure(os.path.join(workdir, 'stats'), 25),
      np.arange(64) * 7,
  )
  # rarer -> worse
  assert summary['exposure']['spearman_loss'] == pytest.approx(-1.0)
  assert summary['exposure']['spearman_recovered'] == pytest.approx(1.0)
  assert list(summary['snapshot_mean_drift']) == ['0', '10', '20']
  assert len(summary['probe']['abs_error_by_bucket']) == 4
  for key in ('table_plot', 'cosine_plot', 'exposure_plot', 'arrays', 'json'):
    assert os.path.getsize(summary['files'][key]) > 0
  with open(summary['files']['json']) as f:
    assert json.load(f)['rows'] == 64
  arrays = np.load(summary['files']['arrays'])
  np.testing.assert_allclose(arrays['drift'], analysis.drift(final, init))


def _window(workdir, step, count):
  os.makedirs(os.path.join(workdir, 'stats'), exist_ok=True)
  np.savez(
      os.path.join(workdir, 'stats', f'window_{step}.npz'),
      step=np.int64(step),
      count=np.asarray(count, np.int64),
      cumulative_count=np.asarray(count, np.int64) * step,
  )


def test_window_readers_ignore_temporary_files(tmp_path):
  from flax_posemb.experiments import measures

  workdir = str(tmp_path)
  _window(workdir, 5, [1, 2])
  _window(workdir, 10, [3, 4])
  stats = tmp_path / 'stats'
  # an old killed writer
  (stats / 'window_15.npz.tmp.npz').write_bytes(b'PK\x03\x04half')
  # the current temp name
  (stats / '.window_15.npz.tmp').write_bytes(b'PK\x03\x04half')
  (stats / 'window_x.npz').write_bytes(b'')
  np.testing.assert_array_equal(
      analysis.cumulative_exposure(str(stats)), [30, 40]
  )
  assert [int(w['step']) for w in measures.load_windows(workdir)] == [5, 10]


def test_truncated_window_file_is_a_clear_error_naming_it(tmp_path):
  from flax_posemb.experiments import measures

  workdir = str(tmp_path)
  _window(workdir, 5, [1, 2])
  _window(workdir, 10, [3, 4])
  path = tmp_path / 'stats' / 'window_10.npz'
  path.write_bytes(path.read_bytes()[:40])
  with pytest.raises(ValueError, match='window_10.npz is damaged'):
    analysis.cumulative_exposure(str(tmp_path / 'stats'))
  with pytest.raises(ValueError, match='window_10.npz is damaged'):
    measures.load_windows(workdir)
  assert (
      analysis.cumulative_exposure(str(tmp_path / 'stats'), upto_step=5)
      is not None
  )


def test_stats_analysis_sums_any_window_directory_against_exposure(
    tmp_path,
):
  d = tmp_path / 'mine'
  d.mkdir()
  count = np.arange(1, 9)
  for step in (3, 6):
    np.savez(
        d / f'window_{step}.npz',
        step=np.int64(step),
        first_step=np.int64(step - 2),
        count=count,
        loss_sum=count * 2.0,
        loss_count=count,
        occ_norm=count * 3.0,
        cumulative_count=count * step // 3,
    )
  summary = analysis_report.analyze_stats(str(d), str(tmp_path / 'out'))
  assert (summary['windows'], summary['first_step'], summary['last_step']) == (
      2,
      1,
      6,
  )
  assert summary['exposure']['total_tokens'] == 2 * count.sum()
  arrays = np.load(summary['files']['arrays'])
  np.testing.assert_array_equal(arrays['count'], 2 * count)
  np.testing.assert_array_equal(arrays['signal_per_occurrence'], 3.0)
  np.testing.assert_array_equal(arrays['mean_loss'], 2.0)
  assert os.path.getsize(summary['files']['exposure_plot']) > 0
  with pytest.raises(ValueError, match='no statistics window files'):
    analysis_report.analyze_stats(str(tmp_path / 'out'), str(tmp_path / 'out2'))


@pytest.mark.parametrize(
    'args, message',
    [
        (
            ['--analyze', '--stats', 'DIR/none', '--output', 'DIR/o'],
            'no statistics window files',
        ),
        (
            ['--stats', 'DIR', '--output', 'DIR/o'],
            'needs --analyze and --output',
        ),
        (['--analyze', '--stats', 'DIR', '--workdir', 'DIR'], 'no --workdir'),
    ],
)
def test_eval_stats_bad_input_is_one_line_and_exit_code_2(
    tmp_path, args, message
):
  import subprocess
  import sys

  from conftest import ROOT
  from conftest import SUBPROCESS_ENV

  argv = [a.replace('DIR', str(tmp_path)) for a in args]
  proc = subprocess.run(
      [sys.executable, str(ROOT / 'eval.py'), *argv],
      cwd=str(ROOT),
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert (
      proc.returncode == 2
      and message in proc.stderr
      and 'Traceback' not in proc.stderr
  )
