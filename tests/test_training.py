"""Train step statistics, the loop's outputs, resume, preemption, NaN stop,
train.py."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import ROOT
from conftest import SUBPROCESS_ENV
from conftest import tiny_config
from flax_posemb import checkpointing
from flax_posemb import config as config_lib
from flax_posemb import sharding
from flax_posemb import stats
from flax_posemb import train_step
from flax_posemb import training


def hand_batch(b=4, t=32, vocab=64, seed=0):
  """Rows: one document + padding, two packed documents, a shifted document,
  full row."""
  rng = np.random.default_rng(seed)
  seg = np.ones((b, t), np.int32)
  pos = np.tile(np.arange(t, dtype=np.int32), (b, 1))
  seg[0, 11:] = 0
  pos[0, 11:] = 0
  seg[1, 9:] = 2
  pos[1, 9:] = np.arange(t - 9)
  pos[2] = np.arange(t) // 2  # repeated position ids within a row
  mask = (seg > 0).astype(np.float32)
  mask[0, 10] = 0.0
  mask[1, 8] = 0.0
  return dict(
      inputs=rng.integers(0, vocab, (b, t)).astype(np.int32),
      targets=rng.integers(0, vocab, (b, t)).astype(np.int32),
      positions=pos,
      segment_ids=seg,
      loss_mask=mask,
  )


def build(config):
  config = config_lib.RunConfig.from_config_dict(config)
  mesh = sharding.make_mesh(jax.devices()[:1])
  model = train_step.make_model(config)
  state, tx, sh = train_step.init_state(model, config, mesh, jax.random.key(0))
  return (
      mesh,
      model,
      state,
      train_step.make_train_step(model, tx, config, mesh, sh),
  )


def test_step_statistics_equal_per_example_computation():
  c = tiny_config()
  c.batch_size, c.grad_accum_steps = 4, 2
  c.optimizer.warmup_steps = 0
  mesh, model, state, step = build(c)
  batch = hand_batch()
  params0 = jax.device_get(state.params)
  new_state, metrics = step(
      state, sharding.global_batch(batch, mesh), jax.random.key(1)
  )
  got = jax.device_get(new_state.stats)
  params1 = jax.device_get(new_state.params)

  def sum_loss(params, delta, b):
    logits = model.apply(
        {'params': params},
        b['inputs'],
        b['positions'],
        segment_ids=b['segment_ids'],
        embed_delta=delta,
    )
    tl = train_step.token_losses(logits, b['targets'])
    return jnp.sum(tl * b['loss_mask']), tl

  def per_example(x):
    xb = jax.tree.map(lambda a: a[None], x)
    zero = jnp.zeros((1, 32, c.model.emb_dim))
    return jax.grad(lambda p: sum_loss(params0, p, xb)[0])(zero)[0]

  g = np.asarray(jax.jit(jax.vmap(per_example))(batch), np.float64)
  zero = jnp.zeros((4, 32, c.model.emb_dim))
  (total, tl), table_grad = jax.jit(
      jax.value_and_grad(lambda p: sum_loss(p, zero, batch), has_aux=True)
  )(params0)
  tl = np.asarray(tl, np.float64)
  want = {k: np.zeros(32) for k in stats.FIELDS}
  for b in range(4):
    for t in range(32):
      p = batch['positions'][b, t]
      if batch['segment_ids'][b, t] > 0:
        n = np.linalg.norm(g[b, t])
        same = batch['segment_ids'][b] == batch['segment_ids'][b, t]
        want['count'][p] += 1
        want['occ_norm'][p] += n
        want['occ_sq'][p] += n * n
        want['downstream'][p] += np.sum(batch['loss_mask'][b, t:] * same[t:])
      if batch['loss_mask'][b, t] > 0:
        want['loss_count'][p] += 1
        want['loss_sum'][p] += tl[b, t]
  want['row_sq'] = np.sum(
      np.asarray(table_grad['pos_embed']['embedding'], np.float64) ** 2, -1
  )
  delta = np.asarray(
      params1['pos_embed']['embedding'], np.float64
  ) - np.asarray(params0['pos_embed']['embedding'], np.float64)
  want['update_sq'] = np.sum(delta**2, -1)
  # The context fields are pinned against brute force in tests/test_stats.py.
  for k in set(stats.FIELDS) - {'full_context_count', 'context_count'}:
    w = want[k]
    np.testing.assert_allclose(
        got[k], w, rtol=1e-5, atol=1e-6 * np.max(np.abs(w)), err_msg=k
    )
  assert float(metrics['loss']) == pytest.approx(
      float(total) / batch['loss_mask'].sum(), rel=1e-6
  )
  assert got['count'].dtype == np.int32 and np.all(want['update_sq'][:16] > 0)


@pytest.mark.parametrize('accum', [1, 2])
def test_stats_on_off_give_identical_loss_and_params(accum):
  out = {}
  for collect in (True, False):
    c = tiny_config()
    c.batch_size, c.grad_accum_steps, c.collect_stats = 4, accum, collect
    mesh, _, state, step = build(c)
    losses = []
    for i in range(3):
      state, m = step(
          state,
          sharding.global_batch(hand_batch(seed=i), mesh),
          jax.random.key(i),
      )
      losses.append(float(m['loss']))
    out[collect] = (losses, jax.device_get(state.params))
  assert out[True][0] == out[False][0]
  for a, b in zip(
      jax.tree.leaves(out[True][1]), jax.tree.leaves(out[False][1])
  ):
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize('decay', [False, True])
def test_absent_rows_get_zero_gradient_and_only_decay_moves_them(decay):
  c = tiny_config()
  c.batch_size = 4
  c.optimizer.warmup_steps = 0
  c.optimizer.decay_position_table = decay
  mesh, _, state, step = build(c)
  batch = hand_batch()
  absent = np.setdiff1d(
      np.arange(32), batch['positions'][batch['segment_ids'] > 0]
  )
  assert len(absent) == 0 or absent.min() >= 23
  batch['positions'] = np.minimum(batch['positions'], 19)  # rows 20..31 absent
  before = np.asarray(jax.device_get(state.params['pos_embed']['embedding']))
  state, _ = step(state, sharding.global_batch(batch, mesh), jax.random.key(0))
  w = jax.device_get(state.stats)
  after = np.asarray(jax.device_get(state.params['pos_embed']['embedding']))
  assert np.all(w['row_sq'][20:] == 0) and np.all(w['count'][20:] == 0)
  assert np.all(w['row_sq'][:20] > 0)
  if decay:
    assert np.all(w['update_sq'][20:] > 0)  # weight decay shrinks unused rows
  else:
    assert np.all(w['update_sq'][20:] == 0)
    np.testing.assert_array_equal(before[20:], after[20:])


def read_metrics(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def test_run_writes_metrics_windows_tables_and_checkpoints(tiny_run):
  workdir, config, result = tiny_run
  rows = read_metrics(workdir)
  train_rows = [r for r in rows if 'loss' in r]
  assert [r['step'] for r in train_rows] == [5, 10, 15, 20]
  assert [r['step'] for r in rows if 'eval' in r] == [10, 20]
  assert {'learning_rate', 'grad_norm', 'tokens_per_sec', 'elapsed'} <= set(
      train_rows[0]
  )
  assert train_rows[-1]['loss'] < train_rows[0]['loss']
  assert 'overall' in rows[-1]['eval'] and 'buckets' in rows[-1]['eval']
  cum = np.zeros(32, np.int64)
  for s in (5, 10, 15, 20):
    with np.load(os.path.join(workdir, 'stats', f'window_{s}.npz')) as z:
      cum += z['count']
      np.testing.assert_array_equal(z['cumulative_count'], cum)
      assert int(z['num_steps']) == 5 and np.all(z['occ_sq'] >= 0)
  assert sorted(os.listdir(os.path.join(workdir, 'tables'))) == sorted(
      f'table_{s}.npy' for s in (0, 5, 10, 15, 20)
  )
  ck = checkpointing.Checkpointer(
      checkpointing.checkpoint_dir(workdir), max_to_keep=2, read_only=True
  )
  assert ck.all_steps() == [0, 10, 20]
  ck.close()
  assert (
      json.load(open(os.path.join(workdir, 'config.json')))['num_train_steps']
      == 20
  )
  assert result['step'] == 20 and not result['preempted']


KILL_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    sys.path.insert(0, {tests!r})
    import conftest
    from flax_posemb import training
    workdir = sys.argv[1]
    def hook(step, metrics):
      # Checkpoint 10 is written asynchronously: wait for it, then die.
      if step == 13:
        while not os.path.isdir(os.path.join(workdir, 'checkpoints', '10')):
          time.sleep(0.05)
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)
    training.train_and_evaluate(conftest.tiny_config(), workdir, hooks=[hook])
""")


