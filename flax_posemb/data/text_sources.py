"""Real text through TFDS array_record, without TensorFlow: the ``local_text``
and ``stdlib`` corpora (built on first use), your own text prepared as a
dataset (`prepare_dataset`), prepared TFDS datasets (docs/DESIGN.md "Data
policies and tokens")."""

import glob as glob_lib
import hashlib
import os
import re
import shutil
import sys
from typing import Any

from absl import logging
from etils import epath
import tensorflow_datasets as tfds

from flax_posemb.data import long_text
from flax_posemb.data import sources
from flax_posemb.data import text_corpus
from flax_posemb.data import tokenizers


def data_dir(data_config) -> str:
  """`data.data_dir`, else $FLAX_POSEMB_DATA_DIR, else ~/.cache/flax_posemb."""
  d = (
      data_config.data_dir
      or os.environ.get('FLAX_POSEMB_DATA_DIR')
      or os.path.join(os.path.expanduser('~'), '.cache', 'flax_posemb')
  )
  os.makedirs(d, exist_ok=True)
  return d


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


class LocalText(text_corpus.TextCorpus):
  """The user's .txt/.jsonl files (`data.local_glob`)."""


class Stdlib(text_corpus.TextCorpus):
  """The Python standard library's .py files, split at top-level definitions."""


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


def prepare_dataset(
    name: str,
    ddir: str,
    *,
    inputs: tuple[str, ...] = (),
    hf_dataset: str = '',
    split_by: str = 'file',
    text_field: str = 'text',
    val_percent: int = 5,
    on_decode_error: str = 'replace',
    overwrite: bool = False,
) -> dict[str, Any]:
  """Builds ``ddir/name/1.0.0`` from `inputs` (globs) or `hf_dataset` (the
  flags of ``python -m flax_posemb.commands.prepare``, checked by them):
  ``{'path', 'feature', 'splits': {split: documents}}``."""
  if hf_dataset:
    files: tuple[str, ...] = ()
    what = hf_dataset
  else:
    found = glob_files(
        inputs, ('.txt', '.jsonl', '.parquet'), f'--input {", ".join(inputs)}'
    )
    files = tuple(os.path.abspath(f) for f in found)
    what = f'{len(files)} files'
  root = os.path.join(ddir, name)
  if os.path.exists(root) and not overwrite:
    raise ValueError(
        f'{root} exists; pass --overwrite to rebuild it, or another --name.'
    )
  shutil.rmtree(root, ignore_errors=True)
  if on_decode_error == 'error':
    refuse_invalid_utf8([f for f in files if not f.endswith('.parquet')])
  source = text_corpus.TextBuilderConfig(
      name='default',
      files=files,
      split_by=split_by,
      text_field=text_field,
      val_percent=val_percent,
      on_decode_error=on_decode_error,
      hf_dataset=hf_dataset,
      description=f'{what} (flax_posemb.commands.prepare)',
  )
  # A builder without configs, named `name`: the dataset is ddir/name/1.0.0.
  builder_cls = type(
      'Prepared',
      (text_corpus.TextCorpus,),
      {'name': name, 'SOURCE': source, '__module__': __name__},
      skip_registration=True,
  )
  builder = builder_cls(data_dir=ddir)
  text_corpus.build(builder)
  # TFDS's download directory, empty.
  shutil.rmtree(os.path.join(ddir, 'downloads'), ignore_errors=True)
  splits = {k: int(v.num_examples) for k, v in builder.info.splits.items()}
  return {'path': builder.data_dir, 'feature': 'text', 'splits': splits}


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
    return (
        data_source(long_text.builder(c, ddir), split, 'long_text'),
        'text',
        None,
    )
  val_percent, mode = int(c.val_percent), sources.decode_mode(c)
  if c.source == 'stdlib':
    files = text_corpus.stdlib_files()
    h = text_corpus.hash_files(
        files,
        f'{text_corpus.PY_VERSION}|{val_percent}|{text_corpus.BUILD_FORMAT}|{mode}',
    )
    builder = text_corpus.build_once(
        Stdlib,
        text_corpus.TextBuilderConfig(
            name=f'{text_corpus.PY_VERSION}_{h}',
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
    h = text_corpus.hash_files(
        files,
        f'{c.local_split_by}|{c.text_feature}|{val_percent}|'
        f'{text_corpus.BUILD_FORMAT}|{mode}',
    )
    if mode == 'error':
      refuse_invalid_utf8(files)
    builder = text_corpus.build_once(
        LocalText,
        text_corpus.TextBuilderConfig(
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
          f'Your own text: python -m flax_posemb.commands.prepare --name {base}'
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
  text_corpus.log_once(
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
