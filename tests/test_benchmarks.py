"""Smoke tests of benchmarks/run.py on miniature shapes (no timing assertions)."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from benchmarks import common
from benchmarks import reference_model as ref
from benchmarks import report
from benchmarks import run


def _library_to_reference(p) -> dict:
  """Maps TransformerLM params onto the reference's dict with kernels [in, out].

  The library's kernel layout is read off the qkv kernel (`[D, 3D]` = in/out, `[3D, D]` =
  out/in), so the test holds whichever layout model.py uses.
  """
  blocks = []
  d = p['token_embed']['embedding'].shape[1]
  out_in = p['block_0']['qkv']['kernel'].shape[0] != d
  kern = (lambda k: k.T) if out_in else (lambda k: k)
  i = 0
  while f'block_{i}' in p:
    b = p[f'block_{i}']
    blocks.append({
        'ln_1': dict(b['ln_1']), 'ln_2': dict(b['ln_2']),
        'qkv_w': kern(b['qkv']['kernel']), 'qkv_b': b['qkv']['bias'],
        'proj_w': kern(b['attn_out']['kernel']), 'proj_b': b['attn_out']['bias'],
        'fc_w': kern(b['mlp_in']['kernel']), 'fc_b': b['mlp_in']['bias'],
        'out_w': kern(b['mlp_out']['kernel']), 'out_b': b['mlp_out']['bias'],
    })
    i += 1
  return {'wte': p['token_embed']['embedding'], 'wpe': p['pos_embed']['embedding'],
          'blocks': blocks, 'ln_f': dict(p['ln_f'])}


def test_reference_model_computes_the_same_function_as_the_library_model():
  # The side-by-side comparison is only fair if both compute the same GPT-2.
  from flax_posemb import model as model_lib
  s = common.MINI
  mc = model_lib.ModelConfig(vocab_size=s.vocab_size, num_layers=2, num_heads=s.num_heads,
                             emb_dim=s.emb_dim, mlp_dim=s.mlp, max_len=s.seq_len,
                             check_positions=False)
  lm = model_lib.TransformerLM(mc)
  batch = common.synthetic_batch(s.replace(num_layers=2), seed=3, packed_docs=2)
  params = lm.init(jax.random.key(0), batch['inputs'], batch['positions'],
                   segment_ids=batch['segment_ids'])['params']
  want = lm.apply({'params': params}, batch['inputs'], batch['positions'],
                  segment_ids=batch['segment_ids'])
  cfg = ref.RefConfig(s.vocab_size, 2, s.num_heads, s.emb_dim, s.mlp, s.seq_len)
  got = ref.forward(cfg, _library_to_reference(params), batch['inputs'], batch['positions'],
                    batch['segment_ids'])
  np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=1e-4)
  # out_in layout is the same function once the kernels are transposed.
  cfg_t = ref.RefConfig(s.vocab_size, 2, s.num_heads, s.emb_dim, s.mlp, s.seq_len,
                        kernel_layout='out_in')
  tp = _library_to_reference(params)
  for b in tp['blocks']:
    for k in ('qkv_w', 'proj_w', 'fc_w', 'out_w'):
      b[k] = b[k].T
  got_t = ref.forward(cfg_t, tp, batch['inputs'], batch['positions'], batch['segment_ids'])
  np.testing.assert_allclose(np.asarray(got_t), np.asarray(want), atol=2e-5, rtol=1e-4)


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


def test_flops_per_token_follows_6n_plus_attention():
  s = common.SMALL
  assert common.flops_per_token(s, 1000) == 6000 + 12 * 4 * 256 * 256


def test_unknown_suite_is_a_clear_error():
  with pytest.raises(SystemExit, match='Unknown suite'):
    run.select('train,nope')


def test_run_emits_valid_json_and_a_table(tmp_path):
  out = tmp_path / 'r.json'
  result = run.main(['--suite', 'side_by_side,overhead,eval,accel', '--mini', '--steps', '2',
                     '--peers', 'reference,not_a_peer', '--out', str(out)])
  loaded = json.loads(out.read_text())
  s = loaded['suites']
  names = [r['name'] for r in s['side_by_side']['rows']]
  assert names[:2] == ['flax_posemb (stats on)', 'flax_posemb (stats off)']
  assert any('plain JAX reference' in n for n in names)
  assert 'not_a_peer' in s['side_by_side']['skipped']
  for r in s['side_by_side']['rows']:
    assert r['tokens_per_s'] > 0 and 0 < r['mfu'] and r['min_s'] <= r['median_s'] <= r['max_s']
  assert len(s['overhead']['overhead_per_block']) == 2
  lo, hi = s['overhead']['overhead_ci95']
  assert lo <= hi
  assert s['eval']['eval_over_train'] > 0
  assert 'skipped' in s['accel'] or s['accel']['rows']
  assert 'stats_overhead' in loaded['summary'] and 'vs_fastest_peer' in loaded['summary']
  table = report.markdown(result)
  assert '| flax_posemb (stats on) |' in table and 'statistics overhead' in table
