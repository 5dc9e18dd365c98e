"""Orbax checkpoints of a training run, verified on restore; the layout, digests and recovery
rules are in docs/DESIGN.md, "Training outputs (workdir)"."""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
from typing import Any, Callable

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from flax_posemb import trees

logger = logging.getLogger(__name__)
ITEMS = ('params', 'opt_state', 'data_iter', 'stats', 'config')
# Root causes of failed reads of damaged files (Orbax wraps TensorStore's ValueError in a plain
# Exception); any other failure (out of memory, a device error) propagates as it is.
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError)


class CheckpointMismatchError(trees.TreeMismatchError):
  """The checkpoint is readable but was written for another config."""


class CheckpointDamagedError(RuntimeError):
  """A checkpoint is missing files, truncated, garbled, fails its digests or holds NaN/inf."""


@dataclasses.dataclass
class RestoreInfo:
  """The step read (``requested`` None: the newest), the damaged newer steps skipped
  (``fell_back_from``: {step, directory, reason}) and the steps deleted while read."""
  step: int
  requested: int | None
  fell_back_from: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  vanished: list[int] = dataclasses.field(default_factory=list)
  to_json = dataclasses.asdict


def checkpoint_dir(workdir: str | os.PathLike[str]) -> epath.Path:
  """``WORKDIR/checkpoints``, absolute (as Orbax needs)."""
  return epath.Path(os.path.abspath(workdir)) / 'checkpoints'


@jax.jit
def _device_digests(leaves: list[jax.Array]) -> list[tuple[jax.Array, ...]]:
  """Per leaf: all finite, and two sums mod 2**32 of its 32-bit words (position-weighted;
  murmur3-mixed): exact integer sums, so independent of the sharding."""
  out = []
  for x in leaves:
    x = jax.random.key_data(x) if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key) else x
    finite = jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.inexact) else True
    x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    word = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)  # 8 bytes: 2 words
    u = jax.lax.bitcast_convert_type(x, word).astype(jnp.uint32).ravel()
    i = jnp.arange(u.size, dtype=jnp.uint32)
    m = u + i * jnp.uint32(0x9E3779B9)
    m = (m ^ (m >> 16)) * jnp.uint32(0x85EBCA6B)
    m = (m ^ (m >> 13)) * jnp.uint32(0xC2B2AE35)
    out.append((finite, (u * (2 * i + 1)).sum(dtype=jnp.uint32),
                (m ^ (m >> 16)).sum(dtype=jnp.uint32)))
  return out


def _blake(value: Any) -> str:
  data = value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode()
  return hashlib.blake2b(data, digest_size=16).hexdigest()


def _digests(item: str, tree: Any, saved: dict[str, Any] | None = None) -> dict[str, str]:
  """{path: digest} of an item: jax arrays on their devices (only the results come to the
  host), host arrays (stats: int64 exact) with BLAKE2b, config and data_iter as JSON. With the
  step's ``saved`` digests, the one integrity check: CheckpointDamagedError unless the values
  are finite and match them (no digests, from before they existed: finiteness only)."""
  if item in ('config', 'data_iter'):
    bad, out = [], {item: _blake(tree)}
  else:
    flat = {f'{item}/{jax.tree_util.keystr(p, simple=True, separator="/")}': x
            for p, x in jax.tree_util.tree_leaves_with_path(tree)}
    dev = [p for p, x in flat.items() if isinstance(x, jax.Array)]
    bad, out = [], {}
    for p, (ok, a, b) in zip(dev, jax.device_get(_device_digests([flat[p] for p in dev]))):
      bad, out[p] = bad + [p] * (not ok), f'{int(a):08x}{int(b):08x}'
    for p, x in flat.items():
      if p not in out:
        x = np.ascontiguousarray(x)
        bad += [p] * (np.issubdtype(x.dtype, np.inexact) and not np.isfinite(x).all())
        out[p] = _blake(f'{x.dtype.str}{x.shape}'.encode() + x.tobytes())
  if saved is not None and bad:
    raise CheckpointDamagedError(f'non-finite values in {", ".join(bad[:5])}')
  want = out if saved is None or 'version' not in saved else saved.get(item) or {}
  want = want if isinstance(want, dict) else {item: want}
  if wrong := sorted(p for p in set(want) | set(out) if want.get(p) != out.get(p)):
    raise CheckpointDamagedError(f'{", ".join(wrong[:5])} fail the checksum written at save time')
  return out


