"""Orbax checkpoints of a training run, verified on restore: `Checkpointer` (save, restore,
retention, preemption) and `restore_params` (params and config without the model).

Layout, digests and recovery rules: docs/DESIGN.md, "Training outputs (workdir)".
"""

from __future__ import annotations

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
from jax import lax

from flax_posemb import trees

logger = logging.getLogger(__name__)
ITEMS = ('params', 'opt_state', 'data_iter', 'stats', 'config')
PyTree = Any


class CheckpointMismatchError(trees.TreeMismatchError):
  """The checkpoint is readable but was written for another config (model, data pipeline)."""


class CheckpointDamagedError(RuntimeError):
  """A checkpoint's files are missing, truncated, garbled, fail their digest or hold NaN/inf;
  ``steps`` lists the damaged steps (left on disk)."""

  def __init__(self, message: str, steps: list[int]):
    super().__init__(message)
    self.steps = steps


class _Damage(Exception):
  """A step whose files were read but fail their digest or hold NaN/inf."""


# Root causes of a failed read that damaged files give (TensorStore reports a ValueError, which
# Orbax wraps in a plain Exception); others (out of memory, a device error) propagate.
_READ_ERRORS = (_Damage, OSError, ValueError, KeyError, TypeError, AttributeError)


@dataclasses.dataclass
class RestoreInfo:
  """The step a restore read; ``requested`` None is the newest; ``fell_back_from``: damaged
  newer steps skipped (``{step, directory, reason}``); ``vanished``: steps deleted while read."""
  step: int
  requested: int | None
  fell_back_from: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  vanished: list[int] = dataclasses.field(default_factory=list)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


def _absolute(path: str | os.PathLike[str]) -> epath.Path:
  """Orbax needs absolute paths (gs://... already are)."""
  return epath.Path(path if '://' in str(path) else os.path.abspath(os.fspath(path)))


def checkpoint_dir(workdir: str | os.PathLike[str]) -> epath.Path:
  """``WORKDIR/checkpoints``, the directory a `Checkpointer` manages."""
  return _absolute(workdir) / 'checkpoints'


