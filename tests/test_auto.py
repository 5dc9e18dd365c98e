"""The fast exact path by default: auto attention and auto microbatches
(flax_posemb.auto)."""

import json

import jax
import numpy as np
import pytest

from conftest import tiny_config
from flax_posemb import auto
from flax_posemb import config as config_lib
from flax_posemb import sharding
from flax_posemb import train_step


def test_cpu_microbatches_hold_at_most_1k_tokens_and_divide_the_batch():
  def k(b, t, n=1):
    return auto.grad_accum_steps(
        0, platform='cpu', batch_size=b, seq_len=t, num_devices=n  # noqa: E731
    )

  # the benchmark's small shape: 4 microbatches of 4 rows
  assert k(16, 256) == 4
  assert k(16, 128) == 2 and k(8, 32) == 1 and k(12, 256) == 3
  assert k(4, 2048) == 4  # a row longer than 1k tokens: one row per microbatch
  assert k(16, 256, n=2) == 2  # per device: 8 rows
  assert (
      auto.grad_accum_steps(
          0, platform='gpu', batch_size=16, seq_len=256, num_devices=1
      )
      == 1
  )
  assert (
      auto.grad_accum_steps(
          3, platform='cpu', batch_size=16, seq_len=256, num_devices=1
      )
      == 3
  )


def test_auto_attention_is_blocked_on_cpu_and_cudnn_only_where_it_applies():
  def a(**kw):
    return auto.attention_impl(
        'auto',
        **{
            **dict(  # noqa: E731
                platform='gpu',
                dtype='bfloat16',
                head_dim=64,
                seq_len=1024,
                compute_capability=(9, 0),
            ),
            **kw,
        },
    )

  assert a(platform='cpu', dtype='float32') == 'blocked'
  assert a() == 'cudnn'
  assert a(dtype='float32') == 'xla'
  assert a(compute_capability=(7, 5)) == 'xla'
  assert a(head_dim=12) == 'xla' and a(seq_len=1023) == 'xla'
  assert a(platform='tpu') == 'xla'
  assert (
      auto.attention_impl(
          'xla', platform='cpu', dtype='float32', head_dim=8, seq_len=8
      )
      == 'xla'
  )


def test_resolution_keeps_explicit_values_and_a_resume_keeps_its_record():
  def typed(c):
    return config_lib.RunConfig.from_config_dict(c)

  c = tiny_config()
  c.batch_size, c.data.seq_len = 16, 256
  c.model.max_len = 256
  resolved, done = auto.resolve_config(typed(c), platform='cpu', num_devices=1)
  assert done == {
      'model.attention_impl': ('auto', 'blocked'),
      'grad_accum_steps': (0, 4),
  }
  assert resolved.model.attention_impl == 'blocked'
  assert resolved.grad_accum_steps == 4
  c = tiny_config()
  c.model.attention_impl, c.grad_accum_steps = 'xla', 2
  resolved, done = auto.resolve_config(typed(c), platform='cpu', num_devices=1)
  assert done == {}
  assert (resolved.model.attention_impl, resolved.grad_accum_steps) == (
      'xla',
      2,
  )
  c = tiny_config()
  saved = json.loads(c.to_json())
  saved['model']['attention_impl'], saved['grad_accum_steps'] = 'xla', 8
  resolved, _ = auto.resolve_config(
      typed(c), saved=saved, platform='cpu', num_devices=1
  )
  assert (resolved.model.attention_impl, resolved.grad_accum_steps) == (
      'xla',
      8,
  )
  # another batch: the recorded microbatches do not apply
  saved['batch_size'] = 64
  resolved, _ = auto.resolve_config(
      typed(tiny_config()), saved=saved, platform='cpu', num_devices=1
  )
  assert resolved.grad_accum_steps == 1


