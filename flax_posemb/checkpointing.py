"""Orbax checkpoints of a run, verified on restore (docs/DESIGN.md, "Training
outputs")."""

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

from flax_posemb import trees

logger = logging.getLogger(__name__)
# Root causes of a failed read of damaged files; any other (out of memory)
# propagates as it is.
_READ_ERRORS = (OSError, ValueError, KeyError, TypeError, AttributeError)


class CheckpointMismatchError(trees.TreeMismatchError):
  """The checkpoint is readable but was written for another config."""


class CheckpointDamagedError(ValueError):
  """A checkpoint is missing files, truncated, garbled, fails its digests or
  holds NaN/inf."""


@dataclasses.dataclass
class RestoreInfo:
  """The step read, and the newer ones skipped: damaged or deleted while read
  (DESIGN.md)."""

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
  """Per leaf: all finite, and two exact sums of its 32-bit words (independent
  of sharding)."""
  out = []
  for x in leaves:
    x = (
        jax.random.key_data(x)
        if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key)
        else x
    )
    finite = (
        jnp.isfinite(x).all() if jnp.issubdtype(x.dtype, jnp.inexact) else True
    )
    x = x.astype(jnp.uint8) if x.dtype == jnp.bool_ else x
    # 8 bytes: 2 words
    word = {1: jnp.uint8, 2: jnp.uint16}.get(x.dtype.itemsize, jnp.uint32)
    u = jax.lax.bitcast_convert_type(x, word).astype(jnp.uint32).ravel()
    i = jnp.arange(u.size, dtype=jnp.uint32)
    m = u + i * jnp.uint32(0x9E3779B9)
    m = (m ^ (m >> 16)) * jnp.uint32(0x85EBCA6B)
    m = (m ^ (m >> 13)) * jnp.uint32(0xC2B2AE35)
    out.append(
        (
            finite,
            (u * (2 * i + 1)).sum(dtype=jnp.uint32),
            (m ^ (m >> 16)).sum(dtype=jnp.uint32),
        )
    )
  return out


def _blake(value: Any) -> str:
  data = (
      value
      if isinstance(value, bytes)
      else json.dumps(value, sort_keys=True).encode()
  )
  return hashlib.blake2b(data, digest_size=16).hexdigest()


def _digests(item: str, tree: Any) -> tuple[dict[str, str], list[str]]:
  """``({path: digest}, non-finite paths)``: jax arrays on their devices, host
  arrays BLAKE2b."""
  if item in ('config', 'data_iter'):
    return {item: _blake(tree)}, []
  flat = {
      f'{item}/{jax.tree_util.keystr(p, simple=True, separator="/")}': x
      for p, x in jax.tree_util.tree_leaves_with_path(tree)
  }
  dev = [p for p, x in flat.items() if isinstance(x, jax.Array)]
  sums = jax.device_get(_device_digests([flat[p] for p in dev]))
  out = {
      p: (ok, f'{int(a):08x}{int(b):08x}') for p, (ok, a, b) in zip(dev, sums)
  }
  for p in flat.keys() - out.keys():  # Host arrays (stats: int64, exact).
    x = np.ascontiguousarray(flat[p])
    out[p] = (
        not np.issubdtype(x.dtype, np.inexact) or np.isfinite(x).all(),
        _blake(f'{x.dtype.str}{x.shape}'.encode() + x.tobytes()),
    )
  return {p: d for p, (_, d) in out.items()}, sorted(
      p for p, (ok, _) in out.items() if not ok
  )


