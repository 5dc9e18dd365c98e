"""Orbax checkpoints of a training run: save, restore, and params-only restore.

The only module of the project that talks to Orbax. It keeps what Orbax does not do itself:
a path-naming check that the stored tree fits the model (Orbax's own message names neither
the path nor the fix), refusing to save non-finite state, falling back past a damaged latest
step, and restoring params without knowing the model. Orbax already writes step directories
atomically (temporary directories are never listed), refuses to overwrite a step (``save``
returns False), lists the items of a step (``item_metadata``) and signals multi-host
preemption (``reached_preemption``).

Integrity: at save time every leaf of ``params`` and ``opt_state`` gets a 64-bit digest of its
bytes, computed on the device by one jitted pass (two position-weighted sums mod 2**32, one
of a murmur-mixed word; any change confined to one 32-bit word always changes the first), and
``stats``, ``config`` and the data-iterator state get a BLAKE2b digest on the host. The
digests go into the step's Orbax metadata (``custom_metadata['integrity']``, written with the
step, so a step never exists without them). Restore recomputes them on the restored values
(independent of the sharding, exact integer arithmetic) and checks finiteness; a mismatch or
NaN/inf is ``CheckpointDamagedError``. Orbax/TensorStore keep a crc32c only for OCDBT tree
nodes and the zarr3 shard index, not for the array bytes (a flipped data byte is read back
silently), hence this digest. A step whose metadata file is missing or garbled is damaged
(its digests are unknown); only a step whose intact metadata has no digests (written before
they existed) is restored with finiteness checked only.

Failures are classified: ``CheckpointMismatchError`` (a ``CallerError``/``ValueError``) when
the files are readable but were written for another config (shapes, tree, data pipeline);
``CheckpointDamagedError`` (a ``RuntimeError``) when files are missing, truncated, garbled,
fail their digest or hold non-finite values. A step deleted while it is being read (a
running trainer with a small ``max_to_keep``) is neither: the newest step is read instead.

On-disk layout::

  WORKDIR/checkpoints/STEP/     e.g. 0/, 100/ (no zero padding)
    params/ opt_state/          Orbax PyTrees (OCDBT)
    data_iter/                  Grain iterator state, one JSON per process (optional)
    stats/                      PyTree of numpy arrays: the statistics window and the host
                                counters (int64 kept exact; optional)
    config/metadata             JSON: the resolved config

Typical use::

  ckpt = Checkpointer(checkpoint_dir(workdir), max_to_keep=3)
  r = ckpt.restore(abstract_params=params, abstract_opt_state=opt_state, data_iter=it)
  ckpt.save(step, params=..., opt_state=..., data_iter=it, stats=..., config=...)
  params, config, step = restore_params(workdir)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple, TypeVar

import grain
import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax import lax
from etils import epath

from flax_posemb import trees

logger = logging.getLogger(__name__)

CHECKPOINT_SUBDIR = 'checkpoints'  # WORKDIR/checkpoints holds the step directories.
ITEMS = ('params', 'opt_state', 'data_iter', 'stats', 'config')

PyTree = Any
_T = TypeVar('_T')


class CallerError(ValueError):
  """A problem with the caller's arguments, not with the files on disk."""


class CheckpointMismatchError(CallerError, trees.TreeMismatchError):
  """The checkpoint is readable but was written for another config: the stored
  params/opt_state tree or shapes differ, or the data pipeline state does not fit."""


class CheckpointDamagedError(RuntimeError):
  """Files of a checkpoint are missing, truncated or garbled, fail their digest, or hold
  NaN/inf. ``steps`` lists the damaged steps (their directories are left on disk)."""

  def __init__(self, message: str, steps: Sequence[int] = ()):
    super().__init__(message)
    self.steps = list(steps)


class _Damage(Exception):
  """Internal: a readable step whose values fail the digest or finiteness check."""


class _Step(NamedTuple):
  """Internal: one read of a step's Orbax metadata: its save-time digests (None only for a
  step provably saved before digests existed), the stored trees of params and opt_state, and
  the items written (a missing item directory is then damage, not an absent item)."""
  integrity: dict[str, Any] | None
  trees: dict[str, PyTree]
  items: list[str]


