"""The 1-D 'data' mesh, batch and parameter (fsdp) shardings, the host-to-device
boundary."""

from typing import Any

import jax
from jax.experimental import multihost_utils
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
import numpy as np

from flax_posemb import embeddings
from flax_posemb.batch import BATCH_KEYS

# Matrices with at least this many elements are sharded under fsdp.
FSDP_MIN_SIZE = 2**14
PyTree = Any


def make_mesh(devices: Any = None) -> Mesh:
  """1-D mesh with axis ``'data'`` over ``devices`` (default: all devices of all
  hosts)."""
  devices = jax.devices() if devices is None else list(devices)
  return Mesh(np.asarray(devices), ('data',))


def replicated(mesh: Mesh) -> NamedSharding:
  """The same full array on every device of `mesh`."""
  return NamedSharding(mesh, P())


def batch_sharding(mesh: Mesh) -> NamedSharding:
  """``[B, T]`` batch rows over ``'data'``."""
  return NamedSharding(mesh, P('data'))


def tree_shardings(tree: PyTree, mesh: Mesh, fsdp: bool) -> PyTree:
  """Per leaf of a tree of arrays / ShapeDtypeStructs: replicated, or under fsdp
  split along the largest axis divisible by the device count."""
  n = mesh.shape['data']

  def leaf(shape):
    axes = [
        a
        for a in sorted(range(len(shape)), key=lambda a: -shape[a])
        if shape[a] % n == 0
    ]
    if (
        fsdp
        and n > 1
        and len(shape) >= 2
        and int(np.prod(shape)) >= FSDP_MIN_SIZE
        and axes
    ):
      return NamedSharding(
          mesh,
          P(*('data' if a == axes[0] else None for a in range(len(shape)))),
      )
    return replicated(mesh)

  return jax.tree.map(lambda x: leaf(tuple(x.shape)), tree)


def check_batch_layout(config: Any, mesh: Mesh) -> None:
  """ValueError unless ``batch_size`` splits over microbatches, devices and
  processes."""
  rows = config.batch_size
  accum = config.grad_accum_steps
  devices = mesh.size
  processes = jax.process_count()
  if accum < 1 or rows < 1 or rows % (accum * devices) or rows % processes:
    raise ValueError(
        f'batch_size={rows} must be a positive multiple of grad_accum_steps *'
        f' device count = {accum} * {devices} (grad_accum_steps >= 1) and of'
        f' the process count {processes}: set --config.batch_size to a'
        f' multiple of {max(accum, 1) * devices}.'
    )


def global_batch(
    batch: dict[str, np.ndarray], mesh: Mesh, max_len: int | None = None
) -> dict[str, jax.Array]:
  """Global ``[B, T]`` arrays of this process's rows of ``BATCH_KEYS`` (the
  batch contract): the one host-to-device boundary, where position ids are
  checked against ``[0, max_len)``."""
  if max_len is not None:
    embeddings.check_position_range(np.asarray(batch['positions']), max_len)
  sh = batch_sharding(mesh)
  return {
      k: jax.make_array_from_process_local_data(sh, np.asarray(batch[k]))
      for k in BATCH_KEYS
  }


def to_host(x: jax.Array | np.ndarray) -> np.ndarray:
  """A numpy copy of ``x``; replicated arrays are read from one local shard,
  arrays spread over several hosts gathered."""
  if not isinstance(x, jax.Array):
    return np.asarray(x)
  if x.is_fully_replicated:
    return np.asarray(x.addressable_data(0))
  if x.is_fully_addressable:
    return np.asarray(jax.device_get(x))
  return np.asarray(multihost_utils.process_allgather(x, tiled=True))
