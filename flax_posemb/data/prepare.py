"""Prepares local text as a TFDS array_record dataset, without TensorFlow.

  python -m flax_posemb.data.prepare --name my_books --input 'books/*.txt' --data_dir DIR
  python -m flax_posemb.data.prepare --name my_books --hf_dataset PATH --data_dir DIR
  python train.py --config configs/default.py --workdir runs/books \\
      --config.data.source=tfds --config.data.name=my_books --config.data.data_dir=DIR

Inputs: ``.txt`` files (one document per file, line or blank-line paragraph: ``--split_by``),
``.jsonl`` (one document per line, its ``--text_field``), ``.parquet`` (one document per row of
its ``--text_field`` column; needs pyarrow), or a Hugging Face ``datasets`` dataset saved with
``save_to_disk`` (``--hf_dataset``; needs the ``datasets`` library). Writes
``DIR/NAME/1.0.0/`` (TFDS's own builder and array_record writer, the same build as the
``local_text`` source) with splits ``train`` and ``validation`` (``--val_percent`` of the
documents by key hash) and one string feature, ``text``; ``data.source=tfds`` reads it with
no TensorFlow installed. The alternative for datasets in the TFDS catalogue (wiki40b, pg19):
``pip install "flax_posemb[prepare]"`` (TensorFlow, Beam) and ``tfds build NAME
--file_format=array_record --data_dir=DIR``.

Exit codes (flax_posemb.cli): 0 done, 2 bad input (one message; --debug shows the traceback).
"""

from __future__ import annotations

import contextlib
import glob as glob_lib
import io
import os
import shutil
import types
from typing import Any

from absl import flags

from flax_posemb import cli

PROG = 'python -m flax_posemb.data.prepare'
cli.name_main_module(PROG, __name__)

FEATURE = 'text'  # The one feature of a prepared dataset.
SUFFIXES = ('.txt', '.jsonl', '.parquet')


def prepare(name: str, data_dir: str, *, inputs: tuple[str, ...] = (), hf_dataset: str = '',
            split_by: str = 'file', text_field: str = 'text', val_percent: int = 5,
            on_decode_error: str = 'replace', overwrite: bool = False) -> dict[str, Any]:
  """Builds ``data_dir/name/1.0.0`` from local files or a Hugging Face dataset on disk.

  Args:
    name: dataset name (``data.name``): lower-case letters, digits and underscores.
    data_dir: TFDS data directory (``data.data_dir``).
    inputs: globs of ``.txt`` / ``.jsonl`` / ``.parquet`` files.
    hf_dataset: directory of a ``datasets`` dataset saved with ``save_to_disk`` (instead).
    split_by: ``.txt`` document unit: file | line | paragraph.
    text_field: the text's field in ``.jsonl`` lines, ``.parquet`` and Hugging Face columns.
    val_percent: percent of documents (by hash of their key) in 'validation'.
    on_decode_error: invalid UTF-8 in text files: replace | skip | error.
    overwrite: replace an existing ``data_dir/name``.

  Returns:
    ``{'path', 'feature', 'splits': {split: documents}}``.

  Raises:
    ValueError: bad name, no or unsupported inputs, an existing dataset without
      ``overwrite``, a missing text column, or a missing optional library.
  """
  from flax_posemb.data import text_sources  # pylint: disable=g-import-not-at-top  (TFDS)
  files = _files(inputs, hf_dataset)
  if not name.replace('_', '').isalnum() or name.lower() != name or name[0].isdigit():
    raise ValueError(f'--name {name!r}: use lower-case letters, digits and underscores, '
                     'starting with a letter (it becomes data.name).')
  if split_by not in ('file', 'line', 'paragraph'):
    raise ValueError(f'--split_by {split_by!r}: use file, line or paragraph.')
  root = os.path.join(data_dir, name)
  if os.path.exists(root):
    if not overwrite:
      raise ValueError(f'{root} exists; pass --overwrite to rebuild it, or another --name.')
    shutil.rmtree(root)
  source = text_sources.TextBuilderConfig(
      name='default', files=files, split_by=split_by, text_field=text_field,
      val_percent=val_percent, on_decode_error=on_decode_error, hf_dataset=hf_dataset,
      description=f'{hf_dataset or f"{len(files)} files"} (flax_posemb.data.prepare)')
  builder_cls = types.new_class(
      'Prepared', (text_sources._TextCorpus,), {'skip_registration': True},  # pylint: disable=protected-access
      lambda ns: ns.update(name=name, SOURCE=source, __module__=__name__))
  builder = builder_cls(data_dir=data_dir)
  import tensorflow_datasets as tfds  # pylint: disable=g-import-not-at-top
  tfds.disable_progress_bar()  # TFDS's "Downloading..." prints and bars, for a local build.
  with contextlib.redirect_stdout(io.StringIO()):
    builder.download_and_prepare(file_format='array_record')
  shutil.rmtree(os.path.join(data_dir, 'downloads'), ignore_errors=True)  # empty, TFDS's
  splits = {k: int(v.num_examples) for k, v in builder.info.splits.items()}
  return {'path': builder.data_dir, 'feature': FEATURE, 'splits': splits}


