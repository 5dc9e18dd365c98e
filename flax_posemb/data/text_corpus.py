"""TFDS builders of text read from files, without TensorFlow: the builder
config, the corpus builder (records `FEATURES`, validation by key hash), one
build per dataset under a file lock, the file readers, and the standard
library's files cut at top-level definitions. Used by `text_sources` (the
local_text and stdlib corpora, prepared datasets) and `long_text`."""

from collections.abc import Iterator
import contextlib
import dataclasses
import fcntl
import functools
import hashlib
import importlib
import inspect
import io
import json
import os
import re
import sys
import sysconfig
from typing import Any, ClassVar

from absl import logging
from etils import epath
import tensorflow_datasets as tfds
import tqdm

# Corpora of the stdlib.
PY_VERSION = f'py{sys.version_info.major}{sys.version_info.minor}'
# In the builder config hash: bump when the stored documents change.
BUILD_FORMAT = 'utf8v1'


def hash_percent(key: str) -> float:
  """Deterministic score in [0, 100) of a document key (its split is by this
  score)."""
  return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 2**32 * 100


def hash_files(paths: list[str], extra: str) -> str:
  """12 hex digits of the SHA-1 of `extra`, then each path and its bytes."""
  h = hashlib.sha1(extra.encode())
  for p in paths:
    h.update(p.encode())
    h.update(epath.Path(p).read_bytes())
  return h.hexdigest()[:12]


# A record of a file: (where, its text or None, why it holds none).
Record = tuple[str, str | None, str]
# Characters that stand for bytes of invalid UTF-8 (surrogateescape), or any
# other surrogate, which no UTF-8 text holds.
_SURROGATES = re.compile('[\ud800-\udfff]')


class UnreadableRecordsError(ValueError):
  """Records that cannot be read exactly (no text field, a value that is not
  text, not JSON, invalid UTF-8), refused: ``records`` lists ``'WHERE:
  why'``."""

  def __init__(self, records: list[str], fix: str):
    self.records = records
    listed = '; '.join(records[:5])
    more = f' (and {len(records) - 5} more)' if len(records) > 5 else ''
    super().__init__(
        f'{len(records)} record(s) cannot be read exactly: {listed}{more}.'
        f' Nothing was built. {fix}'
    )


@dataclasses.dataclass
class Found:
  """What a build found besides documents: ``WHERE`` of each document of
  invalid UTF-8 it replaced or skipped, ``'WHERE: why'`` of each record it
  could not read, ``WHERE`` of each empty document it left out."""

  decode_errors: list[str] = dataclasses.field(default_factory=list)
  unreadable: list[str] = dataclasses.field(default_factory=list)
  empty: list[str] = dataclasses.field(default_factory=list)


def _replaced(text: str) -> str:
  """``text`` with its invalid UTF-8 bytes (kept as surrogates) decoded as
  U+FFFD, as Python's errors='replace' does; a surrogate written as a JSON
  escape becomes one U+FFFD too."""
  try:
    raw = text.encode('utf-8', 'surrogateescape')
  except UnicodeEncodeError:
    return _SURROGATES.sub('\ufffd', text)
  return raw.decode('utf-8', errors='replace')


def _line_starts(content: str, pieces: list[str]) -> list[int]:
  """The line (from 1) where each of `pieces`, consecutive substrings of
  `content` in order, starts."""
  lines = []
  offset = 0
  line = 1
  for piece in pieces:
    start = content.find(piece, offset)
    line += content.count('\n', offset, start)
    lines.append(line)
    line += piece.count('\n')
    offset = start + len(piece)
  return lines


def _text_pieces(content: str, split_by: str) -> list[str]:
  """The documents of a text file's content, cut by `split_by`."""
  if split_by == 'python':
    return split_python_source(content)
  if split_by == 'line':
    return content.split('\n')
  if split_by == 'file':
    return [content]
  return re.split(r'\n[ \t]*\n', content)  # 'paragraph'


