"""Your own text built as a TFDS dataset aside and swapped in (Prepared
datasets in docs/DESIGN.md § Data policies and tokens): one prepare of a name
at a time, each input read once into a copy whose bytes are both hashed and
built from, the build, its record `PREPARED_FROM`, the swap into place. The
entry point is `text_sources.prepare_dataset`."""

from collections.abc import Iterator
import contextlib
import dataclasses
import fcntl
import functools
import glob as glob_lib
import hashlib
import json
import os
import shutil
import tempfile
from typing import Any

import tensorflow_datasets as tfds
import tqdm

from flax_posemb.data import text_corpus

# What a prepared dataset was built from, in its version directory.
PREPARED_FROM = 'prepared_from.json'


def prepare(
    name: str,
    ddir: str,
    source: text_corpus.TextBuilderConfig,
    *,
    overwrite: bool = False,
    progress: bool = False,
) -> dict[str, Any]:
  """Builds ``ddir/name/1.0.0`` of `source` aside and swaps it in.

  It is built in a hidden directory of `ddir` and swapped in only when
  complete and readable. A refused or interrupted run (SIGTERM's
  `preemption.Preempted` included) changes nothing and leaves nothing: no
  build directory, no lock file, and no `ddir` if this run created it.

  Args:
    name: the dataset's name (a valid TFDS name).
    ddir: the TFDS data directory (created if missing).
    source: its inputs (`files` or `hf_dataset`) and how to read and split
      them; `read_from` is set here.
    overwrite: replace an existing ``ddir/name`` (once the new one is built).
    progress: our progress bars on stderr.

  Returns:
    ``{'path', 'feature', 'splits': {split: documents}, 'unreadable',
    'decode_errors', 'empty', 'identity'}``.

  Raises:
    ValueError: bad input, named with its fix (nothing was built).
  """
  if source.hf_dataset and not os.path.isdir(source.hf_dataset):
    raise ValueError(
        f'--hf_dataset {source.hf_dataset} does not exist or is not a'
        ' directory; give the directory a Hugging Face dataset was saved to'
        ' with save_to_disk.'
    )
  created = not os.path.isdir(ddir)
  root = os.path.join(ddir, name)
  try:
    os.makedirs(ddir, exist_ok=True)
    # Removes the build directory, however the build ends.
    with _one_prepare(ddir, name):
      _finish_a_killed_swap(ddir, name)
      if os.path.lexists(root) and not overwrite:
        raise ValueError(
            f'{root} exists; pass --overwrite to replace it (only once the new'
            ' dataset is built), or choose another --name.'
        )
      build_dir = tempfile.mkdtemp(prefix=f'.{name}.build-', dir=ddir)
      built = _build(name, build_dir, source, progress)
      _swap_in(os.path.join(build_dir, name), root)
  except BaseException:
    if created:
      # Only if still empty: rmdir removes nothing else.
      with contextlib.suppress(OSError):
        os.rmdir(ddir)
    raise
  built['path'] = os.path.join(root, built['path'])
  return built


class PreparedText(text_corpus.TextCorpus):
  """A prepared dataset's builder: empty documents are left out (counted and
  named), and its split must leave train documents."""

  LEAVE_OUT_EMPTY = True

  def _check_split(
      self,
      docs: list[tuple[str, str, int]],
      val: set[str],
      found: text_corpus.Found,
  ) -> None:
    source = self._source()
    if not docs:
      empty = ''
      if found.empty:
        empty = (
            f' ({len(found.empty)} empty left out:'
            f' {", ".join(found.empty[:5])})'
        )
      raise ValueError(
          f'{source.description} hold no document{empty}. Nothing was built.'
          ' Check --input / --hf_dataset and --text_field.'
      )
    if len(val) == len(docs):
      raise ValueError(
          f'--val_percent {source.val_percent} puts all {len(docs)} documents'
          ' in the validation split, leaving train empty. Nothing was built.'
          ' Lower --val_percent (below 100), or add documents.'
      )


