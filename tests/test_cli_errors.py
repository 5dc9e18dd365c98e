"""What the CLIs do when things go wrong: one message and exit 2 for bad input
(no traceback, nothing written), 75 when preempted, 3 for a non-finite loss;
SIGTERM during setup leaves nothing; invalid UTF-8 is counted, dropped or
refused (data.on_decode_error); Grain workers end with their parent."""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from conftest import ROOT
from conftest import SUBPROCESS_ENV
from flax_posemb import cli
from flax_posemb import config as config_lib
from flax_posemb import preemption

TRAIN = [
    str(ROOT / 'train.py'),
    '--config',
    'configs/tiny.py',
    '--workdir',
    'WD',
]
EVAL = [str(ROOT / 'eval.py')]
DATA = [
    '-m',
    'flax_posemb.commands.data_report',
    '--config',
    'configs/tiny.py',
    '--num_batches',
    '1',
]
EXPERIMENTS = ['-m', 'flax_posemb.experiments']
# Small enough to compile and train in seconds (train.py flags).
TINY = [
    '--config.model.num_layers=1',
    '--config.model.emb_dim=32',
    '--config.model.mlp_dim=64',
    '--config.model.num_heads=2',
    '--config.data.seq_len=32',
    '--config.model.max_len=32',
    '--config.batch_size=8',
    '--config.eval_every_steps=0',
    '--config.progress_bar=False',
    '--config.eval.bucket_size=8',
]

# (argv, a fragment the one-line message must contain). Every one fails before a
# model is built. The programs' own checks (flags, paths, config files) and, for
# train.py, one refusal of each kind by the config check (a field's value, a
# data source that cannot be opened); the other refused config values are
# CONFIG_REFUSALS, checked in-process.
BAD_INPUTS = [
    (
        TRAIN + ['--config.modle.num_layers=2'],
        (
            "unknown config field 'modle' in "
            "--config.modle.num_layers=2; did you mean 'model'"
        ),
    ),
    (TRAIN + ['--config.batch_size=abc'], 'batch_size'),
    (TRAIN[:3], '--workdir is required: Run directory'),
    (
        TRAIN + ['--config.data.position_policy=natual'],
        "Unknown data.position_policy 'natual'; did you mean 'natural'?",
    ),
    (
        TRAIN
        + [
            '--config.data.source=tfds',
            '--config.data.name=pg91',
            '--config.data.data_dir=DIR',
            '--config.model.vocab_size=257',
        ],
        "No prepared dataset 'pg91' (data.name) under DIR. Did you mean"
        " 'pg19'?",
    ),
    (
        TRAIN[:1] + ['--config', 'configs/nope.py', '--workdir', 'WD'],
        '--config: cannot load the config file',
    ),
    (TRAIN + ['stray'], "unexpected arguments ['stray']"),
    (TRAIN + ['--config.seed=-1'], 'seed must be an int in [0, 2147483647]'),
    (
        TRAIN
        + [
            '--config.data.source=local_text',
            '--config.data.local_glob=DIR/none/*.txt',
        ],
        'Set --config.model.vocab_size=257',
    ),
    (TRAIN[:3] + ['--workdir', 'DIR/file'], 'not a directory'),
    (TRAIN[:3] + ['--workdir', 'DIR/file/sub'], 'is a file'),
    (TRAIN[:3] + ['--workdir', 'DIR/dangling'], 'is a symbolic link to'),
    (EVAL, '--workdir'),
    (EVAL + ['--workdir', 'DIR/missing'], 'not a directory'),
    (
        EVAL + ['--workdir', 'DIR/tiny_rn'],
        'DIR/tiny_rn is not a directory; did you mean DIR/tiny_run?',
    ),
    (EVAL + ['--workdir', 'DIR'], 'no checkpoint'),
    (EVAL + ['--workdir', 'DIR', '--num_windows', '0'], 'num_windows'),
    (EVAL + ['--workdir', 'DIR', '--batch_size', '-3'], 'batch_size'),
    (EVAL + ['--workdir', 'DIR', '--offsets', 'a,b'], '--offsets'),
    (
        EVAL + ['--workdir', 'RUN', '--split', 'nosuchsplit'],
        "Synthetic split 'nosuchsplit' unknown",
    ),
    (
        EVAL + ['--workdir', 'EMPTY_CONFIG'],
        "config.json is not the config of a training run (no 'model'"
        ' section). Nothing was changed. Every checkpoint stores the config:'
        ' move it aside',
    ),
    (EVAL + ['--workdir', 'DIR', '--offsets', '-5'], '--offsets must be >= 0'),
    (
        EVAL
        + ['--workdir', 'DIR', '--buckets', 'log2', '--bucket_edges', '0,8'],
        'not both',
    ),
    (EVAL + ['--workdir', 'DIR', 'stray'], 'unexpected arguments'),
    (
        EVAL + ['--workdir', 'DIR', '--window_start', 'random'],
        "'random' was retired (one window per document mostly scored the"
        " openings of short documents); use 'deep'",
    ),
    (DATA[:4] + ['--num_batches', '0'], 'num_batches'),
    (DATA + ['--config.nope=1'], "unknown config field 'nope'"),
    (DATA + ['--config.data.source=nope'], 'data.source'),
    (DATA + ['--json', 'DIR/file/x.json'], 'not a directory'),
    (DATA[:2], '--config is required: '),
    (DATA + ['stray'], "unexpected arguments ['stray']"),
    (['-m', 'flax_posemb.gallery', 'stray'], "unexpected arguments ['stray']"),
    (EXPERIMENTS, 'required'),
    (
        EXPERIMENTS + ['configs/experiments/nope.py', '--workdir', 'DIR/x'],
        'not found',
    ),
    (EXPERIMENTS + ['configs/tiny.py', '--workdir', 'DIR/x'], 'get_config'),
    (
        EXPERIMENTS
        + [
            'configs/experiments/exposure.py',
            '--workdir',
            'DIR/x',
            '--max_runs',
            'abc',
        ],
        'max_runs',
    ),
]


