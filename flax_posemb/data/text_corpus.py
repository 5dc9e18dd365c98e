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


def _file_docs(path: str, config: 'TextBuilderConfig') -> list[str]:
  """The documents of one .txt/.jsonl/.py/.parquet file (text: lossless
  surrogateescape)."""
  if path.endswith('.parquet'):
    return parquet_texts(path, config.text_field)
  content = epath.Path(path).read_bytes().decode('utf-8', 'surrogateescape')
  if path.endswith('.jsonl'):
    docs = []
    for line in content.split('\n'):
      if not line.strip():
        continue
      record = json.loads(line)
      if isinstance(record, dict):
        docs.append(str(record.get(config.text_field, '')))
      else:
        docs.append(str(record))
    return docs
  if config.split_by == 'python':
    return split_python_source(content)
  if config.split_by == 'line':
    return content.split('\n')
  if config.split_by == 'file':
    return [content]
  return re.split(r'\n[ \t]*\n', content)  # 'paragraph'


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
  hf_dataset: str = ''
  # long_text: its input files per kind.
  parts: dict[str, list[str]] | None = None


class TextCorpus(tfds.core.GeneratorBasedBuilder):
  """The documents of a `TextBuilderConfig` (records: `FEATURES`), split by
  document key."""

  VERSION = tfds.core.Version('1.0.0')
  # The documents of a builder without configs (set by its subclass).
  SOURCE: ClassVar[TextBuilderConfig]
  FEATURES: tuple[str, ...] = ('text',)

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

  def _docs(self, bad: list[str]) -> Iterator[tuple[str, str, str]]:
    """(key, kind, text) of every document in file order; files of invalid UTF-8
    go to `bad`."""
    config = self._source()
    if config.hf_dataset:  # Then `files` is empty.
      yield from hf_documents(config.hf_dataset, config.text_field)
    for path in config.files:
      for i, doc in enumerate(_file_docs(path, config)):
        # Invalid UTF-8 ('error' refused it before the build).
        if re.search('[\udc80-\udcff]', doc):
          bad.append(path)
          if config.on_decode_error == 'skip':
            continue
          raw = doc.encode('utf-8', 'surrogateescape')
          doc = raw.decode('utf-8', errors='replace')
        yield f'{path}:{i}', '', doc

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
    bad: list[str] = []
    docs = []
    # TFDS's own bar (on only when `build` is asked for progress): this first
    # pass over every document runs before TFDS's "Generating splits".
    reading = tfds.core.utils.tqdm(
        self._docs(bad), desc='Reading documents', unit=' documents'
    )
    for key, kind, text in reading:
      docs.append((key, kind, len(text.encode('utf-8')) + 1))
    val = self._held_out(docs)
    self.info.metadata['decode_errors'] = {
        'mode': self._source().on_decode_error,
        'documents': len(bad),
        'files': sorted(set(bad))[:20],
    }
    generators = {}
    if len(docs) > len(val):
      generators['train'] = self._generate_examples(val, validation=False)
    if val:
      generators['validation'] = self._generate_examples(val, validation=True)
    return generators

  def _generate_examples(
      self, val: set[str], validation: bool
  ) -> Iterator[tuple[str, dict[str, str]]]:
    for key, kind, text in self._docs([]):
      if (key in val) != validation:
        continue
      record = {'text': text}
      if 'kind' in self.FEATURES:
        record['kind'] = kind
      yield key, record


def build(builder, progress: bool = False) -> None:
  """Writes `builder`'s dataset as array_record (TFDS prints silenced; its
  progress bars on stderr if ``progress``)."""
  tfds.display_progress_bar(progress)
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
  found = builder.info.metadata['decode_errors']
  if found['documents']:
    if found['mode'] == 'replace':
      done = 'replaced the invalid bytes by U+FFFD'
    else:
      done = 'dropped them'
    log_once(
        logging.WARNING,
        '%s: %d document(s) are not valid UTF-8 (files: %s);'
        ' data.on_decode_error=%s %s. Use data.on_decode_error=error to refuse'
        ' such files.',
        builder.name,
        found['documents'],
        ', '.join(found['files'][:5]),
        found['mode'],
        done,
    )
  return builder


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


def _as_text(value) -> str:
  """A table cell as a document ('' for a missing one)."""
  if value is None:
    return ''
  return str(value)


def parquet_texts(path: str, column: str) -> list[str]:
  """The ``column`` of a Parquet file as a list of documents (needs pyarrow)."""
  pq = _optional_import('pyarrow.parquet', path)
  _check_column(path, column, pq.read_schema(path).names)
  table = pq.read_table(path, columns=[column])
  return [_as_text(value) for value in table.column(column).to_pylist()]


def hf_documents(path: str, column: str) -> Iterator[tuple[str, str, str]]:
  """(``SPLIT:ROW``, '', text) of every row of a dataset saved with
  ``save_to_disk``."""
  datasets = _optional_import('datasets', path)
  loaded = datasets.load_from_disk(path)
  if isinstance(loaded, datasets.DatasetDict):
    parts = dict(loaded)
  else:
    parts = {'all': loaded}
  for split, part in parts.items():
    _check_column(f'{path} ({split})', column, part.column_names)
    for i, value in enumerate(part[column]):
      yield f'{split}:{i}', '', _as_text(value)


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
