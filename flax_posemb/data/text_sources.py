"""Real-text sources through TFDS (array_record + `as_data_source`; no TensorFlow needed).

* ``local_text``: the user's ``.txt`` / ``.jsonl`` files (`data.local_glob`), one document
  per file, line or blank-line paragraph (`data.local_split_by`; a ``.jsonl`` line's
  `data.text_feature` field is its text, one document per line).
* ``stdlib``: this Python's standard-library ``.py`` files, each split into documents at
  top-level ``def`` / ``class`` / decorator lines (a mix of short and long documents).
  Available on every machine without download.
* ``tfds``: any prepared TFDS text dataset (`data.name`, feature `data.text_feature`).

``local_text`` and ``stdlib`` are `GeneratorBasedBuilder`s built on first use into the data
directory. Their builder config name carries a content hash of the input files (and the
Python version for ``stdlib``), so changed files or another Python build a new dataset.
Splits: a document goes to 'validation' when a hash of its key falls in the first
`data.val_percent` percent, else to 'train' (deterministic).

Invalid UTF-8 (`data.on_decode_error`): 'replace' stores U+FFFD for the bad bytes, 'skip'
drops the document, 'error' refuses to build, naming the file, document and byte. The build
records how many documents (and which files) were affected in the dataset's metadata; every
load logs a warning when there were any, and `TextSource.build_decode_errors` carries them
(the exposure report prints them).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob as glob_lib
import hashlib
import inspect
import io
import json
import os
import re
import sys
import sysconfig

from absl import logging
from etils import epath
import tensorflow_datasets as tfds

from flax_posemb.data import sources
from flax_posemb.data import tokenizers

LONG_DOC_CORPORA = ('wiki40b/en', 'pg19')
_BUILD_FORMAT = 'utf8v1'  # In the builder config hash: bump when the stored documents change.
_ESCAPED = re.compile('[\udc80-\udcff]')  # Undecodable bytes under errors='surrogateescape'.


def data_dir(data_config) -> str:
  """`data.data_dir`, else $FLAX_POSEMB_DATA_DIR, else ~/.cache/flax_posemb."""
  d = data_config.data_dir or os.environ.get('FLAX_POSEMB_DATA_DIR') or os.path.join(
      os.path.expanduser('~'), '.cache', 'flax_posemb')
  os.makedirs(d, exist_ok=True)
  return d


def _hash_percent(key: str) -> float:
  """Deterministic score in [0, 100) of a document key (its split is by this score)."""
  return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 2**32 * 100


def _hash_files(paths: list[str], extra: str) -> str:
  h = hashlib.sha1(extra.encode())
  for p in paths:
    h.update(p.encode())
    with open(p, 'rb') as f:
      h.update(f.read())
  return h.hexdigest()[:12]


def _refuse_invalid_utf8(paths: list[str]) -> None:
  """data.on_decode_error=error: raises ValueError naming the first file that is not valid
  UTF-8 (checked before the build starts, so a refused corpus leaves nothing behind)."""
  for p in paths:
    with open(p, 'rb') as f:
      raw = f.read()
    try:
      raw.decode('utf-8')
    except UnicodeDecodeError as e:
      line = raw[:e.start].count(b'\n') + 1
      raise ValueError(
          f'{p} is not valid UTF-8 ({e.reason}, byte 0x{raw[e.start]:02x} at offset {e.start}, '
          f'line {line}); data.on_decode_error=error refuses it. Fix or remove the file, or '
          'set --config.data.on_decode_error=replace (U+FFFD, counted) or skip (drop the '
          'document, counted).') from None


def _split_text(text: str, split_by: str) -> list[str]:
  if split_by == 'file':
    return [text]
  if split_by == 'line':
    return text.split('\n')
  return re.split(r'\n[ \t]*\n', text)


_TOP_LEVEL = re.compile(r'(def |class |async def |@)')


def split_python_source(text: str) -> list[str]:
  """Splits a module at top-level def/class/decorator lines (decorators stay attached).

  Returns:
    Non-blank documents; their concatenation is `text` minus blank-only parts.
  """
  docs, cur, prev_decorator = [], [], False
  for line in text.splitlines(keepends=True):
    if _TOP_LEVEL.match(line) and not prev_decorator and cur:
      docs.append(''.join(cur))
      cur = []
    cur.append(line)
    if line.strip():
      prev_decorator = line.startswith('@')
  docs.append(''.join(cur))
  return [d for d in docs if d.strip()]


class TextBuilderConfig(tfds.core.BuilderConfig):
  """Builder config of the text corpora: the documents to write."""

  def __init__(self, *, name: str, files: tuple[str, ...], split_by: str,
               text_field: str, val_percent: int, description: str = '',
               on_decode_error: str = 'replace', hf_dataset: str = ''):
    super().__init__(name=name, version=tfds.core.Version('1.0.0'), description=description)
    self.files = files
    self.hf_dataset = hf_dataset  # A Hugging Face `datasets` dataset saved to disk (prepare).
    self.split_by = split_by  # file | line | paragraph | python
    self.text_field = text_field
    self.val_percent = val_percent
    self.on_decode_error = on_decode_error  # replace | skip | error


class _TextCorpus(tfds.core.GeneratorBasedBuilder):
  """Documents from local files; splits by hashed document key."""

  VERSION = tfds.core.Version('1.0.0')
  BUILDER_CONFIGS = []

  # TFDS' default probes `importlib_resources` (not installed here); the file is enough.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(inspect.getfile(_TextCorpus))

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self, description=self._source().description,
        features=tfds.features.FeaturesDict({'text': tfds.features.Text()}),
        metadata=tfds.core.MetadataDict())

  SOURCE: TextBuilderConfig | None = None  # The documents of a builder without configs.

  def _source(self) -> TextBuilderConfig:
    return self.builder_config or self.SOURCE

  def _docs(self, bad: list[str] | None = None):
    """Yields (key, text) of every document, in file order; appends the keys of documents
    with invalid UTF-8 to `bad` (they are replaced, skipped or refused: on_decode_error)."""
    cfg = self._source()
    if getattr(cfg, 'hf_dataset', ''):
      yield from hf_documents(cfg.hf_dataset, cfg.text_field)
      return
    for path in cfg.files:
      if path.endswith('.parquet'):
        yield from ((f'{path}:{i}', doc) for i, doc in enumerate(parquet_texts(
            path, cfg.text_field)))
        continue
      with open(path, 'rb') as f:
        content = f.read().decode('utf-8', errors='surrogateescape')  # Lossless.
      if path.endswith('.jsonl'):
        docs = []
        for line in content.split('\n'):
          if line.strip():
            rec = json.loads(line)
            docs.append(str(rec.get(cfg.text_field, '')) if isinstance(rec, dict) else str(rec))
      elif cfg.split_by == 'python':
        docs = split_python_source(content)
      else:
        docs = _split_text(content, cfg.split_by)
      for i, doc in enumerate(docs):
        key = f'{path}:{i}'
        escaped = _ESCAPED.search(doc)
        if escaped:
          if bad is not None:
            bad.append(key)
          mode = getattr(cfg, 'on_decode_error', 'replace')
          if mode == 'error':
            raise ValueError(
                f'{path} is not valid UTF-8 (document {i} of the file, byte '
                f'0x{ord(escaped.group()) - 0xDC00:02x}); data.on_decode_error=error refuses '
                'it. Fix or remove the file, or set --config.data.on_decode_error=replace '
                '(U+FFFD, counted) or skip (drop the document, counted).')
          if mode == 'skip':
            continue
          doc = doc.encode('utf-8', 'surrogateescape').decode('utf-8', errors='replace')
        yield key, doc

  def _split_generators(self, dl_manager):
    del dl_manager
    pct = self._source().val_percent
    bad: list[str] = []
    scores = {key: _hash_percent(key) for key, _ in self._docs(bad)}
    self.info.metadata['decode_errors'] = {
        'mode': getattr(self._source(), 'on_decode_error', 'replace'),
        'documents': len(bad), 'files': sorted({k.rsplit(':', 1)[0] for k in bad})[:20]}
    val = {k for k, v in scores.items() if v < pct}
    if pct > 0 and not val and len(scores) >= 2:  # Tiny corpus: still one validation doc.
      val = {min(scores, key=scores.get)}
    out = {}
    if len(val) < len(scores):
      out['train'] = self._generate_examples(val, False)
    if val:
      out['validation'] = self._generate_examples(val, True)
    return out

  def _generate_examples(self, val: set[str], validation: bool):
    for key, doc in self._docs():
      if (key in val) == validation:
        yield key, {'text': doc}


class LocalText(_TextCorpus):
  """The user's .txt/.jsonl files (`data.local_glob`)."""


