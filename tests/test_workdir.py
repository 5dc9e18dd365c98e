"""The workdir's guarantees: one writer, no partial outputs, no silent config
change, no silent restart over a trained run (flax_posemb.workdir and the loop
that uses it)."""

import dataclasses
import errno
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

from conftest import SUBPROCESS_ENV
from conftest import tiny_config
from flax_posemb import checkpointing
from flax_posemb import config as config_lib
from flax_posemb import outputs
from flax_posemb import own_tokenizer
from flax_posemb import training
from flax_posemb import workdir


def typed(c):
  """The RunConfig of a test's ConfigDict (what train_and_evaluate converts)."""
  return config_lib.RunConfig.from_config_dict(c)


def five_steps():
  """The tiny config, 5 steps, no periodic eval."""
  c = tiny_config()
  c.num_train_steps, c.eval_every_steps = 5, 0
  return c


def trained_five_steps(tmp_path):
  """``(workdir, config)`` of a finished `five_steps` run."""
  wd, c = str(tmp_path / 'w'), five_steps()
  training.train_and_evaluate(c, wd)
  return wd, c


def test_second_writer_is_refused_with_the_holder_named(tmp_path):
  with workdir.Lock(str(tmp_path)):
    with pytest.raises(
        workdir.WorkdirError, match=f'pid {os.getpid()}.*two processes'
    ):
      with workdir.Lock(str(tmp_path)):
        pass
  with workdir.Lock(str(tmp_path)):  # released on exit
    pass


def test_lock_of_a_killed_holder_is_not_stale(tmp_path):
  script = textwrap.dedent("""
      import sys, time
      from flax_posemb import workdir
      with workdir.Lock(sys.argv[1]):
        print('LOCKED', flush=True)
        time.sleep(60)
  """)
  proc = subprocess.Popen(
      [sys.executable, '-c', script, str(tmp_path)],
      env=SUBPROCESS_ENV,
      stdout=subprocess.PIPE,
      text=True,
  )
  try:
    assert proc.stdout.readline().strip() == 'LOCKED'
    with pytest.raises(workdir.WorkdirError, match=f'pid {proc.pid}'):
      workdir.Lock(str(tmp_path)).__enter__()
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    with workdir.Lock(str(tmp_path)):  # the kernel released it
      pass
  finally:
    proc.kill()


def test_atomic_write_leaves_no_file_when_the_writer_fails(tmp_path):
  path = str(tmp_path / 'tables' / 'table_5.npy')
  with pytest.raises(OSError):
    with outputs.atomic_write(path) as f:
      f.write(b'partial')
      raise OSError(28, 'No space left on device')
  assert not [p for p in tmp_path.rglob('*') if p.is_file()]


def test_a_full_disk_fails_an_output_file_once_and_leaves_nothing(small_disk):
  """One error, not numpy's zip writer and the file's close failing again after
  it."""
  with pytest.raises(OSError) as e:
    with outputs.atomic_write(str(small_disk / 'stats' / 'window_5.npz')) as f:
      # 4 MB on a 1.8 MB disk
      np.savez(f, x=np.random.default_rng(0).random(1 << 19))
  assert e.value.errno == errno.ENOSPC and e.value.__context__ is None
  assert not [p for p in small_disk.rglob('*') if p.is_file()]


def test_two_writers_of_one_output_directory_take_turns(tmp_path):
  """Two evals of the same options write one directory: the second waits for
  the first instead of deleting its staging files (a raw [Errno 2])."""
  out = str(tmp_path / 'eval' / 'step_5')
  names = ('results.json', 'buckets.csv')
  first_is_writing = threading.Event()
  errors = []

  def write(label, started=None):
    try:
      with outputs.replace_files(out, names) as stage:
        if started is not None:
          started.set()
          time.sleep(0.5)  # the second writer starts meanwhile
        for name in names[::-1]:
          with open(os.path.join(stage, name), 'w') as f:
            f.write(label)
    except Exception as e:  # reported by the assertion below
      errors.append(e)

  first = threading.Thread(target=write, args=('first', first_is_writing))
  first.start()
  first_is_writing.wait()
  write('second')
  first.join()
  assert not errors
  assert [open(os.path.join(out, n)).read() for n in names] == ['second'] * 2
  assert sorted(os.listdir(out)) == sorted(names)