def _json_text(record: Any, field: str) -> tuple[str | None, str]:
  """(text, '') of a parsed .jsonl line, or (None, why) if it holds no text
  under `field`."""
  if isinstance(record, str):
    return record, ''
  if not isinstance(record, dict):
    return None, f'a JSON {type(record).__name__}, not an object'
  if field not in record:
    return None, f'no field {field!r} (--text_field / data.text_feature)'
  value = record[field]
  if not isinstance(value, str):
    shown = json.dumps(value)[:40]
    return None, (
        f'field {field!r} holds a JSON {type(value).__name__} ({shown}), not'
        ' text'
    )
  return value, ''


def _jsonl_records(path: str, content: str, field: str) -> list[Record]:
  """The records of a .jsonl file's non-blank lines."""
  records: list[Record] = []
  for i, line in enumerate(content.split('\n')):
    if not line.strip():
      continue
    try:
      parsed = json.loads(line)
    except ValueError as e:
      records.append((f'{path}:{i + 1}', None, f'not JSON ({e})'))
      continue
    text, why = _json_text(parsed, field)
    records.append((f'{path}:{i + 1}', text, why))
  return records


def file_records(path: str, config: 'TextBuilderConfig') -> list[Record]:
  """``(where, text, why)`` of each record of a .txt/.jsonl/.py/.parquet file,
  in order: text None (and why) for one that holds no text; where is
  ``PATH:LINE`` (from 1; the line of a record's first invalid UTF-8 byte, kept
  as a surrogate) or ``PATH:row N`` (Parquet, from 0)."""
  if path.endswith('.parquet'):
    return parquet_records(path, config.text_field, stored_copy(path, config))
  content = (
      epath.Path(stored_copy(path, config))
      .read_bytes()
      .decode('utf-8', 'surrogateescape')
  )
  if path.endswith('.jsonl'):
    return _jsonl_records(path, content, config.text_field)
  pieces = _text_pieces(content, config.split_by)
  records: list[Record] = []
  for line, piece in zip(_line_starts(content, pieces), pieces):
    bad = _SURROGATES.search(piece)
    if bad:
      line += piece.count('\n', 0, bad.start())
    records.append((f'{path}:{line}', piece, ''))
  return records


def stored_copy(path: str, config: 'TextBuilderConfig') -> str:
  """Where the build reads input `path` from: prepare's copy of the bytes it
  hashed (`TextBuilderConfig.read_from`), else `path` itself."""
  return (config.read_from or {}).get(path, path)


def split_python_source(text: str) -> list[str]:
  """Non-blank documents of a module cut at top-level def/class (decorators
  attached)."""
  docs = []
  current: list[str] = []
  after_decorator = False
  for line in text.splitlines(keepends=True):
    starts_definition = re.match('def |class |async def |@', line)
    if starts_definition and not after_decorator and current:
      docs.append(''.join(current))
      current = []
    current.append(line)
    if line.strip():
      after_decorator = line.startswith('@')
  docs.append(''.join(current))
  return [d for d in docs if d.strip()]


@dataclasses.dataclass(eq=False, kw_only=True)
class TextBuilderConfig(tfds.core.BuilderConfig):
  """The documents of `files` (or a saved Hugging Face dataset), cut by
  `split_by`."""

  files: tuple[str, ...]
  split_by: str
  text_field: str = 'text'
  val_percent: int
  on_decode_error: str = 'replace'
  # Leave out (counted) the records that cannot be read exactly, else refuse
  # them (`UnreadableRecordsError`, with `unreadable_fix`).
  skip_unreadable: bool = False
  unreadable_fix: str = 'Fix those records.'
  hf_dataset: str = ''
  # long_text: its input files per kind.
  parts: dict[str, list[str]] | None = None
  # prepare: each input (a file, or the saved Hugging Face dataset's
  # directory) -> the copy the build reads, holding exactly the bytes it hashed
  # (records still name the input).
  read_from: dict[str, str] | None = None