def test_resume_after_kill9_equals_uninterrupted_run(
    tiny_run, tmp_path, caplog
):
  ref_dir, _, _ = tiny_run
  workdir = str(tmp_path / 'killed')
  proc = subprocess.run(
      [
          sys.executable,
          '-c',
          KILL_SCRIPT.format(tests=str(ROOT / 'tests')),
          workdir,
      ],
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
  with caplog.at_level('INFO'):
    result = training.train_and_evaluate(tiny_config(), workdir)
  assert result['resumed_from'] == 10
  assert 'Resuming from the checkpoint of step 10' in caplog.text
  a, b = read_metrics(ref_dir), read_metrics(workdir)
  for k in (
      'step',
      'loss',
      'last_loss',
      'grad_norm',
      'learning_rate',
      'tokens',
  ):
    assert [r.get(k) for r in a] == [r.get(k) for r in b], k
  assert [r.get('eval') for r in a] == [r.get('eval') for r in b]
  pa, _, _ = checkpointing.restore_params(ref_dir, step=20)
  pb, _, _ = checkpointing.restore_params(workdir, step=20)
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  for s in (15, 20):
    with (
        np.load(os.path.join(ref_dir, 'stats', f'window_{s}.npz')) as za,
        np.load(os.path.join(workdir, 'stats', f'window_{s}.npz')) as zb,
    ):
      for k in stats.FIELDS + ('cumulative_count',):
        np.testing.assert_array_equal(za[k], zb[k], err_msg=k)


def test_a_run_resumed_from_step_0_writes_the_rows_of_an_uninterrupted_run(
    tiny_run, tmp_path, monkeypatch
):
  """Stopped by SIGTERM during setup (its only checkpoint is step 0), then
  resumed: no evaluation row of step 0, which an uninterrupted run never
  writes."""
  ref_dir, _, _ = tiny_run
  workdir = str(tmp_path / 'from_zero')
  real = train_step.init_state

  def init_state_then_sigterm(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    return real(*args, **kwargs)

  monkeypatch.setattr(train_step, 'init_state', init_state_then_sigterm)
  stopped = training.train_and_evaluate(tiny_config(), workdir)
  assert stopped['preempted'] and stopped['step'] == 0
  monkeypatch.setattr(train_step, 'init_state', real)
  assert (
      training.train_and_evaluate(tiny_config(), workdir)['resumed_from'] == 0
  )
  a, b = read_metrics(ref_dir), read_metrics(workdir)
  assert [(r['step'], 'eval' in r) for r in b] == [
      (r['step'], 'eval' in r) for r in a
  ]
  assert [r.get('loss') for r in a] == [r.get('loss') for r in b]


def test_sigterm_mid_run_leaves_restorable_checkpoint(tmp_path):
  workdir = str(tmp_path / 'term')

  def hook(step, metrics):
    if step == 7:
      os.kill(os.getpid(), signal.SIGTERM)

  result = training.train_and_evaluate(tiny_config(), workdir, hooks=[hook])
  assert result['preempted'] and result['step'] in (7, 8)
  params, config, info = checkpointing.restore_params(workdir)
  assert info.step == result['step'] and config['num_train_steps'] == 20
  assert all(
      np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params)
  )


def test_a_checkpoint_with_the_counters_in_stats_resumes_exactly(
    tiny_run, tmp_path, monkeypatch
):
  """Checkpoints written before the loop's counters had their own item hold
  them in `stats`: a resume from one continues the training rows exactly."""
  ref_dir, _, _ = tiny_run
  workdir = str(tmp_path / 'old_layout')

  def save_old_layout(self, state, step):
    return self.ckpt.save(
        step,
        params=state.params,
        opt_state=state.opt_state,
        data_iter=self.data_iter,
        config=self.config.to_dict(),
        stats=dict(self.statistics.state(state.stats), **self.counters),
    )

  def hook(step, metrics):
    if step == 7:
      os.kill(os.getpid(), signal.SIGTERM)

  with monkeypatch.context() as m:
    m.setattr(training._Loop, 'save', save_old_layout)
    first = training.train_and_evaluate(tiny_config(), workdir, hooks=[hook])
  assert first['preempted']
  step_dir = os.path.join(workdir, 'checkpoints', str(first['step']))
  assert not os.path.exists(os.path.join(step_dir, 'counters'))
  result = training.train_and_evaluate(tiny_config(), workdir)
  assert result['resumed_from'] == first['step'] and result['step'] == 20
  a, b = read_metrics(ref_dir), read_metrics(workdir)
  for k in ('step', 'loss', 'tokens'):
    assert [r.get(k) for r in a] == [r.get(k) for r in b], k


def cpu_recipe_config():
  """tiny_config with the README's CPU recipe: blocked attention and 4
  microbatches."""
  c = tiny_config()
  c.model.attention_impl, c.grad_accum_steps = 'blocked', 4
  return c


def test_cpu_recipe_preempted_and_resumed_equals_uninterrupted_run(tmp_path):
  ref = training.train_and_evaluate(cpu_recipe_config(), str(tmp_path / 'ref'))
  workdir = str(tmp_path / 'term')

  def hook(step, metrics):
    if step == 7:
      os.kill(os.getpid(), signal.SIGTERM)

  first = training.train_and_evaluate(
      cpu_recipe_config(), workdir, hooks=[hook]
  )
  assert first['preempted']
  result = training.train_and_evaluate(cpu_recipe_config(), workdir)
  assert (
      result['resumed_from'] == first['step']
      and result['step'] == ref['step'] == 20
  )
  pa, _, _ = checkpointing.restore_params(str(tmp_path / 'ref'), step=20)
  pb, _, _ = checkpointing.restore_params(workdir, step=20)
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_a_twin_over_a_shared_stream_preempted_and_resumed_equals_uninterrupted(
    tmp_path,
):
  """data.offset_twin over data.shared_stream (the experiments' twins): a
  run stopped by SIGTERM and resumed trains the batches of an uninterrupted
  run, to the bit."""

  def twin_config():
    c = tiny_config()
    c.eval_every_steps = 0
    c.data.position_policy = 'crops'
    c.data.crop_lengths = 'skew:0.1'
    c.data.offset_twin = True
    c.data.shared_stream = True
    return c

  ref_dir = str(tmp_path / 'ref')
  training.train_and_evaluate(twin_config(), ref_dir)
  workdir = str(tmp_path / 'term')

  def hook(step, metrics):
    if step == 7:
      os.kill(os.getpid(), signal.SIGTERM)

  first = training.train_and_evaluate(twin_config(), workdir, hooks=[hook])
  assert first['preempted'] and first['step'] < 20
  result = training.train_and_evaluate(twin_config(), workdir)
  assert result['resumed_from'] == first['step'] and result['step'] == 20
  a, b = read_metrics(ref_dir), read_metrics(workdir)
  assert [r.get('loss') for r in a] == [r.get('loss') for r in b]
  pa, _, _ = checkpointing.restore_params(ref_dir, step=20)
  pb, _, _ = checkpointing.restore_params(workdir, step=20)
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
  with (
      np.load(os.path.join(ref_dir, 'stats', 'window_20.npz')) as za,
      np.load(os.path.join(workdir, 'stats', 'window_20.npz')) as zb,
  ):
    for k in stats.FIELDS + ('cumulative_count',):
      np.testing.assert_array_equal(za[k], zb[k], err_msg=k)


def test_cli_cpu_recipe_on_huge_pages_trains_and_evaluates_bit_identically(
    tmp_path,
):
  # The README's CPU recipe, as its command line: blocked attention,
  # microbatches and glibc malloc on huge pages. The environment setting must
  # not change a single bit.
  outputs = {}
  for name, tunables in (('plain', None), ('huge', 'glibc.malloc.hugetlb=1')):
    # 'plain' stays on 4 KB pages.
    env = dict(SUBPROCESS_ENV, FLAX_POSEMB_HUGE_PAGES='0')
    env.pop('GLIBC_TUNABLES', None)
    if tunables:
      env['GLIBC_TUNABLES'] = tunables
    workdir = str(tmp_path / name)
    for script, args in (
        (
            'train.py',
            [
                '--config',
                'configs/tiny.py',
                '--workdir',
                workdir,
                '--config.num_train_steps=4',
                '--config.log_every_steps=2',
                '--config.eval_every_steps=0',
                '--config.progress_bar=False',
                '--config.model.attention_impl=blocked',
                '--config.grad_accum_steps=4',
            ],
        ),
        ('eval.py', ['--workdir', workdir, '--num_windows', '8']),
    ):
      proc = subprocess.run(
          [sys.executable, str(ROOT / script), *args],
          cwd=str(ROOT),
          env=env,
          capture_output=True,
          text=True,
          timeout=600,
      )
      assert proc.returncode == 0, proc.stderr[-3000:]
    outputs[name] = {
        f: dict(np.load(os.path.join(workdir, f)))
        for f in (
            os.path.join('stats', 'window_4.npz'),
            os.path.join('eval', 'step_4_num_windows-8', 'windows.npz'),
        )
    }
  for f, arrays in outputs['plain'].items():
    assert arrays.keys() == outputs['huge'][f].keys()
    for k, v in arrays.items():
      np.testing.assert_array_equal(
          v, outputs['huge'][f][k], err_msg=f'{f}: {k}'
      )


def test_a_non_finite_update_after_a_finite_loss_stops_before_it_is_saved(
    tmp_path,
):
  """Adam with eps=0 divides 0 by 0 on the position rows no token reached
  (rows of 8 tokens in a table of 32): the loss and the gradient stay finite,
  the update does not. The loop, finiteness's one owner, stops before that
  step is saved (exit 3)."""
  workdir = str(tmp_path / 'update')
  c = tiny_config()
  c.optimizer.eps = 0.0
  c.data.position_policy = 'length_schedule'
  c.data.schedule_seq_len = 8
  with pytest.raises(
      training.NonFiniteLossError,
      match='Non-finite parameter update .* at step 1 .*last good checkpoint'
      ' is step 0',
  ):
    training.train_and_evaluate(c, workdir)
  params, _, info = checkpointing.restore_params(workdir)
  assert info.step == 0
  assert all(
      np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params)
  )


