"""Reading a position table `[rows, features]` trained elsewhere
(`position_init='file:..'`): `[file:]PATH.npy`, `[file:]PATH.npz[:KEY]`,
`[file:]PATH.safetensors[:KEY]` (KEY: if several)."""

import functools
import os
import re

import numpy as np

FILE_PREFIX = 'file:'
# Non-greedy, so that in 'a.npz:b.npy' the file is 'a.npz' and the key 'b.npy'.
_SPEC_RE = re.compile(r'^(.*?(?:\.npy|\.npz|\.safetensors))(?::(.*))?$')


class TableError(ValueError):
  """A table spec that cannot be loaded; the message names the file and the
  fix."""


def is_file_spec(name: str) -> bool:
  """Whether an initializer name is a `file:PATH[:KEY]` table spec."""
  return isinstance(name, str) and name.startswith(FILE_PREFIX)


def load_table(spec: str) -> np.ndarray:
  """The 2-D float table named by `spec`, read-only (cached per file
  identity)."""
  m = _SPEC_RE.match(spec.removeprefix(FILE_PREFIX))
  if m is None or (m.group(1).endswith('.npy') and m.group(2)):
    raise TableError(
        f'Table spec {spec!r}: expected PATH.npy (a .npy file takes no :KEY), '
        'PATH.npz[:KEY] or PATH.safetensors[:KEY] '
        '(e.g. file:gpt2.safetensors:wpe.weight).'
    )
  path, key = m.group(1), m.group(2) or None
  if not os.path.isfile(path):
    raise TableError(
        f'Table file not found: {path!r} (from {spec!r}; relative paths are '
        f'relative to the working directory {os.getcwd()!r}).'
    )
  st = os.stat(path)
  return _load(os.path.realpath(path), key, st.st_mtime_ns, st.st_size, spec)


@functools.lru_cache(maxsize=4)
def _load(
    path: str, key: str | None, mtime_ns: int, size: int, spec: str
) -> np.ndarray:
  del mtime_ns, size  # Cache key only: a rewritten file is read again.
  try:
    if path.endswith('.npy'):
      table = np.load(path, allow_pickle=False)
    elif path.endswith('.npz'):
      with np.load(path, allow_pickle=False) as z:
        table = z[_pick_key(spec, key, z.files)]
    else:
      from safetensors import safe_open

      with safe_open(path, framework='numpy') as f:
        table = f.get_tensor(_pick_key(spec, key, list(f.keys())))
  except Exception as e:  # a foreign file: its reader's words
    raise (
        e
        if isinstance(e, TableError)
        else TableError(f'Cannot read table {spec!r}: {type(e).__name__}: {e}')
    ) from None
  table = np.asarray(table)
  if problem := _content_problem(table):
    raise TableError(f'Table {spec!r} {problem}.')
  table.flags.writeable = False
  return table


def _content_problem(table: np.ndarray) -> str | None:
  if table.ndim != 2:
    return f'must be 2-D [rows, features], got shape {table.shape}'
  if (
      not np.issubdtype(table.dtype, np.floating)
      and table.dtype.name != 'bfloat16'
  ):
    return f'must hold floating-point values, got {table.dtype}'
  bad = np.size(table) - np.count_nonzero(np.isfinite(table.astype(np.float32)))
  return f'has {bad} non-finite (NaN/inf) values' if bad else None


def _pick_key(spec: str, key: str | None, keys: list[str]) -> str:
  if key is None and len(keys) == 1:
    return keys[0]
  if key not in keys:
    raise TableError(
        f'Table file {spec!r} '
        + (
            f'has no key {key!r}'
            if key
            else f'holds {len(keys)} arrays; name one as PATH:KEY'
        )
        + f'. Available keys: {", ".join(sorted(keys)) or "(none)"}.'
    )
  return key
