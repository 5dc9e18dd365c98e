"""The one tree-shape comparison: checkpoint restore, evaluation, NNX
loading."""

from typing import Any

import jax

PyTree = Any


class TreeMismatchError(ValueError):
  """Two trees that should hold the same arrays differ in a path or a shape."""


def check_same_tree(
    item: str,
    stored: PyTree,
    expected: PyTree,
    problem: str,
    fix: str,
    *,
    where: str = 'the checkpoint',
    error: type[Exception] = TreeMismatchError,
) -> None:
  """Raises ``error``: ``problem``, the first path whose shape differs between
  ``stored`` (found in ``where``) and ``expected`` (or that only one has), then
  ``fix``."""
  # String paths: stored metadata turns tuples into lists and dicts.
  got, want = (
      {
          jax.tree_util.keystr(p, simple=True, separator='/'): tuple(x.shape)
          for p, x in jax.tree_util.tree_leaves_with_path(t)
      }
      for t in (stored, expected)
  )
  for path in sorted(set(got) | set(want)):
    if got.get(path) != want.get(path):
      raise error(
          f'{problem}: {item}/{path} has shape {got.get(path, "absent")} in'
          f' {where} but {want.get(path, "absent")} in the model of the config.'
          f' {fix}'
      )
