"""8 forced CPU devices give the 1-device statistics; 2 processes joined by
jax.distributed."""

import json
import os
import socket
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from conftest import ROOT
from conftest import SUBPROCESS_ENV

EIGHT_DEVICES = textwrap.dedent("""
    import json, os, sys
    sys.path.insert(0, {tests!r})
    import jax, numpy as np
    import conftest
    from test_training import hand_batch
    from flax_posemb import config, sharding, train_step, training
    assert jax.device_count() == 8, jax.devices()
    out = {{}}
    # 8 rows
    batch = {{
        k: np.concatenate([v, v[::-1]]) for k, v in hand_batch().items()}}
    cases = [('one', 1, False, 1), ('eight', 8, False, 1),
             ('eight_fsdp', 8, True, 1), ('one_accum', 1, False, 2)]
    for name, n, fsdp, accum in cases:
      c = conftest.tiny_config()
      c.batch_size, c.fsdp, c.grad_accum_steps = 8, fsdp, accum
      c.optimizer.warmup_steps = 0
      c.model.mlp_dim = 512  # 32 x 512 matrices reach FSDP_MIN_SIZE
      c = config.RunConfig.from_config_dict(c)
      mesh = sharding.make_mesh(jax.devices()[:n])
      model = train_step.make_model(c)
      state, tx, sh = train_step.init_state(model, c, mesh, jax.random.key(0))
      step = train_step.make_train_step(model, tx, c, mesh, sh)
      if fsdp:
        k = state.params['block_0']['mlp_in']['kernel']
        out['fsdp_spec'] = str(k.sharding.spec)
      for i in range(2):
        global_batch = sharding.global_batch(batch, mesh)
        state, m = step(state, global_batch, jax.random.key(i))
      w = jax.device_get(state.stats)
      table = state.params['pos_embed']['embedding']
      out[name] = dict(
          loss=float(m['loss']),
          **{{k: np.asarray(v).tolist() for k, v in w.items()}},
          table=np.asarray(table).tolist())
    c = conftest.tiny_config()
    c.batch_size = 12
    workdir = sys.argv[1]
    try:
      training.train_and_evaluate(c, workdir)
    except ValueError as e:
      out['bad_batch'] = str(e)
    out['workdir_created'] = os.path.exists(workdir)
    print('RESULT' + json.dumps(out))
""")


@pytest.mark.slow
def test_eight_devices_give_one_device_statistics(tmp_path):
  env = dict(
      SUBPROCESS_ENV, XLA_FLAGS='--xla_force_host_platform_device_count=8'
  )
  proc = subprocess.run(
      [
          sys.executable,
          '-c',
          EIGHT_DEVICES.format(tests=str(ROOT / 'tests')),
          str(tmp_path / 'bad'),
      ],
      env=env,
      capture_output=True,
      text=True,
      timeout=900,
  )
  assert proc.returncode == 0, proc.stderr[-3000:]
  out = json.loads(proc.stdout.split('RESULT', 1)[1])
  ref = out['one']
  for name in ('eight', 'eight_fsdp', 'one_accum'):
    assert out[name]['loss'] == pytest.approx(ref['loss'], rel=1e-5), name
    for k, v in ref.items():
      v = np.asarray(v)
      np.testing.assert_allclose(
          out[name][k],
          v,
          rtol=1e-4,
          atol=1e-5 * np.abs(v).max(),
          err_msg=f'{name}/{k}',
      )
  assert out['eight']['count'] == ref['count']
  assert 'data' in out['fsdp_spec']
  assert 'multiple of grad_accum_steps * device count' in out['bad_batch']
  assert not out['workdir_created']


def free_port():
  with socket.socket() as s:
    s.bind(('127.0.0.1', 0))
    return s.getsockname()[1]


@pytest.mark.slow
def test_two_processes_on_localhost_agree_on_the_loss(tmp_path):
  workdir = str(tmp_path / 'mh')
  port = free_port()
  args = [
      '--config',
      'configs/tiny.py',
      '--workdir',
      workdir,
      '--config.num_train_steps=4',
      '--config.log_every_steps=2',
      '--config.eval_every_steps=0',
      '--config.checkpoint_every_steps=4',
      '--config.batch_size=8',
      '--config.progress_bar=False',
      f'--coordinator_address=127.0.0.1:{port}',
      '--num_processes=2',
      '--cpu_collectives=gloo',
  ]
  procs = [
      subprocess.Popen(
          [sys.executable, str(ROOT / 'train.py'), *args, f'--process_id={i}'],
          cwd=str(ROOT),
          env=SUBPROCESS_ENV,
          stdout=subprocess.PIPE,
          stderr=subprocess.PIPE,
          text=True,
      )
      for i in range(2)
  ]
  outs = []
  try:
    for p in procs:
      out, err = p.communicate(timeout=900)
      outs.append((p.returncode, out, err))
  finally:
    for p in procs:
      if p.poll() is None:
        p.kill()
  for rc, _, err in outs:
    assert rc == 0, err[-3000:]
  losses = [
      out.strip().splitlines()[-1].rsplit(' ', 1)[-1] for _, out, _ in outs
  ]
  assert losses[0] == losses[1] and np.isfinite(float(losses[0].rstrip('.')))
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    rows = [json.loads(line) for line in f]
  assert [r['step'] for r in rows] == [2, 4]
  assert os.path.isdir(os.path.join(workdir, 'checkpoints', '4', 'data_iter'))