@dataclasses.dataclass
class RestoreInfo:
  """Which step a restore actually read, and why it is not the one asked for.

  Attributes:
    step: the step restored.
    requested: the step asked for (None = the latest).
    fell_back_from: damaged newer steps skipped, ``{'step', 'directory', 'reason'}`` each.
    vanished: steps deleted while they were read (a running trainer replaced them); the
      newest step at the time was read instead.
  """
  step: int
  requested: int | None
  fell_back_from: list[dict[str, Any]] = dataclasses.field(default_factory=list)
  vanished: list[int] = dataclasses.field(default_factory=list)

  def to_json(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


DIGEST_VERSION = 1  # custom_metadata['integrity']['version']
MAX_VANISHED_RETRIES = 5  # steps deleted under a reader before it gives up


def _absolute(path: str | os.PathLike[str]) -> epath.Path:
  """Orbax needs absolute paths: a local relative path (`runs/tiny`) is resolved here."""
  if '://' in str(path):  # gs://, s3:// ... are absolute already.
    return epath.Path(path)
  return epath.Path(os.path.abspath(os.fspath(path)))


def checkpoint_dir(workdir: str | os.PathLike[str]) -> epath.Path:
  """Returns `WORKDIR/checkpoints`, the directory a `Checkpointer` manages."""
  return _absolute(workdir) / CHECKPOINT_SUBDIR


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


def _path(name: str, p) -> str:
  return f'{name}/{jax.tree_util.keystr(p, simple=True, separator="/")}'


def _mix32(x: jax.Array) -> jax.Array:
  """murmur3's 32-bit finalizer (uint32 in, uint32 out)."""
  x = x ^ (x >> 16)
  x = x * jnp.uint32(0x85EBCA6B)
  x = x ^ (x >> 13)
  x = x * jnp.uint32(0xC2B2AE35)
  return x ^ (x >> 16)


def _words(x: jax.Array) -> jax.Array:
  """The bytes of ``x`` as a flat uint32 vector (one word per element of <= 4 bytes)."""
  if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
    x = jax.random.key_data(x)
  if x.dtype == jnp.bool_:
    return x.astype(jnp.uint32).reshape(-1)
  size = jnp.dtype(x.dtype).itemsize
  if size >= 4:  # 8-byte types bitcast to [..., 2] words
    return lax.bitcast_convert_type(x, jnp.uint32).reshape(-1)
  return lax.bitcast_convert_type(x, {1: jnp.uint8, 2: jnp.uint16}[size]).astype(
      jnp.uint32).reshape(-1)


@jax.jit
def _inspect_leaves(leaves: list[jax.Array]) -> tuple[jax.Array, jax.Array]:
  """([n] bool all-finite, [n, 2] uint32 digest) of each leaf; integer sums mod 2**32 are
  exact, so the digest does not depend on the sharding or the reduction order."""
  finite, digest = [], []
  for x in leaves:
    finite.append(jnp.all(jnp.isfinite(x)) if jnp.issubdtype(x.dtype, jnp.inexact)
                  else jnp.bool_(True))
    u = _words(x)
    i = jnp.arange(u.size, dtype=jnp.uint32)
    a = jnp.sum(u * (i * jnp.uint32(2) + jnp.uint32(1)), dtype=jnp.uint32)  # odd weights
    b = jnp.sum(_mix32(u + i * jnp.uint32(0x9E3779B9)), dtype=jnp.uint32)
    digest.append(jnp.stack([a, b]))
  if not leaves:
    return jnp.zeros((0,), bool), jnp.zeros((0, 2), jnp.uint32)
  return jnp.stack(finite), jnp.stack(digest)


def _inspect_arrays(name: str, tree: PyTree) -> tuple[list[str], dict[str, str]]:
  """(paths of non-finite leaves, {path: digest hex}) of a PyTree of jax/numpy arrays,
  computed on the device; only the small results are copied to the host."""
  flat = jax.tree_util.tree_leaves_with_path(tree)
  if not flat:
    return [], {}
  finite, digest = jax.device_get(_inspect_leaves([jnp.asarray(x) for _, x in flat]))
  paths = [_path(name, p) for p, _ in flat]
  return ([p for p, ok in zip(paths, finite) if not ok],
          {p: f'{int(d[0]):08x}{int(d[1]):08x}' for p, d in zip(paths, digest)})


def _blake(data: bytes) -> str:
  return hashlib.blake2b(data, digest_size=16).hexdigest()


def _inspect_host(name: str, tree: PyTree) -> tuple[list[str], dict[str, str]]:
  """As `_inspect_arrays` for host numpy trees (stats: int64 kept exact), with BLAKE2b."""
  bad, digests = [], {}
  for p, x in jax.tree_util.tree_leaves_with_path(tree):
    a = np.ascontiguousarray(x)
    if np.issubdtype(a.dtype, np.inexact) and not np.all(np.isfinite(a)):
      bad.append(_path(name, p))
    digests[_path(name, p)] = _blake(f'{a.dtype.str}{a.shape}'.encode() + a.tobytes())
  return bad, digests


def _json_digest(value: Any) -> str:
  if isinstance(value, bytes):
    return _blake(value)
  return _blake(json.dumps(value, sort_keys=True).encode())


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


class _TolerantLoop(asyncio.SelectorEventLoop):
  """An event loop that lets abandoned TensorStore reads finish before it closes.

  Orbax reads in a fresh loop (``asyncio_utils.run_sync``) closed when the read ends; when one
  read of a damaged or vanishing step fails, ``asyncio.gather`` returns while sibling reads
  are in flight, and each, completing later, prints "Event loop is closed" (and "Exception
  ignored in <coroutine ...>"; 42 and 23 for one eval of a truncated tiny checkpoint). Our
  calls cannot wait for reads Orbax abandons; this loop does, only while a step is read.
  """

  DRAIN_TIMEOUT_S = 60.0

  def close(self):
    pending = [t for t in asyncio.all_tasks(self) if not t.done()]
    if pending and not self.is_closed() and not self.is_running():
      self.run_until_complete(asyncio.wait(pending, timeout=self.DRAIN_TIMEOUT_S))
      for t in pending:
        if t.done() and not t.cancelled():
          t.exception()  # retrieved: no "exception was never retrieved" noise
    super().close()

  def call_exception_handler(self, context):
    # Abandoned reads that failed too: their errors belong to the read that already failed.
    if 'exception was never retrieved' not in str(context.get('message', '')):
      super().call_exception_handler(context)


class _TolerantPolicy(asyncio.DefaultEventLoopPolicy):
  def new_event_loop(self):
    return _TolerantLoop()


@contextlib.contextmanager
def _tolerant_event_loops():
  """New event loops created meanwhile (Orbax's restore loops) are `_TolerantLoop`s."""
  old = asyncio.get_event_loop_policy()
  if type(old) is not asyncio.DefaultEventLoopPolicy:
    yield  # nested, or a custom policy (uvloop...) that we leave alone
    return
  asyncio.set_event_loop_policy(_TolerantPolicy())
  try:
    yield
  finally:
    asyncio.set_event_loop_policy(old)


def _not_damage(e: BaseException) -> bool:
  """Failures that say nothing about the files: out of memory, interrupted, a device error.
  They propagate as they are instead of being reported as a damaged checkpoint."""
  text = str(e)
  return (isinstance(e, (MemoryError, KeyboardInterrupt))
          or 'RESOURCE_EXHAUSTED' in text or 'Out of memory' in text
          or type(e).__name__ in ('XlaRuntimeError', 'JaxRuntimeError'))


def _describe(e: BaseException) -> str:
  """One line of the root cause: Orbax wraps TensorStore's reason (which names the file)
  in an exception whose own text is a repr of the array's spec."""
  while e.__cause__ is not None:
    e = e.__cause__
  msg = str(e).strip().splitlines()
  return f'{type(e).__name__}: {msg[0] if msg else ""}'[:300]


class Checkpointer:
  """Saves and restores the full training state of one run (all hosts make the same calls).

  Items per step: ``params`` and ``opt_state`` (PyTrees of jax.Arrays, any sharding),
  ``data_iter`` (a Grain iterator, optional), ``stats`` (dict of numpy arrays, optional) and
  ``config`` (JSON dict); the step's Orbax metadata holds their digests (``integrity``) and
  the ``metrics`` passed to ``save``.
  """

  def __init__(self, directory: str | os.PathLike[str], *, max_to_keep: int,
               async_save: bool = True, read_only: bool = False):
    """Opens (creating unless ``read_only``) a checkpoint directory.

    Args:
      directory: the checkpoints directory, usually ``checkpoint_dir(workdir)``.
      max_to_keep: most recent steps kept (>= 1); step 0 (the initial table) is kept too.
      async_save: write in a background thread after the device-to-host copy.
      read_only: never write or delete.
    """
    if not isinstance(max_to_keep, int) or max_to_keep < 1:
      raise ValueError(f'max_to_keep must be an int >= 1, got {max_to_keep!r}. '
                       'Set --config.max_to_keep to a positive number.')
    self.directory = _absolute(directory)
    self._read_only = read_only
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

  def reload(self) -> None:
    """Re-lists the steps on disk when opened ``read_only`` (a running trainer writes here and
    may delete a step while Orbax lists it); a writer's own list is authoritative."""
    for attempt in range(MAX_VANISHED_RETRIES + 1) if self._read_only else ():
      try:
        return self._manager.reload()
      except (FileNotFoundError, NotADirectoryError):
        if attempt == MAX_VANISHED_RETRIES:
          raise

  def step_dir(self, step: int) -> epath.Path:
    """Directory of one step's checkpoint."""
    return self.directory / str(int(step))

  def step_metadata(self, step: int) -> dict[str, Any]:
    """The ``custom_metadata`` of a step: ``integrity`` digests and ``metrics`` (may be {})."""
    return dict(self._manager.metadata(int(step)).custom_metadata or {})

  def save(self, step: int, *, params: PyTree, opt_state: PyTree, data_iter: Any,
           stats: Mapping[str, Any] | None, config: Any,
           metrics: Mapping[str, float] | None = None) -> bool:
    """Saves the state after ``step`` updates (asynchronously if opened so).

    Args:
      step: optimizer steps done; 0 is the initial state.
      params: model params (PyTree of jax.Arrays).
      opt_state: optax state.
      data_iter: Grain iterator positioned at the next batch, or None (not stored).
      stats: dict (possibly nested) of numpy arrays / Python ints; no zero-size arrays;
        empty or None is not stored (restored as {}).
      config: ConfigDict or JSON-serializable dict.
      metrics: optional scalars stored with the step (``step_metadata``), e.g. the training
        row of the logging window ending at ``step`` (a resume writes it again if lost).

    Returns:
      True if a checkpoint was written (or started); False if the state held non-finite
      values or the step already exists (a warning says which).
    """
    step, stats = int(step), _stats_to_numpy(stats)
    # Digests and finiteness on the device, before Orbax's copy: the caller may donate
    # these buffers as soon as save returns; only the small results come to the host.
    bad_p, dig_p = _inspect_arrays('params', params)
    bad_o, dig_o = _inspect_arrays('opt_state', opt_state)
    bad_s, dig_s = _inspect_host('stats', stats)
    bad = bad_p + bad_o + bad_s
    if bad:
      logger.warning('Not saving the checkpoint of step %d: non-finite values in %s%s. The '
                     'last good checkpoint (step %s) is left as it is.', step,
                     ', '.join(bad[:5]), ' ...' if len(bad) > 5 else '', self.latest_step())
      return False
    self._check_space(step, params, opt_state, stats)
    metrics = {k: float(v) for k, v in (metrics or {}).items()}
    config = _config_to_dict(config)
    integrity = dict(version=DIGEST_VERSION, params=dig_p, opt_state=dig_o, stats=dig_s,
                     config=_json_digest(config))
    items = dict(params=ocp.args.StandardSave(params),
                 opt_state=ocp.args.StandardSave(opt_state),
                 config=ocp.args.JsonSave(config))
    if stats:  # Orbax refuses an empty tree.
      items['stats'] = ocp.args.StandardSave(stats)
    if data_iter is not None:
      items['data_iter'] = grain.checkpoint.CheckpointSave(data_iter)
      if jax.process_count() == 1:  # Step metadata is the primary host's; states differ per host.
        integrity['data_iter'] = _json_digest(data_iter.get_state())
    custom = dict(integrity=integrity)
    if metrics:
      custom['metrics'] = metrics
    saved = self._manager.save(step, args=ocp.args.Composite(**items), custom_metadata=custom)
    if not saved:
      logger.warning('A checkpoint of step %d already exists at %s (or is older than the '
                     'latest); it is not overwritten.', step, self.step_dir(step))
    return bool(saved)

  def _check_space(self, step: int, *trees: PyTree) -> None:
    """ENOSPC, in the caller's thread, for a save that cannot fit on a local disk: started, it
    fails in Orbax's writer threads, whose sibling writes each print a traceback."""
    if '://' in str(self.directory):
      return
    # Uncompressed (global) sizes: Orbax's zstd only shrinks them.
    need = sum(getattr(x, 'nbytes', 0) for t in trees for x in jax.tree.leaves(t))
    self._manager.wait_until_finished()  # Orbax waits anyway: the previous save is on disk.
    free = shutil.disk_usage(self.directory).free
    if need > free:
      raise OSError(errno.ENOSPC, f'No space left on device for the checkpoint of step {step}: '
                    f'it needs up to {need / 1e6:.1f} MB and {self.directory} has '
                    f'{free / 1e6:.1f} MB free. Free some space and re-run the same command: it '
                    'resumes from the last checkpoint.')

  def _read_step(self, step: int) -> _Step:
    """What one read of a step's metadata says (`_Step`). A missing or garbled metadata file
    is damage: without the digests the bytes cannot be verified."""
    m = self._manager.metadata(int(step))
    integrity = (m.custom_metadata or {}).get('integrity')
    if integrity is None and m.commit_timestamp_nsecs is None:  # Orbax read no file
      raise _Damage(f'{self.step_dir(step) / "_CHECKPOINT_METADATA"} is missing or garbled, '
                    'so the checksums written at save time cannot be checked')
    trees = {k: getattr(v, 'tree', v) for k, v in (m.item_metadata or {}).items()
             if k in ('params', 'opt_state') and v is not None}
    return _Step(integrity, trees, sorted(m.item_handlers or {}))

  def _verify(self, item: str, restored: PyTree, stored: PyTree | None,
              integrity: Mapping[str, Any] | None) -> None:
    """Raises _Damage if ``restored`` holds NaN/inf or differs from its save-time digest
    (``integrity`` None: saved before digests existed). Leaves restored in another dtype
    than stored (a caller's cast) skip the digest."""
    if item == 'config':
      if integrity is not None and _json_digest(restored) != integrity.get('config'):
        raise _Damage('config fails the checksum written at save time')
      return
    if item == 'stats':
      bad, got = _inspect_host(item, restored)
    else:
      bad, got = _inspect_arrays(item, restored)
    if bad:
      raise _Damage(f'non-finite values in {", ".join(bad[:5])}')
    if integrity is None:
      return
    want = integrity.get(item)
    if want is None:
      raise _Damage(f'the step metadata has no checksum of {item}')
    dtypes = {}
    if stored is not None:
      dtypes = {_path(item, p): np.dtype(x.dtype)
                for p, x in jax.tree_util.tree_leaves_with_path(stored) if hasattr(x, 'dtype')}
    kinds = {_path(item, p): np.dtype(x.dtype)
             for p, x in jax.tree_util.tree_leaves_with_path(restored)}
    cast = {p for p in kinds if p in dtypes and dtypes[p] != kinds[p]}
    wrong = [p for p in sorted(set(want) | set(got))
             if p not in cast and want.get(p) != got.get(p)]
    if wrong:
      raise _Damage(f'{", ".join(wrong[:5])} fail{"s" if len(wrong) == 1 else ""} the '
                    'checksum written at save time (the bytes on disk changed)')

  def _restore_data_iter(self, step: int, data_iter: Any,
                         integrity: Mapping[str, Any] | None):
    """Restores the Grain state; a garbled file is damage, a state that does not fit this
    pipeline (verified bytes) is CheckpointMismatchError."""
    path = (self.step_dir(step) / 'data_iter' /
            f'process_{jax.process_index()}-of-{jax.process_count()}.json')
    text = path.read_text()  # OSError: damage
    want = (integrity or {}).get('data_iter')  # absent when saved by several hosts
    if want:
      try:
        got = _json_digest(json.loads(text))
      except ValueError:
        got = None
      if got != want and _json_digest(text.encode()) != want:
        raise _Damage(f'{path} fails the checksum written at save time')
    try:
      self._manager.restore(step, args=ocp.args.Composite(
          data_iter=grain.checkpoint.CheckpointRestore(data_iter)))
    except Exception as e:  # pylint: disable=broad-except
      if not want:
        raise  # unverified bytes: damage
      raise CheckpointMismatchError(
          f'The data iterator state in {path} does not fit the data pipeline of this config '
          f'({_describe(e)}). Resume with the data settings the run was started with, or '
          'use a fresh --workdir.') from e

  def _restore_step(self, step: int, abstract_params: PyTree, abstract_opt_state: PyTree,
                    data_iter: Any) -> dict[str, Any]:
    meta = self._read_step(step)
    for item, want in (('params', abstract_params), ('opt_state', abstract_opt_state)):
      if item not in meta.trees:
        raise FileNotFoundError(f'item {item!r} is missing or unreadable in '
                                f'{self.step_dir(step)}')
      trees.check_same_tree(item, meta.trees[item], want, f'The checkpoint at {self.step_dir(step)} '
                      'was written by a different model', 'Use a fresh --workdir (or the config '
                      'that wrote this checkpoint).', error=CheckpointMismatchError)
    if data_iter is not None and 'data_iter' not in meta.items:
      raise CallerError(f'{self.step_dir(step)} was saved without a data iterator, so a run '
                        'cannot resume its data order from it; use a fresh --workdir (in code: '
                        'restore with data_iter=None).')
    items = dict(params=ocp.args.StandardRestore(_abstract(abstract_params)),
                 opt_state=ocp.args.StandardRestore(_abstract(abstract_opt_state)))
    if 'stats' in meta.items:
      items['stats'] = ocp.args.StandardRestore()
    r = dict(self._restore_verified(step, items, meta), step=step)
    if data_iter is not None:
      self._restore_data_iter(step, data_iter, meta.integrity)
    return dict(r, stats=r.get('stats', {}))

  def _restore_verified(self, step: int, items: dict[str, Any], meta: _Step) -> dict[str, Any]:
    """``items`` (restore args by name) and the config of one step, each verified against
    its save-time digest and for finiteness (`_Damage` otherwise)."""
    r = self._manager.restore(step, args=ocp.args.Composite(
        config=ocp.args.JsonRestore(), **items))
    out = {k: r[k] for k in items} | {'config': dict(r['config'] or {})}
    if 'stats' in out:
      out['stats'] = jax.tree.map(np.asarray, dict(out['stats'] or {}))
    for item, value in out.items():
      self._verify(item, value, meta.trees.get(item), meta.integrity)
    return out

  def restore(self, step: int | None = None, *, abstract_params: PyTree,
              abstract_opt_state: PyTree, data_iter: Any, fallback: bool = True
              ) -> dict[str, Any]:
    """Restores a step (the latest readable one by default), verifying its digests and
    finiteness.

    Args:
      step: step to restore; None = the latest, falling back to earlier steps (with a
        warning naming each damaged directory, which is left on disk).
      abstract_params: PyTree of ``jax.ShapeDtypeStruct`` (or arrays) with ``.sharding``;
        the restored params take these shapes, dtypes and shardings (any mesh).
      abstract_opt_state: the same for the optax state.
      data_iter: Grain iterator whose state is set in place, or None.
      fallback: with step None, whether to fall back past a damaged latest step; False
        raises CheckpointDamagedError naming it (what a resuming trainer wants: it must
        not silently continue from an older step).

    Returns:
      dict ``step``, ``params``, ``opt_state``, ``stats`` (dict of numpy arrays), ``config``,
      ``restore_info`` (`RestoreInfo`: the damaged steps skipped).

    Raises:
      FileNotFoundError: no checkpoint (or not the requested step).
      CheckpointMismatchError: the checkpoint was written for another config (model
        shapes, data pipeline); never counted as damage, never fallen back from.
      CheckpointDamagedError: the requested step (or, with step None, every step; or the
        latest with fallback=False) is damaged.
    """
    r, info = self._first_readable(step, lambda s: self._restore_step(
        s, abstract_params, abstract_opt_state, data_iter), fallback=fallback)
    r['restore_info'] = info
    return r

  def _first_readable(self, step: int | None, fn: Callable[[int], _T], *,
                      fallback: bool = True) -> tuple[_T, RestoreInfo]:
    """``fn(step)``, or for step None ``fn`` of the newest step it can read.

    ``CallerError`` (incl. CheckpointMismatchError) propagates. Any other failure of a
    step that still exists and is still the newest is damage: for step None (and
    ``fallback``) a warning names the directory (left on disk) and the previous step is
    tried; otherwise CheckpointDamagedError. A step deleted or superseded while it was read
    (a running trainer) is not damage: the newest is read instead (MAX_VANISHED_RETRIES).
    """
    self.reload()
    steps = self.all_steps()
    if not steps:
      raise FileNotFoundError(f'no checkpoint under {self.directory}; run train.py first.')
    if step is not None and int(step) not in steps:
      raise FileNotFoundError(f'no checkpoint of step {step} under {self.directory}; '
                              f'available steps: {steps}.')
    requested = None if step is None else int(step)
    damaged: list[dict[str, Any]] = []
    vanished: list[int] = []
    tried: set[int] = set()
    while True:
      if requested is not None:
        s = requested
      else:
        left = [x for x in steps if x not in tried]
        if not left:
          break
        s = left[-1]
      tried.add(s)
      try:
        with _tolerant_event_loops():  # the step's metadata reads too, not only its restore
          out = fn(s)
      except CallerError:
        raise
      except Exception as e:  # pylint: disable=broad-except
        if _not_damage(e):
          raise
        self.reload()
        steps = self.all_steps()
        gone = s not in steps or not self.step_dir(s).exists()
        if gone or (requested is None and any(x > s for x in steps if x not in tried)):
          vanished.append(s)
          self._vanished(s, requested, vanished, steps, e)
        else:
          damaged.append(self._damaged(s, requested, fallback, steps, e))
        continue
      info = RestoreInfo(step=s, requested=requested, fell_back_from=damaged,
                         vanished=vanished)
      return out, info
    raise CheckpointDamagedError(
        'No readable checkpoint: ' + '; '.join(f"{d['directory']} ({d['reason']})"
                                               for d in damaged)
        + '. Inspect or move these directories, or use a fresh --workdir.',
        [d['step'] for d in damaged])

  def _vanished(self, s: int, requested: int | None, vanished: list[int], steps: list[int],
                e: Exception) -> None:
    """A step deleted or superseded while read (a trainer keeping its newest steps): read
    the newest instead, unless that step was asked for or it keeps happening."""
    if requested is not None:
      raise FileNotFoundError(
          f'the checkpoint of step {s} in {self.directory} was deleted while it was read (a '
          f'training run keeping only its newest steps writes there); available steps now: '
          f'{steps}.') from e
    if len(vanished) > MAX_VANISHED_RETRIES:
      raise CheckpointDamagedError(
          f'The newest checkpoint under {self.directory} was deleted while it was read '
          f'{len(vanished)} times (steps {vanished}); a training run is replacing it faster '
          'than it can be read. Retry, or raise --config.max_to_keep.', vanished) from e
    logger.warning('Checkpoint %s was deleted or superseded while it was read (a running '
                   'training run keeps only its newest steps); reading the newest one '
                   'instead.', self.step_dir(s))

  def _damaged(self, s: int, requested: int | None, fallback: bool, steps: list[int],
               e: Exception) -> dict[str, Any]:
    """The record of a damaged step when falling back past it is allowed; else the error."""
    reason = str(e) if isinstance(e, _Damage) else _describe(e)
    if requested is not None:
      raise CheckpointDamagedError(
          f'The checkpoint {self.step_dir(s)} is damaged: {reason}. It is left on disk; '
          f'restore another step (available: {steps}), move it aside, or use a fresh '
          '--workdir.', [s]) from e
    older = [x for x in steps if x < s]
    if not fallback:
      raise CheckpointDamagedError(
          f'The latest checkpoint {self.step_dir(s)} is damaged: {reason}. Nothing was '
          f'changed. Move it aside (e.g. mv {self.step_dir(s)} /tmp/) and re-run to '
          + (f'resume from the previous checkpoint (step {older[-1]}), ' if older else '')
          + 'or use a fresh --workdir.', [s]) from e
    if older:
      logger.warning('Checkpoint %s is damaged (%s); falling back to the previous '
                     'checkpoint. The damaged directory is left on disk for inspection.',
                     self.step_dir(s), reason)
    return dict(step=s, directory=str(self.step_dir(s)), reason=reason)

  def latest_config(self) -> dict[str, Any]:
    """The config stored with the latest step, digest verified; a damaged latest step is
    CheckpointDamagedError, as for ``restore(fallback=False)``."""
    return self._first_readable(None, lambda s: self._restore_verified(
        s, {}, self._read_step(s))['config'], fallback=False)[0]

  def restore_params_only(self, step: int, sharding: Any = None, expected: PyTree = None
                          ) -> tuple[PyTree, dict[str, Any], int]:
    """``(params, config, step)`` of one step, shapes and dtypes from the stored metadata
    (which must fit ``expected``, the run's params tree, if given); digests and finiteness
    verified (`_Damage` otherwise)."""
    meta = self._read_step(step)
    tree = meta.trees.get('params')
    if tree is None:
      raise FileNotFoundError(f'item params is missing in {self.step_dir(step)}')
    if expected is not None:
      trees.check_same_tree('params', tree, expected, f'The checkpoint at {self.step_dir(step)} was '
                      "written by another model than this run's config.json", "Move it out of "
                      "the run's checkpoints/ or evaluate another --step.",
                            error=CheckpointMismatchError)
    r = self._restore_verified(
        step, dict(params=ocp.args.StandardRestore(_abstract(tree, sharding))), meta)
    return r['params'], r['config'], step

  def reached_preemption(self, step: int) -> bool:
    """Whether every host has reached JAX's preemption sync point (multi-host SIGTERM)."""
    return self._manager.reached_preemption(step)

  def wait_until_finished(self) -> None:
    """Blocks until pending asynchronous saves (and deletions) are done."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources, also after a failed
    save (its error, raised by the wait, leaves Orbax's threads running otherwise)."""
    try:
      self._manager.wait_until_finished()
    finally:
      self._manager.close()  # Orbax raises a save's error once per thread: this one closes.

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    try:
      self.close()
    except Exception as e:  # pylint: disable=broad-except
      if exc is None:
        raise
      # The error that stopped the run (often the same full disk) stays the one reported.
      logger.warning('The checkpoint save in progress failed too: %s', _describe(e))


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
    step: step to restore; None = the newest readable one: a damaged newest step is
      skipped with a warning naming it; a step deleted while it is read (a running
      trainer) is replaced by the new newest one, never by an older one.
    sharding: one ``jax.sharding.Sharding`` for every leaf, a PyTree of shardings matching
      params, or None for the first local device.

  Returns:
    ``(params, config, step)``: params as stored, the run's config dict and the step read.

  Raises:
    FileNotFoundError: no checkpoint, or the requested step is absent (or was deleted).
    CheckpointDamagedError: the requested step (or every step) is damaged.
  """
  params, config, info = restore_params_with_info(workdir_or_ckpt_dir, step, sharding)
  return params, config, info.step


def restore_params_with_info(workdir_or_ckpt_dir: str | os.PathLike[str],
                             step: int | None = None,
                             sharding: jax.sharding.Sharding | PyTree | None = None,
                             expected: PyTree = None,
                             ) -> tuple[PyTree, dict[str, Any], RestoreInfo]:
  """``restore_params`` returning ``(params, config, RestoreInfo)``: which step was read,
  the damaged newer steps skipped and the steps deleted under the reader. With
  ``expected`` (the run's params tree), a step of another model is CheckpointMismatchError."""
  with Checkpointer(_resolve_dir(workdir_or_ckpt_dir), max_to_keep=1, async_save=False,
                    read_only=True) as ckpt:
    (params, config, _), info = ckpt._first_readable(  # pylint: disable=protected-access
        step, lambda s: ckpt.restore_params_only(s, sharding, expected))
    return params, config, info
