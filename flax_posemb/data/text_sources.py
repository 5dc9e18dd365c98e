"""Real text through TFDS array_record, without TensorFlow: the ``local_text``
and ``stdlib`` corpora (built on first use), your own text prepared as a
dataset (`prepare_dataset`), prepared TFDS datasets (docs/DESIGN.md § Data
policies and tokens)."""

import difflib
import glob as glob_lib
import hashlib
import json
import os
import re
import sys
from typing import Any

from absl import logging
from etils import epath
import tensorflow_datasets as tfds

from flax_posemb.data import long_text
from flax_posemb.data import prepared
from flax_posemb.data import sources
from flax_posemb.data import text_corpus
from flax_posemb.data import tokenizers


def data_dir(data_config) -> str:
  """`data.data_dir`, else $FLAX_POSEMB_DATA_DIR, else ~/.cache/flax_posemb."""
  ddir = (
      data_config.data_dir
      or os.environ.get('FLAX_POSEMB_DATA_DIR')
      or os.path.join(os.path.expanduser('~'), '.cache', 'flax_posemb')
  )
  os.makedirs(ddir, exist_ok=True)
  return ddir


def refuse_invalid_utf8(paths: list[str]) -> None:
  """data.on_decode_error=error: refuses the first file of invalid UTF-8 before
  a build."""
  for path in paths:
    raw = epath.Path(path).read_bytes()
    try:
      raw.decode('utf-8')
    except UnicodeDecodeError as e:
      line = raw[: e.start].count(b'\n') + 1
      raise ValueError(
          f'{path} is not valid UTF-8 ({e.reason}, byte 0x{raw[e.start]:02x} at'
          f' offset {e.start}, line {line}); data.on_decode_error=error refuses'
          ' it. Fix or remove the file, or set data.on_decode_error=replace'
          ' (U+FFFD, counted) or skip (drop the document).'
      ) from None


class LocalText(text_corpus.TextCorpus):
  """The user's .txt/.jsonl files (`data.local_glob`)."""


class Stdlib(text_corpus.TextCorpus):
  """The Python standard library's .py files, split at top-level definitions."""


def glob_files(globs, suffixes: tuple[str, ...], what: str) -> list[str]:
  """The sorted files that `globs` match, all ending in one of `suffixes`."""
  found = set()
  for pattern in globs:
    for path in glob_lib.glob(os.path.expanduser(pattern), recursive=True):
      if os.path.isfile(path):
        found.add(path)
  files = sorted(found)
  if not files:
    raise ValueError(f'{what} matches no files.')
  bad = [f for f in files if not f.endswith(suffixes)]
  if bad:
    raise ValueError(
        f'{what} matches files that are not {"/".join(suffixes)}: {bad[:3]}.'
    )
  return files