class Checkpointer:
  """The checkpoints of one run (all hosts make the same calls); ``read_only``:
  a reader."""

  def __init__(
      self,
      directory: str | os.PathLike[str],
      *,
      max_to_keep: int,
      async_save: bool = True,
      read_only: bool = False,
  ):
    self.directory, self._read_only = (
        epath.Path(os.path.abspath(directory)),
        read_only,
    )
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
    handlers = {
        k: ocp.StandardCheckpointHandler()
        for k in ('params', 'opt_state', 'stats')
    }
    handlers.update(
        config=ocp.JsonCheckpointHandler(),
        data_iter=grain.checkpoint.CheckpointHandler(),
    )
    self._manager = ocp.CheckpointManager(
        self.directory, options=options, item_handlers=handlers
    )
    self.latest_step = self._manager.latest_step
    self.reached_preemption = self._manager.reached_preemption
    self.wait_until_finished = self._manager.wait_until_finished
    # Waits for pending saves (raising a failed one's error).
    self.close = self._manager.close

  def all_steps(self) -> list[int]:
    if self._read_only:
      # A running trainer writes (and deletes) steps here.
      self._manager.reload()
    return sorted(self._manager.all_steps())

  def step_metadata(self, step: int) -> dict[str, Any]:
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
      metrics: dict[str, float] | None = None,
  ) -> bool:
    """Saves the state after ``step`` updates (asynchronously); False if the
    step exists."""
    config = config.to_dict() if hasattr(config, 'to_dict') else dict(config)
    items = dict(
        params=params,
        opt_state=opt_state,
        stats=jax.tree.map(np.asarray, jax.device_get(dict(stats or {}))),
    )
    # On the device, before Orbax's copy: the caller donates these buffers next.
    digests = {k: _digests(k, v) for k, v in items.items()}
    # README: exit 3
    if bad := [p for _, nonfinite in digests.values() for p in nonfinite]:
      raise FloatingPointError(
          f'Non-finite {", ".join(bad[:3])} after step {step}: not saved; '
          f'the last good checkpoint is step {self.latest_step()}.'
      )
    integrity = dict(
        {k: d for k, (d, _) in digests.items()}, config=_blake(config)
    )
    # ENOSPC here, not from each Orbax writer thread.
    self._manager.wait_until_finished()
    # an upper bound
    need = sum(getattr(x, 'nbytes', 0) for x in jax.tree.leaves(items))
    if need > (free := shutil.disk_usage(self.directory).free):
      raise OSError(
          errno.ENOSPC,
          f'No space left on device for the checkpoint of step {step}: it needs'
          f' up to {need / 1e6:.1f} MB and {self.directory} has'
          f' {free / 1e6:.1f} MB free; free some space and re-run: it resumes'
          ' from the last checkpoint.',
      )
    args = {
        k: ocp.args.StandardSave(v)
        for k, v in items.items()
        if k != 'stats' or v
    }
    args['config'] = ocp.args.JsonSave(config)
    if data_iter is not None:
      args['data_iter'] = grain.checkpoint.CheckpointSave(data_iter)
      # Hosts' states differ; the step's metadata is host 0's.
      if jax.process_count() == 1:
        integrity['data_iter'] = _blake(data_iter.get_state())
    custom = dict(
        integrity=integrity,
        metrics={k: float(v) for k, v in (metrics or {}).items()},
    )
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

  def _read(
      self,
      step: int,
      abstract: dict[str, Any],
      data_iter: Any = None,
      expected: dict[str, Any] | None = None,
  ) -> dict[str, Any]:
    """A step's items, verified (``abstract``: trees with shardings, or a
    Sharding: as stored)."""
    meta, where = self._manager.metadata(step), self.directory / str(step)
    saved, integrity = meta.item_handlers or {}, (
        meta.custom_metadata or {}
    ).get('integrity', {})
    # No metadata file read.
    if not integrity and meta.commit_timestamp_nsecs is None:
      raise CheckpointDamagedError(
          f'{where}/_CHECKPOINT_METADATA is missing or garbled: the '
          'checksums written at save time are unknown'
      )
    if data_iter is not None and 'data_iter' not in saved:
      raise CheckpointMismatchError(
          f'{where} was saved without a data iterator: a run cannot '
          'resume its data order from it; use a fresh --workdir.'
      )
    for item, want in abstract.items():
      if (
          stored := getattr((meta.item_metadata or {}).get(item), 'tree', None)
      ) is None:
        raise CheckpointDamagedError(
            f'the {item} metadata of {where} is missing or unreadable'
        )
      if isinstance(want, jax.sharding.Sharding):  # As stored, placed there.
        abstract = {
            **abstract,
            item: jax.tree.map(
                lambda x, s=want: jax.ShapeDtypeStruct(
                    x.shape, x.dtype, sharding=s
                ),
                stored,
            ),
        }
      trees.check_same_tree(
          item,
          stored,
          (expected or abstract)[item],
          f'{where} was written by another model',
          'Use a fresh --workdir or the config that wrote '
          'it (eval: another --step).',
          error=CheckpointMismatchError,
      )
    args = {k: ocp.args.StandardRestore(v) for k, v in abstract.items()}
    if 'opt_state' in args and 'stats' in saved:
      args['stats'] = ocp.args.StandardRestore()
    if data_iter is not None:
      args['data_iter'] = grain.checkpoint.CheckpointRestore(data_iter)
    out = dict(
        self._manager.restore(
            step, args=ocp.args.Composite(config=ocp.args.JsonRestore(), **args)
        ),
        step=step,
    )
    out['stats'] = jax.tree.map(np.asarray, dict(out.get('stats') or {}))
    out['data_iter'] = data_iter and data_iter.get_state()
    # The one integrity check: finite, and as saved.
    for item in {*args, 'config'}:
      digests, bad = _digests(item, out[item])
      if bad:
        raise CheckpointDamagedError(
            f'non-finite values in {", ".join(bad[:5])}'
        )
      # None stored: saved before digests, or several hosts.
      want = integrity.get(item, digests)
      want = want if isinstance(want, dict) else {item: want}
      if wrong := sorted(
          p for p in {*want, *digests} if want.get(p) != digests.get(p)
      ):
        raise CheckpointDamagedError(
            f'{", ".join(wrong[:5])} fail their checksum of save time'
        )
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
        abstract=dict(params=abstract_params, opt_state=abstract_opt_state),
    )

  def latest_config(self) -> dict[str, Any]:
    """The verified config of the newest step (CheckpointDamagedError if it is
    damaged)."""
    return self.first_readable(None, False, abstract={})['config']

  def first_readable(
      self, step: int | None, fallback: bool, **read: Any
  ) -> dict[str, Any]:
    """`_read` of ``step`` or the newest readable one, ``restore_info``
    (DESIGN.md, Recovery)."""
    info, tried = RestoreInfo(step=-1, requested=step), set()
    while left := [
        s for s in self.all_steps() if s not in tried and step in (None, s)
    ]:
      tried.add(s := left[-1])
      try:
        return dict(
            self._read(s, **read),
            restore_info=dataclasses.replace(info, step=s),
        )
      except Exception as e:
        error, root = e, e
        while root.__cause__ is not None:  # Orbax wraps TensorStore's reason
          root = root.__cause__
        if isinstance(e, CheckpointMismatchError) or not isinstance(
            root, _READ_ERRORS
        ):
          raise
        kind = (
            ''
            if isinstance(root, CheckpointDamagedError)
            else f'{type(root).__name__}: '
        )
        reason = kind + (str(root).strip().splitlines() or [''])[0][:300]
      steps, where = self.all_steps(), self.directory / str(s)
      older = [x for x in steps if x < s]
      if (
          not where.exists()
          or step is None
          and any(x > s and x not in tried for x in steps)
      ):
        logger.warning(
            'Checkpoint %s deleted or superseded while read; reading the'
            ' newest.',
            where,
        )
        info.vanished.append(s)
      elif step is not None or not fallback or not older:
        raise CheckpointDamagedError(
            f'The {"latest " * (step is None)}checkpoint {where} is damaged:'
            f' {reason}. Nothing was changed. Move it aside (mv {where} /tmp/)'
            ' and re-run to resume from the previous checkpoint (step'
            f' {(older or [None])[-1]}), or use a fresh --workdir.'
        ) from error
      else:
        logger.warning(
            'Checkpoint %s is damaged (%s); reading the previous one.',
            where,
            reason,
        )
        info.fell_back_from.append(
            dict(step=s, directory=str(where), reason=reason)
        )
    raise FileNotFoundError(
        f'no checkpoint {"" if step is None else f"of step {step} "}under '
        f'{self.directory} (available steps: {self.all_steps()}); run '
        'train.py first.'
    )

  def __enter__(self) -> Self:
    return self

  def __exit__(self, exc_type, exc, tb) -> None:
    # After an error, that one (often the same full disk) stays the one
    # reported.
    with (
        contextlib.suppress(Exception)
        if exc is not None
        else contextlib.nullcontext()
    ):
      self.close()


def restore_params(
    workdir_or_ckpt_dir: str | os.PathLike[str],
    step: int | None = None,
    sharding: jax.sharding.Sharding | None = None,
    expected: Any = None,
) -> tuple[Any, dict[str, Any], RestoreInfo]:
  """``(params, config, RestoreInfo)`` of a workdir or its ``checkpoints/``,
  read-only."""
  path = checkpoint_dir(workdir_or_ckpt_dir)
  sharding = sharding or jax.sharding.SingleDeviceSharding(
      jax.local_devices()[0]
  )
  with Checkpointer(
      path if path.is_dir() else path.parent, max_to_keep=1, read_only=True
  ) as c:
    r = c.first_readable(
        step,
        True,
        abstract=dict(params=sharding),
        expected=None if expected is None else dict(params=expected),
    )
  return r['params'], r['config'], r['restore_info']
