"""Output files written whole or not at all, and a run's step-numbered outputs
read back (numpy only); the rules are in docs/DESIGN.md § Training outputs."""

from collections.abc import Iterator, Sequence
import contextlib
import errno
import fcntl
import glob
import io
import os
import re
import shutil
from typing import Any
import zipfile

import numpy as np

# The names in a training workdir, spelled here only (docs/DESIGN.md §
# Training outputs).
LOCK_FILE = '.lock'
CONFIG_FILE = 'config.json'
METRICS_FILE = 'metrics.jsonl'
STATS_DIR = 'stats'
TABLES_DIR = 'tables'
CHECKPOINTS_DIR = 'checkpoints'
TENSORBOARD_DIR = 'tensorboard'
EVAL_DIR = 'eval'
# The table analysis inside an evaluation's directory (eval.py --analyze).
ANALYSIS_DIR = 'analysis'
# An imported Hugging Face checkpoint (`pretrained`): where it came from, and a
# copy of its tokenizer files (data.hf_tokenizer names it; any run reading a
# Hugging Face tokenizer has one: `own_tokenizer`).
IMPORT_FILE = 'imported.json'
TOKENIZER_DIR = 'tokenizer'
# A copy of the SentencePiece model file the run reads (data.spm_model).
SPM_MODEL_FILE = 'tokenizer.model'
# A run started from another workdir's parameters (config init_from): which,
# and the rows its position table had.
INIT_FROM_FILE = 'init_from.json'
# Step-numbered files: a statistics window (in STATS_DIR, or any directory of
# them) and a table snapshot (in TABLES_DIR).
WINDOW_FILE = 'window_{step}.npz'
TABLE_FILE = 'table_{step}.npy'
# Their glob patterns relative to a workdir (one "*" for the step).
WINDOW_FILES = os.path.join(STATS_DIR, WINDOW_FILE.format(step='*'))
TABLE_FILES = os.path.join(TABLES_DIR, TABLE_FILE.format(step='*'))
# The temporary name under which `atomic_write` writes NAME.
TEMP_NAME = '.{name}.tmp'
# What a killed write of NAME leaves: `atomic_write`'s temporary name, and the
# one older versions wrote.
LEFTOVER_NAMES = (TEMP_NAME, '{name}.tmp.npz')


@contextlib.contextmanager
def atomic_write(path: str, mode: str = 'wb') -> Iterator[Any]:
  """Yields an in-memory file (``mode`` 'wb' or 'w') written to a hidden
  ``.NAME.tmp`` in one unbuffered write and renamed to ``path``: a failed write
  leaves no file and raises once."""
  buf = io.BytesIO() if 'b' in mode else io.StringIO()
  yield buf
  data = buf.getvalue()
  directory, name = os.path.split(os.fspath(path))
  os.makedirs(directory or '.', exist_ok=True)
  tmp = os.path.join(directory, TEMP_NAME.format(name=name))
  try:
    with open(tmp, 'wb', buffering=0) as f:
      view = memoryview(data.encode() if isinstance(data, str) else data)
      while view:
        view = view[f.write(view) :]
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


