"""Orbax checkpoints of a training run: save, restore, and params-only restore.

The only module of the project that talks to Orbax. It keeps what Orbax does not do itself:
a path-naming check that the stored tree fits the model (Orbax's own message names neither
the path nor the fix), refusing to save non-finite state, falling back past a damaged latest
step, and restoring params without knowing the model. Orbax already writes step directories
atomically (temporary directories are never listed), refuses to overwrite a step (``save``
returns False), lists the items of a step (``item_metadata``) and signals multi-host
preemption (``reached_preemption``).

On-disk layout::

  WORKDIR/checkpoints/STEP/     e.g. 0/, 100/ (no zero padding)
    params/ opt_state/          Orbax PyTrees (OCDBT)
    data_iter/                  Grain iterator state, one JSON per process (optional)
    stats/                      PyTree of numpy arrays: the statistics window and the host
                                counters (int64 kept exact; optional)
    config/metadata             JSON: the resolved config

Retention: the latest ``max_to_keep`` steps plus step 0 (the initial table, which the drift
analysis needs).

Typical use::

  ckpt = Checkpointer(checkpoint_dir(workdir), max_to_keep=3)
  r = ckpt.restore(abstract_params=params, abstract_opt_state=opt_state, data_iter=it)
  ckpt.save(step, params=..., opt_state=..., data_iter=it, stats=..., config=...)
  params, config, step = restore_params(workdir)
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = 'checkpoints'  # WORKDIR/checkpoints holds the step directories.
ITEMS = ('params', 'opt_state', 'data_iter', 'stats', 'config')

PyTree = Any
_T = TypeVar('_T')


class CallerError(ValueError):
  """A problem with the caller's arguments, not with the files on disk."""


class CheckpointMismatchError(CallerError):
  """The stored params/opt_state tree differs from the one the caller expects."""


def _absolute(path: str | os.PathLike[str]) -> epath.Path:
  """Orbax needs absolute paths: a local relative path (`runs/tiny`) is resolved here."""
  if '://' in str(path):  # gs://, s3:// ... are absolute already.
    return epath.Path(path)
  return epath.Path(os.path.abspath(os.fspath(path)))


def checkpoint_dir(workdir: str | os.PathLike[str]) -> epath.Path:
  """Returns `WORKDIR/checkpoints`, the directory a `Checkpointer` manages."""
  return _absolute(workdir) / CHECKPOINT_SUBDIR


def _shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
  # 'a/0/b' paths: stored metadata turns tuples and namedtuples into dicts and lists.
  return {jax.tree_util.keystr(p, simple=True, separator='/'): tuple(x.shape)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _check_same_tree(item: str, stored: PyTree, expected: PyTree, directory: epath.Path):
  """Raises CheckpointMismatchError naming the first path whose shape differs."""
  got, want = _shapes(stored), _shapes(expected)
  for path in sorted(set(got) | set(want)):
    if got.get(path) != want.get(path):
      raise CheckpointMismatchError(
          f'The checkpoint at {directory} was written by a different model: {item}/{path} '
          f'has shape {got.get(path, "absent")} in the checkpoint but '
          f'{want.get(path, "absent")} in the current config. Use a fresh --workdir (or the '
          'config that wrote this checkpoint).')


def _abstract(tree: PyTree, sharding: Any = None) -> PyTree:
  """ShapeDtypeStructs placed by ``sharding`` (one, or a tree), else the leaf's own
  sharding, else the first local device."""
  default = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])

  def one(x, sh=None):
    own = getattr(x, 'sharding', None)  # Stored metadata has a non-jax sharding: ignored.
    own = own if isinstance(own, jax.sharding.Sharding) else None
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh or own or default)
  if sharding is None or isinstance(sharding, jax.sharding.Sharding):
    return jax.tree.map(lambda x: one(x, sharding), tree)
  try:
    return jax.tree.map(one, tree, sharding)
  except ValueError as e:
    raise CallerError('sharding must be one jax.sharding.Sharding or a PyTree of shardings '
                      f'with the structure of the stored params: {e}') from e