class Stdlib(_TextCorpus):
  """The Python standard library's .py files, split at top-level definitions."""


def _prepare(builder_cls, config: TextBuilderConfig, ddir: str):
  """Builds the dataset once; a file lock keeps concurrent processes from racing."""
  builder = builder_cls(config=config, data_dir=ddir)
  if builder.is_prepared():
    _warn_decode_errors(builder)
    return builder
  lock = os.path.join(ddir, f'.{builder.name}_{config.name}.lock')
  with open(lock, 'w') as f:
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
      builder = builder_cls(config=config, data_dir=ddir)
      if not builder.is_prepared():
        # TFDS prints "Downloading and preparing dataset Unknown size..." and progress bars
        # for what is a local build: one log line says what happens instead.
        logging.info('Building the %s corpus (%s) into %s ...', builder.name,
                     config.description, ddir)
        tfds.disable_progress_bar()
        with contextlib.redirect_stdout(io.StringIO()):
          builder.download_and_prepare(file_format='array_record')
    finally:
      fcntl.flock(f, fcntl.LOCK_UN)
  builder = builder_cls(config=config, data_dir=ddir)
  _warn_decode_errors(builder)
  return builder


def decode_errors(builder) -> dict | None:
  """What the build of `builder` found: {'mode', 'documents', 'files'}, or None."""
  meta = builder.info.metadata
  return dict(meta['decode_errors']) if meta and 'decode_errors' in meta else None


