"""Orbax checkpoints of a training run: save, restore, and params-only restore.

This is the only module of the project that talks to Orbax.

On-disk layout (one directory per saved step, written atomically by Orbax: a step
directory appears under its final name only once every item is complete)::

  WORKDIR/checkpoints/
    STEP/                       e.g. 0/, 100/, 200/ (no zero padding)
      _CHECKPOINT_METADATA      Orbax step metadata (commit time, item handlers, and
                                custom_metadata['flax_posemb_items']: items written)
      params/                   Orbax PyTree (OCDBT + _METADATA): the model params
      opt_state/                Orbax PyTree: the optax state (Adam moments, count)
      data_iter/                Grain iterator state: process_I-of-N.json per process
                                (absent if saved with data_iter=None)
      stats/                    Orbax PyTree of numpy arrays (int64 counts kept exact;
                                absent if saved with empty stats)
      config/metadata           JSON: the resolved config dict of the run

Retention: the latest `max_to_keep` steps plus step 0 (the initial table, which the
drift analysis needs) are kept; older steps are deleted after each save.

A step whose values are not all finite is never saved. A truncated or corrupted
latest checkpoint is never deleted by a restore: `restore()` / `restore_params()`
with `step=None` log a warning naming the bad directory and fall back to the
previous step.

Typical use (training)::

  ckpt = Checkpointer(checkpoint_dir(workdir), max_to_keep=3)
  if ckpt.latest_step() is not None:
    r = ckpt.restore(abstract_params=params, abstract_opt_state=opt_state,
                     data_iter=it)
  ckpt.save(step, params=..., opt_state=..., data_iter=it, stats=..., config=...)
  ckpt.close()

and evaluation::

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
_ITEMS_KEY = 'flax_posemb_items'  # Step custom metadata: the items written.

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


# ------------------------------------------------------------------ helpers


def _path_str(path: tuple[Any, ...]) -> str:
  """'a/b/0' for a JAX key path (dict keys, attributes and indices alike)."""
  parts = []
  for k in path:
    for attr in ('key', 'name', 'idx'):
      if hasattr(k, attr):
        parts.append(str(getattr(k, attr)))
        break
    else:
      parts.append(str(k))
  return '/'.join(parts)


def _shapes_by_path(tree: PyTree) -> dict[str, tuple[int, ...]]:
  """Maps each array leaf's path string to its shape."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  return {_path_str(p): tuple(x.shape) for p, x in flat}


def _check_same_tree(item: str, stored: PyTree, expected: PyTree,
                     directory: epath.Path) -> None:
  """Raises CheckpointMismatchError naming the first path that differs."""
  got = _shapes_by_path(stored)
  want = _shapes_by_path(expected)
  for path in sorted(set(got) | set(want)):
    g, w = got.get(path), want.get(path)
    if g != w:
      g_s = 'absent' if g is None else str(g)
      w_s = 'absent' if w is None else str(w)
      raise CheckpointMismatchError(
          f'The checkpoint at {directory} was written by a different model: '
          f'{item} path {path!r} has shape {g_s} in the checkpoint but '
          f'{w_s} in the current config. Use a fresh --workdir (or the config '
          'that wrote this checkpoint).')


def _default_sharding() -> jax.sharding.Sharding:
  return jax.sharding.SingleDeviceSharding(jax.local_devices()[0])


def _abstract(tree: PyTree) -> PyTree:
  """ShapeDtypeStructs with shardings for arrays or ShapeDtypeStructs.

  Leaves without a sharding get the default (first local) device.
  """
  def one(x):
    sharding = getattr(x, 'sharding', None) or _default_sharding()
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)
  return jax.tree.map(one, tree)


def _is_float(x: Any) -> bool:
  return jnp.issubdtype(x.dtype, jnp.inexact)


@jax.jit
def _finite_flags(leaves: list[jax.Array]) -> list[jax.Array]:
  return [jnp.all(jnp.isfinite(x)) for x in leaves]


def _nonfinite_paths(name: str, tree: PyTree) -> list[str]:
  """Paths (prefixed by `name`) of floating leaves holding NaN or inf."""
  flat, _ = jax.tree_util.tree_flatten_with_path(tree)
  host = [(p, x) for p, x in flat if isinstance(x, (np.ndarray, np.generic))
          and _is_float(x)]
  dev = [(p, x) for p, x in flat if isinstance(x, jax.Array) and _is_float(x)]
  bad = [p for p, x in host if not np.all(np.isfinite(x))]
  if dev:
    flags = jax.device_get(_finite_flags([x for _, x in dev]))
    bad += [p for (p, _), ok in zip(dev, flags) if not ok]
  return [f'{name}/{_path_str(p)}' for p in bad]


