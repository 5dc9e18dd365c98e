"""Datasets without TensorFlow: `python -m flax_posemb.commands.prepare` and
data.source=tfds."""

import json
import subprocess
import sys

import pytest

from conftest import ROOT
from conftest import SUBPROCESS_ENV
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
  assert 'Reading documents' in p.stderr and 'Generating' in p.stderr
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
  out = text_sources.prepare_dataset(
      'hfnotes',
      str(tmp_path / 'tfds'),
      hf_dataset=str(tmp_path / 'hf'),
      val_percent=20,
  )
  assert sum(out['splits'].values()) == 11
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
