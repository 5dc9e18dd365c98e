"""Smoke tests of benchmarks/run.py on miniature shapes (no timing
assertions)."""

from __future__ import annotations

import dataclasses
import json

import jax
import numpy as np
import pytest

from benchmarks import common
from benchmarks import reference_model as ref
from benchmarks import report
from benchmarks import run
from benchmarks import steps


def _library_to_reference(p) -> dict:
  """Maps TransformerLM params onto the reference's dict with kernels [in, out].

  The library's kernel layout is read off the qkv kernel (`[D, 3D]` = in/out,
  `[3D, D]` = out/in), so the test holds whichever layout model.py uses."""
  blocks = []
  d = p['token_embed']['embedding'].shape[1]
  out_in = p['block_0']['qkv']['kernel'].shape[0] != d
  kern = (lambda k: k.T) if out_in else (lambda k: k)
  i = 0
  while f'block_{i}' in p:
    b = p[f'block_{i}']
    blocks.append(
        {
            'ln_1': dict(b['ln_1']),
            'ln_2': dict(b['ln_2']),
            'qkv_w': kern(b['qkv']['kernel']),
            'qkv_b': b['qkv']['bias'],
            'proj_w': kern(b['attn_out']['kernel']),
            'proj_b': b['attn_out']['bias'],
            'fc_w': kern(b['mlp_in']['kernel']),
            'fc_b': b['mlp_in']['bias'],
            'out_w': kern(b['mlp_out']['kernel']),
            'out_b': b['mlp_out']['bias'],
        }
    )
    i += 1
  return {
      'wte': p['token_embed']['embedding'],
      'wpe': p['pos_embed']['embedding'],
      'blocks': blocks,
      'ln_f': dict(p['ln_f']),
  }


def test_reference_model_computes_the_same_function_as_the_library_model():
  # The side-by-side comparison is only fair if both compute the same GPT-2.
  from flax_posemb import model as model_lib

  s = common.MINI
  mc = model_lib.ModelConfig(
      vocab_size=s.vocab_size,
      num_layers=2,
      num_heads=s.num_heads,
      emb_dim=s.emb_dim,
      mlp_dim=s.mlp,
      max_len=s.seq_len,
  )
  lm = model_lib.TransformerLM(mc)
  batch = common.synthetic_batch(s.replace(num_layers=2), seed=3, packed_docs=2)
  params = lm.init(
      jax.random.key(0),
      batch['inputs'],
      batch['positions'],
      segment_ids=batch['segment_ids'],
  )['params']
  want = lm.apply(
      {'params': params},
      batch['inputs'],
      batch['positions'],
      segment_ids=batch['segment_ids'],
  )
  cfg = ref.RefConfig(s.vocab_size, 2, s.num_heads, s.emb_dim, s.mlp, s.seq_len)
  got = ref.forward(
      cfg,
      _library_to_reference(params),
      batch['inputs'],
      batch['positions'],
      batch['segment_ids'],
  )
  np.testing.assert_allclose(
      np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-4
  )
  # out_in layout is the same function once the kernels are transposed.
  cfg_t = ref.RefConfig(
      s.vocab_size,
      2,
      s.num_heads,
      s.emb_dim,
      s.mlp,
      s.seq_len,
      kernel_layout='out_in',
  )
  tp = _library_to_reference(params)
  for b in tp['blocks']:
    for k in ('qkv_w', 'proj_w', 'fc_w', 'out_w'):
      b[k] = b[k].T
  got_t = ref.forward(
      cfg_t, tp, batch['inputs'], batch['positions'], batch['segment_ids']
  )
  np.testing.assert_allclose(
      np.asarray(got_t), np.asarray(want), atol=2e-5, rtol=1e-4
  )


def test_reference_train_step_lowers_loss():
  cfg = ref.RefConfig(32, 1, 2, 32, 64, 16)
  params = ref.init(cfg, jax.random.key(0))
  tx = ref.make_optimizer(learning_rate=1e-2)
  step = ref.make_train_step(cfg, tx)
  batch = jax.device_put(common.synthetic_batch(common.MINI))
  opt_state = tx.init(params)
  losses = []
  for _ in range(15):
    params, opt_state, loss = step(params, opt_state, batch)
    losses.append(float(loss))
  assert losses[-1] < losses[0] - 0.5, losses


def test_bootstrap_ci_brackets_the_median_and_narrows_with_more_data():
  rng = np.random.default_rng(0)
  small = rng.normal(0.02, 0.01, 6)
  lo, hi = common.bootstrap_ci(small)
  assert lo <= np.median(small) <= hi
  lo2, hi2 = common.bootstrap_ci(rng.normal(0.02, 0.01, 200))
  assert hi2 - lo2 < hi - lo