def _nonfinite_paths(name: str, tree: PyTree) -> list[str]:
  """Paths (prefixed by ``name``) of floating leaves holding NaN or inf."""
  leaves = [(p, x) for p, x in jax.tree_util.tree_leaves_with_path(tree)
            if jnp.issubdtype(np.asarray(x).dtype if not hasattr(x, 'dtype') else x.dtype,
                              jnp.inexact)]
  flags = jax.device_get([jnp.all(jnp.isfinite(x)) if isinstance(x, jax.Array)
                          else np.all(np.isfinite(x)) for _, x in leaves])
  return [f'{name}/{jax.tree_util.keystr(p, simple=True, separator="/")}'
          for (p, _), ok in zip(leaves, flags) if not ok]


def _stats_to_numpy(stats: Mapping[str, Any] | None) -> dict[str, Any]:
  """Host copies of ``stats``; Python ints become int64; zero-size arrays are refused."""
  def one(path, x):
    a = np.asarray(x, np.int64) if isinstance(x, int) and not isinstance(x, bool) else (
        np.asarray(jax.device_get(x)))
    if a.size == 0:
      raise ValueError(f'stats/{jax.tree_util.keystr(path, simple=True, separator="/")} is '
                       f'an empty array (shape {a.shape})'
                       '; Orbax cannot store zero-size arrays. Drop it from the stats dict.')
    return a
  return jax.tree_util.tree_map_with_path(one, dict(stats or {}))


def _config_to_dict(config: Any) -> dict[str, Any]:
  """A JSON-serializable dict from a dict or ml_collections.ConfigDict."""
  config = dict(config.to_dict() if hasattr(config, 'to_dict') else config or {})
  try:
    json.dumps(config)
  except TypeError as e:
    raise TypeError(f'config must be JSON-serializable to be checkpointed: {e}. '
                    'Pass plain numbers, strings, lists and dicts.') from e
  return config


def _registry() -> ocp.handlers.CheckpointHandlerRegistry:
  """Handlers for the five items, for both saving and restoring."""
  reg = ocp.handlers.DefaultCheckpointHandlerRegistry()
  for item in ('params', 'opt_state', 'stats'):
    h = ocp.StandardCheckpointHandler()
    reg.add(item, ocp.args.StandardSave, h)
    reg.add(item, ocp.args.StandardRestore, h)
  h = ocp.JsonCheckpointHandler()
  reg.add('config', ocp.args.JsonSave, h)
  reg.add('config', ocp.args.JsonRestore, h)
  h = grain.checkpoint.CheckpointHandler()  # Grain's own Orbax handler.
  reg.add('data_iter', grain.checkpoint.CheckpointSave, h)
  reg.add('data_iter', grain.checkpoint.CheckpointRestore, h)
  return reg


def _describe(e: BaseException) -> str:
  msg = str(e).strip().splitlines()
  return f'{type(e).__name__}: {msg[0] if msg else ""}'[:300]


