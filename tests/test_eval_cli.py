"""eval.py end to end on real Orbax checkpoints: table + plot path, comparison, probe, analysis."""

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

from flax_posemb import checkpointing
from flax_posemb import defaults
from flax_posemb import evaluation
from flax_posemb.model import ModelConfig, TransformerLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_LEN = 32


def _config(position_init='gpt2'):
  c = defaults.base()
  c.model.update(vocab_size=64, num_layers=1, num_heads=2, emb_dim=16, mlp_dim=32,
                 max_len=MAX_LEN, position_init=position_init)
  c.data.seq_len = MAX_LEN
  c.data.synthetic.num_docs = 64
  c.eval.update(num_windows=4, batch_size=4, bucket_size=8)
  return c


def _make_run(workdir, config, params_config=None, seed=0, steps=(0, 3)):
  """A workdir with step-0 and step-3 checkpoints, table snapshots and a stats window."""
  model = TransformerLM(ModelConfig.from_config((params_config or config).model))
  x = jnp.zeros((1, 4), jnp.int32)
  params = model.init(jax.random.key(seed), x, x)['params']
  tx = optax.adamw(1e-2)
  ckpt = checkpointing.Checkpointer(checkpointing.checkpoint_dir(workdir), max_to_keep=2,
                                    async_save=False)
  os.makedirs(os.path.join(workdir, 'tables'), exist_ok=True)
  for step in steps:
    table = np.asarray(params['pos_embed']['embedding'])
    np.save(os.path.join(workdir, 'tables', f'table_{step:08d}.npy'), table)
    ckpt.save(step, params=params, opt_state=tx.init(params), data_iter=None,
              stats={'count': np.arange(1, MAX_LEN + 1, dtype=np.int64)}, config=config)
    # A different table at the later step (drift for the analysis).
    params = jax.tree.map(lambda a: a, params)
    params['pos_embed']['embedding'] = params['pos_embed']['embedding'] * 0.5 + 0.01
  ckpt.close()
  os.makedirs(os.path.join(workdir, 'stats'), exist_ok=True)
  count = np.arange(MAX_LEN, 0, -1, dtype=np.int64) * 10
  np.savez(os.path.join(workdir, 'stats', 'window_00000003.npz'), count=count,
           cumulative_count=count)
  return workdir


@pytest.fixture(scope='module')
def runs(tmp_path_factory):
  base = tmp_path_factory.mktemp('runs')
  return (_make_run(str(base / 'init_gpt2'), _config('gpt2'), seed=0),
          _make_run(str(base / 'init_flax'), _config('flax_default'), seed=1, steps=(3,)))


def test_eval_cli_prints_table_and_plot_and_compares_two_runs(runs, tmp_path):
  out = str(tmp_path / 'out')
  cmd = [sys.executable, os.path.join(ROOT, 'eval.py'), '--workdir', runs[0], '--workdir', runs[1],
         '--output', out, '--offsets', '0,8', '--analyze']
  proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, timeout=300,
                        env=dict(os.environ, JAX_PLATFORMS='cpu'))
  assert proc.returncode == 0, proc.stderr[-3000:]
  text = proc.stdout
  assert '[0, 8)' in text and '[24, 32)' in text and 'overall loss' in text
  assert 'K=8' in text and 'off the training distribution' in text
  plot = os.path.join(out, 'init_gpt2', 'loss_by_position.png')
  assert f'plot: {plot}' in text and os.path.getsize(plot) > 0
  res = json.load(open(os.path.join(out, 'init_gpt2', 'results.json')))
  assert res['step'] == 3 and [b['start'] for b in res['buckets']] == [0, 8, 16, 24]
  assert {'loss', 'stderr', 'ci95', 'bits_per_token', 'tokens', 'windows', 'bayes_loss',
          'filter_loss', 'excess_loss', 'recovered'} <= set(res['buckets'][0])
  assert res['offset_probe']['window_len'] == 24
  npz = np.load(os.path.join(out, 'init_gpt2', 'per_position.npz'))
  assert npz['loss'].shape == (MAX_LEN,) and npz['offset_loss'].shape == (2, 24)
  comp = json.load(open(os.path.join(out, 'comparison.json')))
  assert [r['label'] for r in comp['runs']] == ['init_gpt2', 'init_flax']
  assert comp['buckets'][0]['init_flax']['loss'] is not None
  assert comp['runs'][0]['overall']['loss'] != comp['runs'][1]['overall']['loss']
  assert f"plot: {os.path.join(out, 'comparison.png')}" in text
  analysis = json.load(open(os.path.join(out, 'init_gpt2', 'analysis', 'analysis.json')))
  assert analysis['step'] == 3 and 'exposure' in analysis and analysis['drift_by_bucket'][0] > 0
  assert os.path.getsize(os.path.join(out, 'init_gpt2', 'analysis', 'exposure_relation.png')) > 0


def test_eval_default_output_dir_and_step_selection(runs):
  run = evaluation.evaluate_workdir(runs[0], step=0, bucket_edges='log2')
  assert run['out_dir'] == os.path.join(runs[0], 'eval', 'step_0')
  assert run['results']['step'] == 0
  assert [b['end'] for b in run['results']['buckets']] == [1, 2, 4, 8, 16, 32]
  assert os.path.exists(os.path.join(runs[0], 'eval', 'step_0', 'buckets.csv'))


def test_checkpoint_of_a_different_context_length_is_a_clear_error(tmp_path):
  bigger = _config()
  bigger.model.max_len = 2 * MAX_LEN
  bigger.data.seq_len = 2 * MAX_LEN
  workdir = _make_run(str(tmp_path / 'mismatch'), bigger, params_config=_config(), steps=(3,))
  with pytest.raises(ValueError, match=r'do not match the model config \(max_len=64.*pos_embed'):
    evaluation.evaluate_workdir(workdir)


def test_offset_past_the_table_via_workdir_is_a_clear_error(runs):
  with pytest.raises(ValueError, match=f'largest valid offset is {MAX_LEN - 1}'):
    evaluation.evaluate_workdir(runs[0], offsets=[0, MAX_LEN])


def test_comparison_of_different_windows_is_a_clear_error(runs):
  a = evaluation.evaluate_workdir(runs[0])['results']
  b = evaluation.evaluate_workdir(runs[1], window_len=16)['results']
  from flax_posemb import eval_report  # pylint: disable=g-import-not-at-top
  with pytest.raises(ValueError, match='different windows'):
    eval_report.compare(['a', 'b'], [a, b], '/tmp/unused_compare')