def _build(
    name: str,
    build_dir: str,
    source: text_corpus.TextBuilderConfig,
    progress: bool,
) -> dict[str, Any]:
  """Copies the inputs into `build_dir`, builds `name` there from the copies
  (our progress bars if `progress`), reads it back and records
  `PREPARED_FROM`; returns `prepare`'s result, its path relative to
  ``build_dir/name``."""
  # Not a valid dataset name (those start with a letter): no clash with `name`.
  copies, inputs = _read_inputs(
      source, os.path.join(build_dir, '.inputs'), progress
  )
  source = dataclasses.replace(source, read_from=copies)
  # A builder without configs, named `name`: the dataset is NAME/1.0.0.
  builder_cls = type(
      'Prepared',
      (PreparedText,),
      {
          'name': name,
          'SOURCE': source,
          'PROGRESS': progress,
          '__module__': __name__,
      },
      skip_registration=True,
  )
  builder = builder_cls(data_dir=build_dir)
  text_corpus.build(builder)
  version_dir = str(builder.data_dir)
  splits = _read_back(builder, version_dir)
  metadata = builder.info.metadata
  record = {
      'name': name,
      'inputs': inputs,
      'options': {
          'split_by': source.split_by,
          'text_field': source.text_field,
          'val_percent': source.val_percent,
          'on_decode_error': source.on_decode_error,
          'skip_unreadable': source.skip_unreadable,
      },
      'splits': splits,
      'unreadable': metadata['unreadable'],
      'decode_errors': metadata['decode_errors'],
      'empty': metadata['empty'],
  }
  identity = {k: record[k] for k in ('inputs', 'options')}
  identity['format'] = text_corpus.BUILD_FORMAT
  # Empty documents are left out (they were stored before): the same inputs
  # may make other documents than a build made before, so another identity.
  identity['documents'] = 'nonempty'
  record['identity'] = hashlib.sha256(
      json.dumps(identity, sort_keys=True).encode()
  ).hexdigest()[:16]
  with open(os.path.join(version_dir, PREPARED_FROM), 'w') as f:
    json.dump(record, f, indent=1)
  return {
      'path': os.path.relpath(version_dir, os.path.join(build_dir, name)),
      'feature': 'text',
      'splits': splits,
      'unreadable': metadata['unreadable'],
      'decode_errors': metadata['decode_errors'],
      'empty': metadata['empty'],
      'identity': record['identity'],
  }


def _read_back(builder, version_dir: str) -> dict[str, int]:
  """{split: documents} of the build, each split read back as a dataset (a
  split that does not read back whole is a RuntimeError)."""
  splits = {}
  for split, info in tfds.builder_from_directory(
      version_dir
  ).info.splits.items():
    records = builder.as_data_source(split=split)
    if len(records) != info.num_examples:
      raise RuntimeError(
          f'{version_dir}: split {split} holds {len(records)} of its'
          f' {info.num_examples} documents after the build.'
      )
    splits[split] = int(info.num_examples)
  return splits


def _read_inputs(
    source: text_corpus.TextBuilderConfig, into: str, progress: bool
) -> tuple[dict[str, str], list[dict[str, Any]]]:
  """Reads every input file once, into a copy under `into`: ({input: its
  copy}, ``[{path, bytes, sha256}]`` of the bytes read). The build reads the
  copies, so an input rewritten meanwhile cannot make the record describe
  other text than the dataset holds. A saved Hugging Face dataset is every
  file of its directory, copied as a directory."""
  os.makedirs(into)
  copies = {}
  targets = {}
  for i, path in enumerate(source.files):
    # Numbered (inputs may share a name); the name kept: readers go by its
    # suffix.
    copy = os.path.join(into, f'{i}_{os.path.basename(path)}')
    copies[path] = targets[path] = copy
  if source.hf_dataset:
    top = os.path.abspath(source.hf_dataset)
    copies[source.hf_dataset] = os.path.join(into, 'hf_dataset')
    for directory, _, names in sorted(os.walk(top)):
      for file_name in sorted(names):
        path = os.path.join(directory, file_name)
        relative = os.path.relpath(path, top)
        targets[path] = os.path.join(into, 'hf_dataset', relative)
  inputs = []
  # Closed (its line finished) before an error's message is printed.
  with tqdm.tqdm(
      total=len(targets),
      desc='Reading inputs',
      unit=' files',
      disable=not progress,
  ) as bar:
    for path, target in targets.items():
      inputs.append(_copy_and_hash(path, target))
      bar.update()
  return copies, inputs