def _hand_batch(b, t, vocab, seed):
  rng = np.random.default_rng(seed)
  seg = np.ones((b, t), np.int32)
  seg[1, t // 2 :] = 2  # a packed second document
  seg[2, t - 5 :] = 0  # padding
  pos = np.where(seg == 2, np.arange(t) - t // 2, np.arange(t)).astype(np.int32)
  pos[seg == 0] = 0
  return dict(
      inputs=rng.integers(0, vocab, (b, t)).astype(np.int32),
      targets=rng.integers(0, vocab, (b, t)).astype(np.int32),
      positions=pos,
      segment_ids=seg,
      loss_mask=(seg > 0).astype(np.float32),
  )


def _train(config, steps=3):
  config = config_lib.RunConfig.from_config_dict(config)
  mesh = sharding.make_mesh(jax.devices()[:1])
  model = train_step.make_model(config)
  state, tx, sh = train_step.init_state(model, config, mesh, jax.random.key(0))
  step = train_step.make_train_step(model, tx, config, mesh, sh)
  losses = []
  for i in range(steps):
    batch = _hand_batch(
        config.batch_size, config.data.seq_len, config.model.vocab_size, i
    )
    state, m = step(
        state, sharding.global_batch(batch, mesh), jax.random.key(i)
    )
    losses.append(float(m['loss']))
  return losses, jax.device_get(state.params), state.stats.to_numpy()


def test_auto_step_equals_explicit_bitwise_and_one_batch_xla_to_rounding(
    monkeypatch,
):
  # tiny shape: 2 microbatches of 2 rows
  monkeypatch.setattr(auto, 'CPU_MICROBATCH_TOKENS', 64)
  runs = {}
  for name, impl, accum in (
      ('auto', 'auto', 0),
      ('explicit', 'blocked', 2),
      ('one', 'xla', 1),
  ):
    c = tiny_config()
    c.batch_size = 4
    c.model.attention_impl, c.grad_accum_steps = impl, accum
    runs[name] = _train(c)
  (la, pa, sa), (le, pe, se), (l1, p1, s1) = (
      runs['auto'],
      runs['explicit'],
      runs['one'],
  )
  assert la == le
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pe)):
    np.testing.assert_array_equal(x, y)
  for k in sa:
    np.testing.assert_array_equal(sa[k], se[k], err_msg=k)
  np.testing.assert_allclose(la, l1, rtol=1e-5)
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(p1)):
    np.testing.assert_allclose(x, y, rtol=1e-3, atol=1e-5)
  for k in sa:
    np.testing.assert_allclose(
        sa[k], s1[k], rtol=1e-3, atol=1e-6 * np.abs(s1[k]).max(), err_msg=k
    )
  np.testing.assert_array_equal(sa['count'], s1['count'])


@pytest.mark.slow
def test_train_records_resolved_values_and_resumes_an_old_run_with_its_own(
    tmp_path, monkeypatch
):
  from flax_posemb import training

  monkeypatch.setattr(auto, 'CPU_MICROBATCH_TOKENS', 128)
  c = tiny_config()
  c.num_train_steps, c.eval_every_steps, c.checkpoint_every_steps = 2, 0, 2
  training.train_and_evaluate(c, str(tmp_path / 'new'))
  saved = json.loads((tmp_path / 'new' / 'config.json').read_text())
  assert (saved['model']['attention_impl'], saved['grad_accum_steps']) == (
      'blocked',
      2,
  )
  # a run started before the auto defaults
  old = c.copy_and_resolve_references()
  old.model.attention_impl, old.grad_accum_steps = 'xla', 1
  training.train_and_evaluate(old, str(tmp_path / 'old'))
  c.num_train_steps = 3
  # num_train_steps only; the listed changes must not name auto fields
  c.allow_config_change = True
  training.train_and_evaluate(c, str(tmp_path / 'old'))
  rows = [
      json.loads(line)
      for line in (tmp_path / 'old' / 'metrics.jsonl').read_text().splitlines()
  ]
  change = next(r['config_change'] for r in rows if 'config_change' in r)
  assert set(change) == {'num_train_steps'}
  saved = json.loads((tmp_path / 'old' / 'config.json').read_text())
  assert (saved['model']['attention_impl'], saved['grad_accum_steps']) == (
      'xla',
      1,
  )
