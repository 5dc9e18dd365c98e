"""TFDS builders of text read from files, without TensorFlow: the builder
config, the corpus builder (records `FEATURES`, validation by key hash), one
build per dataset under a file lock, the file readers, and the standard
library's files cut at top-level definitions. Used by `text_sources` (the
local_text and stdlib corpora, prepared datasets) and `long_text`."""

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
  h = hashlib.sha1(extra.encode())
  for p in paths:
    h.update(p.encode())
    h.update(epath.Path(p).read_bytes())
  return h.hexdigest()[:12]


def _file_docs(path: str, cfg) -> list[str]:
  """The documents of one .txt/.jsonl/.py/.parquet file (text: lossless
  surrogateescape)."""
  if path.endswith('.parquet'):
    return parquet_texts(path, cfg.text_field)
  content = epath.Path(path).read_bytes().decode('utf-8', 'surrogateescape')
  if path.endswith('.jsonl'):
    recs = [json.loads(line) for line in content.split('\n') if line.strip()]
    return [
        str(r.get(cfg.text_field, '')) if isinstance(r, dict) else str(r)
        for r in recs
    ]
  if cfg.split_by == 'python':
    return split_python_source(content)
  if cfg.split_by == 'line':
    return content.split('\n')
  return (
      [content] if cfg.split_by == 'file' else re.split(r'\n[ \t]*\n', content)
  )


def split_python_source(text: str) -> list[str]:
  """Non-blank documents of a module cut at top-level def/class (decorators
  attached)."""
  docs, cur, prev_decorator = [], [], False
  for line in text.splitlines(keepends=True):
    if (
        re.match('def |class |async def |@', line)
        and not prev_decorator
        and cur
    ):
      docs.append(''.join(cur))
      cur = []
    cur.append(line)
    if line.strip():
      prev_decorator = line.startswith('@')
  docs.append(''.join(cur))
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


class TextCorpus(tfds.core.GeneratorBasedBuilder, skip_registration=True):
  """The documents of a `TextBuilderConfig` (records: `FEATURES`), split by
  document key."""

  VERSION = tfds.core.Version('1.0.0')
  # The documents of a builder without configs.
  SOURCE: TextBuilderConfig | None = None
  FEATURES = ('text',)

  # TFDS' default probes `importlib_resources` (not installed here); the file is
  # enough.
  @tfds.core.utils.classproperty
  @classmethod
  def code_path(cls) -> epath.Path:
    return epath.Path(inspect.getfile(TextCorpus))

  def _info(self) -> tfds.core.DatasetInfo:
    return tfds.core.DatasetInfo(
        builder=self,
        description=self._source().description,
        features=tfds.features.FeaturesDict(
            {f: tfds.features.Text() for f in self.FEATURES}
        ),
        metadata=tfds.core.MetadataDict(),
    )

  def _source(self) -> TextBuilderConfig:
    return self.builder_config or self.SOURCE

  def _docs(self, bad: list[str]):
    """(key, kind, text) of every document in file order; files of invalid UTF-8
    go to `bad`."""
    cfg = self._source()
    if cfg.hf_dataset:  # Then `files` is empty.
      yield from hf_documents(cfg.hf_dataset, cfg.text_field)
    for path in cfg.files:
      for i, doc in enumerate(_file_docs(path, cfg)):
        # Invalid UTF-8 ('error' refused it pre-build).
        if re.search('[\udc80-\udcff]', doc):
          bad.append(path)
          if cfg.on_decode_error == 'skip':
            continue
          doc = doc.encode('utf-8', 'surrogateescape').decode(
              'utf-8', errors='replace'
          )
        yield f'{path}:{i}', '', doc

  def _held_out(self, docs: list[tuple[str, str, int]]) -> set[str]:
    """Keys of the validation documents among (key, kind, tokens) `docs`."""
    pct = self._source().val_percent
    scores = {key: hash_percent(key) for key, _, _ in docs}
    val = {k for k, v in scores.items() if v < pct}
    # Tiny corpus: still one validation doc.
    if pct > 0 and not val and len(scores) >= 2:
      val = {min(scores, key=scores.get)}
    return val

  def _split_generators(self, dl_manager):
    del dl_manager
    bad: list[str] = []
    docs = [
        (key, kind, len(text.encode('utf-8')) + 1)
        for key, kind, text in self._docs(bad)
    ]
    val = self._held_out(docs)
    self.info.metadata['decode_errors'] = {
        'mode': self._source().on_decode_error,
        'documents': len(bad),
        'files': sorted(set(bad))[:20],
    }
    return {
        split: self._generate_examples(val, split == 'validation')
        for split, n in (
            ('train', len(docs) - len(val)),
            ('validation', len(val)),
        )
        if n
    }

  def _generate_examples(self, val: set[str], validation: bool):
    for key, kind, text in self._docs([]):
      if (key in val) == validation:
        yield key, dict(zip(self.FEATURES, (text, kind)))


