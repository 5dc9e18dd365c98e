"""A training workdir apart from its checkpoints: the lock, the config, the
outputs a resume truncates, the paths it records (docs/DESIGN.md § Training
outputs).

A workdir is self-contained: the tokenizer a run reads is copied into it and
recorded relative to it, and a config read from the workdir resolves it through
the workdir (`own_tokenizer`), so that a moved workdir trains and evaluates as
before.
"""

from collections.abc import Callable
import errno
import fcntl
import json
import os
import socket
from typing import Any, Self

from flax import traverse_util

from flax_posemb import config as config_lib
from flax_posemb import defaults
from flax_posemb import outputs
from flax_posemb import own_tokenizer


class WorkdirError(ValueError):
  """The workdir cannot be used as asked (locked, config changed, outputs
  without checkpoints)."""


class Lock:
  """``flock`` on ``WORKDIR/.lock`` for the one training process
  (docs/DESIGN.md § Training outputs)."""

  def __init__(self, workdir: str):
    self.path = os.path.join(workdir, outputs.LOCK_FILE)
    self._fd: int | None = None

  def __enter__(self) -> Self:
    while True:
      os.makedirs(os.path.dirname(self.path), exist_ok=True)
      fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
      try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
      except OSError as e:
        os.close(fd)
        if e.errno not in (errno.EAGAIN, errno.EACCES, errno.ENOLCK):
          raise
        raise self._refusal(e.errno) from None
      if self._still_the_lock_file(fd):
        break
      # `remove_unused` deleted the file (and the workdir) between our open
      # and flock: lock a new one.
      os.close(fd)
    os.ftruncate(fd, 0)
    holder = {'host': socket.gethostname(), 'pid': os.getpid()}
    os.write(fd, json.dumps(holder).encode())
    os.fsync(fd)
    self._fd = fd
    return self

  def _still_the_lock_file(self, fd: int) -> bool:
    try:
      return os.fstat(fd).st_ino == os.stat(self.path).st_ino
    except FileNotFoundError:
      return False

  def _refusal(self, error_number: int) -> 'WorkdirError':
    if error_number == errno.ENOLCK:
      return WorkdirError(
          f'{self.path}: this filesystem does not support file locks; put the'
          ' workdir on a local or lock-capable filesystem.'
      )
    return WorkdirError(
        f'{os.path.dirname(self.path)} is in use by another training process'
        f' ({self._holder()}). Wait for it to finish or stop it; two processes'
        ' must not write one workdir.'
    )

  def _holder(self) -> str:
    """'host H, pid P' as the holder recorded them, or 'holder unknown'."""
    try:
      with open(self.path) as f:
        return 'host {host}, pid {pid}'.format(**json.load(f))
    except (OSError, ValueError, KeyError):
      return 'holder unknown'

  def __exit__(self, *exc) -> None:
    if self._fd is not None:
      # Releases the lock; the file stays (a waiter may hold it open).
      os.close(self._fd)
      self._fd = None


def remove_unused(workdir: str) -> bool:
  """Removes ``workdir`` if, under its lock, it holds nothing but the lock file
  and empty directories (a run stopped during setup: Orbax creates
  ``checkpoints/`` first); a directory another run uses or wrote into is never
  removed."""
  if not os.path.isdir(workdir):
    return False
  try:
    with Lock(workdir) as lock:
      empty_dirs = []
      for name in os.listdir(workdir):
        path = os.path.join(workdir, name)
        if name == outputs.LOCK_FILE:
          continue
        if not os.path.isdir(path) or os.path.islink(path) or os.listdir(path):
          return False
        empty_dirs.append(path)
      for path in empty_dirs:
        os.rmdir(path)
      # A waiter that opened it notices (`Lock.__enter__`).
      os.remove(lock.path)
      os.rmdir(workdir)
      return True
  except (WorkdirError, OSError):
    return False


def flat_config(config: Any) -> dict[str, Any]:
  """``{'a.b': value}`` of a `config.RunConfig` or a config dict (JSON
  values)."""
  if not isinstance(config, dict):
    config = json.loads(config.to_json())
  return traverse_util.flatten_dict(config, sep='.')