class TextCorpus(tfds.core.GeneratorBasedBuilder):
  """The documents of a `TextBuilderConfig` (records: `FEATURES`), split by
  document key."""

  VERSION = tfds.core.Version('1.0.0')
  # The documents of a builder without configs (set by its subclass).
  SOURCE: ClassVar[TextBuilderConfig]
  FEATURES: tuple[str, ...] = ('text',)
  # Our own progress bars on stderr (prepare's console); TFDS's stay off.
  PROGRESS: ClassVar[bool] = False
  # Leave out (counted in `Found.empty`) documents of no text besides
  # whitespace. Off for the corpora built on first use: their builds are named
  # by their files, and one built before must stay the same documents.
  LEAVE_OUT_EMPTY: ClassVar[bool] = False

  # TFDS' default probes `importlib_resources` (not installed here); the file is
  # enough.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(inspect.getfile(TextCorpus))

  def _info(self) -> tfds.core.DatasetInfo:
    features = {f: tfds.features.Text() for f in self.FEATURES}
    return tfds.core.DatasetInfo(
        builder=self,
        description=self._source().description,
        features=tfds.features.FeaturesDict(features),
        metadata=tfds.core.MetadataDict(),
    )

  def _source(self) -> TextBuilderConfig:
    """The builder config, else the class's `SOURCE`."""
    if self.builder_config is not None:
      return self.builder_config
    return self.SOURCE

  def _records(self) -> Iterator[tuple[str, str, str | None, str]]:
    """``(key, where, text, why)`` of every record in file order (text None:
    unreadable, see `file_records`)."""
    config = self._source()
    if config.hf_dataset:  # Then `files` is empty.
      yield from hf_records(
          config.hf_dataset,
          config.text_field,
          stored_copy(config.hf_dataset, config),
      )
    for path in config.files:
      for i, (where, text, why) in enumerate(file_records(path, config)):
        yield f'{path}:{i}', where, text, why

  def _docs(self, found: Found) -> Iterator[tuple[str, str, str]]:
    """(key, kind, text) of every document in file order; what cannot be read
    exactly goes to `found` (invalid UTF-8: by `on_decode_error`)."""
    config = self._source()
    for key, where, text, why in self._records():
      if text is None:
        found.unreadable.append(f'{where}: {why}')
        continue
      if _SURROGATES.search(text):
        if config.on_decode_error == 'error':
          # Only prepare's builds get here: the corpora refuse such a file
          # before building (`text_sources.refuse_invalid_utf8`).
          found.unreadable.append(f'{where}: not valid UTF-8')
          continue
        found.decode_errors.append(where)
        if config.on_decode_error == 'skip':
          continue
        text = _replaced(text)
      if self.LEAVE_OUT_EMPTY and not text.strip():
        # An empty file (or line, paragraph, record) is no document.
        found.empty.append(where)
        continue
      yield key, '', text

  def _held_out(self, docs: list[tuple[str, str, int]]) -> set[str]:
    """Keys of the validation documents among (key, kind, tokens) `docs`."""
    percent = self._source().val_percent
    scores = {key: hash_percent(key) for key, _, _ in docs}
    val = {key for key, score in scores.items() if score < percent}
    # Tiny corpus: still one validation doc.
    if percent > 0 and not val and len(scores) >= 2:
      val = {min(scores, key=scores.__getitem__)}
    return val

  def _split_generators(self, dl_manager) -> dict[str, Iterator[Any]]:
    del dl_manager
    found = Found()
    docs = []
    # Closed (its line finished) before an error's message is printed.
    with tqdm.tqdm(
        desc='Reading documents', unit=' documents', disable=not self.PROGRESS
    ) as bar:
      for key, kind, text in self._docs(found):
        docs.append((key, kind, len(text.encode('utf-8')) + 1))
        bar.update()
    source = self._source()
    # Before anything is written.
    if found.unreadable and not source.skip_unreadable:
      raise UnreadableRecordsError(found.unreadable, source.unreadable_fix)
    val = self._held_out(docs)
    self._check_split(docs, val, found)
    self.info.metadata['decode_errors'] = {
        'mode': source.on_decode_error,
        'documents': len(found.decode_errors),
        'files': sorted({w.rsplit(':', 1)[0] for w in found.decode_errors})[
            :20
        ],
        'records': found.decode_errors[:20],
    }
    self.info.metadata['unreadable'] = {
        'records': len(found.unreadable),
        'first': found.unreadable[:20],
    }
    self.info.metadata['empty'] = {
        'documents': len(found.empty),
        'first': found.empty[:20],
    }
    generators = {}
    if len(docs) > len(val):
      generators['train'] = self._writing(
          'train', len(docs) - len(val), val, validation=False
      )
    if val:
      generators['validation'] = self._writing(
          'validation', len(val), val, validation=True
      )
    return generators

  def _check_split(
      self, docs: list[tuple[str, str, int]], val: set[str], found: Found
  ) -> None:
    """Refuses (ValueError) a split before anything is written; every split is
    accepted here (prepare refuses an empty train split)."""
    del docs, val, found

  def _writing(
      self, split: str, documents: int, val: set[str], validation: bool
  ) -> Iterator[tuple[str, dict[str, str]]]:
    """`_generate_examples` under our own progress bar of `split`'s
    `documents` (TFDS writes them as it reads them)."""
    with tqdm.tqdm(
        desc=f'Writing {split}',
        total=documents,
        unit=' documents',
        disable=not self.PROGRESS,
    ) as bar:
      for example in self._generate_examples(val, validation):
        yield example
        bar.update()

  def _generate_examples(
      self, val: set[str], validation: bool
  ) -> Iterator[tuple[str, dict[str, str]]]:
    for key, kind, text in self._docs(Found()):
      if (key in val) != validation:
        continue
      record = {'text': text}
      if 'kind' in self.FEATURES:
        record['kind'] = kind
      yield key, record


