"""Position tables from files: from_array, model.position_init='file:...',
eval.py --table.

Every table file is written here (no download); shapes are tiny.
"""

import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from safetensors.numpy import save_file

from conftest import ROOT
from conftest import SUBPROCESS_ENV
from flax_posemb import defaults
from flax_posemb import initializers
from flax_posemb import tables
from flax_posemb.model import ModelConfig
from flax_posemb.model import TransformerLM

ROWS, WIDTH = 12, 8
SMALL = dict(
    vocab_size=16,
    num_layers=1,
    num_heads=2,
    emb_dim=WIDTH,
    mlp_dim=16,
    max_len=ROWS,
)
KEY = jax.random.key(0)


def _table(rows=ROWS, width=WIDTH, seed=0):
  return (
      np.random.default_rng(seed)
      .normal(0, 0.3, (rows, width))
      .astype(np.float32)
  )


def _model_table(**cfg):
  """Initializes a TransformerLM with `cfg` and returns
  params['pos_embed']['embedding']."""
  config = ModelConfig(**{**SMALL, **cfg})
  x = jnp.zeros((1, 4), jnp.int32)
  params = TransformerLM(config).init(KEY, x, x)['params']
  return np.asarray(params['pos_embed']['embedding'])


@pytest.fixture
def files(tmp_path):
  """One table `t` [ROWS, WIDTH] in every format, plus decoys, and the specs
  naming it."""
  t = _table()
  np.save(tmp_path / 't.npy', t)
  np.savez(tmp_path / 'many.npz', wpe=t, wte=_table(5, WIDTH, 1))
  np.savez(tmp_path / 'one.npz', only=t)
  save_file(
      {'wpe.weight': t, 'wte.weight': _table(5, WIDTH, 1)},
      str(tmp_path / 'gpt2.safetensors'),
  )
  np.save(tmp_path / 'cube.npy', np.zeros((2, 3, 4), np.float32))
  np.save(tmp_path / 'ints.npy', np.zeros((ROWS, WIDTH), np.int32))
  np.save(tmp_path / 'nan.npy', np.where(np.eye(ROWS, WIDTH) > 0, np.nan, t))
  return t, tmp_path


# ---- from_array
# ---------------------------------------------------------------------


def test_from_array_round_trip_cast_and_copy():
  t = _table()
  init = initializers.from_array(t)
  np.testing.assert_array_equal(
      np.asarray(init(KEY, (ROWS, WIDTH), jnp.float32)), t
  )
  got = init(KEY, (ROWS, WIDTH), jnp.bfloat16)
  assert got.dtype == jnp.bfloat16
  np.testing.assert_array_equal(np.asarray(got), t.astype(ml_dtypes.bfloat16))
  assert init.expected_std(WIDTH) == pytest.approx(float(t.std()), rel=1e-6)
  t[:] = 0  # The initializer holds its own copy.
  assert np.abs(np.asarray(init(KEY, (ROWS, WIDTH)))).sum() > 0


def test_from_array_shape_mismatch_names_both_shapes_and_the_fix():
  init = initializers.from_array(_table())
  with pytest.raises(ValueError) as e:
    init(KEY, (ROWS - 4, WIDTH))
  msg = str(e.value)
  for part in (
      f'({ROWS}, {WIDTH})',
      f'({ROWS - 4}, {WIDTH})',
      f'{ROWS} rows',
      'max_len',
      "'truncate'",
      "'interpolate'",
  ):
    assert part in msg, (part, msg)
  for resize in initializers.RESIZE_RULES:  # No rule changes the width.
    with pytest.raises(
        ValueError, match=rf'width is {WIDTH} features.*emb_dim={WIDTH}'
    ):
      initializers.from_array(_table(), resize=resize)(KEY, (ROWS, 2 * WIDTH))
  with pytest.raises(ValueError, match='2-D'):
    initializers.from_array(np.zeros(5))
  with pytest.raises(ValueError, match='resize rule'):
    initializers.from_array(_table(), resize='pad')


