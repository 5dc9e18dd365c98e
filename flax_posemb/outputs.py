"""Writing output files atomically, and reading a run's step-numbered outputs (numpy only).

Every output file of the project is written through `atomic_write`: a hidden temporary name
beside it, renamed into place only when complete. ``stats/window_STEP.npz`` and
``tables/table_STEP.npy`` are read by `step_files` / `load_npz`: readers list only names that are
exactly ``PREFIX_<int>.EXT``, so leftovers of a killed writer (``.window_5.npz.tmp``, or the
``window_5.npz.tmp.npz`` of older versions) are never taken for results, and read ``.npz``
files through `load_npz`, which names a damaged file.

Policy: a damaged window file is an error, not skipped -- dropping a window would silently
change cumulative counts and the late/early window means.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import io
import os
import re
import shutil
import zipfile
from collections.abc import Sequence
from typing import Any, Iterator

import numpy as np


@contextlib.contextmanager
def atomic_write(path: str, mode: str = 'wb') -> Iterator[Any]:
  """Yields an in-memory file (``mode`` 'wb' or 'w'); when the block ends without an exception
  its content goes to a hidden temporary beside ``path`` (``.NAME.tmp``) in one unbuffered
  write, then is renamed to ``path``. A failed write (a full disk) leaves no file and raises
  once: nothing is left buffered to fail again on close (numpy's zip writer and a buffered
  file would each add a chained traceback)."""
  buf = io.BytesIO() if 'b' in mode else io.StringIO()
  yield buf
  data = buf.getvalue()
  directory, name = os.path.split(os.fspath(path))
  os.makedirs(directory or '.', exist_ok=True)
  tmp = os.path.join(directory, f'.{name}.tmp')
  try:
    with open(tmp, 'wb', buffering=0) as f:
      view = memoryview(data.encode() if isinstance(data, str) else data)
      while view:
        view = view[f.write(view):]
      os.fsync(f.fileno())
    os.replace(tmp, path)
  finally:
    if os.path.exists(tmp):
      os.remove(tmp)


@contextlib.contextmanager
def replace_files(directory: str, names: Sequence[str]) -> Iterator[str]:
  """Yields a hidden staging directory inside ``directory`` to write new versions of
  ``names`` into; only when the block succeeds are the previous ``names`` replaced by them
  (``names[0]``, whose presence means "complete", leaves first and arrives last). A writer
  that fails or is killed before then leaves the previous files untouched; one killed during
  the swap is undone by the next call. Other files in ``directory`` are never touched."""
  stage, old = os.path.join(directory, '.staging'), os.path.join(directory, '.replaced')
  if os.path.isdir(old) and not os.path.exists(os.path.join(directory, names[0])):
    for n in names:  # Killed mid-swap: back to the previous complete set.
      if not os.path.exists(os.path.join(old, n)) and os.path.exists(os.path.join(directory, n)):
        os.remove(os.path.join(directory, n))
    _move(old, directory, names)
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


def _move(src: str, dst: str, names: Sequence[str]) -> None:
  for n in names:
    if os.path.exists(os.path.join(src, n)):
      os.replace(os.path.join(src, n), os.path.join(dst, n))


def append_whole(path: str, data: bytes) -> None:
  """Appends ``data`` to ``path`` whole or not at all: a write that fails or comes up short (a
  full disk) is cut off again and raises, so no partial record is left to read."""
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


# A run's step-numbered outputs, relative to its workdir (one "*" for the step).
WINDOW_FILES = os.path.join('stats', 'window_*.npz')
TABLE_FILES = os.path.join('tables', 'table_*.npy')


def window_files(workdir: str) -> list[tuple[int, str]]:
  """``(step, path)`` of a run's statistics window files, in step order."""
  return step_files(os.path.join(workdir, WINDOW_FILES))


def table_files(workdir: str) -> list[tuple[int, str]]:
  """``(step, path)`` of a run's position-table snapshots, in step order."""
  return step_files(os.path.join(workdir, TABLE_FILES))


def step_files(pattern: str) -> list[tuple[int, str]]:
  """Sorted ``(step, path)`` of the files matching ``DIR/PREFIX_*.EXT`` whose name is
  exactly ``PREFIX_<int>.EXT``; any other name is skipped."""
  name = os.path.basename(pattern)
  if name.count('*') != 1:
    raise ValueError(f'pattern must hold one "*" for the step: {pattern!r}')
  prefix, ext = name.split('*')
  exact = re.compile(re.escape(prefix) + r'(\d+)' + re.escape(ext))
  out = []
  for path in glob.glob(pattern):
    m = exact.fullmatch(os.path.basename(path))
    if m:
      out.append((int(m.group(1)), path))
  return sorted(out)


def load_npy(path: str) -> np.ndarray:
  """One ``.npy`` array (a table snapshot); a truncated file is a ValueError naming it."""
  try:
    return np.load(path, allow_pickle=False)
  except (OSError, ValueError, EOFError) as e:
    if isinstance(e, FileNotFoundError):
      raise
    raise ValueError(f'{path} is damaged ({type(e).__name__}: {e}); it is not a complete '
                     '.npy file. Move it aside (the analysis then uses the remaining '
                     'snapshots) or resume training from a checkpoint before its step.') from e


def load_npz(path: str) -> dict[str, np.ndarray]:
  """All arrays of one ``.npz`` file.

  Raises:
    ValueError: the file is truncated or garbled (the message names it and what to do).
  """
  try:
    with np.load(path, allow_pickle=False) as z:
      return {k: np.asarray(z[k]) for k in z.files}
  except (OSError, ValueError, EOFError, zipfile.BadZipFile, KeyError) as e:
    if isinstance(e, FileNotFoundError):
      raise
    raise ValueError(
        f'{path} is damaged ({type(e).__name__}: {e}); it is not a complete .npz file. '
        'Move it aside and resume training from a checkpoint before its step (resuming '
        'drops and rewrites later window files), or leave this run out.') from e