def saved_config(workdir: str) -> dict[str, Any] | None:
  """The run's ``config.json``, or None if absent; one that is not a run's
  config is refused."""
  path = os.path.join(workdir, outputs.CONFIG_FILE)
  if not os.path.exists(path):
    return None
  fix = (
      'Nothing was changed. Every checkpoint stores the config: move it aside'
      f" (mv {path} /tmp/) and re-run, which uses the checkpoints' config"
      ' (train.py writes the file again).'
  )
  try:
    with open(path) as f:
      saved = json.load(f)
  except ValueError as e:
    raise WorkdirError(f'{path} is not valid JSON ({e}). {fix}') from None
  if not isinstance(saved, dict):
    raise WorkdirError(f'{path} is not the config of a training run. {fix}')
  for section in ('model', 'data'):
    if not isinstance(saved.get(section), dict):
      raise WorkdirError(
          f'{path} is not the config of a training run (no {section!r}'
          f' section). {fix}'
      )
  return own_tokenizer.resolve_paths(saved, workdir)


def run_config(
    workdir: str, first_config: Callable[[], dict[str, Any]]
) -> dict[str, Any]:
  """The run's own config, which every checkpoint it holds must fit:
  ``config.json``, else ``first_config()``, the config stored in its oldest
  readable checkpoint (`checkpointing.first_config`)."""
  saved = saved_config(workdir)
  if saved is not None:
    return saved
  return first_config()


def _may_change(key: str) -> bool:
  """Whether a resume may change ``key`` (`defaults.RESUME_MAY_CHANGE`, or a
  field inside one of its sections)."""
  return any(
      key == field or key.startswith(field + '.')
      for field in defaults.RESUME_MAY_CHANGE
  )


def config_changes(saved: dict[str, Any], config: Any) -> dict[str, list[Any]]:
  """Fields whose value changes the run's meaning, ``{'a.b': [saved, new]}``: a
  field added since the run started ran with its default, a field removed since
  is no change."""
  old = flat_config(saved)
  new = flat_config(config)
  base = flat_config(config_lib.RunConfig())
  changes = {}
  for key in sorted(set(old) | set(new)):
    if _may_change(key):
      continue
    if key in old:
      changed = key in new and old[key] != new[key]
    else:
      ran_with = defaults.BEFORE_FIELD.get(key, base.get(key))
      changed = new.get(key) != ran_with
    if changed:
      changes[key] = [old.get(key), new.get(key)]
  return changes


def check_resume_config(
    workdir: str,
    config: Any,
    stored: dict[str, Any],
    *,
    stored_dataset: str | None = None,
    dataset: str | None = None,
) -> dict[str, list[Any]]:
  """The changes of ``config`` from ``stored`` (the checkpoint's) and
  config.json, and of the ``dataset`` trained on (`data.dataset_identity`)
  from the checkpoint's (None: not recorded) (Resume in docs/DESIGN.md §
  Training outputs: the one drift check; ``WorkdirError`` unless
  ``allow_config_change``)."""
  changes = {}
  saved = saved_config(workdir)
  if saved is not None:
    changes.update(config_changes(saved, config))
  changes.update(
      config_changes(own_tokenizer.resolve_paths(stored, workdir), config)
  )
  if stored_dataset is not None and stored_dataset != dataset:
    changes[DATASET_CHANGE] = [stored_dataset, dataset]
  if changes and not config.allow_config_change:
    first_changes = list(changes.items())[:8]
    listed = '; '.join(f'{k}: {a!r} -> {b!r}' for k, (a, b) in first_changes)
    dataset_fix = ''
    if DATASET_CHANGE in changes:
      dataset_fix = (
          ' The text under the same data settings is not what the run trained'
          ' on: restore its files (a prepared dataset lists them in its'
          ' prepared_from.json),'
      )
    raise WorkdirError(
        f'{workdir} holds a run with another config ({listed}). Nothing was'
        f' changed.{dataset_fix} Resume with the original values, use a fresh'
        ' --workdir, or pass --config.allow_config_change=True to continue'
        ' with the new values (in metrics.jsonl).'
    )
  return changes


# The key of a changed dataset among a resume's changes.
DATASET_CHANGE = 'dataset'


def write_config(workdir: str, config: config_lib.RunConfig) -> None:
  """Writes `config.json`, the resolved config of the run, whole; a tokenizer
  outside the workdir is copied in first and recorded relative to the workdir
  (`own_tokenizer.record`)."""
  saved = config.to_dict()
  saved['data'] = own_tokenizer.record(saved['data'], workdir)
  path = os.path.join(workdir, outputs.CONFIG_FILE)
  with outputs.atomic_write(path, 'w') as f:
    json.dump(saved, f, indent=2, sort_keys=True)