def _files(inputs: tuple[str, ...], hf_dataset: str) -> tuple[str, ...]:
  """The sorted files the globs match (none with --hf_dataset), checked."""
  if bool(inputs) == bool(hf_dataset):
    raise ValueError('give --input GLOB (.txt/.jsonl/.parquet files) or --hf_dataset DIR, '
                     'not both and not neither.')
  if hf_dataset:
    if not os.path.isdir(hf_dataset):
      raise ValueError(f'--hf_dataset {hf_dataset} is not a directory (a dataset saved with '
                       'datasets.Dataset.save_to_disk).')
    return ()
  files = sorted({f for g in inputs for f in glob_lib.glob(os.path.expanduser(g), recursive=True)
                  if os.path.isfile(f)})
  if not files:
    raise ValueError(f'--input {", ".join(inputs)} matches no files.')
  bad = [f for f in files if not f.endswith(SUFFIXES)]
  if bad:
    raise ValueError(f'--input matches files that are not {"/".join(SUFFIXES)}: {bad[:3]}.')
  return tuple(os.path.abspath(f) for f in files)


def define_flags() -> None:
  """The command's flags (defined only when run as a program: the module is also a library)."""
  flags.DEFINE_string('name', None, 'Dataset name (then --config.data.name=NAME).')
  flags.DEFINE_multi_string('input', [], 'Glob of .txt/.jsonl/.parquet files (repeatable).')
  flags.DEFINE_string('hf_dataset', '', 'A Hugging Face dataset saved with save_to_disk.')
  flags.DEFINE_string('data_dir', None, 'TFDS data directory (then --config.data.data_dir=DIR).')
  flags.DEFINE_enum('split_by', 'file', ['file', 'line', 'paragraph'], '.txt document unit.')
  flags.DEFINE_string('text_field', 'text', 'Text field of .jsonl lines / column of .parquet '
                      'and Hugging Face datasets.')
  flags.DEFINE_integer('val_percent', 5, 'Percent of documents in validation.', lower_bound=0,
                       upper_bound=100)
  flags.DEFINE_enum('on_decode_error', 'replace', ['replace', 'skip', 'error'],
                    'Invalid UTF-8 in text files.')
  flags.DEFINE_bool('overwrite', False, 'Replace an existing DATA_DIR/NAME.')
  cli.define_debug_flag()


FLAGS = flags.FLAGS


def main(argv):
  if len(argv) > 1:
    raise cli.UserError(f'unexpected arguments {argv[1:]}; every option is a --flag.')
  for flag in ('name', 'data_dir'):
    if not FLAGS[flag].value:
      raise cli.UserError(f'--{flag} is required.')
  cli.check_output_dir(FLAGS.data_dir, '--data_dir')
  out = prepare(FLAGS.name, FLAGS.data_dir, inputs=tuple(FLAGS.input),
                hf_dataset=FLAGS.hf_dataset, split_by=FLAGS.split_by,
                text_field=FLAGS.text_field, val_percent=FLAGS.val_percent,
                on_decode_error=FLAGS.on_decode_error, overwrite=FLAGS.overwrite)
  splits = ', '.join(f'{k} {v} documents' for k, v in sorted(out['splits'].items()))
  print(f"prepared {out['path']}: {splits}; text feature {out['feature']!r}.\n"
        f'Train on it with --config.data.source=tfds --config.data.name={FLAGS.name} '
        f'--config.data.data_dir={FLAGS.data_dir}')


if __name__ == '__main__':
  define_flags()
  cli.run(main, PROG)