def build(builder) -> None:
  """Writes `builder`'s dataset as array_record, TFDS's prints and progress
  bars off (its bars, one per split and per shuffle, overwrite each other
  into one long line; `TextCorpus.PROGRESS` shows our own)."""
  tfds.display_progress_bar(False)
  with contextlib.redirect_stdout(io.StringIO()):
    builder.download_and_prepare(file_format='array_record')


def _with_config(builder_cls, config: TextBuilderConfig):
  """``builder_cls`` with ``config`` as its one own config (same name and
  paths): TFDS logs a config that is not the class's own as a warning holding
  all of it, every file path included (~30,000 characters for long_text)."""
  return type(
      builder_cls.__name__,
      (builder_cls,),
      {
          'name': builder_cls.name,
          'BUILDER_CONFIGS': [config],
          '__module__': builder_cls.__module__,
      },
      skip_registration=True,
  )


def build_once(builder_cls, config: TextBuilderConfig, ddir: str):
  """The dataset, built once (a file lock keeps concurrent processes from
  racing)."""
  builder_cls = _with_config(builder_cls, config)
  builder = builder_cls(config=config, data_dir=ddir)
  if not builder.is_prepared():
    lock_path = os.path.join(ddir, f'.{builder.name}_{config.name}.lock')
    with open(lock_path, 'w') as f:
      fcntl.flock(f, fcntl.LOCK_EX)  # Released when the file closes.
      # Another process may have built it.
      builder = builder_cls(config=config, data_dir=ddir)
      if not builder.is_prepared():
        logging.info(
            'Building the %s corpus (%s) into %s ...',
            builder.name,
            config.description,
            ddir,
        )
        build(builder)
  # Set by every build (_split_generators).
  warn_decode_errors(builder.name, builder.info.metadata['decode_errors'])
  return builder


def warn_decode_errors(name: str, found: dict[str, Any]) -> None:
  """Logs once what a build did with documents of invalid UTF-8 (its
  ``decode_errors`` metadata)."""
  if not found['documents']:
    return
  if found['mode'] == 'replace':
    done = 'replaced the invalid bytes by U+FFFD'
  else:
    done = 'dropped them'
  where = found.get('records') or found['files']
  log_once(
      logging.WARNING,
      '%s: %d document(s) are not valid UTF-8 (%s); on_decode_error=%s %s.'
      ' Use on_decode_error=error to refuse such files.',
      name,
      found['documents'],
      ', '.join(where[:5]),
      found['mode'],
      done,
  )