def held_by(workdir: str) -> str | None:
  """'host H, pid P' of a training process holding the workdir's lock now, or
  None (probed with a shared lock, released at once)."""
  path = os.path.join(workdir, outputs.LOCK_FILE)
  try:
    fd = os.open(path, os.O_RDONLY)
  except OSError:
    return None
  try:
    fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
  except OSError:
    return Lock(workdir)._holder()
  finally:
    os.close(fd)
  return None


def _step_files(workdir: str) -> list[tuple[int, str]]:
  """``(step, path)`` of the run's window and table files, in step order."""
  return sorted(outputs.window_files(workdir) + outputs.table_files(workdir))


def check_not_imported(workdir: str) -> None:
  """Refuses to resume training in an imported model's workdir (its checkpoint
  holds parameters only)."""
  if os.path.exists(os.path.join(workdir, outputs.IMPORT_FILE)):
    raise WorkdirError(
        f'{workdir} holds an imported model ({outputs.IMPORT_FILE}), which no'
        ' run resumes. Nothing was changed. Start a run from it in a fresh'
        f' --workdir with --config.init_from={workdir}.'
    )


def check_fresh_start(workdir: str) -> None:
  """Refuses to start over on a workdir with trained outputs but no
  checkpoints."""
  trained = [path for step, path in _step_files(workdir) if step > 0]
  if trained or metric_rows(workdir):
    raise WorkdirError(
        f'{workdir} has outputs of a trained run ({outputs.METRICS_FILE},'
        f' {len(trained)} window/table files) but no checkpoint to resume from.'
        ' Nothing was changed. Restore its checkpoints/ directory, use a fresh'
        ' --workdir, or delete the old outputs.'
    )


def metric_rows(workdir: str) -> list[tuple[str, dict[str, Any]]]:
  """``(line, row)`` of ``metrics.jsonl``, the one reader (a half-written line
  is skipped)."""
  path = os.path.join(workdir, outputs.METRICS_FILE)
  if not os.path.exists(path):
    return []
  rows = []
  with open(path) as f:
    for line in f:
      try:
        row = json.loads(line)
      except ValueError:
        continue
      if isinstance(row, dict):
        rows.append((line, row))
  return rows


def truncate_outputs(workdir: str, step: int) -> None:
  """Reads the outputs up to ``step``, drops those after it and leftovers
  (Resume in docs/DESIGN.md § Training outputs)."""
  keep = [path for s, path in _step_files(workdir) if s <= step]
  # Read, so that a damaged one stops the resume: it cannot be written again.
  for path in keep:
    if path.endswith('.npz'):
      outputs.load_npz(path)
    else:
      outputs.load_npy(path)
  metrics = os.path.join(workdir, outputs.METRICS_FILE)
  if os.path.exists(metrics):
    rows = metric_rows(workdir)
    with outputs.atomic_write(metrics, 'w') as f:
      # A row without a step counts as after it.
      f.writelines(line for line, r in rows if r.get('step', step + 1) <= step)
  later = [path for s, path in _step_files(workdir) if s > step]
  leftovers = []
  for pattern in (outputs.WINDOW_FILES, outputs.TABLE_FILES):
    leftovers += outputs.step_leftovers(os.path.join(workdir, pattern))
  # Only names the run writes: a user's window_20.npz.bak stays.
  for path in later + leftovers:
    os.remove(path)


def append_row(workdir: str, row: dict[str, Any]) -> None:
  """Appends one JSON row to ``metrics.jsonl``, whole or not at all (numpy
  scalars as floats)."""
  outputs.append_whole(
      os.path.join(workdir, outputs.METRICS_FILE),
      (json.dumps(row, default=float) + '\n').encode(),
  )


def has_row(workdir: str, step: int, key: str) -> bool:
  """Whether ``metrics.jsonl`` holds a row of ``step`` with ``key`` ('loss' or
  'eval')."""
  return any(
      r.get('step') == step and key in r for _, r in metric_rows(workdir)
  )


def write_init_record(workdir: str, record: dict[str, Any]) -> None:
  """Writes init_from.json: the workdir and step a run started from, and the
  rows its position table had (`init_from.start_params`)."""
  path = os.path.join(workdir, outputs.INIT_FROM_FILE)
  with outputs.atomic_write(path, 'w') as f:
    json.dump(record, f, indent=1)


def init_record(workdir: str) -> dict[str, Any] | None:
  """The run's init_from.json, or None if it started from a fresh init."""
  path = os.path.join(workdir, outputs.INIT_FROM_FILE)
  if not os.path.exists(path):
    return None
  try:
    with open(path) as f:
      return json.load(f)
  except ValueError as e:
    raise WorkdirError(f'{path} is not valid JSON ({e}).') from None