def _run(argv, tmp_path, env=None, timeout=300):
  argv = [
      a.replace('WD', str(tmp_path / 'wd')).replace('DIR', str(tmp_path))
      for a in argv
  ]
  return subprocess.run(
      [sys.executable, *argv],
      cwd=str(ROOT),
      capture_output=True,
      text=True,
      timeout=timeout,
      env=dict(
          env or SUBPROCESS_ENV, FLAX_POSEMB_DATA_DIR=str(tmp_path / 'data')
      ),
  )


def _message_lines(stderr):
  """stderr without absl/TFDS log lines (W1130 ..., I1130 ...)."""
  return [
      line
      for line in stderr.splitlines()
      if line.strip()
      and not (len(line) > 5 and line[0] in 'IWE' and line[1:5].isdigit())
  ]


@pytest.mark.parametrize(
    'argv, fragment',
    BAD_INPUTS,
    ids=[
        f'{i}-{" ".join(a[1:] if a[0] == "-m" else a[3:])[:60]}'
        for i, (a, _) in enumerate(BAD_INPUTS)
    ],
)
def test_bad_cli_input_is_one_message_and_exit_2(
    tmp_path, argv, fragment, tiny_run
):
  (tmp_path / 'file').write_text('not a directory')
  (tmp_path / 'dangling').symlink_to(tmp_path / 'gone')
  (tmp_path / 'tiny_run').mkdir()
  (tmp_path / 'short.txt').write_text('too short to train on')
  if 'EMPTY_CONFIG' in argv:
    run = shutil.copytree(tiny_run[0], tmp_path / 'run')
    (run / 'config.json').write_text('{}')
    argv = [a.replace('EMPTY_CONFIG', str(run)) for a in argv]
  argv = [a.replace('RUN', tiny_run[0]) for a in argv]
  proc = _run(argv, tmp_path)
  lines = _message_lines(proc.stderr)
  assert proc.returncode == cli.EXIT_USER_ERROR, proc.stderr[-3000:]
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert len(lines) == 1, lines
  prog = 'python -m' if argv[0] == '-m' else os.path.basename(argv[0])
  fragment = fragment.replace('DIR', str(tmp_path))
  assert lines[0].startswith(prog) and fragment in lines[0], lines[0]
  assert not (tmp_path / 'wd').exists() and not (tmp_path / 'x').exists()