def _stats_to_numpy(stats: Mapping[str, Any] | None) -> dict[str, Any]:
  """Host copies of `stats`; Python ints become int64, zero-size is refused."""
  stats = dict(stats or {})

  def one(path, x):
    if isinstance(x, int) and not isinstance(x, bool):
      a = np.asarray(x, dtype=np.int64)
    else:
      a = np.asarray(jax.device_get(x))
    if a.size == 0:
      raise ValueError(
          f'stats/{_path_str(path)} is an empty array (shape {a.shape}); Orbax '
          'cannot store zero-size arrays. Drop it from the stats dict.')
    return a
  return jax.tree_util.tree_map_with_path(one, stats)


def _config_to_dict(config: Any) -> dict[str, Any]:
  """A JSON-serializable dict from a dict or ml_collections.ConfigDict."""
  if config is None:
    return {}
  if hasattr(config, 'to_dict'):
    config = config.to_dict()
  config = dict(config)
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


# ------------------------------------------------------------ Checkpointer


class Checkpointer:
  """Saves and restores the full training state of one run.

  Wraps `orbax.checkpoint.CheckpointManager` with five items per step:
  `params` and `opt_state` (PyTrees of jax.Arrays, any sharding), `data_iter`
  (a Grain `DatasetIterator` / `DataLoaderIterator`, state saved as JSON per
  process), `stats` (dict of numpy arrays; int64 stays int64 exactly) and
  `config` (JSON dict). See the module docstring for the on-disk layout.

  All processes of a multi-host run must make the same calls.
  """

  def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int,
               async_save: bool = True, read_only: bool = False):
    """Opens (creating unless `read_only`) a checkpoint directory.

    Args:
      directory: the checkpoints directory, usually `checkpoint_dir(workdir)`.
      max_to_keep: number of most recent steps kept (>= 1); step 0 is kept in
        addition.
      async_save: write in a background thread after the device-to-host copy;
        call `wait_until_finished()` before reading the files.
      read_only: never write or delete (used by `restore_params`).
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
        preservation_policy=policy,
        enable_async_checkpointing=async_save,
        create=not read_only,
        read_only=read_only,
        save_interval_steps=0 if read_only else 1,
        # Orphaned *.orbax-checkpoint-tmp-* dirs of a killed save are removed;
        # finalized step directories are never touched by this.
        cleanup_tmp_directories=not read_only,
    )
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, handler_registry=_registry())

  # -- queries

  def all_steps(self) -> list[int]:
    """Sorted steps of the finalized checkpoints on disk."""
    return sorted(int(s) for s in self._manager.all_steps())

  def latest_step(self) -> int | None:
    """The highest finalized step, or None when there is none."""
    return self._manager.latest_step()

  def step_dir(self, step: int) -> epath.Path:
    """Directory of one step's checkpoint."""
    return self.directory / str(int(step))

  # -- save

  def save(self, step: int, *, params: PyTree, opt_state: PyTree,
           data_iter: Any, stats: Mapping[str, Any] | None,
           config: Any, force: bool = False) -> bool:
    """Saves one step (asynchronously if the Checkpointer was opened so).

    Args:
      step: optimizer step the state belongs to (the state *after* `step`
        updates); 0 is the initial state.
      params: model params, PyTree of jax.Arrays (any shapes/shardings).
      opt_state: optax state, PyTree of jax.Arrays.
      data_iter: Grain iterator positioned at the next batch, or None (not
        stored; restore it with data_iter=None).
      stats: dict (possibly nested) of numpy arrays / Python ints; e.g. int64
        cumulative counts `[max_len]`. No zero-size arrays. Empty or None:
        not stored, restored as {}.
      config: ConfigDict or JSON-serializable dict.
      force: save even where Orbax's save-decision policy would skip; an
        existing step is still never overwritten.

    Returns:
      True if a checkpoint was written (or started writing); False if the
      state held non-finite values (a warning names them), or the step is
      already on disk / older than the latest.
    """
    step = int(step)
    stats = _stats_to_numpy(stats)
    bad = (_nonfinite_paths('params', params)
           + _nonfinite_paths('opt_state', opt_state)
           + _nonfinite_paths('stats', stats))
    if bad:
      logger.warning(
          'Not saving the checkpoint of step %d: non-finite values in %s%s. '
          'The last good checkpoint (step %s) is left as it is.', step,
          ', '.join(bad[:5]), ' ...' if len(bad) > 5 else '',
          self.latest_step())
      return False
    if step in self.all_steps():
      logger.warning('A checkpoint of step %d already exists at %s; it is not '
                     'overwritten.', step, self.step_dir(step))
      return False
    items = dict(
        params=ocp.args.StandardSave(params),
        opt_state=ocp.args.StandardSave(opt_state),
        config=ocp.args.JsonSave(_config_to_dict(config)),
    )
    if stats:  # Orbax refuses an empty tree; an absent item restores as {}.
      items['stats'] = ocp.args.StandardSave(stats)
    if data_iter is not None:
      items['data_iter'] = grain.checkpoint.CheckpointSave(data_iter)
    saved = self._manager.save(
        step, args=ocp.args.Composite(**items), force=force,
        custom_metadata={_ITEMS_KEY: sorted(items)})
    if not saved:
      logger.warning('Orbax skipped the checkpoint of step %d (latest on disk: '
                     '%s).', step, self.latest_step())
    return bool(saved)

  # -- restore

  def _item_tree(self, step: int, item: str) -> PyTree:
    """The stored metadata tree (leaves have .shape/.dtype) of one item."""
    md = self._manager.item_metadata(step)
    tree = md[item] if md is not None else None
    if tree is None:
      raise FileNotFoundError(f'item {item!r} is missing or unreadable in '
                              f'{self.step_dir(step)}')
    return getattr(tree, 'tree', tree)

  def _saved_items(self, step: int) -> list[str] | None:
    """Items written at `step` (from its step metadata), None if unknown."""
    try:
      custom = self._manager.metadata(step).custom_metadata or {}
    except Exception:  # pylint: disable=broad-except
      return None
    items = custom.get(_ITEMS_KEY)
    return list(items) if items is not None else None

  def _restore_step(self, step: int, abstract_params: PyTree,
                    abstract_opt_state: PyTree, data_iter: Any) -> dict[str, Any]:
    saved = self._saved_items(step)
    _check_same_tree('params', self._item_tree(step, 'params'),
                     abstract_params, self.step_dir(step))
    _check_same_tree('opt_state', self._item_tree(step, 'opt_state'),
                     abstract_opt_state, self.step_dir(step))
    items = dict(
        params=ocp.args.StandardRestore(_abstract(abstract_params)),
        opt_state=ocp.args.StandardRestore(_abstract(abstract_opt_state)),
        config=ocp.args.JsonRestore(),
    )
    if saved is None or 'stats' in saved:  # A missing stats dir is then damage.
      items['stats'] = ocp.args.StandardRestore()
    if data_iter is not None:
      if saved is not None and 'data_iter' not in saved:
        raise CallerError(
            f'{self.step_dir(step)} was saved without a data iterator; pass '
            'data_iter=None to restore it (the data order then restarts).')
      items['data_iter'] = grain.checkpoint.CheckpointRestore(data_iter)
    r = self._manager.restore(step, args=ocp.args.Composite(**items))
    stats = {}
    if 'stats' in items:
      stats = jax.tree.map(np.asarray, dict(r['stats'] or {}))
    return dict(step=step, params=r['params'], opt_state=r['opt_state'],
                stats=stats, config=dict(r['config'] or {}))

  def restore(self, step: int | None = None, *, abstract_params: PyTree,
              abstract_opt_state: PyTree, data_iter: Any) -> dict[str, Any]:
    """Restores a step (the latest readable one by default).

    Args:
      step: step to restore; None = the latest, falling back to earlier steps
        (with a warning naming each unreadable directory, which is left on
        disk) if it is truncated or corrupted.
      abstract_params: PyTree of `jax.ShapeDtypeStruct` (or arrays) with
        `.sharding`; the restored params take these shapes, dtypes and
        shardings, so a restore works onto any mesh. Leaves without a sharding
        go to the first local device.
      abstract_opt_state: the same for the optax state (e.g.
        `jax.eval_shape(tx.init, params)` with shardings).
      data_iter: Grain iterator whose state is set in place to the saved one,
        or None to leave iterators alone.

    Returns:
      dict with `step` (int), `params`, `opt_state`, `stats` (dict of numpy
      arrays, dtypes as saved), `config` (dict).

    Raises:
      FileNotFoundError: no checkpoint in the directory.
      CheckpointMismatchError (a ValueError): the stored params/opt_state tree
        or shapes differ from the abstract ones (another model's checkpoint).
      RuntimeError: every checkpoint (or the requested one) is unreadable.
    """
    return self.first_readable(
        step, lambda s: self._restore_step(s, abstract_params,
                                           abstract_opt_state, data_iter))

  def first_readable(self, step: int | None,
                     fn: Callable[[int], _T]) -> _T:
    """`fn(step)`, or, for step None, `fn` of the latest step it can read.

    Exceptions other than `CallerError` count as a truncated or corrupted
    checkpoint: with step None, a warning names the directory (left on disk)
    and the previous step is tried.

    Raises:
      FileNotFoundError: no checkpoint, or not the requested step.
      RuntimeError: no readable checkpoint among the candidates; names them.
    """
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f'no checkpoint under {self.directory}; run '
                              'train.py first.')
    if step is not None and int(step) not in steps:
      raise FileNotFoundError(f'no checkpoint of step {step} under '
                              f'{self.directory}; available steps: {steps}.')
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
          logger.warning('Checkpoint %s is truncated or corrupted (%s); falling '
                         'back to the previous checkpoint. The bad directory '
                         'is left on disk for inspection.', self.step_dir(s),
                         _describe(e))
    raise RuntimeError('No readable checkpoint: ' + '; '.join(bad) +
                       '. Inspect or move these directories, or use a fresh '
                       '--workdir.')

  # -- lifecycle

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