_WARNED: set[str] = set()


def _warn_decode_errors(builder) -> None:
  """Logs (once per dataset and process) the documents the build found invalid UTF-8 in."""
  found = decode_errors(builder)
  if not found or not found['documents'] or builder.builder_config.name in _WARNED:
    return
  _WARNED.add(builder.builder_config.name)
  what = ('replaced the invalid bytes by U+FFFD' if found['mode'] == 'replace'
          else 'dropped them')
  logging.warning('%s: %d document(s) are not valid UTF-8 (files: %s); '
                  'data.on_decode_error=%s %s. Use data.on_decode_error=error to refuse such '
                  'files.', builder.name, found['documents'], ', '.join(found['files'][:5]),
                  found['mode'], what)


def parquet_texts(path: str, column: str) -> list[str]:
  """The ``column`` of a Parquet file as a list of documents (needs pyarrow)."""
  try:
    import pyarrow.parquet as pq  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f'{path}: reading .parquet files needs pyarrow (pip install pyarrow).'
                     ) from None
  names = pq.read_schema(path).names
  if column not in names:
    raise ValueError(f'{path} has no column {column!r} (data.text_feature / --text_field); '
                     f'its columns are {names}.')
  return ['' if t is None else str(t) for t in pq.read_table(path, columns=[column])
          .column(column).to_pylist()]


def hf_documents(path: str, column: str):
  """(key, text) of every row of a Hugging Face dataset saved with ``save_to_disk`` (needs the
  ``datasets`` library); a ``DatasetDict``'s splits in order, keys ``SPLIT:ROW``."""
  try:
    import datasets  # pylint: disable=g-import-not-at-top
  except ImportError:
    raise ValueError(f'{path}: reading a Hugging Face dataset needs the datasets library '
                     '(pip install datasets).') from None
  ds = datasets.load_from_disk(path)
  parts = ds.items() if isinstance(ds, datasets.DatasetDict) else [('all', ds)]
  for split, part in parts:
    if column not in part.column_names:
      raise ValueError(f'{path} ({split}) has no column {column!r} (--text_field); its '
                       f'columns are {part.column_names}.')
    for i, text in enumerate(part[column]):
      yield f'{split}:{i}', '' if text is None else str(text)


