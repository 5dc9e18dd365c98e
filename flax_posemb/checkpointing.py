"""Orbax checkpoints of a run, verified on restore (docs/DESIGN.md § Training
outputs)."""

from collections.abc import Callable
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
from typing import Any, Self

from etils import epath
import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp

from flax_posemb import outputs
from flax_posemb import trees

logger = logging.getLogger(__name__)
# Root causes of a failed read of damaged files; any other (out of memory)
# propagates as it is.
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError)
# Items that are pytrees of arrays (Orbax's StandardCheckpointHandler).
_ARRAY_ITEMS = ('params', 'opt_state', 'stats', 'counters')
# The training loop's host state: numpy arrays, saved only when not empty and
# read only with the optimizer state (a resume).
_HOST_ITEMS = ('stats', 'counters')
# Items digested whole, as JSON.
_JSON_ITEMS = ('config', 'data_iter')
# Listings a reader takes while a trainer's deletions keep racing them.
_LISTINGS = 20


class CheckpointMismatchError(trees.TreeMismatchError):
  """The checkpoint is readable but was written for another config."""


class CheckpointDamagedError(ValueError):
  """A checkpoint is missing files, truncated, garbled, fails its digests or
  holds NaN/inf."""


@dataclasses.dataclass
class RestoreInfo:
  """The step read, and the newer ones skipped: damaged or deleted while read
  (Recovery in docs/DESIGN.md § Training outputs)."""

  step: int
  requested: int | None
  fell_back_from: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  vanished: list[int] = dataclasses.field(default_factory=list)

  def to_json(self) -> dict[str, Any]:
    """The fields as a JSON-serializable dict (`results.json['checkpoint']`)."""
    return dataclasses.asdict(self)


def checkpoint_dir(workdir: str | os.PathLike[str]) -> epath.Path:
  """``WORKDIR/checkpoints``, absolute (as Orbax needs)."""
  return epath.Path(os.path.abspath(workdir)) / outputs.CHECKPOINTS_DIR


# Integrity (Checkpoints in docs/DESIGN.md § Training outputs): a digest of
# every array, computed at save and checked at restore by `_digests` alone.
# Finiteness is the loop's (a step with a non-finite loss, gradient or update
# is never saved).


@jax.jit
def _device_digests(
    leaves: list[jax.Array],
) -> list[tuple[jax.Array, jax.Array]]:
  """Per leaf, on its devices: two exact sums mod 2**32 of its 32-bit words,
  one position-weighted, one murmur3-mixed (so they do not depend on the
  sharding)."""
  out = []
  for x in leaves:
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      x = jax.random.key_data(x)
    if x.dtype == jnp.bool_:
      x = x.astype(jnp.uint8)
    # Words of at most 32 bits: an 8-byte element is two of them.
    word_type = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    words = (
        jax.lax.bitcast_convert_type(x, word_type).astype(jnp.uint32).ravel()
    )
    index = jnp.arange(words.size, dtype=jnp.uint32)
    weighted = (words * (2 * index + 1)).sum(dtype=jnp.uint32)
    mixed = words + index * jnp.uint32(0x9E3779B9)
    mixed = (mixed ^ (mixed >> 16)) * jnp.uint32(0x85EBCA6B)
    mixed = (mixed ^ (mixed >> 13)) * jnp.uint32(0xC2B2AE35)
    mixed = (mixed ^ (mixed >> 16)).sum(dtype=jnp.uint32)
    out.append((weighted, mixed))
  return out


def _blake(value: Any) -> str:
  """BLAKE2b of bytes, or of a JSON value's canonical text."""
  if isinstance(value, bytes):
    data = value
  else:
    data = json.dumps(value, sort_keys=True).encode()
  return hashlib.blake2b(data, digest_size=16).hexdigest()


