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
  got = _shapes(stored)
  want = _shapes(expected)
  for path in sorted(set(got) | set(want)):
    if got.get(path) != want.get(path):
      raise error(
          f'{problem}: {item}/{path} has shape {got.get(path, "absent")} in'
          f' {where} but {want.get(path, "absent")} in the model of the config.'
          f' {fix}'
      )


def _shapes(tree: PyTree) -> dict[str, tuple[int, ...]]:
  """'a/b/c' path -> shape of every leaf of ``tree``."""
  # String paths: stored metadata turns tuples into lists and dicts.
  return {
      jax.tree_util.keystr(path, simple=True, separator='/'): tuple(leaf.shape)
      for path, leaf in jax.tree_util.tree_leaves_with_path(tree)
  }