def _words(x: jax.Array) -> jax.Array:
  """The bytes of ``x`` as a flat uint32 vector (one word per element of <= 4 bytes)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  size = 1 if x.dtype == jnp.bool_ else x.dtype.itemsize
  if size >= 4:  # 8-byte types bitcast to [..., 2] words
    return lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
  return lax.bitcast_convert_type(x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x, {
      1: jnp.uint8, 2: jnp.uint16}[size]).astype(jnp.uint32).reshape(-1)


@jax.jit
def _device_digests(leaves: list[jax.Array]) -> list[tuple[jax.Array, jax.Array, jax.Array]]:
  """(all finite, two uint32 sums) per leaf: a position-weighted sum of its words and a sum of
  murmur3-mixed words, mod 2**32 (exact: independent of the sharding and reduction order)."""
  out = []
  for x in leaves:
    u = _words(x)
    i = jnp.arange(u.size, dtype=jnp.uint32)
    m = u + i * jnp.uint32(0x9E3779B9)
    m = (m ^ (m >> 16)) * jnp.uint32(0x85EBCA6B)
    m = (m ^ (m >> 13)) * jnp.uint32(0xC2B2AE35)
    finite = jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact) else True
    out.append((finite, jnp.sum(u * (i * 2 + 1), dtype=jnp.uint32),
                jnp.sum(m ^ (m >> 16), dtype=jnp.uint32)))
  return out


def _blake(data: bytes) -> str:
  return hashlib.blake2b(data, digest_size=16).hexdigest()


def _json_digest(value: Any) -> str:
  return _blake(value if isinstance(value, bytes) else json.dumps(value, sort_keys=True).encode())


def _inspect(name: str, tree: PyTree) -> tuple[list[str], dict[str, str]]:
  """(paths holding NaN/inf, {path: digest}) of a tree: jax arrays on their devices (only
  the small results come to the host), numpy arrays (stats: int64 exact) on the host."""
  flat = [(f'{name}/{jax.tree_util.keystr(p, simple=True, separator="/")}', x)
          for p, x in jax.tree_util.tree_leaves_with_path(tree)]
  dev = [(p, x) for p, x in flat if isinstance(x, jax.Array)]
  bad, digests = [], {}
  for (p, _), (ok, a, b) in zip(dev, jax.device_get(_device_digests([x for _, x in dev]))):
    bad += [] if ok else [p]
    digests[p] = f'{int(a):08x}{int(b):08x}'
  for p, x in flat:
    if not isinstance(x, jax.Array):
      x = np.ascontiguousarray(x)
      bad += [p] if np.issubdtype(x.dtype, np.inexact) and not np.isfinite(x).all() else []
      digests[p] = _blake(f'{x.dtype.str}{x.shape}'.encode() + x.tobytes())
  return bad, digests


def _verify(item: str, value: PyTree, integrity: dict[str, Any] | None) -> None:
  """The one integrity check: `_Damage` unless ``value`` is finite and matches its digests
  (``integrity`` None: a step saved before digests existed, finiteness only)."""
  bad, got = ([], {item: _json_digest(value)}) if item == 'config' else _inspect(item, value)
  if bad:
    raise _Damage(f'non-finite values in {", ".join(bad[:5])}')
  if integrity is not None:
    want = integrity.get(item)
    want = {item: want} if item == 'config' else want or {}
    wrong = [p for p in sorted(set(want) | set(got)) if want.get(p) != got.get(p)]
    if wrong:
      raise _Damage(f'{", ".join(wrong[:5])} fail the checksum written at save time')


def _root(e: BaseException) -> BaseException:
  while e.__cause__ is not None:
    e = e.__cause__
  return e


def _describe(e: BaseException) -> str:
  """One line of the root cause (Orbax wraps TensorStore's reason, which names the file)."""
  e = _root(e)
  return f'{type(e).__name__}: {(str(e).strip().splitlines() or [""])[0]}'[:300]


class Checkpointer:
  """Saves and restores the full state of one run (all hosts make the same calls)."""

  def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int,
               async_save: bool = True, read_only: bool = False):
    """``max_to_keep`` newest steps are kept, and step 0 (the initial table); ``read_only``
    (a reader such as eval) never writes and sees new steps on `restore`."""
    self.directory, self._read_only = _absolute(directory), read_only
    policy = ocp.checkpoint_managers.AnyPreservationPolicy([
        ocp.checkpoint_managers.LatestN(n=max_to_keep), ocp.checkpoint_managers.CustomSteps([0])])
    handlers = dict(params=ocp.StandardCheckpointHandler(), opt_state=ocp.StandardCheckpointHandler(),
                    stats=ocp.StandardCheckpointHandler(), config=ocp.JsonCheckpointHandler(),
                    data_iter=grain.checkpoint.CheckpointHandler())
    self._manager = ocp.CheckpointManager(self.directory, item_handlers=handlers,
                                          options=ocp.CheckpointManagerOptions(
        preservation_policy=policy, create=not read_only, read_only=read_only,
        enable_async_checkpointing=async_save and not read_only, cleanup_tmp_directories=not read_only))

  def all_steps(self) -> list[int]:
    return sorted(self._manager.all_steps())

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def step_dir(self, step: int) -> epath.Path:
    return self.directory / str(step)

  def step_metadata(self, step: int) -> dict[str, Any]:
    """A step's ``custom_metadata``: ``integrity`` digests and ``metrics`` (may be {})."""
    return dict(self._manager.metadata(step).custom_metadata or {})

  def save(self, step: int, *, params: PyTree, opt_state: PyTree, data_iter: Any,
           stats: PyTree | None, config: Any, metrics: dict[str, float] | None = None) -> bool:
    """Saves the state after ``step`` updates asynchronously; False if the step exists.

    ``stats``: host arrays and scalars, none of size 0 ({} or None: not stored); ``metrics``:
    scalars kept in the step's metadata (`step_metadata`).
    """
    stats = jax.tree.map(lambda x: np.asarray(jax.device_get(x)), dict(stats or {}))
    config = dict(config.to_dict() if hasattr(config, 'to_dict') else config)
    # On the device, before Orbax's copy: the caller donates these buffers next.
    integrity = {k: _inspect(k, v)[1] for k, v in
                 (('params', params), ('opt_state', opt_state), ('stats', stats))}
    integrity.update(version=1, config=_json_digest(config))
    self._check_space(step, params, opt_state, stats)
    items = dict(params=ocp.args.StandardSave(params), config=ocp.args.JsonSave(config),
                 opt_state=ocp.args.StandardSave(opt_state))
    if stats:  # Orbax refuses an empty tree.
      items['stats'] = ocp.args.StandardSave(stats)
    if data_iter is not None:
      items['data_iter'] = grain.checkpoint.CheckpointSave(data_iter)
      if jax.process_count() == 1:  # Hosts' states differ; the step metadata is host 0's.
        integrity['data_iter'] = _json_digest(data_iter.get_state())
    custom = dict(integrity=integrity, metrics={k: float(v) for k, v in (metrics or {}).items()})
    if not self._manager.save(step, args=ocp.args.Composite(**items), custom_metadata=custom):
      logger.warning('A checkpoint of step %d already exists in %s; it is not overwritten.',
                     step, self.directory)
      return False
    return True

  def _check_space(self, step: int, *tree: PyTree) -> None:
    """ENOSPC in the caller's thread for a save that cannot fit a local disk (in Orbax's
    writer threads, each sibling write would print a traceback)."""
    if '://' in str(self.directory):
      return
    need = sum(getattr(x, 'nbytes', 0) for x in jax.tree.leaves(tree))  # before zstd
    self._manager.wait_until_finished()  # Orbax waits anyway: the previous save is on disk.
    free = shutil.disk_usage(self.directory).free
    if need > free:
      raise OSError(errno.ENOSPC, f'No space left on device for the checkpoint of step {step}: '
                    f'it needs up to {need / 1e6:.1f} MB and {self.directory} has '
                    f'{free / 1e6:.1f} MB free. Free some space and re-run the same command: it '
                    'resumes from the last checkpoint.')

  def _read(self, step: int, items: dict[str, Any], expected: dict[str, PyTree]
            ) -> dict[str, Any]:
    """``items`` (restore args by name) and the config of one step, verified: the stored
    trees must fit ``expected`` (CheckpointMismatchError), the values their digests."""
    meta = self._manager.metadata(step)
    integrity = (meta.custom_metadata or {}).get('integrity')
    if integrity is None and meta.commit_timestamp_nsecs is None:  # no metadata file read
      raise _Damage(f'{self.step_dir(step) / "_CHECKPOINT_METADATA"} is missing or garbled, '
                    'so the checksums written at save time cannot be checked')
    for item, want in expected.items():
      stored = getattr((meta.item_metadata or {}).get(item), 'tree', None)
      if stored is None:
        raise _Damage(f'the {item} metadata of {self.step_dir(step)} is missing or unreadable')
      trees.check_same_tree(item, stored, want, f'The checkpoint at {self.step_dir(step)} was '
                            'written by another model', 'Use a fresh --workdir or the config '
                            'that wrote it (eval: another --step).', error=CheckpointMismatchError)
    out = dict(self._manager.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore(), **items)))
    if 'stats' in out:
      out['stats'] = jax.tree.map(np.asarray, dict(out['stats'] or {}))
    for item in items.keys() | {'config'}:
      _verify(item, out[item], integrity)
    return dict(out, step=step)

  def _restore_data_iter(self, step: int, data_iter: Any, integrity: dict[str, Any] | None):
    """The Grain state, its file verified first: what still fails does not fit this pipeline."""
    path = self.step_dir(step) / 'data_iter' / (
        f'process_{jax.process_index()}-of-{jax.process_count()}.json')
    text, want = path.read_text(), (integrity or {}).get('data_iter')
    if want and want not in (_json_digest(text.encode()), _json_digest(json.loads(text))):
      raise _Damage(f'{path} fails the checksum written at save time')
    try:
      self._manager.restore(step, args=ocp.args.Composite(
          data_iter=grain.checkpoint.CheckpointRestore(data_iter)))
    except Exception as e:  # pylint: disable=broad-except
      raise CheckpointMismatchError(
          f'The data iterator state in {path} does not fit the data pipeline of this config '
          f'({_describe(e)}). Resume with the data settings the run was started with, or use '
          'a fresh --workdir.') from e

  def _restore_step(self, step: int, abstract_params: PyTree, abstract_opt_state: PyTree,
                    data_iter: Any) -> dict[str, Any]:
    meta = self._manager.metadata(step)
    saved = meta.item_handlers or dict.fromkeys(ITEMS)  # no metadata: `_read` says damaged
    if data_iter is not None and 'data_iter' not in saved:
      raise CheckpointMismatchError(f'{self.step_dir(step)} was saved without a data iterator, '
                                    'so a run cannot resume its data order from it; use a '
                                    'fresh --workdir (in code: restore with data_iter=None).')
    items = dict(params=ocp.args.StandardRestore(abstract_params),
                 opt_state=ocp.args.StandardRestore(abstract_opt_state))
    if 'stats' in saved:
      items['stats'] = ocp.args.StandardRestore()
    out = self._read(step, items, dict(params=abstract_params, opt_state=abstract_opt_state))
    if data_iter is not None:
      self._restore_data_iter(step, data_iter, (meta.custom_metadata or {}).get('integrity'))
    return dict(out, stats=out.get('stats', {}))

  def restore(self, step: int | None = None, *, abstract_params: PyTree,
              abstract_opt_state: PyTree, data_iter: Any, fallback: bool = False
              ) -> dict[str, Any]:
    """Restores ``step`` (None = the newest), verified; ``abstract_*``: ShapeDtypeStructs (or
    arrays) with shardings; ``data_iter``: a Grain iterator set in place, or None.

    Returns dict ``step``, ``params``, ``opt_state``, ``stats``, ``config``, ``restore_info``.
    Raises FileNotFoundError (no such step), CheckpointMismatchError (another config), or
    CheckpointDamagedError (the step is damaged; with ``fallback``, every step is).
    """
    r, info = self.first_readable(step, lambda s: self._restore_step(
        s, abstract_params, abstract_opt_state, data_iter), fallback)
    return dict(r, restore_info=info)

  def latest_config(self) -> dict[str, Any]:
    """The verified config of the newest step (CheckpointDamagedError if it is damaged)."""
    return self.first_readable(None, lambda s: self._read(s, {}, {}), False)[0]['config']

  def restore_params_only(self, step: int, sharding: jax.sharding.Sharding | None = None,
                          expected: PyTree = None) -> tuple[PyTree, dict[str, Any], int]:
    """``(params, config, step)``, shapes from the stored metadata (which must fit
    ``expected`` if given), placed by ``sharding`` (None: the first local device)."""
    tree = getattr((self._manager.metadata(step).item_metadata or {}).get('params'), 'tree', None)
    if tree is None:
      raise _Damage(f'the params metadata of {self.step_dir(step)} is missing or unreadable')
    sharding = sharding or jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                            tree)
    r = self._read(step, dict(params=ocp.args.StandardRestore(abstract)),
                   {} if expected is None else dict(params=expected))
    return r['params'], r['config'], step

  def first_readable(self, step: int | None, read: Callable[[int], Any], fallback: bool = True
                     ) -> tuple[Any, RestoreInfo]:
    """``read(step)``, or for step None ``read`` of the newest step that is not damaged (with
    ``fallback``) and still exists: a step deleted (or superseded) while read is replaced by
    the new newest, never an older one."""
    info, tried = RestoreInfo(step=-1, requested=step), set()
    while left := [s for s in self._steps() if s not in tried and step in (None, s)]:
      s = left[-1]
      tried.add(s)
      try:
        return read(s), dataclasses.replace(info, step=s)
      except CheckpointMismatchError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        if not isinstance(_root(e), _READ_ERRORS):
          raise
        error = e
      steps = self._steps()
      if s not in steps or not self.step_dir(s).exists() or step is None and steps[-1] > s:
        logger.warning('Checkpoint %s was deleted or superseded while it was read (a running '
                       'training run keeps only its newest steps); reading the newest one.',
                       self.step_dir(s))
        info.vanished.append(s)
        continue
      reason = str(error) if isinstance(error, _Damage) else _describe(error)
      if step is not None or not fallback:
        older = [x for x in steps if x < s]
        raise CheckpointDamagedError(
            f'The {"latest " if step is None else ""}checkpoint {self.step_dir(s)} is damaged: '
            f'{reason}. Nothing was changed; it is left on disk. Move it aside (e.g. mv '
            f'{self.step_dir(s)} /tmp/) and re-run to resume from the previous checkpoint '
            f'(step {older[-1] if older else None}), or use a fresh --workdir.', [s]) from error
      logger.warning('Checkpoint %s is damaged (%s); falling back to the previous one. The '
                     'directory is left on disk for inspection.', self.step_dir(s), reason)
      info.fell_back_from.append(dict(step=s, directory=str(self.step_dir(s)), reason=reason))
    if info.fell_back_from:
      raise CheckpointDamagedError('No readable checkpoint: ' + '; '.join(
          f"{d['directory']} ({d['reason']})" for d in info.fell_back_from) + '. Move these '
          'directories aside, or use a fresh --workdir.', [d['step'] for d in info.fell_back_from])
    what = 'no checkpoint' if step is None else f'no checkpoint of step {step}'
    raise FileNotFoundError(f'{what} under {self.directory} (available steps: '
                            f'{self.all_steps()}); run train.py first.')

  def _steps(self) -> list[int]:
    """The steps on disk; a reader lists them again (a running trainer writes here)."""
    if self._read_only:
      self._manager.reload()
    return self.all_steps()

  def reached_preemption(self, step: int) -> bool:
    """Whether every host reached JAX's preemption sync point (multi-host SIGTERM)."""
    return self._manager.reached_preemption(step)

  def wait_until_finished(self) -> None:
    self._manager.wait_until_finished()

  def __enter__(self) -> Checkpointer:
    return self

  def close(self) -> None:
    """Waits for pending saves and closes, also after a failed save (whose error it raises)."""
    try:
      self._manager.wait_until_finished()
    finally:
      self._manager.close()

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      self.close()
    except Exception as e:  # pylint: disable=broad-except
      if exc is None:
        raise
      # The error that stopped the run (often the same full disk) stays the one reported.
      logger.warning('The checkpoint save in progress failed too: %s', _describe(e))