def _digests(item: str, tree: Any) -> dict[str, str]:
  """``{path: digest}`` of one item: jax arrays hashed on their devices, host
  arrays and JSON items with BLAKE2b."""
  if item in _JSON_ITEMS:
    return {item: _blake(tree)}
  leaves = {}
  for key_path, leaf in jax.tree_util.tree_leaves_with_path(tree):
    name = jax.tree_util.keystr(key_path, simple=True, separator='/')
    leaves[f'{item}/{name}'] = leaf
  digests = {}
  on_device = [path for path, x in leaves.items() if isinstance(x, jax.Array)]
  sums = jax.device_get(_device_digests([leaves[path] for path in on_device]))
  for path, (weighted, mixed) in zip(on_device, sums):
    digests[path] = f'{int(weighted):08x}{int(mixed):08x}'
  for path, leaf in leaves.items():
    if path in digests:
      continue
    # A host array (stats, counters: int64, exact).
    x = np.ascontiguousarray(leaf)
    digests[path] = _blake(f'{x.dtype.str}{x.shape}'.encode() + x.tobytes())
  return digests


def _verify(item: str, tree: Any, saved: Any) -> None:
  """Raises CheckpointDamagedError unless a restored item has its digests of
  save time (``saved``: None for a step saved before digests, or by several
  hosts)."""
  digests = _digests(item, tree)
  if saved is None:
    return
  if not isinstance(saved, dict):  # A JSON item's one digest.
    saved = {item: saved}
  paths = saved.keys() | digests.keys()
  wrong = sorted(p for p in paths if saved.get(p) != digests.get(p))
  if wrong:
    raise CheckpointDamagedError(
        f'{", ".join(wrong[:5])} fail their checksum of save time'
    )


def _host_tree(tree: Any) -> dict[str, Any]:
  """A host copy (numpy arrays) of a dict of arrays; {} for None."""
  return jax.tree.map(np.asarray, jax.device_get(dict(tree or {})))


def _placed(stored: Any, sharding: jax.sharding.Sharding) -> Any:
  """The stored tree's shapes and dtypes, to be restored onto ``sharding``."""

  def leaf(x):
    return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

  return jax.tree.map(leaf, stored)


def _damage_reason(error: Exception) -> str | None:
  """The first line of the root cause of a read of damaged files, or None for
  any other failure (another model, out of memory)."""
  if isinstance(error, CheckpointMismatchError):
    return None
  root: BaseException = error
  while root.__cause__ is not None:  # Orbax wraps TensorStore's reason.
    root = root.__cause__
  if not isinstance(root, _READ_ERRORS):
    return None
  lines = str(root).strip().splitlines()
  first_line = lines[0][:300] if lines else ''
  if isinstance(root, CheckpointDamagedError):
    return first_line
  return f'{type(root).__name__}: {first_line}'


def check_model(
    where: str | os.PathLike[str],
    item: str,
    stored: Any,
    expected: Any,
    fix: str = (
        'Use a fresh --workdir or the config that wrote it (eval: another'
        ' --step).'
    ),
) -> None:
  """CheckpointMismatchError unless the tree of ``item`` stored in step
  directory ``where`` fits the model's ``expected`` tree."""
  trees.check_same_tree(
      item,
      stored,
      expected,
      f'{where} was written by another model',
      fix,
      error=CheckpointMismatchError,
  )


def _listed(list_steps: Callable[[], Any], directory: epath.Path) -> Any:
  """``list_steps()``, again while a step it found vanishes before Orbax reads
  its metadata (a trainer deleting its oldest step while a reader lists)."""
  for _ in range(_LISTINGS - 1):
    try:
      return list_steps()
    except FileNotFoundError as e:
      logger.info('A step vanished while listing %s (%s).', directory, e)
  return list_steps()