class Checkpointer:
  """Saves and restores the full training state of one run (all hosts make the same calls).

  Items per step: ``params`` and ``opt_state`` (PyTrees of jax.Arrays, any sharding),
  ``data_iter`` (a Grain iterator, optional), ``stats`` (dict of numpy arrays, optional) and
  ``config`` (JSON dict).
  """

  def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int,
               async_save: bool = True, read_only: bool = False):
    """Opens (creating unless ``read_only``) a checkpoint directory.

    Args:
      directory: the checkpoints directory, usually ``checkpoint_dir(workdir)``.
      max_to_keep: most recent steps kept (>= 1); step 0 is kept in addition.
      async_save: write in a background thread after the device-to-host copy.
      read_only: never write or delete.
    """
    if not isinstance(max_to_keep, int) or max_to_keep < 1:
      raise ValueError(f'max_to_keep must be an int >= 1, got {max_to_keep!r}. '
                       'Set --config.max_to_keep to a positive number.')
    self.directory = _absolute(directory)
    policy = ocp.checkpoint_managers.AnyPreservationPolicy([
        ocp.checkpoint_managers.LatestN(n=max_to_keep),
        ocp.checkpoint_managers.CustomSteps([0]),  # the initial table
    ])
    options = ocp.CheckpointManagerOptions(
        preservation_policy=policy, enable_async_checkpointing=async_save,
        create=not read_only, read_only=read_only, save_interval_steps=0 if read_only else 1,
        cleanup_tmp_directories=not read_only)  # Orphans of a killed save are removed.
    self._manager = ocp.CheckpointManager(self.directory, options=options,
                                          handler_registry=_registry())

  def all_steps(self) -> list[int]:
    """Sorted steps of the finalized checkpoints on disk."""
    return sorted(int(s) for s in self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The highest finalized step, or None."""
    return self._manager.latest_step()

  def step_dir(self, step: int) -> epath.Path:
    """Directory of one step's checkpoint."""
    return self.directory / str(int(step))

  def save(self, step: int, *, params: PyTree, opt_state: PyTree, data_iter: Any,
           stats: Mapping[str, Any] | None, config: Any) -> bool:
    """Saves the state after ``step`` updates (asynchronously if opened so).

    Args:
      step: optimizer steps done; 0 is the initial state.
      params: model params (PyTree of jax.Arrays).
      opt_state: optax state.
      data_iter: Grain iterator positioned at the next batch, or None (not stored).
      stats: dict (possibly nested) of numpy arrays / Python ints; no zero-size arrays;
        empty or None is not stored (restored as {}).
      config: ConfigDict or JSON-serializable dict.

    Returns:
      True if a checkpoint was written (or started); False if the state held non-finite
      values or the step already exists (a warning says which).
    """
    step, stats = int(step), _stats_to_numpy(stats)
    bad = (_nonfinite_paths('params', params) + _nonfinite_paths('opt_state', opt_state)
           + _nonfinite_paths('stats', stats))
    if bad:
      logger.warning('Not saving the checkpoint of step %d: non-finite values in %s%s. The '
                     'last good checkpoint (step %s) is left as it is.', step,
                     ', '.join(bad[:5]), ' ...' if len(bad) > 5 else '', self.latest_step())
      return False
    items = dict(params=ocp.args.StandardSave(params),
                 opt_state=ocp.args.StandardSave(opt_state),
                 config=ocp.args.JsonSave(_config_to_dict(config)))
    if stats:  # Orbax refuses an empty tree.
      items['stats'] = ocp.args.StandardSave(stats)
    if data_iter is not None:
      items['data_iter'] = grain.checkpoint.CheckpointSave(data_iter)
    saved = self._manager.save(step, args=ocp.args.Composite(**items))
    if not saved:
      logger.warning('A checkpoint of step %d already exists at %s (or is older than the '
                     'latest); it is not overwritten.', step, self.step_dir(step))
    return bool(saved)

  def saved_items(self, step: int) -> list[str]:
    """The items written at ``step`` (from Orbax's step metadata: a missing item directory
    is then damage, not an absent item)."""
    return sorted(self._manager.metadata(step).item_handlers or {})

  def item_tree(self, step: int, item: str) -> PyTree | None:
    """The stored metadata tree (leaves with .shape/.dtype) of one item; None if absent."""
    tree = self._manager.item_metadata(step).get(item)
    return getattr(tree, 'tree', tree)

  def _restore_step(self, step: int, abstract_params: PyTree, abstract_opt_state: PyTree,
                    data_iter: Any) -> dict[str, Any]:
    for item, want in (('params', abstract_params), ('opt_state', abstract_opt_state)):
      stored = self.item_tree(step, item)
      if stored is None:
        raise FileNotFoundError(f'item {item!r} is missing or unreadable in '
                                f'{self.step_dir(step)}')
      _check_same_tree(item, stored, want, self.step_dir(step))
    saved = self.saved_items(step)
    items = dict(params=ocp.args.StandardRestore(_abstract(abstract_params)),
                 opt_state=ocp.args.StandardRestore(_abstract(abstract_opt_state)),
                 config=ocp.args.JsonRestore())
    if 'stats' in saved:
      items['stats'] = ocp.args.StandardRestore()
    if data_iter is not None:
      if 'data_iter' not in saved:
        raise CallerError(f'{self.step_dir(step)} was saved without a data iterator; pass '
                          'data_iter=None to restore it (the data order then restarts).')
      items['data_iter'] = grain.checkpoint.CheckpointRestore(data_iter)
    r = self._manager.restore(step, args=ocp.args.Composite(**items))
    stats = jax.tree.map(np.asarray, dict(r['stats'] or {})) if 'stats' in items else {}
    return dict(step=step, params=r['params'], opt_state=r['opt_state'], stats=stats,
                config=dict(r['config'] or {}))

  def restore(self, step: int | None = None, *, abstract_params: PyTree,
              abstract_opt_state: PyTree, data_iter: Any) -> dict[str, Any]:
    """Restores a step (the latest readable one by default).

    Args:
      step: step to restore; None = the latest, falling back to earlier steps (with a
        warning naming each unreadable directory, which is left on disk).
      abstract_params: PyTree of ``jax.ShapeDtypeStruct`` (or arrays) with ``.sharding``;
        the restored params take these shapes, dtypes and shardings (any mesh).
      abstract_opt_state: the same for the optax state.
      data_iter: Grain iterator whose state is set in place, or None.

    Returns:
      dict ``step``, ``params``, ``opt_state``, ``stats`` (dict of numpy arrays), ``config``.

    Raises:
      FileNotFoundError: no checkpoint (or not the requested step).
      CheckpointMismatchError: the stored tree or shapes differ (another model).
      RuntimeError: every candidate checkpoint is unreadable.
    """
    return self.first_readable(step, lambda s: self._restore_step(
        s, abstract_params, abstract_opt_state, data_iter))

  def first_readable(self, step: int | None, fn: Callable[[int], _T]) -> _T:
    """``fn(step)``, or for step None ``fn`` of the latest step it can read.

    Exceptions other than ``CallerError`` count as a damaged checkpoint: with step None a
    warning names the directory (left on disk) and the previous step is tried.
    """
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f'no checkpoint under {self.directory}; run train.py first.')
    if step is not None and int(step) not in steps:
      raise FileNotFoundError(f'no checkpoint of step {step} under {self.directory}; '
                              f'available steps: {steps}.')
    candidates = [int(step)] if step is not None else steps[::-1]
    bad = []
    for s in candidates:
      try:
        return fn(s)
      except CallerError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        bad.append(f'{self.step_dir(s)} ({_describe(e)})')
        if s != candidates[-1]:
          logger.warning('Checkpoint %s is truncated or corrupted (%s); falling back to the '
                         'previous checkpoint. The bad directory is left on disk for '
                         'inspection.', self.step_dir(s), _describe(e))
    raise RuntimeError('No readable checkpoint: ' + '; '.join(bad) + '. Inspect or move '
                       'these directories, or use a fresh --workdir.')

  def restore_params_only(self, step: int, sharding: Any = None
                          ) -> tuple[PyTree, dict[str, Any], int]:
    """``(params, config, step)`` of one step, shapes and dtypes from the stored metadata."""
    tree = self.item_tree(step, 'params')
    if tree is None:
      raise FileNotFoundError(f'item params is missing in {self.step_dir(step)}')
    r = self._manager.restore(step, args=ocp.args.Composite(
        params=ocp.args.StandardRestore(_abstract(tree, sharding)),
        config=ocp.args.JsonRestore()))
    return r['params'], dict(r['config'] or {}), step

  def reached_preemption(self, step: int) -> bool:
    """Whether every host has reached JAX's preemption sync point (multi-host SIGTERM)."""
    return self._manager.reached_preemption(step)

  def wait_until_finished(self) -> None:
    """Blocks until pending asynchronous saves (and deletions) are done."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources."""
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc) -> None:
    self.close()