def test_flops_per_token_is_what_xla_counts_for_the_train_step():
  """6 N + 12 L D T against XLA's own count of the compiled step (plain-JAX
  reference, where matmuls dominate): the MFU figures rest on it."""
  shape = dataclasses.replace(
      common.SMALL,
      name='flops',
      num_layers=2,
      emb_dim=128,
      seq_len=128,
      batch_size=4,
  )
  runner = steps.reference_train(shape)
  cost = runner.lower().compile().cost_analysis()
  if isinstance(cost, list):  # Older jax: one dict per computation.
    cost = cost[0]
  counted = cost['flops'] / (shape.batch_size * shape.seq_len)
  formula = common.flops_per_token(shape, runner.n_params_no_pos)
  assert 0.9 < counted / formula < 1.1, (counted, formula)


def test_unknown_suite_is_a_clear_error():
  with pytest.raises(SystemExit, match='Unknown suite'):
    run.select('train,nope')


def test_run_emits_valid_json_and_a_table(tmp_path):
  out = tmp_path / 'r.json'
  result = run.main(
      [
          '--suite',
          'side_by_side,overhead,eval,accel',
          '--mini',
          '--steps',
          '2',
          '--peers',
          'reference,not_a_peer',
          '--out',
          str(out),
      ]
  )
  loaded = json.loads(out.read_text())
  s = loaded['suites']
  names = [r['name'] for r in s['side_by_side']['rows']]
  assert names[:2] == ['flax_posemb (stats on)', 'flax_posemb (stats off)']
  assert any('plain JAX reference' in n for n in names)
  assert 'not_a_peer' in s['side_by_side']['skipped']
  for r in s['side_by_side']['rows']:
    assert (
        r['tokens_per_s'] > 0
        and 0 < r['mfu']
        and r['min_s'] <= r['median_s'] <= r['max_s']
    )
  assert len(s['overhead']['overhead_per_block']) == 2
  lo, hi = s['overhead']['overhead_ci95']
  assert lo <= hi
  assert s['eval']['eval_over_train'] > 0
  assert 'skipped' in s['accel'] or s['accel']['rows']
  assert (
      'stats_overhead' in loaded['summary']
      and 'vs_fastest_peer' in loaded['summary']
  )
  table = report.markdown(result)
  assert (
      '| flax_posemb (stats on) |' in table and 'statistics overhead' in table
  )


# --- Per-process harness, configs without ml_collections, device-image
# simulation, export.

_DEVICE_IMAGE_SITECUSTOMIZE = """
import sys
# Packages the GPU device image does not have (or that the accelerator path
# must not need).
_BLOCKED = {'grain', 'tensorflow_datasets', 'tensorflow', 'ml_collections',
            'array_record', 'tensorboardX', 'sentencepiece', 'tqdm',
            'matplotlib', 'safetensors', 'torch', 'transformers'}
class _Refuse:
  def find_spec(self, name, path=None, target=None):
    if name.partition('.')[0] in _BLOCKED:
      raise ModuleNotFoundError(
          f'No module named {name!r} (device-image simulation)', name=name)
    return None
sys.meta_path.insert(0, _Refuse())
"""


def test_benchmark_config_matches_the_project_defaults():
  # benchmarks.common.base_config avoids ml_collections; it must carry the same
  # values.
  from flax_posemb import defaults

  want = defaults.base().to_dict()

  def check(got, ref, path=''):
    for k, v in got.items():
      assert k in ref, f'{path}{k} is not a field of defaults.base()'
      if isinstance(v, dict):
        check(v, ref[k], f'{path}{k}.')
      else:
        assert v == ref[k], f'{path}{k}: {v!r} != defaults {ref[k]!r}'

  check(common.base_config().to_dict(), want)
  c = common.model_config(common.MINI, **{'model.remat': True})
  assert c.model.remat and c.optimizer.b2 == want['optimizer']['b2']
  with pytest.raises(KeyError, match='unknown config field'):
    common.model_config(common.MINI, **{'model.nope': 1})


def test_per_process_spec_parsing():
  from benchmarks import per_process

  name, over, env = per_process.parse_spec(
      "stats_off:model.attention_impl='blocked';model.remat=True;"
      'env.XLA_FLAGS=--x=1'
  )
  assert name == 'stats_off' and over == {
      'model.attention_impl': 'blocked',
      'model.remat': True,
  }
  assert env == {'XLA_FLAGS': '--x=1'}
  assert per_process.split_specs(
      'stats_on,stats_off:env.XLA_FLAGS=--a=+x,+y;model.remat=True,'
      'torch_compile'
  ) == [
      'stats_on',
      'stats_off:env.XLA_FLAGS=--a=+x,+y;model.remat=True',
      'torch_compile',
  ]
  with pytest.raises(ValueError, match='unknown implementation'):
    per_process.parse_spec('nope')
  with pytest.raises(ValueError, match='overrides apply'):
    per_process.parse_spec('reference:model.remat=True')
  assert per_process.parse_spec('torch_compile:grad_accum_steps=4')[1] == {
      'grad_accum_steps': 4
  }
  with pytest.raises(ValueError, match='overrides apply'):
    per_process.parse_spec('torch_eager:model.remat=True')