@contextlib.contextmanager
def replace_files(directory: str, names: Sequence[str]) -> Iterator[str]:
  """Yields a staging directory for new ``names``, swapped in when the block
  succeeds (names[0], "complete", leaves first and arrives last); a swap killed
  midway is undone by the next call. Writers of one directory take turns (a
  second eval of the same options waits, then replaces the first's files)."""
  stage = os.path.join(directory, '.staging')
  old = os.path.join(directory, '.replaced')
  os.makedirs(directory, exist_ok=True)
  with _one_writer(directory):
    complete = os.path.exists(os.path.join(directory, names[0]))
    if os.path.isdir(old) and not complete:
      # Killed mid-swap: back to the previous complete set.
      for n in names:
        new_only = not os.path.exists(os.path.join(old, n))
        if new_only and os.path.exists(os.path.join(directory, n)):
          os.remove(os.path.join(directory, n))
      _move(old, directory, names)
    # Under the lock, a staging directory is a killed writer's.
    for leftover in (stage, old):
      shutil.rmtree(leftover, ignore_errors=True)
    os.makedirs(stage)
    try:
      yield stage
      os.makedirs(old)
      _move(directory, old, names)
      _move(stage, directory, names[::-1])
    finally:
      shutil.rmtree(stage, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def _one_writer(directory: str) -> Iterator[None]:
  """Holds an exclusive ``flock`` on ``directory`` itself (waiting for another
  holder; the kernel releases it when a holder dies). A filesystem without
  locks is written unlocked, as before."""
  fd = os.open(directory, os.O_RDONLY)
  try:
    try:
      fcntl.flock(fd, fcntl.LOCK_EX)
    except OSError as e:
      if e.errno not in (errno.ENOLCK, errno.EOPNOTSUPP):
        raise
    yield
  finally:
    os.close(fd)


def _move(src: str, dst: str, names: Sequence[str]) -> None:
  for n in names:
    if os.path.exists(os.path.join(src, n)):
      os.replace(os.path.join(src, n), os.path.join(dst, n))


def save_npz(path: str, arrays: dict[str, Any]) -> str:
  """Writes ``arrays`` as one ``.npz`` file, whole or not at all; returns
  ``path``."""
  with atomic_write(path) as f:
    # numpy's stub lets **kwds fill savez's allow_pickle: bool.
    np.savez(f, **arrays)  # type: ignore[arg-type]
  return path


def append_whole(path: str, data: bytes) -> None:
  """Appends ``data`` whole or not at all (a failed or short write is cut off
  and raises)."""
  fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
  size = os.fstat(fd).st_size
  try:
    if os.write(fd, data) != len(data):
      raise OSError(errno.ENOSPC, f'{path}: short write (disk full?)')
  except BaseException:
    os.ftruncate(fd, size)
    raise
  finally:
    os.close(fd)


def step_files(pattern: str) -> list[tuple[int, str]]:
  """Sorted ``(step, path)`` of the files ``DIR/PREFIX_<int>.EXT`` of
  ``pattern`` (one "*")."""
  prefix, ext = os.path.basename(pattern).split('*')
  exact = re.compile(re.escape(prefix) + r'(\d+)' + re.escape(ext))
  found = []
  for path in glob.glob(pattern):
    match = exact.fullmatch(os.path.basename(path))
    if match:
      found.append((int(match.group(1)), path))
  return sorted(found)


def step_leftovers(pattern: str) -> list[str]:
  """The leftovers of killed writes of the step files of ``pattern`` (one
  "*"), by their exact names (`LEFTOVER_NAMES`): nothing else is taken for
  one."""
  directory, name_pattern = os.path.split(pattern)
  prefix, ext = name_pattern.split('*')
  step_name = re.escape(prefix) + r'\d+' + re.escape(ext)
  exact = [
      re.compile(re.escape(leftover).replace(re.escape('{name}'), step_name))
      for leftover in LEFTOVER_NAMES
  ]
  if not os.path.isdir(directory):
    return []
  return sorted(
      os.path.join(directory, name)
      for name in os.listdir(directory)
      if any(e.fullmatch(name) for e in exact)
  )


def window_files(workdir: str) -> list[tuple[int, str]]:
  """`(step, path)` of the workdir's window files, by step."""
  return step_files(os.path.join(workdir, WINDOW_FILES))


def table_files(workdir: str) -> list[tuple[int, str]]:
  """`(step, path)` of the workdir's table snapshots, by step."""
  return step_files(os.path.join(workdir, TABLE_FILES))


def window_files_in(directory: str) -> list[tuple[int, str]]:
  """The window files of any directory of them (a run's ``stats/``)."""
  return step_files(os.path.join(directory, WINDOW_FILE.format(step='*')))


def table_path(workdir: str, step: int) -> str:
  """The path of the workdir's table snapshot of `step`."""
  return os.path.join(workdir, TABLES_DIR, TABLE_FILE.format(step=step))


def _load(path: str, fix: str) -> Any:
  """The array(s) of ``path``; a damaged file is a ValueError naming it and
  ``fix``."""
  try:
    data = np.load(path, allow_pickle=False)
    if not isinstance(data, np.lib.npyio.NpzFile):
      return data
    with data:
      return {k: np.asarray(data[k]) for k in data.files}
  except FileNotFoundError:
    raise
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
    raise ValueError(
        f'{path} is damaged ({type(e).__name__}: {e}); it is not a complete '
        f'{os.path.splitext(path)[1]} file. {fix}'
    ) from e


def load_npy(path: str) -> np.ndarray:
  """One table snapshot."""
  return _load(
      path,
      'Move it aside (the analysis then uses the remaining snapshots) or resume'
      ' training from a checkpoint before its step.',
  )


def load_npz(path: str) -> dict[str, np.ndarray]:
  """All arrays of one window file."""
  return _load(
      path,
      'Move it aside and resume training from a checkpoint before its step '
      '(resuming drops and rewrites later window files), or leave this run'
      ' out.',
  )