def _resolve_dir(path: str | os.PathLike[str]) -> epath.Path:
  """WORKDIR/checkpoints if it exists, else ``path`` itself if it holds steps."""
  path = _absolute(path)
  if (path / CHECKPOINT_SUBDIR).is_dir():
    return path / CHECKPOINT_SUBDIR
  if path.is_dir() and any(p.name.isdigit() for p in path.iterdir()):
    return path
  raise FileNotFoundError(f'no checkpoint under {path}; run train.py first '
                          '(with --workdir pointing here).')


def restore_params(workdir_or_ckpt_dir: str | os.PathLike[str], step: int | None = None,
                   sharding: jax.sharding.Sharding | PyTree | None = None,
                   ) -> tuple[PyTree, dict[str, Any], int]:
  """Restores only ``params`` and ``config``, without knowing the model; writes nothing.

  Args:
    workdir_or_ckpt_dir: a training workdir (holding ``checkpoints/``) or that directory.
    step: step to restore; None = latest readable (falls back past a damaged latest).
    sharding: one ``jax.sharding.Sharding`` for every leaf, a PyTree of shardings matching
      params, or None for the first local device.

  Returns:
    ``(params, config, step)``: params as stored (e.g. ``params['pos_embed']['embedding']``
    ``[max_len, emb_dim]``), the run's config dict and the restored step.
  """
  with Checkpointer(_resolve_dir(workdir_or_ckpt_dir), max_to_keep=1, async_save=False,
                    read_only=True) as ckpt:
    return ckpt.first_readable(step, lambda s: ckpt.restore_params_only(s, sharding))