def test_resize_truncate_and_interpolate():
  t = _table()
  trunc = initializers.from_array(t, resize='truncate')
  np.testing.assert_array_equal(np.asarray(trunc(KEY, (5, WIDTH))), t[:5])
  with pytest.raises(ValueError, match="'truncate' only drops rows"):
    trunc(KEY, (ROWS + 1, WIDTH))
  # A table linear in the position is resampled exactly: row i = old position
  # i*(R-1)/(n-1).
  a, b = np.linspace(-1, 1, WIDTH), np.linspace(0.5, -0.3, WIDTH)
  lin = a + np.arange(ROWS)[:, None] * b
  interp = initializers.from_array(lin, resize='interpolate')
  for n in (4, ROWS, 2 * ROWS + 1):
    x = np.arange(n) * (ROWS - 1) / (n - 1)
    np.testing.assert_allclose(
        np.asarray(interp(KEY, (n, WIDTH))), a + x[:, None] * b, atol=1e-5
    )
  np.testing.assert_array_equal(
      initializers.fit_rows(t, 1, 'interpolate'), t[:1]
  )


# ---- model.position_init='file:...'
# -------------------------------------------------


@pytest.mark.parametrize(
    'spec', ['t.npy', 'many.npz:wpe', 'one.npz', 'gpt2.safetensors:wpe.weight']
)
def test_position_init_file_round_trip(files, spec):
  t, d = files
  np.testing.assert_array_equal(
      _model_table(position_init=f'file:{d / spec}'), t
  )


def test_position_init_file_bfloat16_safetensors(tmp_path):
  t = _table().astype(ml_dtypes.bfloat16)
  save_file({'wpe': t}, str(tmp_path / 'bf.safetensors'))
  got = _model_table(position_init=f'file:{tmp_path}/bf.safetensors:wpe')
  np.testing.assert_array_equal(got, t.astype(np.float32))


def test_position_init_resize_from_config(files):
  t, d = files
  spec = f'file:{d}/gpt2.safetensors:wpe.weight'
  with pytest.raises(
      ValueError, match=rf'\({ROWS}, {WIDTH}\).*\(6, {WIDTH}\).*max_len={ROWS}'
  ):
    # Fails at config time.
    ModelConfig(**{**SMALL, 'max_len': 6, 'position_init': spec})
  np.testing.assert_array_equal(
      _model_table(
          max_len=6, position_init=spec, position_init_resize='truncate'
      ),
      t[:6],
  )
  got = _model_table(
      max_len=2 * ROWS - 1,
      position_init=spec,
      position_init_resize='interpolate',
  )
  # Every other row is an original row.
  np.testing.assert_allclose(got[::2], t, atol=1e-6)
  np.testing.assert_allclose(got[1::2], (t[:-1] + t[1:]) / 2, atol=1e-6)
  with pytest.raises(ValueError, match='emb_dim'):
    ModelConfig(
        **{
            **SMALL,
            'emb_dim': 2 * WIDTH,
            'position_init': spec,
            'position_init_resize': 'interpolate',
        }
    )
  with pytest.raises(ValueError, match='resize rule'):
    ModelConfig(
        **{**SMALL, 'position_init': spec, 'position_init_resize': 'pad'}
    )
  # Reaches every config.
  assert defaults.model().position_init_resize == 'error'


@pytest.mark.parametrize(
    'spec, match',
    [
        ('missing.npy', 'not found'),
        ('many.npz:nope', "no key 'nope'.*Available keys: wpe, wte"),
        ('many.npz', 'holds 2 arrays.*Available keys: wpe, wte'),
        ('gpt2.safetensors:wpe', 'Available keys: wpe.weight, wte.weight'),
        ('cube.npy', r'2-D.*\(2, 3, 4\)'),
        ('ints.npy', 'floating-point'),
        ('nan.npy', f'{WIDTH} non-finite'),
        ('t.npy:key', 'takes no'),
        ('t.txt', 'expected PATH.npy'),
    ],
)
def test_position_init_file_errors_at_config_time(files, spec, match):
  _, d = files
  with pytest.raises(ValueError, match=match):
    ModelConfig(**{**SMALL, 'position_init': f'file:{d / spec}'})


