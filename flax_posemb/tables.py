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
  """Whether an initializer name is a `file:PATH[:KEY]` table spec.

  Args:
    name: an initializer name (`model.position_init`); a non-string is none.

  Returns:
    True if `name` is a string starting with the `FILE_PREFIX`.
  """
  return isinstance(name, str) and name.startswith(FILE_PREFIX)


def load_table(spec: str) -> np.ndarray:
  """Reads the position table a spec names.

  Cached per file identity (path, modification time and size), so a
  rewritten file is read again.

  Args:
    spec: `[file:]PATH.npy`, `[file:]PATH.npz[:KEY]` or
      `[file:]PATH.safetensors[:KEY]`; KEY is needed when the file holds
      several arrays (e.g. `file:gpt2.safetensors:wpe.weight`).

  Returns:
    The table, `[rows, features]` of a floating dtype, read-only.

  Raises:
    TableError: a malformed spec, a missing or unreadable file, a missing or
      ambiguous key, or a table that is not 2-D, not floating-point or not
      finite; the message names the file and the fix.
  """
  m = _SPEC_RE.match(spec.removeprefix(FILE_PREFIX))
  if m is None or (m.group(1).endswith('.npy') and m.group(2)):
    raise TableError(
        f'Table spec {spec!r}: expected PATH.npy (a .npy file takes no :KEY), '
        'PATH.npz[:KEY] or PATH.safetensors[:KEY] '
        '(e.g. file:gpt2.safetensors:wpe.weight).'
    )
  path = m.group(1)
  key = m.group(2) or None
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
    table = np.asarray(_read_array(path, key, spec))
  except TableError:
    raise
  except Exception as e:  # A foreign file: its reader's words.
    raise TableError(
        f'Cannot read table {spec!r}: {type(e).__name__}: {e}'
    ) from None
  _check_content(table, spec)
  table.flags.writeable = False
  return table


def _read_array(path: str, key: str | None, spec: str) -> np.ndarray:
  if path.endswith('.npy'):
    return np.load(path, allow_pickle=False)
  if path.endswith('.npz'):
    with np.load(path, allow_pickle=False) as z:
      return z[_pick_key(spec, key, z.files)]
  # Here, not at the top: the model (initializers -> tables) must import on
  # the accelerator image, which has no safetensors (benchmarks/accel.sh,
  # tests/test_benchmarks.py); only a .safetensors table needs it.
  import safetensors

  with safetensors.safe_open(path, framework='numpy') as f:
    return f.get_tensor(_pick_key(spec, key, list(f.keys())))


def _check_content(table: np.ndarray, spec: str) -> None:
  if table.ndim != 2:
    raise TableError(
        f'Table {spec!r} must be 2-D [rows, features], got shape'
        f' {table.shape}.'
    )
  floating = np.issubdtype(table.dtype, np.floating)
  if not floating and table.dtype.name != 'bfloat16':
    raise TableError(
        f'Table {spec!r} must hold floating-point values, got {table.dtype}.'
    )
  finite = np.count_nonzero(np.isfinite(table.astype(np.float32)))
  bad = np.size(table) - finite
  if bad:
    raise TableError(f'Table {spec!r} has {bad} non-finite (NaN/inf) values.')


def _pick_key(spec: str, key: str | None, keys: list[str]) -> str:
  if key is None and len(keys) == 1:
    return keys[0]
  if key is not None and key in keys:
    return key
  if key:
    problem = f'has no key {key!r}'
  else:
    problem = f'holds {len(keys)} arrays; name one as PATH:KEY'
  available = ', '.join(sorted(keys)) or '(none)'
  raise TableError(
      f'Table file {spec!r} {problem}. Available keys: {available}.'
  )
