"""Datasets without TensorFlow: `python -m flax_posemb.commands.prepare` and
data.source=tfds."""

import hashlib
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import types

import ml_collections
import pytest

from conftest import ROOT
from conftest import SUBPROCESS_ENV
from flax_posemb import preemption
from flax_posemb.data import text_corpus
from flax_posemb.data import text_sources


def _texts(root):
  root.mkdir()
  for i in range(8):
    (root / f'book{i}.txt').write_text(
        f'Chapter {i}. ' + 'It was a dark night. ' * (20 + i)
    )
  (root / 'more.jsonl').write_text(
      ''.join(json.dumps({'body': f'note {i} ' * 30}) + '\n' for i in range(6))
  )
  return root


@pytest.mark.slow
def test_prepared_local_text_trains_through_the_tfds_source_without_tensorflow(
    tmp_path,
):
  texts = _texts(tmp_path / 'texts')
  # The machine of the README's install: TensorFlow absent (TFDS and etils probe
  # for it with importlib.util.find_spec, so it cannot be faked away where it is
  # installed).
  env = SUBPROCESS_ENV
  probe = subprocess.run(
      [sys.executable, '-c', 'import tensorflow'],
      env=env,
      capture_output=True,
      text=True,
  )
  if probe.returncode == 0:
    pytest.skip(
        'TensorFlow is installed here; this test needs a machine without it.'
    )
  ddir = tmp_path / 'tfds'
  p = subprocess.run(
      [
          sys.executable,
          '-m',
          'flax_posemb.commands.prepare',
          '--name',
          'my_notes',
          '--input',
          str(texts / '*.txt'),
          '--input',
          str(texts / '*.jsonl'),
          '--text_field',
          'body',
          '--data_dir',
          str(ddir),
          '--val_percent',
          '30',
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert p.returncode == 0, p.stderr[-2000:]
  assert (
      "text feature 'text'" in p.stdout
      and '--config.data.name=my_notes' in p.stdout
  )
  wd = tmp_path / 'run'
  p = subprocess.run(
      [
          sys.executable,
          'train.py',
          '--config',
          'configs/tiny.py',
          '--workdir',
          str(wd),
          '--config.data.source=tfds',
          '--config.data.name=my_notes',
          f'--config.data.data_dir={ddir}',
          '--config.model.vocab_size=257',
          '--config.data.seq_len=32',
          '--config.model.max_len=32',
          '--config.batch_size=4',
          '--config.num_train_steps=3',
          '--config.log_every_steps=1',
          '--config.eval_every_steps=0',
          '--config.progress_bar=False',
      ],
      cwd=ROOT,
      env=env,
      capture_output=True,
      text=True,
      timeout=600,
  )
  assert p.returncode == 0, p.stderr[-3000:]
  assert "TFDS dataset my_notes: text feature 'text'." in p.stderr
  rows = [
      json.loads(line)
      for line in (wd / 'metrics.jsonl').read_text().splitlines()
  ]
  assert [r['step'] for r in rows if 'loss' in r] == [1, 2, 3]
  assert (
      json.loads((wd / 'config.json').read_text())['data']['source'] == 'tfds'
  )


def test_prepare_shows_progress_and_warns_of_too_few_validation_documents(
    tmp_path,
):
  texts = _texts(tmp_path / 'texts')
  p = subprocess.run(
      [
          sys.executable,
          '-m',
          'flax_posemb.commands.prepare',
          '--name',
          'few',
          '--input',
          str(texts / '*.txt'),
          '--data_dir',
          str(tmp_path / 'tfds'),
          '--val_percent',
          '30',
      ],
      cwd=ROOT,
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=300,
  )
  assert p.returncode == 0, p.stderr[-2000:]
  validation = int(p.stdout.split('validation ')[1].split()[0])
  assert 0 < validation < 8
  # Our own bars, one line each; none of TFDS's (one per split and shuffle,
  # moving the cursor up over each other into one long line).
  for bar in ('Reading inputs', 'Reading documents', 'Writing train'):
    assert bar in p.stderr
  assert 'Writing validation' in p.stderr
  assert 'Generating' not in p.stderr and 'Shuffling' not in p.stderr
  assert '\x1b[A' not in p.stderr
  bars = [line for line in p.stderr.splitlines() if '%|' in line]
  assert bars and all(
      len(update) < 100 for line in bars for update in line.split('\r')
  )
  warning = p.stderr.strip().splitlines()[-1]
  assert warning.startswith('python -m flax_posemb.commands.prepare: warning:')
  assert f'the validation split has {validation} documents' in warning
  assert '64 windows' in warning and 'eval.py --num_windows N' in warning


def test_prepare_reads_parquet_rows_and_refuses_to_overwrite(tmp_path):
  pa = pytest.importorskip('pyarrow')
  import pyarrow.parquet as pq

  pq.write_table(
      pa.table(
          {'text': [f'row {i} ' * 10 for i in range(12)], 'id': list(range(12))}
      ),
      tmp_path / 'rows.parquet',
  )
  out = text_sources.prepare_dataset(
      'rows',
      str(tmp_path / 'tfds'),
      inputs=(str(tmp_path / '*.parquet'),),
      val_percent=25,
  )
  assert sum(out['splits'].values()) == 12 and set(out['splits']) == {
      'train',
      'validation',
  }
  records, feature = text_sources.tfds_records(
      'rows', 'train', str(tmp_path / 'tfds')
  )
  assert feature == 'text' and len(records) == out['splits']['train']
  assert all(r['text'].decode().startswith('row ') for r in records)
  with pytest.raises(ValueError, match='exists; pass --overwrite'):
    text_sources.prepare_dataset(
        'rows', str(tmp_path / 'tfds'), inputs=(str(tmp_path / '*.parquet'),)
    )
  with pytest.raises(ValueError, match=r"no column 'body'.*\['text', 'id'\]"):
    text_sources.prepare_dataset(
        'rows2',
        str(tmp_path / 'tfds'),
        inputs=(str(tmp_path / '*.parquet'),),
        text_field='body',
    )
  with pytest.raises(ValueError, match='not .txt/.jsonl/.parquet'):
    (tmp_path / 'x.csv').write_text('a')
    text_sources.prepare_dataset(
        'rows3', str(tmp_path / 'tfds'), inputs=(str(tmp_path / '*'),)
    )


def test_prepare_reads_a_saved_hugging_face_dataset_and_names_a_missing_column(
    tmp_path,
):
  datasets = pytest.importorskip('datasets')
  texts = [f'doc {i} ' * 20 for i in range(10)] + [None]
  datasets.DatasetDict(
      {'train': datasets.Dataset.from_dict({'text': texts})}
  ).save_to_disk(str(tmp_path / 'hf'))
  # A missing cell is no document: refused, or left out when asked.
  with pytest.raises(ValueError, match=r'\(train\) row 10: missing'):
    text_sources.prepare_dataset(
        'hfnotes', str(tmp_path / 'tfds'), hf_dataset=str(tmp_path / 'hf')
    )
  out = text_sources.prepare_dataset(
      'hfnotes',
      str(tmp_path / 'tfds'),
      hf_dataset=str(tmp_path / 'hf'),
      val_percent=20,
      skip_unreadable=True,
  )
  assert sum(out['splits'].values()) == 10
  records, feature = text_sources.tfds_records(
      'hfnotes', 'train', str(tmp_path / 'tfds')
  )
  assert feature == 'text' and len(records) == out['splits']['train']
  with pytest.raises(
      ValueError, match=r"\(train\) has no column 'body'.*\['text'\]"
  ):
    text_sources.prepare_dataset(
        'hf2',
        str(tmp_path / 'tfds'),
        hf_dataset=str(tmp_path / 'hf'),
        text_field='body',
    )


@pytest.mark.parametrize(
    'args, message',
    [
        (
            ['--name', 'Bad', '--input', 'x.txt'],
            '--name: use lower-case letters',
        ),
        (['--name', 'ok'], 'Exactly one of (input, hf_dataset)'),
        (
            ['--name', 'ok', '--input', 'x.txt', '--hf_dataset', 'd'],
            'Exactly one of',
        ),
    ],
)
def test_prepare_flags_refuse_a_bad_name_and_need_exactly_one_input(
    tmp_path, args, message
):
  p = subprocess.run(
      [
          sys.executable,
          '-m',
          'flax_posemb.commands.prepare',
          '--data_dir',
          str(tmp_path),
          *args,
      ],
      cwd=ROOT,
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=120,
  )
  assert (
      p.returncode == 2 and message in p.stderr and 'Traceback' not in p.stderr
  )


def _notes(tmp_path, n=8):
  """``n`` .txt documents (their directory)."""
  d = tmp_path / 'notes'
  d.mkdir(exist_ok=True)
  for i in range(n):
    (d / f'note{i}.txt').write_text(f'note {i}: ' + 'some words here. ' * 8)
  return d


def _documents(ddir, name='notes'):
  """Every document of a prepared dataset, sorted."""
  texts = []
  for split in ('train', 'validation'):
    records, _ = text_sources.tfds_records(name, split, str(ddir))
    texts += [r['text'].decode() for r in records]
  return sorted(texts)


def test_a_refused_overwrite_leaves_the_old_dataset_as_it_was(tmp_path):
  ddir = tmp_path / 'tfds'
  text_sources.prepare_dataset(
      'notes', str(ddir), inputs=(str(_notes(tmp_path) / '*.txt'),)
  )
  before = _documents(ddir)
  bad = tmp_path / 'bad.jsonl'
  bad.write_text('{"text": "a line cut short\n')
  with pytest.raises(ValueError) as refused:
    text_sources.prepare_dataset(
        'notes', str(ddir), inputs=(str(bad),), overwrite=True
    )
  assert _documents(ddir) == before
  assert f'{bad}:1: not JSON' in str(refused.value)
  assert sorted(p.name for p in ddir.iterdir() if p.name[0] != '.') == ['notes']
  assert not list(ddir.glob('.notes.build-*'))


def test_an_interrupted_prepare_leaves_no_dataset_directory(
    tmp_path, monkeypatch
):
  """Killed while TFDS writes the shards: no DIR/NAME (so a re-run needs no
  --overwrite and train.py does not find half a dataset); a killed run's
  hidden build directory is removed by the next run."""
  ddir = tmp_path / 'tfds'
  notes = str(_notes(tmp_path) / '*.txt')
  real = text_corpus.TextCorpus._generate_examples

  def killed_after_one(self, val, validation):
    yield next(real(self, val, validation))
    raise KeyboardInterrupt

  monkeypatch.setattr(
      text_corpus.TextCorpus, '_generate_examples', killed_after_one
  )
  with pytest.raises(KeyboardInterrupt):
    text_sources.prepare_dataset('notes', str(ddir), inputs=(notes,))
  assert not (ddir / 'notes').exists()
  monkeypatch.undo()
  (ddir / '.notes.build-killed' / 'notes').mkdir(parents=True)  # a kill -9's
  out = text_sources.prepare_dataset('notes', str(ddir), inputs=(notes,))
  assert sum(out['splits'].values()) == 8
  assert not list(ddir.glob('.notes.build-*'))


def test_unreadable_records_are_counted_named_and_refused_unless_skipped(
    tmp_path,
):
  d = _notes(tmp_path, 3)
  (d / 'more.jsonl').write_text(
      '\n'.join(
          [
              json.dumps({'text': 'a good record'}),
              json.dumps({'title': 'no text'}),
              json.dumps({'text': 12}),
              json.dumps({'text': None}),
              '{"text": "cut',
              json.dumps(['a', 'list']),
              json.dumps('a bare string is text'),
          ]
      )
      + '\n'
  )
  (d / 'bytes.txt').write_bytes(b'fine\nstill fine\nthen \xff\xfe here\n')
  ddir = tmp_path / 'tfds'
  with pytest.raises(ValueError) as e:
    text_sources.prepare_dataset('notes', str(ddir), inputs=(str(d / '*'),))
  message = str(e.value)
  assert message.startswith('6 record(s) cannot be read exactly')
  for where in (
      f'{d}/bytes.txt:3: not valid UTF-8',
      f"{d}/more.jsonl:2: no field 'text'",
      f"{d}/more.jsonl:3: field 'text' holds a JSON int (12), not text",
      f"{d}/more.jsonl:4: field 'text' holds a JSON NoneType",
      f'{d}/more.jsonl:5: not JSON',
  ):
    assert where in message, message
  assert '(and 1 more)' in message and '--skip_unreadable' in message
  assert not (ddir / 'notes').exists()
  out = text_sources.prepare_dataset(
      'notes', str(ddir), inputs=(str(d / '*'),), skip_unreadable=True
  )
  assert out['unreadable']['records'] == 6
  texts = _documents(ddir)
  assert 'a good record' in texts and 'a bare string is text' in texts
  assert len(texts) == 3 + 2 and not any(t in ('', '12') for t in texts)
  recorded = json.loads(
      (ddir / 'notes' / '1.0.0' / 'prepared_from.json').read_text()
  )
  assert recorded['unreadable']['records'] == 6
  assert recorded['options']['skip_unreadable'] is True


def test_invalid_utf8_replaced_on_request_is_reported_when_training_on_it(
    tmp_path,
):
  from flax_posemb import defaults

  d = _notes(tmp_path, 3)
  (d / 'bytes.txt').write_bytes(b'then \xff here\n')
  ddir = tmp_path / 'tfds'
  out = text_sources.prepare_dataset(
      'notes', str(ddir), inputs=(str(d / '*'),), on_decode_error='replace'
  )
  assert out['decode_errors']['records'] == [f'{d}/bytes.txt:1']
  c = defaults.data()
  c.source, c.name, c.data_dir, c.val_percent = 'tfds', 'notes', str(ddir), 0
  src = text_sources.make_text_source(c, 'train')
  assert src.build_decode_errors['documents'] == 1


@pytest.mark.parametrize(
    'table, message',
    [
        ({'text': ['a'] * 3, 'id': [1, 2, 3]}, "column 'id' holds int64"),
        ({'text': ['a', None, 'c']}, 'rows.parquet:row 1: missing'),
    ],
)
def test_parquet_text_that_is_not_text_or_missing_is_refused(
    tmp_path, table, message
):
  pa = pytest.importorskip('pyarrow')
  import pyarrow.parquet as pq

  pq.write_table(pa.table(table), tmp_path / 'rows.parquet')
  field = 'id' if 'id' in table else 'text'
  with pytest.raises(ValueError, match=re.escape(message)):
    text_sources.prepare_dataset(
        'rows',
        str(tmp_path / 'tfds'),
        inputs=(str(tmp_path / 'rows.parquet'),),
        text_field=field,
    )
  assert not (tmp_path / 'tfds' / 'rows').exists()


def test_a_damaged_parquet_file_is_named(tmp_path):
  pytest.importorskip('pyarrow')
  (tmp_path / 'rows.parquet').write_bytes(b'PAR1 not really')
  with pytest.raises(
      ValueError, match=f'{tmp_path}/rows.parquet is not a readable Parquet'
  ):
    text_sources.prepare_dataset(
        'rows', str(tmp_path / 'tfds'), inputs=(str(tmp_path / '*.parquet'),)
    )


def test_a_prepared_dataset_records_its_inputs_and_their_hashes(tmp_path):
  d = _notes(tmp_path, 4)
  ddir = tmp_path / 'tfds'
  out = text_sources.prepare_dataset(
      'notes', str(ddir), inputs=(str(d / '*.txt'),)
  )
  recorded = json.loads(
      (ddir / 'notes' / '1.0.0' / 'prepared_from.json').read_text()
  )
  assert [i['path'] for i in recorded['inputs']] == sorted(
      str(p) for p in d.glob('*.txt')
  )
  for item in recorded['inputs']:
    data = open(item['path'], 'rb').read()
    assert item['sha256'] == hashlib.sha256(data).hexdigest()
    assert item['bytes'] == len(data)
  assert recorded['splits'] == out['splits'] and recorded['identity']
  (d / 'note0.txt').write_text('other words')
  again = text_sources.prepare_dataset(
      'notes', str(ddir), inputs=(str(d / '*.txt'),), overwrite=True
  )
  assert again['identity'] != out['identity']


def test_a_damaged_record_of_a_prepared_dataset_is_named_with_the_fix(tmp_path):
  d = _notes(tmp_path, 4)
  ddir = tmp_path / 'tfds'
  text_sources.prepare_dataset('notes', str(ddir), inputs=(str(d / '*.txt'),))
  record = ddir / 'notes' / '1.0.0' / 'prepared_from.json'
  record.write_text('{"inputs": [')
  config = ml_collections.ConfigDict(
      {'source': 'tfds', 'name': 'notes', 'data_dir': str(ddir)}
  )
  with pytest.raises(ValueError, match='prepared_from.json is damaged'):
    text_sources.dataset_identity(config)


def test_prepare_cli_refuses_unreadable_records_with_one_line_and_exit_2(
    tmp_path,
):
  (tmp_path / 'notes.jsonl').write_text(json.dumps({'body': 'x'}) + '\n')
  p = subprocess.run(
      [
          sys.executable,
          '-m',
          'flax_posemb.commands.prepare',
          '--name',
          'notes',
          '--input',
          str(tmp_path / 'notes.jsonl'),
          '--data_dir',
          str(tmp_path / 'tfds'),
      ],
      cwd=ROOT,
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=120,
  )
  lines = [
      line for line in p.stderr.splitlines() if line.startswith('python -m')
  ]
  assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr[-2000:]
  assert (
      len(lines) == 1
      and f"{tmp_path}/notes.jsonl:1: no field 'text'" in lines[0]
  )
  assert '--skip_unreadable' in lines[0]
  assert not (tmp_path / 'tfds' / 'notes').exists()


def test_a_resume_on_a_dataset_replaced_under_the_run_is_refused(tmp_path):
  """Same name, other files: the run recorded its dataset's identity, so the
  resume is refused like a config change (allowed and recorded with
  allow_config_change)."""
  from conftest import tiny_config
  from flax_posemb import training
  from flax_posemb import workdir

  ddir = tmp_path / 'tfds'
  first = tmp_path / 'first'
  first.mkdir()
  for i in range(6):
    (first / f'a{i}.txt').write_text(f'first text {i}. ' * 20)
  text_sources.prepare_dataset(
      'notes', str(ddir), inputs=(str(first / '*.txt'),), val_percent=30
  )
  c = tiny_config()
  c.data.source, c.data.name, c.data.data_dir = 'tfds', 'notes', str(ddir)
  c.model.vocab_size = 257
  c.num_train_steps, c.eval_every_steps, c.checkpoint_every_steps = 2, 0, 2
  wd = str(tmp_path / 'run')
  training.train_and_evaluate(c, wd)
  text_sources.prepare_dataset(
      'notes',
      str(ddir),
      inputs=(str(_notes(tmp_path) / '*.txt'),),
      val_percent=30,
      overwrite=True,
  )
  # The same config: only the text under the name changed.
  with pytest.raises(
      workdir.WorkdirError,
      match=r"another config \(dataset: 'tfds notes \w+' -> 'tfds notes \w+'\)",
  ):
    training.train_and_evaluate(c, wd)
  assert checkpointing_steps(wd) == [0, 2]
  c.allow_config_change = True
  assert training.train_and_evaluate(c, wd)['resumed_from'] == 2
  rows = [json.loads(line) for line in open(os.path.join(wd, 'metrics.jsonl'))]
  assert [r['step'] for r in rows if 'config_change' in r] == [2]
  assert (
      'dataset'
      in next(r for r in rows if 'config_change' in r)['config_change']
  )


def checkpointing_steps(workdir):
  return sorted(
      int(d)
      for d in os.listdir(os.path.join(workdir, 'checkpoints'))
      if d.isdigit()
  )


def _prepare_cli(*args, timeout=300, **popen):
  """``python -m flax_posemb.commands.prepare ARGS`` (a finished process)."""
  return subprocess.run(
      [sys.executable, '-m', 'flax_posemb.commands.prepare', *args],
      cwd=ROOT,
      env=SUBPROCESS_ENV,
      capture_output=True,
      text=True,
      timeout=timeout,
  )


def test_an_input_rewritten_during_prepare_leaves_a_record_that_matches(
    tmp_path, monkeypatch
):
  """Every input is rewritten after prepare read it and before its documents
  are built: the record's SHA-256 are still those of the documents the dataset
  holds (it hashed and built from the same bytes, read once)."""
  d = _notes(tmp_path, 6)
  real = text_corpus.file_records

  def rewritten_first(path, config):
    for note in d.glob('*.txt'):
      note.write_text('other words, written while prepare ran')
    return real(path, config)

  monkeypatch.setattr(text_corpus, 'file_records', rewritten_first)
  ddir = tmp_path / 'tfds'
  text_sources.prepare_dataset(
      'notes', str(ddir), inputs=(str(d / '*.txt'),), val_percent=30
  )
  recorded = json.loads(
      (ddir / 'notes' / '1.0.0' / 'prepared_from.json').read_text()
  )
  held = sorted(
      (len(text.encode()), hashlib.sha256(text.encode()).hexdigest())
      for text in _documents(ddir)
  )
  assert held == sorted((i['bytes'], i['sha256']) for i in recorded['inputs'])
  assert not any('other words' in text for text in _documents(ddir))


def test_an_input_deleted_during_prepare_is_named_in_one_line(
    tmp_path, monkeypatch
):
  d = _notes(tmp_path, 4)
  real = text_sources.glob_files

  def then_deleted(globs, suffixes, what):
    found = real(globs, suffixes, what)
    os.remove(found[1])
    return found

  monkeypatch.setattr(text_sources, 'glob_files', then_deleted)
  ddir = tmp_path / 'tfds'
  with pytest.raises(ValueError) as refused:
    text_sources.prepare_dataset('notes', str(ddir), inputs=(str(d / '*'),))
  message = str(refused.value)
  assert f'{d}/note1.txt disappeared while prepare read it' in message
  assert 'Errno' not in message and '\n' not in message
  assert not ddir.exists()


def test_a_missing_hf_dataset_is_reported_as_a_missing_path(tmp_path):
  p = _prepare_cli(
      '--name',
      'notes',
      '--hf_dataset',
      str(tmp_path / 'nowhere'),
      '--data_dir',
      str(tmp_path / 'tfds'),
  )
  assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr[-2000:]
  assert f'--hf_dataset {tmp_path}/nowhere does not exist' in p.stderr
  assert 'library' not in p.stderr and 'pip install' not in p.stderr
  assert not (tmp_path / 'tfds').exists()


def test_empty_inputs_are_left_out_counted_and_named(tmp_path):
  d = _notes(tmp_path, 4)
  (d / 'empty.txt').write_text('')
  (d / 'blank.txt').write_text('\n  \n')
  (d / 'rows.jsonl').write_text(
      json.dumps({'text': ''}) + '\n' + json.dumps({'text': 'a row'}) + '\n'
  )
  p = _prepare_cli(
      '--name',
      'notes',
      '--input',
      str(d / '*'),
      '--data_dir',
      str(tmp_path / 'tfds'),
      '--val_percent',
      '30',
  )
  assert p.returncode == 0, p.stderr[-2000:]
  counts = re.findall(r'(train|validation) (\d+) documents', p.stdout)
  assert sum(int(n) for _, n in counts) == 5  # 4 notes and 'a row'
  lines = [x for x in p.stdout.splitlines() if x.startswith('left out')]
  assert len(lines) == 1
  line = lines[0]
  assert line.startswith('left out 3 empty document(s)')
  for where in (f'{d}/empty.txt:1', f'{d}/blank.txt:1', f'{d}/rows.jsonl:1'):
    assert where in line
  assert all(text.strip() for text in _documents(tmp_path / 'tfds'))
  recorded = json.loads(
      (tmp_path / 'tfds' / 'notes' / '1.0.0' / 'prepared_from.json').read_text()
  )
  assert recorded['empty']['documents'] == 3


def test_a_split_that_leaves_train_empty_is_refused_with_one_line(tmp_path):
  d = _notes(tmp_path, 4)
  p = _prepare_cli(
      '--name',
      'notes',
      '--input',
      str(d / '*.txt'),
      '--data_dir',
      str(tmp_path / 'tfds'),
      '--val_percent',
      '100',
  )
  lines = [x for x in p.stderr.splitlines() if x.startswith('python -m')]
  assert p.returncode == 2 and 'Traceback' not in p.stderr, p.stderr[-2000:]
  assert len(lines) == 1
  assert '--val_percent 100 puts all 4 documents in the validation' in lines[0]
  assert not (tmp_path / 'tfds').exists()


def _start_prepare(name, input_glob, ddir):
  """The prepare command on `input_glob` into `ddir`, started, not awaited."""
  args = [
      sys.executable,
      '-m',
      'flax_posemb.commands.prepare',
      '--name',
      name,
      '--input',
      str(input_glob),
      '--data_dir',
      str(ddir),
  ]
  return subprocess.Popen(
      args,
      cwd=ROOT,
      env=SUBPROCESS_ENV,
      stdout=subprocess.PIPE,
      stderr=subprocess.PIPE,
      text=True,
  )


def test_sigterm_during_prepare_exits_75_and_leaves_nothing(tmp_path):
  """SIGTERM while the dataset is being built: exit 75 through the one
  handler, one line, and nothing in the data directory (it created it: gone
  too), so the same command then runs from scratch."""
  d = tmp_path / 'many'
  d.mkdir()
  for i in range(1500):
    (d / f'doc{i}.txt').write_text(f'document {i} ' + 'words ' * 500)
  ddir = tmp_path / 'tfds'
  p = _start_prepare('many', d / '*.txt', ddir)
  while not list(ddir.glob('.many.build-*')) and p.poll() is None:
    time.sleep(0.005)
  p.send_signal(signal.SIGTERM)
  _, stderr = p.communicate(timeout=120)
  assert p.returncode == 75, stderr[-2000:]
  assert 'Traceback' not in stderr
  assert 'SIGTERM: stopped before many was complete' in stderr
  assert not ddir.exists()


def test_sigterm_while_the_command_loads_jax_exits_75(tmp_path):
  """SIGTERM half a second in, while the command still imports its modules
  (JAX among them, seconds on a busy machine): the package loads no JAX
  before the command's first line holds the signal, so it exits 75 through
  the one handler, not -15."""
  notes = _notes(tmp_path)
  ddir = tmp_path / 'tfds'
  p = _start_prepare('notes', notes / '*.txt', ddir)
  time.sleep(0.5)
  p.send_signal(signal.SIGTERM)
  _, stderr = p.communicate(timeout=120)
  assert p.returncode == 75, stderr[-2000:]
  assert 'Traceback' not in stderr
  assert not ddir.exists()


def test_sigterm_in_a_library_call_leaves_nothing(tmp_path, monkeypatch):
  """The one handler's `Preempted` unwinds `prepare_dataset`: no dataset, no
  build directory, no lock file, and a data directory it found stays."""
  ddir = tmp_path / 'tfds'
  ddir.mkdir()
  (ddir / 'mine.txt').write_text('kept')
  real = text_corpus.TextCorpus._generate_examples

  def terminated_after_one(self, val, validation):
    yield next(real(self, val, validation))
    os.kill(os.getpid(), signal.SIGTERM)
    yield from real(self, val, validation)

  monkeypatch.setattr(
      text_corpus.TextCorpus, '_generate_examples', terminated_after_one
  )
  replaced = preemption.install_handler()
  try:
    with pytest.raises(preemption.Preempted):
      text_sources.prepare_dataset(
          'notes', str(ddir), inputs=(str(_notes(tmp_path) / '*.txt'),)
      )
  finally:
    signal.signal(signal.SIGTERM, replaced)
  assert sorted(p.name for p in ddir.iterdir()) == ['mine.txt']


def test_a_saved_hf_dataset_is_built_from_the_copy_it_hashed(
    tmp_path, monkeypatch
):
  """A stand-in for the `datasets` library (the few members prepare reads),
  whose load rewrites the saved dataset as it reads: the dataset is loaded from
  prepare's copy, and the record hashes the bytes of that copy."""
  hf = tmp_path / 'hf'
  hf.mkdir()
  texts = [f'saved document {i} ' * 10 for i in range(6)]
  original = json.dumps(texts).encode()
  (hf / 'rows.json').write_bytes(original)
  loaded_from = []

  class Dataset:

    def __init__(self, rows):
      self.rows = rows
      self.column_names = ['text']
      self.features = {'text': types.SimpleNamespace(dtype='string')}

    def __getitem__(self, column):
      return self.rows

  def load_from_disk(path):
    loaded_from.append(path)
    (hf / 'rows.json').write_text(json.dumps(['rewritten meanwhile']))
    return Dataset(json.loads((pathlib.Path(path) / 'rows.json').read_text()))

  fake = types.ModuleType('datasets')
  fake.Dataset = Dataset
  fake.DatasetDict = type('DatasetDict', (dict,), {})
  fake.load_from_disk = load_from_disk
  monkeypatch.setitem(sys.modules, 'datasets', fake)
  ddir = tmp_path / 'tfds'
  text_sources.prepare_dataset(
      'hfnotes', str(ddir), hf_dataset=str(hf), val_percent=30
  )
  assert loaded_from and loaded_from[0] != str(hf)
  recorded = json.loads(
      (ddir / 'hfnotes' / '1.0.0' / 'prepared_from.json').read_text()
  )
  assert recorded['inputs'] == [
      {
          'path': str(hf / 'rows.json'),
          'bytes': len(original),
          'sha256': hashlib.sha256(original).hexdigest(),
      }
  ]
  assert _documents(ddir, 'hfnotes') == sorted(texts)