def restore_params(workdir_or_ckpt_dir: str | os.PathLike[str], step: int | None = None,
                   sharding: Any = None) -> tuple[PyTree, dict[str, Any], int]:
  """``(params, config, step)`` of a workdir (or its ``checkpoints/``), without the model;
  see `restore_params_with_info`."""
  params, config, info = restore_params_with_info(workdir_or_ckpt_dir, step, sharding)
  return params, config, info.step


def restore_params_with_info(workdir_or_ckpt_dir: str | os.PathLike[str],
                             step: int | None = None, sharding: Any = None,
                             expected: PyTree = None
                             ) -> tuple[PyTree, dict[str, Any], RestoreInfo]:
  """``(params, config, RestoreInfo)`` read by a reader (writes nothing): with step None the
  newest readable step, a damaged one skipped with a warning; ``sharding``: one Sharding or a
  tree (None: first device); ``expected``: the run's params tree (else CheckpointMismatchError).
  """
  path = _absolute(workdir_or_ckpt_dir)
  path = checkpoint_dir(path) if checkpoint_dir(path).is_dir() else path
  if not path.is_dir():
    raise FileNotFoundError(f'no checkpoint under {path}; run train.py first (with --workdir '
                            'pointing here).')
  with Checkpointer(path, max_to_keep=1, read_only=True) as ckpt:
    (params, config, _), info = ckpt.first_readable(
        step, lambda s: ckpt.restore_params_only(s, sharding, expected))
    return params, config, info