# (field -> value over configs/tiny.py, a fragment of the message) that
# train.py's config check refuses. It runs in `train_and_evaluate` before
# anything is written; how train.py reports such a refusal (one line, exit 2)
# is pinned by the train.py cases of BAD_INPUTS.
CONFIG_REFUSALS = [
    ({'max_to_keep': 0}, 'max_to_keep must be >= 1'),
    (
        {'optimizer.learning_rate': float('nan')},
        'optimizer.learning_rate must be finite',
    ),
    ({'optimizer.learning_rate': -1.0}, 'optimizer.learning_rate must be > 0'),
    ({'optimizer.grad_clip_norm': float('inf')}, 'optimizer.grad_clip_norm'),
    ({'optimizer.eps': -1.0}, 'optimizer.eps must be >= 0'),
    ({'data.synthetic.num_docs': 10}, 'lower eval.num_windows'),
    ({'eval.bucket_edges': 'abc'}, 'eval.bucket'),
    ({'eval.min_start': -1}, 'eval.min_start must be >= 0'),
    ({'eval.window_start': 'random'}, "'random' was retired"),
    ({'eval.window_start': 'deep'}, 'needs a text source'),
    ({'data.source': 'nope'}, 'data.source'),
    ({'eval.seed': -1}, 'eval.seed must be >= 0'),
    ({'eval.position_policy': 'nope'}, 'Unknown evaluation position_policy'),
    ({'data.synthetic.seed': -1}, 'and seed >= 0'),
    ({'data.synthetic.concentration': float('nan')}, 'finite concentration'),
    ({'data.synthetic.concentration': float('inf')}, 'finite concentration'),
    ({'data.val_percent': 101}, 'data.val_percent must be'),
    (
        {'model.position_init_std': float('nan')},
        'model.position_init_std must be a number',
    ),
    (
        # Opened only by the training iterator (no periodic eval).
        {
            'data.source': 'local_text',
            'data.local_glob': 'DIR/short.txt',
            'data.min_doc_len': 1000,
            'model.vocab_size': 257,
            'eval_every_steps': 0,
        },
        'the corpus is (nearly) empty',
    ),
    (
        {
            'data.source': 'local_text',
            'data.local_glob': 'DIR/none/*.txt',
            'model.vocab_size': 257,
        },
        'matches no files',
    ),
    ({'data.on_decode_error': 'ignore'}, 'data.on_decode_error'),
    ({'data.num_workers': -1}, 'data.num_workers must be >= 0'),
]


@pytest.mark.parametrize(
    'overrides, fragment',
    CONFIG_REFUSALS,
    ids=[
        ' '.join(f'{k}={v}' for k, v in o.items()) for o, _ in CONFIG_REFUSALS
    ],
)
def test_a_refused_config_value_is_one_line_of_user_error_and_writes_nothing(
    tmp_path, overrides, fragment
):
  from configs import tiny
  from flax_posemb import training

  (tmp_path / 'short.txt').write_text('too short to train on')
  config = tiny.get_config()
  config.data.data_dir = str(tmp_path / 'data')
  for path, value in overrides.items():
    if isinstance(value, str):
      value = value.replace('DIR', str(tmp_path))
    config.update_from_flattened_dict({path: value})
  workdir = tmp_path / 'wd'
  with pytest.raises(Exception) as refusal:
    training.train_and_evaluate(config, str(workdir))
  assert cli._is_user_error(refusal.value), repr(refusal.value)
  message = cli._message(refusal.value)
  assert '\n' not in message and fragment in message, message
  assert not workdir.exists()


