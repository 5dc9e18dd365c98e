"""Prepares local text as a TFDS array_record dataset, without TensorFlow
(README "Configs and data"): ``DIR/NAME/1.0.0/`` with splits train/validation
and one feature, ``text``.

  python -m flax_posemb.data.prepare --name my_books --input 'books/*.txt'
  --data_dir DIR python -m flax_posemb.data.prepare --name my_books --hf_dataset
  PATH --data_dir DIR

Exit codes (flax_posemb.cli): 0 done, 2 bad input (one message; --debug shows
the traceback)."""

import os
import re
import shutil
from typing import Any

from absl import flags

from flax_posemb import cli

PROG = 'python -m flax_posemb.data.prepare'
cli.name_main_module(PROG, __name__)


def prepare(
    name: str,
    data_dir: str,
    *,
    inputs: tuple[str, ...] = (),
    hf_dataset: str = '',
    split_by: str = 'file',
    text_field: str = 'text',
    val_percent: int = 5,
    on_decode_error: str = 'replace',
    overwrite: bool = False,
) -> dict[str, Any]:
  """Builds ``data_dir/name/1.0.0`` from `inputs` (globs) or `hf_dataset` (the
  flags, checked by them): ``{'path', 'feature', 'splits': {split:
  documents}}``."""
  from flax_posemb.data import text_sources  # TFDS

  files = (
      ()
      if hf_dataset
      else tuple(
          os.path.abspath(f)
          for f in text_sources.glob_files(
              inputs,
              ('.txt', '.jsonl', '.parquet'),
              f'--input {", ".join(inputs)}',
          )
      )
  )
  root = os.path.join(data_dir, name)
  if os.path.exists(root) and not overwrite:
    raise ValueError(
        f'{root} exists; pass --overwrite to rebuild it, or another --name.'
    )
  shutil.rmtree(root, ignore_errors=True)
  if on_decode_error == 'error':
    text_sources.refuse_invalid_utf8(
        [f for f in files if not f.endswith('.parquet')]
    )
  source = text_sources.TextBuilderConfig(
      name='default',
      files=files,
      split_by=split_by,
      text_field=text_field,
      val_percent=val_percent,
      on_decode_error=on_decode_error,
      hf_dataset=hf_dataset,
      description=(
          f'{hf_dataset or f"{len(files)} files"} (flax_posemb.data.prepare)'
      ),
  )
  builder = type(
      'Prepared',
      (text_sources._TextCorpus,),
      {'name': name, 'SOURCE': source, '__module__': __name__},
      skip_registration=True,
  )(data_dir=data_dir)
  text_sources.build(builder)
  # Empty, TFDS's.
  shutil.rmtree(os.path.join(data_dir, 'downloads'), ignore_errors=True)
  splits = {k: int(v.num_examples) for k, v in builder.info.splits.items()}
  return {'path': builder.data_dir, 'feature': 'text', 'splits': splits}


def define_flags() -> None:
  """The command's flags (defined only when run as a program)."""
  flags.DEFINE_string(
      'name', None, 'Dataset name (then --config.data.name=NAME).'
  )
  flags.register_validator(
      'name',
      lambda n: n is None or re.fullmatch('[a-z][a-z0-9_]*', n) is not None,
      '--name: use lower-case letters, digits and underscores, starting with a'
      ' letter (it becomes data.name).',
  )
  flags.DEFINE_multi_string(
      'input', None, 'Glob of .txt/.jsonl/.parquet files (repeatable).'
  )
  flags.DEFINE_string(
      'hf_dataset', None, 'A Hugging Face dataset saved with save_to_disk.'
  )
  flags.mark_flags_as_mutual_exclusive(['input', 'hf_dataset'], required=True)
  flags.DEFINE_string(
      'data_dir', None, 'TFDS data directory (then --config.data.data_dir=DIR).'
  )
  flags.DEFINE_enum(
      'split_by', 'file', ['file', 'line', 'paragraph'], '.txt document unit.'
  )
  flags.DEFINE_string(
      'text_field',
      'text',
      'Text field of .jsonl lines / column of .parquet '
      'and Hugging Face datasets.',
  )
  flags.DEFINE_integer(
      'val_percent',
      5,
      'Percent of documents in validation.',
      lower_bound=0,
      upper_bound=100,
  )
  flags.DEFINE_enum(
      'on_decode_error',
      'replace',
      ['replace', 'skip', 'error'],
      'Invalid UTF-8 in text files.',
  )
  flags.DEFINE_bool('overwrite', False, 'Replace an existing DATA_DIR/NAME.')
  flags.mark_flags_as_required(['name', 'data_dir'])
  cli.define_debug_flag()


FLAGS = flags.FLAGS


def main(argv):
  del argv  # cli.run refuses positional arguments.
  cli.check_output_dir(FLAGS.data_dir, '--data_dir')
  out = prepare(
      FLAGS.name,
      FLAGS.data_dir,
      inputs=tuple(FLAGS.input or ()),
      hf_dataset=FLAGS.hf_dataset or '',
      split_by=FLAGS.split_by,
      text_field=FLAGS.text_field,
      val_percent=FLAGS.val_percent,
      on_decode_error=FLAGS.on_decode_error,
      overwrite=FLAGS.overwrite,
  )
  splits = ', '.join(
      f'{k} {v} documents' for k, v in sorted(out['splits'].items())
  )
  print(
      f"prepared {out['path']}: {splits}; text feature"
      f" {out['feature']!r}.\nTrain on it with --config.data.source=tfds"
      f' --config.data.name={FLAGS.name}'
      f' --config.data.data_dir={FLAGS.data_dir}'
  )


if __name__ == '__main__':
  define_flags()
  cli.run(main, PROG)