def stdlib_files() -> list[str]:
  """Sorted .py files of this Python's standard library (no site-packages, no tests)."""
  root = sysconfig.get_paths()['stdlib']
  out = []
  for dirpath, dirnames, filenames in os.walk(root):
    dirnames[:] = sorted(d for d in dirnames if d not in (
        'site-packages', 'dist-packages', '__pycache__', 'test', 'tests', 'idle_test'))
    out += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith('.py')]
  return out


def _records(data_config, split: str):
  """(records, text feature, build decode errors or None): random-access records (dicts
  with a text feature) of `split`."""
  c = data_config
  ddir = data_dir(c)
  val_percent = int(c.val_percent)
  mode = sources.decode_mode(c)
  if c.source in ('local_text', 'stdlib'):
    if split not in ('train', 'validation'):
      raise ValueError(f"Split {split!r} unknown for {c.source}; use 'train' or 'validation'.")
    if c.source == 'local_text':
      files = sorted(glob_lib.glob(os.path.expanduser(c.local_glob), recursive=True))
      files = [f for f in files if os.path.isfile(f)]
      if not files:
        raise ValueError(f'data.local_glob={c.local_glob!r} matches no files; the corpus '
                         'is empty.')
      bad = [f for f in files if not f.endswith(('.txt', '.jsonl'))]
      if bad:
        raise ValueError(f'local_text reads .txt or .jsonl files only; got {bad[:3]}.')
      h = _hash_files(files, f'{c.local_split_by}|{c.text_feature}|{val_percent}|'
                      f'{_BUILD_FORMAT}|{mode}')
      if mode == 'error':
        _refuse_invalid_utf8(files)
      config = TextBuilderConfig(name=f'h{h}', files=tuple(files), split_by=c.local_split_by,
                                 text_field=c.text_feature, val_percent=val_percent,
                                 description=f'{len(files)} files from {c.local_glob}',
                                 on_decode_error=mode)
      builder = _prepare(LocalText, config, ddir)
    else:
      files = stdlib_files()
      ver = f'py{sys.version_info.major}{sys.version_info.minor}'
      h = _hash_files(files, f'{ver}|{val_percent}|{_BUILD_FORMAT}|{mode}')
      config = TextBuilderConfig(
          name=f'{ver}_{h}', files=tuple(files), split_by='python', text_field='text',
          val_percent=val_percent, on_decode_error=mode,
          description=f'Python {sys.version.split()[0]} stdlib, {len(files)} files')
      builder = _prepare(Stdlib, config, ddir)
    if split not in builder.info.splits:
      raise ValueError(
          f'{c.source} split {split!r} has no documents (corpus of '
          f'{sum(s.num_examples for s in builder.info.splits.values())} documents, '
          f'data.val_percent={val_percent}); the corpus is empty or too small, or change '
          'data.val_percent.')
    return builder.as_data_source(split=split), 'text', decode_errors(builder)
  if c.source == 'long_text':
    from flax_posemb.data import long_text  # pylint: disable=g-import-not-at-top
    return long_text.records(c, split, ddir), 'text', None
  return (*tfds_records(c.name, split, ddir, c.text_feature), None)


def prepare_hint(name: str, ddir: str) -> str:
  """The commands that prepare TFDS dataset `name` as array_record into `ddir`."""
  return (f'Prepare it once (on any machine; TensorFlow is needed only there) with\n'
          f'  pip install "flax_posemb[prepare]"  # brings TensorFlow/Beam for preparation\n'
          f'  tfds build {name.split(":")[0]} --file_format=array_record --data_dir={ddir}\n'
          f'(prepared on another machine: copy its {name.split(":")[0].split("/")[0]}/ '
          f'directory into {ddir}). For '
          f'long-context studies use corpora with long documents '
          f'({", ".join(LONG_DOC_CORPORA)}); lm1b is shuffled single sentences and useless '
          'for long context.')


def prepared_datasets(ddir: str) -> list[str]:
  """Names (``NAME`` or ``NAME/CONFIG``) of the datasets prepared under ``ddir``."""
  found = set()
  for depth in ('*/*', '*/*/*'):
    for info in glob_lib.glob(os.path.join(ddir, depth, 'dataset_info.json')):
      parts = os.path.relpath(os.path.dirname(info), ddir).split(os.sep)
      if parts[-1][:1].isdigit():  # NAME[/CONFIG]/VERSION
        found.add('/'.join(parts[:-1]))
  return sorted(found)