def test_debug_flag_and_env_var_show_the_traceback(tmp_path):
  argv = TRAIN + ['--config.max_to_keep=0']
  for extra, env in (
      ([' --debug'], None),
      ([], dict(SUBPROCESS_ENV, FLAX_POSEMB_DEBUG='1')),
  ):
    proc = _run(argv + [e.strip() for e in extra], tmp_path, env=env)
    assert proc.returncode != 0 and 'Traceback' in proc.stderr, proc.stderr[
        -2000:
    ]


def test_train_py_sigterm_during_training_saves_and_exits_75(tmp_path):
  wd = tmp_path / 'wd'
  argv = (
      TRAIN
      + TINY
      + [
          '--config.num_train_steps=100000',
          '--config.log_every_steps=2',
          '--config.checkpoint_every_steps=100000',
      ]
  )
  argv = [a.replace('WD', str(wd)) for a in argv]
  proc = subprocess.Popen(
      [sys.executable, *argv],
      cwd=str(ROOT),
      env=SUBPROCESS_ENV,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  deadline = time.time() + 300
  while (
      not (wd / 'metrics.jsonl').exists()
      and time.time() < deadline
      and proc.poll() is None
  ):
    time.sleep(0.2)
  proc.send_signal(signal.SIGTERM)
  out, err = proc.communicate(timeout=300)
  assert proc.returncode == cli.EXIT_PREEMPTED, err[-3000:]
  assert 'preempted at step' in out and 'Traceback' not in err
  steps = [int(d) for d in os.listdir(wd / 'checkpoints') if d.isdigit()]
  assert max(steps) >= 2


SETUP_SCRIPT = textwrap.dedent("""
    import os, signal, sys, time
    from flax_posemb import cli
    workdir = sys.argv[1]
    from flax_posemb import workdir as workdir_lib
    with cli.exit_early_on_sigterm('train.py', workdir):
      # setup had created the workdir and its lock file
      with workdir_lib.Lock(workdir):
        pass
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(30)
      print('not interrupted')
""")


def test_sigterm_before_training_removes_the_new_workdir_and_exits_75(tmp_path):
  wd = str(tmp_path / 'wd')
  proc = subprocess.run(
      [sys.executable, '-c', SETUP_SCRIPT, wd],
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert proc.returncode == cli.EXIT_PREEMPTED, proc.stderr
  assert not os.path.exists(wd) and 'not interrupted' not in proc.stdout
  assert proc.stderr.strip().startswith(
      'train.py: SIGTERM while starting, before the first'
  )
  # An existing workdir (a resume) is never removed.
  os.makedirs(os.path.join(wd, 'keep'))
  proc = subprocess.run(
      [sys.executable, '-c', SETUP_SCRIPT, wd],
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=60,
  )
  assert proc.returncode == cli.EXIT_PREEMPTED and os.path.isdir(
      os.path.join(wd, 'keep')
  )


def test_train_py_non_finite_loss_exits_3_with_one_message(tmp_path):
  argv = (
      TRAIN
      + TINY
      + [
          '--config.num_train_steps=20',
          '--config.log_every_steps=5',
          '--config.checkpoint_every_steps=10',
          '--config.optimizer.learning_rate=1e30',
          '--config.optimizer.grad_clip_norm=0',
          '--config.optimizer.warmup_steps=0',
      ]
  )
  proc = _run(argv, tmp_path)
  assert proc.returncode == cli.EXIT_NONFINITE, proc.stderr[-3000:]
  lines = _message_lines(proc.stderr)
  assert 'Traceback' not in proc.stderr and len(lines) == 1, lines
  assert lines[0].startswith('train.py: Non-finite training loss at step')


def _corpus(tmp_path):
  d = tmp_path / 'corpus'
  d.mkdir()
  (d / 'a.txt').write_text(
      'a perfectly good first document, long enough to train on.\n'
  )
  (d / 'b.txt').write_text(
      'a second good document that is also long enough for this.\n'
  )
  (d / 'bad.txt').write_bytes(
      b'starts fine \xff\xfe\x00\x81 then binary garbage and text\n'
  )
  return d


def _text_config(tmp_path, mode):
  from flax_posemb import defaults

  c = defaults.base()
  c.data.source, c.data.local_glob = 'local_text', str(
      tmp_path / 'corpus' / '*.txt'
  )
  c.data.data_dir, c.data.val_percent = str(tmp_path / 'data'), 0
  c.data.seq_len, c.model.max_len, c.batch_size = 16, 16, 2
  c.model.vocab_size = 257  # the byte tokenizer's ids
  c.data.on_decode_error = mode
  return c


@pytest.mark.parametrize(
    'mode, docs, replaced', [('replace', 3, True), ('skip', 2, False)]
)
def test_invalid_utf8_is_replaced_or_skipped_and_counted(
    tmp_path, mode, docs, replaced
):
  from flax_posemb import data
  from flax_posemb.data import report

  _corpus(tmp_path)
  c = config_lib.RunConfig.from_config_dict(_text_config(tmp_path, mode))
  src = data.make_source(c.data, 'train')
  assert len(src) == docs
  assert any('\ufffd' in src.text(i) for i in range(len(src))) == replaced
  rep = report.exposure(c, num_batches=1)
  assert (
      rep['decode_errors']['documents'] == 1
      and rep['decode_errors']['mode'] == mode
  )
  assert rep['decode_errors']['files'] == [str(tmp_path / 'corpus' / 'bad.txt')]
  assert 'invalid UTF-8: 1 document(s)' in report.format_report(rep)
  # The corpus has no validation split: the report says so instead of failing.
  assert "split 'validation'" in rep['eval_windows_problem']


def test_invalid_utf8_with_on_decode_error_error_refuses_naming_the_file(
    tmp_path,
):
  from flax_posemb import data

  _corpus(tmp_path)
  c = config_lib.RunConfig.from_config_dict(_text_config(tmp_path, 'error'))
  with pytest.raises(
      ValueError, match=r'bad\.txt is not valid UTF-8.*offset 12, line 1'
  ):
    data.make_source(c.data, 'train')
  # nothing half-built
  assert not os.path.exists(tmp_path / 'data' / 'local_text')


def test_text_records_of_invalid_utf8_follow_on_decode_error():
  from flax_posemb.data import sources
  from flax_posemb.data import tokenizers

  records = [{'text': b'ok text'}, {'text': b'bad \xff bytes'}]
  tok = tokenizers.ByteTokenizer()
  rep = sources.TextSource(records, tok, 'text', on_decode_error='replace')
  assert rep.text(1) == 'bad \ufffd bytes' and rep.decode_errors == 1
  skip = sources.TextSource(records, tok, 'text', on_decode_error='skip')
  assert (
      skip.text(1) == ''
      and skip.text(0) == 'ok text'
      and skip.decode_errors == 1
  )
  with pytest.raises(ValueError, match='Document 1 is not valid UTF-8'):
    sources.TextSource(records, tok, 'text', on_decode_error='error').text(1)


GRAIN_SCRIPT = textwrap.dedent("""
    import os, sys, time
    from flax_posemb import data
    c = data.DataConfig(seq_len=16, num_workers=1)
    it = data.make_train_iterator(
        c, batch_size=2, seed=0, num_train_steps=10)
    next(it)
    me = str(os.getpid())
    kids = [p for p in os.listdir('/proc') if p.isdigit() and
            open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[1] == me]
    print(' '.join(kids), flush=True)
    time.sleep(600)
""")


def test_grain_workers_exit_when_their_parent_is_sigkilled():
  proc = subprocess.Popen(
      [sys.executable, '-c', GRAIN_SCRIPT],
      env=SUBPROCESS_ENV,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  line = proc.stdout.readline()
  workers = [int(p) for p in line.split()]
  assert workers, (
      proc.stderr.read()[-2000:] if proc.poll() is not None else 'no workers'
  )
  proc.kill()
  proc.wait()
  deadline = time.time() + 20
  alive = workers
  while alive and time.time() < deadline:
    time.sleep(0.5)
    alive = [
        p
        for p in workers
        if os.path.exists(f'/proc/{p}')
        and open(f'/proc/{p}/stat').read().rsplit(')', 1)[1].split()[0] != 'Z'
    ]
  assert not alive, f'Grain workers {alive} outlived their SIGKILLed parent'


def test_a_damaged_latest_checkpoint_is_one_message_not_a_traceback(tmp_path):
  workdir = str(tmp_path / 'damaged')
  args = [
      sys.executable,
      str(ROOT / 'train.py'),
      '--config',
      'configs/tiny.py',
      '--workdir',
      workdir,
      '--config.num_train_steps=4',
      '--config.checkpoint_every_steps=2',
      '--config.eval_every_steps=0',
      '--config.progress_bar=False',
  ]
  assert (
      subprocess.run(
          args, cwd=ROOT, env=SUBPROCESS_ENV, capture_output=True, timeout=600
      ).returncode
      == 0
  )
  for root, _, files in os.walk(
      os.path.join(workdir, 'checkpoints', '4', 'params')
  ):
    for f in files:
      if f != 'commit_success.txt':
        with open(os.path.join(root, f), 'r+b') as fh:
          fh.truncate(3)
  proc = subprocess.run(
      args,
      cwd=ROOT,
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert proc.returncode == 2 and 'Traceback' not in proc.stderr, proc.stderr[
      -2000:
  ]
  assert 'is damaged' in proc.stderr and 'step 2' in proc.stderr


# The duplicate run stops just before taking the lock: past its SIGTERM handler,
# with the workdir created (by its own makedirs) while another run holds it or
# has finished in it.
DUPLICATE_SCRIPT = textwrap.dedent("""
    import os, runpy, signal, sys
    from flax_posemb import workdir
    def enter(self):
      print('READY', flush=True)
      sys.stdin.readline()  # the first run takes the workdir meanwhile
      os.kill(os.getpid(), signal.SIGTERM)
    workdir.Lock.__enter__ = enter
    sys.argv = ['train.py', *sys.argv[1:]]
    runpy.run_path('train.py', run_name='__main__')
""")


@pytest.mark.parametrize('first_run', ['training', 'finished'])
def test_sigterm_in_a_duplicate_train_py_never_removes_the_other_workdir(
    tmp_path, first_run
):
  from flax_posemb import workdir

  wd = tmp_path / 'wd'
  proc = subprocess.Popen(
      [
          sys.executable,
          '-c',
          DUPLICATE_SCRIPT,
          '--config',
          'configs/tiny.py',
          '--workdir',
          str(wd),
          *TINY,
      ],
      cwd=str(ROOT),
      env=SUBPROCESS_ENV,
      stdin=subprocess.PIPE,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )
  try:
    assert proc.stdout.readline().strip() == 'READY', proc.stderr.read()[-3000:]
    assert wd.is_dir()  # created by the duplicate
    lock = workdir.Lock(str(wd)).__enter__()  # the first run
    for name in ('config.json', 'metrics.jsonl', 'checkpoints/0/params'):
      (wd / name).parent.mkdir(parents=True, exist_ok=True)
      (wd / name).write_text('{}')
    if first_run == 'finished':
      lock.__exit__()
    proc.stdin.write('\n')
    proc.stdin.flush()
    _, err = proc.communicate(timeout=120)
  finally:
    proc.kill()
  assert proc.returncode == cli.EXIT_PREEMPTED, err[-3000:]
  assert 'removed' not in err and 'Traceback' not in err, err[-3000:]
  assert {p.name for p in wd.iterdir()} >= {
      '.lock',
      'config.json',
      'metrics.jsonl',
      'checkpoints',
  }
  assert (wd / 'checkpoints' / '0' / 'params').exists()


# A full disk inside an Orbax save, as TensorStore reports it (a ValueError),
# from step 4 on.
ENOSPC_SCRIPT = textwrap.dedent("""
    import runpy, sys
    from orbax.checkpoint._src.serialization import serialization
    real = serialization.async_serialize_from_host
    async def full_disk(rslices, spec, **kwargs):
      if '/checkpoints/4.' in str(spec):
        raise ValueError(
            'RESOURCE_EXHAUSTED: Failed writing: "' + str(spec)[:40] + '": '
            'Failed to write 7614 bytes to file 12: No space left on device '
            "[os_error_code='28']")
      return await real(rslices, spec, **kwargs)
    serialization.async_serialize_from_host = full_disk
    sys.argv = ['train.py', *sys.argv[1:]]
    runpy.run_path('train.py', run_name='__main__')
""")


def test_a_full_disk_during_a_checkpoint_save_exits_1_with_one_traceback(
    tmp_path,
):
  """The README's table: an environment failure is exit 1 with its traceback,
  printed once (not as a user error, and not again from Orbax's and
  TensorBoard's threads)."""
  wd = tmp_path / 'wd'
  proc = subprocess.run(
      [
          sys.executable,
          '-c',
          ENOSPC_SCRIPT,
          '--config',
          'configs/tiny.py',
          '--workdir',
          str(wd),
          *TINY,
          '--config.num_train_steps=6',
          '--config.checkpoint_every_steps=2',
          '--config.log_every_steps=2',
      ],
      cwd=str(ROOT),
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == cli.EXIT_UNEXPECTED, proc.stderr[-3000:]
  assert proc.stderr.count('Traceback') == 1, proc.stderr[-6000:]
  assert (
      'No space left on device' in _message_lines(proc.stderr)[-1]
  ), proc.stderr[-3000:]
  assert (
      'Exception ignored' not in proc.stderr
      and 'Exception in thread' not in proc.stderr
  )
  steps = sorted(int(d) for d in os.listdir(wd / 'checkpoints') if d.isdigit())
  assert steps[-1] == 2  # the last good checkpoint, to resume from


def test_a_really_full_disk_exits_1_with_one_traceback_and_nothing_else(
    small_disk,
):
  """A filesystem that fills up, not an injected error: nothing else on stderr
  from Orbax's writer threads, their event loops or TensorBoard (thread,
  atexit)."""
  proc = subprocess.run(
      [
          sys.executable,
          str(ROOT / 'train.py'),
          '--config',
          'configs/tiny.py',
          '--workdir',
          str(small_disk / 'wd'),
          '--config.num_train_steps=6',
          '--config.log_every_steps=2',
          '--config.checkpoint_every_steps=2',
          '--config.eval_every_steps=0',
          '--config.progress_bar=False',
      ],
      cwd=str(ROOT),
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == cli.EXIT_UNEXPECTED, proc.stderr[-3000:]
  assert proc.stderr.count('Traceback') == 1, proc.stderr[-6000:]
  assert (
      'No space left on device' in _message_lines(proc.stderr)[-1]
  ), proc.stderr[-3000:]
  for noise in (
      'Event loop is closed',
      'Exception ignored',
      'Exception in thread',
      'atexit',
  ):
    assert noise not in proc.stderr, proc.stderr[-6000:]


def _holds_sigterm(pid):
  """Whether the process blocks (holds) or catches SIGTERM: train.py blocks it
  first thing."""
  with open(f'/proc/{pid}/status') as f:
    masks = [
        int(line.split()[1], 16)
        for line in f
        if line.startswith(('SigBlk:', 'SigCgt:'))
    ]
  return any(m >> (signal.SIGTERM - 1) & 1 for m in masks)


def test_train_py_sigterm_while_importing_exits_75_with_a_message(tmp_path):
  """SIGTERM in the first moments (imports, before setup) is no silent -15."""
  wd = tmp_path / 'wd'
  proc = subprocess.Popen(
      [sys.executable, *[a.replace('WD', str(wd)) for a in TRAIN]],
      cwd=str(ROOT),
      env=SUBPROCESS_ENV,
      stderr=subprocess.PIPE,
      text=True,
  )
  while proc.poll() is None and not _holds_sigterm(proc.pid):
    time.sleep(0.001)
  proc.send_signal(signal.SIGTERM)
  _, err = proc.communicate(timeout=60)
  assert proc.returncode == cli.EXIT_PREEMPTED, err[-2000:]
  lines = _message_lines(err)
  assert len(lines) == 1 and lines[0].startswith(
      'train.py: SIGTERM while starting'
  ), lines
  assert not wd.exists()


# SIGTERM while a gc callback runs (JAX registers some): Python only reports
# the handler's `Preempted` there, so the request alone must stop the run.
GC_CALLBACK_SCRIPT = textwrap.dedent("""
    import gc, os, runpy, signal, sys
    from flax_posemb import training
    real = training.check_periodic_eval
    def check_after_a_sigterm_in_a_gc_callback(config):
      def callback(phase, info):
        if phase == 'start':
          gc.callbacks.remove(callback)
          os.kill(os.getpid(), signal.SIGTERM)  # handled in this callback
      gc.callbacks.append(callback)
      gc.collect()
      return real(config)
    training.check_periodic_eval = check_after_a_sigterm_in_a_gc_callback
    sys.argv = ['train.py', *sys.argv[1:]]
    runpy.run_path('train.py', run_name='__main__')
""")


def test_a_sigterm_handled_inside_a_gc_callback_still_stops_the_run(tmp_path):
  wd = tmp_path / 'wd'
  proc = subprocess.run(
      [
          sys.executable,
          '-c',
          GC_CALLBACK_SCRIPT,
          '--config',
          'configs/tiny.py',
          '--workdir',
          str(wd),
          *TINY,
          '--config.num_train_steps=3',
      ],
      cwd=str(ROOT),
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert proc.returncode == cli.EXIT_PREEMPTED, proc.stderr[-3000:]
  assert 'preempted at step 0' in proc.stdout
  assert 'Traceback' not in proc.stderr, proc.stderr[-3000:]
  assert os.listdir(wd / 'checkpoints') == ['0']


def test_the_training_sigterm_handler_only_sets_a_flag_and_is_removed():
  """Library callers (no CLI): `defer_sigterm` installs the one handler for the
  block, where a SIGTERM is a flag the training loop polls, and puts the
  previous handler back."""
  before = signal.getsignal(signal.SIGTERM)
  with preemption.defer_sigterm():
    assert not preemption.sigterm_requested()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.01)
    assert preemption.sigterm_requested()
  assert signal.getsignal(signal.SIGTERM) is before


def test_a_second_run_in_one_process_stops_on_a_sigterm_during_setup(
    tmp_path,
):
  """The deferral of one run's training ends with it: the next run's setup exits
  75 at once."""
  before = signal.getsignal(signal.SIGTERM)
  with cli.exit_early_on_sigterm('train.py', str(tmp_path / 'a')):
    with preemption.defer_sigterm():
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(0.01)
      assert preemption.sigterm_requested()
  with pytest.raises(SystemExit) as e:
    with cli.exit_early_on_sigterm('train.py', str(tmp_path / 'b')):
      os.kill(os.getpid(), signal.SIGTERM)
      time.sleep(1)
  assert e.value.code == cli.EXIT_PREEMPTED
  assert signal.getsignal(signal.SIGTERM) is before