def _copy_and_hash(path: str, target: str) -> dict[str, Any]:
  """Copies `path` to `target` in one read: ``{path, bytes, sha256}`` of the
  bytes copied. An input that vanished or cannot be read is a ValueError."""
  os.makedirs(os.path.dirname(target), exist_ok=True)
  digest = hashlib.sha256()
  size = 0
  try:
    with open(path, 'rb') as f, open(target, 'wb') as out:
      for block in iter(functools.partial(f.read, 1 << 20), b''):
        digest.update(block)
        out.write(block)
        size += len(block)
  except (FileNotFoundError, NotADirectoryError):
    raise ValueError(
        f'{path} disappeared while prepare read it (deleted or moved during'
        ' the build). Nothing was built. Keep the input files in place and'
        ' re-run.'
    ) from None
  except PermissionError:
    raise ValueError(
        f'{path} cannot be read (permission denied). Nothing was built. Make it'
        ' readable, or leave it out of --input.'
    ) from None
  return {'path': path, 'bytes': size, 'sha256': digest.hexdigest()}


@contextlib.contextmanager
def _one_prepare(ddir: str, name: str) -> Iterator[None]:
  """Holds ``ddir/.NAME.prepare.lock`` (a second prepare of `name` is
  refused), removed when done; under it, hidden build directories are killed
  runs' leftovers, removed on entry, and this run's, removed on exit (also
  one whose `tempfile.mkdtemp` a SIGTERM cut short)."""
  path = os.path.join(ddir, f'.{name}.prepare.lock')
  while True:
    lock = open(path, 'a')
    try:
      fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      lock.close()
      raise ValueError(
          f'Another prepare of {name!r} is running in {ddir}; wait for it to'
          ' finish.'
      ) from None
    # A prepare that finished removed the file it held: then this lock is on
    # a file nobody else can find, and a fresh one is taken.
    if _is_at(lock, path):
      break
    lock.close()
  try:
    _remove_builds(ddir, name)
    yield
  finally:
    _remove_builds(ddir, name)
    with contextlib.suppress(FileNotFoundError):
      os.remove(path)
    lock.close()


def _remove_builds(ddir: str, name: str) -> None:
  """Removes the hidden build directories of `name` (only under its lock)."""
  for build_dir in glob_lib.glob(os.path.join(ddir, f'.{name}.build-*')):
    shutil.rmtree(build_dir, ignore_errors=True)


def _is_at(opened, path: str) -> bool:
  """Whether the open file `opened` is the file at `path`."""
  try:
    at_path = os.stat(path)
  except FileNotFoundError:
    return False
  mine = os.fstat(opened.fileno())
  return (mine.st_dev, mine.st_ino) == (at_path.st_dev, at_path.st_ino)


def _finish_a_killed_swap(ddir: str, name: str) -> None:
  """A run killed between `_swap_in`'s two renames: the old dataset is put
  back if the new one is not in place, else removed."""
  old = os.path.join(ddir, f'.{name}.replaced')
  if not os.path.lexists(old):
    return
  if os.path.lexists(os.path.join(ddir, name)):
    shutil.rmtree(old, ignore_errors=True)
  else:
    os.rename(old, os.path.join(ddir, name))


def _swap_in(new: str, root: str) -> None:
  """Moves the built dataset `new` to `root`, replacing what is there."""
  if not os.path.lexists(root):
    os.rename(new, root)
    return
  ddir, name = os.path.split(root)
  old = os.path.join(ddir, f'.{name}.replaced')
  os.rename(root, old)
  os.rename(new, root)
  if os.path.isdir(old) and not os.path.islink(old):
    shutil.rmtree(old)
  else:
    os.remove(old)