def build(builder) -> None:
  """Writes `builder`'s dataset as array_record (TFDS prints silenced)."""
  tfds.disable_progress_bar()
  with contextlib.redirect_stdout(io.StringIO()):
    builder.download_and_prepare(file_format='array_record')


def build_once(builder_cls, config: TextBuilderConfig, ddir: str):
  """The dataset, built once (a file lock keeps concurrent processes from
  racing)."""
  builder = builder_cls(config=config, data_dir=ddir)
  if not builder.is_prepared():
    with open(
        os.path.join(ddir, f'.{builder.name}_{config.name}.lock'), 'w'
    ) as f:
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
    log_once(
        logging.WARNING,
        '%s: %d document(s) are not valid UTF-8 (files: %s);'
        ' data.on_decode_error=%s %s. Use data.on_decode_error=error to refuse'
        ' such files.',
        builder.name,
        found['documents'],
        ', '.join(found['files'][:5]),
        found['mode'],
        'replaced the invalid bytes by U+FFFD'
        if found['mode'] == 'replace'
        else 'dropped them',
    )
  return builder


@functools.cache  # Once per message and process.
def log_once(level: int, msg: str, *args) -> None:
  logging.log(level, msg, *args)


def _optional_import(module: str, path: str):
  try:
    return importlib.import_module(module)
  except ImportError:
    raise ValueError(
        f'{path}: reading it needs the {module.split(".")[0]} library (pip '
        f'install {module.split(".")[0]}).'
    ) from None


def _check_column(path: str, column: str, columns: list[str]) -> None:
  if column not in columns:
    raise ValueError(
        f'{path} has no column {column!r} (data.text_feature / --text_field); '
        f'its columns are {columns}.'
    )


def parquet_texts(path: str, column: str) -> list[str]:
  """The ``column`` of a Parquet file as a list of documents (needs pyarrow)."""
  pq = _optional_import('pyarrow.parquet', path)
  _check_column(path, column, pq.read_schema(path).names)
  return [
      '' if t is None else str(t)
      for t in pq.read_table(path, columns=[column]).column(column).to_pylist()
  ]


def hf_documents(path: str, column: str):
  """(``SPLIT:ROW``, '', text) of every row of a dataset saved with
  ``save_to_disk``."""
  datasets = _optional_import('datasets', path)
  ds = datasets.load_from_disk(path)
  for split, part in (
      ds.items() if isinstance(ds, datasets.DatasetDict) else [('all', ds)]
  ):
    _check_column(f'{path} ({split})', column, part.column_names)
    for i, text in enumerate(part[column]):
      yield f'{split}:{i}', '', '' if text is None else str(text)


def stdlib_files() -> list[str]:
  """Sorted .py files of this Python's standard library (no site-packages, no
  tests)."""
  out = []
  for dirpath, dirnames, filenames in os.walk(sysconfig.get_paths()['stdlib']):
    dirnames[:] = sorted(
        d
        for d in dirnames
        if d
        not in (
            'site-packages',
            'dist-packages',
            '__pycache__',
            'test',
            'tests',
            'idle_test',
        )
    )
    out += [
        os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith('.py')
    ]
  return out