def test_resume_cleans_leftovers_of_a_killed_write(tmp_path):
  wd = str(tmp_path / 'w')
  os.makedirs(os.path.join(wd, 'stats'))
  os.makedirs(os.path.join(wd, 'tables'))
  junk = [
      os.path.join(wd, 'stats', 'window_5.npz.tmp.npz'),
      os.path.join(wd, 'stats', '.window_5.npz.tmp'),
      os.path.join(wd, 'tables', '.table_5.npy.tmp'),
  ]
  for p in junk:
    open(p, 'w').close()
  assert training.train_and_evaluate(five_steps(), wd)['step'] == 5
  assert not any(os.path.exists(p) for p in junk)
  assert os.path.exists(os.path.join(wd, 'stats', 'window_5.npz'))


def test_a_resume_removes_only_the_files_the_run_wrote(tmp_path):
  """Files a user put in stats/ and tables/ stay, whatever their names start
  with; the run's later step files and killed writes' leftovers go."""
  wd, c = trained_five_steps(tmp_path)
  stats, tables = os.path.join(wd, 'stats'), os.path.join(wd, 'tables')
  users = [
      os.path.join(stats, 'window_20.npz.bak'),
      os.path.join(stats, 'window_notes.txt'),
      os.path.join(stats, '.window_notes.tmp'),
      os.path.join(tables, 'table_5.npy.orig'),
      os.path.join(tables, 'table_of_contents.md'),
  ]
  for path in users:
    open(path, 'w').close()
  runs = [
      os.path.join(stats, '.window_9.npz.tmp'),
      os.path.join(tables, '.table_9.npy.tmp'),
  ]
  for path in runs:
    open(path, 'w').close()
  runs.append(os.path.join(stats, 'window_9.npz'))  # after the checkpoint
  shutil.copy(os.path.join(stats, 'window_5.npz'), runs[-1])
  assert training.train_and_evaluate(c, wd)['resumed_from'] == 5
  assert all(os.path.exists(p) for p in users)
  assert not any(os.path.exists(p) for p in runs)


def test_outputs_without_checkpoints_are_never_wiped(tmp_path):
  wd, c = trained_five_steps(tmp_path)
  os.rename(os.path.join(wd, 'checkpoints'), str(tmp_path / 'moved'))
  with open(os.path.join(wd, 'metrics.jsonl')) as f:
    before = f.read()
  with pytest.raises(
      workdir.WorkdirError, match='no checkpoint to resume from'
  ):
    training.train_and_evaluate(c, wd)
  with open(os.path.join(wd, 'metrics.jsonl')) as f:
    assert f.read() == before
  assert os.path.exists(os.path.join(wd, 'stats', 'window_5.npz'))


def test_resume_with_another_policy_names_the_change_not_corruption(tmp_path):
  wd, c = trained_five_steps(tmp_path)
  c.data.position_policy = 'packed'
  c.optimizer.learning_rate = 1e-2
  with pytest.raises(workdir.WorkdirError) as e:
    training.train_and_evaluate(c, wd)
  msg = str(e.value)
  assert "data.position_policy: 'natural' -> 'packed'" in msg
  assert 'optimizer.learning_rate' in msg and 'corrupt' not in msg
  assert (
      json.load(open(os.path.join(wd, 'config.json')))['data'][
          'position_policy'
      ]
      == 'natural'
  )