def prepare_dataset(
    name: str,
    ddir: str,
    *,
    inputs: tuple[str, ...] = (),
    hf_dataset: str = '',
    split_by: str = 'file',
    text_field: str = 'text',
    val_percent: int = 5,
    on_decode_error: str = 'error',
    skip_unreadable: bool = False,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
  """Builds ``ddir/name/1.0.0`` from `inputs` (globs) or `hf_dataset` (the
  flags of ``python -m flax_posemb.commands.prepare``, checked by them):
  ``{'path', 'feature', 'splits': {split: documents}, 'unreadable',
  'decode_errors', 'empty', 'identity'}``; ``progress``: our progress bars on
  stderr (TFDS's stay off).

  Each input is read once, into a copy that is hashed and built from; the
  dataset is built in a hidden directory of `ddir` and swapped in only when
  complete and readable, with `prepared.PREPARED_FROM` (its inputs and their
  SHA-256): a refused or interrupted run changes nothing and leaves nothing
  (`prepared.prepare`; Prepared datasets in docs/DESIGN.md § Data policies
  and tokens)."""
  if hf_dataset:
    files: tuple[str, ...] = ()
    what = hf_dataset
  else:
    found = glob_files(
        inputs, ('.txt', '.jsonl', '.parquet'), f'--input {", ".join(inputs)}'
    )
    files = tuple(os.path.abspath(f) for f in found)
    what = f'{len(files)} files'
  source = text_corpus.TextBuilderConfig(
      name='default',
      files=files,
      split_by=split_by,
      text_field=text_field,
      val_percent=val_percent,
      on_decode_error=on_decode_error,
      skip_unreadable=skip_unreadable,
      unreadable_fix=(
          'Fix them, or pass --skip_unreadable to leave them out (they are'
          f' counted, and listed in {prepared.PREPARED_FROM}).'
      ),
      hf_dataset=hf_dataset,
      description=f'{what} (flax_posemb.commands.prepare)',
  )
  return prepared.prepare(
      name, ddir, source, overwrite=overwrite, progress=progress
  )


def data_source(builder, split: str, name: str):
  """`builder`'s random-access records of `split`; a split it lacks is
  refused."""
  splits = builder.info.splits
  if split not in splits:
    total = sum(info.num_examples for info in splits.values())
    raise ValueError(
        f'{name}: split {split!r} has no documents (no split {split!r}; its'
        f' splits are {sorted(splits)}, {total} documents in all).'
        ' Set data.train_split / data.eval_split, or data.val_percent for a'
        ' small corpus.'
    )
  return builder.as_data_source(split=split)


def _records(data_config, split: str):
  """(records, text feature, build decode errors or None) of `split`."""
  ddir = data_dir(data_config)
  source = data_config.source
  if source == 'tfds':
    records, feature = tfds_records(
        data_config.name, split, ddir, data_config.text_feature
    )
    # A dataset prepared here records what its build did with invalid UTF-8.
    decode_errors = (records.dataset_info.metadata or {}).get('decode_errors')
    if decode_errors:
      text_corpus.warn_decode_errors(data_config.name, decode_errors)
    return records, feature, decode_errors
  if source == 'long_text':
    builder = long_text.builder(data_config, ddir)
    return data_source(builder, split, 'long_text'), 'text', None
  if source == 'stdlib':
    builder = _stdlib_builder(data_config, ddir)
  else:
    builder = _local_text_builder(data_config, ddir)
  records = data_source(builder, split, source)
  return records, 'text', builder.info.metadata['decode_errors']


def _stdlib_builder(data_config, ddir: str) -> Stdlib:
  """The prepared `Stdlib` corpus of this Python (built on first use)."""
  val_percent = int(data_config.val_percent)
  mode = sources.decode_mode(data_config)
  files = text_corpus.stdlib_files()
  key = (
      f'{text_corpus.PY_VERSION}|{val_percent}|{text_corpus.BUILD_FORMAT}'
      f'|{mode}'
  )
  digest = text_corpus.hash_files(files, key)
  config = text_corpus.TextBuilderConfig(
      name=f'{text_corpus.PY_VERSION}_{digest}',
      files=tuple(files),
      split_by='python',
      val_percent=val_percent,
      on_decode_error=mode,
      description=f'Python {sys.version.split()[0]} stdlib, {len(files)} files',
  )
  return text_corpus.build_once(Stdlib, config, ddir)


def _local_text_builder(data_config, ddir: str) -> LocalText:
  """The prepared `LocalText` corpus of `data.local_glob` (built on first
  use)."""
  val_percent = int(data_config.val_percent)
  mode = sources.decode_mode(data_config)
  pattern = data_config.local_glob
  files = glob_files(
      [pattern], ('.txt', '.jsonl'), f'data.local_glob={pattern!r}'
  )
  key = (
      f'{data_config.local_split_by}|{data_config.text_feature}|{val_percent}|'
      f'{text_corpus.BUILD_FORMAT}|{mode}|{_LOCAL_RECORDS}'
  )
  if mode == 'error':
    refuse_invalid_utf8(files)
  digest = text_corpus.hash_files(files, key)
  config = text_corpus.TextBuilderConfig(
      name=f'h{digest}',
      files=tuple(files),
      split_by=data_config.local_split_by,
      text_field=data_config.text_feature,
      val_percent=val_percent,
      description=f'{len(files)} files from {pattern}',
      on_decode_error=mode,
      unreadable_fix=(
          'Fix them, or prepare the files with python -m'
          ' flax_posemb.commands.prepare --skip_unreadable (which leaves them'
          ' out, counted) and train on that dataset (data.source=tfds).'
      ),
  )
  return text_corpus.build_once(LocalText, config, ddir)


# In local_text's build key: .jsonl records without text are refused, no
# longer stored as empty documents (a build made before is not reused).
_LOCAL_RECORDS = 'exact'


def string_features(features) -> list[str]:
  """Names of the top-level text/string features of a TFDS `FeaturesDict`."""
  names = []
  for name, feature in features.items():
    # TFDS gives string features the object dtype, dtype('O').
    if str(getattr(feature, 'np_dtype', None)) == 'object':
      names.append(name)
  return names


def pick_text_feature(features, wanted: str, name: str) -> str:
  """`wanted`, else the only string feature, else the only one named '*text*'
  (pg19)."""
  if features is None or wanted in features:
    return wanted
  texts = string_features(features)
  if len(texts) == 1:
    return texts[0]
  named_text = [k for k in texts if 'text' in k.lower()]
  if len(named_text) == 1:
    return named_text[0]
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
    configs = {os.path.dirname(os.path.dirname(x)) for x in infos}
    if len(configs) > 1:
      return None  # Several configs: the name must say which.
  versions = []
  for info in infos:
    version_dir = os.path.dirname(info)
    if re.fullmatch(r'\d+(\.\d+)*', os.path.basename(version_dir)):
      versions.append(version_dir)
  return max(versions, key=_version_key, default=None)


def _version_key(version_dir: str) -> list[int]:
  """``.../1.2.0`` -> [1, 2, 0]: versions compare by number."""
  return [int(x) for x in os.path.basename(version_dir).split('.')]


def _prepared(ddir: str) -> list[str]:
  """The datasets prepared in `ddir` (``NAME`` or ``NAME/CONFIG``), sorted."""
  infos = []
  for pattern in ('*', '*/*'):
    infos += glob_lib.glob(
        os.path.join(ddir, pattern, '[0-9]*', 'dataset_info.json')
    )
  names = set()
  for info in infos:
    names.add(os.path.relpath(os.path.dirname(os.path.dirname(info)), ddir))
  return sorted(names)


def _prepared_names(ddir: str) -> str:
  """The datasets prepared in `ddir`, 20 at most, for a message."""
  names = _prepared(ddir)
  if not names:
    return 'none'
  listed = ', '.join(names[:20])
  if len(names) > 20:
    listed += ' ...'
  return listed


def _did_you_mean(name: str, ddir: str) -> str:
  """' Did you mean 'X'?' for the prepared or catalog dataset closest to
  ``name`` ('' if none is close)."""
  known = _prepared(ddir) + tfds.list_builders(with_community_datasets=False)
  close = difflib.get_close_matches(name, known, n=1)
  if not close:
    return ''
  return f' Did you mean {close[0]!r}?'


def tfds_records(name: str, split: str, ddir: str, text_feature: str = 'text'):
  """(records, text feature) of `find_builder_dir`'s dataset, else the TFDS
  registry's `name`."""
  path = find_builder_dir(name, ddir)
  base = name.split(':')[0]
  if path is None:
    try:
      records = tfds.data_source(
          name, split=split, data_dir=ddir, download=False
      )
    except Exception:  # Unknown, or registered but not prepared.
      # Without TensorFlow TFDS cannot tell which: the message gives both fixes.
      raise ValueError(
          f'No prepared dataset {name!r} (data.name) under {ddir}.'
          f'{_did_you_mean(base, ddir)}'
          ' A TFDS catalog dataset: build it once (only this needs'
          ' TensorFlow: pip install "flax_posemb[prepare]"),'
          f' tfds build {base} --file_format=array_record --data_dir={ddir},'
          f' or copy a build into {ddir}.'
          f' Your own text: python -m flax_posemb.commands.prepare'
          f" --name {base} --input 'FILES' --data_dir {ddir}."
          ' Else check the spelling (catalog names are lowercase, e.g. pg19,'
          ' wiki40b/en; several prepared configs need NAME/CONFIG).'
          f' Prepared datasets in {ddir}: {_prepared_names(ddir)}.'
      ) from None
  else:
    builder = tfds.builder_from_directory(path)
    stored = builder.info.file_format
    if stored and stored.value != 'array_record':
      raise ValueError(
          f'TFDS dataset {name!r} in {path} is stored as {stored.value}, which'
          ' has no random access without TensorFlow; rebuild it with tfds'
          f' build {base} --file_format=array_record --data_dir={ddir}.'
      )
    records = data_source(builder, split, f'TFDS dataset {name!r}')
  feature = pick_text_feature(records.dataset_info.features, text_feature, name)
  if feature == text_feature:
    picked = ''
  else:
    picked = (
        f' (picked: the dataset has no {text_feature!r}; set'
        ' data.text_feature to choose another)'
    )
  text_corpus.log_once(
      logging.INFO, 'TFDS dataset %s: text feature %r%s.', name, feature, picked
  )
  return records, feature


def dataset_identity(data_config) -> str:
  """What the configured text is, for a run to record (a resume on other text
  is refused): a prepared dataset's `prepared.PREPARED_FROM` identity, another
  TFDS build's ``dataset_info.json`` digest, a corpus built on first use by its
  build (named by a digest of its files)."""
  ddir = data_dir(data_config)
  source = data_config.source
  if source == 'tfds':
    return f'tfds {data_config.name} {_tfds_identity(data_config.name, ddir)}'
  if source == 'long_text':
    builder = long_text.builder(data_config, ddir)
  elif source == 'stdlib':
    builder = _stdlib_builder(data_config, ddir)
  else:
    builder = _local_text_builder(data_config, ddir)
  return f'{source} {builder.builder_config.name}'


def _tfds_identity(name: str, ddir: str) -> str:
  """The identity of `find_builder_dir`'s build of `name` ('' for one of the
  TFDS registry elsewhere)."""
  path = find_builder_dir(name, ddir)
  if path is None:
    return ''
  record = os.path.join(path, prepared.PREPARED_FROM)
  if os.path.exists(record):
    with open(record) as f:
      try:
        return json.load(f)['identity']
      except (ValueError, KeyError):
        raise ValueError(
            f'{record} is damaged (no readable identity). Re-run prepare'
            ' with --overwrite to rebuild the dataset and its record.'
        ) from None
  with open(os.path.join(path, 'dataset_info.json'), 'rb') as f:
    return hashlib.sha256(f.read()).hexdigest()[:16]


def make_tokenizer(data_config) -> tokenizers.Tokenizer:
  """The configured tokenizer (SentencePiece: trained on the train split once,
  cached; hf: `tokenizers.HFTokenizer`)."""
  c = data_config
  if c.tokenizer == 'byte':
    return tokenizers.ByteTokenizer()
  if c.tokenizer == 'hf':
    return tokenizers.HFTokenizer(c.hf_tokenizer)
  if c.spm_model:
    return tokenizers.SentencePieceTokenizer(model_file=c.spm_model)
  records, feature, _ = _records(c, c.train_split)
  corpus = (
      f'{c.source}|{c.name}|{c.local_glob}|{c.local_split_by}|'
      f'{len(records)}|{c.spm_vocab_size}'
  )
  key = hashlib.sha1(corpus.encode()).hexdigest()[:12]
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
  records, feature, decode_errors = _records(data_config, split)
  # A TFDS dataset's documents are of its kind.
  if data_config.source == 'tfds':
    kind = data_config.name
  else:
    kind = data_config.source
  src = sources.TextSource(
      records,
      make_tokenizer(data_config),
      feature,
      on_decode_error=sources.decode_mode(data_config),
      kind=kind,
  )
  src.build_decode_errors = decode_errors
  return src