class Checkpointer:
  """The checkpoints of one run (all hosts make the same calls); ``read_only``:
  a reader; ``max_to_keep`` >= 1 (`config.RunConfig` checks the run's)."""

  def __init__(
      self,
      directory: str | os.PathLike[str],
      *,
      max_to_keep: int,
      async_save: bool = True,
      read_only: bool = False,
  ):
    self.directory = epath.Path(os.path.abspath(directory))
    self._read_only = read_only
    keep = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        preservation_policy=keep.AnyPreservationPolicy(
            [keep.LatestN(max_to_keep), keep.CustomSteps([0])]
        ),
        create=not read_only,
        read_only=read_only,
        cleanup_tmp_directories=not read_only,
        enable_async_checkpointing=async_save and not read_only,
    )
    handlers = {item: ocp.StandardCheckpointHandler() for item in _ARRAY_ITEMS}
    handlers['config'] = ocp.JsonCheckpointHandler()
    handlers['data_iter'] = grain.checkpoint.CheckpointHandler()
    # The manager lists the steps as it starts (a reader: see `_list_again`).
    self._manager = _listed(
        lambda: ocp.CheckpointManager(
            self.directory, options=options, item_handlers=handlers
        ),
        self.directory,
    )
    self.latest_step = self._manager.latest_step
    self.reached_preemption = self._manager.reached_preemption
    self.wait_until_finished = self._manager.wait_until_finished
    # Waits for pending saves (raising a failed one's error).
    self.close = self._manager.close

  def all_steps(self) -> list[int]:
    """The saved steps, ascending (listed again on each call when read-only)."""
    if self._read_only:
      # A running trainer writes (and deletes) steps here.
      _listed(self._manager.reload, self.directory)
    return sorted(self._manager.all_steps())

  def step_metadata(self, step: int) -> dict[str, Any]:
    """The custom metadata of `step` (`integrity`, `metrics`)."""
    return dict(self._manager.metadata(step).custom_metadata or {})

  def save(
      self,
      step: int,
      *,
      params: Any,
      opt_state: Any,
      data_iter: Any,
      stats: Any,
      config: Any,
      counters: dict[str, Any] | None = None,
      metrics: dict[str, float] | None = None,
      dataset: str | None = None,
  ) -> bool:
    """Saves the state after ``step`` updates (asynchronously); False if the
    step exists. The state is trusted finite (the loop stops on a
    non-finite step before saving it: docs/failures.md, exit 3).
    ``opt_state`` None: parameters only (an imported model, `pretrained`),
    which no run resumes. ``dataset``: the identity of the text trained on
    (`data.dataset_identity`), kept in the step's metadata."""
    if hasattr(config, 'to_dict'):
      config = config.to_dict()
    else:
      config = dict(config)
    items = {'params': params}
    if opt_state is not None:
      items['opt_state'] = opt_state
    items['stats'] = _host_tree(stats)
    items['counters'] = _host_tree(counters)
    # On the devices, before Orbax's copy: the caller donates these buffers
    # next.
    integrity: dict[str, Any] = {}
    for item, tree in items.items():
      integrity[item] = _digests(item, tree)
    integrity['config'] = _blake(config)
    self._refuse_without_space(step, items)
    args = {}
    for item, tree in items.items():
      if item in _HOST_ITEMS and not tree:
        continue
      args[item] = ocp.args.StandardSave(tree)
    args['config'] = ocp.args.JsonSave(config)
    if data_iter is not None:
      args['data_iter'] = grain.checkpoint.CheckpointSave(data_iter)
      # Hosts' states differ; the step's metadata is host 0's.
      if jax.process_count() == 1:
        integrity['data_iter'] = _blake(data_iter.get_state())
    custom: dict[str, Any] = {
        'integrity': integrity,
        'metrics': {k: float(v) for k, v in (metrics or {}).items()},
    }
    if dataset is not None:
      custom['dataset'] = dataset
    saved = self._manager.save(
        step, args=ocp.args.Composite(**args), custom_metadata=custom
    )
    if not saved:
      logger.warning(
          'A checkpoint of step %d exists in %s; not overwritten.',
          step,
          self.directory,
      )
    return saved

  def _refuse_without_space(self, step: int, items: dict[str, Any]) -> None:
    """ENOSPC here, before Orbax writes anything, rather than a traceback from
    each of its writer threads."""
    self._manager.wait_until_finished()
    need = sum(getattr(x, 'nbytes', 0) for x in jax.tree.leaves(items))
    free = shutil.disk_usage(self.directory).free
    # `need` is an upper bound: the arrays uncompressed.
    if need > free:
      raise OSError(
          errno.ENOSPC,
          f'No space left on device for the checkpoint of step {step}: it needs'
          f' up to {need / 1e6:.1f} MB and {self.directory} has'
          f' {free / 1e6:.1f} MB free; free some space and re-run: it resumes'
          ' from the last checkpoint.',
      )

  def stored_tree(self, step: int, item: str) -> Any:
    """The shapes and dtypes that step ``step`` records for ``item`` (its
    metadata only; CheckpointDamagedError if unreadable)."""
    where = self.directory / str(step)
    try:
      meta = self._manager.metadata(step)
    except _READ_ERRORS as e:
      raise CheckpointDamagedError(
          f'the metadata of {where} cannot be read ({type(e).__name__}: {e})'
      ) from e
    return self._stored_tree(meta, item, where)

  def first_config(self) -> dict[str, Any]:
    """The verified config of the oldest readable step (step 0 is always
    kept): a run's own config when its config.json is gone."""
    for step in self.all_steps():
      try:
        return self._read(step, abstract={})['config']
      except Exception as error:
        if _damage_reason(error) is None:
          raise
        logger.warning('Checkpoint %s is unreadable (%s).', step, error)
    raise FileNotFoundError(
        f'no readable checkpoint under {self.directory}; run train.py first.'
    )

  def _stored_tree(self, meta: Any, item: str, where: epath.Path) -> Any:
    """The tree of shapes and dtypes that a step's metadata records for
    ``item``."""
    item_metadata = (meta.item_metadata or {}).get(item)
    stored = getattr(item_metadata, 'tree', None)
    if stored is None:
      raise CheckpointDamagedError(
          f'the {item} metadata of {where} is missing or unreadable'
      )
    return stored

  def _read(
      self,
      step: int,
      abstract: dict[str, Any],
      data_iter: Any = None,
  ) -> dict[str, Any]:
    """A step's items, verified.

    Args:
      step: the step to read.
      abstract: item -> the tree to restore (arrays or ShapeDtypeStructs with
        shardings; the stored tree must fit it, `check_model`), or a
        Sharding: the stored tree, placed there.
      data_iter: the iterator to restore (a resume), or None.
    """
    meta = self._manager.metadata(step)
    where = self.directory / str(step)
    saved_items = meta.item_handlers or {}
    integrity = (meta.custom_metadata or {}).get('integrity', {})
    # No metadata file was read.
    if not integrity and meta.commit_timestamp_nsecs is None:
      raise CheckpointDamagedError(
          f'{where}/_CHECKPOINT_METADATA is missing or garbled: the '
          'checksums written at save time are unknown'
      )
    if 'opt_state' in abstract and 'opt_state' not in saved_items:
      raise CheckpointMismatchError(
          f'{where} holds parameters only (an imported model): no run resumes'
          ' from it. Start one from it in a fresh --workdir with'
          f' --config.init_from={self.directory.parent}.'
      )
    if data_iter is not None and 'data_iter' not in saved_items:
      raise CheckpointMismatchError(
          f'{where} was saved without a data iterator: a run cannot '
          'resume its data order from it; use a fresh --workdir.'
      )
    args = {'config': ocp.args.JsonRestore()}
    for item, target in abstract.items():
      stored = self._stored_tree(meta, item, where)
      if isinstance(target, jax.sharding.Sharding):
        # The stored tree as it is: the caller checks it (eval_workdir).
        target = _placed(stored, target)
      else:
        check_model(where, item, stored, target)
      args[item] = ocp.args.StandardRestore(target)
    if 'opt_state' in args:
      for item in _HOST_ITEMS:
        if item in saved_items:
          args[item] = ocp.args.StandardRestore()
    if data_iter is not None:
      args['data_iter'] = grain.checkpoint.CheckpointRestore(data_iter)
    restored = self._manager.restore(step, args=ocp.args.Composite(**args))
    out = dict(restored, step=step)
    for item in _HOST_ITEMS:
      out[item] = _host_tree(out.get(item))
    out['data_iter'] = None if data_iter is None else data_iter.get_state()
    for item in args:
      _verify(item, out[item], integrity.get(item))
    return out

  def restore(
      self,
      step: int | None = None,
      *,
      abstract_params: Any,
      abstract_opt_state: Any,
      data_iter: Any,
      fallback: bool = False,
  ) -> dict[str, Any]:
    """`_read` of ``step`` (None: the newest), with ``restore_info``."""
    return self.first_readable(
        step,
        fallback,
        data_iter=data_iter,
        abstract={'params': abstract_params, 'opt_state': abstract_opt_state},
    )

  def latest_config(self) -> dict[str, Any]:
    """The verified config of the newest step (CheckpointDamagedError if it is
    damaged)."""
    return self.first_readable(None, False, abstract={})['config']

  def first_readable(
      self, step: int | None, fallback: bool, **read: Any
  ) -> dict[str, Any]:
    """`_read` of ``step`` (None: the newest readable one) with
    ``restore_info`` (Recovery in docs/DESIGN.md § Training outputs: with
    ``fallback`` a damaged newest step gives way to the one before it)."""
    info = RestoreInfo(step=-1, requested=step)
    tried: set[int] = set()
    while True:
      untried = [s for s in self.all_steps() if s not in tried]
      if step is not None:
        untried = [s for s in untried if s == step]
      if not untried:
        break
      current = untried[-1]
      tried.add(current)
      try:
        restored = self._read(current, **read)
      except Exception as error:
        reason = _damage_reason(error)
        if reason is None:
          raise
        self._skip_unreadable(
            current, step, fallback, tried, info, reason, error
        )
        continue
      restored['restore_info'] = dataclasses.replace(info, step=current)
      return restored
    which = '' if step is None else f'of step {step} '
    raise FileNotFoundError(
        f'no checkpoint {which}under {self.directory} (available steps:'
        f' {self.all_steps()}); run train.py first.'
    )

  def _skip_unreadable(
      self,
      current: int,
      step: int | None,
      fallback: bool,
      tried: set[int],
      info: RestoreInfo,
      reason: str,
      error: Exception,
  ) -> None:
    """After step ``current`` failed to read for ``reason``: records it in
    ``info`` as vanished (deleted or superseded while read) or as damaged and
    skipped, or raises CheckpointDamagedError when it may not be skipped."""
    steps = self.all_steps()
    where = self.directory / str(current)
    older = [s for s in steps if s < current]
    superseded = step is None and any(
        s > current and s not in tried for s in steps
    )
    if not where.exists() or superseded:
      logger.warning(
          'Checkpoint %s deleted or superseded while read; reading the newest.',
          where,
      )
      info.vanished.append(current)
      return
    if step is not None or not fallback or not older:
      latest = 'latest ' if step is None else ''
      previous = older[-1] if older else None
      raise CheckpointDamagedError(
          f'The {latest}checkpoint {where} is damaged: {reason}. Nothing was'
          f' changed. Move it aside (mv {where} /tmp/) and re-run to resume'
          f' from the previous checkpoint (step {previous}), or use a fresh'
          ' --workdir.'
      ) from error
    logger.warning(
        'Checkpoint %s is damaged (%s); reading the previous one.',
        where,
        reason,
    )
    info.fell_back_from.append(
        {'step': current, 'directory': str(where), 'reason': reason}
    )

  def __enter__(self) -> Self:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    if exc is None:
      self.close()
      return
    # After an error, that one (often the same full disk) stays the one
    # reported.
    with contextlib.suppress(Exception):
      self.close()