def not_prepared_message(name: str, ddir: str) -> str:
  """Why TFDS dataset ``name`` cannot be read from ``ddir``, and the fixes. Without TensorFlow
  TFDS cannot tell a catalog dataset that was never prepared from a name that does not
  exist, so the message gives both."""
  base = name.split(':')[0]
  listed = prepared_datasets(ddir)
  listed = ', '.join(listed[:20]) + (' ...' if len(listed) > 20 else '') if listed else 'none'
  return (
      f'No prepared dataset {name!r} (data.name) under {ddir} (no '
      f'{os.path.join(ddir, *base.split("/"))}/<version>/dataset_info.json). If it is a TFDS '
      f'catalog dataset, build it once (TensorFlow is needed only there): pip install '
      f'"flax_posemb[prepare]"; tfds build {base} --file_format=array_record '
      f'--data_dir={ddir} (built elsewhere: copy its {base.split("/")[0]}/ directory into '
      f'{ddir}). If it is your own text: python -m flax_posemb.data.prepare --name {base} '
      f"--input 'FILES' --data_dir {ddir} (README, \"Configs and data\"). Otherwise check "
      'the spelling: catalog names are lowercase, e.g. pg19, wiki40b/en. Prepared datasets '
      f'in {ddir}: {listed}.')


def find_builder_dir(name: str, ddir: str) -> str | None:
  """The prepared directory ``ddir/NAME[/CONFIG]/VERSION`` of `name`, or None.

  `name` is ``NAME``, ``NAME/CONFIG`` or either with ``:VERSION``; without a config, a
  dataset with exactly one prepared config is found too. The highest prepared version wins.
  """
  base, _, version = name.partition(':')
  root = os.path.join(ddir, *base.split('/'))
  pattern = version or '*'
  cands = glob_lib.glob(os.path.join(root, pattern, 'dataset_info.json'))
  if not cands and '/' not in base:
    cands = glob_lib.glob(os.path.join(root, '*', pattern, 'dataset_info.json'))
    if len({os.path.dirname(os.path.dirname(x)) for x in cands}) > 1:
      configs = sorted({os.path.basename(os.path.dirname(os.path.dirname(x))) for x in cands})
      raise ValueError(f'TFDS dataset {base!r} has several prepared configs in {ddir}: '
                       f'{configs}; name one in data.name (e.g. {base}/{configs[0]}).')

  def key(path):
    try:
      return tuple(int(x) for x in os.path.basename(os.path.dirname(path)).split('.'))
    except ValueError:
      return (-1,)

  cands = [x for x in cands if key(x) != (-1,)]
  return os.path.dirname(max(cands, key=key)) if cands else None


def string_features(features) -> list[str]:
  """Names of the top-level text/string features of a TFDS `FeaturesDict`."""
  out = []
  for k, f in features.items():
    if isinstance(f, tfds.features.Text) or str(getattr(f, 'dtype', '')) in (
        "<dtype: 'string'>", 'object', 'string') or getattr(f, 'np_dtype', None) == object:
      out.append(k)
  return out


def pick_text_feature(features, wanted: str, name: str) -> str:
  """`wanted` if the dataset has it, else its only string feature, else its only string
  feature named like '*text*'; else a clear error listing the string features."""
  if features is None or wanted in features:
    return wanted
  texts = string_features(features)
  named = [k for k in texts if 'text' in k.lower()]
  for cands in (texts, named):
    if len(cands) == 1:
      return cands[0]  # E.g. pg19's 'book_text' (next to 'book_title', 'url', ...).
  raise ValueError(
      f'TFDS dataset {name!r} has no feature {wanted!r} (data.text_feature); its string '
      f'features are {texts} (all features: {sorted(features)}). Set '
      f'--config.data.text_feature to one of them.')


_LOGGED_FEATURES: set[tuple[str, str]] = set()


def _log_feature(name: str, feature: str, wanted: str) -> None:
  """Logs (once per dataset and process) which feature is read as the text."""
  if (name, feature) in _LOGGED_FEATURES:
    return
  _LOGGED_FEATURES.add((name, feature))
  why = '' if feature == wanted else (f' (picked: the dataset has no {wanted!r}; set '
                                       'data.text_feature to choose another)')
  logging.info('TFDS dataset %s: text feature %r%s.', name, feature, why)