def test_a_newest_checkpoint_of_another_model_is_named_not_a_config_change(
    tmp_path,
):
  """A wider model's step placed as the newest: the resume names the step and
  another model (not a change of config, which the user did not make)."""
  import jax
  import jax.numpy as jnp
  import optax

  wd, c = trained_five_steps(tmp_path)
  wider = five_steps()
  wider.model.emb_dim, wider.model.mlp_dim = 64, 128
  model = training.step_lib.make_model(typed(wider))
  x = jnp.zeros((1, 4), jnp.int32)
  params = model.init(jax.random.key(0), x, x)['params']
  foreign = os.path.join(wd, 'checkpoints', '9')
  with checkpointing.Checkpointer(
      os.path.dirname(foreign), max_to_keep=5, async_save=False
  ) as ckpt:
    ckpt.save(
        9,
        params=params,
        opt_state=optax.adamw(1e-2).init(params),
        data_iter=None,
        stats=None,
        config=wider,
    )
  before = open(os.path.join(wd, 'metrics.jsonl')).read()
  with pytest.raises(checkpointing.CheckpointMismatchError) as e:
    training.train_and_evaluate(c, wd)
  message = str(e.value)
  assert message.startswith(f'{foreign} was written by another model')
  assert 'another config' not in message
  assert f'mv {foreign} /tmp/' in message and 'step before it (5)' in message
  assert open(os.path.join(wd, 'metrics.jsonl')).read() == before
  shutil.move(foreign, str(tmp_path / 'aside'))  # the fix it names
  assert training.train_and_evaluate(c, wd)['resumed_from'] == 5


@pytest.mark.parametrize('content', ['{}', '[]', '{"model": {}}'])
def test_a_config_json_that_is_not_a_runs_config_is_named_with_the_fix(
    tmp_path, content
):
  wd, c = trained_five_steps(tmp_path)
  path = os.path.join(wd, 'config.json')
  with open(path, 'w') as f:
    f.write(content)
  with pytest.raises(
      workdir.WorkdirError,
      match=f'{path} is not the config of a training run.*mv {path} /tmp/',
  ):
    training.train_and_evaluate(c, wd)
  assert open(path).read() == content


def test_log_and_eval_settings_may_change_on_resume(tmp_path):
  wd = str(tmp_path / 'w')
  c = tiny_config()
  c.num_train_steps, c.eval_every_steps, c.log_every_steps = 10, 0, 5
  c.checkpoint_every_steps = 5
  training.train_and_evaluate(c, wd)
  c.eval.num_windows, c.log_every_steps, c.progress_bar = 4, 2, False
  assert training.train_and_evaluate(c, wd)['resumed_from'] == 10


def test_diverged_finite_loss_stops_before_it_is_saved(tmp_path):
  wd = str(tmp_path / 'w')
  c = tiny_config()
  c.divergence_loss = 0.5  # below the initial loss: the first step "diverges"
  with pytest.raises(training.NonFiniteLossError, match='Diverged .*step 1'):
    training.train_and_evaluate(c, wd)
  assert checkpointing.restore_params(wd)[2].step == 0
  assert training.divergence_bound(typed(tiny_config())) == pytest.approx(
      3 * np.log(64)
  )


def test_sigterm_during_setup_leaves_a_resumable_workdir(tmp_path, monkeypatch):
  real = training.step_lib.init_state

  def init_state_then_sigterm(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.1)
    return real(*args, **kwargs)

  monkeypatch.setattr(training.step_lib, 'init_state', init_state_then_sigterm)
  wd = str(tmp_path / 'w')
  result = training.train_and_evaluate(tiny_config(), wd)
  assert result['preempted'] and result['step'] == 0
  assert checkpointing.restore_params(wd)[2].step == 0
  monkeypatch.setattr(training.step_lib, 'init_state', real)
  c = tiny_config()
  c.num_train_steps, c.eval_every_steps = 3, 0
  c.allow_config_change = True
  assert training.train_and_evaluate(c, wd)['resumed_from'] == 0


