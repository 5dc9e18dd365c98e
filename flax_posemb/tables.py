"""Reading a position table `[rows, features]` that was not trained here.

One loader, `load_table(spec)`, serves both `model.position_init='file:SPEC'` (through
`initializers.resolve`) and `eval.py --analyze --table SPEC`, so both accept the same
files and fail with the same messages:

  * `table.npy`                        a 2-D array;
  * `tables.npz:KEY` (or `tables.npz`  when it holds exactly one array);
  * `model.safetensors:KEY`, e.g. `gpt2.safetensors:wpe.weight` (key optional when the
    file holds one tensor).

A leading `file:` is accepted and ignored. Relative paths are relative to the working
directory. Every bad input raises `TableError` (a `ValueError`) naming the file and the fix.
"""

from __future__ import annotations

import functools
import os
import re

import numpy as np

FILE_PREFIX = 'file:'
EXTENSIONS: tuple[str, ...] = ('.npy', '.npz', '.safetensors')
# Non-greedy, so that in 'a.npz:b.npy' the file is 'a.npz' and the key 'b.npy'.
_SPEC_RE = re.compile(r'^(.*?(?:\.npy|\.npz|\.safetensors))(?::(.*))?$')


class TableError(ValueError):
  """A table spec that cannot be loaded; the message names the file and the fix."""


def is_file_spec(name: str) -> bool:
  """Whether an initializer name is a `file:PATH[:KEY]` table spec."""
  return isinstance(name, str) and name.startswith(FILE_PREFIX)


def parse_spec(spec: str) -> tuple[str, str | None]:
  """Splits `[file:]PATH[:KEY]` into `(PATH, KEY or None)`.

  Raises:
    TableError: the path does not end in .npy, .npz or .safetensors, or a .npy has a key.
  """
  body = spec[len(FILE_PREFIX):] if is_file_spec(spec) else spec
  m = _SPEC_RE.match(body)
  if not body or m is None:
    raise TableError(f'Table spec {spec!r}: expected PATH.npy, PATH.npz[:KEY] or '
                     f'PATH.safetensors[:KEY] (e.g. file:gpt2.safetensors:wpe.weight).')
  path, key = m.group(1), m.group(2)
  if key == '':
    key = None
  if path.endswith('.npy') and key is not None:
    raise TableError(f'Table spec {spec!r}: a .npy file holds one array and takes no '
                     f':KEY; use {FILE_PREFIX}{path}.')
  return path, key


def load_table(spec: str) -> np.ndarray:
  """Loads the 2-D table named by `spec` (see the module docstring).

  Args:
    spec: `[file:]PATH.npy`, `[file:]PATH.npz[:KEY]` or `[file:]PATH.safetensors[:KEY]`.

  Returns:
    The table `[rows, features]` in its stored dtype, read-only (it is cached: a
    `ModelConfig` validates it and the model initializes from it without re-reading).

  Raises:
    TableError: bad spec, missing file, missing key (the message lists the available
      keys), unreadable file, or an array that is not 2-D, not float, or not finite.
  """
  path, key = parse_spec(spec)
  if not os.path.isfile(path):
    raise TableError(f'Table file not found: {path!r} (from {spec!r}; relative paths are '
                     f'relative to the working directory {os.getcwd()!r}).')
  st = os.stat(path)
  # The file's identity is part of the cache key, so a rewritten file is read again.
  return _load(os.path.realpath(path), key, st.st_mtime_ns, st.st_size, spec)


@functools.lru_cache(maxsize=4)
def _load(path: str, key: str | None, mtime_ns: int, size: int, spec: str) -> np.ndarray:
  del mtime_ns, size  # Cache key only.
  try:
    if path.endswith('.npy'):
      table = np.load(path, allow_pickle=False)
    elif path.endswith('.npz'):
      with np.load(path, allow_pickle=False) as z:
        table = z[_pick_key(spec, path, key, z.files)]
    else:
      from safetensors import safe_open  # pylint: disable=g-import-not-at-top
      with safe_open(path, framework='numpy') as f:
        table = f.get_tensor(_pick_key(spec, path, key, list(f.keys())))
  except TableError:
    raise
  except Exception as e:  # A corrupt or foreign file: its reader's message, with the path.
    raise TableError(f'Cannot read table {spec!r}: {type(e).__name__}: {e}') from None
  table = np.asarray(table)
  if table.ndim != 2:
    raise TableError(f'Table {spec!r} must be 2-D [rows, features], got shape {table.shape}.')
  if not np.issubdtype(table.dtype, np.floating) and table.dtype.name != 'bfloat16':
    raise TableError(f'Table {spec!r} must hold floating-point values, got {table.dtype}.')
  bad = int(np.size(table) - np.count_nonzero(np.isfinite(np.asarray(table, np.float32))))
  if bad:
    raise TableError(f'Table {spec!r} has {bad} non-finite (NaN/inf) values.')
  table.flags.writeable = False
  return table


def _pick_key(spec: str, path: str, key: str | None, keys: list[str]) -> str:
  if key is None:
    if len(keys) == 1:
      return keys[0]
    raise TableError(f'Table file {spec!r} holds {len(keys)} arrays; name one as '
                     f'PATH:KEY. Available keys: {", ".join(sorted(keys)) or "(none)"}.')
  if key not in keys:
    raise TableError(f'Table file {path!r} has no key {key!r} (from {spec!r}). Available keys: '
                     f'{", ".join(sorted(keys)) or "(none)"}.')
  return key
