"""Real text through TFDS array_record, without TensorFlow: the ``local_text``
and ``stdlib`` corpora (built on first use), prepared TFDS datasets
(docs/DESIGN.md "Data policies and tokens")."""

import contextlib
import dataclasses
import fcntl
import functools
import glob as glob_lib
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

from flax_posemb.data import sources
from flax_posemb.data import tokenizers

# Corpora of the stdlib.
PY_VERSION = f'py{sys.version_info.major}{sys.version_info.minor}'
# In the builder config hash: bump when the stored documents change.
_BUILD_FORMAT = 'utf8v1'


def data_dir(data_config) -> str:
  """`data.data_dir`, else $FLAX_POSEMB_DATA_DIR, else ~/.cache/flax_posemb."""
  d = (
      data_config.data_dir
      or os.environ.get('FLAX_POSEMB_DATA_DIR')
      or os.path.join(os.path.expanduser('~'), '.cache', 'flax_posemb')
  )
  os.makedirs(d, exist_ok=True)
  return d


def _hash_percent(key: str) -> float:
  """Deterministic score in [0, 100) of a document key (its split is by this
  score)."""
  return int(hashlib.sha1(key.encode()).hexdigest()[:8], 16) / 2**32 * 100


def _hash_files(paths: list[str], extra: str) -> str:
  h = hashlib.sha1(extra.encode())
  for p in paths:
    h.update(p.encode())
    h.update(epath.Path(p).read_bytes())
  return h.hexdigest()[:12]


def refuse_invalid_utf8(paths: list[str]) -> None:
  """data.on_decode_error=error: refuses the first file of invalid UTF-8 before
  a build."""
  for p in paths:
    raw = epath.Path(p).read_bytes()
    try:
      raw.decode('utf-8')
    except UnicodeDecodeError as e:
      line = raw[: e.start].count(b'\n') + 1
      raise ValueError(
          f'{p} is not valid UTF-8 ({e.reason}, byte 0x{raw[e.start]:02x} at'
          f' offset {e.start}, line {line}); data.on_decode_error=error refuses'
          ' it. Fix or remove the file, or set data.on_decode_error=replace'
          ' (U+FFFD, counted) or skip (drop the document).'
      ) from None


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


class _TextCorpus(tfds.core.GeneratorBasedBuilder):
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
    return epath.Path(inspect.getfile(_TextCorpus))

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
    scores = {key: _hash_percent(key) for key, _, _ in docs}
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


class LocalText(_TextCorpus):
  """The user's .txt/.jsonl files (`data.local_glob`)."""


class Stdlib(_TextCorpus):
  """The Python standard library's .py files, split at top-level definitions."""


def build(builder) -> None:
  """Writes `builder`'s dataset as array_record (TFDS prints silenced)."""
  tfds.disable_progress_bar()
  with contextlib.redirect_stdout(io.StringIO()):
    builder.download_and_prepare(file_format='array_record')