def _describe(e: BaseException) -> str | None:
  """One line of the root cause (Orbax wraps TensorStore's reason, which names the file), or
  None if it is no failed read of damaged files."""
  while e.__cause__ is not None:
    e = e.__cause__
  text = (str(e).strip().splitlines() or [''])[0][:300]
  if isinstance(e, (CheckpointDamagedError, *_READ_ERRORS)):
    return text if isinstance(e, CheckpointDamagedError) else f'{type(e).__name__}: {text}'
  return None


class Checkpointer:
  """The state of one run (all hosts make the same calls): keeps the ``max_to_keep`` newest
  steps and step 0; a ``read_only`` reader (eval) writes nothing."""

  def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int,
               async_save: bool = True, read_only: bool = False):
    self.directory, self._read_only = epath.Path(os.path.abspath(directory)), read_only
    keep = ocp.checkpoint_managers
    options = ocp.CheckpointManagerOptions(
        preservation_policy=keep.AnyPreservationPolicy([keep.LatestN(max_to_keep),
                                                        keep.CustomSteps([0])]),
        create=not read_only, read_only=read_only, cleanup_tmp_directories=not read_only,
        enable_async_checkpointing=async_save and not read_only)
    handlers = {k: ocp.StandardCheckpointHandler() for k in ('params', 'opt_state', 'stats')}
    handlers.update(config=ocp.JsonCheckpointHandler(),
                    data_iter=grain.checkpoint.CheckpointHandler())
    self._manager = ocp.CheckpointManager(self.directory, options=options, item_handlers=handlers)

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def step_metadata(self, step: int) -> dict[str, Any]:
    """A step's custom metadata: ``integrity`` (its digests) and ``metrics``."""
    return dict(self._manager.metadata(step).custom_metadata or {})

  def save(self, step: int, *, params: Any, opt_state: Any, data_iter: Any, stats: Any,
           config: Any, metrics: dict[str, float] | None = None) -> bool:
    """Saves the state after ``step`` updates (asynchronously); False if the step exists.
    ``stats``: host arrays and scalars, none of size 0 (None or {}: not saved); ``config``: a
    dict or ConfigDict; ``metrics``: scalars kept in the step's metadata (`step_metadata`)."""
    config = config.to_dict() if hasattr(config, 'to_dict') else dict(config)
    items = dict(params=params, opt_state=opt_state,
                 stats=jax.tree.map(lambda x: np.asarray(jax.device_get(x)), dict(stats or {})))
    # On the device, before Orbax's copy: the caller donates these buffers next.
    integrity = dict({k: _digests(k, v) for k, v in items.items()}, version=1,
                     config=_blake(config))
    # ENOSPC here, not from each of Orbax's writer threads; Orbax would wait for the previous
    # save anyway. The uncompressed size is an upper bound.
    self._manager.wait_until_finished()
    need = sum(getattr(x, 'nbytes', 0) for x in jax.tree.leaves(items))
    if need > (free := shutil.disk_usage(self.directory).free):
      raise OSError(errno.ENOSPC, f'No space left on device for the checkpoint of step {step}: '
                    f'it needs up to {need / 1e6:.1f} MB and {self.directory} has '
                    f'{free / 1e6:.1f} MB free. Free some space and re-run the same command: it '
                    'resumes from the last checkpoint.')
    args = {k: ocp.args.StandardSave(v) for k, v in items.items() if k != 'stats' or v}
    args['config'] = ocp.args.JsonSave(config)
    if data_iter is not None:
      args['data_iter'] = grain.checkpoint.CheckpointSave(data_iter)
      if jax.process_count() == 1:  # Hosts' states differ; the step's metadata is host 0's.
        integrity['data_iter'] = _blake(data_iter.get_state())
    custom = dict(integrity=integrity, metrics={k: float(v) for k, v in (metrics or {}).items()})
    if not (saved := self._manager.save(step, args=ocp.args.Composite(**args),
                                        custom_metadata=custom)):
      logger.warning('A checkpoint of step %d exists in %s; not overwritten.', step, self.directory)
    return saved

  def _read(self, step: int, abstract: dict[str, Any], data_iter: Any = None,
            expected: dict[str, Any] | None = None) -> dict[str, Any]:
    """The ``abstract`` items (trees of ShapeDtypeStructs or arrays with shardings, or one
    Sharding: as stored), config, stats (with opt_state) and ``data_iter`` of a step,
    verified; the stored trees must fit ``expected`` (default: ``abstract``)."""
    meta, where = self._manager.metadata(step), self.directory / str(step)
    saved, integrity = meta.item_handlers or {}, (meta.custom_metadata or {}).get('integrity')
    if integrity is None and meta.commit_timestamp_nsecs is None:  # No metadata file read.
      raise CheckpointDamagedError(f'{where}/_CHECKPOINT_METADATA is missing or garbled: the '
                                   'checksums written at save time are unknown')
    if data_iter is not None and 'data_iter' not in saved:
      raise CheckpointMismatchError(f'{where} was saved without a data iterator: a run cannot '
                                    'resume its data order from it; use a fresh --workdir.')
    for item, want in abstract.items():
      if (stored := getattr((meta.item_metadata or {}).get(item), 'tree', None)) is None:
        raise CheckpointDamagedError(f'the {item} metadata of {where} is missing or unreadable')
      if isinstance(want, jax.sharding.Sharding):  # As stored, placed there.
        abstract = {**abstract, item: jax.tree.map(
            lambda x, s=want: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), stored)}
      trees.check_same_tree(item, stored, (expected or abstract)[item], 'The checkpoint at '
                            f'{where} was written by another model', 'Use a fresh --workdir '
                            'or the config that wrote it (eval: another --step).',
                            error=CheckpointMismatchError)
    args = {k: ocp.args.StandardRestore(v) for k, v in abstract.items()}
    if 'opt_state' in args and 'stats' in saved:
      args['stats'] = ocp.args.StandardRestore()
    if data_iter is not None:
      args['data_iter'] = grain.checkpoint.CheckpointRestore(data_iter)
    out = dict(self._manager.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore(), **args)), step=step)
    out['stats'] = jax.tree.map(np.asarray, dict(out.get('stats') or {}))
    out['data_iter'] = data_iter and data_iter.get_state()
    unchecked = set() if 'data_iter' in (integrity or {}) else {'data_iter'}  # several hosts
    for item in {*args, 'config'} - unchecked:
      _digests(item, out[item], integrity or {})
    return out

  def restore(self, step: int | None = None, *, abstract_params: Any, abstract_opt_state: Any,
              data_iter: Any, fallback: bool = False) -> dict[str, Any]:
    """``step`` (None: the newest; see `first_readable`) as dict ``step``, ``params``,
    ``opt_state``, ``stats``, ``config``, ``data_iter`` (state), ``restore_info``."""
    r, info = self.first_readable(step, lambda s: self._read(
        s, dict(params=abstract_params, opt_state=abstract_opt_state), data_iter), fallback)
    return dict(r, restore_info=info)

  def latest_config(self) -> dict[str, Any]:
    """The verified config of the newest step (CheckpointDamagedError if it is damaged)."""
    return self.first_readable(None, lambda s: self._read(s, {}), False)[0]['config']

  def restore_params_only(self, step: int, sharding: jax.sharding.Sharding | None = None,
                          expected: Any = None) -> tuple[Any, dict[str, Any], int]:
    """``(params, config, step)`` as stored (the tree must fit ``expected``, the run's params,
    if given), placed by ``sharding`` (None: the first local device)."""
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    r = self._read(step, dict(params=sharding),
                   expected=None if expected is None else dict(params=expected))
    return r['params'], r['config'], step

  def first_readable(self, step: int | None, read: Callable[[int], Any], fallback: bool = True
                     ) -> tuple[Any, RestoreInfo]:
    """``read(step)``; for step None ``read`` of the newest step, skipping damaged ones with a
    warning if ``fallback`` (else CheckpointDamagedError); a step deleted (or superseded)
    while read is replaced by the new newest, never by an older one."""
    info, tried = RestoreInfo(step=-1, requested=step), set()
    while left := [s for s in self._steps() if s not in tried and step in (None, s)]:
      tried.add(s := left[-1])
      try:
        return read(s), dataclasses.replace(info, step=s)
      except CheckpointMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        if (reason := _describe(e)) is None:
          raise
        error = e
      steps, where = self._steps(), self.directory / str(s)
      older = [x for x in steps if x < s]
      if not where.exists() or step is None and steps[-1:] > [s]:
        logger.warning('Checkpoint %s was deleted or superseded while it was read (a running '
                       'training run keeps only its newest steps); reading the newest.', where)
        info.vanished.append(s)
      elif step is not None or not fallback or not older:
        raise CheckpointDamagedError(
            f'The {"latest " * (step is None)}checkpoint {where} is damaged: {reason}. Nothing '
            f'was changed; it is left on disk. Move it aside (e.g. mv {where} /tmp/) and re-run '
            f'to resume from the previous checkpoint (step {(older or [None])[-1]}), or use a '
            'fresh --workdir.') from error
      else:
        logger.warning('Checkpoint %s is damaged (%s); falling back to the previous one (the '
                       'directory is left on disk).', where, reason)
        info.fell_back_from.append(dict(step=s, directory=str(where), reason=reason))
    raise FileNotFoundError(f'no checkpoint {"" if step is None else f"of step {step} "}under '
                            f'{self.directory} (available steps: {self.all_steps()}); run '
                            'train.py first.')

  def _steps(self) -> list[int]:
    if self._read_only:
      self._manager.reload()  # A running trainer writes (and deletes) steps here.
    return self.all_steps()

  def reached_preemption(self, step: int) -> bool:
    """Whether every host reached JAX's preemption sync point (multi-host SIGTERM)."""
    return self._manager.reached_preemption(step)

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and closes, also after a failed save (whose error it raises)."""
    try:
      self._manager.wait_until_finished()
    finally:
      self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    # After an error, that one (often the same full disk) stays the one reported.
    with contextlib.nullcontext() if exc is None else contextlib.suppress(Exception):
      self.close()


def restore_params(workdir_or_ckpt_dir: str | os.PathLike[str], step: int | None = None,
                   sharding: jax.sharding.Sharding | None = None) -> tuple[Any, dict, int]:
  """``(params, config, step)``; see `restore_params_with_info`."""
  params, config, info = restore_params_with_info(workdir_or_ckpt_dir, step, sharding)
  return params, config, info.step


def restore_params_with_info(workdir_or_ckpt_dir: str | os.PathLike[str], step: int | None = None,
                             sharding: jax.sharding.Sharding | None = None,
                             expected: Any = None) -> tuple[Any, dict, RestoreInfo]:
  """``(params, config, RestoreInfo)`` of a workdir (or its ``checkpoints/``), read without
  writing (`Checkpointer.restore_params_only`, `Checkpointer.first_readable`)."""
  path = checkpoint_dir(workdir_or_ckpt_dir)
  with Checkpointer(path if path.is_dir() else path.parent, max_to_keep=1, read_only=True) as c:
    (params, config, _), info = c.first_readable(
        step, lambda s: c.restore_params_only(s, sharding, expected))
  return params, config, info