@functools.cache  # Once per message and process.
def log_once(level: int, msg: str, *args) -> None:
  logging.log(level, msg, *args)


def _optional_import(module: str, path: str):
  """`module`, else a ValueError naming `path` and the package to install."""
  package = module.split('.')[0]
  try:
    return importlib.import_module(module)
  except ImportError:
    raise ValueError(
        f'{path}: reading it needs the {package} library (pip install'
        f' {package}).'
    ) from None


def _check_column(path: str, column: str, columns: list[str]) -> None:
  if column not in columns:
    raise ValueError(
        f'{path} has no column {column!r} (data.text_feature / --text_field); '
        f'its columns are {columns}.'
    )


def _not_text(path: str, column: str, kind: Any) -> ValueError:
  return ValueError(
      f'{path}: column {column!r} holds {kind}, not text; nothing of it can be'
      ' read exactly. Give the text column with --text_field (or convert the'
      ' column to strings).'
  )


def _cell(value: Any) -> tuple[str | None, str]:
  """(text, '') of a text column's cell, or (None, why) for a missing one."""
  if value is None:
    return None, 'missing (null)'
  return value, ''


def parquet_records(
    path: str, column: str, stored: str | None = None
) -> list[Record]:
  """``(where, text, why)`` of the ``column`` of a Parquet file (needs pyarrow;
  read from `stored`, a copy of it, if given): a column that is not text is
  refused; a null cell is unreadable."""
  pq = _optional_import('pyarrow.parquet', path)
  pa = _optional_import('pyarrow', path)
  stored = stored or path
  try:
    schema = pq.read_schema(stored)
    _check_column(path, column, schema.names)
    kind = schema.field(column).type
    if not (pa.types.is_string(kind) or pa.types.is_large_string(kind)):
      raise _not_text(path, column, f'{kind} values')
    table = pq.read_table(stored, columns=[column])
    cells = table.column(column).to_pylist()
  except (pa.ArrowException, OSError) as e:
    raise ValueError(
        f'{path} is not a readable Parquet file ({type(e).__name__}: {e}).'
        ' Nothing was built. Replace or remove the file.'
    ) from None
  records: list[Record] = []
  for row, value in enumerate(cells):
    text, why = _cell(value)
    records.append((f'{path}:row {row}', text, why))
  return records


def hf_records(
    path: str, column: str, stored: str | None = None
) -> Iterator[tuple[str, str, str | None, str]]:
  """(``SPLIT:ROW``, where, text, why) of every row of a dataset saved with
  ``save_to_disk`` (loaded from `stored`, a copy of its directory, if given): a
  column that is not text is refused; a missing cell (None) is unreadable."""
  datasets = _optional_import('datasets', path)
  loaded = datasets.load_from_disk(stored or path)
  if isinstance(loaded, datasets.DatasetDict):
    parts = dict(loaded)
  else:
    parts = {'all': loaded}
  for split, part in parts.items():
    where = f'{path} ({split})'
    _check_column(where, column, part.column_names)
    feature = part.features[column]
    if getattr(feature, 'dtype', None) not in ('string', 'large_string'):
      raise _not_text(where, column, f'{feature!r}')
    for i, value in enumerate(part[column]):
      text, why = _cell(value)
      yield f'{split}:{i}', f'{where} row {i}', text, why


# Directories of the standard library that are not its modules.
_NOT_STDLIB = (
    'site-packages',
    'dist-packages',
    '__pycache__',
    'test',
    'tests',
    'idle_test',
)


def stdlib_files() -> list[str]:
  """Sorted .py files of this Python's standard library (no site-packages, no
  tests)."""
  files = []
  for dirpath, dirnames, filenames in os.walk(sysconfig.get_paths()['stdlib']):
    # In place: os.walk then descends only into these, in sorted order.
    dirnames[:] = sorted(d for d in dirnames if d not in _NOT_STDLIB)
    for name in sorted(filenames):
      if name.endswith('.py'):
        files.append(os.path.join(dirpath, name))
  return files