def _checkpoints_of(workdir_or_ckpt_dir: str | os.PathLike[str]) -> epath.Path:
  """``WORKDIR/checkpoints``, or the checkpoints directory given itself."""
  path = checkpoint_dir(workdir_or_ckpt_dir)
  if not path.is_dir():
    return path.parent
  return path


def first_config(
    workdir_or_ckpt_dir: str | os.PathLike[str],
) -> dict[str, Any]:
  """`Checkpointer.first_config` of a workdir or its ``checkpoints/``,
  read-only."""
  path = _checkpoints_of(workdir_or_ckpt_dir)
  with Checkpointer(path, max_to_keep=1, read_only=True) as ckpt:
    return ckpt.first_config()


def restore_params(
    workdir_or_ckpt_dir: str | os.PathLike[str],
    step: int | None = None,
    sharding: jax.sharding.Sharding | None = None,
) -> tuple[Any, dict[str, Any], RestoreInfo]:
  """``(params, config, RestoreInfo)`` of a workdir or its ``checkpoints/``,
  read-only, as stored (the caller checks them against its model)."""
  path = _checkpoints_of(workdir_or_ckpt_dir)
  if sharding is None:
    sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
  with Checkpointer(path, max_to_keep=1, read_only=True) as ckpt:
    restored = ckpt.first_readable(step, True, abstract={'params': sharding})
  return restored['params'], restored['config'], restored['restore_info']
