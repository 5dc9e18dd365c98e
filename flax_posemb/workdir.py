"""What lives in a training workdir, apart from checkpoints: the lock, the run's config,
and the outputs that a resume truncates.

* ``.lock`` — held (``fcntl.flock``) by the one training process that writes the workdir;
  it records the holder's host and pid for the message a second process gets. The kernel
  releases the lock when its holder dies, even by ``kill -9``, so a lock is never stale. The
  file stays (removing it would let a waiter lock a file that is no longer the lock).
* ``config.json`` — the resolved config of the run. A resume compares the new config with
  it and with the config stored in the checkpoint it resumes from (``check_resume_config``)
  and refuses changes of meaning unless ``allow_config_change``.
* ``metrics.jsonl``, ``stats/window_STEP.npz``, ``tables/table_STEP.npy`` — outputs indexed
  by step; ``truncate_outputs`` drops those after the restored step. Every file is written
  under a hidden temporary name and renamed (``outputs.atomic_write``), so a kill or a full disk never
  leaves a partial file under a result's name; leftovers of any kind are removed, never read.
"""

from __future__ import annotations

import errno
import fcntl
import glob
import json
import os
import socket
from typing import Any, Callable

from flax import traverse_util

from flax_posemb import defaults
from flax_posemb import outputs
from flax_posemb.outputs import atomic_write

LOCK_FILE = '.lock'
CONFIG_FILE = 'config.json'
METRICS_FILE = 'metrics.jsonl'


class WorkdirError(ValueError):
  """The workdir cannot be used as asked (locked, config changed, outputs without checkpoints)."""


class Lock:
  """Exclusive lock on a workdir for one training process (see the module docstring)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd = None

  def __enter__(self) -> 'Lock':
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno == errno.ENOLCK:
        raise WorkdirError(f'{self.path}: this filesystem does not support file locks; put '
                           'the workdir on a local or lock-capable filesystem.') from None
      if e.errno not in (errno.EAGAIN, errno.EACCES):
        raise
      raise WorkdirError(
          f'{os.path.dirname(self.path)} is in use by another training process '
          f'({self._holder()}). Wait for it to finish or stop it; two processes must not '
          'write one workdir.') from None
    if not _is_at(fd, self.path):  # `remove_unused` deleted the file between our open and flock: no lock.
      os.close(fd)
      return self.__enter__()
    os.ftruncate(fd, 0)
    os.write(fd, json.dumps({'host': socket.gethostname(), 'pid': os.getpid()}).encode())
    os.fsync(fd)
    self._fd = fd
    return self

  def _holder(self) -> str:
    try:
      with open(self.path) as f:
        h = json.load(f)
      return f"host {h['host']}, pid {h['pid']}"
    except (OSError, ValueError, KeyError):
      return 'holder unknown'

  def __exit__(self, *exc) -> None:
    if self._fd is not None:
      os.close(self._fd)  # Releases the lock.
      self._fd = None


def _is_at(fd: int, path: str) -> bool:
  """Whether the open file ``fd`` is still the file at ``path``."""
  try:
    return os.fstat(fd).st_ino == os.stat(path).st_ino
  except FileNotFoundError:
    return False


def remove_unused(workdir: str) -> bool:
  """Removes ``workdir`` if it holds nothing but its lock file and no process holds the lock
  (a run stopped during setup, before it wrote anything); returns whether it did.

  Decided under the lock: a directory that another run is using, or has written anything
  into, is never removed, whoever created it.
  """
  if not os.path.isdir(workdir):
    return False
  try:
    with Lock(workdir) as lock:
      if set(os.listdir(workdir)) - {LOCK_FILE}:
        return False
      os.remove(lock.path)  # A waiter that opened it notices (see `Lock.__enter__`).
      os.rmdir(workdir)
      return True
  except (WorkdirError, OSError):
    return False


def _flat(d: dict[str, Any]) -> dict[str, Any]:
  return traverse_util.flatten_dict(d, sep='.')


def flat_config(config: Any) -> dict[str, Any]:
  """``{'a.b': value}`` of a ConfigDict or a config dict (JSON values)."""
  return _flat(config if isinstance(config, dict) else json.loads(config.to_json_best_effort()))


def _may_change(key: str) -> bool:
  return any(key == f or key.startswith(f + '.') for f in defaults.RESUME_MAY_CHANGE)


def saved_config(workdir: str) -> dict[str, Any] | None:
  """The run's ``config.json``, or None if absent."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError as e:
    raise WorkdirError(f'{path} is not valid JSON ({e}). Nothing was changed. The config is '
                       'also stored in every checkpoint: move it aside and re-run, which '
                       'checks against the checkpoint and rewrites it.') from None


