"""Prepares your own text as a TFDS array_record dataset, without TensorFlow
(docs/data.md): ``DIR/NAME/1.0.0/`` with splits train/validation,
one feature, ``text``, and ``prepared_from.json`` (its inputs and their
SHA-256). Built aside and swapped in only when complete; a record that cannot
be read exactly is refused unless --skip_unreadable (the library call:
`flax_posemb.data.text_sources.prepare_dataset`).

  python -m flax_posemb.commands.prepare --name my_books \
      --input 'books/*.txt' --data_dir DIR
  python -m flax_posemb.commands.prepare --name my_books \
      --hf_dataset PATH --data_dir DIR

Exit codes (flax_posemb.cli): 0 done, 2 bad input (one message; --debug shows
the traceback), 75 SIGTERM (nothing was written; re-run the same command)."""

import re
import signal
import sys

if __name__ == '__main__':
  # Held, not lost, while TFDS loads: the one handler takes it in `main`.
  signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})

from absl import flags

from flax_posemb import cli
from flax_posemb import defaults
from flax_posemb import preemption
from flax_posemb.data import text_sources

PROG = 'python -m flax_posemb.commands.prepare'
cli.name_main_module(PROG, __name__)

_NAME = flags.DEFINE_string(
    'name', None, 'Dataset name (then --config.data.name=NAME).'
)
_INPUT = flags.DEFINE_multi_string(
    'input', None, 'Glob of .txt/.jsonl/.parquet files (repeatable).'
)
_HF_DATASET = flags.DEFINE_string(
    'hf_dataset', None, 'A Hugging Face dataset saved with save_to_disk.'
)
_DATA_DIR = flags.DEFINE_string(
    'data_dir', None, 'TFDS data directory (then --config.data.data_dir=DIR).'
)
_SPLIT_BY = flags.DEFINE_enum(
    'split_by', 'file', ['file', 'line', 'paragraph'], '.txt document unit.'
)
_TEXT_FIELD = flags.DEFINE_string(
    'text_field',
    'text',
    'Text field of .jsonl lines / column of .parquet '
    'and Hugging Face datasets.',
)
_VAL_PERCENT = flags.DEFINE_integer(
    'val_percent',
    5,
    'Percent of documents in validation.',
    lower_bound=0,
    upper_bound=100,
)
_ON_DECODE_ERROR = flags.DEFINE_enum(
    'on_decode_error',
    'error',
    ['error', 'replace', 'skip'],
    'Invalid UTF-8 in .txt/.jsonl files: refuse it (by --skip_unreadable:'
    ' leave it out), replace it by U+FFFD, or skip the document (both'
    ' counted).',
)
_SKIP_UNREADABLE = flags.DEFINE_bool(
    'skip_unreadable',
    False,
    'Leave out (counted, listed in prepared_from.json) the records that cannot'
    ' be read exactly: no text field, a value that is not text, a line that is'
    ' not JSON, invalid UTF-8; without it they are refused.',
)
_OVERWRITE = flags.DEFINE_bool(
    'overwrite',
    False,
    'Replace an existing DATA_DIR/NAME (once the new dataset is built).',
)
cli.define_debug_flag()


def _valid_name(name: str | None) -> bool:
  """A dataset name TFDS accepts (None: --name is missing, reported as such)."""
  return name is None or re.fullmatch('[a-z][a-z0-9_]*', name) is not None


flags.register_validator(
    'name',
    _valid_name,
    '--name: use lower-case letters, digits and underscores, starting with a'
    ' letter (it becomes data.name).',
)
flags.mark_flags_as_mutual_exclusive(['input', 'hf_dataset'], required=True)
flags.mark_flags_as_required(['name', 'data_dir'])


def main(argv):
  del argv  # cli.run refuses positional arguments.
  replaced = preemption.install_handler()
  try:
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    _prepare()
  except preemption.Preempted:
    # A second SIGTERM cannot cut the message short.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    cli.fail(
        PROG,
        f'SIGTERM: stopped before {_NAME.value} was complete; nothing was'
        f' written to {_DATA_DIR.value} (a dataset there stays as it was).'
        ' Re-run the same command.',
        cli.EXIT_PREEMPTED,
    )
  finally:
    signal.signal(signal.SIGTERM, replaced)


def _prepare() -> None:
  """Prepares the dataset of the flags and prints its summary."""
  name = _NAME.value
  data_dir = _DATA_DIR.value
  # Required flags: absl refused their absence before `main`.
  assert name is not None and data_dir is not None
  cli.check_output_dir(data_dir, '--data_dir')
  out = text_sources.prepare_dataset(
      name,
      data_dir,
      inputs=tuple(_INPUT.value or ()),
      hf_dataset=_HF_DATASET.value or '',
      split_by=_SPLIT_BY.value,
      text_field=_TEXT_FIELD.value,
      val_percent=_VAL_PERCENT.value,
      on_decode_error=_ON_DECODE_ERROR.value,
      skip_unreadable=_SKIP_UNREADABLE.value,
      overwrite=_OVERWRITE.value,
      progress=True,
  )
  splits = ', '.join(
      f'{k} {v} documents' for k, v in sorted(out['splits'].items())
  )
  print(f"prepared {out['path']}: {splits}; text feature {out['feature']!r}.")
  skipped = out['unreadable']
  if skipped['records']:
    print(
        f"left out {skipped['records']} record(s) that cannot be read exactly"
        f" (--skip_unreadable): {'; '.join(skipped['first'][:5])}."
    )
  empty = out['empty']
  if empty['documents']:
    print(
        f"left out {empty['documents']} empty document(s) (no text besides"
        f" whitespace; an empty file is one): {', '.join(empty['first'][:5])}."
    )
  decoded = out['decode_errors']
  if decoded['documents']:
    print(
        f"{decoded['documents']} document(s) of invalid UTF-8"
        f" (--on_decode_error={decoded['mode']}):"
        f" {', '.join(decoded['records'][:5])}."
    )
  print(
      'Train on it with --config.data.source=tfds'
      f' --config.data.name={_NAME.value}'
      f' --config.data.data_dir={_DATA_DIR.value}'
  )
  warning = few_validation_documents(out['splits'].get('validation', 0))
  if warning:
    print(f'{PROG}: warning: {warning}', file=sys.stderr)


def few_validation_documents(documents: int) -> str:
  """A warning when the validation split has fewer documents than an
  evaluation reads windows by default ('' if not)."""
  wanted = defaults.evaluation().num_windows
  if documents >= wanted:
    return ''
  return (
      f'the validation split has {documents} documents, fewer than the'
      f' {wanted} windows an evaluation reads by default (eval.num_windows;'
      ' first windows take one a document), so a default evaluation (eval.py,'
      " training's periodic one) will refuse it. Raise --val_percent (now"
      f' {_VAL_PERCENT.value}) or add text, or evaluate fewer windows:'
      ' eval.py --num_windows N, train.py --config.eval.num_windows=N.'
  )


if __name__ == '__main__':
  cli.run(main, PROG)