def test_a_tensorboard_write_on_a_full_disk_raises_and_leaves_no_partial(
    tmp_path, monkeypatch
):
  """No writer thread and no flush at exit to fail again later: the caller gets
  the error."""
  threads = threading.active_count()
  tb = training.TensorBoard(str(tmp_path))
  before = open(tb.path, 'rb').read()
  real = os.write
  monkeypatch.setattr(
      os, 'write', lambda fd, data: real(fd, data[: len(data) // 2])
  )
  with pytest.raises(OSError, match='short write'):
    tb.add_scalar('train/loss', 1.0, 1)
  monkeypatch.undo()
  assert (
      open(tb.path, 'rb').read() == before
      and threading.active_count() == threads
  )


def test_a_run_started_before_a_field_existed_resumes_with_its_default(
    tmp_path,
):
  wd, c = trained_five_steps(tmp_path)
  # as train_and_evaluate does before this check
  c = training.resolve_auto(typed(c), wd)
  path = os.path.join(wd, 'config.json')
  saved = json.load(open(path))
  del saved['data']['on_decode_error']  # as written by an older version
  json.dump(saved, open(path, 'w'))
  assert workdir.check_resume_config(wd, c, saved) == {}
  skip = dataclasses.replace(c.data, on_decode_error='skip')
  with pytest.raises(
      workdir.WorkdirError, match="data.on_decode_error: None -> 'skip'"
  ):
    workdir.check_resume_config(wd, dataclasses.replace(c, data=skip), saved)
  # the saved data-iterator state depends on it
  workers = dataclasses.replace(c.data, num_workers=2)
  with pytest.raises(workdir.WorkdirError, match='data.num_workers'):
    workdir.check_resume_config(wd, dataclasses.replace(c, data=workers), saved)


@pytest.mark.parametrize('config_json', ['missing', 'edited'])
def test_resume_compares_with_the_config_stored_in_the_checkpoint(
    tmp_path, config_json
):
  """config.json gone, or rewritten to the new values: the checkpoint's own
  config still refuses the change (the drift check is not switched off by one
  file)."""
  wd, c = trained_five_steps(tmp_path)
  c.optimizer.learning_rate = 1e-2
  path = os.path.join(wd, 'config.json')
  if config_json == 'missing':
    os.remove(path)
  else:
    workdir.write_config(wd, typed(c))
  with pytest.raises(workdir.WorkdirError, match='optimizer.learning_rate'):
    training.train_and_evaluate(c, wd)
  c.allow_config_change = True
  assert training.train_and_evaluate(c, wd)['resumed_from'] == 5


def test_a_garbled_config_json_is_named_with_the_fix(tmp_path):
  wd, c = trained_five_steps(tmp_path)
  with open(os.path.join(wd, 'config.json'), 'w') as f:
    f.write('{"data": ')
  with pytest.raises(
      workdir.WorkdirError, match='config.json is not valid JSON.*move it'
  ):
    training.train_and_evaluate(c, wd)
  os.remove(os.path.join(wd, 'config.json'))  # the fix the message names
  assert training.train_and_evaluate(c, wd)['resumed_from'] == 5


def test_a_half_written_last_eval_row_of_a_finished_run_is_rewritten_on_resume(
    tmp_path,
):
  wd, c = str(tmp_path / 'w'), tiny_config()
  c.num_train_steps = c.eval_every_steps = c.checkpoint_every_steps = 10
  training.train_and_evaluate(c, wd)
  path = os.path.join(wd, 'metrics.jsonl')
  text = open(path).read()
  assert '"eval"' in text.splitlines()[-1]
  # half of it
  open(path, 'w').write(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])
  assert training.train_and_evaluate(c, wd)['resumed_from'] == 10
  rows = [json.loads(line) for line in open(path)]
  assert [r['step'] for r in rows if 'eval' in r] == [10]
  assert (
      json.loads(text.splitlines()[-1])['eval']['overall']
      == rows[-1]['eval']['overall']
  )


def test_a_half_written_last_row_of_a_finished_run_is_rewritten_on_resume(
    tmp_path,
):
  wd, c = trained_five_steps(tmp_path)
  path = os.path.join(wd, 'metrics.jsonl')
  text = open(path).read()
  last = text.splitlines()[-1]
  assert json.loads(last)['step'] == 5 and 'loss' in json.loads(last)
  open(path, 'w').write(text[: len(text) - len(last) // 2 - 1])  # half of it
  assert training.train_and_evaluate(c, wd)['resumed_from'] == 5
  assert [json.loads(line) for line in open(path)] == [
      json.loads(line) for line in text.splitlines()
  ]


def test_a_truncated_window_file_is_named_on_resume_and_nothing_changes(
    tmp_path,
):
  wd, c = trained_five_steps(tmp_path)
  path = os.path.join(wd, 'stats', 'window_5.npz')
  open(path, 'r+b').truncate(100)
  before = open(os.path.join(wd, 'metrics.jsonl')).read()
  with pytest.raises(ValueError, match='window_5.npz is damaged'):
    training.train_and_evaluate(c, wd)
  assert open(os.path.join(wd, 'metrics.jsonl')).read() == before


def test_a_metrics_row_that_fails_to_append_leaves_no_partial_line(
    tmp_path, monkeypatch
):
  workdir.append_row(str(tmp_path), {'step': 1, 'loss': 2.0})
  real = os.write

  def full_disk(fd, data):
    real(fd, data[: len(data) // 2])
    raise OSError(28, 'No space left on device')

  monkeypatch.setattr(workdir.os, 'write', full_disk)
  with pytest.raises(OSError, match='No space'):
    workdir.append_row(str(tmp_path), {'step': 2, 'loss': 1.0})
  monkeypatch.undo()
  assert open(tmp_path / 'metrics.jsonl').read() == '{"step": 1, "loss": 2.0}\n'


def test_a_run_saved_before_row_shuffling_resumes_only_with_stream_order():
  from flax_posemb import defaults
  from flax_posemb import workdir as workdir_lib

  config = defaults.base()
  saved = config.to_dict()
  # config.json of a run from before the field existed
  del saved['data']['shuffle_rows']
  assert workdir_lib.config_changes(saved, config) == {
      'data.shuffle_rows': [None, 8192]
  }
  config.data.shuffle_rows = 0  # what it ran with: stream order
  assert workdir_lib.config_changes(saved, config) == {}


def _tokenizer_dir(path, content='{"model": "bpe"}'):
  os.makedirs(path)
  with open(os.path.join(path, 'tokenizer.json'), 'w') as f:
    f.write(content)
  return str(path)


def _hf_config(tokenizer_dir):
  config = tiny_config()
  config.data.tokenizer = 'hf'
  config.data.hf_tokenizer = tokenizer_dir
  return config_lib.RunConfig.from_config_dict(config)


def test_a_workdir_copies_its_tokenizer_and_records_it_relative(tmp_path):
  """config.json names the workdir's own copy, `tokenizer`; read back from a
  moved workdir with the original gone, it is the copy at the new place."""
  original = _tokenizer_dir(tmp_path / 'hf')
  run = str(tmp_path / 'run')
  os.makedirs(run)
  workdir.write_config(run, _hf_config(original))
  with open(os.path.join(run, 'config.json')) as f:
    assert json.load(f)['data']['hf_tokenizer'] == 'tokenizer'
  assert os.listdir(os.path.join(run, 'tokenizer')) == ['tokenizer.json']
  moved = str(tmp_path / 'elsewhere')
  shutil.move(run, moved)
  shutil.rmtree(original)
  saved = workdir.saved_config(moved)
  assert saved['data']['hf_tokenizer'] == os.path.join(moved, 'tokenizer')
  # A checkpoint's config recorded the old absolute path: the copy stands in.
  stored = {'data': {'tokenizer': 'hf', 'hf_tokenizer': original}}
  resolved = own_tokenizer.resolve_paths(stored, moved)
  assert resolved['data']['hf_tokenizer'] == os.path.join(moved, 'tokenizer')
  # The command line's tokenizer, gone: the copy stands in.
  config = own_tokenizer.use_own_tokenizer(_hf_config(original), moved)
  assert config.data.hf_tokenizer == os.path.join(moved, 'tokenizer')


def test_a_workdir_copies_its_sentencepiece_model_and_records_it_relative(
    tmp_path,
):
  """data.spm_model is copied to WORKDIR/tokenizer.model and recorded as
  'tokenizer.model'; with the workdir moved and the original deleted, the
  recorded, the checkpoint's and the command line's paths are the copy."""
  original = str(tmp_path / 'spm' / 'm.model')
  os.makedirs(os.path.dirname(original))
  with open(original, 'wb') as f:
    f.write(b'model bytes')
  config = tiny_config()
  config.data.tokenizer = 'sentencepiece'
  config.data.spm_model = original
  config = config_lib.RunConfig.from_config_dict(config)
  run = str(tmp_path / 'run')
  os.makedirs(run)
  workdir.write_config(run, config)
  with open(os.path.join(run, 'config.json')) as f:
    assert json.load(f)['data']['spm_model'] == 'tokenizer.model'
  with open(os.path.join(run, 'tokenizer.model'), 'rb') as f:
    assert f.read() == b'model bytes'
  moved = str(tmp_path / 'elsewhere')
  shutil.move(run, moved)
  shutil.rmtree(os.path.dirname(original))
  own = os.path.join(moved, 'tokenizer.model')
  assert workdir.saved_config(moved)['data']['spm_model'] == own
  stored = {'data': {'tokenizer': 'sentencepiece', 'spm_model': original}}
  resolved = own_tokenizer.resolve_paths(stored, moved)
  assert resolved['data']['spm_model'] == own
  assert own_tokenizer.use_own_tokenizer(config, moved).data.spm_model == own
  # A model trained on the corpus (spm_model='') is the data's, not copied.
  trained = dataclasses.replace(
      config, data=dataclasses.replace(config.data, spm_model='')
  )
  fresh = str(tmp_path / 'fresh')
  os.makedirs(fresh)
  workdir.write_config(fresh, trained)
  assert not os.path.exists(os.path.join(fresh, 'tokenizer.model'))
  assert own_tokenizer.use_own_tokenizer(trained, moved).data.spm_model == ''


def test_byte_identical_tokenizer_copies_compare_as_one_config(tmp_path):
  from flax_posemb import eval_report

  a = _hf_config(_tokenizer_dir(tmp_path / 'a' / 'tokenizer'))
  b = _hf_config(_tokenizer_dir(tmp_path / 'b' / 'tokenizer'))
  c = _hf_config(_tokenizer_dir(tmp_path / 'c' / 'tokenizer', '{"other": 1}'))
  same = [own_tokenizer.comparable(x) for x in (a, b)]
  assert eval_report.config_differences(['a', 'b'], same) == []
  other = [own_tokenizer.comparable(x) for x in (a, c)]
  (difference,) = eval_report.config_differences(['a', 'c'], other)
  assert difference['field'] == 'data.hf_tokenizer'
  assert a.data.hf_tokenizer == str(tmp_path / 'a' / 'tokenizer')


def test_the_first_training_row_says_its_tokens_per_sec_include_compilation(
    tiny_run,
):
  rows = [r for _, r in workdir.metric_rows(tiny_run[0]) if 'loss' in r]
  assert len(rows) > 1
  assert rows[0]['includes_compilation'] is True
  assert not any('includes_compilation' in r for r in rows[1:])
