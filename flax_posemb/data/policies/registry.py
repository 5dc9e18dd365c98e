"""The position policy registry and what a policy is (docs/data.md, "Adding a
position policy").

A position policy decides how documents become training rows, and so how
often each position is trained. Each is one class, `Policy`'s subclass,
registered under its `name` with `register`; `DataConfig` looks
`data.position_policy` up here to check the policy's own fields, the training
pipeline to build its rows, the data report for its exposure model and batch
diversity, the experiments' budget for its phases.

`DataConfig` imports this module, so it does not import the data config
back: the methods' ``data`` is a `flax_posemb.data.config.DataConfig`.
"""

from collections.abc import Callable
import dataclasses
from typing import Any, ClassVar, TypeVar

import grain
import numpy as np

from flax_posemb.data import rows as rows_lib
from flax_posemb.data.policies import exposure as exposure_lib

# (batch ``[b, T]``, length) -> the batch of a schedule's short phase.
BatchTransform = Callable[[dict[str, np.ndarray], int], dict[str, Any]]


@dataclasses.dataclass(frozen=True)
class ShortPhase:
  """The first steps of a schedule, whose batches are transformed."""

  # ``transform(batch, length)`` on each batch of the phase.
  transform: BatchTransform
  # The phase's row or piece length.
  length: int
  # Share of num_train_steps in the phase.
  fraction: float


class Policy:
  """One position policy: its fields' checks, its rows, its exposure model.

  A subclass sets `name` and implements `rows`; the other methods have the
  defaults of a policy of one document per row. Policies hold no state: the
  registry keeps one instance of each.
  """

  # The value of data.position_policy that selects it.
  name: ClassVar[str]

  def check(self, data: Any) -> None:
    """Checks the policy's own fields of ``data`` (a DataConfig).

    Called by `DataConfig.__post_init__` after the fields every policy uses.

    Raises:
      ValueError: naming the field (``data.x``) and the fix.
    """
    del data

  def rows(self, data: Any, setup: rows_lib.RowSetup) -> grain.IterDataset:
    """The training rows, each a dict of ``[T]`` arrays (`rows_lib.KEYS` and
    `rows_lib.DOC_IDS`), in training order; the pipeline batches them.

    The dataset must restore exactly from Grain's ``get_state`` and depend
    only on ``data`` and ``setup`` (the same rows for the same seed).
    """
    raise NotImplementedError(f'{type(self).__name__}.rows')

  def recuts_stream(self, data: Any) -> bool:
    """Whether its rows can be cut, in order, from any share of the document
    stream (`RowSetup.substream`): data.shared_stream needs it."""
    del data
    return False

  def short_phase(self, data: Any) -> ShortPhase | None:
    """The batches' short phase, if the policy has one (None: no phase)."""
    del data
    return None

  def budget_phases(self, data: Any) -> tuple[tuple[float, dict], ...]:
    """Phases whose rows score different numbers of tokens.

    Returns:
      (share of the steps, data fields that give that phase's rows
      throughout) pairs; () when the configured rows are alike throughout.
    """
    del data
    return ()

  def position_count(self, data: Any, max_len: int) -> int:
    """How many positions the rows use: position ids are below it."""
    del max_len
    return data.seq_len

  def exposure(
      self, data: Any, corpus: exposure_lib.CorpusLengths
  ) -> exposure_lib.Exposure:
    """The analytic exposure of one epoch of ``corpus`` (``max_len =
    seq_len``), for the data report's table of policies."""
    raise NotImplementedError(f'{type(self).__name__}.exposure')

  def rows_per_document(self, data: Any, pairs: np.ndarray) -> np.ndarray:
    """``[k]`` rows of an epoch a document of ``pairs`` ``[k]`` pairs fills
    (the report's batch diversity of rows drawn at random)."""
    del data
    return (pairs > 0).astype(np.float64)


_POLICIES: dict[str, Policy] = {}
PolicyClass = TypeVar('PolicyClass', bound=type[Policy])


def register(cls: PolicyClass) -> PolicyClass:
  """Registers a policy class under its ``name`` (usable as a decorator).

  Args:
    cls: a `Policy` subclass with a `name` not registered yet.

  Returns:
    ``cls``.

  Raises:
    ValueError: when the name is taken.
  """
  if cls.name in _POLICIES:
    raise ValueError(
        f'A position policy named {cls.name!r} is registered already'
        f' ({type(_POLICIES[cls.name]).__name__}); choose another name.'
    )
  _POLICIES[cls.name] = cls()
  return cls


def get(name: str) -> Policy:
  """The registered policy ``name`` (KeyError naming the choices)."""
  if name not in _POLICIES:
    raise KeyError(f'No position policy {name!r}; registered: {names()}.')
  return _POLICIES[name]


def names() -> tuple[str, ...]:
  """The registered policies' names, sorted."""
  return tuple(sorted(_POLICIES))