def test_position_init_file_takes_no_std(files):
  _, d = files
  with pytest.raises(ValueError, match='takes no std'):
    ModelConfig(
        **{
            **SMALL,
            'position_init': f'file:{d}/t.npy',
            'position_init_std': 0.1,
        }
    )


def test_load_table_rereads_a_rewritten_file(tmp_path):
  path = tmp_path / 't.npy'
  np.save(path, _table(seed=1))
  tables.load_table(str(path))
  t2 = _table(rows=ROWS + 1, seed=2)
  np.save(path, t2)
  np.testing.assert_array_equal(tables.load_table(f'file:{path}'), t2)


# ---- eval.py --analyze --table
# ------------------------------------------------------


def _eval(*args):
  return subprocess.run(
      [sys.executable, str(ROOT / 'eval.py'), *args],
      capture_output=True,
      text=True,
      env=SUBPROCESS_ENV,
      cwd=str(ROOT),
      timeout=300,
  )


def test_eval_analyze_table_end_to_end(tmp_path):
  # A sinusoid table has known structure: near rows alike, position linearly
  # decodable.
  t = initializers.sinusoid_at(np.arange(64), 16).astype(np.float32)
  save_file(
      {'wpe.weight': t, 'wte.weight': t[:3]}, str(tmp_path / 'm.safetensors')
  )
  out = tmp_path / 'out'
  proc = _eval(
      '--analyze',
      '--table',
      f'{tmp_path}/m.safetensors:wpe.weight',
      '--output',
      str(out),
      '--buckets',
      'log2',
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  with open(out / 'table_analysis.json') as f:
    summary = json.load(f)
  assert str(out / 'table_analysis.json') in proc.stdout
  assert (summary['rows'], summary['features']) == (64, 16)
  assert summary['probe']['bucket_edges'] == [0, 1, 2, 4, 8, 16, 32, 64]
  assert summary['probe']['r2'] > 0.9
  assert len(summary['norm_by_bucket']) == 7
  # 8 sin/cos pairs
  np.testing.assert_allclose(summary['norm_by_bucket'], np.sqrt(8), rtol=1e-5)
  cos = summary['cosine_by_offset']
  assert list(cos) == ['1', '2', '4', '8', '16', '32'] and cos['1'] > cos['32']
  assert sum(summary['pca_explained_variance']) == pytest.approx(1.0)
  assert 'drift' in summary['skipped'] and 'drift_by_bucket' not in summary
  for key in ('table_plot', 'cosine_plot'):
    assert os.path.getsize(summary['files'][key]) > 0
    assert f"plot: {summary['files'][key]}" in proc.stdout
  # What it found, on the console too; a bar over the stages while it ran.
  r2 = summary['probe']['r2']
  assert f'position probe (held-out ridge): R^2 {r2:.3f}' in proc.stdout
  components = summary['pca_components_for_90pct']
  assert f'{components} principal components explain 90%' in proc.stdout
  assert 'row norm: first bucket 2.828' in proc.stdout
  assert 'analysis: 100%' in proc.stderr


@pytest.mark.parametrize(
    'args, match',
    [
        (
            ['--analyze', '--table', 'DIR/nope.npy', '--output', 'DIR/o'],
            'not found',
        ),
        (
            ['--analyze', '--table', 'DIR/t.npz:nope', '--output', 'DIR/o'],
            'Available keys: a, b',
        ),
        (['--analyze', '--table', 'DIR/cube.npy', '--output', 'DIR/o'], '2-D'),
        (
            ['--table', 'DIR/t.npz:a', '--output', 'DIR/o'],
            'needs --analyze and --output',
        ),
        (
            ['--analyze', '--table', 'DIR/t.npz:a'],
            'needs --analyze and --output',
        ),
    ],
)
def test_eval_analyze_table_bad_input_exits_2(tmp_path, args, match):
  np.savez(tmp_path / 't.npz', a=_table(), b=_table())
  np.save(tmp_path / 'cube.npy', np.zeros((2, 3, 4), np.float32))
  proc = _eval(*[a.replace('DIR', str(tmp_path)) for a in args])
  assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
  assert 'Traceback' not in proc.stderr
  assert match in proc.stderr
  assert not (tmp_path / 'o').exists()