def test_nan_loss_stops_with_message_and_keeps_last_good_checkpoint(tmp_path):
  workdir = str(tmp_path / 'nan')
  c = tiny_config()
  c.optimizer.learning_rate, c.optimizer.grad_clip_norm = 1e30, 0.0
  c.optimizer.warmup_steps = 0
  with pytest.raises(
      training.NonFiniteLossError, match='Non-finite training loss at step'
  ):
    training.train_and_evaluate(c, workdir)
  params, _, info = checkpointing.restore_params(workdir)
  assert info.step == 0
  assert all(
      np.all(np.isfinite(np.asarray(x))) for x in jax.tree.leaves(params)
  )


def test_corrupted_latest_checkpoint_stops_with_its_name(tiny_run, tmp_path):
  import shutil

  workdir = str(tmp_path / 'corrupt')
  shutil.copytree(tiny_run[0], workdir)
  bad = os.path.join(workdir, 'checkpoints', '20')
  for root, _, files in os.walk(os.path.join(bad, 'params')):
    for f in files:
      with open(os.path.join(root, f), 'r+b') as fh:
        fh.truncate(7)
  before = snapshot_files(workdir)
  with pytest.raises(
      checkpointing.CheckpointDamagedError,
      match=f'latest checkpoint {bad} is damaged.*Nothing was changed.*step 10',
  ):
    training.train_and_evaluate(tiny_config(), workdir)
  assert snapshot_files(workdir) == before