def config_changes(saved: dict[str, Any], config: Any) -> dict[str, list[Any]]:
  """Fields whose value changes the run's meaning, ``{'a.b': [saved, new]}`` (dotted keys)."""
  old, new = _flat(saved), flat_config(config)
  base = flat_config(defaults.base())

  def changed(k):
    if k not in old:  # A field added since the run started: it ran with the default.
      return new.get(k) != defaults.BEFORE_FIELD.get(k, base.get(k))
    return k in new and old[k] != new[k]  # A field removed since is no change.
  return {k: [old.get(k), new.get(k)] for k in sorted(set(old) | set(new))
          if changed(k) and not _may_change(k)}


def check_resume_config(workdir: str, config: Any,
                        stored: dict[str, Any]) -> dict[str, list[Any]]:
  """The one drift check of a resume: raises ``WorkdirError`` listing meaningful changes of
  ``config`` from ``stored`` (the config saved in the checkpoint resumed from) and from the
  run's ``config.json`` when present (so a run whose two disagree is refused too), unless
  ``config.allow_config_change``; returns the changes (empty if none)."""
  saved = saved_config(workdir)
  changes = {**({} if saved is None else config_changes(saved, config)),
             **config_changes(stored, config)}
  if changes and not config.get('allow_config_change', False):
    listed = '; '.join(f'{k}: {a!r} -> {b!r}' for k, a, b in
                       ((k, *v) for k, v in list(changes.items())[:8]))
    raise WorkdirError(
        f'{workdir} holds a run with another config ({listed}; compared with its checkpoint '
        f'and {CONFIG_FILE}). Nothing was changed. Resume '
        'with the original values, use a fresh --workdir, or pass '
        '--config.allow_config_change=True to continue with the new values (recorded in '
        'metrics.jsonl).')
  return changes


def write_config(workdir: str, config: Any) -> None:
  """Writes ``config.json`` (atomically)."""
  with atomic_write(os.path.join(workdir, CONFIG_FILE), 'w') as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))


def step_outputs(workdir: str) -> list[tuple[int, str]]:
  """``(step, path)`` of every finished step-indexed output file (windows and tables)."""
  return sorted(outputs.window_files(workdir) + outputs.table_files(workdir))


def check_fresh_start(workdir: str) -> None:
  """Refuses to start over on a workdir that has trained outputs but no checkpoints (a
  missing ``checkpoints/`` would otherwise wipe them)."""
  trained = [p for s, p in step_outputs(workdir) if s > 0]
  if trained or _metric_rows(workdir):
    raise WorkdirError(
        f'{workdir} has outputs of a trained run ({METRICS_FILE}, {len(trained)} window/table '
        'files) but no checkpoint to resume from. Nothing was changed. Restore its '
        "checkpoints/ directory, use a fresh --workdir, or delete the old outputs.")


def _metric_rows(workdir: str) -> list[str]:
  path = os.path.join(workdir, METRICS_FILE)
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [line for line in f if line.strip()]


def truncate_outputs(workdir: str, step: int) -> None:
  """Drops metrics rows and output files after ``step``, half-written lines and leftover
  temporaries of any name (a killed run's). A damaged output file up to ``step`` (which
  the resume cannot write again) is a ValueError naming it, raised before anything changes."""
  for s, path in step_outputs(workdir):
    if s <= step:
      (outputs.load_npz if path.endswith('.npz') else outputs.load_npy)(path)
  rows = _metric_rows(workdir)
  if rows:
    keep = []
    for line in rows:
      try:
        if json.loads(line)['step'] <= step:
          keep.append(line)
      except (ValueError, KeyError, TypeError):
        continue  # A half-written last line of a killed run.
    with atomic_write(os.path.join(workdir, METRICS_FILE), 'w') as f:
      f.writelines(keep)
  finished = step_outputs(workdir)
  for s, path in finished:
    if s > step:
      os.remove(path)
  keep = {path for _, path in finished}
  for pattern in (outputs.WINDOW_FILES, outputs.TABLE_FILES):
    sub, name = os.path.split(pattern)
    prefix = name.split('*')[0]
    for path in glob.glob(os.path.join(workdir, sub, f'{prefix}*')) + glob.glob(
        os.path.join(workdir, sub, f'.{prefix}*')):
      if path not in keep:
        os.remove(path)  # Leftovers of a killed write: window_5.npz.tmp.npz, .table_5.npy.tmp


def append_row(workdir: str, row: dict[str, Any], default: Callable[[Any], Any] = float):
  """Appends one JSON row to ``metrics.jsonl``, whole or not at all (``outputs.append_whole``:
  a failed write, e.g. a full disk, leaves no half-written line to lose on resume)."""
  outputs.append_whole(os.path.join(workdir, METRICS_FILE),
                       (json.dumps(row, default=default) + '\n').encode())


def has_row(workdir: str, step: int, key: str) -> bool:
  """Whether ``metrics.jsonl`` holds a row of ``step`` with ``key``: ``'loss'`` for the
  training row, ``'eval'`` for the periodic evaluation."""
  for line in _metric_rows(workdir):
    try:
      row = json.loads(line)
    except ValueError:
      continue
    if row.get('step') == step and key in row:
      return True
  return False