# --------------------------------------------------------- params only


def _resolve_dir(path: str | os.PathLike[str]) -> epath.Path:
  """WORKDIR/checkpoints if it exists, else `path` itself if it holds steps."""
  path = _absolute(path)
  sub = path / CHECKPOINT_SUBDIR
  if sub.is_dir():
    return sub
  if path.is_dir() and any(p.name.isdigit() for p in path.iterdir()):
    return path
  raise FileNotFoundError(f'no checkpoint under {path}; run train.py first '
                          '(with --workdir pointing here).')


def _params_abstract(tree: PyTree, sharding: Any) -> PyTree:
  """ShapeDtypeStructs from stored metadata, placed by `sharding`."""
  to_sds = lambda m, sh: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=sh)
  if sharding is None or isinstance(sharding, jax.sharding.Sharding):
    sh = sharding or _default_sharding()
    return jax.tree.map(lambda m: to_sds(m, sh), tree)
  try:
    return jax.tree.map(to_sds, tree, sharding)
  except ValueError as e:
    raise CallerError(
        'sharding must be one jax.sharding.Sharding or a PyTree of shardings '
        f'with the structure of the stored params: {e}') from e


def restore_params(workdir_or_ckpt_dir: str | os.PathLike[str],
                   step: int | None = None,
                   sharding: jax.sharding.Sharding | PyTree | None = None,
                   ) -> tuple[PyTree, dict[str, Any], int]:
  """Restores only `params` and `config`, without knowing the model.

  Shapes and dtypes come from the checkpoint's metadata. Nothing is written.

  Args:
    workdir_or_ckpt_dir: a training workdir (holding `checkpoints/`) or the
      checkpoints directory itself.
    step: step to restore; None = latest readable (falls back past a corrupted
      latest with a warning, like `Checkpointer.restore`).
    sharding: one `jax.sharding.Sharding` for every leaf (e.g. a replicated
      `NamedSharding(mesh, P())`), a PyTree of shardings matching params, or
      None for the first local device.

  Returns:
    (params, config, step): params as stored (e.g. `params['pos_embed']
    ['embedding']` of shape `[max_len, emb_dim]`), the run's config dict and
    the restored step.
  """
  directory = _resolve_dir(workdir_or_ckpt_dir)
  ckpt = Checkpointer(directory, max_to_keep=1, async_save=False,
                      read_only=True)
  def one(s: int):
    tree = ckpt._item_tree(s, 'params')  # pylint: disable=protected-access
    abstract = _params_abstract(tree, sharding)
    r = ckpt._manager.restore(  # pylint: disable=protected-access
        s, args=ocp.args.Composite(params=ocp.args.StandardRestore(abstract),
                                   config=ocp.args.JsonRestore()))
    return r['params'], dict(r['config'] or {}), s

  try:
    return ckpt.first_readable(step, one)
  finally:
    ckpt.close()
