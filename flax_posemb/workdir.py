"""A training workdir apart from its checkpoints: the lock, the config, the
outputs a resume truncates (docs/DESIGN.md, "Training outputs (workdir)")."""

import contextlib
import errno
import fcntl
import json
import os
import socket
from typing import Any, Self

from flax import traverse_util

from flax_posemb import defaults
from flax_posemb import outputs

LOCK_FILE, CONFIG_FILE, METRICS_FILE = '.lock', 'config.json', 'metrics.jsonl'


class WorkdirError(ValueError):
  """The workdir cannot be used as asked (locked, config changed, outputs
  without checkpoints)."""


class Lock:
  """``flock`` on ``WORKDIR/.lock`` for the one training process
  (docs/DESIGN.md)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, LOCK_FILE)
    self._fd = None

  def __enter__(self) -> Self:
    os.makedirs(os.path.dirname(self.path), exist_ok=True)
    fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
      fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
      os.close(fd)
      if e.errno not in (errno.EAGAIN, errno.EACCES, errno.ENOLCK):
        raise
      holder = 'holder unknown'
      with (
          contextlib.suppress(OSError, ValueError, KeyError),
          open(self.path) as f,
      ):
        holder = 'host {host}, pid {pid}'.format(**json.load(f))
      raise WorkdirError(
          f'{self.path}: this filesystem does not support file locks; put the'
          ' workdir on a local or lock-capable filesystem.'
          if e.errno == errno.ENOLCK
          else (
              f'{os.path.dirname(self.path)} is in use by another training'
              f' process ({holder}). Wait for it to finish or stop it; two'
              ' processes must not write one workdir.'
          )
      ) from None
    try:
      here = os.fstat(fd).st_ino == os.stat(self.path).st_ino
    except FileNotFoundError:
      here = False
    if not here:  # `remove_unused` deleted it between our open and flock.
      os.close(fd)
      return self.__enter__()
    os.ftruncate(fd, 0)
    os.write(
        fd,
        json.dumps({'host': socket.gethostname(), 'pid': os.getpid()}).encode(),
    )
    os.fsync(fd)
    self._fd = fd
    return self

  def __exit__(self, *exc) -> None:
    if self._fd is not None:
      # Releases the lock; the file stays (a waiter may hold it open).
      os.close(self._fd)
      self._fd = None


def remove_unused(workdir: str) -> bool:
  """Removes ``workdir`` if, under its lock, it holds nothing but the lock file
  (a run stopped during setup); a directory another run uses or wrote into is
  never removed."""
  if not os.path.isdir(workdir):
    return False
  try:
    with Lock(workdir) as lock:
      if set(os.listdir(workdir)) - {LOCK_FILE}:
        return False
      # A waiter that opened it notices (`Lock.__enter__`).
      os.remove(lock.path)
      os.rmdir(workdir)
      return True
  except (WorkdirError, OSError):
    return False


def flat_config(config: Any) -> dict[str, Any]:
  """``{'a.b': value}`` of a ConfigDict or a config dict (JSON values)."""
  config = (
      config
      if isinstance(config, dict)
      else json.loads(config.to_json_best_effort())
  )
  return traverse_util.flatten_dict(config, sep='.')


def saved_config(workdir: str) -> dict[str, Any] | None:
  """The run's ``config.json``, or None if absent."""
  path = os.path.join(workdir, CONFIG_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError as e:
    raise WorkdirError(
        f'{path} is not valid JSON ({e}). Nothing was changed. Every checkpoint'
        ' stores the config: move it aside and re-run, which rewrites it.'
    ) from None


def config_changes(saved: dict[str, Any], config: Any) -> dict[str, list[Any]]:
  """Fields whose value changes the run's meaning, ``{'a.b': [saved, new]}``: a
  field added since the run started ran with its default, a field removed since
  is no change."""
  old, new, base = (
      flat_config(saved),
      flat_config(config),
      flat_config(defaults.base()),
  )

  def changed(k):
    if any(k == f or k.startswith(f + '.') for f in defaults.RESUME_MAY_CHANGE):
      return False
    if k not in old:
      return new.get(k) != defaults.BEFORE_FIELD.get(k, base.get(k))
    return k in new and old[k] != new[k]

  return {
      k: [old.get(k), new.get(k)]
      for k in sorted(set(old) | set(new))
      if changed(k)
  }


def check_resume_config(
    workdir: str, config: Any, stored: dict[str, Any]
) -> dict[str, list[Any]]:
  """The changes of ``config`` from ``stored`` (the checkpoint's) and
  config.json (DESIGN.md §Resume: the one drift check; ``WorkdirError`` unless
  ``allow_config_change``)."""
  saved = saved_config(workdir)
  changes = {
      **({} if saved is None else config_changes(saved, config)),
      **config_changes(stored, config),
  }
  if changes and not config.get('allow_config_change', False):
    listed = '; '.join(
        f'{k}: {a!r} -> {b!r}' for k, (a, b) in list(changes.items())[:8]
    )
    raise WorkdirError(
        f'{workdir} holds a run with another config ({listed}). Nothing was'
        ' changed. Resume with the original values, use a fresh --workdir, or'
        ' pass --config.allow_config_change=True to continue with the new'
        ' values (in metrics.jsonl).'
    )
  return changes


def write_config(workdir: str, config: Any) -> None:
  with outputs.atomic_write(os.path.join(workdir, CONFIG_FILE), 'w') as f:
    f.write(config.to_json_best_effort(indent=2, sort_keys=True))


def check_fresh_start(workdir: str) -> None:
  """Refuses to start over on a workdir with trained outputs but no
  checkpoints."""
  trained = [
      p
      for s, p in outputs.window_files(workdir) + outputs.table_files(workdir)
      if s > 0
  ]
  if trained or metric_rows(workdir):
    raise WorkdirError(
        f'{workdir} has outputs of a trained run ({METRICS_FILE},'
        f' {len(trained)} window/table files) but no checkpoint to resume from.'
        ' Nothing was changed. Restore its checkpoints/ directory, use a fresh'
        ' --workdir, or delete the old outputs.'
    )


def metric_rows(workdir: str) -> list[tuple[str, dict[str, Any]]]:
  """``(line, row)`` of ``metrics.jsonl``, the one reader (a half-written line
  is skipped)."""
  path, rows = os.path.join(workdir, METRICS_FILE), []
  with (
      open(path)
      if os.path.exists(path)
      else contextlib.nullcontext([]) as lines
  ):
    for line in lines:
      with contextlib.suppress(ValueError):
        row = json.loads(line)
        rows += [(line, row)] if isinstance(row, dict) else []
  return rows


def truncate_outputs(workdir: str, step: int) -> None:
  """Reads the outputs up to ``step``, drops those after it and leftovers
  (DESIGN.md §Resume)."""
  # in step order
  keep = dict.fromkeys(
      p
      for s, p in sorted(
          outputs.window_files(workdir) + outputs.table_files(workdir)
      )
      if s <= step
  )
  for path in keep:
    (outputs.load_npz if path.endswith('.npz') else outputs.load_npy)(path)
  if os.path.exists(os.path.join(workdir, METRICS_FILE)):
    with outputs.atomic_write(os.path.join(workdir, METRICS_FILE), 'w') as f:
      f.writelines(
          line
          for line, r in metric_rows(workdir)
          if r.get('step', step + 1) <= step
      )
  for pattern in (outputs.WINDOW_FILES, outputs.TABLE_FILES):
    sub, name = os.path.split(os.path.join(workdir, pattern))
    for n in os.listdir(sub) if os.path.isdir(sub) else []:
      if (
          n.lstrip('.').startswith(name.split('*')[0])
          and os.path.join(sub, n) not in keep
      ):
        # A later step's output, or a killed write's leftover.
        os.remove(os.path.join(sub, n))


def append_row(workdir: str, row: dict[str, Any]) -> None:
  """Appends one JSON row to ``metrics.jsonl``, whole or not at all (numpy
  scalars as floats)."""
  outputs.append_whole(
      os.path.join(workdir, METRICS_FILE),
      (json.dumps(row, default=float) + '\n').encode(),
  )


def has_row(workdir: str, step: int, key: str) -> bool:
  """Whether ``metrics.jsonl`` holds a row of ``step`` with ``key`` ('loss' or
  'eval')."""
  return any(
      r.get('step') == step and key in r for _, r in metric_rows(workdir)
  )