def tfds_records(name: str, split: str, ddir: str, text_feature: str = 'text'):
  """Random-access records of a prepared TFDS dataset and its text feature.

  Reads the builder directory under `ddir` directly (`tfds.builder_from_directory`), so a
  dataset prepared elsewhere with ``tfds build NAME --file_format=array_record`` is read
  without TensorFlow (TFDS registers wiki40b, c4, pg19, ... only when TensorFlow imports).
  Falls back to `tfds.data_source` for registered datasets.

  Returns:
    (records, feature): records[i] is a dict; `feature` the key of its text (`text_feature`
    if present, else the dataset's only string feature, e.g. pg19's 'book_text').

  Raises:
    ValueError: no prepared dataset of that name (`not_prepared_message`), not array_record,
      unknown split (lists the splits) or no usable text feature (lists them).
  """
  path = find_builder_dir(name, ddir)
  if path is None:
    try:
      records = tfds.data_source(name, split=split, data_dir=ddir, download=False)
    except Exception:  # pylint: disable=broad-except  # Unknown, or registered but not prepared.
      raise ValueError(not_prepared_message(name, ddir)) from None
    info = getattr(records, 'dataset_info', None)
    feature = pick_text_feature(getattr(info, 'features', None), text_feature, name)
    _log_feature(name, feature, text_feature)
    return records, feature
  builder = tfds.builder_from_directory(path)
  fmt = getattr(builder.info, 'file_format', None)
  fmt = str(getattr(fmt, 'value', fmt) or '')
  if fmt and 'array_record' not in fmt.lower():
    raise ValueError(f'TFDS dataset {name!r} in {path} is stored as {fmt}, which has no '
                     f'random access without TensorFlow; rebuild it as array_record. '
                     f'{prepare_hint(name, ddir)}')
  if split not in builder.info.splits:
    raise ValueError(f'TFDS dataset {name!r} has no split {split!r}; its splits are '
                     f'{sorted(builder.info.splits)} (set data.train_split / '
                     'data.eval_split).')
  feature = pick_text_feature(builder.info.features, text_feature, name)
  _log_feature(name, feature, text_feature)
  return builder.as_data_source(split=split), feature


def make_tokenizer(data_config) -> tokenizers.Tokenizer:
  """The configured tokenizer; a SentencePiece model is trained on the train split once and
  cached in the data directory."""
  c = data_config
  if c.tokenizer == 'byte':
    return tokenizers.ByteTokenizer()
  if c.tokenizer != 'sentencepiece':
    raise ValueError(f'Unknown data.tokenizer {c.tokenizer!r}; use byte | sentencepiece.')
  if c.spm_model:
    return tokenizers.SentencePieceTokenizer(model_file=c.spm_model)
  records, feature, _ = _records(c, c.train_split)
  key = hashlib.sha1(f'{c.source}|{c.name}|{c.local_glob}|{c.local_split_by}|'
                     f'{len(records)}|{c.spm_vocab_size}'.encode()).hexdigest()[:12]
  path = os.path.join(data_dir(c), 'spm', f'{c.source}_{key}.model')
  if os.path.exists(path):
    return tokenizers.SentencePieceTokenizer(model_file=path)
  src = sources.TextSource(records, tokenizers.ByteTokenizer(), feature,
                           on_decode_error=sources.decode_mode(c))
  texts = (src.text(i) for i in range(min(len(src), 50_000)))
  return tokenizers.SentencePieceTokenizer.train(texts, int(c.spm_vocab_size), save_path=path)


def make_text_source(data_config, split: str) -> sources.TextSource:
  """`TextSource` of `split` for source local_text | stdlib | tfds."""
  records, feature, found = _records(data_config, split)
  if len(records) == 0:
    raise ValueError(f'Split {split!r} of data.source={data_config.source!r} has no '
                     'documents; the corpus is empty.')
  c = data_config
  src = sources.TextSource(records, make_tokenizer(c), feature,
                           on_decode_error=sources.decode_mode(c),
                           kind=c.name if c.source == 'tfds' else c.source)
  src.build_decode_errors = found
  return src