def run_cli(*args, timeout=600):
  return subprocess.run(
      [sys.executable, str(ROOT / 'train.py'), *args],
      cwd=str(ROOT),
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def snapshot_files(workdir):
  out = {}
  for root, _, files in os.walk(workdir):
    for f in files:
      # the lock records its current holder; it is not an output
      if f == '.lock':
        continue
      p = os.path.join(root, f)
      st = os.stat(p)
      out[p] = (st.st_size, st.st_mtime_ns)
  return out


@pytest.mark.slow
def test_train_py_tiny_end_to_end_resume_and_bad_inputs(tmp_path):
  workdir = str(tmp_path / 'cli')
  args = [
      '--config',
      'configs/tiny.py',
      '--workdir',
      workdir,
      '--config.num_train_steps=6',
      '--config.log_every_steps=3',
      '--config.eval_every_steps=6',
      '--config.checkpoint_every_steps=3',
      '--config.eval.num_windows=8',
      '--config.progress_bar=False',
  ]
  proc = run_cli(*args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'finished at step 6' in proc.stdout
  rows = read_metrics(workdir)
  assert [r['step'] for r in rows] == [3, 6, 6]
  assert os.path.exists(os.path.join(workdir, 'stats', 'window_6.npz'))
  # Same command again: resumes from the latest checkpoint and has nothing left
  # to do.
  proc = run_cli(*args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'Resuming from the checkpoint of step 6' in proc.stderr  # absl logging
  assert read_metrics(workdir) == rows
  # A different model shape on the same workdir: the change is named, nothing
  # touched.
  before = snapshot_files(workdir)
  proc = run_cli(*args, '--config.model.emb_dim=32')
  assert proc.returncode != 0
  assert (
      'model.emb_dim: 64 -> 32' in proc.stderr
      and 'fresh --workdir' in proc.stderr
  )
  assert snapshot_files(workdir) == before
  # Unknown config key.
  proc = run_cli(*args[:4], '--config.modle.num_layers=3')
  assert proc.returncode != 0 and 'modle' in proc.stderr


def test_batch_positions_past_the_table_are_a_host_error_before_the_step():
  mesh = sharding.make_mesh()
  batch = {k: np.zeros((2, 4), np.int32) for k in sharding.BATCH_KEYS}
  batch['loss_mask'] = np.ones((2, 4), np.float32)
  batch['positions'] = np.array([[0, 1, 2, 3], [4, 5, 6, 8]], np.int32)
  sharding.global_batch(batch, mesh, max_len=9)  # fits
  with pytest.raises(ValueError, match=r'8.*\[0, 8\)'):
    sharding.global_batch(batch, mesh, max_len=8)
  batch['positions'][0, 0] = -1
  with pytest.raises(ValueError, match='-1'):
    sharding.global_batch(batch, mesh, max_len=9)


@pytest.mark.slow
def test_cli_train_eval_resume_with_statistics_off_and_a_table_file(tmp_path):
  table = np.random.default_rng(0).normal(0, 0.02, (128, 64)).astype(np.float32)
  np.save(tmp_path / 'table.npy', table)
  workdir = str(tmp_path / 'off')
  args = [
      '--config',
      'configs/tiny.py',
      '--workdir',
      workdir,
      '--config.num_train_steps=4',
      '--config.log_every_steps=2',
      '--config.eval_every_steps=4',
      '--config.checkpoint_every_steps=2',
      '--config.eval.num_windows=8',
      '--config.progress_bar=False',
      '--config.collect_stats=False',
      f'--config.model.position_init=file:{tmp_path / "table.npy"}',
  ]
  proc = run_cli(*args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  np.testing.assert_array_equal(
      np.load(os.path.join(workdir, 'tables', 'table_0.npy')), table
  )
  with np.load(os.path.join(workdir, 'stats', 'window_4.npz')) as z:
    assert set(stats.LOSS_FIELDS) <= set(z.files) and 'occ_norm' not in z.files
    assert int(z['count'].sum()) > 0
  os.remove(tmp_path / 'table.npy')  # eval reads the table from the checkpoint
  proc = subprocess.run(
      [sys.executable, str(ROOT / 'eval.py'), '--workdir', workdir],
      cwd=str(ROOT),
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert os.path.exists(os.path.join(workdir, 'eval', 'step_4', 'results.json'))
  np.save(tmp_path / 'table.npy', table)
  longer = [a.replace('num_train_steps=4', 'num_train_steps=6') for a in args]
  # num_train_steps shapes the schedule: a change of meaning
  proc = run_cli(*longer)
  assert proc.returncode != 0 and 'num_train_steps: 4 -> 6' in proc.stderr
  proc = run_cli(*longer, '--config.allow_config_change=True')
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'Resuming from the checkpoint of step 4' in proc.stderr
  rows = read_metrics(workdir)
  assert [r['step'] for r in rows if 'loss' in r] == [2, 4, 6]
  assert {'step': 4, 'config_change': {'num_train_steps': [4, 6]}} in rows
  assert (
      json.load(open(os.path.join(workdir, 'config.json')))['num_train_steps']
      == 6
  )


def read_events(directory):
  """(tag, step, kind) of every summary value in the event files under
  ``directory``."""
  import glob as glob_lib
  import struct

  from tensorboardX.proto import event_pb2

  out = []
  for path in glob_lib.glob(
      os.path.join(directory, '**', 'events.out.tfevents.*'), recursive=True
  ):
    data = open(path, 'rb').read()
    i = 0
    while i < len(data):  # TFRecord framing: length, crc, payload, crc
      (n,) = struct.unpack('<Q', data[i : i + 8])
      event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
      i += 12 + n + 4
      for v in event.summary.value:
        out.append(
            (
                v.tag,
                event.step,
                v.WhichOneof('value'),
                os.path.relpath(path, directory),
            )
        )
  return out


def test_tensorboard_gets_bucket_scalars_the_figure_and_hparams(tiny_run):
  events = read_events(os.path.join(tiny_run[0], 'tensorboard'))
  tags = {t for t, _, _, _ in events}
  assert {'eval/loss', 'eval/degradation/last_minus_best', 'train/loss'} <= tags
  buckets = sorted(t for t in tags if t.startswith('eval_bucket_loss/'))
  assert len(buckets) == 4  # 32 positions, buckets of 8
  assert sorted(s for t, s, _, _ in events if t == buckets[-1]) == [10, 20]
  assert any(
      t == 'eval/loss_by_position' and kind == 'image'
      for t, _, kind, _ in events
  )
  assert any(t.startswith('_hparams_') for t in tags)


def _summaries(directory):
  """{(tag, step): summary value} of the event files in ``directory``."""
  import glob as glob_lib
  import struct

  from tensorboardX.proto import event_pb2

  (path,) = glob_lib.glob(os.path.join(directory, 'events.out.tfevents.*'))
  data, i, values = open(path, 'rb').read(), 0, {}
  while i < len(data):  # TFRecord framing: length, crc, payload, crc
    (n,) = struct.unpack('<Q', data[i : i + 8])
    event = event_pb2.Event.FromString(data[i + 12 : i + 12 + n])
    i += 12 + n + 4
    for v in event.summary.value:
      values[v.tag, event.step] = v
  return values


POSITION_CURVES = (
    'count',
    'loss',
    'signal_per_occurrence',
    'coherence',
    'update_sq',
    'row_sq',
    'occ_norm',
    'drift',
)


@pytest.mark.smoke
def test_tensorboard_gets_position_scalars_per_eval_bucket(tiny_run):
  values = _summaries(os.path.join(tiny_run[0], 'tensorboard'))
  spans = ['00000-00008', '00008-00016', '00016-00024', '00024-00032']
  for name in POSITION_CURVES:
    # The first bucket has tokens in every window of the natural policy.
    tag = f'positions_{name}/{spans[0]}'
    assert sorted(s for t, s in values if t == tag) == [5, 10, 15, 20], tag
    assert values[tag, 10].WhichOneof('value') == 'simple_value'
  for span in spans:
    tag = f'positions_count/{span}'
    assert sorted(s for t, s in values if t == tag) == [5, 10, 15, 20], tag
  assert not any(v.HasField('histo') for v in values.values())
  with np.load(os.path.join(tiny_run[0], 'stats', 'window_5.npz')) as z:
    count = z['count']
    loss_sum = z['loss_sum']
    loss_count = z['loss_count']
  assert values['positions_count/00008-00016', 5].simple_value == (
      pytest.approx(count[8:16].mean())
  )
  assert values['positions_loss/00000-00008', 5].simple_value == (
      pytest.approx(loss_sum[:8].sum() / loss_count[:8].sum(), rel=1e-5)
  )
  # A bucket no scored token reached has no loss that window (not a 0).
  assert loss_count[24:].sum() == 0
  assert ('positions_loss/00024-00032', 5) not in values
  drift = np.linalg.norm(
      np.load(os.path.join(tiny_run[0], 'tables', 'table_10.npy'))
      - np.load(os.path.join(tiny_run[0], 'tables', 'table_0.npy')),
      axis=1,
  )
  assert values['positions_drift/00024-00032', 10].simple_value == (
      pytest.approx(drift[24:].mean(), rel=1e-5)
  )


def test_tensorboard_gets_a_line_plot_per_position_curve_and_the_cosine_image(
    tiny_run,
):
  import io

  from PIL import Image

  values = _summaries(os.path.join(tiny_run[0], 'tensorboard'))
  for name in POSITION_CURVES:
    steps = sorted(s for t, s in values if t == f'positions/{name}')
    assert steps == [5, 10, 15, 20], name
    image = values[f'positions/{name}', 15].image
    png = Image.open(io.BytesIO(image.encoded_image_string))
    assert png.size == (image.width, image.height) and image.width >= 300
    # A line plot: more than the white page and black axes.
    colours = np.unique(np.asarray(png.convert('RGB')).reshape(-1, 3), axis=0)
    assert len(colours) > 10
  cosine = [s for t, s in values if t == 'positions/cosine_similarity']
  assert sorted(cosine) == [10, 20]
  image = values['positions/cosine_similarity', 20].image
  assert (image.height, image.width) == (32, 32)


@pytest.mark.slow
@pytest.mark.parametrize('verbosity', ['0', '1'])
def test_periodic_eval_results_reach_the_console_without_library_noise(
    tmp_path, verbosity
):
  proc = run_cli(
      '--config',
      'configs/tiny.py',
      '--workdir',
      str(tmp_path / 'v'),
      '--config.num_train_steps=4',
      '--config.log_every_steps=2',
      '--config.eval_every_steps=4',
      '--config.checkpoint_every_steps=4',
      '--config.eval.num_windows=8',
      '--config.progress_bar=False',
      f'--verbosity={verbosity}',
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'eval step 4: loss' in proc.stderr and 'step 2: loss' in proc.stderr
  noisy = ('Downloading and preparing', 'Given directory is read only')
  # Orbax's per-file INFO and TFDS's builder chatter are filtered.
  if verbosity == '0':
    assert not any(n in proc.stderr for n in noisy), proc.stderr[-2000:]
    assert 'orbax' not in proc.stderr.lower()


@pytest.mark.slow
def test_cli_text_corpus_chunked_blocked_attention_and_deep_eval_windows(
    tmp_path,
):
  """natural_chunked rows, blocked attention and deep eval windows, end to
  end."""
  corpus = tmp_path / 'corpus'
  corpus.mkdir()
  rng = np.random.default_rng(0)
  # long documents: several rows each, deep windows inside them
  for i in range(24):
    words = rng.choice(['alpha', 'beta', 'gamma', 'delta', 'the', 'of'], 120)
    (corpus / f'doc{i}.txt').write_text(' '.join(words))
  workdir = str(tmp_path / 'text')
  args = [
      '--config',
      'configs/tiny.py',
      '--workdir',
      workdir,
      '--config.num_train_steps=4',
      '--config.log_every_steps=2',
      '--config.checkpoint_every_steps=2',
      '--config.eval_every_steps=0',
      '--config.progress_bar=False',
      '--config.data.source=local_text',
      f'--config.data.local_glob={corpus}/*.txt',
      f'--config.data.data_dir={tmp_path / "data"}',
      '--config.data.val_percent=50',
      '--config.data.position_policy=natural_chunked',
      '--config.model.vocab_size=257',
      '--config.model.attention_impl=blocked',
      '--config.eval.num_windows=4',
      '--config.eval.batch_size=4',
      '--config.eval.window_start=deep',
  ]
  proc = run_cli(*args)
  assert proc.returncode == 0, proc.stderr[-3000:]
  with np.load(os.path.join(workdir, 'stats', 'window_4.npz')) as z:
    count = z['cumulative_count']
  # Every chunk starts at position 0 and runs on contiguously; long documents
  # reach the end.
  assert count[-1] > 0 and np.all(np.diff(count) <= 0)
  proc = run_cli(*args)  # the same command again: resumes, nothing left to do
  assert (
      proc.returncode == 0
      and 'Resuming from the checkpoint of step 4' in proc.stderr
  )
  proc = subprocess.run(
      [
          sys.executable,
          str(ROOT / 'eval.py'),
          '--workdir',
          workdir,
          '--window_start',
          'deep',
      ],
      cwd=str(ROOT),
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  # The config's own window_start: no variant of its own (issue 30).
  out = os.path.join(workdir, 'eval', 'step_4')
  res = json.load(open(os.path.join(out, 'results.json')))
  assert (
      res['settings']['window_start'] == 'deep'
      and res['overall']['windows'] == 4
  )
  assert res['windows']['start']['min'] >= 128  # configs/tiny.py: T = 128