def _prepare(builder_cls, config: TextBuilderConfig, ddir: str):
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
    _log_once(
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
def _log_once(level: int, msg: str, *args) -> None:
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


def glob_files(globs, suffixes: tuple[str, ...], what: str) -> list[str]:
  """The sorted files that `globs` match, all ending in one of `suffixes`."""
  files = sorted(
      {
          f
          for g in globs
          for f in glob_lib.glob(os.path.expanduser(g), recursive=True)
          if os.path.isfile(f)
      }
  )
  bad = [f for f in files if not f.endswith(suffixes)]
  if not files or bad:
    raise ValueError(
        f'{what} matches '
        + (
            f'files that are not {"/".join(suffixes)}: {bad[:3]}.'
            if bad
            else 'no files.'
        )
    )
  return files


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


def data_source(builder, split: str, name: str):
  """`builder`'s random-access records of `split`; a split it lacks is
  refused."""
  splits = builder.info.splits
  if split not in splits:
    raise ValueError(
        f'{name}: split {split!r} has no documents (no split {split!r}; its'
        f' splits are {sorted(splits)},'
        f' {sum(s.num_examples for s in splits.values())} documents in all).'
        ' Set data.train_split / data.eval_split, or data.val_percent for a'
        ' small corpus.'
    )
  return builder.as_data_source(split=split)


def _records(data_config, split: str):
  """(records, text feature, build decode errors or None) of `split`."""
  c = data_config
  ddir = data_dir(c)
  if c.source == 'tfds':
    return (*tfds_records(c.name, split, ddir, c.text_feature), None)
  if c.source == 'long_text':
    from flax_posemb.data import long_text

    return (
        data_source(long_text.builder(c, ddir), split, 'long_text'),
        'text',
        None,
    )
  val_percent, mode = int(c.val_percent), sources.decode_mode(c)
  if c.source == 'stdlib':
    files = stdlib_files()
    h = _hash_files(files, f'{PY_VERSION}|{val_percent}|{_BUILD_FORMAT}|{mode}')
    builder = _prepare(
        Stdlib,
        TextBuilderConfig(
            name=f'{PY_VERSION}_{h}',
            files=tuple(files),
            split_by='python',
            val_percent=val_percent,
            on_decode_error=mode,
            description=(
                f'Python {sys.version.split()[0]} stdlib, {len(files)} files'
            ),
        ),
        ddir,
    )
  else:  # local_text
    files = glob_files(
        [c.local_glob], ('.txt', '.jsonl'), f'data.local_glob={c.local_glob!r}'
    )
    h = _hash_files(
        files,
        f'{c.local_split_by}|{c.text_feature}|{val_percent}|'
        f'{_BUILD_FORMAT}|{mode}',
    )
    if mode == 'error':
      refuse_invalid_utf8(files)
    builder = _prepare(
        LocalText,
        TextBuilderConfig(
            name=f'h{h}',
            files=tuple(files),
            split_by=c.local_split_by,
            text_field=c.text_feature,
            val_percent=val_percent,
            description=f'{len(files)} files from {c.local_glob}',
            on_decode_error=mode,
        ),
        ddir,
    )
  return (
      data_source(builder, split, c.source),
      'text',
      builder.info.metadata['decode_errors'],
  )


def string_features(features) -> list[str]:
  """Names of the top-level text/string features of a TFDS `FeaturesDict`."""
  return [
      k
      for k, f in features.items()
      # TFDS gives string features the object dtype, dtype('O').
      if str(getattr(f, 'np_dtype', None)) == 'object'
  ]


def pick_text_feature(features, wanted: str, name: str) -> str:
  """`wanted`, else the only string feature, else the only one named '*text*'
  (pg19)."""
  if features is None or wanted in features:
    return wanted
  texts = string_features(features)
  for cands in (texts, [k for k in texts if 'text' in k.lower()]):
    if len(cands) == 1:
      return cands[0]
  raise ValueError(
      f'TFDS dataset {name!r} has no feature {wanted!r} (data.text_feature);'
      f' its string features are {texts} (all features: {sorted(features)}).'
      ' Set --config.data.text_feature to one of them.'
  )


def find_builder_dir(name: str, ddir: str) -> str | None:
  """The highest prepared version ``ddir/NAME[/CONFIG]/VERSION`` of
  ``NAME[/CONFIG][:VERSION]`` (an only config needs no name); None if there is
  none, or several configs."""
  base, _, version = name.partition(':')
  root = os.path.join(ddir, *base.split('/'))
  infos = glob_lib.glob(os.path.join(root, version or '*', 'dataset_info.json'))
  if not infos and '/' not in base:
    infos = glob_lib.glob(
        os.path.join(root, '*', version or '*', 'dataset_info.json')
    )
    if len({os.path.dirname(os.path.dirname(x)) for x in infos}) > 1:
      return None  # Several configs: the name must say which.
  dirs = [
      d
      for d in map(os.path.dirname, infos)
      if re.fullmatch(r'\d+(\.\d+)*', os.path.basename(d))
  ]
  return max(
      dirs,
      key=lambda d: [int(x) for x in os.path.basename(d).split('.')],
      default=None,
  )


def tfds_records(name: str, split: str, ddir: str, text_feature: str = 'text'):
  """(records, text feature) of `find_builder_dir`'s dataset, else the TFDS
  registry's `name`."""
  path, base = find_builder_dir(name, ddir), name.split(':')[0]
  if path is None:
    try:
      records = tfds.data_source(
          name, split=split, data_dir=ddir, download=False
      )
    except Exception:  # Unknown, or registered but not prepared.
      # Without TensorFlow TFDS cannot tell which: the message gives both fixes.
      found = [
          x
          for d in ('*', '*/*')
          for x in glob_lib.glob(
              os.path.join(ddir, d, '[0-9]*', 'dataset_info.json')
          )
      ]
      listed = sorted(
          {
              os.path.relpath(os.path.dirname(os.path.dirname(x)), ddir)
              for x in found
          }
      )
      listed = (
          ', '.join(listed[:20]) + (' ...' if len(listed) > 20 else '')
          if listed
          else 'none'
      )
      raise ValueError(
          f'No prepared dataset {name!r} (data.name) under {ddir}. A TFDS'
          ' catalog dataset: build '
          'it once (only this needs TensorFlow: pip install'
          ' "flax_posemb[prepare]"), tfds build '
          f'{base} --file_format=array_record --data_dir={ddir}, or copy a'
          f' build into {ddir}. '
          f'Your own text: python -m flax_posemb.data.prepare --name {base}'
          " --input 'FILES' "
          f'--data_dir {ddir}. Else check the spelling (catalog names are'
          ' lowercase, e.g. pg19, '
          'wiki40b/en; several prepared configs need NAME/CONFIG). Prepared'
          ' datasets in '
          f'{ddir}: {listed}.'
      ) from None
  else:
    builder = tfds.builder_from_directory(path)
    fmt = builder.info.file_format
    if fmt and fmt.value != 'array_record':
      raise ValueError(
          f'TFDS dataset {name!r} in {path} is stored as {fmt.value}, which has'
          ' no random access without TensorFlow; rebuild it with tfds build'
          f' {base} --file_format=array_record --data_dir={ddir}.'
      )
    records = data_source(builder, split, f'TFDS dataset {name!r}')
  feature = pick_text_feature(records.dataset_info.features, text_feature, name)
  _log_once(
      logging.INFO,
      'TFDS dataset %s: text feature %r%s.',
      name,
      feature,
      ''
      if feature == text_feature
      else (
          f' (picked: the dataset has no {text_feature!r}; '
          'set data.text_feature to choose another)'
      ),
  )
  return records, feature


def make_tokenizer(data_config) -> tokenizers.Tokenizer:
  """The configured tokenizer (SentencePiece: trained on the train split once,
  cached)."""
  c = data_config
  if c.tokenizer == 'byte':
    return tokenizers.ByteTokenizer()
  if c.spm_model:
    return tokenizers.SentencePieceTokenizer(model_file=c.spm_model)
  records, feature, _ = _records(c, c.train_split)
  key = hashlib.sha1(
      f'{c.source}|{c.name}|{c.local_glob}|{c.local_split_by}|'
      f'{len(records)}|{c.spm_vocab_size}'.encode()
  ).hexdigest()[:12]
  path = os.path.join(data_dir(c), 'spm', f'{c.source}_{key}.model')
  if os.path.exists(path):
    return tokenizers.SentencePieceTokenizer(model_file=path)
  src = sources.TextSource(
      records,
      tokenizers.ByteTokenizer(),
      feature,
      on_decode_error=sources.decode_mode(c),
  )
  texts = (src.text(i) for i in range(min(len(src), 50_000)))
  return tokenizers.SentencePieceTokenizer.train(
      texts, int(c.spm_vocab_size), save_path=path
  )


def make_text_source(data_config, split: str) -> sources.TextSource:
  """`TextSource` of `split` for source local_text | stdlib | long_text |
  tfds."""
  c = data_config
  records, feature, found = _records(c, split)
  src = sources.TextSource(
      records,
      make_tokenizer(c),
      feature,
      on_decode_error=sources.decode_mode(c),
      kind=c.name if c.source == 'tfds' else c.source,
  )
  src.build_decode_errors = found
  return src