def test_torch_microbatched_step_matches_the_full_batch_step():
  # The like-for-like PyTorch row (torch_compile:grad_accum_steps=4) must train
  # on the same loss and gradient as the full batch, only cut into microbatches.
  pytest.importorskip('torch')
  pytest.importorskip('transformers')
  from benchmarks import common
  from benchmarks import steps

  full = steps.torch_train(common.MINI, False, threads=1)
  micro = steps.torch_train(common.MINI, False, threads=1, grad_accum_steps=2)
  # later losses depend on the updates, i.e. on the gradients
  for _ in range(3):
    assert micro.call() == pytest.approx(full.call(), rel=1e-5)
  with pytest.raises(ValueError, match='not divisible'):
    steps.torch_train(common.MINI, False, grad_accum_steps=3)


def test_per_process_runs_each_implementation_in_its_own_process(tmp_path):
  from benchmarks import per_process

  out = tmp_path / 'pp.json'
  res = per_process.main(
      [
          '--shape',
          'mini',
          '--rounds',
          '2',
          '--steps',
          '1',
          '--warmup',
          '1',
          '--impls',
          'stats_off,reference',
          '--ratio_to',
          'reference',
          '--out',
          str(out),
      ]
  )
  loaded = json.loads(out.read_text())
  assert [r['order'] for r in loaded['rounds']][1][0] != loaded['rounds'][0][
      'order'
  ][0]
  pids = {
      r[s]['pid'] for r in loaded['rounds'] for s in ('stats_off', 'reference')
  }
  assert len(pids) == 4  # a fresh process per implementation per round
  rows = {r['spec']: r for r in res['aggregate']['rows']}
  assert rows['stats_off']['tokens_per_s']['n'] == 2
  assert rows['reference']['ratio_to_reference']['median'] == pytest.approx(1.0)
  assert loaded['aggregate']['peaks']['jax']['n'] == 2
  assert 'fp32 matmul peak' in per_process.markdown(res)


def test_accel_script_runs_with_only_the_device_image_packages(tmp_path):
  # benchmarks/accel.sh as on the GPU image: ml_collections, grain, tfds, torch,
  # ... are unimportable; the miniature shape on CPU (--accel_force).
  import os
  import subprocess
  import sys

  site = tmp_path / 'site'
  site.mkdir()
  (site / 'sitecustomize.py').write_text(_DEVICE_IMAGE_SITECUSTOMIZE)
  root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
  env = dict(
      os.environ,
      PYTHONPATH=str(site),
      JAX_PLATFORMS='cpu',
      OUT=str(tmp_path / 'out'),
      STEPS='1',
      PYTHON=sys.executable,
  )
  probe = subprocess.run(
      [sys.executable, '-c', 'import ml_collections'],
      env=env,
      capture_output=True,
      text=True,
  )
  assert probe.returncode != 0 and 'device-image simulation' in probe.stderr
  p = subprocess.run(
      [
          'bash',
          os.path.join(root, 'benchmarks', 'accel.sh'),
          '--accel_force',
          '--warmup',
          '1',
      ],
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  res = json.loads((tmp_path / 'out' / 'accel.json').read_text())
  acc = res['suites']['accel']
  variants = {r['variant'] for r in acc['rows']}
  assert {'stats_on_xla', 'stats_off_xla', 'reference'} <= variants, (
      variants,
      acc['failed'],
  )
  assert all(r['tokens_per_s'] > 0 and r['memory'] for r in acc['rows'])
  assert res['machine']['torch'] is None and res['machine']['grain'] is None


def test_gpt2_small_train_step_exports_for_cuda_from_a_cpu():
  # A GPU-only lowering error (dtype, custom call) shows up here, not on the
  # device.
  from benchmarks import accel

  exp = accel.export_train_step(
      common.GPT2_SMALL, ('cuda',), True, **{'model.attention_impl': 'xla'}
  )
  assert exp.platforms == ('cuda',)
  assert 'bf16' in exp.mlir_module()


def test_cudnn_attention_step_exports_for_cuda_where_jax_allows_it():
  from benchmarks import accel

  try:
    exp = accel.export_train_step(
        common.GPT2_SMALL.replace(num_layers=1),
        ('cuda',),
        False,
        **{'model.attention_impl': 'cudnn'},
    )
  except RuntimeError as e:  # jax checks the local cuDNN version while tracing
    if 'cuDNN is not detected' not in str(e):
      raise
    pytest.skip(
        f'cudnn attention cannot be lowered for cuda on a CPU-only jaxlib ({e})'
    )
  assert 'cudnn' in exp.mlir_module()
